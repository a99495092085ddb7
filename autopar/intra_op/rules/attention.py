"""Scaled dot-product attention q[.., Hq, Sq, D], k/v[.., Hkv, Sk, D]: the batch and head dims
may split, the sequence and head dims stay whole (a split query sequence would break the causal
mask). With grouped-query attention (Hq = g * Hkv) a head split `h` must divide both head counts,
so each device keeps whole groups. A mask broadcasts against [.., Hq, Sq, Sk].

Where the tensor-parallel degree exceeds the KV heads (Llama 3 with 8 at tp 16, llama-small's 2
at tp 4, multi-query attention's 1), Megatron splits the query heads only: `hq@axis` shards q and
the output by heads, K and V stay replicated, and each device reads the one KV head its query
heads share (query head i uses KV head i // g; the executor slices it locally, no forward
collective). The K and V gradients are then partial over those axes (each device's covers its KV
head), reduced on the edge to their producer like a column-parallel linear's input. Offered only
where `h` cannot take the axes (Hkv does not divide by them) and every device's query heads fall
in one KV head (the axes' size divides by Hkv)."""

from __future__ import annotations

import math

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, label_strategies


def _labels(ctx: OpContext, head_q: str, head_kv):
    q = ctx.in_shape(0)
    nb = len(q) - 3
    lead = [f"b{i}" for i in range(nb)]
    lq, lkv = lead + [head_q, None, None], lead + [head_kv, None, None]
    ins = [lq, lkv, lkv]
    for i in range(3, len(ctx.in_metas)):                 # attn_mask
        m = ctx.in_shape(i)
        off = len(lq) - len(m)
        ins.append([None if (d == 1 and q[off + j] != 1) or off + j >= len(q) - 2 else lq[off + j]
                    for j, d in enumerate(m)])
    outs = [lq] + [(lead + [head_q]) + [None] * (len(ctx.out_shape(j)) - nb - 1)
                   for j in range(1, len(ctx.out_metas))]
    return ins, outs


def query_head_axes(strategy_name: str) -> list[int]:
    """The mesh axes a strategy splits the query heads only over (`hq@a`)."""
    return [int(t[3:]) for t in strategy_name.split() if t.startswith("hq@")]


@register("scaled_dot_product_attention", family="attention")
def sdpa(ctx: OpContext) -> list[Strategy]:
    ins, outs = _labels(ctx, "h", "h")
    out = label_strategies(ctx, ins, outs)
    hq, hkv = ctx.in_shape(0)[-3], ctx.in_shape(1)[-3]
    if hkv == hq or hq % hkv:
        return out

    def query_heads_only(assign: dict, st: Strategy):
        ways = math.prod(ctx.mesh_shape[a] for a, lab in assign.items() if lab == "hq")
        if ways == 1 or ways % hkv or hkv % ways == 0:
            return None          # no hq axis, a device's heads span KV heads, or `h` does it
        return st

    ins, outs = _labels(ctx, "hq", None)
    return out + label_strategies(ctx, ins, outs, extra=query_heads_only)
