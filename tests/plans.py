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
* tp (DTensor, Megatron placements qkv/fc "S(0)", proj "S(1)"): per block the runtime measures
  forward: an all-reduce after each row-parallel proj (2; the fused qkv rows are head-major, so
  a contiguous row shard holds whole heads and nothing is gathered); backward: an all-reduce of
  the gradient at each LayerNorm's output (the input of the column-parallel qkv / fc;
  `spmd.megatron_boundaries`). tp over 2 blocks measures all_reduce 8 per step (no
  all-gathers); these are the runtime's measured counts, written
  down once and pinned, so a change in the runtime's or DTensor's behaviour fails the test.
  dp2 x tp2 adds the dp gradient all-reduce.
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


# measured per-step collectives of the tp layouts (see module docstring), by tp stage shape
TP_COLLECTIVES = {
    # filled from the runtime's own count; see test_runtime_layouts
    "tp": {"all_reduce": 8},
}

LAYOUTS = ["single", "dp2", "dp4", "tp2", "tp4", "dp2xtp2", "pp2xdp2", "pp2xtp2", "pp4v2", "zero3dp4",
           "zero2dp2", "zero2dp4", "recompute_dp4", "selective_tp4", "pp2xdp2z2", "pp2xdp2z3", "zero3dp2xtp2",
           "pp2xtp2_full", "pp2xtp2_selective", "pp2xtp2_vocab"]

# per block and micro-batch, the collectives recomputation re-runs in the backward (measured):
# torch's non-reentrant checkpoint stops recomputing at the region's last saved tensor, so the
# all-reduce of the MLP projection ("full"), feeding only a residual add that saves nothing, is
# not re-run; "selective" re-runs the attention core alone (or, in a format-8 plan, the
# attention module up to its projection), which issues none
RECOMPUTED_PER_BLOCK = {"none": {}, "full": {"all_reduce": 1}, "selective": {}}


def _rc(layers: list[str], rec: str) -> "list[str] | None":
    """The modules a hand-written plan of the zoo GPT checkpoints (`StagePlan.recompute_modules`,
    what the planner finds from the ops): each block, or its attention under "selective"."""
    if rec == "none":
        return None
    blocks = [x for x in layers if x.startswith("blocks.")]
    return blocks if rec == "full" else [f"{b}.attn" for b in blocks]


def _rc_ops(layers: list[str], rec: str) -> "list[str] | None":
    """The ops a hand-written plan of the zoo GPT recomputes under "selective"
    (`StagePlan.recompute_ops`): each block's fused attention call, named as the capture names
    them. None elsewhere (and in "selective_tp4", which stands for a plan of format 8: its
    attention modules checkpointed whole)."""
    if rec != "selective":
        return None
    idx = [int(x.split(".")[1]) for x in layers if x.startswith("blocks.")]
    return [f"scaled_dot_product_attention{f'_{i}' if i else ''}" for i in idx]


