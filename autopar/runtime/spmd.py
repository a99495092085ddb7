"""SPMD execution of one stage: parameters as DTensors with the planned placements.

`parallelize(module, mesh, param_placements, input_placements)` turns every parameter named in
`param_placements` into a DTensor on `mesh` ("R" -> Replicate, "S(d)" -> Shard(d), "P" ->
Partial), wraps the forward so that the inputs (this rank's local shards) become DTensors with
`input_placements`, and returns the loss as a plain tensor equal to the one-process loss.

Activations stay DTensors between ops: DTensor's sharding propagation picks each op's output
layout and `redistribute`s an operand where an op needs another layout (for the zoo GPT with the
Megatron placements - qkv/fc weight "S(0)", proj weight "S(1)" on the tp axis - that is the
all-reduce after each row-parallel projection and nothing else: its fused qkv rows are
head-major, so a contiguous row shard holds whole heads; a model whose fused qkv keeps q, k and
v as row blocks, GPT-2's c_attn, pays an all-gather of its output before the head split).
torch's `parallelize_module` with ColwiseParallel/RowwiseParallel is *not* used: it hands local
tensors to the module's own code, which breaks models whose forward reads `x.shape` to split a
fused projection (the zoo GPT and GPT-2 do). Keeping DTensors everywhere is correct for any
placement the ILP may choose.

DTensor reduces a partial sum lazily, where an op first needs it whole; `megatron_boundaries`
(applied by `distribute_params`) reduces it where Megatron does instead - a row-parallel
linear's or vocabulary-parallel embedding's output in the forward, a norm's output gradient in
the backward - without which a Llama (RMSNorm is linear in its input) fails (see there).

Parameters not named in `param_placements` are replicated. Plain tensors created inside the
forward (positions, masks) are treated as replicated (`allow_implicit_replication`, process-wide).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autopar.runtime.vocab_loss import VocabParallelLoss, class_sharded
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


def distribute_params(module: nn.Module, mesh: DeviceMesh,
                      param_placements: dict[str, Sequence[str]], *,
                      aliases: dict[str, str] | None = None, src_data_rank: int | None = 0) -> None:
    """Replace every parameter of `module` by a DTensor on `mesh` with its planned placements
    (Replicate on every axis when not named). Tied parameters stay tied. `aliases` maps a
    parameter's name in `module` to the name the plan uses (its first name in the full model)."""
    aliases = aliases or {}

    def make(fqn: str, p: nn.Parameter) -> nn.Parameter:
        if isinstance(p, DTensor):
            return p
        key = aliases.get(fqn, fqn)
        pl = param_placements.get(key, param_placements.get(fqn))
        if pl is None:
            placements = tuple(Replicate() for _ in range(mesh.ndim))
        else:
            if len(pl) != mesh.ndim:
                raise PlanError(f"placement {tuple(pl)} of {key} has {len(pl)} entries for a "
                                f"{mesh.ndim}-D mesh")
            placements = to_placements(pl, p.dim())
        for q in placements:
            if isinstance(q, Shard) and (q.dim >= p.dim()):
                raise PlanError(f"placement S({q.dim}) of {key} does not fit its shape {tuple(p.shape)}")
        dt = distribute_tensor(p.detach(), mesh, placements, src_data_rank=src_data_rank)
        return nn.Parameter(dt, requires_grad=p.requires_grad)

    replace_parameters(module, make)
    megatron_boundaries(module)


def _grad_boundary(x: DTensor) -> DTensor:
    """`x` unchanged in the forward; in the backward its gradient is first redistributed to
    `x`'s own placements (a partial-sum gradient is all-reduced here). DTensor would otherwise
    keep a gradient partial for as long as the ops it flows back through allow."""
    return DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())


def _reduce_partial(out: Any) -> Any:
    """`out` with every Partial placement all-reduced to Replicate (other placements kept),
    behind a gradient boundary (`_grad_boundary`): the gradient that flows back into the layer
    is then never a lazily summed partial, which DTensor cannot turn back into a vocabulary-
    parallel embedding's masked partial ("Redistribution from one partial type ... is
    unsupported")."""
    if not (isinstance(out, DTensor) and any(q.is_partial() for q in out.placements)):
        return out
    r = out.redistribute(out.device_mesh, [Replicate() if q.is_partial() else q for q in out.placements])
    return _grad_boundary(r)


