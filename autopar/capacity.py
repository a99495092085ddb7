"""`autopar.sweep` / `autopar sweep`: capacity planning. Which cluster type, how many nodes, how
long the training run takes and what it costs, from the best plan at every size (not a formula).

The model is captured once; every (cluster type, node count) is an `autopar.planner.plan` of
that graph, so each point is the plan `autopar plan` gives for that cluster and size. The
per-layer costs (the intra-op ILP's solutions) are shared across the sizes of one cluster type
(`planner.ProviderCache`): they depend on the device and the node, not on the node count.
(The module is not `autopar/sweep.py`: that name would shadow the function `autopar.sweep`.)

From each plan: step time, tokens/s, MFU (model FLOPs without recomputation over the devices'
peak), the steps and time to train the token budget, GPU-hours and, given a price per
GPU-hour, the cost. Points no plan fits keep the planner's reason. The time-vs-cost Pareto
frontier is marked; a deadline picks the cheapest point finishing in time.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from autopar.schema import ClusterSpec, Plan, PlanError
from autopar.schema.plan import TRAINING_DTYPES
from autopar.schema.software import software_for_cluster
from autopar.schema.sweep import SweepPoint, SweepResult, format_duration

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64)
# GPT-3 175B's 3.2M-token batch (Brown et al. 2020, Table 2.1) rounded to a power of two
DEFAULT_TOKENS_PER_STEP = 2**22
_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


# -- parsing what the command line gives --------------------------------------------------------

def parse_nodes(text: str) -> list[int]:
    """`1..64` (the powers of two from 1 to 64), `1,2,4,12` or both mixed (`1..8,12`): sorted,
    without repeats."""
    out: set[int] = set()
    for part in (x.strip() for x in str(text).split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*\.\.\s*(\d+)", part)
        try:
            if m:
                a, b = int(m.group(1)), int(m.group(2))
                if a < 1 or b < a:
                    raise ValueError
                pows = [1 << k for k in range(b.bit_length()) if a <= 1 << k <= b]
                if not pows:
                    raise PlanError(f"--nodes {part}: no power of two between {a} and {b}; list sizes "
                                    f"with commas instead (e.g. {a},{b})")
                out.update(pows)
            else:
                n = int(part)
                if n < 1:
                    raise ValueError
                out.add(n)
        except ValueError:
            raise PlanError(f"--nodes: {part!r} is not a node count; give A..B (the powers of two "
                            f"from A to B) or a list like 1,2,4") from None
    if not out:
        raise PlanError("--nodes is empty; give A..B or a list like 1,2,4")
    return sorted(out)


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90min`, `2w`, `3600s` -> seconds (a unit is required: a bare number is
    ambiguous)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]+)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise PlanError(f"--deadline {text!r}: give a positive duration with a unit, e.g. 30d, 12h, "
                        f"90min, 2w or 3600s")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_count(text: str, what: str) -> float:
    """`1e12`, `1T`, `300B`, `4M` -> a positive number."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmbt]?)\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"{what} {text!r}: give a positive number such as 1e12, 300B or 4M")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]


def parse_prices(text: Optional[str]) -> dict[str, float]:
    """`dgx-h100=2.5,dgx-a100-80g=1.8` -> {cluster: price per GPU-hour}."""
    out: dict[str, float] = {}
    for part in (x.strip() for x in (text or "").split(",")):
        if not part:
            continue
        name, eq, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not eq or not name.strip() or price < 0:
            raise PlanError(f"--price {part!r}: give CLUSTER=PRICE, your price per GPU-hour, for each "
                            f"priced cluster (comma-separated)")
        out[name.strip()] = price
    return out


# -- the sweep ----------------------------------------------------------------------------------

