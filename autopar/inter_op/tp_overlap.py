"""The tensor-parallel collectives a layer's ILP solution runs, paired with the GEMMs Transformer
Engine's userbuffers overlap them with (`SoftwareSpec.tp_comm_overlap`), and what the layer's
time becomes (`cost_models.tp_overlap` prices each pair).

Under Megatron-SP a transformer layer's tensor-parallel block is an all-gather of the sequence-split
activation into column-parallel linears and a reduce-scatter out of a row-parallel linear after
them (Megatron-Core's TELayerNormColumnParallelLinear / TERowParallelLinear, TE's `ub_name` "qkv" /
"proj" in the attention block and "fc1" / "fc2" in the MLP). Read off the solution's collectives
(`Collective.tensor`: the op whose output, or its gradient, each moves) in the layer's program
order: a forward all-gather read by linears opens a block, the next forward reduce-scatter of a
linear's output closes it; the k-th block is TE's attention pair for k = 0 and its MLP pair after.
An all-gather no such reduce-scatter follows (the LM head's, which Megatron-Core runs as its own
ColumnParallelLinear, outside userbuffers) and a collective of no linear (the embedding's
reduce-scatter, an expert block's exchange: TE disables userbuffers for experts) stay as they were.
Per block and micro-batch:

- forward: the all-gather with the column-parallel GEMM(s) (`{qkv,fc1}_fprop`), the reduce-scatter
  with the row-parallel GEMM (`{proj,fc2}_fprop`);
- backward: the input gradient's reduce-scatter with the column-parallel weight-gradient GEMM
  (`{qkv,fc1}_wgrad`), and the all-gather of the layer norm's output that TE runs again for that
  GEMM (LayerNormLinear saves its sequence shard; module/layernorm_linear.py at v1.12, backward:
  `ub_obj_lnout.copy_input_to_ubuf(ln_out, 1)` under ub_bulk_dgrad, else `gather_along_first_dim`),
  which autopar's executor does not run (it keeps the gathered copy), with the input-gradient GEMM
  (`{qkv,fc1}_dgrad`); the output gradient's all-gather with the row-parallel input-gradient GEMM
  (`{proj,fc2}_dgrad`).

A backward GEMM is half its op's backward (`backward_factor`: input and weight gradient, one GEMM
of the forward's size each). What a pair takes beyond its GEMM is its exposed communication; the
GEMM's own slowdown (its chunks, the SMs the overlap takes) is compute.
"""

from __future__ import annotations

from typing import Any

from autopar.capture.graph import OpGraph
from autopar.intra_op.solution import Collective, ShardingSolution
from autopar.schema.software import SoftwareSpec
from cost_models.communication import link_collective_time
from cost_models.tp_overlap import overlapped_time

_KINDS = ("all_gather", "reduce_scatter")


def _linear(g: OpGraph, name: str) -> bool:
    from autopar.inter_op.stage_cost import linear_like

    n = g.node(name)
    return n.kind == "call" and linear_like(g, n) is not None