def _reduce_partial_hook(mod: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook of a row-parallel linear / vocabulary-parallel embedding: `_reduce_partial`,
    unless the plan names the module's output layout."""
    return out if getattr(mod, "_autopar_planned_output", False) else _reduce_partial(out)


def _reduce_grad_hook(mod: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook of a norm: its output behind a `_grad_boundary`, unless the plan names the
    module's output layout."""
    if getattr(mod, "_autopar_planned_output", False) or not isinstance(out, DTensor):
        return out
    return _grad_boundary(out)


def _is_partial_producer(mod: nn.Module) -> bool:
    """Whether `mod` may hand on a partial sum: a module holding a sharded DTensor parameter of
    its own (a row-parallel projection whatever its class, `nn.Linear` or Hugging Face's
    `Conv1D`; a vocabulary-parallel embedding). Its hook reduces only an output that is partial."""
    return any(isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements)
               for p in mod.parameters(recurse=False))


def _is_norm(mod: nn.Module) -> bool:
    """Whether `mod` is a normalisation layer (torch's, or a model's own class named *Norm, as
    Llama's RMSNorm in the zoo and in transformers) with DTensor parameters."""
    is_norm = isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) or type(mod).__name__.endswith("Norm")
    return is_norm and any(isinstance(p, DTensor) for p in mod.parameters(recurse=False))


def megatron_boundaries(module: nn.Module) -> None:
    """Put Megatron's tensor-parallel communication at the layer boundaries where Megatron has it
    (its `g` and `f` operators), instead of wherever DTensor's lazy propagation puts it:

    * forward: the partial-sum output of a vocabulary-parallel embedding or a row-parallel linear
      (o_proj, down_proj) is all-reduced at that layer. Left to DTensor, the partial sum flows on
      through linear ops - the residual add, RMSNorm's `x * rsqrt(..)` (only its `pow` forces a
      reduction) - into the next column-parallel projection, whose matmul has no strategy for a
      partial input and a row-sharded weight, so DTensor all-gathers the *weight* (the layer no
      longer runs sharded) and q/k/v come out partial. Attention then reduce-scatters q; the CPU
      attention kernel's output follows the local query's memory layout (now contiguous) while
      DTensor's metadata follows the global, transposed one, so the head-merging `view` after
      attention fails ("view size is not compatible with input tensor's size and stride";
      `.contiguous()` is a no-op on a DTensor whose strides claim contiguity). A vocabulary-
      parallel embedding's masked partial can moreover be reduced only once, so a model reading
      it twice (residual and norm, as Llama does) fails on the second read.
    * backward: the gradient of a normalisation layer's output (the input of the column-parallel
      projections after it) is all-reduced there, once for q, k and v together. Left to DTensor,
      it stays partial through the norm, whose weight gradient then needs an all-reduce of its
      own (an extra collective per norm, beyond the plan's count).

    Both are collectives every Megatron layout needs; they only move to the layer boundary, so
    a Megatron plan (q/k/v/gate/up column, o/down row) runs its weights sharded with 2
    all-reduces per block forward and 2 backward. Modules whose output layout the plan names
    (`parallelize(output_placements=...)`) keep it."""
    for mod in module.modules():
        if getattr(mod, "_autopar_boundary", False):
            continue
        if _is_partial_producer(mod):
            mod.register_forward_hook(_reduce_partial_hook)
            mod._autopar_boundary = True
        elif _is_norm(mod):
            mod.register_forward_hook(_reduce_grad_hook)
            mod._autopar_boundary = True


def _to_dtensor(x: Any, mesh: DeviceMesh, placements: Sequence[Any] | None) -> Any:
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return x
    if placements is None:
        placements = ["R"] * mesh.ndim
    return DTensor.from_local(x, mesh, to_placements(placements, x.dim()), run_check=False)


