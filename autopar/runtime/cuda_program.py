"""What a GPU rank runs where the CPU program differs: `autopar verify` of a plan for GPUs.

Verify builds and steps ranks on CPU fake tensors (a CPU-only torch cannot fake CUDA tensors
through autocast: its casts need a CUDA device guard), so a GPU plan's ranks would hold what the
CPU program holds. Two differences change what a step holds, and `cuda_program()` runs both as
CUDA does, for the ops the executor calls (a `TorchFunctionMode`: it sees `torch.ops.aten...`
and module code, above autograd as autocast is; backward ops are not autocast on either device;
not while the model's program is captured, `torch.compiler.is_exporting()`):

* autocast's op lists: under mixed precision CUDA runs layer norm, softmax, exp, rsqrt, ... in
  fp32 (saving the fp32 copy of the input and the fp32 output), CPU keeps them in the 2-byte
  dtype (`cost_models.memory`, module docstring). While CPU autocast is on, each op of CUDA's
  fp32 list (`cost_models.memory.CUDA_FP32_OPS`) runs on fp32 inputs, cast first (an
  autograd-recorded copy, as autocast's);
* RMSNorm: `aten.rms_norm` is CUDA's fused kernel there (`_fused_rms_norm`, torch 2.13), whose
  backward keeps the input and one fp32 rstd per row; on CPU it decomposes into fp32 ops that
  keep an fp32 copy of the input and the fp32 normalised tensor (twice the input, 4 B per
  element each, under bf16). `FusedRMSNorm` keeps what the fused kernel keeps and computes the
  same values (its backward is the kernel's formula).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from cost_models.memory import CUDA_FP32_OPS

__all__ = ["cuda_program", "FusedRMSNorm"]


def _op_name(func: Any) -> str:
    """aten's name of an op (`torch.ops.aten.layer_norm.default` -> layer_norm), or the
    function's (`torch.layer_norm`, `F.softmax`, `Tensor.softmax`)."""
    return str(getattr(func, "_opname", None) or getattr(func, "__name__", ""))


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm saving what CUDA's `_fused_rms_norm` saves for its backward: the input and the
    fp32 reciprocal RMS per row (the weight is a parameter, held anyway)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor],
                eps: Optional[float]) -> torch.Tensor:
        dims = tuple(range(-len(normalized_shape), 0))
        xf = x.float()
        e = torch.finfo(torch.float32).eps if eps is None else eps
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + e)
        y = xf * rstd
        if weight is not None:
            y = y * weight
        ctx.dims = dims
        ctx.save_for_backward(x, rstd, weight)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, rstd, weight = ctx.saved_tensors
        dims = ctx.dims
        n = x.float() * rstd
        g = grad.float()
        gw = None
        if weight is not None:
            lead = tuple(range(g.dim() - len(dims)))
            gw = (g * n).sum(lead).to(weight.dtype) if ctx.needs_input_grad[2] else None
            g = g * weight
        gx = rstd * (g - n * (g * n).mean(dims, keepdim=True))
        return gx.to(x.dtype), None, gw, None


class cuda_program(TorchFunctionMode):
    """While active: CUDA's autocast fp32 list (when CPU autocast is on) and its fused RMSNorm.
    Autograd runs a checkpoint's recomputation without the modes of the forward (a
    TorchFunctionMode sees nothing inside the backward): the runtime's checkpoints enter
    `recompute_context()` there, which re-enters this mode when one is active."""

    active = 0          # how many are entered (verify steps one rank at a time in a process)

    def __enter__(self) -> "cuda_program":
        type(self).active += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        type(self).active -= 1
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if torch.compiler.is_exporting():
            return func(*args, **kwargs)      # capturing the model's program: its own ops
        if name == "rms_norm" and args:
            x, shape = args[0], args[1]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            eps = args[3] if len(args) > 3 else kwargs.get("eps")
            return FusedRMSNorm.apply(x, tuple(shape), weight, eps)
        if name not in CUDA_FP32_OPS or not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        low = torch.get_autocast_dtype("cpu")

        def up(x: Any) -> Any:
            return x.to(torch.float32) if isinstance(x, torch.Tensor) and x.dtype == low else x

        args, kwargs = tree_map(up, (args, kwargs))
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)


def recompute_context() -> contextlib.AbstractContextManager:
    """The context a checkpoint's recomputation runs in: `cuda_program()` while one is active
    (so the re-run makes what the forward made: fp32 norms, the fused RMSNorm), else nothing."""
    return cuda_program() if cuda_program.active else contextlib.nullcontext()