def sweep(model: Any, clusters: Sequence[str | ClusterSpec], nodes: Iterable[int] = DEFAULT_NODES, *,
          tokens: float, seq_len: Optional[int] = None, global_batch_size: Optional[int] = None,
          tokens_per_step: Optional[float] = None, prices: Optional[dict[str, float]] = None,
          deadline_s: Optional[float] = None, dtype: str = "bf16",
          example_inputs: Optional[Sequence[Any]] = None, cache: Any = None, intra_op: str = "auto",
          keep_plans: bool = True, share_providers: bool = True,
          progress: Optional[Callable[[str], None]] = None, software: Any = None) -> SweepResult:
    """The best plan of `model` on every cluster type of `clusters` (bundled names, YAML/JSON
    paths or ClusterSpecs) at every node count of `nodes`, and what training `tokens` tokens
    takes there (see the module docstring). The batch: `global_batch_size` samples, or
    `tokens_per_step` tokens (default 4Mi) over the model's sequence length; `seq_len` rebuilds
    a zoo model at another sequence length. `prices`: USD (or any currency) per GPU-hour by
    cluster name. `progress` receives a line per point. `share_providers=False` plans every
    point from scratch (what `benchmarks/sweep_time.py` compares with). `software`: what the
    training software does (`autopar.plan`'s; None: the default, what `autopar run` executes),
    the same for every point. Raises PlanError for bad input; a size no plan fits is a point
    with its `reason`."""
    from autopar import __version__
    from autopar.capture import capture
    from autopar.planner import ProviderCache, plan

    if dtype not in TRAINING_DTYPES:
        raise PlanError(f"dtype {dtype!r} is not supported; use bf16, fp16 or fp32")
    if not tokens or tokens <= 0:
        raise PlanError(f"the token budget must be positive, got {tokens!r}")
    if global_batch_size is not None and tokens_per_step is not None:
        raise PlanError("give the global batch size or the tokens per step, not both")
    sizes = sorted(set(int(n) for n in nodes))
    if not sizes or sizes[0] < 1:
        raise PlanError(f"node counts must be positive integers, got {list(nodes)!r}")
    if not clusters:
        raise PlanError("no cluster to sweep; give bundled names (see hardware_profiles/) or files")
    specs = [ClusterSpec.load(c) if isinstance(c, str) else c for c in clusters]   # bad names fail here
    if software is not None:
        from autopar.schema.software import resolve_software

        software = resolve_software(software)                                      # and here
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PlanError(f"cluster types repeat: {', '.join(names)}")
    prices = dict(prices or {})
    unknown = sorted(set(prices) - set(names))
    if unknown:
        raise PlanError(f"--price names {', '.join(unknown)}, not a swept cluster ({', '.join(names)})")
    say = progress or (lambda _msg: None)

    bundle = _bundle(model, example_inputs, seq_len)
    seq = _tokens_per_sample(bundle)
    gbs, notes = _batch(global_batch_size, tokens_per_step, seq)
    t0 = time.perf_counter()
    say(f"capturing {bundle.name} ...")
    graph = capture(bundle.model, bundle.example_inputs, name=bundle.name, cache=cache)
    say(f"captured in {time.perf_counter() - t0:.1f} s ({graph.capture_method})")
    providers = ProviderCache()
    points: list[SweepPoint] = []
    total = len(specs) * len(sizes)
    for spec in specs:
        # the software resolved on the cluster as loaded: a cluster file written before software
        # was apart from hardware keeps its attention kernel (`_sized` re-validates a dump,
        # which does not carry that deprecated setting)
        sw = software_for_cluster(software, spec)
        for n in sizes:
            t = time.perf_counter()
            p: Optional[Plan] = None
            try:
                sized = _sized(spec, n)          # a one-node profile cannot grow: that size's reason
                p = plan(bundle, sized, global_batch_size=gbs, dtype=dtype, graph=graph,
                         cache=cache, providers=providers if share_providers else None, intra_op=intra_op,
                         software=sw)
                reason = None
            except PlanError as e:
                reason = str(e)
            pt = point_of(p, spec, n, gbs, tokens, seq, prices.get(spec.name), reason,
                          time.perf_counter() - t, dtype)
            if not keep_plans:
                pt.plan = None
            points.append(pt)
            got = (f"{pt.iteration_time_s:.3g} s/step, {format_duration(pt.time_to_train_s)} to train"
                   if pt.iteration_time_s is not None else f"no plan: {pt.reason}")
            say(f"[{len(points)}/{total}] {spec.name} x {n} node{'s' if n > 1 else ''}: {got} "
                f"(searched in {pt.search_time_s:.1f} s)")
    res = SweepResult(autopar_version=__version__, model=bundle.name, dtype=dtype, tokens=tokens,
                      seq_len=seq, global_batch_size=gbs, deadline_s=deadline_s, notes=notes,
                      points=points)
    return select(res)


