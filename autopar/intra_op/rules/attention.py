"""Scaled dot-product attention q[.., Hq, Sq, D], k/v[.., Hkv, Sk, D]: the batch and head dims
may split, the sequence and head dims stay whole (a split query sequence would break the causal
mask). With grouped-query attention (Hq = g * Hkv) a head split must divide both head counts,
so each device keeps whole groups. A mask broadcasts against [.., Hq, Sq, Sk]."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, label_strategies


@register("scaled_dot_product_attention", family="attention")
def sdpa(ctx: OpContext) -> list[Strategy]:
    q = ctx.in_shape(0)
    nb = len(q) - 3
    lead = [f"b{i}" for i in range(nb)] + ["h"]
    ins = [lead + [None, None], lead + [None, None], lead + [None, None]]
    for i in range(3, len(ctx.in_metas)):                 # attn_mask
        m = ctx.in_shape(i)
        full = lead + [None, None]
        off = len(full) - len(m)
        ins.append([None if (d == 1 and q[off + j] != 1) or off + j >= len(q) - 2 else full[off + j]
                    for j, d in enumerate(m)])
    outs = [lead + [None, None]] + [lead + [None] * (len(ctx.out_shape(j)) - len(lead))
                                    for j in range(1, len(ctx.out_metas))]
    return label_strategies(ctx, ins, outs)