def _to_plain(y: Any) -> Any:
    if isinstance(y, DTensor):
        return y.full_tensor()
    if isinstance(y, (tuple, list)):
        return type(y)(_to_plain(v) for v in y)
    if isinstance(y, dict):
        return {k: _to_plain(v) for k, v in y.items()}
    return y


class SPMDModule(nn.Module):
    """The result of `parallelize`: `module` with DTensor parameters; forward takes this rank's
    local input shards and returns plain tensors (the loss, equal on every rank).

    A cross-entropy on vocabulary-sharded logits inside the forward runs vocabulary-parallel
    (`vocab_loss`; `loss_inside=False`, a pipeline stage, skips the function mode that routes
    it: a stage's loss, if any, is computed outside its forward). `loss_output=True` (a last
    pipeline stage, whose output only feeds the loss) returns class-sharded logits as they are,
    for the loss to read in place (`engine.stage_loss`); any other output is made plain."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh,
                 input_placements: Sequence[Sequence[str] | None], plain_output: bool = True,
                 loss_inside: bool = True, loss_output: bool = False) -> None:
        super().__init__()
        self.module = module
        self.mesh = mesh
        self.input_placements = list(input_placements)
        self.plain_output = plain_output
        self.loss_inside = loss_inside
        self.loss_output = loss_output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ins = []
        for i, a in enumerate(args):
            pl = self.input_placements[i] if i < len(self.input_placements) else None
            ins.append(_to_dtensor(a, self.mesh, pl))
        allow_implicit_replication()
        with VocabParallelLoss() if self.loss_inside else contextlib.nullcontext():
            out = self.module(*ins, **kwargs)
        if not self.plain_output or (self.loss_output and class_sharded(out, -1)):
            return out
        return _to_plain(out)


def parallelize(module: nn.Module, mesh: DeviceMesh, param_placements: dict[str, tuple[str, ...]],
                input_placements: list[tuple[str, ...]], *,
                output_placements: dict[str, tuple[str, ...]] | None = None) -> nn.Module:
    """Shard `module` over `mesh` as planned and return a module whose forward takes local input
    shards (placed by `input_placements`, one tuple per positional input, one entry per mesh
    axis) and returns the loss as a plain tensor, equal to the one-process loss.

    `param_placements`: parameter FQN -> one placement per mesh axis ("R", "S(d)").
    `output_placements` (optional): submodule FQN -> the layout its output is consumed in; the
    output is `redistribute`d there (a forward hook), so the activations follow the plan rather
    than DTensor's own choice. Entries with a "P" (partial) are left as DTensor produces them.
    Modules named here are exempt from `megatron_boundaries` (the plan says where their output
    is reduced).

    Parameters must be materialised (not on meta); every rank passes the same full values
    (each keeps its shard)."""
    register_extra_strategies()
    allow_implicit_replication()
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    unknown = sorted(set(param_placements) - names)
    if unknown:
        raise PlanError(f"placements name parameters the module does not have: {', '.join(unknown[:5])}")
    distribute_params(module, mesh, param_placements, src_data_rank=None)
    for path, spec in (output_placements or {}).items():
        sub = module.get_submodule(path)
        sub._autopar_planned_output = True   # the plan's layout, not `megatron_boundaries`
        if any(str(x).strip() == "P" for x in spec):
            continue

        def hook(m: nn.Module, args: Any, out: Any, spec: Sequence[str] = spec) -> Any:
            if isinstance(out, DTensor):
                return out.redistribute(out.device_mesh, to_placements(spec, out.dim()))
            return out

        sub.register_forward_hook(hook)
    return SPMDModule(module, mesh, input_placements)


def local_shard_rows(x: torch.Tensor, mesh: DeviceMesh, placements: Sequence[str]) -> torch.Tensor:
    """This rank's local shard of a full tensor `x` under `placements` (helper for callers that
    hold the full input and want to feed `parallelize`d modules)."""
    return distribute_tensor(x, mesh, to_placements(placements, x.dim()), src_data_rank=None).to_local()


def grads_to_param_layout(params: Iterable[nn.Parameter]) -> None:
    """Make every DTensor gradient have its parameter's placements (Partial -> all-reduce or
    reduce-scatter), so the optimizer sees consistent shards."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