def point_of(p: Optional[Plan], spec: ClusterSpec, nodes: int, gbs: int, tokens: float, seq: int,
             price: Optional[float], reason: Optional[str], search_s: float, dtype: str) -> SweepPoint:
    """The sweep's record of cluster type `spec` at `nodes` nodes from its plan (None: `reason`
    says why there is none)."""
    devices = nodes * spec.devices_per_node
    base = dict(cluster=spec.name, nodes=nodes, devices=devices, device=spec.device.name,
                global_batch_size=gbs, price_per_gpu_hour=price, search_time_s=round(search_s, 3))
    if p is None:
        return SweepPoint(**base, reason=reason or "no plan")
    it = p.predicted.iteration_time_s
    steps = math.ceil(tokens / (gbs * seq))
    ttt = steps * it
    gpu_h = ttt * devices / 3600.0
    mfu = p.model.flops_per_sample * gbs / it / (devices * spec.device.peak(dtype))
    return SweepPoint(**base, layout=layout(p), iteration_time_s=it, tokens_per_s=gbs * seq / it, mfu=mfu,
                      tflops_per_device=p.predicted.tflops_per_device,
                      peak_memory_bytes=p.predicted.peak_memory_bytes, steps=steps, time_to_train_s=ttt,
                      gpu_hours=gpu_h, cost=None if price is None else gpu_h * price, plan=p)


def layout(p: Plan) -> str:
    """`dp8 tp8 pp4 mb1x64 1f1b full z1`: the plan in one short line."""
    tps = sorted({s.axis_size("tp") for s in p.stages})
    rcs = sorted({s.recompute for s in p.stages})
    sched = p.schedule + (f"(v{p.virtual_stages})" if p.virtual_stages > 1 else "")
    parts = [f"dp{p.dp}", "tp" + "/".join(map(str, tps)), f"pp{p.pp}",
             f"mb{p.microbatch_size}x{p.num_microbatches}", sched, "/".join(rcs)]
    if p.zero_stage:
        parts.append(f"z{p.zero_stage}")
    return " ".join(parts)


def select(res: SweepResult) -> SweepResult:
    """Mark the time-vs-cost Pareto frontier and the deadline's choice on `res` (in place, and
    returned). The cost axis is the cost where every feasible point has a price, else
    GPU-hours (said in `notes`)."""
    ok = [p for p in res.points if p.time_to_train_s is not None]
    priced = [p for p in ok if p.cost is not None]
    res.cost_axis = "cost" if ok and len(priced) == len(ok) else "gpu_hours"
    if priced and res.cost_axis == "gpu_hours":
        missing = sorted({p.cluster for p in ok if p.cost is None})
        res.notes.append(f"no price for {', '.join(missing)}: the frontier and the deadline compare "
                         f"GPU-hours, not cost")
    elif not priced and len({p.device for p in ok}) > 1:
        res.notes.append("GPU-hours of different devices are not the same cost: give prices per GPU-hour "
                         "(--price CLUSTER=PRICE) to compare the cluster types")
    axis = (lambda p: p.cost) if res.cost_axis == "cost" else (lambda p: p.gpu_hours)
    for p in res.points:
        p.pareto = p.chosen = False
    for p in pareto_front(ok, axis):
        p.pareto = True
    res.chosen = None
    if res.deadline_s is not None:
        best = choose(ok, res.deadline_s, axis)
        if best is not None:
            best.chosen = True
            res.chosen = best.key
        elif ok:
            fastest = min(ok, key=lambda p: p.time_to_train_s)
            res.notes.append(f"no point finishes within {format_duration(res.deadline_s)}; the fastest, "
                             f"{fastest.key}, takes {format_duration(fastest.time_to_train_s)}")
    return res


