"""Tracing a model on fake CUDA tensors with a CPU-only torch.

`execute.meta_program` traces the program a GPU rank runs (verify of a GPU plan) on fake CUDA
tensors, which need no GPU. But a few of `torch.Tensor`'s methods take a CUDA device guard in
their Python binding before they dispatch, and a CPU-only torch has none ("PyTorch is not linked
with support for cuda devices"), though the ops they call have fake kernels: `.contiguous()` on a
tensor that is not (Hugging Face attention's `.transpose(1, 2).contiguous()`) and basic indexing
(`x[:, -k:, :]`, Hugging Face's `slice_logits_to_keep`). `CudaMethods` calls the ops themselves
for those, on CUDA tensors only: `aten.contiguous`, and for an index of ints, slices, `None`
and `...` the `slice`/`select`/`unsqueeze` views that torch's indexing records for it. Anything
else (advanced indexing) goes through the method, and where it fails the caller traces on meta.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaMethods", "needed"]

_A = torch.ops.aten


def needed(device: torch.device) -> bool:
    """Whether tracing for `device` needs `CudaMethods`: a CUDA device and a torch without CUDA."""
    return device.type == "cuda" and not torch.cuda.is_available()


def basic_index(x: torch.Tensor, index: Any) -> Any:
    """`x[index]` as views, for an index of ints, slices, `None` and one `...`; NotImplemented
    for anything else (tensors, lists, bools)."""
    idx = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in idx if i is Ellipsis) > 1:
        return NotImplemented
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        n = sum(1 for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:k] + (slice(None),) * (x.dim() - n) + idx[k + 1:]
    d, out = 0, x
    for i in idx:
        if i is None:
            out = _A.unsqueeze.default(out, d)
            d += 1
        elif isinstance(i, slice):
            whole = i.start in (None, 0) and i.stop is None and i.step in (None, 1)
            if not whole:
                out = _A.slice.Tensor(out, d, i.start, i.stop, 1 if i.step is None else i.step)
            d += 1
        elif isinstance(i, (int, torch.SymInt)) and not isinstance(i, bool):
            out = _A.select.int(out, d, i)
        else:
            return NotImplemented
    # an index that selects all of `x` is an alias of it, as torch's indexing returns it
    return _A.alias.default(x) if out is x else out


class CudaMethods(TorchFunctionMode):
    """`Tensor.contiguous` and basic `Tensor.__getitem__` of CUDA tensors as the ops they call
    (see the module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            if func is torch.Tensor.contiguous:
                return _A.contiguous.default(*args, **kwargs)
            if func is torch.Tensor.__getitem__ and not kwargs:
                out = basic_index(args[0], args[1])
                if out is not NotImplemented:
                    return out
        return func(*args, **kwargs)
