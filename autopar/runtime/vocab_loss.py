"""Vocabulary-parallel cross-entropy: the loss of logits sharded over the classes (a
vocabulary-parallel output layer) computed where the shards lie, as Megatron does, instead of
all-gathering (tokens x vocab) logits first.

The arithmetic is torch's `loss_parallel` (DTensor handlers for log-softmax and NLL: per row an
all-reduce of the max, of the sum of exponentials and of the target logit; the backward needs
none). Its handlers are global while active and its log-softmax backward is only right when
paired with its NLL backward, so it is not switched on for a whole forward and backward here:

* `VocabParallelLoss` (a `TorchFunctionMode`, active around a stage's forward and the loss)
  routes a `cross_entropy` call whose input is a DTensor sharded on the class dim of a 1-D mesh
  (the tp mesh; `loss_parallel`'s "mean" needs one) to `vocab_parallel_cross_entropy`, and every
  other call on unchanged;
* `vocab_parallel_cross_entropy` enables the handlers for the forward of that one call, and for
  its backward only: identity autograd nodes on its output (reached first in the backward) and
  on its input (reached last) switch them on and off.

Unsupported arguments (label smoothing, class-probability targets, the deprecated
`size_average`/`reduce`) and logits that are whole, partial or on a larger mesh take DTensor's
ordinary path (which gathers them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

_OPEN: list[Any] = []   # one `loss_parallel` context per loss that needs its handlers now


def _enable() -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    if not _OPEN:
        cm = loss_parallel()
        cm.__enter__()
        _OPEN.append(cm)
    else:
        _OPEN.append(_OPEN[0])


def _disable() -> None:
    cm = _OPEN.pop()
    if not _OPEN:
        cm.__exit__(None, None, None)


class _ScopeInBackward(torch.autograd.Function):
    """Identity whose backward switches the handlers on (`on=True`: placed on the loss, reached
    before the loss's own backward) or off (placed on the loss input, reached after it). On the
    loss it returns a copy (a scalar): a model may add to its loss in place (Hugging Face's MoE
    classes: `loss += coef * aux_loss`), which autograd forbids on a custom Function's view."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, on: bool) -> torch.Tensor:
        ctx.on = on
        return x.clone() if on else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        (_enable if ctx.on else _disable)()
        return g, None


def class_sharded(x: Any, cdim: int | None = None) -> bool:
    """Whether `x` is a DTensor sharded on its class dim `cdim` (default: 1, or 0 for 1-D, as
    `F.cross_entropy` reads it; -1 for logits before flattening) over a 1-D mesh: logits
    `vocab_parallel_cross_entropy` takes without gathering them."""
    if not isinstance(x, DTensor) or x.dim() == 0 or x.device_mesh.ndim != 1:
        return False
    cdim = (1 if x.dim() >= 2 else 0) if cdim is None else cdim % x.dim()
    p = x.placements[0]
    return p.is_shard() and p.dim % x.dim() == cdim


def _supported(args: tuple, kwargs: dict) -> bool:
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
             "label_smoothing")
    a = dict(zip(names, args), **kwargs)
    x, t = a.get("input"), a.get("target")
    return (class_sharded(x) and isinstance(t, torch.Tensor) and not t.is_floating_point()
            and a.get("size_average") is None and a.get("reduce") is None
            and float(a.get("label_smoothing", 0.0)) == 0.0
            and (a.get("weight") is None or not isinstance(a["weight"], DTensor)
                 or all(p.is_replicate() for p in a["weight"].placements)))


def loss_parallel_call(fn: Any, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`fn(input, *args, **kwargs)` - a cross-entropy or NLL loss (functional or aten) of
    class-sharded DTensor logits - under torch's loss-parallel handlers, in its forward and,
    through identity nodes on its input and output, in its backward only."""
    if input.requires_grad and torch.is_grad_enabled():
        input = _ScopeInBackward.apply(input, False)
    _enable()
    try:
        loss = fn(input, *args, **kwargs)
    finally:
        _disable()
    if loss.requires_grad:
        loss = _ScopeInBackward.apply(loss, True)
    return loss


def vocab_parallel_cross_entropy(input: torch.Tensor, target: torch.Tensor, *args: Any,
                                 **kwargs: Any) -> torch.Tensor:
    """`F.cross_entropy` of class-sharded DTensor logits without gathering them (arguments as
    `F.cross_entropy`); returns a replicated DTensor, equal to the one-device loss."""
    return loss_parallel_call(F.cross_entropy, input, target, *args, **kwargs)


def _aten_supported(args: tuple, kwargs: dict) -> bool:
    """`_supported` for `aten.cross_entropy_loss(self, target, weight, reduction, ignore_index,
    label_smoothing)`, the call a traced program makes (a pipeline chunk cut from the trace)."""
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    a = dict(zip(names, args), **kwargs)
    return _supported((), {k: v for k, v in a.items() if k != "reduction"})


class VocabParallelLoss(TorchFunctionMode):
    """While active, a cross-entropy of class-sharded DTensor logits (`F.cross_entropy`, or
    `aten.cross_entropy_loss` as a traced program calls it) runs vocabulary-parallel
    (`loss_parallel_call`); every other call is unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy and _supported(args, kwargs):
            return vocab_parallel_cross_entropy(*args, **kwargs)
        if func is torch.ops.aten.cross_entropy_loss.default and _aten_supported(args, kwargs):
            return loss_parallel_call(func, *args, **kwargs)
        return func(*args, **kwargs)
