"""Collectives that DTensor will issue for a plan's tensor-parallel placements, counted by a dry run.

The runtime executes "tp" axes as DTensor placements and lets DTensor's sharding propagation
choose every op's layout (`autopar.runtime.spmd`); the collectives it runs follow from those
rules (for GPT-2's fused qkv with q, k, v as row blocks: an all-gather of its output before the
head split; lazily reduced partial sums, ...), which a Megatron-style count does not reproduce.
So the planner counts them the way the runtime will issue them: the model (or one pipeline stage
of it) is copied to the meta device, its parameters distributed with the stage's tp placements
over a fake process group of tp ranks (`torch.testing._internal.distributed.fake_pg`), and one
forward and backward run under `CommDebugMode`, which attributes each collective to the module
that issued it. Nothing is allocated or communicated. Layers identical to their predecessor
(same signature) are run once: the later copies pass their input through, and take the counts of
the first steady-state copy.

* `dtensor_tp_counts`: the whole model, as the runtime runs a plan without pipelining (the
  model's own loss inside the tp region).
* `dtensor_stage_counts`: one pipeline stage, as the runtime runs it (the chunk cut from the
  traced model, `runtime.graph_stages`, inside an `SPMDModule`): plain replicated inputs
  (requiring their gradient after the first stage), plain outputs and output gradients, except
  that the last chunk ends with its loss: a vocabulary-parallel head's logits are read in place
  by the vocabulary-parallel cross-entropy (`runtime.vocab_loss`: three all-reduces of one value
  per row, no all-gather). Stages of
  different tp degrees see exactly these boundaries, which a slice of the whole-model run at one
  tp degree does not reproduce (mlp-tiny, stages tp 1, 2, 1: the whole-model run at tp 2 counts
  {all_gather 2, reduce_scatter 1} for the middle layer; the stage alone runs {all_gather 1,
  all_reduce 1}).

Recomputation: with a stage's `recompute` mode the dry run wraps the repeated blocks as the
runtime does (`runtime.recompute`: non-reentrant `torch.utils.checkpoint` around the plan's
`recompute_modules`: blocks, or attention modules under "attention"; or the attention core
alone under "selective") and counts the
backward's re-run forward as it happens, instead of adding the block's forward collectives.
torch's checkpoint stops recomputing once every tensor the backward needs is back, so the
collectives after a region's last saved tensor are not re-run: for Megatron layouts the
all-reduce of the last row-parallel output (the MLP's for "full": the residual add after it saves
nothing; Megatron's reentrant recompute re-runs it, the runtime does not, so neither does the
prediction); "selective" re-runs the attention core alone (`runtime.selective`), which issues
none.

Counts are per micro-batch; DTensor chooses layouts by tensor size, so the dry run uses the
plan's micro-batch size. Skipped (returns None) when a
process group is already initialised in this process, or the model is not on the meta device
and too large to copy.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from autopar.inter_op.layers import Layer
from autopar.schema.errors import PlanError

_KINDS = (("all_reduce", "all_reduce"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
          ("all_to_all", "all_to_all"), ("broadcast", "broadcast"))


def _kind(op: Any) -> Optional[str]:
    s = str(op)
    for key, kind in _KINDS:
        if key in s:
            return kind
    return None


def _counter(d: dict) -> Counter:
    out: Counter = Counter()
    for op, n in (d or {}).items():
        k = _kind(op)
        if k:
            out[k] += int(n)
    return out


class LayerCounts:
    """Per layer (index): forward and backward collectives per micro-batch; `attn_fwd` the part
    of the forward issued inside its attention children; `step` what bringing its parameters'
    gradients to their parameters' layouts issues once per step (`spmd.grads_to_param_layout`,
    e.g. a reduce-scatter of a partial gradient of a sharded weight). `bwd` includes what recomputation
    re-runs when the dry run ran with `recompute` ("full" / "selective"); `block_fwd` and
    `attn_fwd` (Megatron's whole re-run forward) serve counts made without it."""

    def __init__(self, L: int, recompute: str = "none") -> None:
        self.recompute = recompute   # the recompute mode whose re-run forward `bwd` includes
        self.fwd = [Counter() for _ in range(L)]
        self.bwd = [Counter() for _ in range(L)]
        self.block_fwd = [Counter() for _ in range(L)]
        self.attn_fwd = [Counter() for _ in range(L)]
        self.step = [Counter() for _ in range(L)]   # once per step: gradients to their params' layout


def _working_copy(module: nn.Module, device: str, max_real_params: int) -> Optional[tuple[nn.Module, str]]:
    """(a copy of `module` to run the dry run on, its device), or None when `module` is real and
    too large to copy. DTensor's choices can depend on the kernels the device dispatches to (CPU
    attention takes another path than the meta one): on a CPU cluster a small model runs on
    (uninitialised) CPU tensors, else on meta."""
    params = list(module.parameters())
    on_meta = all(p.device.type == "meta" for p in params)
    small = sum(p.numel() for p in params) <= max_real_params
    if not on_meta and not small:
        return None
    m = copy.deepcopy(module)
    if device == "cpu" and small:
        return m.to_empty(device="cpu"), "cpu"
    return (m if on_meta else m.to("meta")), "meta"


def _pass_through_repeats(m: nn.Module, layers: list[Layer], lo: int, hi: int) -> Optional[dict[int, int]]:
    """Make the layers of [lo, hi) that repeat their two predecessors in the range pass their
    input through (in the copy `m`); returns {repeated layer: the layer whose counts it takes},
    or None when a layer's module is not found."""
    rep: dict[int, int] = {}
    for i in range(lo + 2, hi):
        l = layers[i]
        if l.signature == layers[i - 1].signature == layers[i - 2].signature and len(l.modules) == 1:
            rep[i] = rep.get(i - 1, i - 1)
    for i in rep:
        try:
            mod = m.get_submodule(layers[i].modules[0])
        except AttributeError:
            return None
        mod.forward = lambda x, *a, **k: x  # type: ignore[method-assign]
    return rep


def _apply_recompute(m: nn.Module, layers: list[Layer], lo: int, hi: int, rep: dict[int, int],
                     recompute: str) -> None:
    """Recompute in the copy `m` what the runtime recomputes for `recompute` in layers [lo, hi):
    the modules of `Layer.recompute_modules` checkpointed whole ("full", "attention"), under
    "selective" the attention core's call alone where it is one (`runtime.selective`), so the
    dry run's backward re-runs what the runtime's re-runs. Layers passing their input through
    (`rep`) take their source's counts and stay unwrapped."""
    if recompute == "none":
        return
    from autopar.runtime.recompute import checkpoint_module
    from autopar.runtime.selective import recompute_core_calls, runs_as_one_call

    for i in range(lo, hi):
        if i not in rep and recompute in layers[i].recompute_modules:
            mod = m.get_submodule(layers[i].recompute_modules[recompute])
            ops = layers[i].selective_ops
            if recompute == "selective" and ops and runs_as_one_call(ops):
                recompute_core_calls(mod, ops)
            else:
                checkpoint_module(mod)


def _batch_inputs(example_inputs: Sequence[Any], batch: Optional[int], dev: str) -> list[Any]:
    """Zero tensors shaped like `example_inputs` with dim 0 = `batch`, on `dev`."""
    out = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            shape = (batch, *x.shape[1:]) if batch and x.dim() > 0 else tuple(x.shape)
            out.append(torch.zeros(shape, dtype=x.dtype, device=dev))
        else:
            out.append(x)
    return out


def _count_comms(tp: int, build: Callable[[Any], tuple[Callable[[], Any], Callable[[], dict]]]) -> Optional[dict]:
    """Over a fake process group of `tp` ranks, `step, after = build(mesh)`: CommDebugMode's
    per-module counts of `step()` (a forward and backward) as "modules", and `after()`'s result
    (per-parameter counts, run outside that count) as "params"; None when anything fails (the
    caller falls back)."""
    import torch.distributed as dist

    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from autopar.runtime.spmd import allow_implicit_replication, register_extra_strategies
    except Exception:  # noqa: BLE001 - an optional refinement
        return None
    hook = sys.excepthook   # init_process_group prefixes every later traceback with "[rank0]:"
    try:
        dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (tp,))
            register_extra_strategies()
            allow_implicit_replication()
            step, after = build(mesh)
            cm = CommDebugMode()
            with cm, warnings.catch_warnings():
                warnings.simplefilter("ignore")   # a dry run: torch's hook warnings are not the user's
                step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                per_param = after()
            return {"modules": cm.comm_module_counts, "params": per_param}
        finally:
            dist.destroy_process_group()
            sys.excepthook = hook
    except Exception:  # noqa: BLE001 - fall back to the analytic counts
        return None