def tp_overlap_deltas(sol: ShardingSolution, g: OpGraph, nodes: list[str], tp: int, software: SoftwareSpec,
                      cluster: Any, dtype: str) -> dict[str, float]:
    """{"fwd_s", "fwd_comm_s", "bwd_s", "bwd_comm_s": seconds to add to the layer's cost} when
    `software` overlaps its tp collectives (`tp_comm_overlap`); `sol` solved with sequence
    parallelism on a 1-D tp mesh of `tp` ranks, `g` the layer's graph at its micro-batch, `nodes`
    its ops in program order. All zero without the overlap."""
    out = {"fwd_s": 0.0, "fwd_comm_s": 0.0, "bwd_s": 0.0, "bwd_comm_s": 0.0}
    ov = software.tp_comm_overlap
    if not ov or tp <= 1:
        return out
    mine = set(nodes)
    order = {n: i for i, n in enumerate(nodes)}
    readers: dict[str, list[str]] = {}
    for n in nodes:
        node = g.node(n)
        if node.kind != "call":
            continue
        for i in node.inputs:
            if n not in readers.setdefault(i, []):
                readers[i].append(n)
    tpc = [x for x in sol.collectives
           if x.kind in _KINDS and x.phase in ("forward", "backward") and x.tensor and len(x.mesh_axes) == 1]

    def gemm_readers(t: str) -> list[str]:
        return [r for r in readers.get(t, []) if r in mine and _linear(g, r)]

    # forward events in program order: an all-gather read by linears, a reduce-scatter of a linear's output
    events: list[tuple[int, str, Collective]] = []
    for x in tpc:
        if x.phase != "forward":
            continue
        if x.kind == "all_gather" and gemm_readers(x.tensor):
            events.append((min(order[r] for r in gemm_readers(x.tensor)), "ag", x))
        elif x.kind == "reduce_scatter" and x.tensor in mine and _linear(g, x.tensor):
            events.append((order[x.tensor], "rs", x))
    events.sort(key=lambda e: e[0])
    blocks: list[tuple[Collective, Collective]] = []
    open_ag = None
    for _, what, x in events:
        if what == "ag":
            open_ag = x
        elif open_ag is not None:
            blocks.append((open_ag, x))
            open_ag = None
    if not blocks:
        return out

    link = cluster.intra_node
    dev = cluster.device

    def fwd(n: str) -> float:
        ch = sol.op_choices.get(n)
        return ch.forward_s if ch is not None else 0.0

    def half_bwd(n: str) -> float:
        ch = sol.op_choices.get(n)
        return (ch.compute_s - ch.forward_s) / 2.0 if ch is not None else 0.0

    def flops(ns: list[str]) -> float:
        return sum(float(g.node(n).flops or 0.0) for n in ns) / tp

    def price(gemm: str, gemm_s: float, gemm_flops: float, x_kind: str, x_bytes: float, x_s: float,
              phase: str, charged: float | None = None) -> None:
        """Replace the GEMM's `gemm_s` and the collective's `charged` seconds (default: its
        own, `x_s`) by what the pair takes overlapped."""
        cfg = ov.get(gemm)
        if cfg is None or gemm_s <= 0:
            return
        part = lambda f: link_collective_time(x_kind, x_bytes * f, tp, link)  # noqa: E731
        send = link_collective_time("send_recv", x_bytes / tp, 2, link)
        g_eff, total = overlapped_time(cfg, gemm_s, gemm_flops, x_s, tp, dev, dtype, part, send,
                                       reduce_scatter=x_kind == "reduce_scatter")
        key = "fwd" if phase == "forward" else "bwd"
        out[f"{key}_s"] += g_eff - gemm_s
        out[f"{key}_comm_s"] += (total - g_eff) - (x_s if charged is None else charged)

    back = [x for x in tpc if x.phase == "backward"]
    for k, (ag, rs) in enumerate(blocks):
        col, row = ("qkv", "proj") if k == 0 else ("fc1", "fc2")
        cols = gemm_readers(ag.tensor)
        price(f"{col}_fprop", sum(fwd(c) for c in cols), flops(cols), "all_gather", ag.bytes, ag.time_s, "forward")
        price(f"{row}_fprop", fwd(rs.tensor), flops([rs.tensor]), "reduce_scatter", rs.bytes, rs.time_s, "forward")
        wg = sum(half_bwd(c) for c in cols)
        for x in back:
            if x.kind == "reduce_scatter" and x.tensor == ag.tensor:
                price(f"{col}_wgrad", wg, flops(cols), "reduce_scatter", x.bytes, x.time_s, "backward")
                # TE's all-gather of the norm's output again, beside the input-gradient GEMM: not
                # among the solution's collectives (0 charged before), its time the forward's gather's
                price(f"{col}_dgrad", wg, flops(cols), "all_gather", ag.bytes, ag.time_s, "backward", charged=0.0)
            elif x.kind == "all_gather" and x.tensor == rs.tensor:
                price(f"{row}_dgrad", half_bwd(rs.tensor), flops([rs.tensor]), "all_gather", x.bytes, x.time_s,
                      "backward")
    return out
