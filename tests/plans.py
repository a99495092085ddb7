"""Pinned Plan objects for runtime tests (the real planner emits the same format).

`make_plan(layout)` builds a plan for gpt-tiny (or the 6-block variant `GPT6_REF` for the
interleaved pipeline, which needs 8 chunks) on a 4-process CPU cluster. Each plan's
`predicted.collectives` holds the collectives the layout needs per optimizer step under the
runtime's counting convention (autopar/runtime/counting.py):

* an SPMD collective counts once per stage (not per group or rank);
* a point-to-point transfer counts once (send_recv), per micro-batch and direction;
* a collective joining stages (tied embedding gradient) counts once.

Derivations (gpt-tiny: embed, 2 blocks, head; tied embedding/output weight):

* dpN, zero 0: one flat gradient all-reduce per stage -> all_reduce 1.
* ZeRO-3 dp4 (`fully_shard` per block; embed+head share the tied weight so they stay in the
  root unit): all_gather = 3 units in forward + 2 blocks re-gathered in backward (the root is
  not resharded after forward) = 5; reduce_scatter = 3 (one per unit).
* tp layouts (tp2, tp4, dp2xtp2, selective_tp4, zero3dp2xtp2, pp2xtp2 and its recomputing
  variants, pp2xtp2_vocab) are the planner's own plans at those pins (`PLANNED`): `autopar run`
  executes tensor parallelism only op by op as solved (issue 20, one executor), which a plan
  written by hand, naming parameter placements alone, does not say. The analytic rules' plans
  (Megatron's placements, the activations' layouts solved with them pinned) but pp2xtp2_vocab,
  the ILP's (its tied embedding placed as the ILP places it); their collectives are the
  plan's prediction (the solution's). Each is made once per source tree and kept in a file
  (`_planned`), so that every process of a job runs the same plan.
* pp: 1F1B/GPipe with M micro-batches over p stages: 2·M·(p−1) send_recv (activation forward,
  gradient backward); interleaved with v chunks per device: 2·M·(p·v−1). Tied embedding across
  first and last stage: +1 all_reduce. (torch.pipelining's one-time warm-up vote, p−1
  sends each way, runs at setup: `runtime.pipeline._vote_now`.)
"""

from __future__ import annotations

import torch

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.registry import build_model, token_batch
from autopar.schema import ClusterSpec, DeviceSpec, LinkSpec, ModelInfo, Plan, Prediction, StagePlan
from autopar.schema.plan import load_plan

GPT6_REF = "tests.plans:gpt_tiny6"
_CFG6 = GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=6, heads=4)


def gpt_tiny6():
    """gpt-tiny with 6 blocks (8 layers: embed, 6 blocks, head), built on meta."""
    with torch.device("meta"):
        model = GPT(_CFG6)
    inputs = (torch.zeros(1, 16, dtype=torch.long, device="meta"),
              torch.zeros(1, 16, dtype=torch.long, device="meta"))
    return model, inputs, token_batch(_CFG6.vocab_size, _CFG6.seq_len)


MOE4_REF = "tests.plans:moe_tiny4"


def moe_tiny4():
    """moe-tiny with 4 blocks (each 8 experts top-2 + 1 shared), built on meta: enough layers
    for 2 pipeline ranks of 2 interleaved chunks each."""
    import dataclasses

    from autopar.models.catalogue import catalogue
    from autopar.models.moe import MoEModel

    cfg = dataclasses.replace(catalogue("moe")["moe-tiny"].config, layers=4)
    with torch.device("meta"):
        model = MoEModel(cfg)
    inputs = (torch.zeros(1, cfg.seq_len, dtype=torch.long, device="meta"),
              torch.zeros(1, cfg.seq_len, dtype=torch.long, device="meta"))
    return model, inputs, token_batch(cfg.vocab_size, cfg.seq_len)


def large_step_sgd(params):
    """Plain SGD with a large step (an optimizer a layouts job can name: "optimizer=tests.plans:
    large_step_sgd"): an expert weight left out of the update moves the next loss."""
    return torch.optim.SGD(params, lr=0.5)


_FP: dict[str, tuple[str, int, int]] = {}


