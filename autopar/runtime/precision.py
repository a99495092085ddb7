"""Mixed precision as the planner models it (Megatron's, `cost_models.memory.PRECISION_POLICIES`):
a bf16/fp16 plan keeps 2-byte weights and gradients, and an fp32 master copy of the weights
beside AdamW's fp32 moments (16 bytes per parameter; ZeRO-1 4 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3
16/N), and its gradient sync and weight gathers move 2-byte elements.

* ZeRO 0: the model's parameters are cast to the low dtype in place (`cast_parameters_`); the
  optimizer steps fp32 masters (`masters`), fed the synced low-precision gradients and copied
  back into the parameters (`MasterWeights.step`).
* ZeRO-1/2: the flat fp32 shard the sharded optimizer steps is the master; gradients are
  reduce-scattered and the updated shard all-gathered in the low dtype (`engine`).
* ZeRO-3: `fully_shard(..., mp_policy=fsdp_policy(dtype))`: FSDP keeps the fp32 shard as the
  master, all-gathers the weights and reduce-scatters the gradients in the low dtype.

Forward and loss run under `torch.autocast` (norms, softmax and the loss in fp32). Buffers keep
their dtype (a rotary table stays fp32).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def low_dtype(plan_dtype: str) -> Optional[torch.dtype]:
    """The 2-byte compute dtype of a mixed-precision plan, None for fp32."""
    return LOW.get(plan_dtype)


def fsdp_policy(dtype: torch.dtype) -> Any:
    """FSDP2's policy for ZeRO-3 under mixed precision: gather and reduce in `dtype`. Forward
    inputs are left as they come (FSDP would cast floating ones to `dtype`): autocast casts
    what each op reads, as on the other ZeRO stages, so a float target stays fp32 for the loss
    and no bf16 copy of the inputs is kept."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, cast_forward_inputs=False)


def cast_parameters_(params: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
    """Cast floating parameters to `dtype` in place, keeping each Parameter object (modules,
    tied references and hooks still see it). A DTensor's local shard is cast too (assigning
    `.data` would change its dtype only on the surface)."""
    for p in params:
        if not p.is_floating_point() or p.dtype == dtype:
            continue
        if isinstance(p, DTensor):
            torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
        else:
            p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 masters of low-precision parameters (ZeRO 0): `params` must still hold their fp32
    values when this is built; afterwards cast them (`cast_parameters_`)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.masters = [nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
                        for p in self.params]

    def step(self, step: Callable[[], Any]) -> None:
        """Run `step` (an optimizer's, built over the masters) with the parameters' gradients,
        then copy the updated masters into the parameters."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None   # at most one gradient per parameter held: the master's fp32 one
        step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad = None
                p.copy_(m)

    def refresh(self) -> None:
        """After the masters were loaded (a checkpoint): copy them into the parameters."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
