"""Softmax and log-softmax: the softmax dim stays whole, every other dim may split."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, label_strategies


@register("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", family="softmax",
          follow=True)
def softmax(ctx: OpContext) -> list[Strategy]:
    x = ctx.in_shape(0)
    dim = ctx.node.args[1] if len(ctx.node.args) > 1 else ctx.node.kwargs.get("dim", -1)
    dim = dim % len(x) if x else 0
    labels = [None if i == dim else f"d{i}" for i in range(len(x))]
    return label_strategies(ctx, [labels], [labels])
