"""Losses. A split batch gives a partial loss (its all-reduce is paid where the loss is
consumed). cross_entropy with split classes is Megatron's vocab-parallel cross-entropy: three
all-reduces of one value per row (max, sum of exponentials, target logit), and every device ends
with the whole loss. nll_loss with split classes gives a partial loss (only the device holding a
row's target contributes)."""

from __future__ import annotations

from typing import Any, Sequence

from autopar.intra_op.placement import REPLICATE
from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, dims_labels, label_strategies

# loss op -> position of its `reduction` argument (0 none, 1 mean, 2 sum); the rules below and
# the solution executor (`intra_op.execute`) read it
REDUCTION_ARG = {"cross_entropy_loss": 3, "nll_loss": 3, "nll_loss_forward": 3, "nll_loss2d": 3,
                 "mse_loss": 2, "l1_loss": 2, "smooth_l1_loss": 2, "huber_loss": 2,
                 "soft_margin_loss": 2, "binary_cross_entropy": 3,
                 "binary_cross_entropy_with_logits": 4, "kl_div": 2}


def reduction_of(op: str, args: Sequence[Any], kwargs: dict) -> int:
    """The reduction a loss call asks for (0 none, 1 mean, 2 sum); 0 for ops not in the table."""
    pos = REDUCTION_ARG.get(op)
    if pos is None:
        return 0
    r = args[pos] if len(args) > pos else kwargs.get("reduction", 1)
    return r if isinstance(r, int) else 1


def _reduction(ctx: OpContext) -> int:
    return reduction_of(ctx.node.op, ctx.node.args, ctx.node.kwargs)


def _class_loss(ctx: OpContext, vocab_parallel: bool) -> list[Strategy]:
    x = ctx.in_shape(0)
    n = len(x)
    cdim = 1 if n >= 2 else 0
    lx = ["c" if d == cdim else f"n{d}" for d in range(n)]
    lt = [l for l in lx if l != "c"]
    ins = [lx, lt] + [["c"] for _ in range(2, len(ctx.in_metas))]      # class weights
    red = _reduction(ctx)
    lo = [] if red != 0 else lt
    reduced = (lt if red != 0 else []) + ["c"]

    def extra(assign: dict, st: Strategy):
        c_axes = tuple(a for a, l in assign.items() if l == "c")
        if not c_axes or not vocab_parallel:
            return st
        rows = 1
        for d, l in enumerate(lx):
            if l != "c":
                k = 1
                for a, ll in assign.items():
                    if ll == l:
                        k *= ctx.mesh_shape[a]
                rows *= x[d] // k
        for _ in range(3):
            st.comms.append(("all_reduce", c_axes, float(rows * 4), "forward"))
        st.out_specs = [tuple(REPLICATE if a in c_axes else p for a, p in enumerate(o)) for o in st.out_specs]
        st.name += " (vocab-parallel)"
        return st

    return label_strategies(ctx, ins, [lo], reduced=reduced, extra=extra)


@register("cross_entropy_loss", family="loss")
def cross_entropy(ctx: OpContext) -> list[Strategy]:
    return _class_loss(ctx, vocab_parallel=True)


@register("nll_loss", "nll_loss_forward", "nll_loss2d", family="loss")
def nll_loss(ctx: OpContext) -> list[Strategy]:
    return _class_loss(ctx, vocab_parallel=False)


@register("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
          "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", family="loss")
def pointwise_loss(ctx: OpContext) -> list[Strategy]:
    out = ctx.in_shape(0)
    labels = dims_labels(len(out))
    ins = [labels if ctx.in_shape(i) == out else [None] * len(ctx.in_shape(i)) for i in range(len(ctx.in_metas))]
    red = _reduction(ctx)
    if red == 0:
        return label_strategies(ctx, ins, [labels])
    return label_strategies(ctx, ins, [[]], reduced=labels)