def model_info(ref: str) -> ModelInfo:
    if ref not in _FP:
        from autopar.capture import capture

        b = build_model(ref, device="meta")
        nparams = sum(p.numel() for p in b.model.parameters())
        layers = len(b.model.blocks) + 2 if hasattr(b.model, "blocks") else 1
        _FP[ref] = (capture(b.model, b.example_inputs).fingerprint(), nparams, layers)
    fp, n, layers = _FP[ref]
    return ModelInfo(name=ref, num_params=n, fingerprint=fp, num_layers=layers, flops_per_sample=1.0)


def cpu_cluster(n: int = 4) -> ClusterSpec:
    return ClusterSpec(name="cpu-test", num_nodes=1, devices_per_node=n,
                       device=DeviceSpec(name="cpu-process", device_type="cpu", peak_flops={"fp32": 5e10},
                                         memory_bytes=8 * 2**30, memory_bandwidth=1e10),
                       intra_node=LinkSpec(bandwidth=2e9, latency=5e-5))


def megatron_placements(nblocks: int, axes: tuple[str, ...], blocks: range | None = None) -> dict:
    """Megatron TP on the tp axis (qkv/fc column: weight+bias S(0); proj row: weight S(1)), R on
    every other axis."""
    out = {}
    tpi = [i for i, a in enumerate(axes) if a == "tp"]

    def pl(p: str) -> tuple[str, ...]:
        return tuple(p if i in tpi else "R" for i in range(len(axes)))

    for b in (blocks if blocks is not None else range(nblocks)):
        for n in ("attn.qkv", "mlp.fc"):
            out[f"blocks.{b}.{n}.weight"] = pl("S(0)")
            out[f"blocks.{b}.{n}.bias"] = pl("S(0)")
        for n in ("attn.proj", "mlp.proj"):
            out[f"blocks.{b}.{n}.weight"] = pl("S(1)")
    return out


def _layers(nblocks: int) -> list[str]:
    return ["embed"] + [f"blocks.{i}" for i in range(nblocks)] + ["head"]


def _plan(ref: str, stages: list[StagePlan], *, gbs: int, mb: int, m: int, schedule: str = "1f1b",
          v: int = 1, zero: int = 0, collectives: dict | None = None, nodes_devices: int = 4) -> Plan:
    if zero == 3:
        # ZeRO-3 units (`StagePlan.fsdp_units`), written out as a planner would choose them for the
        # zoo GPT: one model, every block (the tied embedding and head stay with the root unit);
        # a pipeline stage, each of its layer modules (it holds one name of a tied weight)
        pipelined = len({tuple(st.devices) for st in stages}) > 1
        for st in stages:
            if st.fsdp_units is None:
                st.fsdp_units = list(st.layers) if pipelined else [x for x in st.layers if x.startswith("blocks.")]
    return Plan(model=model_info(ref), cluster=cpu_cluster(nodes_devices), dtype="fp32",
                global_batch_size=gbs, microbatch_size=mb, num_microbatches=m, schedule=schedule,
                virtual_stages=v, zero_stage=zero, stages=stages,
                predicted=Prediction(iteration_time_s=0.05, samples_per_s=gbs / 0.05, tokens_per_s=gbs * 16 / 0.05,
                                     tflops_per_device=0.0, peak_memory_bytes=2**30,
                                     collectives=dict(collectives or {})))


LAYOUTS = ["single", "dp2", "dp4", "tp2", "tp4", "dp2xtp2", "pp2xdp2", "pp2xtp2", "pp4v2", "zero3dp4",
           "zero2dp2", "zero2dp4", "recompute_dp4", "selective_tp4", "pp2xdp2z2", "pp2xdp2z3", "zero3dp2xtp2",
           "pp2xtp2_full", "pp2xtp2_selective", "pp2xtp2_vocab"]


def _rc(layers: list[str], rec: str) -> "list[str] | None":
    """The modules a hand-written plan of the zoo GPT checkpoints (`StagePlan.recompute_modules`,
    what the planner finds from the ops): each block, or its attention under "selective"."""
    if rec == "none":
        return None
    blocks = [x for x in layers if x.startswith("blocks.")]
    return blocks if rec == "full" else [f"{b}.attn" for b in blocks]


