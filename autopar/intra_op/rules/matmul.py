"""Matmul family: every assignment of mesh axes to the batch, row (m), column (n) and
contracted (k) dimensions. A split k leaves the output partial (an all-reduce or
reduce-scatter downstream); a split m or batch leaves the weight's gradient partial
(gradient all-reduce); a split n leaves the input's gradient partial (backward all-reduce).
Megatron's column-parallel linear is `n@axis`, row-parallel `k@axis`, data parallel `b0@axis`."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, label_strategies


def _batch(n: int) -> list[str]:
    return [f"b{i}" for i in range(n)]


def _bias_after_reduction(bias_input: int):
    """The bias is added once, after the contracted dim's reduction: its gradient is the
    (replicated) output gradient summed over rows, so a split k leaves it whole."""
    def extra(assign: dict, st: Strategy) -> Strategy:
        k_axes = {a for a, l in assign.items() if l == "k"}
        gp = list(st.grad_partial)
        gp[bias_input] = tuple(a for a in gp[bias_input] if a not in k_axes)
        st.grad_partial = gp
        return st
    return extra


@register("linear", family="matmul")
def linear(ctx: OpContext) -> list[Strategy]:
    x = ctx.in_shape(0)
    lead = _batch(len(x) - 1)
    ins = [lead + ["k"], ["n", "k"]]
    if len(ctx.in_metas) > 2:
        ins.append(["n"])
        return label_strategies(ctx, ins, [lead + ["n"]], reduced=["k"], extra=_bias_after_reduction(2))
    return label_strategies(ctx, ins, [lead + ["n"]], reduced=["k"])


@register("mm", family="matmul")
def mm(ctx: OpContext) -> list[Strategy]:
    return label_strategies(ctx, [["m", "k"], ["k", "n"]], [["m", "n"]], reduced=["k"])


@register("addmm", family="matmul")
def addmm(ctx: OpContext) -> list[Strategy]:
    bias = ["n"] if len(ctx.in_shape(0)) == 1 else [("m" if ctx.in_shape(0)[0] != 1 else None), "n"]
    return label_strategies(ctx, [bias, ["m", "k"], ["k", "n"]], [["m", "n"]], reduced=["k"],
                            extra=_bias_after_reduction(0))


@register("bmm", family="matmul")
def bmm(ctx: OpContext) -> list[Strategy]:
    return label_strategies(ctx, [["b0", "m", "k"], ["b0", "k", "n"]], [["b0", "m", "n"]], reduced=["k"])


@register("baddbmm", family="matmul")
def baddbmm(ctx: OpContext) -> list[Strategy]:
    s = ctx.in_shape(0)
    full = ["b0", "m", "n"][-len(s):]
    bias = [None if d == 1 else l for d, l in zip(s, full)]
    return label_strategies(ctx, [bias, ["b0", "m", "k"], ["b0", "k", "n"]], [["b0", "m", "n"]], reduced=["k"],
                            extra=_bias_after_reduction(0))


@register("matmul", family="matmul")
def matmul(ctx: OpContext) -> list[Strategy]:
    a, b = ctx.in_shape(0), ctx.in_shape(1)
    out = ctx.out_shape(0)
    nb = len(out) - (0 if len(a) == 1 else 1) - (0 if len(b) == 1 else 1)
    bl = _batch(nb)
    la = (["k"] if len(a) == 1 else [None if d == 1 and o != 1 else l for d, l, o in
                                        zip(a[:-2], bl[nb - (len(a) - 2):], out[nb - (len(a) - 2):nb])]
          + ["m", "k"])
    lb = (["k"] if len(b) == 1 else [None if d == 1 and o != 1 else l for d, l, o in
                                        zip(b[:-2], bl[nb - (len(b) - 2):], out[nb - (len(b) - 2):nb])]
          + ["k", "n"])
    lo = bl + ([] if len(a) == 1 else ["m"]) + ([] if len(b) == 1 else ["n"])
    return label_strategies(ctx, [la, lb], [lo], reduced=["k"])


@register("convolution", "_convolution", family="matmul")
def convolution(ctx: OpContext) -> list[Strategy]:
    nd = len(ctx.in_shape(0))
    sp = [None] * (nd - 2)
    ins = [["n", "c"] + sp, ["o", "c"] + sp]
    if len(ctx.in_metas) > 2:
        ins.append(["o"])
    return label_strategies(ctx, ins, [["n", "o"] + sp], reduced=["c"])