def pareto_front(points: Sequence[SweepPoint], cost: Callable[[SweepPoint], float]) -> list[SweepPoint]:
    """The points no other point dominates (at most as long and as costly, and less in one), in
    order of time."""
    out = []
    for p in points:
        if not any(q.time_to_train_s <= p.time_to_train_s and cost(q) <= cost(p)
                   and (q.time_to_train_s < p.time_to_train_s or cost(q) < cost(p)) for q in points):
            out.append(p)
    return sorted(out, key=lambda p: (p.time_to_train_s, cost(p)))


def choose(points: Sequence[SweepPoint], deadline_s: float,
           cost: Callable[[SweepPoint], float]) -> Optional[SweepPoint]:
    """The cheapest point finishing within `deadline_s` (the faster on a tie); None if none does."""
    ok = [p for p in points if p.time_to_train_s is not None and p.time_to_train_s <= deadline_s]
    return min(ok, key=lambda p: (cost(p), p.time_to_train_s), default=None)


# -- helpers ------------------------------------------------------------------------------------

def _sized(spec: ClusterSpec, n: int) -> ClusterSpec:
    """`spec` at `n` nodes, validated as `ClusterSpec.load(name, num_nodes=n)` makes it (a
    multi-node cluster needs an inter-node link)."""
    from pydantic import ValidationError

    from autopar.schema.cluster import validation_message

    try:
        return ClusterSpec.model_validate({**spec.model_dump(), "num_nodes": n})
    except ValidationError as e:
        raise PlanError(f"cluster {spec.name} at {n} nodes: {validation_message(e)}") from None


def _bundle(model: Any, example_inputs: Optional[Sequence[Any]], seq_len: Optional[int]):
    """The model bundle, rebuilt at `seq_len` for a zoo model (its configuration's sequence
    length; other references take their sequence from their example inputs)."""
    from autopar.planner import resolve_model

    if seq_len is None:
        return resolve_model(model, example_inputs, None)
    if seq_len < 1:
        raise PlanError(f"--seq-len must be positive, got {seq_len}")
    from autopar.models.catalogue import catalogue

    entry = catalogue().get(model) if isinstance(model, str) else None
    if entry is None or not hasattr(entry.config, "seq_len"):
        raise PlanError("--seq-len applies to zoo models of the gpt, llama and bert families; for "
                        "another model, give example inputs of the sequence length you want")
    import torch

    from autopar.models.registry import ModelBundle, zoo

    cfg = dataclasses.replace(entry.config, seq_len=seq_len)
    family = {"gpt": ("autopar.models.gpt", "GPT"), "llama": ("autopar.models.llama", "Llama"),
              "bert": ("autopar.models.bert", "Bert")}.get(entry.family)
    if family is None:
        raise PlanError(f"--seq-len does not apply to {model!r} ({entry.family} model)")
    import importlib

    cls = getattr(importlib.import_module(family[0]), family[1])
    with torch.device("meta"):
        m = cls(cfg)
    default = zoo()[model]
    inputs = tuple(torch.zeros((1, seq_len, *x.shape[2:]), dtype=x.dtype, device="meta")
                   for x in default.inputs(1))
    return ModelBundle(model, m, inputs, None, f"{entry.description}, sequence {seq_len}")


def _tokens_per_sample(bundle: Any) -> int:
    """Tokens per sample as the plan counts them (`planner._tokens_per_sample`: dim 1 of an
    integer first input, else 1)."""
    from autopar.planner import _tokens_per_sample as tps

    return tps(bundle)


def _batch(gbs: Optional[int], tokens_per_step: Optional[float], seq: int) -> tuple[int, list[str]]:
    """(global batch in samples, notes) from the batch or the tokens per step."""
    if gbs is not None:
        if not isinstance(gbs, int) or gbs < 1:
            raise PlanError(f"the global batch size must be a positive integer, got {gbs!r}")
        return gbs, []
    tps = DEFAULT_TOKENS_PER_STEP if tokens_per_step is None else tokens_per_step
    if tps < seq:
        raise PlanError(f"{tps:g} tokens per step is less than one sample of {seq} tokens")
    b = max(1, round(tps / seq))
    notes = [] if b * seq == tps else [f"{tps:g} tokens per step is not a whole number of {seq}-token "
                                       f"samples: the batch is {b} samples ({b * seq} tokens)"]
    return b, notes
