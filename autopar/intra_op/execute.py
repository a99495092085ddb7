"""Execute a ShardingSolution as planned, op by op, with DTensor.

    prog = parallelize_graph(model, example_inputs, solution, mesh)   # or solution.apply(...)
    loss = prog(*inputs)            # full inputs (the same on every rank); the one-process loss
    loss.backward()                 # parameters' .grad: DTensors in their planned placements
    optimizer = torch.optim.AdamW(prog.parameters())

`parallelize_graph` re-exports the model with its loss (`capture.export.export_program`: the
torch.export program the solution was solved on, so its nodes carry the solution's op names) and
runs that program with a torch.fx.Interpreter over DTensors:

* parameters are DTensors with the solution's placements (`param_placements`); the rows of a
  fused projection that the plan splits chunk-interleaved (`param_layouts`) are permuted so that
  each device's contiguous shard holds its share of every chunk, as Megatron lays out fused QKV;
* before each op, each tensor input is redistributed to the layout the op's chosen strategy reads
  it in (`op_choices[op].input_placements`). A tensor read by several ops is first
  redistributed once to its junction's layout (`junctions`). The loss is made replicated;
* DTensor then runs the op. Given its inputs in the planned layouts it produces the planned
  output layout without communicating, apart from the op's own reductions (a vocab-parallel
  cross-entropy's three all-reduces). An op whose inputs and outputs the plan replicates over
  every mesh axis (a norm, a residual add) runs on the local tensors instead, as hand-written
  tensor parallelism runs the layers it leaves alone: the same kernels, without DTensor's
  dispatch; its output stays a plain tensor, read as replicated (`_PlanInterpreter.runs_local`).
  An element-wise op of one tensor laid out sharded, its output likewise, runs on the device's
  shard (`_PlanInterpreter.runs_on_shards`), as DTensor would run it without communicating.

The backward pass is autograd over the same DTensor ops. Each redistribution's backward sends
the gradient back to its source's layout, with partial made replicated (a backward all-reduce,
Megatron's f, or for a parameter its gradient synchronisation). A junction is the exception:
along its partial axes the consumers' gradients stay partial, are summed, and are reduced once.
So the collectives that run are the solution's `collectives`: its resharding, forward and
backward, and the ops' own reductions.

Where DTensor by default would run other collectives than the plan, the step runs here:

* redistribution (`redistribute`): to partial is local (DTensor refuses it), shard to shard on
  a CPU mesh is an all-to-all (DTensor gathers there);
* a split along a dim the plan shards (fused QKV, interleaved weight rows) splits each device's
  shard locally (DTensor would gather the dim first);
* an op passing a partial input through (a view, a cast, a scaling) runs on each summand
  (DTensor reduces first for some, expand and unsqueeze among them);
* attention runs on each device's shard: the plan splits only batch and heads (DTensor has no
  rule for CPU flash attention with a mask); with the query heads split alone (grouped-query
  attention over more devices than KV heads) each device slices the KV heads its query heads
  read from replicated K and V, their gradients partial; under context parallelism
  (`parallelize_graph(context=)`: a program of a cp rank's tokens) that local attention is the
  cp attention, K and V gathered over the cp ranks, and a token-mean loss the cp group's mean;
* a loss whose plan splits a reduced dim (the batch) is computed on each device's shard and
  summed or averaged by the all-reduce that makes it replicated, as data parallelism does
  (DTensor's nll_loss would also all-reduce the target count in the backward pass, and its
  mse_loss backward scales gradients by the mesh size, torch 2.13);
* a vocab-parallel cross-entropy runs under torch's `loss_parallel` handlers, forward and
  backward (`runtime.vocab_loss.loss_parallel_call`, as the runtime runs it);
* a parameter stored sharded and gathered for an op (ZeRO-3) is not kept for the backward
  pass: it is gathered again when the backward reads it (`_Regather`), as FSDP does and the
  plan counts.

ZeRO-3 over a solution's tp mesh is FSDP2's (the runtime's): the modules FSDP shards as units
are not called, so `ShardedProgram.run_units` runs each unit's ops (its contiguous run of the
program) as one call of a forward method FSDP hooks, inside which the unit's parameters are
its gathered ones (`_PlanInterpreter._run_unit`).

A custom `torch.autograd.Function`'s call (a straight-through estimator, Hugging Face BLOOM's
GELU) is traced as its forward's ops, which the solution lays out like any other; the program
runs the call as the user's `Function.apply` at its first op instead (`capture.functions`),
on its arguments as they are (DTensor propagates their layouts through the forward's ops), so
that its backward is the Function's own, not autograd through the traced ops.

Ops the solution has no choice for (shape arithmetic, assertions) run as DTensor runs them.
Subgraphs of higher-order ops (a torch.no_grad region) run nested, under their names in the
capture. The program is traced from a meta copy of the model (where the solution was solved; a
model may trace differently on its device) and runs on the real device; the device's own
program where the meta one does not fit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from autopar.capture.export import _WithLoss, default_loss, move_not_cast
from autopar.capture.functions import regions as function_regions
from autopar.capture.own_positions import CAUSAL_MASK, causal_call
from autopar.intra_op import fake_cuda
from autopar.intra_op.rules.attention import query_head_axes
from autopar.intra_op.rules.loss import REDUCTION_ARG, reduction_of
from autopar.intra_op.solution import OpChoice, ShardingSolution
from autopar.runtime.memory_tracking import communication_buffers, now_activation, recomputing
from autopar.runtime.spmd import replace_parameters, to_placements
from autopar.runtime.tied_grads import release
from autopar.runtime.vocab_loss import loss_parallel_call
from autopar.schema.errors import PlanError

log = logging.getLogger(__name__)

__all__ = ["parallelize_graph", "ShardedProgram", "to_placements"]

Spec = Sequence[str]
SPLIT_OPS = ("split", "split_with_sizes", "chunk", "unsafe_split", "tensor_split")


# ---------------------------------------------------------------------------- placements
def _target(x: DTensor, spec: Spec) -> tuple[Placement, ...]:
    """The placements `spec` asks of `x`; a partial already there stays as it is (a plan's "P"
    is any pending reduction: DTensor's masked partial of a vocab-parallel embedding included)."""
    want = _placements_of(spec, x.ndim)
    have = x.placements
    if have == want:
        return want
    return tuple(h if w.is_partial() and h.is_partial() else w for h, w in zip(have, want))


def _placements_of(spec: Spec, ndim: int) -> tuple[Placement, ...]:
    """`to_placements(spec, ndim)`, remembered: a few distinct specs per program, asked at every
    read of every op (the executor's hot path), each a parse of the spec's strings otherwise."""
    key = (tuple(spec), ndim)
    out = _PLACEMENTS.get(key)
    if out is None:
        out = _PLACEMENTS[key] = to_placements(spec, ndim)
    return out


_PLACEMENTS: dict[tuple, tuple[Placement, ...]] = {}


def _span_boundary(span: Sequence[torch.fx.Node]) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(what a run of program nodes reads from before it, in first-read order; those of its
    nodes read after it)."""
    inside = set(span)
    ext: list[torch.fx.Node] = []
    for m in span:
        for a in m.all_input_nodes:
            if a not in inside and a not in ext:
                ext.append(a)
    return ext, [m for m in span if any(u not in inside for u in m.users)]


def _grad_target(src: Sequence[Placement], keep_partial: Sequence[int]) -> tuple[Placement, ...]:
    """Where the gradient of a tensor laid out `src` goes back to: its layout, partial made
    replicated, except along `keep_partial` (a junction's axes), where it stays partial."""
    if not keep_partial and not any(p.is_partial() for p in src):
        return tuple(src)
    return tuple(Partial() if a in keep_partial else Replicate() if p.is_partial() else p
                 for a, p in enumerate(src))


# ---------------------------------------------------------------------------- redistribution
def redistribute(x: DTensor, dst: Sequence[Placement], whole: Sequence[int] = ()) -> DTensor:
    """`x` laid out `dst` (not differentiable), one mesh axis at a time as the plan's
    `placement.transition` counts it: a collective per axis that changes (a reduction, a gather,
    an all-to-all) or none (a slice; to partial). The axes go in an order where no later axis
    splits a dim the step touches, so each step is that one collective. DTensor's redistribute
    runs the steps, except two it does not take: to partial (from replicated or sharded) is
    local, one device keeping the value (or each its shard, in place) and the others zeros, as
    DTensor allows only inside its ops; shard to shard on a CPU mesh is an all-to-all (DTensor
    gathers there; gloo has all-to-all). With no such order (a split nested inside the one that
    changes), each step gathers the nested axes first (`_nested_redistribute`). Along the
    `whole` axes (a solution's `model_axes`) a partial sum wanted sharded is all-reduced whole
    and then sliced, as the plan counts it there (no reduce-scatter into activation slices)."""
    dst = tuple(dst)
    if tuple(x.placements) == dst:
        return x
    if x.numel() == 0:
        return _empty_as(x, dst)
    fix = [a for a in whole if x.placements[a].is_partial() and isinstance(dst[a], Shard)]
    if fix:
        mid = tuple(Replicate() if a in fix else p for a, p in enumerate(x.placements))
        return redistribute(redistribute(x, mid), dst)
    changing = [a for a, (c, d) in enumerate(zip(x.placements, dst))
                if c != d and not (c.is_partial() and d.is_partial())]
    order = _simple_order(tuple(x.placements), dst, changing)
    if order is None:
        return _nested_redistribute(x, dst, changing)
    for a in order:
        x = _step(x, a, dst[a])
    return x


def _empty_as(x: DTensor, dst: tuple) -> DTensor:
    """An empty tensor laid out `dst`: every layout of it holds nothing, so no collective (the
    plan counts none: a collective of 0 bytes costs the ILP nothing and is left out of its
    list). Phi-3's rotary embedding splits each head into the rotated part and the rest, which
    is empty when the whole head rotates; its concatenation read the empty rest, left partial
    by the solution, and all-reduced it, 3 all-reduces a step the plan did not say."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(x.shape, x.device_mesh, dst)
    local = x._local_tensor.new_empty(shape)
    return DTensor.from_local(local, x.device_mesh, dst, run_check=False, shape=x.shape,
                              stride=contiguous_strides(x.shape))


def _nested_redistribute(x: DTensor, dst: tuple, changing: list[int]) -> DTensor:
    """No simple order: per changing axis (mesh order), gather the later axes that split a dim
    it touches (innermost first), change it, and slice back those that keep their layout, as
    `placement.transition` counts it."""
    src = tuple(x.placements)
    for a in changing:
        t = _touched(x.placements[a], dst[a])
        inner = [b for b in range(a + 1, len(dst))
                 if isinstance(x.placements[b], Shard) and x.placements[b].dim in t]
        for b in reversed(inner):
            x = _step(x, b, Replicate())
        x = _step(x, a, dst[a])
        for b in inner:
            if b not in changing:
                x = _step(x, b, src[b])
    return x


def _touched(c: Placement, d: Placement) -> set[int]:
    return {p.dim for p in (c, d) if isinstance(p, Shard)}


def _simple_order(cur: tuple, dst: tuple, axes: list[int]) -> Optional[list[int]]:
    """An order of `axes` in which, at each step, no later mesh axis splits a dim the step
    touches (None when there is none)."""
    if not axes:
        return []
    for a in axes:
        if any(isinstance(p, Shard) and p.dim in _touched(cur[a], dst[a]) for p in cur[a + 1:]):
            continue
        nxt = cur[:a] + (dst[a],) + cur[a + 1:]
        rest = _simple_order(nxt, dst, [b for b in axes if b != a])
        if rest is not None:
            return [a] + rest
    return None


def _step(x: DTensor, axis: int, d: Placement) -> DTensor:
    """`x` with mesh axis `axis` laid out `d`, the other axes as they are."""
    c = x.placements[axis]
    if d.is_partial() and not c.is_partial():
        return _to_partial(x, axis)
    if isinstance(c, Shard) and isinstance(d, Shard) and x.device_mesh.device_type == "cpu":
        return _all_to_all(x, axis, d)
    if isinstance(c, Shard) and isinstance(d, Replicate) and c.dim != 0 and _even(x, c.dim):
        return _gather(x, axis, c.dim)
    return x.redistribute(x.device_mesh, tuple(d if b == axis else p for b, p in enumerate(x.placements)))


def _even(x: DTensor, dim: int) -> bool:
    """Whether every device holds as much of `dim` as the others (no padded shard)."""
    parts = math.prod(x.device_mesh.size(a) for a, p in enumerate(x.placements)
                      if isinstance(p, Shard) and p.dim == dim)
    return x.shape[dim] % parts == 0


def _gather(x: DTensor, axis: int, dim: int) -> DTensor:
    """Shard(dim) -> Replicate along `axis`, dim != 0, even shards: DTensor's steps (an
    all-gather along dim 0 into a buffer, the pieces concatenated along `dim`), on a copy of the
    shard, with the buffer and the copy freed as soon as the concatenation has them (storages
    resized to 0, as FSDP frees unsharded parameters): the process group's work keeps
    references to its input and output for as long as its thread runs, so dropping ours alone
    leaves their memory held into the next ops (the shard past its last reader) for a time
    that varies from run to run. The memory model counts shard, copy, buffer and result at
    the gather (`ilp_provider._gather_buffer`), buffer and result as buffers there, which the
    memory tracker is told (`communication_buffers`)."""
    mesh = x.device_mesh
    n = mesh.size(axis)
    src = x.to_local().clone(memory_format=torch.contiguous_format)
    with communication_buffers():
        buf = src.new_empty((n * src.shape[0],) + tuple(src.shape[1:]))
        dist.all_gather_into_tensor(buf, src, group=mesh.get_group(axis))
        full = torch.cat(buf.chunk(n, dim=0), dim=dim)
    release(buf, src)
    now_activation(full)
    pl = list(x.placements)
    pl[axis] = Replicate()
    return DTensor.from_local(full, mesh, pl, run_check=False, shape=x.shape, stride=x.stride())


def _all_to_all(x: DTensor, axis: int, d: Shard) -> DTensor:
    c = x.placements[axis]
    group = x.device_mesh.get_group(axis).group_name
    local = torch.ops._dtensor.shard_dim_alltoall(x.to_local().contiguous(), c.dim, d.dim, group)
    pl = list(x.placements)
    pl[axis] = d
    return DTensor.from_local(local, x.device_mesh, pl, run_check=False, shape=x.shape,
                              stride=x.stride())


def _to_partial(x: DTensor, axis: int) -> DTensor:
    """Replicated -> partial: the device at coordinate 0 of `axis` keeps the value, the others
    zeros. Shard(d) -> partial: each device's shard in its place along d, zeros elsewhere."""
    mesh = x.device_mesh
    p = x.placements[axis]
    inner = [b for b, q in enumerate(x.placements)
             if b > axis and isinstance(p, Shard) and isinstance(q, Shard) and q.dim == p.dim]
    if inner:       # a later axis splits the same dim: gather it around the step
        pl = tuple(x.placements)
        x = _to_partial(x.redistribute(mesh, tuple(Replicate() if b in inner else q
                                                   for b, q in enumerate(pl))), axis)
        return x.redistribute(mesh, tuple(pl[b] if b in inner else q for b, q in enumerate(x.placements)))
    coord = mesh.get_local_rank(axis)
    local = x.to_local()
    if isinstance(p, Shard):
        n = local.shape[p.dim]
        shape = list(local.shape)
        shape[p.dim] = n * mesh.size(axis)
        full = local.new_zeros(shape)
        full.narrow(p.dim, coord * n, n).copy_(local)
        local = full
    elif coord != 0:
        local = torch.zeros_like(local)
    pl = list(x.placements)
    pl[axis] = Partial()
    return DTensor.from_local(local, mesh, pl, run_check=False, shape=x.shape, stride=x.stride())


# ---------------------------------------------------------------------------- autograd pieces
class _Reshard(torch.autograd.Function):
    """Redistribute to `dst` in the forward pass, and the gradient to `grad_dst` in the backward
    pass (DTensor's own redistribute always sends the gradient to the source's layout).

    Most reads find their tensor already in the layout the op reads (148 of 157 per gpt-small
    tp-2 step); the function still stands in the autograd graph, as the gradient may come back
    in another layout (a replicated input of a column-parallel matmul gets a partial one).
    What it returns then is an alias (a new DTensor on the local tensor detached: the same
    storage, no DTensor dispatch) rather than a DTensor view (`view_as`: DTensor's dispatch,
    about 100 us a read on CPU), unless the program mutates tensors in place (`alias=False`):
    only a view shares the input's version counter, which autograd needs to see such a
    mutation."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, dst: tuple, grad_dst: tuple, whole: tuple = (),
                alias: bool = False) -> DTensor:
        ctx.grad_dst, ctx.whole = grad_dst, whole
        out = redistribute(x, dst, whole)
        if out is not x:
            return out
        return DTensor(x._local_tensor.detach(), x._spec, requires_grad=False) if alias else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple:
        if isinstance(g, DTensor):
            g = redistribute(g, ctx.grad_dst, ctx.whole)
        return g, None, None, None, None


class _ToLocal(torch.autograd.Function):
    """`x.to_local()` whose gradient comes back contiguous, as a DTensor laid out
    `grad_placements`. Kernels run on local shards (attention) may return gradients in their own
    strides; DTensor derives global strides from local ones, and a later view of such a
    gradient can fail."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, grad_placements: tuple) -> torch.Tensor:
        ctx.mesh, ctx.grad_placements, ctx.shape = x.device_mesh, tuple(grad_placements), x.shape
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple:
        if g is None:
            return None, None
        return DTensor.from_local(g.contiguous(), ctx.mesh, ctx.grad_placements, run_check=False,
                                  shape=ctx.shape, stride=contiguous_strides(ctx.shape)), None


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (what DTensor needs to wrap a local one)."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * int(shape[d + 1])
    return tuple(out)


class _ShardLoss(torch.autograd.Function):
    """A loss computed on this device's shard, as a partial DTensor whose sum is the whole loss
    (`scale` = 1/devices for a mean over equal shards); backward gives each device the gradient
    of its share."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: DeviceMesh, placements: tuple,
                scale: float) -> DTensor:
        ctx.scale, ctx.mesh = scale, mesh
        return DTensor.from_local(local * scale, mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple:
        if isinstance(g, DTensor):
            g = g.redistribute(ctx.mesh, [Replicate()] * ctx.mesh.ndim).to_local()
        return g * ctx.scale, None, None, None


class _Regather:
    """Keeps no gathered parameter for the backward pass: a tensor some op saves that lives in
    the storage of a gathered parameter is packed as a recipe (the parameter's shard, the
    layout it was gathered to, the view), and unpacked by gathering the shard again: one
    all-gather per gathered parameter per backward pass, shared by the ops that saved it,
    dropped once the last one has read it.

    Nor does it keep one through the forward: it follows a gathered parameter by a weak
    reference, so the parameter goes after its last forward reader (the interpreter drops a
    value after its last use, a junction's after its last consumer), as FSDP reshards after a
    unit's forward and as the plan counts it (the op that gathers it, not the rest of the
    forward). A strong reference here kept the tied embedding table of Megatron-SP dp2 x tp2,
    gathered for the lookup, until the forward's end (`benchmarks/memory_accuracy.py`, its
    activations 17 KiB over the plan at the head); under full recomputation the re-run
    forward's gathers were kept as long as the autograd graph.

    The saved-tensor hooks are installed only around the ops that read a gathered parameter
    (`saving`), not around the whole forward: a tensor saved under hooks is unpacked as a new
    tensor (for a DTensor, a `detach` through DTensor's dispatch), which on gpt-small's tp-2 step
    was 66 extra DTensor ops. The hooks are methods of a separate state object
    (`_RegatherState`), so that the autograd graph holding them forms no reference cycle with
    this object: the state goes when the graph does, not at a garbage collection (the weak
    references' callbacks reach the state weakly too). Used as a context manager around the
    forward; at its exit it follows no parameter any more (what was packed keeps its recipe)."""

    def __init__(self) -> None:
        self.state = _RegatherState()
        self.paused = 0         # > 0 inside a recomputed region (see `saving`)
        self.discard: Optional[_DiscardState] = None     # "norm_act"'s noted outputs (`_DiscardState`)

    def track(self, gathered: DTensor, shard: DTensor, dst: tuple) -> None:
        self.state.track(gathered, shard, dst)

    def saving(self, args: Sequence[Any], kwargs: Optional[dict] = None) -> Any:
        """The saved-tensor hooks when one of an op's inputs (`args`, `kwargs`) lives in a
        gathered parameter's storage, else a null context (the inputs looked at only when some
        parameter is gathered now). Never inside a recomputed region: there torch's checkpoint
        holds what the ops save with hooks of its own, which ours, pushed on top, would displace
        (the region gathers its parameters again when it is re-run)."""
        live, discard = self.state.live, self.discard
        if not (live and not self.paused) and not (discard is not None and discard.live):
            return contextlib.nullcontext()
        values = [v for v in _flat_nodes([args, list((kwargs or {}).values())]) if isinstance(v, torch.Tensor)]
        regather = bool(live) and not self.paused and any(_storage(v) in live for v in values)
        if discard is None or not discard.reads(values):
            if regather:
                return torch.autograd.graph.saved_tensors_hooks(self.state.pack, self.state.unpack)
            return contextlib.nullcontext()
        # a noted "norm_act" output among the inputs: its reference first, else the regather's
        state = self.state if regather else None

        def pack(t: torch.Tensor) -> Any:
            p = discard.pack(t)
            if p is not None:
                return p
            return state.pack(t) if state is not None else t

        def unpack(p: Any) -> Any:
            if isinstance(p, _DiscardPacked):
                return _DiscardState.unpack(p)
            return state.unpack(p) if state is not None else p

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def __enter__(self) -> "_Regather":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.state.live = {}


class _RegatherState:
    def __init__(self) -> None:
        # storage of a gathered parameter alive now -> (weak reference to it, its recipe's id);
        # an entry goes with the parameter (its storage's identity may then be reused)
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.recipes: dict[int, tuple[DTensor, tuple]] = {}     # recipe id -> (shard, dst)
        self.gathered: dict[int, DTensor] = {}                  # recipe id -> gathered again
        self.readers: dict[int, int] = {}

    def track(self, gathered: DTensor, shard: DTensor, dst: tuple) -> None:
        key, rid = _storage(gathered), len(self.recipes)
        self.recipes[rid] = (shard, dst)
        me = weakref.ref(self)

        def gone(ref: weakref.ref, key: int = key) -> None:
            st = me()
            if st is not None and st.live.get(key, (None,))[0] is ref:
                del st.live[key]

        self.live[key] = (weakref.ref(gathered, gone), rid)

    def pack(self, t: torch.Tensor) -> Any:
        entry = self.live.get(_storage(t))
        if entry is None:
            return t
        rid = entry[1]
        self.readers[rid] = self.readers.get(rid, 0) + 1
        loc = t._local_tensor if isinstance(t, DTensor) else t
        view = (tuple(loc.shape), tuple(loc.stride()), loc.storage_offset())
        spec = (tuple(t.placements), tuple(t.shape), tuple(t.stride())) if isinstance(t, DTensor) else None
        return ("regather", rid, view, spec)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and len(packed) == 4 and packed[0] == "regather"):
            return packed
        _, rid, (shape, stride, offset), spec = packed
        full = self.gathered.get(rid)
        if full is None:
            shard, dst = self.recipes[rid]
            full = self.gathered[rid] = redistribute(shard, dst)
        self.readers[rid] -= 1
        if self.readers[rid] == 0:
            del self.gathered[rid]
        loc = full._local_tensor.as_strided(shape, stride, offset)
        if spec is None:
            return loc
        return DTensor.from_local(loc, full.device_mesh, spec[0], run_check=False, shape=spec[1],
                                  stride=spec[2])


def _storage(t: Any) -> int:
    """The identity of `t`'s storage (its StorageImpl, not its data pointer: a fake tensor's
    is 0 for every storage, `autopar verify`)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else -1