def _grad_layout_counts(module: nn.Module) -> dict[str, Counter]:
    """{parameter name: the collectives of bringing its gradient to its layout}, each counted
    alone, as the runtime's `spmd.grads_to_param_layout` runs them once per step."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    out: dict[str, Counter] = {}
    for name, p in module.named_parameters():
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            with CommDebugMode() as cm:
                g.redistribute(p.device_mesh, p.placements)
            out[name] = _counter(cm.get_comm_counts())
    return out


def _can_dry_run(tp: int) -> bool:
    import torch.distributed as dist

    return tp > 1 and dist.is_available() and not dist.is_initialized()


def dtensor_tp_counts(model: nn.Module, example_inputs: Sequence[Any], tp: int,
                      placements: dict[str, str], layers: list[Layer],
                      loss_fn: Optional[Callable[[Any], Any]] = None, batch: Optional[int] = None,
                      device: str = "meta", max_real_params: int = 50_000_000,
                      recompute: str = "none") -> Optional[LayerCounts]:
    """Per-layer collectives of one micro-batch of `batch` samples (DTensor picks layouts by
    size, so the plan's micro-batch size is used) under `placements` (FQN -> tp placement),
    the whole model run as one tp stage (a plan without pipelining), its repeated blocks
    recomputed as `recompute` says (the backward counts include the re-run forward)."""
    if not _can_dry_run(tp):
        return None
    work = _working_copy(model, device, max_real_params)
    if work is None:
        return None
    m, dev = work
    rep = _pass_through_repeats(m, layers, 0, len(layers))
    if rep is None:
        return None
    _apply_recompute(m, layers, 0, len(layers), rep, recompute)
    inputs = _batch_inputs(example_inputs, batch, dev)

    def build(mesh: Any) -> tuple[Callable[[], None], Callable[[], dict]]:
        from autopar.runtime.spmd import parallelize

        pm = parallelize(m, mesh, {f: (p,) for f, p in placements.items()},
                         [("R",) if isinstance(x, torch.Tensor) else None for x in inputs])

        def step() -> None:
            out = pm(*inputs)
            if not (isinstance(out, torch.Tensor) and out.dim() == 0):
                from autopar.capture.export import default_loss

                out = (loss_fn or default_loss)(out)
            out.backward()
        return step, lambda: _grad_layout_counts(m)

    counts = _count_comms(tp, build)
    if counts is None:
        return None
    return _attribute(counts, layers, rep, 0, len(layers), recompute)


def dtensor_stage_counts(model: nn.Module, example_inputs: Sequence[Any], tp: int,
                         placements: dict[str, str], layers: list[Layer], lo: int, hi: int,
                         *, index: int, num_stages: int, batch: Optional[int] = None,
                         device: str = "meta", max_real_params: int = 50_000_000,
                         recompute: str = "none") -> Optional[LayerCounts]:
    """Per-layer collectives (layers [lo, hi) filled) of one micro-batch of pipeline stage
    `index` of `num_stages`, holding layers [lo, hi), run on a tp mesh of `tp` ranks under
    `placements` (FQN -> tp placement) with the stage's `recompute` mode as the runtime runs it
    (see the module docstring). None when the model cannot be cut into stages here (the caller
    falls back)."""
    if not _can_dry_run(tp):
        return None
    return _graph_stage_counts(model, example_inputs, tp, placements, layers, lo, hi, index=index,
                               num_stages=num_stages, batch=batch, device=device,
                               max_real_params=max_real_params, recompute=recompute)


def _received(t: torch.Tensor, dev: str, index: int, needs_grad: bool = True) -> torch.Tensor:
    """A stage input received from the stage before (zeros on `dev`), requiring its gradient
    after the first stage when floating and `needs_grad` (its gradient is sent back)."""
    x = torch.zeros(t.shape, dtype=t.dtype, device=dev)
    return x.requires_grad_(True) if index > 0 and x.is_floating_point() and needs_grad else x


def _prepare(core: nn.Module, dev: str, x: torch.Tensor, layers: list[Layer], lo: int, hi: int,
             recompute: str, index: int) -> Optional[tuple[dict[int, int], torch.Tensor]]:
    """A stage copy made ready for its dry run: repeated layers passing their input through,
    recomputation as the runtime wraps it; (the repeats, the stage's input on `dev`, requiring
    its gradient after the first stage), or None when a layer's module is not found."""
    rep = _pass_through_repeats(core, layers, lo, hi)
    if rep is None:
        return None
    _apply_recompute(core, layers, lo, hi, rep, recompute)
    return rep, _received(x, dev, index)


def _dry_run_stage(core: nn.Module, tp: int, placements: dict[str, str], aliases: dict[str, str],
                   step: Callable[[Any], Callable[[], None]], layers: list[Layer], rep: dict[int, int],
                   lo: int, hi: int, recompute: str) -> Optional[LayerCounts]:
    """Count one stage copy `core` on a fake tp mesh: its parameters distributed with
    `placements`, `step(mesh)` the forward and backward the runtime runs; per-layer counts."""
    def build(mesh: Any) -> tuple[Callable[[], None], Callable[[], dict]]:
        from autopar.runtime.spmd import distribute_params

        distribute_params(core, mesh, {f: (p,) for f, p in placements.items()}, aliases=aliases,
                          src_data_rank=None)
        return step(mesh), lambda: _grad_layout_counts(core)

    counts = _count_comms(tp, build)
    if counts is None:
        return None
    return _attribute(counts, layers, rep, lo, hi, recompute)


def _graph_stage_counts(model: nn.Module, example_inputs: Sequence[Any], tp: int, placements: dict[str, str],
                        layers: list[Layer], lo: int, hi: int, *, index: int, num_stages: int,
                        batch: Optional[int], device: str, max_real_params: int,
                        recompute: str) -> Optional[LayerCounts]:
    """`dtensor_stage_counts` of a chunk the runtime cuts from the traced model: the model is cut
    at the stage's first layer and after its last (`graph_stages.split_model`, as the runtime
    cuts it), the chunk before it run on meta for the stage's input, the stage's chunk dry-run
    as the runtime runs it (`FedChunk` around an `SPMDModule`, the loss inside a last chunk)."""
    from autopar.runtime.graph_stages import FedChunk, split_model
    from autopar.runtime.materialize import canonical_names

    inputs = _batch_inputs(example_inputs, batch, "meta")
    cuts = ([layers[lo].modules[0]] if lo > 0 else []) + ([layers[hi].modules[0]] if hi < len(layers) else [])
    try:
        chunks = split_model(model, inputs, cuts, torch.device("meta"))
    except PlanError:
        return None
    mine = 1 if lo > 0 else 0
    received: tuple = (inputs[0],)
    if mine:
        # on meta, autograd on: which of the tensors the stage receives need a gradient (rotary
        # tables made from buffers do not; the runtime sends back none for them)
        c0 = chunks[0]
        y = FedChunk(c0.module, c0.sources, c0.sends).run(received, lambda k: inputs[k])
        received = y if isinstance(y, tuple) else (y,)
    ch = chunks[mine]
    work = _working_copy(ch.module, device, max_real_params)
    if work is None:
        return None
    core, dev = work
    from autopar.runtime.graph_stages import retarget

    retarget(core, torch.device(dev))
    prep = _prepare(core, dev, received[0], layers, lo, hi, recompute, index)
    if prep is None:
        return None
    rep, x = prep
    if not received[0].requires_grad:
        x = x.detach()
    xs = (x, *(_received(t, dev, index, t.requires_grad) for t in received[1:]))
    last = index == num_stages - 1
    real_inputs = _batch_inputs(example_inputs, batch, dev)
    aliases = canonical_names(model)

    def step(mesh: Any) -> Callable[[], None]:
        from autopar.runtime.spmd import SPMDModule

        fed = FedChunk(SPMDModule(core, mesh, [None], loss_inside=last), ch.sources, ch.sends)
        fed.start_step(real_inputs, 1)

        def go() -> None:
            out = fed(*xs)
            if last:
                out.backward()     # the chunk's loss
                return
            outs = [o for o in (out if isinstance(out, tuple) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(outs, grad_tensors=[torch.zeros_like(o) for o in outs])
        return go

    return _dry_run_stage(core, tp, placements, aliases, step, layers, rep, lo, hi, recompute)


def _attribute(counts: dict, layers: list[Layer], rep: dict[int, int], lo: int, hi: int,
               recompute: str = "none") -> LayerCounts:
    """CommDebugMode's per-module counts of a run of layers [lo, hi) as per-layer LayerCounts
    (other layers left empty); a repeated layer takes its source's counts, and the collectives
    of no layer module (the loss, a stage's boundaries) go to the last layer of the range."""
    per_param = counts.get("params", {})
    counts = counts["modules"]
    roots = [k for k in counts if k.endswith(".module")]
    root = roots[0] if roots else "SPMDModule.module"
    prefix = root + "."

    # a layer may name a module that holds other layers' modules (a Hugging Face model's
    # `model` holds the embedding, the final norm and `model.layers.*`, and is named by the first
    # and the last layer): its own collectives, without those of the layer modules inside it,
    # count once, in the first layer naming it
    names = list(dict.fromkeys(m for l in layers[lo:hi] for m in l.modules))
    owner = {m: next(i for i in range(lo, hi) if m in layers[i].modules) for m in names}

    def inner(name: str) -> list[str]:
        """The outermost layer modules strictly inside `name`."""
        sub = [m for m in names if m.startswith(name + ".")]
        return [m for m in sub if not any(m.startswith(o + ".") for o in sub)]

    def get(name: str, phase: str) -> Counter:
        c = _counter(counts.get(prefix + name, {}).get(phase, {}))
        for m in inner(name):
            c -= _counter(counts.get(prefix + m, {}).get(phase, {}))
        return c

    res = LayerCounts(len(layers), recompute)
    total_f = _counter(counts.get("Global", {}).get("forward", {}))
    total_b = _counter(counts.get("Global", {}).get("backward", {}))
    seen_f, seen_b = Counter(), Counter()
    for i in range(lo, hi):
        src = rep.get(i, i)
        for mod in layers[src].modules:
            if owner[mod] != src:
                continue
            f, b = get(mod, "forward"), get(mod, "backward")
            res.fwd[i] += f
            res.bwd[i] += b
            if mod == layers[src].name:
                res.block_fwd[i] += f
                for k, v in counts.items():
                    if k.startswith(prefix + mod + ".") and k.rsplit(".", 1)[-1].startswith("attn"):
                        res.attn_fwd[i] += _counter(v.get("forward", {}))
            if src == i:
                seen_f += f
                seen_b += b
    # ops of the root module itself (the loss, a stage's plain boundaries): the last layer's
    res.fwd[hi - 1] += total_f - seen_f
    res.bwd[hi - 1] += total_b - seen_b
    # per-step gradient layouts: each parameter with the layer owning the innermost layer module
    # holding it (not `model`, which holds every layer of a Hugging Face model); a repeated
    # layer (run as a pass-through) takes its source's
    for pname, c in per_param.items():
        holders = [m for m in names if m and (pname == m or pname.startswith(m + "."))]
        if holders:
            res.step[owner[max(holders, key=len)]] += c
    for i, src in rep.items():
        if lo <= i < hi:
            res.step[i] = Counter(res.step[src])
    return res
