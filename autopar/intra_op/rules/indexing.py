"""Gather-like ops: the indexed dim stays whole, the others may split (index tensors follow)."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, dims_labels, label_strategies


@register("gather", family="indexing")
def gather(ctx: OpContext) -> list[Strategy]:
    n = len(ctx.in_shape(0))
    dim = ctx.node.args[1] % n
    lx = dims_labels(n)
    lx[dim] = None
    li = list(dims_labels(n))
    li[dim] = None
    # index and output share their shape; x's other dims must match them to split
    lx = [l if l is None or ctx.in_shape(0)[k] == ctx.out_shape(0)[k] else None for k, l in enumerate(lx)]
    li = [l if l in lx else None for l in li]
    return label_strategies(ctx, [lx, li], [li])


@register("index_select", family="indexing")
def index_select(ctx: OpContext) -> list[Strategy]:
    n = len(ctx.in_shape(0))
    dim = ctx.node.args[1] % n
    lx = dims_labels(n)
    lx[dim] = None
    lo = list(lx)
    lo[dim] = "i"
    return label_strategies(ctx, [lx, ["i"]], [lo])


@register("index", "_unsafe_index", family="indexing")
def index(ctx: OpContext) -> list[Strategy]:
    """x[idx0, idx1, ...]: dims after the indexed ones (when the index tensors sit at the front
    and are 1-D) keep their labels; the rest stay whole."""
    x = ctx.in_shape(0)
    idx = ctx.node.args[1]
    k = len(idx)
    if any(i is None for i in idx) or any(len(ctx.in_shape(j)) != 1 for j in range(1, len(ctx.in_metas))):
        lx = [None] * len(x)
        return label_strategies(ctx, [lx] + [[None] * len(ctx.in_shape(j)) for j in range(1, len(ctx.in_metas))],
                                [[None] * len(ctx.out_shape(0))])
    lx = [None] * k + dims_labels(len(x))[k:]
    lo = ["i"] + lx[k:]
    return label_strategies(ctx, [lx] + [["i"]] * (len(ctx.in_metas) - 1), [lo])


@register("embedding_dense_backward", "scatter", "scatter_add", "index_put", "index_add",
          family="indexing")
def scatter(ctx: OpContext) -> list[Strategy]:
    return label_strategies(ctx, [[None] * len(ctx.in_shape(i)) for i in range(len(ctx.in_metas))],
                            [[None] * len(ctx.out_shape(j)) for j in range(len(ctx.out_metas))])