# ---------------------------------------------------------------------------- discarded outputs
class _DiscardTape:
    """One "norm_act" region's run in one forward (`_DiscardState`): its ops (with the
    interpreter that ran each and the names it read them by), the values they read from outside
    the region (held: the re-run's inputs, as Megatron's `CheckpointWithoutOutput` keeps its
    inputs) and the forward's autocast state; what the region made is not held. Re-run once,
    without autograd, by the first backward that unpacks one of its outputs (`value`)."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, torch.fx.Node, dict]] = []    # (interpreter, node, its aliases)
        self.held: dict[torch.fx.Node, Any] = {}                  # values read from before the region
        self.outer: set[int] = set()                              # their storages
        self.made: set[torch.fx.Node] = set()
        self.need: dict[tuple[torch.fx.Node, int], int] = {}      # packed references not yet unpacked
        self.cache: Optional[dict[tuple[torch.fx.Node, int], Any]] = None
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]

    def value(self, node: torch.fx.Node, j: int) -> Any:
        """Output `j` of `node`, re-made (the region's ops re-run once through their interpreters,
        their redistributions with them: the plan's "recompute" collectives), kept until its
        last packed reference is unpacked."""
        from autopar.runtime.selective import recomputation_context

        key = (node, j)
        if self.cache is None or key not in self.cache:
            vals: dict[torch.fx.Node, Any] = dict(self.held)
            junctions: dict[str, DTensor] = {}
            with torch.no_grad(), recomputation_context(*[torch.autocast(d, dtype=dt) for d, dt in self.autocast]):
                for interp, n, alias in self.steps:
                    saved = interp.env, interp.junction_values, interp.alias, interp.node_name
                    interp.env, interp.junction_values, interp.alias = vals, junctions, alias
                    interp.discard.replaying += 1
                    try:
                        vals[n] = interp._run_one(n)
                    finally:
                        interp.env, interp.junction_values, interp.alias, interp.node_name = saved
                        interp.discard.replaying -= 1
            self.cache = {k: _flat_output(vals[k[0]], k[1]) for k, c in self.need.items() if c > 0}
        v = self.cache[key]
        self.need[key] -= 1
        if self.need[key] <= 0:
            del self.cache[key]
        return v


def _flat_output(value: Any, j: int) -> Any:
    return [t for t in _flat_values(value) if isinstance(t, torch.Tensor)][j]


def _flat_values(value: Any) -> list:
    from torch.utils._pytree import tree_flatten

    return tree_flatten(value)[0]


class _DiscardPacked:
    __slots__ = ("tape", "key", "view", "spec")

    def __init__(self, tape: _DiscardTape, key: tuple, view: tuple, spec: Optional[tuple]) -> None:
        self.tape, self.key, self.view, self.spec = tape, key, view, spec


class _DiscardState:
    """Output-discarding recomputation ("norm_act", Megatron-Core's `--recompute-modules
    layernorm moe_act`) on a stage run op by op: the regions are the plan's
    (`StageLayouts.discard_regions`, what `cost_models.memory.norm_act_regions` counts). Each
    region op runs as planned (its layouts, its redistributions) and its outputs are noted by
    their storages' identity (`_storage`: a DTensor's local tensor's StorageImpl, which fake
    tensors have too, `autopar verify`); an op that saves a tensor living in one of them (the
    projections reading a norm's output, the GEMM reading an activation's product, a later op
    of the region) saves a reference (`pack`: region, output, view, DTensor spec) instead, so
    only the region's inputs keep anything alive. The first backward unpacking one re-runs the
    region (`_DiscardTape.value`). An op saving its own output (a norm's statistics) saves it
    before it is noted: kept, as the memory model counts it. A region output redistributed
    into a new tensor for a reader (a junction) is that reader's own copy: kept, as the memory
    model counts a redistributed copy. `runtime.discard` is the same for module-cut stages."""

    def __init__(self) -> None:
        # storage of a region output alive now -> (its tape, (node, output index), weak reference)
        self.live: dict[int, tuple[_DiscardTape, tuple, weakref.ref]] = {}
        self.open: dict[int, _DiscardTape] = {}       # region index -> its tape while it runs
        self.replaying = 0                            # > 0 while a tape re-runs its region

    def run(self, interp: Any, n: torch.fx.Node, region: int, first: bool, last: bool) -> Any:
        """Op `n` of region `region` in the forward: run, its outputs noted."""
        tape = self.open.get(region)
        if tape is None or first:
            tape = self.open[region] = _DiscardTape()
        for a in n.all_input_nodes:
            if a not in tape.made and a not in tape.held and a in interp.env:
                v = tape.held[a] = interp.env[a]
                for t in _flat_values(v):
                    if isinstance(t, torch.Tensor):
                        tape.outer.add(_storage(t))
        tape.steps.append((interp, n, {x: interp.alias[x] for x in (n, *n.all_input_nodes) if x in interp.alias}))
        self.replaying += 1     # the op itself runs as any other
        try:
            out = interp._run_one(n)
        finally:
            self.replaying -= 1
        tape.made.add(n)
        me = weakref.ref(self)
        for j, t in enumerate(t for t in _flat_values(out) if isinstance(t, torch.Tensor)):
            key = _storage(t)
            if key in tape.outer or key in self.live and self.live[key][0] is tape:
                continue        # an input returned as it is, or a view of an earlier output
            def gone(ref: weakref.ref, key: int = key) -> None:
                st = me()
                if st is not None and st.live.get(key, (None, None, None))[2] is ref:
                    del st.live[key]
            self.live[key] = (tape, (n, j), weakref.ref(t, gone))
        if last:
            self.open.pop(region, None)
        return out

    def reads(self, values: Sequence[Any]) -> bool:
        """Whether one of `values` (an op's inputs) lives in a noted region output."""
        return bool(self.live) and any(_storage(v) in self.live for v in values if isinstance(v, torch.Tensor))

    def pack(self, t: torch.Tensor) -> Any:
        e = self.live.get(_storage(t))
        if e is None:
            return None
        tape, key, ref = e
        made = ref()
        if made is None or made.dtype != t.dtype:
            return None
        loc = t._local_tensor if isinstance(t, DTensor) else t
        spec = (t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride())) \
            if isinstance(t, DTensor) else None
        tape.need[key] = tape.need.get(key, 0) + 1
        return _DiscardPacked(tape, key, (tuple(loc.shape), tuple(loc.stride()), loc.storage_offset()), spec)

    @staticmethod
    def unpack(p: _DiscardPacked) -> torch.Tensor:
        v = p.tape.value(*p.key)
        loc = (v._local_tensor if isinstance(v, DTensor) else v).as_strided(*p.view)
        if p.spec is None:
            return loc
        mesh, placements, shape, stride = p.spec
        return DTensor.from_local(loc, mesh, placements, run_check=False, shape=shape, stride=stride)

    def clear(self) -> None:
        """The forward ended: nothing more is saved (what was packed keeps its tape)."""
        self.live.clear()
        self.open.clear()


# ---------------------------------------------------------------------------- interleaved rows
def interleave(t: torch.Tensor, dim: int, chunks: int, ways: int) -> torch.Tensor:
    """Rows of `t` along `dim` reordered so that contiguous shard r of `ways` holds the r-th
    slice of each of its `chunks` chunks (Megatron's fused-QKV layout)."""
    s = tuple(t.shape)
    n = s[dim]
    v = t.reshape(s[:dim] + (chunks, ways, n // (chunks * ways)) + s[dim + 1:])
    return v.transpose(dim, dim + 1).reshape(s)


def deinterleave(t: torch.Tensor, dim: int, chunks: int, ways: int) -> torch.Tensor:
    """The inverse of `interleave`: the rows back in the model's order."""
    s = tuple(t.shape)
    n = s[dim]
    v = t.reshape(s[:dim] + (ways, chunks, n // (chunks * ways)) + s[dim + 1:])
    return v.transpose(dim, dim + 1).reshape(s)


def _ways(placements: Sequence[Placement], dim: int, mesh: DeviceMesh) -> int:
    return math.prod(mesh.size(a) for a, p in enumerate(placements)
                     if isinstance(p, Shard) and p.dim == dim)


# ---------------------------------------------------------------------------- the program
class ShardedProgram(nn.Module):
    """A model with its loss, run as a ShardingSolution plans it (see the module docstring).

    forward(*inputs) takes the model's inputs (full tensors, the same on every rank; or this
    rank's shards with `inputs="local"`) and returns the loss, a plain tensor equal on every
    rank. `parameters()` are the model's, as DTensors in their planned placements (gradients
    land in the same placements). `full_parameters()` / `full_gradients()` gather them, in the
    model's own row order."""

    # context parallelism (`runtime.context_parallel.ProgramContext`): the program holds a cp
    # rank's tokens; its attention ops and token-mean losses run through it (`parallelize_graph`)
    context: Any = None

    def __init__(self, model: nn.Module, wrapped: nn.Module, program: Any, solution: ShardingSolution,
                 mesh: DeviceMesh, names: Optional[list[str]], inputs: str = "full",
                 device: Optional[torch.device] = None, recompute: Sequence[Sequence[str]] = (),
                 own: Optional[set[str]] = None, constants: Optional[dict[str, Any]] = None,
                 discard: Sequence[Sequence[str]] = ()) -> None:
        super().__init__()
        # the program's lifted constants, those given in `constants` in their stead (a meta
        # program's meta constants as the model holds them: `_real_constants`); the program,
        # shared (`meta_program`), keeps its own
        self.constants = {**program.constants, **(constants or {})}
        self.own = own                      # set: only these parameters are this rank's (a pipeline)
        self.run_device = device            # set: the program was traced on meta, runs here
        # the device `meta_program` traced the program for (None: meta, or the model's own
        # export), whose name in the graph means `run_device` too
        self.traced_device = getattr(program, "autopar_traced_device", None)
        self.model = model
        self._wrapped = [wrapped]           # not a submodule: `model` already is
        self.program = program
        self.gm = program.graph_module
        self.solution = solution
        self.mesh = mesh
        self.names = names
        if inputs not in ("full", "local"):
            raise PlanError(f"inputs must be 'full' or 'local', got {inputs!r}")
        self.inputs_mode = inputs
        # set to a list to record each redistribution: (op, from placements, to placements)
        self.trace: Optional[list[tuple[str, tuple[str, ...], tuple[str, ...]]]] = None
        self.layouts: dict[str, tuple[int, int, int]] = {}      # fqn -> (dim, chunks, ways)
        self._check_names()
        self._recompute_spans(recompute)
        self._discard_regions(discard)
        # the program holds the parameters as exported (full, before sharding); the interpreter
        # reads the model's own, so keeping them would hold a whole unsharded copy of the model
        state = getattr(program, "_state_dict", None)
        if isinstance(state, dict):
            state.clear()
        for mod in self.gm.modules():
            if isinstance(getattr(mod, "graph", None), torch.fx.Graph):
                for n in mod.graph.nodes:
                    move_not_cast(n)
        self.mutates = _mutates(self.gm)
        self.local_ops: dict[torch.fx.Node, bool] = {}     # `_PlanInterpreter.runs_local`, per node
        self.device_args: dict[torch.fx.Node, bool] = {}   # `_names_device`, per node
        self.shard_ops: dict[torch.fx.Node, bool] = {}     # `_PlanInterpreter.runs_on_shards`, per node
        self._op_names: dict[torch.fx.Node, str] = {}      # `op_name`, per node
        # modules whose ops run as one call each (`run_units`: ZeRO-3's FSDP units; `replace_modules`:
        # expert blocks, which may lie inside a unit): first node -> [(module, its run)], outer
        # first; node -> the modules whose runs hold it, outer first
        self.unit_spans: dict[torch.fx.Node, list[tuple[str, list[torch.fx.Node]]]] = {}
        self.units_of: dict[torch.fx.Node, list[str]] = {}
        self.unit_calls: dict[str, Any] = {}
        self.replaced: set[str] = set()       # units whose call replaces their ops (`replace_modules`)
        self.replaced_pending: set[str] = set()
        # custom autograd Functions' calls (`capture.functions`): run as `Function.apply` at their
        # first op, so that the backward is the user's; first op -> the call, and all their ops
        self.fn_first: dict[torch.fx.Node, Any] = {}
        self.fn_inside: set[torch.fx.Node] = set()
        for mod in self.gm.modules():
            if isinstance(getattr(mod, "graph", None), torch.fx.Graph):
                for r in function_regions(mod.graph):
                    self.fn_first[r.nodes[0]] = r
                    self.fn_inside.update(r.nodes[1:])
        self._distribute_parameters()

    def op_name(self, n: torch.fx.Node) -> str:
        """`_op_name(n)`, remembered (a string made of the op's name at every run otherwise)."""
        name = self._op_names.get(n)
        if name is None:
            name = self._op_names[n] = _op_name(n)
        return name

    # -- setup ---------------------------------------------------------------------------
    def _check_names(self) -> None:
        """The program must be the one the solution was solved on: every op with a choice is a
        node of it, of the same kind (`_mismatch`). Notes the parameters' placeholders."""
        missing = _mismatch(self.program, self.solution)
        if missing:
            raise PlanError(f"the solution's ops do not match the model's program "
                            f"({', '.join(missing[:4])}); solve and apply with the same model and "
                            f"loss, and solve the whole graph (not a subset of its nodes)")
        from torch.export.graph_signature import InputKind

        self.param_nodes = {s.arg.name for s in self.program.graph_signature.input_specs
                            if s.kind == InputKind.PARAMETER}
        targets = {s.arg.name: s.target for s in self.program.graph_signature.input_specs
                   if s.kind == InputKind.PARAMETER}
        self.param_targets = {n: targets[n.name] for n in self.gm.graph.nodes
                              if n.op == "placeholder" and n.name in targets}

    def _recompute_spans(self, regions: Sequence[Sequence[str]]) -> None:
        """For each region (op names of the capture), the run of top-level program nodes from its
        first op to its last: run under checkpoint and re-run in the backward (`spans`: first
        node -> the run; `in_span`: the others)."""
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        top: dict[str, torch.fx.Node] = {}
        for n in self.gm.graph.nodes:
            if n.op != "call_function":
                continue
            top[n.name] = n
            i = _subgraph_index(n, self.gm)
            if i is not None:
                for inner in _program_calls(getattr(self.gm, str(n.args[i].target)), f"{n.name}__"):
                    top[inner] = n
        nodes = list(self.gm.graph.nodes)
        self.spans: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        self.in_span: set[torch.fx.Node] = set()
        for names in regions:
            ns = [top[x] for x in names if x in top]
            if not ns:
                continue
            lo, hi = min(order[n] for n in ns), max(order[n] for n in ns)
            span = nodes[lo:hi + 1]
            # getitems reading a node of the span belong with it
            while hi + 1 < len(nodes) and nodes[hi + 1].target is operator.getitem and nodes[hi + 1].args[0] in span:
                hi += 1
                span = nodes[lo:hi + 1]
            if any(m in self.in_span or m in self.spans for m in span):
                raise PlanError(f"recomputed regions overlap at {span[0].name}")
            self.spans[span[0]] = span
            self.in_span.update(span[1:])

    def _discard_regions(self, regions: Sequence[Sequence[str]]) -> None:
        """"norm_act"'s regions (op names of the capture, each in program order): each op's
        outputs discarded once saved and re-made in the backward (`_DiscardState`).
        `discard_of`: op -> its region's index into `discard_ops`."""
        self.discard_ops: list[list[str]] = [list(r) for r in regions if r]
        self.discard_of: dict[str, int] = {}
        if not self.discard_ops:
            return
        names = {n.name for n in self.gm.graph.nodes}
        for n in self.gm.graph.nodes:
            i = _subgraph_index(n, self.gm) if n.op == "call_function" else None
            if i is not None:
                names.update(_program_calls(getattr(self.gm, str(n.args[i].target)), f"{n.name}__"))
        for k, ops in enumerate(self.discard_ops):
            missing = [o for o in ops if o not in names]
            if missing:
                raise PlanError(f"the recompute=norm_act region of {ops[0]} names ops the model's program lacks "
                                f"({', '.join(missing[:3])}); plan and run the same model")
            for o in ops:
                if o in self.discard_of:
                    raise PlanError(f"recompute=norm_act regions overlap at {o}")
                self.discard_of[o] = k

    def run_units(self, calls: dict[str, Any], running: Optional[set] = None) -> None:
        """Run the ops of each module `fqn` of the model (its nodes in the program, from the first
        to the last, a contiguous run) as one call `calls[fqn](region, *inputs)`, which must
        return `region(*inputs)`: `inputs` are the tensors the run reads from before it (other
        modules' parameters among them), the module's own parameters are looked up on the model
        inside `region` (at the call's time), and what it returns is what later ops read.
        ZeRO-3 passes FSDP2 forward methods of the module (`register_fsdp_forward_method`),
        so each FSDP unit is gathered for its ops, freed after them, gathered again for their
        backward and its gradients reduce-scattered after it, as FSDP does for a module's
        forward (the runtime's `zero.ZeroSharding._shard_solved`). A parameter of such a module read by an op outside
        its run, or runs of two modules that interleave, are refused (the planner's units
        avoid both: `planner.zero3_units`); `running`: the nodes this rank runs (its pipeline
        chunks'; default all), the only readers that count (another chunk holds its own copy
        of a tied parameter)."""
        nodes = list(self.gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        spans = []
        for fqn in calls:
            if fqn in self.unit_calls:
                raise PlanError(f"module {fqn}'s ops are already run as one call")
            mine = [n for n in nodes if n.op == "call_function" and _in_module(n, self.gm, fqn)]
            if not mine:
                raise PlanError(f"the model's program runs no op of module {fqn} (a ZeRO-3 unit of the plan)")
            lo, hi = order[mine[0]], order[mine[-1]]
            while hi + 1 < len(nodes) and nodes[hi + 1].target is operator.getitem and nodes[hi + 1].args[0] in mine:
                hi += 1
            spans.append((lo, hi, fqn))
        spans.sort()
        for (_, hi, a), (lo2, _, b) in zip(spans, spans[1:]):
            if lo2 <= hi:
                raise PlanError(f"the ops of modules {a} and {b} (ZeRO-3 units of the plan) interleave in "
                                f"the model's program; each unit's ops must run as one contiguous run")
        # runs given before (ZeRO-3's units around the expert blocks given now): nested or apart
        earlier = {f: (order[sp[0]], order[sp[-1]]) for lst in self.unit_spans.values() for f, sp in lst}
        for lo, hi, fqn in spans:
            for f, (lo2, hi2) in earlier.items():
                if not (hi < lo2 or hi2 < lo or lo2 <= lo <= hi <= hi2 or lo <= lo2 <= hi2 <= hi):
                    raise PlanError(f"the ops of modules {f} and {fqn} overlap in the model's program without "
                                    f"one holding the other; each must run as one contiguous run")
        for lo, hi, fqn in spans:
            span = nodes[lo:hi + 1]
            inside = set(span)
            for ph, target in self.param_targets.items():
                if _under(target.removeprefix("model."), fqn) and any(
                        u not in inside and (running is None or u in running) for u in ph.users):
                    raise PlanError(f"parameter {target.removeprefix('model.')} of ZeRO-3 unit {fqn} is read "
                                    f"by an op outside the unit's ops")
            for first, rspan in self.spans.items():
                rs = set(rspan)
                if rs & inside and not rs <= inside:
                    raise PlanError(f"a recomputed region starting at {first.name} crosses the ops of ZeRO-3 "
                                    f"unit {fqn}")
            # a region inside a ZeRO-3 unit holds the unit's gathered parameters it read: FSDP
            # frees their storage after the unit's forward and gathers them into it again before
            # the unit's backward, where the region's outputs' savers (its block's ops) re-run it
            inner = [m.name for m in span if m.name in self.discard_of]
            if inner and fqn in self.replaced_pending:
                # its ops do not run: the replacing module discards its activations itself
                # (`runtime.discard.discard_activations`, installed by the caller)
                for r in {self.discard_of[o] for o in inner}:
                    for o in self.discard_ops[r]:
                        self.discard_of.pop(o, None)
            self.unit_spans.setdefault(span[0], []).append((fqn, span))
            for m in span:
                self.units_of.setdefault(m, []).append(fqn)
        # outer runs first: the longer of two runs holding a node holds the other
        size = {f: len(sp) for lst in self.unit_spans.values() for f, sp in lst}
        for lst in self.unit_spans.values():
            lst.sort(key=lambda x: -len(x[1]))
        for fs in self.units_of.values():
            fs.sort(key=lambda f: -size[f])
        self.unit_calls.update(calls)

    def replace_modules(self, calls: dict[str, Callable[..., tuple]], running: Optional[set] = None) -> None:
        """Run each module `fqn`'s ops (one contiguous run of the program, found and checked as
        `run_units` does) as `calls[fqn](*inputs)` in their place: a module the runtime replaces
        by one of its own that computes the same values another way (expert parallelism's token
        exchange, `runtime.experts.program_calls`). `inputs` are the tensors the run reads from
        before it, in program order, the module's own parameters left out (the replacement holds
        its own); the call returns the tensors later ops read of the run, in program order (the
        numbers they read, sizes its shape arithmetic worked out, symbolic in the batch, are
        worked out again from the numbers before the run: `_with_numbers`)."""
        self.replaced_pending = set(calls)
        try:
            self.run_units({fqn: (lambda region, *vals, f=f: f(*vals)) for fqn, f in calls.items()}, running)
        finally:
            self.replaced_pending = set()
        self.replaced |= set(calls)

    def _distribute_parameters(self) -> None:
        """Every parameter becomes a DTensor with its planned placements (Replicate when the
        plan does not name it); tied parameters stay tied; interleaved rows are permuted."""
        sol, mesh = self.solution, self.mesh

        def make(fqn: str, p: nn.Parameter) -> nn.Parameter:
            if self.own is not None and fqn not in self.own:
                return p                    # another pipeline chunk's: stays on meta
            spec = sol.param_placements.get(fqn, ("R",) * mesh.ndim)
            if len(spec) != mesh.ndim:
                raise PlanError(f"placement {tuple(spec)} of {fqn} has {len(spec)} entries for a "
                                f"{mesh.ndim}-D mesh")
            pl = to_placements(spec, p.dim())
            data = p.detach()
            if fqn in sol.param_layouts:
                dim, chunks = sol.param_layouts[fqn]
                ways = _ways(pl, dim, mesh)
                self.layouts[fqn] = (dim, chunks, ways)
                data = interleave(data, dim, chunks, ways)
            return nn.Parameter(distribute_tensor(data, mesh, pl, src_data_rank=None), requires_grad=p.requires_grad)

        replace_parameters(self.model, make)

    # -- running ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.names and kwargs:
            args = tuple(args) + tuple(kwargs[k] for k in self.names[len(args):])
        flat = self._flat_inputs(args)
        interp = _PlanInterpreter(self)
        try:
            with interp.regather:
                out = interp.run(*flat)
        finally:
            # what the forward made is the backward's (autograd keeps what it saves): the
            # interpreter's references go now, not whenever a garbage collection breaks its cycles
            interp.release()
        loss = out[0] if isinstance(out, (tuple, list)) else out
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def _flat_inputs(self, user: Sequence[Any]) -> list[Any]:
        """The program's placeholders in order: parameters, buffers, constants, user inputs."""
        from torch.export.graph_signature import InputKind

        wrapped = self._wrapped[0]
        user_it: Iterator[Any] = iter(user)
        flat: list[Any] = []
        for spec in self.program.graph_signature.input_specs:
            if spec.kind == InputKind.PARAMETER:
                flat.append(wrapped.get_parameter(spec.target))
            elif spec.kind == InputKind.BUFFER:
                flat.append(self._replicated(wrapped.get_buffer(spec.target)))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                c = self.constants[spec.target]
                if isinstance(c, torch.Tensor) and c.is_meta:
                    raise PlanError(f"the model's program holds a tensor constant ({spec.target}) "
                                    f"traced on the meta device only; capture the model on its "
                                    f"device to apply this solution")
                flat.append(self._replicated(c) if isinstance(c, torch.Tensor) else c)
            elif spec.kind == InputKind.USER_INPUT:
                flat.append(self._user_input(spec.arg.name, next(user_it)))
            else:  # pragma: no cover - token inputs of effectful ops
                raise PlanError(f"unsupported program input {spec.kind} ({spec.arg})")
        return flat

    def _replicated(self, t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)

    def _user_input(self, name: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        spec = self.solution.input_placements.get(name, ("R",) * self.mesh.ndim)
        pl = to_placements(spec, x.dim())
        if self.inputs_mode == "local":
            return DTensor.from_local(x, self.mesh, pl, run_check=False)
        return distribute_tensor(x, self.mesh, pl, src_data_rank=None)

    # -- reading back ----------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter as a full tensor in the model's row order (collective: call it on
        every rank)."""
        return {n: self._full(n, p) for n, p in self.model.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient as a full tensor in the model's row order (collective)."""
        return {n: self._full(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None}

    def _full(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        t = t.full_tensor() if isinstance(t, DTensor) else t
        lay = self.layouts.get(fqn)
        return deinterleave(t.detach(), *lay) if lay else t.detach()


def _under(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def _in_module(n: torch.fx.Node, gm: torch.fx.GraphModule, fqn: str) -> bool:
    """Whether top-level node `n` of the program runs inside module `fqn` of the model (the
    `_WithLoss` wrapper's `model`): its module stack, or that of an op of the subgraph it wraps,
    names the module."""
    def names(m: torch.fx.Node) -> bool:
        stack = m.meta.get("nn_module_stack") or {}
        return any(_under(str(v[0] if isinstance(v, tuple) else v), "model." + fqn) for v in stack.values())

    if names(n):
        return True
    i = _subgraph_index(n, gm)
    if i is not None:
        sub = getattr(gm, str(n.args[i].target))
        return any(names(m) for m in sub.graph.nodes if m.op == "call_function")
    return False


def _program_calls(gm: torch.fx.GraphModule, prefix: str = "") -> dict[str, torch.fx.Node]:
    """The call nodes of a program by their OpGraph names, wrapped subgraphs inlined as the
    capture inlines them ("<wrapper>__<node>")."""
    out: dict[str, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        i = _subgraph_index(n, gm)
        if i is not None:
            out.update(_program_calls(getattr(gm, str(n.args[i].target)), f"{prefix}{n.name}__"))
        elif not (n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)
                  and _subgraph_index(n.args[0], gm) is not None):
            out[prefix + n.name] = n
    return out


def _mutates(gm: torch.fx.GraphModule) -> bool:
    """Whether the program (its wrapped subgraphs included) holds an op that writes to one of
    its inputs in place (`x.add_(y)` in the model's code)."""
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for mod in gm.modules() if isinstance(getattr(mod, "graph", None), torch.fx.Graph)
               for n in mod.graph.nodes if n.op == "call_function")


def _with_numbers(fqn: str, outs: Sequence[torch.fx.Node], tensors: Sequence[Any], env: dict) -> tuple:
    """The values later ops read of a replaced module's run (`outs`): `tensors`, what the
    replacement returned, for those that are tensors; a number (a size its shape arithmetic
    worked out: Hugging Face's grouped experts compute token counts that later ops reuse)
    worked out again from the numbers it was made of (`env`: the run's values), which must not
    need a tensor of the run."""
    def number(n: Any) -> Any:
        if not isinstance(n, torch.fx.Node):
            return n
        if n in env:
            return env[n]
        v = n.meta.get("val")
        if n.op != "call_function" or isinstance(v, torch.Tensor) or n.target.__module__ not in ("_operator",
                                                                                                  "math", "builtins"):
            raise PlanError(f"the run of module {fqn}'s ops is replaced, but later ops read {n.name} ({n.target}) "
                            f"of it, which cannot be worked out without it")
        return n.target(*[number(a) for a in n.args])

    numbers = {o: number(o) for o in outs if not isinstance(o.meta.get("val"), torch.Tensor)}
    if len(outs) - len(numbers) != len(tensors):
        raise PlanError(f"the run of module {fqn}'s ops gave {len(tensors)} tensors where later ops read "
                        f"{', '.join(o.name for o in outs)} of it")
    it = iter(tensors)
    return tuple(numbers[o] if o in numbers else next(it) for o in outs)


def _written_inputs(n: torch.fx.Node, args: Sequence[Any]) -> list[int]:
    """The positions of op `n`'s positional inputs that it writes in place (its schema's
    mutable arguments: `x.div_(y)`, `x /= y` in the model's code) and that need a gradient,
    read from program nodes."""
    if not isinstance(n.target, torch._ops.OpOverload) or not n.target._schema.is_mutable:
        return []
    return [i for i, a in enumerate(n.target._schema.arguments[:len(args)])
            if a.alias_info is not None and a.alias_info.is_write and isinstance(n.args[i], torch.fx.Node)
            and isinstance(args[i], torch.Tensor) and args[i].requires_grad]


def _no_choice_needed(n: torch.fx.Node) -> bool:
    """Nodes the capture leaves out of the OpGraph: shape arithmetic and assertions."""
    val = n.meta.get("val")
    if isinstance(val, (torch.SymInt, int, float, bool)) or "sym_size" in str(n.target) \
            or "_assert" in str(n.target):
        return True
    return val is None or (n.target is operator.getitem and not isinstance(val, torch.Tensor))


class _PlanInterpreter(torch.fx.Interpreter):
    """Runs the exported program over DTensors, feeding each planned op its inputs in the
    layouts its chosen strategy reads them in. A higher-order op wrapping a subgraph (a
    torch.no_grad or autocast region) runs its subgraph with a nested interpreter, whose nodes
    the capture names "<wrapper>__<node>" (it inlines them)."""

    def __init__(self, prog: ShardedProgram, gm: Optional[torch.fx.GraphModule] = None,
                 prefix: str = "", parent: Optional["_PlanInterpreter"] = None) -> None:
        super().__init__(gm if gm is not None else prog.gm, garbage_collect_values=True)
        self.prog = prog
        self.sol = prog.solution
        self.mesh = prog.mesh
        self.prefix = prefix
        self.junction_values: dict[str, DTensor] = parent.junction_values if parent else {}
        self.alias: dict[torch.fx.Node, str] = parent.alias if parent else {}   # node -> OpGraph name
        self.regather = parent.regather if parent else _Regather()
        self.discard: _DiscardState = parent.discard if parent else _DiscardState()
        if parent is None and prog.discard_of:
            self.regather.discard = self.discard
        self.alias_outputs: dict[torch.fx.Node, list[str]] = {}   # wrapper -> its outputs' names
        self.node_name = ""
        self.in_units: list[str] = []       # the units whose runs are running (`_run_unit`), outer first

    def run_span(self, nodes: Sequence[torch.fx.Node], env: dict, keep: set) -> Any:
        """Run `nodes` (a contiguous run of the program, a pipeline chunk) from `env` (the
        placeholders and received tensors they read); a value is dropped after its last reader
        unless in `keep` (what the chunk sends on). Returns the output node's value when the
        run reaches it, else None (what to send is in `self.env`)."""
        self.env = env
        return self._run_nodes(nodes, keep)

    def _run_nodes(self, nodes: Sequence[torch.fx.Node], keep: set) -> Any:
        """Run `nodes` into `self.env`, each value dropped after its last reader unless in
        `keep`; the output node's value when the run reaches it, else None."""
        for node in nodes:
            if node in self.env:
                continue
            self.env[node] = self.run_node(node)
            for v in self.user_to_last_uses.get(node, ()):
                if v not in keep:
                    self.env.pop(v, None)
            if node.op == "output":
                return self.env[node]
        return None

    def release(self) -> None:
        """Drop the tensors the run holds (its environment, the junctions' redistributed values)."""
        self.env.clear()
        self.junction_values.clear()
        self.alias.clear()
        self.alias_outputs.clear()
        self.discard.clear()

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return self.on_device(args), self.on_device(kwargs)

    def on_device(self, v: Any, n: Optional[torch.fx.Node] = None) -> Any:
        """Devices of a program traced on meta made the real one (`n`: the node whose arguments
        `v` are, when it names no device: `v` as it is)."""
        if self.prog.run_device is None or (n is not None and not _names_device(n, self.prog.device_args)):
            return v
        real, traced = self.prog.run_device, self.prog.traced_device
        return torch.fx.node.map_aggregate(v, lambda x: real if _traced_for(x, traced) else x)

    def name_of(self, n: torch.fx.Node) -> str:
        """The OpGraph name of the tensor node `n` stands for."""
        return self.alias.get(n, self.prefix + n.name)

    def run_node(self, n: torch.fx.Node) -> Any:
        out = self._run_node(n)
        self._release_junctions(n)
        return out

    def _release_junctions(self, n: torch.fx.Node) -> None:
        """Drop the redistributed values of the tensors `n` read last: a junction's value lives
        as long as its producer's last reader (a tied table gathered for the embedding is not
        held through the forward)."""
        if not self.junction_values:
            return
        for v in self.user_to_last_uses.get(n, ()):
            if v.op == "placeholder" and self.prefix:
                continue                # an outer tensor: the outer run owns its junction
            pre = self.name_of(v) + "#"
            for k in [k for k in self.junction_values if k.startswith(pre)]:
                del self.junction_values[k]
        for k in self.sol.junctions_done(self.name_of(n)):
            self.junction_values.pop(k, None)      # a layer's own junction, after its last reader there

    def _run_node(self, n: torch.fx.Node) -> Any:
        if self.prefix == "" and self.prog.unit_spans:
            # the outermost unit holding n that is not running: n starts it, or ran with it
            owner = next((f for f in self.prog.units_of.get(n, ()) if f not in self.in_units), None)
            if owner is not None:
                unit = next((u for u in self.prog.unit_spans.get(n, ()) if u[0] == owner), None)
                if unit is None:
                    return None             # ran with its unit; what others read is in env
                return self._run_unit(n, *unit)
        if self.prefix == "" and self.prog.spans:
            span = self.prog.spans.get(n)
            if span is not None:
                return self._run_recomputed(n, span)
            if n in self.prog.in_span:
                return None                 # ran with its span; what others read is in env
        return self._run_one(n)

    def _run_unit(self, first: torch.fx.Node, fqn: str, span: list[torch.fx.Node]) -> Any:
        """A module's run of ops (`ShardedProgram.run_units`) as one call of its unit's
        callable: the tensors it reads from before it are the call's inputs, its parameters are
        read from the model inside the call (FSDP's unsharded ones there), a recomputed region
        inside it runs as one (`_run_recomputed`). Values are dropped after their last reader,
        inside the run as outside."""
        ext, outs = _span_boundary(span)
        inside = set(span)
        # the unit's own parameters are read inside the call (FSDP's gathered ones there); any
        # other (the root unit's, gathered through the forward) is an input like a tensor
        targets = self.prog.param_targets
        params = [a for a in ext if a in targets and _under(targets[a].removeprefix("model."), fqn)]
        reads = [a for a in ext if a not in params]
        keep = set(outs)
        wrapped = self.prog._wrapped[0]

        def region(*vals: Any) -> tuple:
            outer_env = self.env
            self.env = dict(zip(reads, vals))
            for a in params:
                self.env[a] = wrapped.get_parameter(self.prog.param_targets[a])
            self.in_units.append(fqn)
            try:
                self._run_nodes(span, keep)
                return tuple(self.env[o] for o in outs)
            finally:
                self.env = outer_env
                self.in_units.pop()

        res = self.prog.unit_calls[fqn](region, *[self.env[a] for a in reads])
        if fqn in self.prog.replaced:
            res = _with_numbers(fqn, outs, res, self.env)
        for o, v in zip(outs, res):
            if o is not first:
                self.env[o] = v
        # what is read last by an op of the run that others read (set above, so the outer run
        # skips it, and with it the release of what it read last) goes now
        for o in outs:
            if o is not first:
                for v in self.user_to_last_uses.get(o, ()):
                    if v not in inside:
                        self.env.pop(v, None)
        return res[outs.index(first)] if first in outs else None

    def _run_recomputed(self, first: torch.fx.Node, span: list[torch.fx.Node]) -> Any:
        """A recomputed region's ops (`span`, in program order) under torch's non-reentrant
        checkpoint with torch's selective policy (`runtime.selective`), which asks which op is
        running: every op of the span (under "selective" the attention core's, `StagePlan.
        recompute_ops`) MUST_RECOMPUTE: the backward re-runs all of them, their
        redistributions included (no early stop, so the forward collectives re-run are the
        region's own, as the plan counts them). Junction values are the region's own, so the
        re-run makes what the forward made. Inside the region, as outside, a value is dropped
        after its last reader (else the re-run forward in the backward holds every tensor of the
        region until its end: llama-small tp2 x pp2 full recomputation, stage 0 0.66 MB over
        its plan)."""
        from autopar.runtime.selective import checkpoint_selective

        ext, outs = _span_boundary(span)
        mine = {self.name_of(m) for m in span}
        keep = set(outs)

        def region(*vals: Any) -> tuple:
            outer_env, outer_j = self.env, self.junction_values
            self.env, self.junction_values = dict(zip(ext, vals)), {}
            self.regather.paused += 1       # the checkpoint's own hooks hold what the region saves
            try:
                with recomputing():
                    for m in span:
                        self.env[m] = self._run_one(m)
                        self._release_junctions(m)
                        for v in self.user_to_last_uses.get(m, ()):
                            if v not in keep:
                                self.env.pop(v, None)
                return tuple(self.env[o] for o in outs)
            finally:
                self.env, self.junction_values = outer_env, outer_j
                self.regather.paused -= 1

        res = checkpoint_selective(region, *[self.env[a] for a in ext], early_stop=False,
                                   recompute=lambda: self.node_name in mine)
        for o, v in zip(outs, res):
            if o is not first:
                self.env[o] = v
        return res[outs.index(first)] if first in outs else None

    def _run_one(self, n: torch.fx.Node) -> Any:
        self.node_name = self.name_of(n)
        if self.prog.discard_of and not self.discard.replaying and torch.is_grad_enabled():
            region = self.prog.discard_of.get(self.node_name)
            if region is not None:
                ops = self.prog.discard_ops[region]
                return self.discard.run(self, n, region, self.node_name == ops[0], self.node_name == ops[-1])
        if self.prog.fn_first:
            call = self.prog.fn_first.get(n)
            if call is not None:
                return self._run_function(n, call)
            if n in self.prog.fn_inside:
                return self.env.get(n)      # ran with its call; its value, if an output, is in env
        if n.op == "call_function" and "_assert" in self.prog.op_name(n):
            return None                     # metadata assertions: nothing to run
        choice = self.sol.op_choices.get(self.node_name) if n.op == "call_function" else None
        if choice is not None:
            if not _preserving_meta():
                return self._run_planned(n, choice)     # `_set_current_node` would set nothing
            with self._set_current_node(n):
                return self._run_planned(n, choice)
        if n.op == "call_function" and _subgraph_index(n, self.module) is not None:
            return self._run_wrapped(n)
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in self.alias_outputs:
            self.alias[n] = self.alias_outputs[n.args[0]][n.args[1]]
        if n.op == "output" and self.prefix == "":
            outs = [self._feed(self.env[a], self.name_of(a), 0, ("R",) * self.mesh.ndim)
                    if isinstance(a, torch.fx.Node) else a for a in _flat_nodes(n.args[0])]
            return tuple(outs)
        return super().run_node(n)

    def _run_function(self, first: torch.fx.Node, call: Any) -> Any:
        """A custom autograd Function's call (`capture.functions.Region`) run as the user's
        `Function.apply` on its arguments as they are: its forward's ops run under DTensor's
        propagation (plain tensors, read as replicated, become DTensors where another argument
        is one), its backward is the Function's own. Its outputs go to env under its output
        ops; the value of `first` is returned."""
        args = [self.env[a] if isinstance(a, torch.fx.Node) else a for a in call.args]
        if any(isinstance(a, DTensor) for a in args):
            args = [self.prog._replicated(a) if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                    for a in args]
        with self.regather.saving(args):
            out = call.fn.apply(*args)
        outs = (out,) if call.single else tuple(out)
        for k, node in call.outputs.items():
            self.env[node] = outs[k]
        return self.env.get(first)

    def _run_wrapped(self, n: torch.fx.Node) -> Any:
        """A higher-order op wrapping a subgraph: its subgraph, nested, under its context."""
        i = _subgraph_index(n, self.module)
        sub = getattr(self.module, str(n.args[i].target))
        operands = n.args[i + 1:]
        inner = _PlanInterpreter(self.prog, sub, f"{self.prefix}{n.name}__", self)
        placeholders = [x for x in sub.graph.nodes if x.op == "placeholder"]
        for ph, a in zip(placeholders, operands):
            if isinstance(a, torch.fx.Node):
                self.alias[ph] = self.name_of(a)
        out_node = next(x for x in sub.graph.nodes if x.op == "output")
        self.alias_outputs[n] = [inner.name_of(x) if isinstance(x, torch.fx.Node) else ""
                                 for x in _flat_nodes(out_node.args[0])]
        values = [self.env[a] if isinstance(a, torch.fx.Node) else a for a in operands]
        with _wrapper_context(n):
            return inner.run(*values)

    # -- one op ----------------------------------------------------------------------------
    def _run_planned(self, n: torch.fx.Node, choice: OpChoice) -> Any:
        """Op `n` with its inputs in the layouts `choice` reads them in."""
        specs = choice.input_placements
        local = self.runs_local(n, choice)
        if local:
            feed_one = self._feed_local
        elif self.runs_on_shards(n, choice):
            return self._run_on_shards(n, self._feed_own_grad(self.env[n.args[0]], self.name_of(n.args[0]), 0,
                                                              choice.input_placements[0]))
        elif choice.family == "attention" and not query_head_axes(choice.strategy):
            feed_one = self._feed_own_grad     # `_local_attention` sets its inputs' gradients' layout
        else:
            feed_one = self._feed
        env = self.env
        if n.target is operator.getitem and isinstance(env[n.args[0]], (tuple, list)):
            src, idx = n.args[0], n.args[1]
            return feed_one(env[src][idx], self.name_of(src), idx, specs[0])
        k = 0

        def feed(a: Any) -> Any:
            nonlocal k
            if not isinstance(a, torch.fx.Node):
                return a
            v = env[a]
            if isinstance(v, torch.Tensor) and k < len(specs):
                v = feed_one(v, self.name_of(a), 0, specs[k])
                k += 1
            return v

        args = self.on_device(torch.fx.node.map_aggregate(n.args, feed), n)
        kwargs = self.on_device(torch.fx.node.map_aggregate(n.kwargs, feed), n) if n.kwargs else {}
        written = _written_inputs(n, args)
        if written:
            # an op writing in place to a tensor that needs a gradient: what it reads may be the
            # view `_Reshard` returns, which autograd forbids mutating; it writes to a copy, and
            # the tensor's later readers read the result (in eager the write is visible to them)
            args = tuple(a.clone() if i in written else a for i, a in enumerate(args))
        with self.regather.saving(args, kwargs):
            out = _run_target(n, args, kwargs) if local else self._run_op(n, choice, args, kwargs)
        if choice.family == "loss" and self.prog.context is not None:
            out = self.prog.context.loss(n.target, args, kwargs, out)     # the cp group's mean
        for i in written:
            if n.args[i] in self.env:
                self.env[n.args[i]] = args[i]
        return out

    def runs_local(self, n: torch.fx.Node, choice: OpChoice) -> bool:
        """Whether op `n` runs on local tensors: the plan replicates each of its inputs and
        outputs over every mesh axis. DTensor would run the same kernel on the same local
        tensors, behind its dispatch (50 to 100 us an op on CPU, forward and backward again);
        gpt-small's norms and residual adds are 18 of its tp step's 120 DTensor ops forward
        and more backward. Attention keeps its own path (`_local_attention`); random ops
        (DTensor draws one stream for a replicated tensor on every device) and ops writing in
        place (to a tensor a DTensor may share) stay with DTensor."""
        local = self.prog.local_ops.get(n)
        if local is None:
            local = self.prog.local_ops[n] = choice.family != "attention" and not _random_or_mutating(n) \
                and all(_replicated(s) for s in [*choice.input_placements, *choice.output_placements])
        return local

    def runs_on_shards(self, n: torch.fx.Node, choice: OpChoice) -> bool:
        """Whether op `n` runs on each device's shard as DTensor would run it, without DTensor's
        dispatch (`_run_on_shards`): an element-wise op (torch's `pointwise` tag) of one tensor,
        its first argument, the other arguments numbers, that the plan lays out sharded (not
        only replicated: `runs_local`), partial nowhere, its output as its input. The shards'
        results are the result's shards, and each shard's gradient the gradient's shard:
        DTensor communicates nothing for it either way (gpt-small's GELUs)."""
        hit = self.prog.shard_ops.get(n)
        if hit is None:
            t = n.target
            specs, outs = choice.input_placements, choice.output_placements
            hit = self.prog.shard_ops[n] = (
                isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
                and not _random_or_mutating(n) and choice.family not in ("attention", "loss")
                and len(specs) == 1 and len(outs) == 1 and tuple(map(str, specs[0])) == tuple(map(str, outs[0]))
                and not _partial(specs[0]) and not _replicated(specs[0])
                and len(n.args) >= 1 and isinstance(n.args[0], torch.fx.Node)
                and all(isinstance(a, (int, float, bool, str)) for a in [*n.args[1:], *n.kwargs.values()])
                and isinstance(n.args[0].meta.get("val"), torch.Tensor)
                and isinstance(n.meta.get("val"), torch.Tensor)
                and tuple(n.meta["val"].shape) == tuple(n.args[0].meta["val"].shape))
        return hit

    def _run_on_shards(self, n: torch.fx.Node, x: Any) -> Any:
        """Op `n` (`runs_on_shards`) on this device's shard of `x`, its gradient coming back in
        `x`'s layout; the result laid out as `x`."""
        with self.regather.saving((x,)):
            if not isinstance(x, DTensor):
                return _run_target(n, (x, *n.args[1:]), dict(n.kwargs))
            local = _ToLocal.apply(x, x.placements)
            out = _run_target(n, (local, *n.args[1:]), dict(n.kwargs))
        if out.stride() != local.stride():      # as DTensor would lay it out: from the shard's strides
            return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())

    def _feed_local(self, value: Any, producer: str, out_index: int, spec: Spec) -> Any:
        """`value` as a plain tensor for an op run on local tensors (`runs_local`; `spec` is
        replicated): as it is when it is one (what such an op made) and no junction asks
        another layout or partial gradients of it, else through `_feed` and its local tensor,
        whose gradient goes back as a replicated DTensor."""
        if not isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, DTensor):
            j = self.sol.junctions.get(self.sol.junction_of(self.node_name, f"{producer}#{out_index}"))
            if j is None or (_replicated(j[0]) and not j[1]):
                return value
        x = self._feed_own_grad(value, producer, out_index, spec)
        return _ToLocal.apply(x, x.placements)

    def _feed_own_grad(self, value: Any, producer: str, out_index: int, spec: Spec) -> Any:
        """`_feed` for an op run on local tensors that it reads through `_ToLocal` with their
        gradients laid out as its inputs (`_grad_target` of their layout: an op run locally, or
        attention, `_local_attention`): a DTensor already in the layout asked, partial nowhere,
        read without a junction, is read as it is, since its `_Reshard` would redistribute
        nothing forward and, its gradient arriving in its own layout, nothing backward (121 of
        gpt-small tp-2's 130 reads per step are such no-ops, 42 of them of this kind)."""
        if isinstance(value, DTensor) and value.placements == _placements_of(spec, value.ndim) \
                and not any(p.is_partial() for p in value.placements) \
                and self.sol.junction_of(self.node_name, f"{producer}#{out_index}") not in self.sol.junctions:
            return value
        return self._feed(value, producer, out_index, spec)

    def _run_op(self, n: torch.fx.Node, choice: OpChoice, args: Any, kwargs: Any) -> Any:
        """Run op `n` on inputs laid out as planned: DTensor runs it, except where its default
        would communicate differently from the plan (see the module docstring)."""
        op, specs, outs = self.prog.op_name(n), choice.input_placements, choice.output_placements
        if op in SPLIT_OPS and self._splits_sharded_dim(n, args[0]):
            return self._local_split(n, args[0])
        if len(specs) == 1 and _partial(specs[0]) and _unsharded(specs[0]) and all(map(_unsharded, outs)):
            return self._partial_passthrough(n, args, kwargs)
        if choice.family == "attention":
            return self._local_attention(args, kwargs, n, outs, query_head_axes(choice.strategy))
        if choice.family == "loss" and "vocab-parallel" in choice.strategy:
            return self._vocab_parallel_loss(n, args, kwargs)
        if choice.family == "loss" and _partial(outs[0]) and reduction_of(op, n.args, n.kwargs) in (1, 2):
            return self._shard_loss(n, args, kwargs, outs[0], op)
        return _run_target(n, args, kwargs)

    def _feed(self, value: Any, producer: str, out_index: int, spec: Spec) -> Any:
        """`value` (output `out_index` of `producer`) in layout `spec`: through its junction
        (one redistribution shared by its consumers) when it has one."""
        if not isinstance(value, torch.Tensor):
            return value
        x = value if isinstance(value, DTensor) else self.prog._replicated(value)
        key = self.sol.junction_of(self.node_name, f"{producer}#{out_index}")
        j = self.sol.junctions.get(key)
        param = producer in self.prog.param_nodes
        if j is None:
            return self._reshard(x, spec, (), param)
        jv = self.junction_values.get(key)
        if jv is None:
            jv = self.junction_values[key] = self._reshard(x, j[0], (), param)
        return self._reshard(jv, spec, j[1], param)

    def _reshard(self, x: DTensor, spec: Spec, keep_partial: Sequence[int], param: bool = False) -> DTensor:
        """`x` in layout `spec`; a parameter gathered here is gathered again for the backward
        pass rather than kept (`_Regather`), as ZeRO-3/FSDP and the plan's accounting do."""
        dst = _target(x, spec)
        if self.prog.trace is not None and tuple(x.placements) != dst:
            self.prog.trace.append((self.node_name, tuple(map(str, x.placements)),
                                    tuple(map(str, dst))))
        whole = tuple(self.sol.model_axes)
        if not x.requires_grad:
            return redistribute(x, dst, whole)
        if not param and not keep_partial and not self.prog.mutates and tuple(x.placements) == dst \
                and all(isinstance(p, Shard) for p in dst):
            # an activation split along every mesh axis and read so: nothing to do forward, and
            # its gradient goes to its producer's backward, which takes it in any layout, so no
            # `_Reshard` node either. Not a parameter: DTensor's backward may hand its gradient
            # back in another layout (a vocabulary-parallel embedding's table, S(0) over tp, gets
            # a replicated (vocabulary x hidden) one: torch has no row-wise
            # `embedding_dense_backward` strategy), and without the node that whole gradient
            # accumulated over the step's micro-batches (GPT-3 175B stage 0: +0.88 GiB, -2.1%
            # against the plan, `autopar verify`)
            return x
        out = _Reshard.apply(x, dst, _grad_target(x.placements, keep_partial), whole, not self.prog.mutates)
        if param and any(isinstance(c, Shard) and d.is_replicate() for c, d in zip(x.placements, dst)):
            self.regather.track(out, x.detach(), dst)
        return out

    # -- ops DTensor would run otherwise ---------------------------------------------------
    def _splits_sharded_dim(self, n: torch.fx.Node, x: Any) -> bool:
        return isinstance(x, DTensor) and any(
            isinstance(p, Shard) and p.dim == _split_dim(n, x.ndim) for p in x.placements)

    def _local_split(self, n: torch.fx.Node, x: DTensor) -> list[DTensor]:
        """Split each device's shard: with interleaved weight rows it holds its share of every
        chunk, so chunk i of the shard is the shard of chunk i."""
        dim = _split_dim(n, x.ndim)
        ways = _ways(x.placements, dim, self.mesh)
        sizes = [int(v.shape[dim]) // ways for v in n.meta["val"]]
        pieces = torch.split(_ToLocal.apply(x, x.placements), sizes, dim)
        return [DTensor.from_local(p, self.mesh, x.placements, run_check=False) for p in pieces]

    def _partial_passthrough(self, n: torch.fx.Node, args: Any, kwargs: Any) -> DTensor:
        """An op linear in its one tensor input (a view, a cast, a scaling) on a partial input:
        run on each device's summand, the output partial likewise. DTensor reduces the input
        first for some of them (expand, unsqueeze). The layout holds no shard, so local shapes
        are the global ones."""
        return _on_summands(args[0], lambda t: n.target(t, *args[1:], **kwargs))

    def _local_attention(self, args: Any, kwargs: Any, n: torch.fx.Node,
                         out_specs: Sequence[Spec], hq_axes: Sequence[int] = ()) -> Any:
        """Attention on each device's shard: the plan splits only batch and head dims (the
        sequence and head dims stay whole), so the shards are independent attentions. DTensor
        has no rule for CPU flash attention with a mask.

        Query heads split alone (`hq_axes`, grouped-query attention with more devices than KV
        heads): K and V come replicated over those axes, and each device attends over the KV
        heads its query heads use (query head i reads KV head i // g), sliced locally. Their
        gradients go back partial over `hq_axes`: each device's is zero outside its slice."""
        cp = self.prog.context
        attend = n.target if cp is None else (lambda *a, **k: cp.attention(n.target, a, k))
        if cp is not None and n.meta.get(CAUSAL_MASK):
            # its explicit mask is the causal one of the positions (`capture.own_positions`)
            attend = lambda *a, **k: cp.attention(n.target, *causal_call(a, k))  # noqa: E731
        if not hq_axes:
            out = attend(*_locals(args), **_locals(kwargs))
        else:
            q, k, v = args[:3]
            lq, lk, lv = _locals(q), _kv_local(k, hq_axes), _kv_local(v, hq_axes)
            hd = q.ndim - 3
            hq, hkv = int(q.shape[hd]), int(k.shape[hd])
            start = _local_offset(q, hd)
            g = hq // hkv
            first, last = start // g, (start + int(lq.shape[hd]) - 1) // g
            lk, lv = (t.narrow(hd, first, last - first + 1) for t in (lk, lv))
            out = attend(lq, lk, lv, *_locals(args[3:]), **_locals(kwargs))
        if isinstance(out, torch.Tensor):
            return DTensor.from_local(out, self.mesh, to_placements(out_specs[0], out.dim()), run_check=False)
        return type(out)(DTensor.from_local(o, self.mesh, to_placements(sp, o.dim()), run_check=False)
                         if isinstance(o, torch.Tensor) else o for o, sp in zip(out, out_specs))

    def _vocab_parallel_loss(self, n: torch.fx.Node, args: Any, kwargs: Any) -> Any:
        """Cross-entropy over class-sharded logits with torch's loss_parallel handlers (three
        all-reduces of one value per row, none backward), forward and backward. On a mesh of
        several axes the handlers sum only (the batch may be split along another axis): the
        mean is that sum over the number of targets (exact when none is ignored)."""
        op = _op_name(n)
        args, kwargs = list(args), dict(kwargs)
        mean_nd = self.mesh.ndim > 1 and reduction_of(op, n.args, n.kwargs) == 1
        if mean_nd:
            pos = REDUCTION_ARG[op]
            if len(args) > pos:
                args[pos] = 2
            else:
                kwargs["reduction"] = 2
        out = loss_parallel_call(n.target, *args, **kwargs)
        return _scaled(out, 1.0 / args[1].numel()) if mean_nd else out

    def _shard_loss(self, n: torch.fx.Node, args: Any, kwargs: Any, out_spec: Spec, op: str) -> DTensor:
        """A loss over a split batch (or other reduced dim): each device's share, to be summed
        (reduction mean: each device's mean / devices, exact for equal shards)."""
        local = n.target(*_locals(args), **_locals(kwargs))
        pl = tuple(Partial() if p == "P" else Replicate() for p in out_spec)
        devices = math.prod(self.mesh.size(a) for a, p in enumerate(out_spec) if p == "P")
        scale = 1.0 / devices if reduction_of(op, n.args, n.kwargs) == 1 else 1.0
        return _ShardLoss.apply(local, self.mesh, pl, scale)


# ---------------------------------------------------------------------------- helpers
def _subgraph_index(n: torch.fx.Node, owner: Any) -> Optional[int]:
    """Position of the subgraph argument of a wrapping higher-order op (None for other ops)."""
    if "wrap" not in str(n.target):
        return None
    return next((i for i, a in enumerate(n.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                 and isinstance(getattr(owner, str(a.target), None), torch.fx.GraphModule)), None)


def _wrapper_context(n: torch.fx.Node) -> Any:
    """The context a wrapping higher-order op runs its subgraph in."""
    t = str(n.target)
    if "set_grad_enabled" in t:
        return torch.set_grad_enabled(bool(n.args[0]))
    if "autocast" in t:
        device, dtype, enabled, cache = n.args[:4]
        return torch.autocast(device_type=device, dtype=dtype, enabled=enabled, cache_enabled=cache)
    return contextlib.nullcontext()


def _op_name(n: torch.fx.Node) -> str:
    """"split" for aten.split.Tensor (the OpNode.op convention)."""
    if n.target is operator.getitem:
        return "getitem"
    s = str(n.target)
    parts = s.split(".")
    if s == "autopar.token_positions.default":
        return "arange"         # the capture's op for it (`positions_named_as_captured`)
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else s


def _traced_for(x: Any, traced: Optional[torch.device]) -> bool:
    """`x` is a device a program names for the device it runs on: meta, or the device it was
    traced for (`meta_program`; a CUDA program's `cuda:0` on a rank's `cuda:3`, or on the CPU in
    `autopar verify`)."""
    if not isinstance(x, torch.device):
        return False
    if x.type == "meta":
        return True
    return traced is not None and x.type == traced.type and (x.index is None or x.index == traced.index)


def _split_dim(n: torch.fx.Node, ndim: int) -> int:
    d = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    return int(d) % ndim


def _run_target(n: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    """Op `n`'s own target on `args`; a view as a reshape (a view when strides allow: a program
    traced on meta may view a tensor that real kernels, attention's, lay out with other
    strides)."""
    if n.target is torch.ops.aten.view.default:
        return torch.ops.aten.reshape.default(*args, **kwargs)
    if n.target is torch.ops.aten.histc.default:
        # a program traced for CUDA (verify of a GPU plan) or on meta can take a model's
        # integer branch (Hugging Face's grouped experts: `.int()` unless on CPU or MPS); on
        # the CPU, where the device's program does not fit the solution and the meta one runs
        # (`fitting_program`)
        return histc_any_dtype(*args, **kwargs)
    return n.target(*args, **kwargs)


def histc_any_dtype(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`aten.histc` of `x`, an integer tensor on the CPU included (no CPU kernel takes one: a
    program traced on meta or for CUDA takes a model's integer branch, Hugging Face's experts'
    `.int()` unless on CPU): counted as floats, the same bins, returned in `x`'s dtype."""
    if _int_on_cpu(x):
        return torch.ops.aten.histc.default(x.float(), *args, **kwargs).to(x.dtype)
    return torch.ops.aten.histc.default(x, *args, **kwargs)


def _int_on_cpu(x: Any) -> bool:
    local = x.to_local() if isinstance(x, DTensor) else x
    return isinstance(local, torch.Tensor) and local.device.type == "cpu" and not local.is_floating_point()


def _replicated(spec: Spec) -> bool:
    return all(str(p) == "R" for p in spec)


def _preserving_meta() -> bool:
    """Whether fx keeps node metadata for ops run now (`fx.traceback.preserve_node_meta`), the
    only case where the Interpreter's `_set_current_node` sets anything."""
    return torch.fx.traceback.should_preserve_node_meta


def _names_device(n: torch.fx.Node, memo: dict) -> bool:
    """Whether op `n`'s arguments may hold a device (a constant, or what an argument node
    computes that is no tensor or number), remembered per node in `memo`."""
    hit = memo.get(n)
    if hit is None:
        def maybe(a: Any) -> bool:
            if isinstance(a, torch.fx.Node):
                return not isinstance(a.meta.get("val"), (torch.Tensor, torch.SymInt, torch.SymFloat, int, float,
                                                          bool))
            return isinstance(a, torch.device)
        hit = memo[n] = any(maybe(a) for a in _flat_args(n.args) + _flat_args(list(n.kwargs.values())))
    return hit


def _flat_args(v: Any) -> list[Any]:
    if isinstance(v, (tuple, list)):
        return [y for x in v for y in _flat_args(x)]
    if isinstance(v, dict):
        return [y for x in v.values() for y in _flat_args(x)]
    return [v]


def _random_or_mutating(n: torch.fx.Node) -> bool:
    """Whether op `n` draws random numbers or writes to an input in place."""
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and (
        t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags)


def _partial(spec: Spec) -> bool:
    return any(str(p) == "P" for p in spec)


def _on_summands(x: DTensor, fn: Any) -> DTensor:
    """`fn` (linear) applied to each device's local tensor of `x` (differentiably), the result
    laid out as `x` (partial stays partial; its gradient is the replicated one)."""
    local = _ToLocal.apply(x, _grad_target(x.placements, ()))
    return DTensor.from_local(fn(local), x.device_mesh, x.placements, run_check=False)


def _scaled(x: DTensor, c: float) -> DTensor:
    """`x * c` without the reduction DTensor may run first on a partial `x`."""
    return _on_summands(x, lambda t: t * c)


def _unsharded(spec: Spec) -> bool:
    return all(str(p) in ("R", "P") for p in spec)


def _locals(v: Any) -> Any:
    """DTensors replaced by their local tensors (differentiably)."""
    return torch.fx.node.map_aggregate(
        v, lambda x: _ToLocal.apply(x, _grad_target(x.placements, ())) if isinstance(x, DTensor) else x)


def _kv_local(x: DTensor, axes: Sequence[int]) -> torch.Tensor:
    """The local tensor of K or V (replicated over `axes`) whose gradient goes back partial
    over `axes`: each device's slice of the KV heads gets its share."""
    pl = tuple(Partial() if a in axes else p for a, p in enumerate(_grad_target(x.placements, ())))
    return _ToLocal.apply(x, pl)


def _local_offset(x: DTensor, dim: int) -> int:
    """Where this device's shard of `x` starts along `dim`, in the global tensor (shards nest:
    each later axis splits what the earlier ones left). From the mesh coordinate alone, so it
    runs under fake tensors too (`autopar verify`)."""
    mesh, coord = x.device_mesh, x.device_mesh.get_coordinate()
    size, off = int(x.shape[dim]), 0
    for a, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim == dim:
            size = -(-size // mesh.size(a))
            off += coord[a] * size
    return off


def _flat_nodes(v: Any) -> list[Any]:
    if isinstance(v, (tuple, list)):
        return [y for x in v for y in _flat_nodes(x)]
    return [v]


# ---------------------------------------------------------------------------- entry point
def parallelize_graph(model: nn.Module, example_inputs: Any, solution: ShardingSolution,
                      mesh: DeviceMesh, *, loss_fn: Any = None, inputs: str = "full",
                      param_dtype: Optional[torch.dtype] = None,
                      recompute: Sequence[Sequence[str]] = (), context: Any = None,
                      discard: Sequence[Sequence[str]] = ()) -> ShardedProgram:
    """Apply `solution` to `model` on `mesh` and return a module that trains it as planned.

    `model` must hold real (materialised) parameters, the same values on every rank (each rank
    keeps its shards). `example_inputs` and `loss_fn` as given to `auto_shard` (the program is
    re-exported, so a solution solved on the meta-device copy of the model applies). The mesh's
    shape must be the solution's. Call it on every rank. See the module docstring for how it
    runs and which collectives run. `param_dtype`: the dtype the floating parameters will have
    when the program runs (2-byte weights under mixed precision); the program is then traced
    from a meta copy in that dtype, so that the casts the model's code makes to its weights'
    dtype (`x.to(self.weight.dtype)`, a norm's `.to(input_dtype)`) are traced as they run.
    `recompute`: regions (op names) run under activation checkpointing, each re-run whole in the
    backward. `discard`: "norm_act"'s regions (op names), their outputs discarded once saved
    and re-made in the backward (`_DiscardState`). `context`: context parallelism
    (`runtime.context_parallel.ProgramContext`):
    `example_inputs` are a cp rank's tokens, the program is exported with the token positions
    read when it runs (`models.positions.traced_positions`, its nodes named as the capture's:
    `positions_named_as_captured`), its attention and token-mean loss run through `context`."""
    if context is None:
        return _parallelize_graph(model, example_inputs, solution, mesh, loss_fn=loss_fn, inputs=inputs,
                                  param_dtype=param_dtype, recompute=recompute, discard=discard)
    from autopar.capture.own_positions import whole_sequence
    from autopar.models.positions import traced_positions

    # a model that makes its own positions: its aranges of them made the op (`adopt_positions`)
    with traced_positions(), whole_sequence(context.cp.seq):
        prog = _parallelize_graph(model, example_inputs, solution, mesh, loss_fn=loss_fn, inputs=inputs,
                                  param_dtype=param_dtype, recompute=recompute, discard=discard)
    context.check(prog.program)
    context.cp.shifts.update(getattr(prog.program.graph_module, "autopar_input_shifts", {}))
    prog.context = context
    return prog


def _parallelize_graph(model: nn.Module, example_inputs: Any, solution: ShardingSolution,
                       mesh: DeviceMesh, *, loss_fn: Any = None, inputs: str = "full",
                       param_dtype: Optional[torch.dtype] = None,
                       recompute: Sequence[Sequence[str]] = (),
                       discard: Sequence[Sequence[str]] = ()) -> ShardedProgram:
    if tuple(mesh.shape) != tuple(solution.mesh_shape):
        raise PlanError(f"the solution is for a mesh of shape {tuple(solution.mesh_shape)}, "
                        f"the device mesh has shape {tuple(mesh.shape)}")
    if any(p.is_meta for p in model.parameters()):
        raise PlanError("materialise the model's parameters before applying a solution "
                        "(they are on the meta device)")
    from autopar.capture.export import export_program

    device = None
    floats = [p for p in model.parameters() if p.is_floating_point()]
    if param_dtype is not None and any(p.dtype != param_dtype for p in floats):
        program, names = fitting_program(model, example_inputs, solution, loss_fn=loss_fn, param_dtype=param_dtype,
                                         device=next(model.parameters()).device)
        wrapped = _WithLoss(model, loss_fn or default_loss, names)
        return ShardedProgram(model, wrapped, program, solution, mesh, names, inputs=inputs,
                              device=next(model.parameters()).device, recompute=recompute,
                              constants=_real_constants(program, model), discard=discard)
    # the data-less copy first, traced for the device (`meta_program`), or on meta where that
    # does not fit the solution (`fitting_program`): the solution was solved on the meta
    # capture, whose program it fits even where the model traces differently on its device (a
    # Hugging Face model's attention, for one), and one export then serves (a data-less constant
    # the model holds under its name, Hugging Face's rotary `inv_freq`, read from the model);
    # the model's own program where neither fits or one holds a tensor constant it traced only
    on_meta, names = fitting_program(model, example_inputs, solution, loss_fn=loss_fn,
                                     device=next(model.parameters()).device)
    meta_fits = not _mismatch(on_meta, solution)
    held = _real_constants(on_meta, model) if meta_fits else None
    if held is not None:
        wrapped = _WithLoss(model, loss_fn or default_loss, names)
        return ShardedProgram(model, wrapped, on_meta, solution, mesh, names, inputs=inputs,
                              device=next(model.parameters()).device, recompute=recompute, constants=held,
                              discard=discard)
    program, wrapped, names = export_program(model, example_inputs, loss_fn=loss_fn)
    adopt_positions(program, lambda ins: export_program(model, ins, loss_fn=loss_fn)[0], example_inputs)
    positions_named_as_captured(program)
    if meta_fits and _mismatch(program, solution):
        program, device = on_meta, next(model.parameters()).device
    return ShardedProgram(model, wrapped, program, solution, mesh, names, inputs=inputs, device=device,
                          recompute=recompute, discard=discard)


# programs exported from meta copies, by the model's structure (`capture.cache.model_key`), the
# inputs' shapes, the loss, the weights' dtype and the device the program runs on: the last few
# (a meta program holds no data: its size is its graph's)
_META_PROGRAMS: "OrderedDict[tuple, tuple[Any, Optional[list[str]]]]" = OrderedDict()
META_PROGRAMS_KEPT = 8
#: how often `meta_program` found its program kept ("hits") or exported it ("misses"), in this process
META_PROGRAM_STATS = {"hits": 0, "misses": 0}


def fitting_program(model: nn.Module, example_inputs: Any, solution: ShardingSolution, *, loss_fn: Any = None,
                    param_dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                    whole: Any = None) -> tuple[Any, Optional[list[str]]]:
    """`meta_program` traced for `device`, its ops renamed as the planner's capture names them
    (`program_match.match_names`), or traced on meta where the device's program does not fit
    `solution` even so (`_mismatch`: the model traces into other ops there than on the meta
    device the planner's capture ran on, so the solution names ops the device's program lacks).
    `whole`: where `solution` is part of the program's (a pipeline rank's chunks), the op choices
    of all of it (anything with `op_choices`, every chunk's in pipeline order), which the
    program is matched against; an op of the program it has no choice for runs unplanned, which
    is logged."""
    from autopar.intra_op.grouped_names import grouped_gemms_named_as_solved
    from autopar.intra_op.program_match import match_names, pass_through, unplanned_ops

    full = solution if whole is None else whole
    program, names = meta_program(model, example_inputs, loss_fn=loss_fn, param_dtype=param_dtype, device=device)
    # a grouped GEMM of another spelling in the run's dtype (`grouped_names`) takes the solution's name
    grouped_gemms_named_as_solved(program, full, _program_calls(program.graph_module))
    if getattr(program, "autopar_traced_device", None) is not None:
        bad = _mismatch(program, full, named_by_export=True) and (match_names(program, full)
                                                                   or _mismatch(program, full))
        if bad:
            log.warning("the program %s traces for %s does not fit the plan's solution (%s): running the "
                        "one traced on the meta device, as the planner captured it", type(model).__name__,
                        program.autopar_traced_device, ", ".join(bad[:3]))
            traced = program.autopar_traced_device
            program, names = meta_program(model, example_inputs, loss_fn=loss_fn, param_dtype=param_dtype,
                                          device=device, trace=False)
            # said where the rank reports (verify's notes); the meta program is shared by every
            # rank of this model and device in the process, which match alike
            program.autopar_trace_fallback = (f"its program traced for {traced} does not fit the plan's "
                                              f"solution ({', '.join(bad[:3])})")
            grouped_gemms_named_as_solved(program, full, _program_calls(program.graph_module))
        else:
            pass_through(program, solution, full)
            extra = unplanned_ops(program, full)
            if extra:
                log.warning("%s traces for %s into ops the planner's capture on the meta device lacks (%s): "
                            "they run unplanned, laid out by DTensor's propagation", type(model).__name__,
                            program.autopar_traced_device, ", ".join(extra[:3]))
    return program, names


def meta_program(model: nn.Module, example_inputs: Any, *, loss_fn: Any = None,
                 param_dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None, trace: bool = True) -> tuple[Any, Optional[list[str]]]:
    """(the torch.export program of a data-less copy of `model` with its loss, the keyword names
    of dict inputs or None), floating weights in `param_dtype` when given.

    The program is the one the model runs on `device` (`trace_device`): on CPU the copy's
    weights and inputs are fake tensors on the CPU (a `FakeTensorMode` of the export's own, no
    data), so a model that branches on its device (`x.device.type == "cpu"`, `x.is_cuda`,
    Hugging Face's experts choosing their histogram dtype by device) is traced along the branch
    that runs there, not the meta device's; on a CUDA device as CUDA runs it, where a fake CUDA
    tensor can be traced (`_fake_copy`); elsewhere, or when the device's trace fails, on the meta
    device as before. The program records the device it was traced for
    (`program.autopar_traced_device`, None for meta), which `retarget` and the interpreter map
    to the device it runs on. `trace=False`: on meta, whatever the device.

    Exporting is most of what building a rank's program costs (GPT-3 175B: 17 of about 40 CPU s
    a rank kind in `autopar verify`), and a process that builds several ranks of one plan, or
    several plans of one model (verify's workers, a test launch), exports the same program each
    time. So the last few are kept, keyed by everything the export depends on: the model's
    structure as the capture cache keys it (module types and settings, their classes' source,
    parameter names, shapes, dtypes and tying), the inputs' shapes and dtypes, the loss, the
    device the program is retargeted to and the device it is traced for. The program is shared:
    its users only read it (the setup they do to it, `move_not_cast`, `retarget`, clearing its
    state dict, gives the same result done again). A program whose tensor constants are the
    copy's own data-less tensors (a non-persistent buffer, Hugging Face's rotary `inv_freq`) or
    tensors its forward made from Python data (`_made_from_python_data`: Falcon's index lists,
    whose ranks each exported their own program before) is kept; one that lifts another
    tensor (of the fake-tensor mode it was traced under) is not. A test launch of 26 plans of
    four models on 4 ranks exported 11 of its 12 meta programs per rank with 2 kept and
    constants left out (about 1.5 CPU s each); `META_PROGRAM_STATS` counts hits and misses, and
    each is logged at debug level."""
    from autopar.capture.cache import model_key
    from autopar.capture.export import export_program
    from autopar.capture.own_positions import whole_length
    from autopar.models.positions import tracing

    meta = _meta_copy(model, param_dtype)
    inputs = _to_meta(example_inputs)
    traced = trace_device(device) if trace else None
    # positions traced as the op that reads them when the program runs (context parallelism)
    key = (model_key(meta, inputs, loss_fn=loss_fn), str(device), str(traced), tracing(), whole_length())
    hit = _META_PROGRAMS.get(key)
    if hit is not None:
        _META_PROGRAMS.move_to_end(key)
        META_PROGRAM_STATS["hits"] += 1
        log.debug("meta program of %s: kept (key %s)", type(model).__name__, key[0][:12])
        return hit
    META_PROGRAM_STATS["misses"] += 1
    log.debug("meta program of %s: exporting for %s (key %s)", type(model).__name__, traced or "meta", key[0][:12])
    program, why = None, None
    if traced is not None:
        try:
            copy_, fake_inputs, own = _fake_copy(meta, inputs, traced)
            with fake_cuda.CudaMethods() if fake_cuda.needed(traced) else contextlib.nullcontext():
                program, _, names = export_program(copy_, fake_inputs, loss_fn=loss_fn)
        except Exception as e:  # noqa: BLE001 - a model that cannot be traced there: on meta, said
            why = f"tracing {type(model).__name__} for {traced} failed ({type(e).__name__}: {str(e)[:200]})"
            _warn_once(f"{why}; its program is traced on the meta device, as the planner captured it, and runs "
                       f"on {device}: a branch the model takes by device is the meta device's")
            program = None
    fallback = why if program is None and traced is not None else None
    if program is None:
        traced, own = None, set()
        program, _, names = export_program(meta, inputs, loss_fn=loss_fn)
    program.autopar_traced_device = traced
    program.autopar_trace_fallback = fallback
    adopt_positions(program, lambda ins: meta_program(model, ins, loss_fn=loss_fn, param_dtype=param_dtype,
                                                      device=device, trace=trace)[0], inputs)
    positions_named_as_captured(program)
    if all(_dataless(c, own) or _made_from_python_data(c) for c in program.constants.values()
           if isinstance(c, torch.Tensor)):
        _META_PROGRAMS[key] = (program, names)
        while len(_META_PROGRAMS) > META_PROGRAMS_KEPT:
            _META_PROGRAMS.popitem(last=False)
    return program, names


def adopt_positions(program: Any, trace: Callable[[Any], Any], example_inputs: Any) -> None:
    """Under `capture.own_positions.whole_sequence` (the program of a cp rank's tokens), make
    `program` (exported at `example_inputs`) take the rank's positions where its model makes
    its own, by comparison with `trace(inputs)`, the same export at the whole sequence
    (`capture.own_positions.adopt`; the input shifts it took out on
    `program.graph_module.autopar_input_shifts`). Nothing elsewhere."""
    from autopar.capture.own_positions import adopt, tokens_of, whole_length, whole_sequence, widened

    s, l = whole_length(), tokens_of(example_inputs)
    if s is None or l is None or l == s:
        return

    def whole(length: int) -> nn.Module:
        with whole_sequence(None):
            return trace(widened(example_inputs, l, length)).graph_module

    # a causal mask stays an argument (the solution reads it), the cp attention drops it
    # (`_local_attention`)
    adopt(program.graph_module, whole, l, s, {n: i for i, n in enumerate(program.graph_signature.user_inputs)},
          drop_masks=False)


def positions_named_as_captured(program: Any) -> None:
    """Name `program`'s token-positions ops (`autopar::token_positions`, traced under
    `models.positions.traced_positions`) and its `arange`s as a capture without them names them
    (the capture a plan is solved on records each positions op as an `arange`): in each graph,
    in order, `arange`, `arange_1`, ... (torch.export's own naming, one counter per name), so
    that the ops the solution names are the nodes of this program. Idempotent; nothing to do in
    a program without positions ops."""
    from autopar.models.positions import traced_op

    op = traced_op()
    for mod in program.graph_module.modules():
        g = getattr(mod, "graph", None)
        if not isinstance(g, torch.fx.Graph):
            continue
        nodes = [n for n in g.nodes if n.op == "call_function" and (
            n.target is op or getattr(getattr(n.target, "_overloadpacket", None), "__name__", "") == "arange")]
        if not any(n.target is op for n in nodes):
            continue
        ns = g._graph_namespace
        olds = {n.name for n in nodes}
        finals = {"arange" if i == 0 else f"arange_{i}" for i in range(len(nodes))}
        for i, n in enumerate(nodes):
            n.name = "arange" if i == 0 else f"arange_{i}"
            ns._obj_to_name[n] = n.name
        ns._used_names.difference_update(olds - finals)
        ns._used_names.update(finals)
        mod.recompile()


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Log `message` as a warning once in this process (a verify worker builds many ranks)."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def trace_device(device: Optional[torch.device]) -> Optional[torch.device]:
    """The device `meta_program` traces a program for, to run on `device`: a CPU, or a CUDA
    device (one with an index: fake CUDA tensors are made without a GPU, but tracing one needs
    autograd's device guard, which a CPU-only torch lacks for weights requiring gradients, so
    there they are traced not requiring them), also for the CPU while `cuda_program` is active
    (verify of a GPU plan); None (the meta device) for other devices."""
    from autopar.runtime.cuda_program import cuda_program

    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu" and cuda_program.active:
        # `autopar verify` of a GPU plan, which runs a CUDA rank's program on CPU fake tensors
        return torch.device("cuda", 0)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        return torch.device("cuda", device.index if device.index is not None else 0)
    return None


def _fake_copy(meta: nn.Module, inputs: Any, device: torch.device) -> tuple[nn.Module, Any, set[int]]:
    """(`meta` (a `_meta_copy`) with every parameter and buffer a fake tensor on `device`,
    `inputs` (meta tensors) likewise, the ids of those fake tensors), all of one
    `FakeTensorMode`, which torch.export then traces under: nothing is allocated, and the model
    sees tensors of `device`. On a CUDA device without CUDA, no weight requires a gradient (see
    `trace_device`)."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    grads = device.type != "cuda" or torch.cuda.is_available()
    own: set[int] = set()

    def fake(t: torch.Tensor) -> torch.Tensor:
        f = FakeTensor(mode, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"), device)
        own.add(id(f))
        return f

    memo: dict[int, Any] = {}
    for p in meta.parameters():
        memo[id(p)] = nn.Parameter(fake(p), requires_grad=p.requires_grad and grads)
        own.add(id(memo[id(p)]))
    for b in meta.buffers():
        memo[id(b)] = fake(b)

    def fake_inputs(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return fake(v)
        if isinstance(v, dict):
            return {k: fake_inputs(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(fake_inputs(x) for x in v)
        return v

    return copy.deepcopy(meta, memo), fake_inputs(inputs), own


def _dataless(c: torch.Tensor, own: set[int]) -> bool:
    """A program constant that holds no data and no other trace's state: a plain meta tensor
    (a meta copy's buffer or attribute), or a fake tensor of the copy's own (`_fake_copy`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(c, FakeTensor):
        return id(c) in own
    return c.is_meta


def _made_from_python_data(c: torch.Tensor) -> bool:
    """A program constant that is a plain tensor with data (not meta, not fake): in a program
    exported from a data-less copy, one the forward made from Python data (Falcon's index list
    `fused_qkv[..., [-2], :]`, lifted as `lifted_tensor_0`; every tensor the copy holds is meta
    or fake). Its value comes from the forward's code and the model's settings, which the key
    covers (the class's source, the modules' settings) as it covers the graph itself; the
    program's users read it (`_flat_inputs`, `_lifted_values`), never write it."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(c) is torch.Tensor and not isinstance(c, FakeTensor) and not c.is_meta


def _placeholder_constant(c: Any) -> bool:
    """A constant of a program `meta_program` exported that stands for a tensor of the model
    (meta, or fake on the traced device): the model's own tensor must be read in its stead."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(c, torch.Tensor) and (c.is_meta or isinstance(c, FakeTensor))


def _real_constants(program: Any, model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """{name: the model's tensor} for each tensor constant of `program` (exported from a meta
    copy of `model` wrapped by `_WithLoss`) that is on the meta device, each read from `model`
    at the constant's name (an attribute the forward read, which the export lifted: a
    non-persistent buffer, a plain tensor attribute), with its shape and dtype; None when one is
    not held there (a tensor the forward made, `lifted_tensor_0`): the model's own export then
    lifts it."""
    out: dict[str, torch.Tensor] = {}
    for name, c in program.constants.items():
        if not _placeholder_constant(c):
            continue
        path = name.removeprefix("model.") if name.startswith("model.") else None
        owner, _, attr = (path or "").rpartition(".")
        try:
            t = getattr(model.get_submodule(owner), attr) if path else None
        except AttributeError:
            t = None
        if not isinstance(t, torch.Tensor) or t.is_meta or t.shape != c.shape or t.dtype != c.dtype:
            return None
        out[name] = t
    return out


def _mismatch(program: Any, solution: ShardingSolution, named_by_export: bool = False) -> list[str]:
    """Ops the solution has a choice for that the program lacks, or holds as another kind of op
    (another rule family, another number of tensor inputs); a solved layout change the program
    lacks is none (`program_match`), unless `named_by_export` (the program's names are still
    torch.export's) and the program holds an op of its kind: export numbers the ops of a kind in
    order, so one left out shifts the names of the later ones (GPTBigCode on the CPU keeps one
    `contiguous` of five, its loss's, named `contiguous` as the first layer's is: matched by
    name, it ran as that layer's and sat in the wrong pipeline chunk)."""
    from autopar.intra_op import rules
    from autopar.intra_op.program_match import _kind, computes_nothing

    nodes = _program_calls(program.graph_module)
    kinds = {_kind(k) for k in nodes} if named_by_export else set()
    bad = []
    for name, ch in solution.op_choices.items():
        n = nodes.get(name)
        if n is None and computes_nothing(_kind(name), ch.family):
            if _kind(name) in kinds:
                bad.append(name)
            continue            # a layout change the device's kernels make unnecessary (`program_match`)
        rule = rules.rule_for(_op_name(n)) if n is not None else None
        if n is None or (rule.family if rule else "fallback") != ch.family \
                or len(_tensor_args(n)) != len(ch.input_placements):
            bad.append(name)
    return bad


def _tensor_args(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments of `n` the capture records as its tensor inputs (not shape arithmetic)."""
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), lambda a: out.append(a) if not _no_choice_needed(a) else None)
    return out


def _meta_copy(model: nn.Module, param_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A copy of `model` with its parameters and buffers on the meta device (no data copied),
    its floating parameters in `param_dtype` when given."""
    import copy

    memo: dict[int, Any] = {}
    for p in model.parameters():
        dt = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dt), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_like(v, device="meta")
    if isinstance(v, dict):
        return {k: _to_meta(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    return v
