"""Forward FLOPs and bytes moved of one captured op at concrete shapes.

Matrix ops (linear, mm, bmm, matmul, attention, convolution) count 2 FLOPs per multiply-add;
PyTorch's own flop formulas (`torch.utils.flop_counter`) are used where it has them. Other ops
count a few FLOPs per output element. Bytes moved are the bytes read plus written; views,
reshapes and other aliasing ops move nothing.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from autopar.capture.graph import OpNode, Ref, TensorMeta, shapes_of

# ops that alias or only change metadata: no FLOPs, no memory traffic
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "flatten", "unflatten", "split", "split_with_sizes", "chunk",
    "unbind", "slice", "select", "narrow", "alias", "detach", "lift_fresh_copy", "view_as",
    "as_strided", "getitem", "sym_size", "sym_numel", "_assert_tensor_metadata", "movedim",
    "unsafe_split", "numpy_T", "swapaxes", "swapdims",
})

# dropouts that ATen returns their input from (`at::dropout` and its feature/alpha variants
# return `input` itself when p == 0 or not training; `native_dropout` always makes a new tensor)
_ALIASING_DROPOUTS = frozenset({"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})


def identity_dropout(node: OpNode) -> bool:
    """A dropout with p = 0 (Hugging Face's `nn.Dropout(0.0)`) or in eval mode: it returns its
    input, moves nothing and saves nothing."""
    if node.op not in _ALIASING_DROPOUTS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return (isinstance(p, (int, float)) and p == 0) or train is False


def identity_move(node: OpNode) -> bool:
    """A `.to(device)` (export records `aten.to.dtype_layout` with the tensor's own dtype and the
    device it is on, Hugging Face's `position_embeds.to(inputs_embeds.device)`): `Tensor.to`
    returns the tensor itself, so it moves nothing. A `.to(dtype)` (`aten.to.dtype`) is not one:
    in a capture (fp32) it cannot be told from an upcast a mixed-precision run makes."""
    return (node.target == "aten.to.dtype_layout" and node.kwargs.get("device") is not None
            and bool(node.outputs) and node.kwargs.get("dtype") == node.outputs[0].dtype)


def is_view(node: OpNode) -> bool:
    """An op whose output aliases its input (a view, a getitem, an identity dropout or device
    move): no FLOPs, no memory traffic, nothing saved; its output's storage is its input's."""
    return node.op in VIEW_OPS or node.target == "getitem" or identity_dropout(node) or identity_move(node)


# software that runs a cross-entropy as one fused kernel (`SoftwareSpec.loss_kernel`) marks the
# loss in its captured graph by this overload of its target (`cost_models.fused_loss`)
FUSED_OVERLOAD = "fused"
FUSED_LOSS_OPS = frozenset({"cross_entropy_loss"})


# software that runs the eager cross-entropy on the 2-byte logits without upcasting them
# (`SoftwareSpec.loss_kernel` "half") marks the loss by this overload (`cost_models.fused_loss`)
HALF_OVERLOAD = "half"


def is_fused_loss(node: OpNode) -> bool:
    """Whether `node` is a cross-entropy `cost_models.fused_loss.fuse_losses` marked as one kernel."""
    return node.op in FUSED_LOSS_OPS and node.target.endswith("." + FUSED_OVERLOAD)


def is_half_loss(node: OpNode) -> bool:
    """Whether `node` is a cross-entropy `cost_models.fused_loss.fuse_losses` marked as run on the
    2-byte logits (`HALF_OVERLOAD`)."""
    return node.op in FUSED_LOSS_OPS and node.target.endswith("." + HALF_OVERLOAD)


# losses reduce their input to a scalar: their work is per input element
LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "mse_loss", "l1_loss",
                    "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                    "kl_div", "soft_margin_loss", "multilabel_margin_loss"})

# FLOPs per output element for common non-matrix ops (per input element for reductions and
# losses); transcendental ones count the few operations their approximations take (gelu's tanh
# form: cube, multiply-adds, tanh, and the final product)
PER_ELEMENT = {"softmax": 5, "_softmax": 5, "log_softmax": 5, "_log_softmax": 5, "layer_norm": 8,
               "native_layer_norm": 8, "rms_norm": 6, "batch_norm": 8,
               "_native_batch_norm_legit": 8, "_native_batch_norm_legit_no_training": 8,
               "native_batch_norm": 8, "group_norm": 8, "native_group_norm": 8, "instance_norm": 8,
               "gelu": 18, "silu": 6, "tanh": 10, "sigmoid": 5,
               "exp": 2, "rsqrt": 2, "pow": 2, "dropout": 2, "native_dropout": 2,
               "cross_entropy_loss": 6, "nll_loss": 1, "embedding": 0, "gather": 0, "index": 0,
               "index_select": 0, "scatter": 0, "cat": 0, "clone": 0, "contiguous": 0, "_to_copy": 0,
               "to": 0, "copy_": 0, "zeros_like": 0, "ones_like": 0, "full": 0, "arange": 0,
               "zeros": 0, "ones": 0, "empty": 0, "new_zeros": 0, "new_ones": 0, "tril": 1, "triu": 1}


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def matmul_flops(a: tuple, b: tuple) -> float:
    """2*M*N*K (times batch) for torch.matmul semantics with broadcasting."""
    a, b = list(a), list(b)
    if len(a) == 1:
        a = [1] + a
    if len(b) == 1:
        b = b + [1]
    m, k = a[-2], a[-1]
    n = b[-1]
    batch = [max(x, y) for x, y in zip([1] * (max(len(a), len(b)) - len(a)) + a[:-2],
                                        [1] * (max(len(a), len(b)) - len(b)) + b[:-2])]
    return 2.0 * _numel(batch) * m * n * k


def attention_flops(q: tuple, k: tuple, v: tuple) -> float:
    """Scaled dot-product attention: QK^T and PV, 2 FLOPs per MAC (causality not discounted,
    as in the Megatron FLOP formula)."""
    *bq, sq, d = q
    *_, sk, dv = v
    batch = _numel(bq)
    return 2.0 * batch * sq * sk * d + 2.0 * batch * sq * sk * dv


def node_cost(node: OpNode, metas: dict[str, list[TensorMeta]]) -> tuple[float, float]:
    """(forward FLOPs, bytes moved) of `node` at the concrete shapes in `metas`."""
    op = node.op
    if is_view(node):
        return 0.0, 0.0
    in_metas = [metas[i][0] for i in node.inputs if metas.get(i)]
    out_bytes = sum(o.nbytes for o in node.outputs)
    in_bytes = sum(m.nbytes for m in in_metas)
    if op in ("embedding", "index_select", "gather", "index"):
        in_bytes = sum(m.nbytes for m in in_metas[1:]) + out_bytes   # rows actually read
    if op == "cross_entropy_loss" and in_metas and not is_fused_loss(node):
        # eager: log_softmax writes the log-probabilities (the logits' size) that nll_loss picks
        # from; a fused kernel (`cost_models.fused_loss`) reads the logits alone
        in_bytes += in_metas[0].nbytes
    flops = _matrix_flops(node, metas)
    if flops is None:
        out_el = sum(o.numel for o in node.outputs)
        per = PER_ELEMENT.get(op, 1)
        if op in ("sum", "mean", "amax", "max", "min", "var", "std", "norm", "cumsum") or op in LOSSES:
            out_el = sum(m.numel for m in in_metas[:1]) or out_el
        flops = float(per * out_el)
    return flops, float(in_bytes + out_bytes)


def _matrix_flops(node: OpNode, metas: dict[str, list[TensorMeta]]) -> float | None:
    op = node.op
    shp = lambda r: tuple(int(d) for d in metas[r.name][0].shape) if isinstance(r, Ref) else None  # noqa: E731
    a = node.args
    if op == "linear":
        x, w = shp(a[0]), shp(a[1])
        return 2.0 * _numel(x[:-1]) * x[-1] * w[0] + (_numel(x[:-1]) * w[0] if len(a) > 2 and a[2] is not None else 0)
    if op in ("matmul", "mm", "bmm"):
        return matmul_flops(shp(a[0]), shp(a[1]))
    if op in ("addmm", "baddbmm"):
        return matmul_flops(shp(a[1]), shp(a[2])) + _numel(node.outputs[0].shape)
    if op == "scaled_dot_product_attention":
        return attention_flops(shp(a[0]), shp(a[1]), shp(a[2]))
    if op in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
              "conv_transpose2d", "conv_transpose3d") and len(a) >= 2 and node.outputs:
        # 2 * output elements * (input channels per group) * kernel size; for a transposed
        # convolution the same product counted over the input (weight is (C_in, C_out/g, *k))
        w = shp(a[1])
        if w is not None and len(w) >= 3:
            kernel = _numel(w[2:])
            if op.startswith("conv_transpose") or (op in ("convolution", "_convolution") and len(a) > 6
                                                   and a[6] is True):
                x = shp(a[0])
                return 2.0 * _numel(x) * (w[1]) * kernel
            return 2.0 * _numel(node.outputs[0].shape) * w[1] * kernel
    if "grouped_mm" in node.target and len(a) >= 2 and isinstance(a[0], Ref) and isinstance(a[1], Ref):
        # grouped GEMM of routed tokens (S, K) against per-expert weights (E, K, N): each token
        # row meets one expert's (K, N) matrix (mixture-of-experts layers)
        x, w = shp(a[0]), shp(a[1])
        if len(x) == 2 and len(w) == 3:
            return 2.0 * x[0] * x[1] * w[-1]
    try:
        import torch
        from torch.utils.flop_counter import flop_registry

        packet = getattr(torch.ops.aten, op, None)
        if packet is not None and packet in flop_registry:
            out = torch.Size([int(d) for d in node.outputs[0].shape]) if node.outputs else None
            return float(flop_registry[packet](*shapes_of(node.args, metas),
                                               **shapes_of(node.kwargs, metas), out_val=out))
    except Exception as e:  # noqa: BLE001 - said below, and the per-element count stands in
        # torch's formula does not fit this call's arguments (an unusual signature): the op is
        # counted per element instead, and the user is told once per op
        if op not in _FORMULA_MISSES:
            _FORMULA_MISSES.add(op)
            warnings.warn(f"autopar.capture: torch's FLOP formula for {op} does not fit its arguments "
                          f"({type(e).__name__}: {str(e)[:120]}); counted per output element instead",
                          stacklevel=2)
        return None
    return None


_FORMULA_MISSES: set[str] = set()   # ops already reported