_TP = dict(num_microbatches=1, recompute="none", zero_stage=0)
_PP2XTP2 = dict(dp=1, tp=2, pp=2, num_microbatches=4, schedule="gpipe", zero_stage=0)
# layout: (devices, constraints, intra_op): the tp layouts, planned (module docstring)
PLANNED = {
    "tp2": (2, dict(_TP, dp=1, tp=2, pp=1), "analytic"),
    "tp4": (4, dict(_TP, dp=1, tp=4, pp=1), "analytic"),
    "selective_tp4": (4, dict(_TP, dp=1, tp=4, pp=1, recompute="selective"), "analytic"),
    "dp2xtp2": (4, dict(_TP, dp=2, tp=2, pp=1), "analytic"),
    "zero3dp2xtp2": (4, dict(_TP, dp=2, tp=2, pp=1, zero_stage=3), "analytic"),
    "pp2xtp2": (4, dict(_PP2XTP2, recompute="none"), "analytic"),
    "pp2xtp2_full": (4, dict(_PP2XTP2, recompute="full"), "analytic"),
    "pp2xtp2_selective": (4, dict(_PP2XTP2, recompute="selective"), "analytic"),
    "pp2xtp2_vocab": (4, dict(_PP2XTP2, recompute="none"), "ilp"),
}


def _source_digest() -> str:
    """A digest of the sources a plan depends on (the planner, cost models, profiles)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for d in ("autopar", "cost_models", "hardware_profiles", "software_profiles"):
        for f in sorted((root / d).rglob("*")):
            if f.is_file() and f.suffix in (".py", ".yaml", ".yml", ".json"):
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _planned(layout: str, gbs: int, ref: str) -> Plan:
    """The planner's plan of `PLANNED[layout]` for `ref` at global batch `gbs` (`planned`)."""
    devices, cons, intra_op = PLANNED[layout]
    return planned(layout, ref, devices, cons, intra_op, gbs)


def planned(name: str, ref: str, devices: int, cons: dict, intra_op: str, gbs: int = 8) -> Plan:
    """The planner's fp32 plan for `ref` on `devices` CPU processes at `cons` (Constraints'
    keywords), made once per source tree and kept in a file under `name`: every process of a
    job (each asks for it) and the test that checks the job's rows read the same plan (the ILP
    may break a tie another way in another process)."""
    import os
    import tempfile
    from pathlib import Path

    from autopar.planner import plan as make
    from autopar.schema import Constraints

    folder = Path(tempfile.gettempdir()) / f"autopar-test-plans-{_source_digest()}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{gbs}-{ref.replace(':', '_').replace('/', '_')}.json"
    if not path.exists():
        cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": devices, "num_nodes": 1})
        p = make(ref, cl, global_batch_size=gbs, dtype="fp32", intra_op=intra_op, constraints=Constraints(**cons))
        tmp = folder / f".{path.name}.{os.getpid()}"
        p.save(tmp)
        try:
            os.link(tmp, path)           # the first plan written is every process's
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return load_plan(path)


