"""CUDA's autocast op lists on a CPU program: `autopar verify` of a plan for GPUs, on this machine.

Under mixed precision the runtime computes under `torch.autocast(device_type)`, and which ops run
in fp32 is the device's list: CUDA runs layer norm, softmax, exp, rsqrt, ... in fp32 (saving the
fp32 copy of the input and the fp32 output), CPU keeps them in the 2-byte dtype
(`cost_models.memory`, module docstring). Verify builds and steps ranks on CPU fake tensors (a
CPU-only torch cannot fake CUDA tensors through autocast: its casts need a CUDA device guard), so
a GPU plan's ranks would hold what the CPU program holds, not what they hold on the GPU.
`cuda_autocast_lists()` runs, while CPU autocast is on, each op of CUDA's fp32 list
(`cost_models.memory.CUDA_FP32_OPS`) as CUDA's autocast does: its floating inputs cast to fp32
first (an autograd-recorded copy, as autocast's), the op then in fp32. A `TorchFunctionMode`:
it sees the ops the executor calls (`torch.ops.aten...`, module code), above autograd as
autocast is; backward ops are not autocast on either device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from cost_models.memory import CUDA_FP32_OPS

__all__ = ["cuda_autocast_lists"]


def _op_name(func: Any) -> str:
    """aten's name of an op (`torch.ops.aten.layer_norm.default` -> layer_norm), or the
    function's (`torch.layer_norm`, `F.softmax`, `Tensor.softmax`)."""
    return str(getattr(func, "_opname", None) or getattr(func, "__name__", ""))


class cuda_autocast_lists(TorchFunctionMode):
    """While active (and CPU autocast on): ops of CUDA's fp32 list run on fp32 inputs."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cpu") or _op_name(func) not in CUDA_FP32_OPS:
            return func(*args, **kwargs)
        low = torch.get_autocast_dtype("cpu")

        def up(x: Any) -> Any:
            return x.to(torch.float32) if isinstance(x, torch.Tensor) and x.dtype == low else x

        args, kwargs = tree_map(up, (args, kwargs))
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)
