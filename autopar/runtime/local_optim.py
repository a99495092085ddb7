"""An element-wise optimizer stepped on the local shards of DTensor parameters.

AdamW's update of an element reads only that element's parameter, gradient and state, so run on
a rank's shard of a parameter it gives exactly that shard of the whole update, and on each
replica of a replicated parameter (whose gradients are summed before the step) the same update.
Run over DTensors, each of its ops (about ten per parameter) goes through DTensor's sharding
propagation, 50-100 us an op on a CPU: the tp optimizer step cost 1.3-1.4 times what
`parallelize_module`'s did (README, "Runtime overhead"). `LocalShards` builds the optimizer the
plan's factory made again over plain views of the DTensors' local tensors (the same storage, so
its in-place updates are the parameters'), and hands it the gradients' local tensors before
each step.

Only for optimizers known to be element-wise (`ELEMENTWISE`, exact classes: a subclass may
read whole tensors). Any other optimizer (Adafactor's factored moments, Muon's or Shampoo's
matrix maths, a user's) keeps stepping the DTensors, which is right for any optimizer. The
optimizer's state is then plain local tensors: `checkpoint` stores it as DTensors in the
parameters' layouts (`dtensor_state`), so checkpoints reshard as before.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

ELEMENTWISE: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
                                 torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop)


class LocalShards:
    """`optimizer` (built over `tensors`, some DTensors) rebuilt over their local tensors, with
    the same parameter groups and hyperparameters. `step()` moves the gradients' local tensors
    onto the local views, steps, and drops them again."""

    def __init__(self, optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor]) -> None:
        self.sources: list[torch.Tensor] = list(tensors)
        self.views: list[torch.Tensor] = [
            nn.Parameter(t.to_local().detach(), requires_grad=t.requires_grad) if isinstance(t, DTensor) else t
            for t in self.sources]
        view_of = {id(t): v for t, v in zip(self.sources, self.views)}
        groups = [{**g, "params": [view_of[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        self.optimizer = type(optimizer)(groups)
        self.source_of = {id(v): t for t, v in zip(self.sources, self.views)}

    def step(self) -> None:
        pairs = [(t, v) for t, v in zip(self.sources, self.views) if v is not t]
        for t, v in pairs:
            g = t.grad
            v.grad = None if g is None else (g.to_local() if isinstance(g, DTensor) else g)
        try:
            self.optimizer.step()
        finally:
            for _, v in pairs:
                v.grad = None

    def dtensor_state(self, view: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A state tensor of `view` as the DTensor of its parameter's layout (the same storage),
        for checkpoints; a state not shaped like the shard (a step count) as it is."""
        src = self.source_of.get(id(view))
        if not isinstance(src, DTensor) or value.shape != view.shape:
            return value
        return DTensor.from_local(value, src.device_mesh, src.placements, run_check=False,
                                  shape=src.shape, stride=src.stride())


def localize(optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor]) -> Optional[LocalShards]:
    """`LocalShards` of `optimizer` when it is element-wise (`ELEMENTWISE`) and steps at least
    one DTensor, else None (it keeps stepping what it was given)."""
    if type(optimizer) not in ELEMENTWISE or not any(isinstance(t, DTensor) for t in tensors):
        return None
    if any(bool(st) for st in optimizer.state.values()):
        return None         # already stepped: its state is the DTensors'
    return LocalShards(optimizer, tensors)