def make_plan(layout: str, *, gbs: int = 8, ref: str = "gpt-tiny") -> Plan:
    """A pinned plan for `layout` (see LAYOUTS); a "_bf16" suffix makes it a bf16 plan (autocast,
    fp32 parameters and optimizer state), with the same collectives."""
    if layout.endswith("_bf16"):
        return make_plan(layout[:-len("_bf16")], gbs=gbs, ref=ref).model_copy(update={"dtype": "bf16"})
    if layout in PLANNED:
        return _planned(layout, gbs, ref)
    nb = 2
    L = _layers(nb)
    if layout == "single":
        return _plan(ref, [StagePlan(index=0, devices=[0], mesh_shape=(1,), mesh_axis_names=("dp",), layers=L)],
                     gbs=gbs, mb=gbs, m=1, collectives={}, nodes_devices=1)
    if layout in ("dp2", "dp4", "recompute_dp4"):
        n = 2 if layout == "dp2" else 4
        rec = "full" if layout == "recompute_dp4" else "none"
        m = 2 if layout == "dp4" else 1
        return _plan(ref, [StagePlan(index=0, devices=list(range(n)), mesh_shape=(n,), mesh_axis_names=("dp",),
                                     layers=L, recompute=rec, recompute_modules=_rc(L, rec))],
                     gbs=gbs, mb=gbs // n // m, m=m, collectives={"all_reduce": 1}, nodes_devices=n)
    if layout == "zero3dp4":
        pl = {n: ("S(0)",) for n in _param_names(ref)}
        return _plan(ref, [StagePlan(index=0, devices=[0, 1, 2, 3], mesh_shape=(4,), mesh_axis_names=("dp",),
                                     layers=L, placements=pl)],
                     gbs=gbs, mb=gbs // 4, m=1, zero=3, collectives={"all_gather": 5, "reduce_scatter": 3})
    if layout == "zero2dp2":
        return _plan(ref, [StagePlan(index=0, devices=[0, 1], mesh_shape=(2,), mesh_axis_names=("dp",),
                                     layers=L)],
                     gbs=gbs, mb=gbs // 2, m=1, zero=2, collectives={"all_gather": 1, "reduce_scatter": 1},
                     nodes_devices=2)
    if layout == "zero2dp4":
        return _plan(ref, [StagePlan(index=0, devices=[0, 1, 2, 3], mesh_shape=(4,), mesh_axis_names=("dp",),
                                     layers=L)],
                     gbs=gbs, mb=gbs // 4, m=1, zero=2, collectives={"all_gather": 1, "reduce_scatter": 1})
    if layout == "pp2xdp2":
        M = 4
        st = [StagePlan(index=0, devices=[0, 1], mesh_shape=(2,), mesh_axis_names=("dp",), layers=L[:2]),
              StagePlan(index=1, devices=[2, 3], mesh_shape=(2,), mesh_axis_names=("dp",), layers=L[2:])]
        return _plan(ref, st, gbs=gbs, mb=gbs // 2 // M, m=M, schedule="1f1b",
                     collectives={"all_reduce": 2 + 1, "send_recv": 2 * M})
    if layout in ("pp2xdp2z2", "pp2xdp2z3"):
        M = 2
        z = int(layout[-1])
        st = [StagePlan(index=0, devices=[0, 1], mesh_shape=(2,), mesh_axis_names=("dp",), layers=L[:2]),
              StagePlan(index=1, devices=[2, 3], mesh_shape=(2,), mesh_axis_names=("dp",), layers=L[2:])]
        # z2: per stage 1 reduce-scatter + 1 all-gather; + tied all-reduce; 2·M transfers.
        # z3 (fully_shard per layer in each stage; U = 2 units per stage): measured and pinned,
        # per stage all_gather U·(M + 1) (each micro-batch's forward re-gathers, the backward
        # gathers once: torch.pipelining reshards after the last micro-batch only),
        # reduce_scatter U: all_gather 12, reduce_scatter 4
        c = ({"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1, "send_recv": 2 * M} if z == 2 else
             {"all_gather": 12, "reduce_scatter": 4, "all_reduce": 1, "send_recv": 2 * M})
        return _plan(ref, st, gbs=gbs, mb=gbs // 2 // M, m=M, schedule="1f1b", zero=z, collectives=c)
    if layout == "pp4v2":
        ref = GPT6_REF
        L6 = _layers(6)
        M = 4
        st = [StagePlan(index=i, devices=[i % 4], mesh_shape=(1,), mesh_axis_names=("dp",), layers=[L6[i]],
                        virtual_chunk=i // 4) for i in range(8)]
        return _plan(ref, st, gbs=gbs, mb=gbs // M, m=M, schedule="interleaved_1f1b", v=2,
                     collectives={"all_reduce": 1, "send_recv": 2 * M * 7})
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def _param_names(ref: str) -> list[str]:
    b = build_model(ref, device="meta")
    return [n for n, _ in b.model.named_parameters()]


def build_api_check(steps: int, seed: int) -> dict:
    """`autopar.runtime.build` + `ParallelModel.step` from a user's loop (dp2 x tp2)."""
    from autopar.models.registry import call_batch_fn
    from autopar.runtime import build

    plan = make_plan("dp2xtp2")
    b = build_model("gpt-tiny", device="meta")
    pm = build(plan, "gpt-tiny", seed=seed)
    losses = [pm.step(call_batch_fn(b.batch_fn, s, plan.global_batch_size, seed)) for s in range(steps)]
    return {"losses": losses}


def vocab_loss_check() -> dict:
    """`runtime.vocab_loss` on this job's ranks (a 1-D mesh over all of them): cross-entropy of
    class-sharded logits (with ignored rows) against one process's, its gradient, the collectives
    it ran (CommDebugMode, forward and backward), whether torch's loss-parallel handlers are off
    again after the backward, and the fallbacks (label smoothing; whole logits) still exact."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.runtime.spmd import allow_implicit_replication
    from autopar.runtime.vocab_loss import VocabParallelLoss

    allow_implicit_replication()   # plain targets beside DTensor logits, as in the runtime
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 8 * dist.get_world_size(), generator=g)
    target = torch.randint(0, logits.shape[1], (12,), generator=g)
    target[3] = -100
    out: dict = {}
    for name, kw, pl in (("vocab", {}, Shard(1)), ("smoothing", {"label_smoothing": 0.1}, Shard(1)),
                         ("whole", {}, Replicate())):
        ref_x = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_x, target, **kw)
        ref.backward()
        x = distribute_tensor(logits, mesh, [pl]).requires_grad_(True)
        cm = CommDebugMode()
        with cm, VocabParallelLoss():
            loss = F.cross_entropy(x, target, **kw)
        fwd = {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}
        cm = CommDebugMode()
        with cm:
            loss.backward()
        bwd = {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}
        grad = x.grad.full_tensor() if isinstance(x.grad, DTensor) else x.grad
        out[name] = {"loss": float(loss.full_tensor() if isinstance(loss, DTensor) else loss),
                     "ref": float(ref), "grad_err": float((grad - ref_x.grad).abs().max()),
                     "fwd": fwd, "bwd": bwd,
                     "handlers_left": any("log_softmax" in str(op)
                                          for op in DTensor._op_dispatcher._custom_op_handlers)}
    # a log-softmax on vocabulary-sharded logits outside a cross-entropy keeps DTensor's own rule
    x = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_(True)
    ref_x = logits.clone().requires_grad_(True)
    F.log_softmax(ref_x, -1)[:, 0].sum().backward()
    with VocabParallelLoss():
        F.log_softmax(x, -1)[:, 0].sum().backward()
    out["log_softmax_grad_err"] = float((x.grad.full_tensor() - ref_x.grad).abs().max())
    return out


def recompute_check(layout: str) -> dict:
    """Whether `layout`'s recomputation really recomputes, on this job's ranks: over one step,
    the forward attention ops the rank runs (each block's attention core: inside both the
    "full" and the "selective" region; a tp stage runs its program op by op, so the ops are
    counted, not module calls) and the bytes autograd keeps saved for the backward outside
    checkpointed regions (a checkpoint keeps only its inputs). Returns {"calls": per rank,
    "saved_bytes": per rank, "microbatches": M}."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.models.registry import call_batch_fn
    from autopar.runtime import build

    plan = make_plan(layout)
    b = build_model(plan.model.name, device="meta")
    calls = [0]

    class Attention(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if "scaled_dot_product" in name and "backward" not in name:
                calls[0] += 1
            return func(*args, **(kwargs or {}))

    pm = build(plan, b, seed=0)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        loc = t.to_local() if hasattr(t, "to_local") else t
        saved[0] += loc.numel() * loc.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Attention():
        pm.step(call_batch_fn(b.batch_fn, 0, plan.global_batch_size, 0))
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (calls[0], saved[0]))
    return {"calls": [c for c, _ in out], "saved_bytes": [s for _, s in out],
            "microbatches": plan.num_microbatches}


def _entry_plan(lay: str) -> "Plan | None":
    """The plan a layouts job's entry `lay` runs (`run_layouts_job`), None for a check of none."""
    if lay.startswith("plan:"):
        return load_plan(lay[len("plan:"):].partition("?")[0])
    if lay.startswith("recompute_check:"):
        return make_plan(lay.split(":", 1)[1])
    if lay == "build_api":
        return make_plan("dp2xtp2")
    if lay.removesuffix("_bf16") in LAYOUTS:
        return make_plan(lay)
    return None


def trace_layouts(layouts: list[str]) -> None:
    """What every rank of a layouts job would trace alike, traced once in the process its ranks
    are forked from (`tests.launch.layouts_job`, `processes.launch(prepare=...)`): each entry's
    programs (`runtime.shared_programs.trace_programs`) and the hand-written plans' fingerprints
    (`model_info`). A rank looks each up by its own key: one traced here that it does not ask
    for changes nothing it runs."""
    from autopar.runtime.shared_programs import trace_programs

    for lay in layouts:
        try:
            plan = _entry_plan(lay)
        except Exception:  # noqa: BLE001 - the entry's own run reports it, on every rank
            continue
        if plan is not None:
            trace_programs(plan, build_model(plan.model.name, device="meta"))


# ---------------------------------------------------------------------------------------------
# a multi-layout job: one torchrun launch runs several layouts in turn (saves process start-up)
# ---------------------------------------------------------------------------------------------
def run_layouts_job(layouts: list[str], out_path: str, steps: int = 4, seed: int = 0) -> None:
    """Under torchrun: train each layout `steps` steps; rank 0 writes {layout: rows} as JSON.
    A layout is a name of LAYOUTS, "plan:PATH" (a plan file, e.g. the planner's; "plan:PATH?
    steps=N&checkpoint_dir=DIR&optimizer=MODULE:NAME" runs it N steps, checkpointing to DIR,
    with the optimizer `MODULE.NAME(params)` makes, as `autopar.runtime.run` does), or a check:
    "build_api", "vocab_loss", "recompute_check:LAYOUT",
    "fail_on_rank:R" (rank R raises: the harness's own test). With AUTOPAR_LAYOUT_TIMES set to
    a file, rank 0 appends each layout's seconds to it (which layouts a job's time goes to), and
    how many programs it found kept and traced (`runtime.shared_programs`)."""
    import importlib
    import json
    import os
    import time
    import traceback
    from urllib.parse import parse_qsl

    import torch.distributed as dist

    from autopar.runtime.worker import init_distributed, train

    init_distributed()
    results: dict = {}

    def write_results() -> None:
        # after every layout, so a job that dies in a later one keeps what ran (`tests.launch.
        # layouts_job` relaunches the rest); written whole, then renamed
        if dist.get_rank() == 0:
            tmp = f"{out_path}.part"
            with open(tmp, "w") as f:
                json.dump(results, f)
            os.replace(tmp, out_path)

    def one(lay: str) -> object:
        if lay == "vocab_loss":
            return vocab_loss_check()
        if lay == "build_api":
            return build_api_check(steps, seed)
        if lay.startswith("fail_on_rank:"):     # the harness's own test: one rank fails
            if dist.get_rank() == int(lay.split(":", 1)[1]):
                raise RuntimeError("this rank fails, as asked")
            dist.barrier()
            return []
        if lay.startswith("recompute_check:"):
            return recompute_check(lay.split(":", 1)[1])
        opts: dict = {}
        if lay.startswith("plan:"):
            path, _, query = lay[len("plan:"):].partition("?")
            opts = dict(parse_qsl(query))
            plan = load_plan(path)
        else:
            plan = make_plan(lay)
        bundle = build_model(plan.model.name, device="meta")
        optimizer = None
        if "optimizer" in opts:
            module, _, name = opts["optimizer"].partition(":")
            optimizer = getattr(importlib.import_module(module), name)
        rows = train(plan, bundle, steps=int(opts.get("steps", steps)), seed=seed, quiet=True,
                     checkpoint_dir=opts.get("checkpoint_dir"), optimizer_factory=optimizer)
        dist.barrier()
        return rows

    from autopar.intra_op.execute import META_PROGRAM_STATS
    from autopar.runtime.graph_stages import SPLIT_STATS

    def traced() -> tuple[int, ...]:
        return (META_PROGRAM_STATS["hits"], META_PROGRAM_STATS["misses"], SPLIT_STATS["hits"], SPLIT_STATS["misses"])

    try:
        for lay in layouts:
            t0 = time.perf_counter()
            c0 = traced()
            try:
                results[lay] = one(lay)
            except Exception as e:
                # the ranks may stand in different collectives now: each writes its error for
                # `tests.launch.layouts_job`, which reports it as this layout's rows and runs
                # the layouts after it in a new job
                err = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                results[lay] = err
                with open(f"{out_path}.err{dist.get_rank()}", "w") as f:
                    json.dump({"layout": lay, **err}, f)
                raise
            write_results()
            if os.environ.get("AUTOPAR_LAYOUT_TIMES") and dist.get_rank() == 0:
                with open(os.environ["AUTOPAR_LAYOUT_TIMES"], "a") as f:
                    d = [b - a for a, b in zip(c0, traced())]
                    f.write(f"{time.perf_counter() - t0:8.1f} s  {dist.get_world_size()}p  programs kept/traced "
                            f"{d[0]}/{d[1]}, splits {d[2]}/{d[3]}  {lay}\n")
    finally:
        write_results()
        dist.destroy_process_group()


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("layouts", nargs="+")
    a = ap.parse_args()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    # the module the job's leader imported (`trace_layouts`), not this __main__ copy of it: a
    # forked rank finds its memos (`model_info`'s fingerprints) filled
    from tests.plans import run_layouts_job as job

    job(a.layouts, a.out, a.steps)
    from autopar.runtime.worker import hard_exit

    hard_exit(0)
