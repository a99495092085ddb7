"""Element-wise ops with broadcasting: every output dim may split; an input broadcast along a
dim (size 1 or missing) is replicated there and its gradient is partial (the bias case).
Ops linear in a single tensor input (casts, negation, scaling by a constant) also pass a
partial input through as a partial output."""

from __future__ import annotations

from autopar.capture.graph import Ref
from autopar.intra_op.rules import register
from autopar.intra_op.strategy import (
    OpContext,
    Strategy,
    broadcast_labels,
    dims_labels,
    label_strategies,
    with_partial_passthrough,
)

UNARY = ("relu", "gelu", "silu", "tanh", "sigmoid", "exp", "log", "log1p", "expm1", "rsqrt", "sqrt",
         "reciprocal", "cos", "sin", "abs", "erf", "square", "sign", "floor", "ceil", "round",
         "logical_not", "bitwise_not", "isnan", "isinf", "hardtanh", "leaky_relu", "elu",
         "softplus", "mish", "hardswish", "hardsigmoid", "relu6", "dropout", "native_dropout",
         "feature_dropout", "alpha_dropout", "clamp", "clamp_min", "clamp_max", "fill",
         "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
         "bernoulli", "nan_to_num", "pow", "type_as", "masked_fill", "where", "lerp",
         "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod",
         "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
         "bitwise_and", "bitwise_or", "atan2", "addcmul", "addcdiv", "copy", "copy_", "xlogy",
         "__and__", "__or__", "__xor__", "__invert__", "bitwise_xor", "logical_xor", "masked_fill_",
         "gelu_", "relu_", "add_", "mul_", "div_", "sub_", "fill_", "clamp_", "isin", "float_power",
         "log_sigmoid", "logit", "erfinv", "exp2", "sgn", "trunc", "frac", "heaviside", "hypot")
LINEAR_UNARY = ("neg", "to", "_to_copy", "clone", "contiguous", "alias", "detach",
                "lift_fresh_copy", "positive", "conj")


def _elementwise(ctx: OpContext) -> list[Strategy]:
    out = ctx.out_shape(0)
    ins = [broadcast_labels(ctx.in_shape(i), out) for i in range(len(ctx.in_metas))]
    outs = [dims_labels(len(ctx.out_shape(j))) if ctx.out_shape(j) == out else [None] * len(ctx.out_shape(j))
            for j in range(len(ctx.out_metas))]
    return label_strategies(ctx, ins, outs)


def _single_tensor(ctx: OpContext) -> bool:
    return len(ctx.in_metas) == 1


@register(*UNARY, family="elementwise", follow=True)
def elementwise(ctx: OpContext) -> list[Strategy]:
    sts = _elementwise(ctx)
    op = ctx.node.op
    # x * c, x / c with a constant c are linear in x
    if op in ("mul", "div", "true_divide") and _single_tensor(ctx) and isinstance(ctx.node.args[0], Ref):
        sts = with_partial_passthrough(ctx, sts)
    return sts


@register(*LINEAR_UNARY, family="elementwise", follow=True)
def linear_unary(ctx: OpContext) -> list[Strategy]:
    return with_partial_passthrough(ctx, _elementwise(ctx))


@register("outer", "ger", family="elementwise")
def outer(ctx: OpContext) -> list[Strategy]:
    return label_strategies(ctx, [["i"], ["j"]], [["i", "j"]])


@register("diff", family="elementwise", follow=True)
def diff(ctx: OpContext) -> list[Strategy]:
    """x[..., 1:] - x[..., :-1] along `dim`: that dim stays whole."""
    n = len(ctx.in_shape(0))
    a = ctx.node.args
    dim = (a[2] if len(a) > 2 else ctx.node.kwargs.get("dim", -1)) % n
    ins = [dims_labels(n)[:dim] + [None] + dims_labels(n)[dim + 1:]]
    ins += [[None] * len(ctx.in_shape(i)) for i in range(1, len(ctx.in_metas))]
    return label_strategies(ctx, ins, [ins[0]])


@register("pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
          "replication_pad2d", family="elementwise", follow=True)
def pad(ctx: OpContext) -> list[Strategy]:
    """Padding: the padded (trailing) dims stay whole."""
    n = len(ctx.in_shape(0))
    widths = ctx.node.args[1] if len(ctx.node.args) > 1 else []
    k = len(widths) // 2
    labels = dims_labels(n)[:n - k] + [None] * k
    return label_strategies(ctx, [labels], [labels])


@register("triu", "tril", family="elementwise", follow=True)
def triangle(ctx: OpContext) -> list[Strategy]:
    n = len(ctx.in_shape(0))
    labels = dims_labels(n)[:-2] + [None, None]
    return label_strategies(ctx, [labels], [labels])


@register("broadcast_tensors", family="elementwise")
def broadcast_tensors(ctx: OpContext) -> list[Strategy]:
    out = ctx.out_shape(0)
    ins = [broadcast_labels(ctx.in_shape(i), out) for i in range(len(ctx.in_metas))]
    return label_strategies(ctx, ins, [dims_labels(len(out))] * len(ctx.out_metas))
