"""DTensor helpers of the executor (`autopar.intra_op.execute`) and the runtime: placements
parsed from the plan's strings ("R" -> Replicate, "S(d)" -> Shard(d), "P" -> Partial), plain
tensors met by DTensor ops treated as replicated, the sharding rules DTensor lacks on CPU (the
fused CPU flash attention), parameter replacement keeping tied parameters tied, and gradients
brought to their parameters' layouts.

Issue 20 (one executor): tensor parallelism runs only op by op as solved. The DTensor-propagation
path that was here (`parallelize`, `distribute_params`: parameters as DTensors with the plan's
placements and DTensor's propagation deciding every activation, patched by `megatron_boundaries`
with module-class and name heuristics such as `_is_norm`) is gone: a plan without per-op layouts
is refused (`runtime.validate`), and plans of the analytic rules carry layouts solved with their
placements pinned (`inter_op.pinned_layouts`).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.schema.errors import PlanError

_SHARD = re.compile(r"^S\((-?\d+)\)$")


def to_placement(p: str | Any):
    """"R" -> Replicate(), "S(d)" -> Shard(d), "P" -> Partial(); placement objects pass through."""
    if not isinstance(p, str):
        return p
    p = p.strip()
    if p == "R":
        return Replicate()
    if p == "P":
        return Partial()
    m = _SHARD.match(p)
    if m:
        return Shard(int(m.group(1)))
    raise PlanError(f"unknown placement {p!r}; use 'R', 'S(d)' or 'P'")


def to_placements(pl: Sequence[str | Any], ndim: int | None = None) -> tuple:
    out = tuple(to_placement(p) for p in pl)
    if ndim is not None:
        fixed = []
        for p in out:
            if isinstance(p, Shard) and p.dim < 0:
                p = Shard(p.dim + ndim)
            fixed.append(p)
        out = tuple(fixed)
    return out


_registered = False


def allow_implicit_replication() -> None:
    """Treat plain tensors met by DTensor ops as replicated, process-wide: the forward of a model
    creates plain tensors (positions, masks) and their backward runs outside any context
    manager, so `implicit_replication()` (a context) is not enough."""
    DTensor._op_dispatcher._allow_implicit_replication = True


def register_extra_strategies() -> None:
    """Sharding rules DTensor lacks on CPU: the fused CPU flash-attention kernels (batch or
    head sharded, or replicated; with a mask, only along the dims it broadcasts over)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # pragma: no cover
        return
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or bwd is None:
        return

    def usable(attn_mask: Any, d: Optional[int]) -> bool:
        # an attention mask (a traced model passes one where eager code said is_causal) goes
        # with the strategy only whole: DTensor does not redistribute a keyword argument, so a
        # split is one along a dim the mask broadcasts over (size 1)
        if attn_mask is None or d is None:
            return True
        shape = getattr(getattr(attn_mask, "tensor_meta", None), "shape", None)
        return shape is not None and len(shape) == 4 and shape[d] == 1

    def mask(attn_mask: Any) -> list:
        return [] if attn_mask is None else [Replicate()]

    @register_sharding(fwd.default)
    def _fwd(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        out = []
        for d in (None, 0, 1):
            if usable(attn_mask, d):
                p = Replicate() if d is None else Shard(d)
                out.append(([p, p], [p, p, p, None, None, *mask(attn_mask)]))
        return out

    @register_sharding(bwd.default)
    def _bwd(g, q, k, v, o, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
        out = []
        for d in (None, 0, 1):
            if usable(attn_mask, d):
                p = Replicate() if d is None else Shard(d)
                out.append(([p, p, p], [p, p, p, p, p, p, None, None, *mask(attn_mask)]))
        return out


def replace_parameters(module: nn.Module, make: Callable[[str, nn.Parameter], nn.Parameter]) -> None:
    """Replace every parameter of `module` by `make(fqn, parameter)`, once per tensor: a
    parameter registered under several names (tied) gets one replacement, made for its first
    name, under all of them."""
    done: dict[int, nn.Parameter] = {}
    for mod_name, mod in list(module.named_modules(remove_duplicate=False)):
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = make(f"{mod_name}.{pname}" if mod_name else pname, p)
            mod._parameters[pname] = done[id(p)]


def grads_to_param_layout(params: Iterable[nn.Parameter]) -> None:
    """Make every DTensor gradient have its parameter's placements (Partial -> all-reduce or
    reduce-scatter), so the optimizer sees consistent shards."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
