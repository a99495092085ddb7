"""LayerNorm / RMSNorm: the normalised (trailing) dims stay whole, every leading dim may split;
the affine weight and bias are replicated and their gradients are partial under a split of the
leading dims (gradient all-reduce). RMSNorm written out (pow, mean, rsqrt, mul) is covered by
the element-wise and reduction rules."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, label_strategies


def _norm(ctx: OpContext, normalized: list) -> list[Strategy]:
    x = ctx.in_shape(0)
    k = len(normalized)
    lead = [f"d{i}" for i in range(len(x) - k)]
    ins = [lead + [None] * k] + [[None] * len(ctx.in_shape(i)) for i in range(1, len(ctx.in_metas))]
    outs = [lead + [None] * (len(ctx.out_shape(j)) - len(lead)) for j in range(len(ctx.out_metas))]
    return label_strategies(ctx, ins, outs)


@register("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm_last",
          family="norm")
def layer_norm(ctx: OpContext) -> list[Strategy]:
    ns = ctx.node.args[1]
    ns = [ns] if isinstance(ns, int) else list(ns)
    return _norm(ctx, ns)