def make_plan(layout: str, *, gbs: int = 8, ref: str = "gpt-tiny") -> Plan:
    """A pinned plan for `layout` (see LAYOUTS); a "_bf16" suffix makes it a bf16 plan (autocast,
    fp32 parameters and optimizer state), with the same collectives."""
    if layout.endswith("_bf16"):
        return make_plan(layout[:-len("_bf16")], gbs=gbs, ref=ref).model_copy(update={"dtype": "bf16"})
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
    if layout == "tp2":
        return _plan(ref, [StagePlan(index=0, devices=[0, 1], mesh_shape=(2,), mesh_axis_names=("tp",),
                                     layers=L, placements=megatron_placements(nb, ("tp",)))],
                     gbs=gbs, mb=gbs, m=1, collectives=dict(TP_COLLECTIVES["tp"]), nodes_devices=2)
    if layout == "selective_tp4":
        # recomputing attention re-runs its forward collectives in the backward up to its last
        # saved tensor (the qkv output all-gather of each block, not the proj all-reduce:
        # RECOMPUTED_PER_BLOCK); the embedding and head are never recomputed: measured and
        # pinned, 2 all-gathers more than tp4
        return _plan(ref, [StagePlan(index=0, devices=[0, 1, 2, 3], mesh_shape=(4,), mesh_axis_names=("tp",),
                                     layers=L, recompute="selective", recompute_modules=_rc(L, "selective"),
                                     placements=megatron_placements(nb, ("tp",)))],
                     gbs=gbs, mb=gbs, m=1, collectives={"all_reduce": 8})
    if layout == "tp4":
        return _plan(ref, [StagePlan(index=0, devices=[0, 1, 2, 3], mesh_shape=(4,), mesh_axis_names=("tp",),
                                     layers=L, placements=megatron_placements(nb, ("tp",)))],
                     gbs=gbs, mb=gbs, m=1, collectives=dict(TP_COLLECTIVES["tp"]))
    if layout == "zero3dp2xtp2":
        pl = megatron_placements(nb, ("dp", "tp"))
        pl = {n: ("S(0)", pl.get(n, ("R", "R"))[1]) for n in _param_names(ref)}
        return _plan(ref, [StagePlan(index=0, devices=[0, 1, 2, 3], mesh_shape=(2, 2), mesh_axis_names=("dp", "tp"),
                                     layers=L, placements=pl)],
                     gbs=gbs, mb=gbs // 2, m=1, zero=3,
                     # tp's 8 all-reduces + ZeRO-3's 5 all-gathers, 3 reduce-scatters
                     collectives={"all_gather": 5, "all_reduce": 8, "reduce_scatter": 3})
    if layout == "dp2xtp2":
        c = dict(TP_COLLECTIVES["tp"])
        c["all_reduce"] = c.get("all_reduce", 0) + 1
        return _plan(ref, [StagePlan(index=0, devices=[0, 1, 2, 3], mesh_shape=(2, 2), mesh_axis_names=("dp", "tp"),
                                     layers=L, placements=megatron_placements(nb, ("dp", "tp")))],
                     gbs=gbs, mb=gbs // 2, m=1, collectives=c)
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
    if layout == "pp2xtp2_vocab":
        # pp2xtp2 with the tied embedding in two layouts on equal meshes, as the planner's ILP
        # places it: replicated on stage 0, the output weight vocabulary-parallel on stage 1
        # (its gradient summed in the full parameter's coordinates, `tied_grads.FullTiedSync`).
        # The vocabulary-parallel head adds per micro-batch 1 all-reduce (its input's partial
        # gradient) and the vocabulary-parallel cross-entropy's 3 (max, sum of exponentials,
        # target logit; the logits are never gathered): measured and pinned
        plan = make_plan("pp2xtp2", gbs=gbs, ref=ref)
        M = plan.num_microbatches
        plan.stages[1].placements.update({"embed.tok.weight": ("S(0)",), "head.out.weight": ("S(0)",)})
        c = dict(plan.predicted.collectives)
        c.update(all_reduce=c["all_reduce"] + (1 + 3) * M)
        return plan.model_copy(update={"predicted": plan.predicted.model_copy(update={"collectives": c})})
    if layout in ("pp2xtp2", "pp2xtp2_full", "pp2xtp2_selective"):
        M = 4
        rec = layout.split("_")[1] if "_" in layout else "none"
        st = [StagePlan(index=0, devices=[0, 1], mesh_shape=(2,), mesh_axis_names=("tp",), layers=L[:2],
                        placements=megatron_placements(nb, ("tp",), range(0, 1)), recompute=rec,
                        recompute_modules=_rc(L[:2], rec), recompute_ops=_rc_ops(L[:2], rec)),
              StagePlan(index=1, devices=[2, 3], mesh_shape=(2,), mesh_axis_names=("tp",), layers=L[2:],
                        placements=megatron_placements(nb, ("tp",), range(1, 2)), recompute=rec,
                        recompute_modules=_rc(L[2:], rec), recompute_ops=_rc_ops(L[2:], rec))]
        # measured: per micro-batch 8 all-reduces inside the two tp stages (as tp4), + 1
        # tied-embedding all-reduce; 2 transfers per micro-batch; recomputation adds
        # RECOMPUTED_PER_BLOCK for each of the nb blocks per micro-batch
        extra = RECOMPUTED_PER_BLOCK[rec]
        c = {"all_reduce": (8 + nb * extra.get("all_reduce", 0)) * M + 1, "send_recv": 2 * M}
        if extra.get("all_gather"):
            c["all_gather"] = nb * extra["all_gather"] * M
        return _plan(ref, st, gbs=gbs, mb=gbs // M, m=M, schedule="gpipe", collectives=c)
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


def spmd2d_check() -> dict:
    """`autopar.runtime.spmd.parallelize` on a (dp 2, tp 2) mesh with Megatron placements and
    batch-sharded inputs: forward loss and a backward vs one process on the full batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.materialize import canonical_names, materialize
    from autopar.runtime.spmd import grads_to_param_layout, local_shard_rows, parallelize

    b = build_model("gpt-tiny", device="meta")
    materialize(b.model, seed=0, aliases=canonical_names(b.model))
    tok, tgt = b.batch_fn(0, 8, 0)
    ref = b.model(tok, tgt)
    ref.backward()
    ref_grad = b.model.blocks[0].mlp.fc.weight.grad.clone()
    m = build_model("gpt-tiny", device="meta").model
    materialize(m, seed=0, aliases=canonical_names(m))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = parallelize(m, mesh, megatron_placements(2, ("dp", "tp")), [("S(0)", "R"), ("S(0)", "R")])
    loss = pm(local_shard_rows(tok, mesh, ("S(0)", "R")), local_shard_rows(tgt, mesh, ("S(0)", "R")))
    loss.backward()
    grads_to_param_layout(m.parameters())
    g = m.blocks[0].mlp.fc.weight.grad.full_tensor()
    dist.barrier()
    return {"loss": float(loss), "ref": float(ref), "grad_err": float((g - ref_grad).abs().max()),
            "grad_scale": float(ref_grad.abs().max())}


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
    the forward calls of every local block's attention (its qkv projection: inside both the
    "full" and the "selective" region) and the bytes autograd keeps saved for the backward
    outside checkpointed regions (a checkpoint keeps only its inputs). Returns {"calls": per
    rank, "saved_bytes": per rank, "microbatches": M}."""
    import torch.distributed as dist

    from autopar.models.registry import call_batch_fn
    from autopar.runtime import build

    plan = make_plan(layout)
    b = build_model(plan.model.name, device="meta")
    calls = [0]

    def count(mod: torch.nn.Module, args: tuple) -> None:
        calls[0] += 1

    pm = build(plan, b, seed=0)
    for local in pm.local_modules:      # the modules the rank runs (a pipeline chunk's own)
        for name, mod in local.named_modules():
            if name.endswith("attn.qkv"):
                mod.register_forward_pre_hook(count)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        loc = t.to_local() if hasattr(t, "to_local") else t
        saved[0] += loc.numel() * loc.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.step(call_batch_fn(b.batch_fn, 0, plan.global_batch_size, 0))
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (calls[0], saved[0]))
    return {"calls": [c for c, _ in out], "saved_bytes": [s for _, s in out],
            "microbatches": plan.num_microbatches}


# ---------------------------------------------------------------------------------------------
# a multi-layout job: one torchrun launch runs several layouts in turn (saves process start-up)
# ---------------------------------------------------------------------------------------------
def run_layouts_job(layouts: list[str], out_path: str, steps: int = 4, seed: int = 0) -> None:
    """Under torchrun: train each layout `steps` steps; rank 0 writes {layout: rows} as JSON.
    A layout is a name of LAYOUTS, "plan:PATH" (a plan file, e.g. the planner's; "plan:PATH?
    steps=N&checkpoint_dir=DIR" runs it N steps, checkpointing to DIR as `autopar.runtime.run`
    does), or a check: "spmd2d", "build_api", "vocab_loss", "recompute_check:LAYOUT",
    "fail_on_rank:R" (rank R raises: the harness's own test)."""
    import json
    import os
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
        if lay == "spmd2d":
            return spmd2d_check()
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
        rows = train(plan, bundle, steps=int(opts.get("steps", steps)), seed=seed, quiet=True,
                     checkpoint_dir=opts.get("checkpoint_dir"))
        dist.barrier()
        return rows

    try:
        for lay in layouts:
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
    run_layouts_job(a.layouts, a.out, a.steps)
    from autopar.runtime.worker import hard_exit

    hard_exit(0)
