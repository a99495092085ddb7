"""Tensor factories (arange, zeros, full, ...): no inputs, so every layout is free (each device
makes its own shard)."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, dims_labels, label_strategies


@register("arange", "zeros", "ones", "full", "empty", "empty_strided", "scalar_tensor", "rand",
          "randn", "randint", "linspace", "eye", "tensor", "new_zeros", "new_ones", "new_full",
          "new_empty", "_local_scalar_dense", family="creation")
def factory(ctx: OpContext) -> list[Strategy]:
    ins = [[None] * len(ctx.in_shape(i)) for i in range(len(ctx.in_metas))]
    return label_strategies(ctx, ins, [dims_labels(len(ctx.out_shape(j))) for j in range(len(ctx.out_metas))])
