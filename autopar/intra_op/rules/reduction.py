"""Reductions: the kept dims may split freely; a split reduced dim leaves a sum (sum, mean)
partial, to be reduced by the consumer; max/min/var/... keep their reduced dims whole."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, dims_labels, label_strategies

SUMMING = ("sum", "mean", "nansum", "nanmean")


def _reduced_dims(ctx: OpContext) -> tuple[list[int], bool]:
    n = len(ctx.in_shape(0))
    a = ctx.node.args
    dims = a[1] if len(a) > 1 else ctx.node.kwargs.get("dim")
    keep = a[2] if len(a) > 2 and isinstance(a[2], bool) else ctx.node.kwargs.get("keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0) or not isinstance(dims, (int, list, tuple)):
        return list(range(n)), bool(keep)
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % n for d in dims}) if n else [], bool(keep)


@register(*SUMMING, "amax", "amin", "max", "min", "argmax", "argmin", "var", "std", "var_mean",
          "std_mean", "norm", "linalg_vector_norm", "logsumexp", "prod", "all", "any", "count_nonzero",
          "cumsum", family="reduction")
def reduction(ctx: OpContext) -> list[Strategy]:
    n = len(ctx.in_shape(0))
    op = ctx.node.op
    if len(ctx.in_metas) == 2 and op in ("max", "min"):          # max.other / min.other
        from autopar.intra_op.rules.elementwise import elementwise

        return elementwise(ctx)
    if op == "cumsum":
        d = ctx.node.args[1] % n
        li = dims_labels(n)
        li[d] = None
        return label_strategies(ctx, [li], [li])
    red, keep = _reduced_dims(ctx)
    li = dims_labels(n)
    summing = op in SUMMING
    if not summing:
        for d in red:
            li[d] = None
    lo = [None if k in red else l for k, l in enumerate(li)] if keep else [l for k, l in enumerate(li) if k not in red]
    outs = [lo if len(ctx.out_shape(j)) == len(lo) else [None] * len(ctx.out_shape(j))
            for j in range(len(ctx.out_metas))]
    return label_strategies(ctx, [li], outs, reduced=[f"d{d}" for d in red] if summing else [])


@register("topk", "sort", "argsort", "kthvalue", "mode", "median", "cummax", "cummin", family="reduction")
def along_dim(ctx: OpContext) -> list[Strategy]:
    """Ops that work along one dim (sort, top-k): that dim stays whole, the others may split."""
    x = ctx.in_shape(0)
    n = len(x)
    a = ctx.node.args
    op = ctx.node.op
    pos = {"topk": 2, "kthvalue": 2}.get(op, 1)
    dim = a[pos] if len(a) > pos and isinstance(a[pos], int) else ctx.node.kwargs.get("dim", -1)
    dim = dim % n if n else 0
    li = dims_labels(n)
    li[dim] = None
    outs = []
    for j in range(len(ctx.out_metas)):
        o = ctx.out_shape(j)
        outs.append(li if len(o) == n
                    else [l for k, l in enumerate(li) if k != dim] if len(o) == n - 1
                    else [None] * len(o))
    return label_strategies(ctx, [li], outs)
