"""Fake-tensor kernels where torch's own do not match what the device runs (`autopar verify`
builds and steps ranks on CPU fake tensors).

* `aten._grouped_mm` on CPU: torch 2.13's meta kernel (`_meta_grouped_mm_common`) applies the
  CUDA kernel's bf16-only check to every device, but the CPU kernel takes fp32 and fp16 as well
  (`torch._grouped_mm(x, w, offs=offs)` in fp32 runs on CPU). Hugging Face's grouped experts call
  it on CPU in the weights' dtype (`integrations.moe._grouped_mm`: no fallback on CPU since torch
  2.10), so an fp32 Mixtral ran on one process but failed in verify ("Expected inputs of BF16
  type"). On a CPU fake tensor of another dtype the output is made here, as the CPU kernel makes
  it (contiguous, `out_dtype` or the inputs' dtype); bf16 and other devices keep torch's kernel.

`install()` registers them once (idempotent); `verify` calls it before building a rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["install"]

_installed = False


def _grouped_mm_out_shape(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor]) -> list:
    """The output's shape, as torch's meta kernel (`_create_grouped_mm_output_tensor`) makes it."""
    if a.dim() == 2 and b.dim() == 2:
        return [offs.size(0) if offs is not None else 1, a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _grouped_mm_cpu(fake_mode: Any, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor,
                    offs: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                    out_dtype: Optional[torch.dtype] = None) -> Any:
    if mat_a.device.type != "cpu" or (mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16):
        return NotImplemented           # torch's meta kernel
    torch._check(mat_a.dtype == mat_b.dtype,
                 lambda: f"grouped_mm: mat_a.dtype={mat_a.dtype} and mat_b.dtype={mat_b.dtype} differ")
    torch._check(mat_a.dtype.is_floating_point, lambda: f"grouped_mm: {mat_a.dtype} is not a floating dtype")
    for name, m in (("mat_a", mat_a), ("mat_b", mat_b)):     # the CPU kernel's stride check
        lead = m.stride(-2) if m.stride(-1) == 1 else m.stride(-1)
        torch._check(lead * m.element_size() % 16 == 0,
                     lambda name=name: f"grouped_mm: {name}'s strides should be multiples of 16 bytes")
    with fake_mode:
        return torch.empty(_grouped_mm_out_shape(mat_a, mat_b, offs), dtype=out_dtype or mat_a.dtype,
                           device=mat_a.device)


def install() -> None:
    """Register the fake kernels above with torch's fake-tensor mode (once per process)."""
    global _installed
    if _installed:
        return
    from torch._subclasses import fake_impls

    op = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)
    if op is not None and op not in fake_impls.op_implementations_dict:
        fake_impls.register_op_impl(op)(_grouped_mm_cpu)
    _installed = True
