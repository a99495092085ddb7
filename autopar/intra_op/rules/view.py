"""Views and data movement: view/reshape/flatten, transpose/permute, (un)squeeze, expand, split
and chunk, cat/stack, slice/select, getitem.

A reshape splits or merges groups of dims; only the first (non-unit) dim of a group may be
split, and it maps to the first dim of the matching group on the other side. A split along a
split dim is allowed when the tensor's last dim is a projection's output features
(`fused_weight`) and every chunk divides evenly: the weight's rows are then laid out
chunk-interleaved (each device holds its share of every chunk, as Megatron lays out the fused
QKV weight); the solution records it in `param_layouts`."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import (
    OpContext,
    Strategy,
    broadcast_labels,
    dims_labels,
    label_strategies,
    with_partial_passthrough,
)

MATMUL_PRODUCERS = ("linear", "mm", "addmm", "bmm", "baddbmm", "matmul")
_RESHAPES = ("view", "reshape", "_unsafe_view")
_TRANSPOSES = ("t", "transpose", "numpy_T")


def fused_weight(graph, tensor: str) -> list[tuple[str, int]] | None:
    """The parameters whose rows make the last dim of `tensor` (a fused projection's output:
    `linear(x, W, b)`, `addmm(b, x, W)`, `mm`/`matmul(x, W)` with `W` a weight or its
    transpose, seen through reshapes that keep the last dim, as Hugging Face's Conv1D flattens
    its input), as (FQN, the dim of its output features); None where the output is not a
    projection of parameters. Laying those dims out chunk-interleaved makes a split of the
    last dim into chunks local (`param_layouts`)."""
    if graph is None:
        return None
    try:
        n = graph.node(tensor)
        while n.op in _RESHAPES and n.inputs:
            src = graph.node(n.inputs[0])
            if not (src.outputs and n.outputs and src.outputs[0].shape[-1:] == n.outputs[0].shape[-1:]):
                return None
            n = src
    except KeyError:
        return None

    def param(name: str, dim: int) -> tuple[str, int] | None:
        p = graph.node(name)
        if p.kind == "param" and p.fqn:
            return p.fqn, dim
        if p.op in _TRANSPOSES and p.inputs and len(p.outputs[0].shape) == 2:
            q = graph.node(p.inputs[0])
            return (q.fqn, 1 - dim) if q.kind == "param" and q.fqn else None
        return None

    if n.op == "linear" and len(n.inputs) >= 2:
        found = [param(n.inputs[1], 0)] + [param(b, 0) for b in n.inputs[2:3]]
    elif n.op == "addmm" and len(n.inputs) == 3:
        found = [param(n.inputs[2], 1), param(n.inputs[0], 0)]
    elif n.op in ("mm", "matmul") and len(n.inputs) == 2 and len(graph.node(n.inputs[1]).outputs[0].shape) == 2:
        found = [param(n.inputs[1], 1)]
    else:
        return None
    return None if any(f is None for f in found) else found  # type: ignore[return-value]


def _dim(d: int, n: int) -> int:
    return d % n if n else 0


def view_groups(ishape: tuple[int, ...], oshape: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Matching groups of input and output dims with equal products (unit dims attached)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    ni, no = len(ishape), len(oshape)
    while i < ni or j < no:
        gi, gj = [], []
        pi = pj = 1
        while i < ni and ishape[i] == 1 and (j >= no or oshape[j] != 1):
            gi.append(i)
            i += 1
        while j < no and oshape[j] == 1 and (i >= ni or ishape[i] != 1):
            gj.append(j)
            j += 1
        if i < ni:
            gi.append(i)
            pi = ishape[i]
            i += 1
        if j < no:
            gj.append(j)
            pj = oshape[j]
            j += 1
        while pi != pj and (i < ni or j < no):
            if (pi < pj and i < ni) or j >= no:
                pi *= ishape[i]
                gi.append(i)
                i += 1
            else:
                pj *= oshape[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def reshape_labels(ishape, oshape) -> tuple[list, list]:
    li: list = [None] * len(ishape)
    lo: list = [None] * len(oshape)
    for g, (gi, gj) in enumerate(view_groups(tuple(ishape), tuple(oshape))):
        fi = next((d for d in gi if ishape[d] != 1), None)
        fj = next((d for d in gj if oshape[d] != 1), None)
        if fi is not None and fj is not None:
            li[fi] = lo[fj] = f"g{g}"
    return li, lo


def _follow(ctx: OpContext, li, lo) -> list[Strategy]:
    return with_partial_passthrough(ctx, label_strategies(ctx, [li], [lo]))


@register("view", "_unsafe_view", "reshape", "flatten", "unflatten", "view_as", "reshape_as",
          "_reshape_alias", "squeeze", "unsqueeze", family="view", follow=True)
def reshape(ctx: OpContext) -> list[Strategy]:
    li, lo = reshape_labels(ctx.in_shape(0), ctx.out_shape(0))
    return _follow(ctx, li, lo)


@register("transpose", "t", "permute", "movedim", "swapaxes", "numpy_T", family="view", follow=True)
def permute(ctx: OpContext) -> list[Strategy]:
    n = len(ctx.in_shape(0))
    a = ctx.node.args
    if ctx.node.op == "permute":
        perm = [_dim(d, n) for d in a[1]]
    elif ctx.node.op == "movedim":
        src, dst = _dim(a[1], n), _dim(a[2], n)
        perm = [d for d in range(n) if d != src]
        perm.insert(dst, src)
    else:
        d0, d1 = (0, 1) if ctx.node.op in ("t", "numpy_T") or len(a) < 3 else (_dim(a[1], n), _dim(a[2], n))
        perm = list(range(n))
        if n >= 2:
            perm[d0], perm[d1] = perm[d1], perm[d0]
    li = dims_labels(n)
    return _follow(ctx, li, [li[p] for p in perm])


@register("expand", "expand_as", "broadcast_to", family="view", follow=True)
def expand(ctx: OpContext) -> list[Strategy]:
    out = ctx.out_shape(0)
    li = broadcast_labels(ctx.in_shape(0), out)
    return _follow(ctx, li, dims_labels(len(out)))


@register("split", "split_with_sizes", "chunk", "unsafe_split", "tensor_split", "unbind",
          family="view", follow=True)
def split(ctx: OpContext) -> list[Strategy]:
    x = ctx.in_shape(0)
    n = len(x)
    a = ctx.node.args
    op = ctx.node.op
    default = 0
    dim = a[2] if len(a) > 2 else ctx.node.kwargs.get("dim", default)
    if op == "unbind":
        dim = a[1] if len(a) > 1 else ctx.node.kwargs.get("dim", 0)
    dim = _dim(dim, n)
    li = dims_labels(n)
    interleave = (ctx.interleaved_splits and op != "unbind" and dim == n - 1
                  and fused_weight(ctx.graph, ctx.node.inputs[0]) is not None)
    if op == "unbind":
        outs = [li[:dim] + li[dim + 1:] for _ in ctx.out_metas]
        li = li[:dim] + [None] + li[dim + 1:]
        return label_strategies(ctx, [li], outs)
    if not interleave:
        li = li[:dim] + [None] + li[dim + 1:]
    outs = [list(li) for _ in ctx.out_metas]
    sts = label_strategies(ctx, [li], outs)
    for st in sts:
        if any(s == f"S({dim})" for s in st.in_specs[0]):
            st.note = f"interleaved:{dim}:{len(ctx.out_metas)}"
    return sts


@register("getitem", family="view", follow=True)
def getitem(ctx: OpContext) -> list[Strategy]:
    n = len(ctx.in_shape(0))
    return _follow(ctx, dims_labels(n), dims_labels(n))


@register("cat", "concat", "concatenate", "stack", family="view")
def cat(ctx: OpContext) -> list[Strategy]:
    out = ctx.out_shape(0)
    a = ctx.node.args
    dim = a[1] if len(a) > 1 else ctx.node.kwargs.get("dim", 0)
    if ctx.node.op == "stack":
        dim = _dim(dim, len(out))
        lo = dims_labels(len(out))
        lo[dim] = None
        li = [l for k, l in enumerate(lo) if k != dim]
    else:
        dim = _dim(dim, len(out))
        lo = dims_labels(len(out))
        lo[dim] = None
        li = list(lo)
    ins = []
    for i in range(len(ctx.in_metas)):
        s = ctx.in_shape(i)
        ins.append(li if len(s) == len(li) else [None] * len(s))   # legacy empty tensors
    return label_strategies(ctx, ins, [lo])


@register("slice", "narrow", "select", family="view", follow=True)
def slice_(ctx: OpContext) -> list[Strategy]:
    x = ctx.in_shape(0)
    n = len(x)
    a = ctx.node.args
    dim = _dim(a[1] if len(a) > 1 else ctx.node.kwargs.get("dim", 0), n)
    li = dims_labels(n)
    if ctx.node.op == "select":
        li[dim] = None
        lo = [l for k, l in enumerate(dims_labels(n)) if k != dim]
    else:
        lo = list(li)
        if ctx.out_shape(0)[dim] != x[dim]:
            li[dim] = lo[dim] = None
    return _follow(ctx, li, lo)


@register("repeat", "tile", family="view", follow=True)
def repeat(ctx: OpContext) -> list[Strategy]:
    """`x.repeat(sizes)` tiles `x`: a dim repeated once keeps its layout (each device tiles its
    shard alike); a tiled dim, or one the sizes add in front, is whole (a shard of the tiling
    is not the tiling of a shard)."""
    x = ctx.in_shape(0)
    out = ctx.out_shape(0)
    a = ctx.node.args
    sizes = list(a[1] if len(a) > 1 else ctx.node.kwargs.get("repeats" if ctx.node.op == "repeat" else "dims"))
    lead = len(out) - len(x)
    if ctx.node.op == "tile" and len(sizes) < len(out):
        sizes = [1] * (len(out) - len(sizes)) + sizes      # tile pads the repeats in front
    li = dims_labels(len(x))
    lo = [None] * lead + [li[i] if int(sizes[lead + i]) == 1 else None for i in range(len(x))]
    li = [li[i] if int(sizes[lead + i]) == 1 else None for i in range(len(x))]
    return _follow(ctx, li, lo)


@register("repeat_interleave", family="view", follow=True)
def repeat_interleave(ctx: OpContext) -> list[Strategy]:
    """`x.repeat_interleave(r, dim)` with a whole number `r`: every dim keeps its layout, the
    repeated one included (a device's rows, each repeated r times, are its share of the result);
    repeats given as a tensor, or no dim (the flattened tensor), leave nothing split."""
    x = ctx.in_shape(0)
    a = ctx.node.args
    reps = a[1] if len(a) > 1 else ctx.node.kwargs.get("repeats")
    dim = a[2] if len(a) > 2 else ctx.node.kwargs.get("dim")
    if not isinstance(reps, int) or dim is None or len(ctx.in_metas) != 1:
        return label_strategies(ctx, [[None] * len(x) for _ in ctx.in_metas], [[None] * len(ctx.out_shape(0))])
    li = dims_labels(len(x))
    return _follow(ctx, li, list(li))
