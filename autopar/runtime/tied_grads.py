"""Gradient sync of parameters held by more than one pipeline chunk (GPT's embedding and output
weight; T5's shared embedding read by the encoder, the decoder and the head): the copies'
gradients are summed, as Megatron's embedding group does.

A rank may hold several copies of one parameter (interleaved schedules: two of its chunks read
it, each chunk materialising its own): its copies are first summed on the rank, so that every
rank of a group contributes one entry per parameter, and the group's sum is copied back into
each copy. Entries are ordered by canonical name, so every rank of a group lays out the same
flat buffer (`TiedEntry`; `check_agreement` compares them across the group at setup).

* `LocalTiedSum`: copies on one device set only (several chunks of one rank): summed on the
  rank, no collective.
* `FlatTiedSync`: the stages hold the parameter in the same layout (equal stage meshes): rank c
  of one stage and rank c of the other hold the same elements; one flat all-reduce over the
  pair (a group per mesh coordinate).
* `FullTiedSync`: the layouts differ (stages of different tp degrees, e.g. the embedding whole
  on a 1-device stage and vocabulary-sharded on a 2-device one): every rank adds its local
  gradient into a zero buffer of the full parameter at its elements (once per stage: a rank
  holding a copy along a Replicate mesh dimension adds nothing unless it is at coordinate 0
  there), one flat all-reduce over all holders sums the stages' copies, and each rank reads its
  elements back. It moves the full parameter instead of a shard: see `autopar/runtime/README.md`.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.schema.errors import PlanError


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-gather equal 1-D shards into `out` (torch >= 2.10 names it `all_gather_single`)."""
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, shard, group=group)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum-reduce-scatter the 1-D `full` into equal shards (`reduce_scatter_single` in new torch).
    On gloo, the backend's own copy of `full` is freed when the call returns (`gloo_copies_released`).
    On the fake backend (`autopar verify`) emulating one that copies its input
    (`fake_backend_of`), a copy of `full` is held through the call, as that backend holds it."""
    copy = full.clone() if _FAKE_RS_COPIES_INPUT and dist.get_backend(group) == "fake" else None
    with gloo_copies_released(group, out, full):
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, full, group=group)
    del copy


# whether the fake backend's reduce-scatter holds a copy of its input, as the backend of the
# device a verified plan runs on does (`fake_backend_of`)
_FAKE_RS_COPIES_INPUT = False


@contextlib.contextmanager
def fake_backend_of(device_type: Optional[str]) -> Iterator[None]:
    """Inside, the fake process group's collectives (`autopar verify`) hold what the runtime's
    backend on `device_type` holds beyond their operands (`cost_models.memory.
    reduce_scatter_copies_input`: gloo's reduce-scatter works on a copy of its input, NCCL's in
    place), so that a step on fake tensors tracks the memory the real run does."""
    from cost_models.memory import reduce_scatter_copies_input

    global _FAKE_RS_COPIES_INPUT
    old, _FAKE_RS_COPIES_INPUT = _FAKE_RS_COPIES_INPUT, reduce_scatter_copies_input(device_type)
    try:
        yield
    finally:
        _FAKE_RS_COPIES_INPUT = old


class _BackendViews(TorchDispatchMode):
    """The storages of the tensors split inside (gloo's wait: `buffer.chunk(world)[rank]`),
    other than `known` ones' (the collective's operands)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.found: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        a = args[0] if args else None
        if (func is torch.ops.aten.split.Tensor and type(a) is torch.Tensor and a.device.type == "cpu"):
            st = a.untyped_storage()
            if st.data_ptr() not in self.known and st.nbytes():
                self.found.setdefault(st.data_ptr(), st)
        return func(*args, **(kwargs or {}))


_EXACT_MEMORY = True


@contextlib.contextmanager
def gloo_memory_exact(on: bool) -> Iterator[None]:
    """Inside, whether the gloo collectives wait until gloo's worker thread let go of their
    operands (`gloo_quiesced`, `_settled`, `zero.gloo_fsdp_comms`): what makes tracked memory
    the same every run, at a scheduling latency per collective. Off for a step whose memory
    nobody measures (`ParallelModel.train_step(exact_memory=False)`): the results are the same,
    only when gloo frees its references differs."""
    global _EXACT_MEMORY
    old, _EXACT_MEMORY = _EXACT_MEMORY, on
    try:
        yield
    finally:
        _EXACT_MEMORY = old


def exact_gloo_memory() -> bool:
    """Whether gloo collectives wait for gloo's thread to let go (`gloo_memory_exact`)."""
    return _EXACT_MEMORY


def gloo_quiesced(collective: Callable[..., Any], group: Optional[dist.ProcessGroup], *operands: torch.Tensor,
                  timeout_s: float = 10.0) -> Any:
    """`collective(*operands)`, a synchronous collective, run on views of `operands`; once it
    returned, wait until gloo's worker thread has dropped its work.

    The wait returns when the collective is done, but the worker thread that ran it drops its
    work, and the tensors in it, only once it takes its queue's lock again: under load several
    milliseconds later, a thousand small ops (`release`). A buffer its owner drops in the
    meantime (FSDP2's flat all-gather output, after its copy-out) is freed when the thread gets
    there, not when the owner drops it: memory held a scheduling-dependent time. The views are
    tensors of their own that only this call and the work reference; once both let go (a weak
    reference dies: torch keeps a tensor's Python object while C++ holds it) gloo holds nothing
    of the operands. Waits at most `timeout_s` (the collective's result is complete either
    way). On another backend `collective(*operands)` as it is."""
    if not _EXACT_MEMORY or not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return collective(*operands)
    views = [t.view(t.shape) for t in operands]
    refs = [weakref.ref(v) for v in views]
    out = collective(*views)
    del views
    end = time.monotonic() + timeout_s
    while any(r() is not None for r in refs) and time.monotonic() < end:
        time.sleep(0)
    return out


@contextlib.contextmanager
def gloo_copies_released(group: Optional[dist.ProcessGroup], *operands: torch.Tensor) -> Iterator[None]:
    """Free, once a synchronous gloo reduce-scatter inside returned, the copy of its input it
    made. ProcessGroupGloo's reduce-scatter (torch 2.13, `reduce_scatter_tensor_coalesced`)
    clones its input, all-reduces the clone on a worker thread and, in the wait, copies the
    rank's chunk out of it: the clone is referenced by the returned work (dropped with it) and
    by the worker thread's all-reduce work, which that thread drops only some time after waking
    the waiter (`release`). So the input-sized copy outlived the call by a time that depends on
    the threads' scheduling, into the optimizer step in some runs (the memory harness's
    intermittent optimizer-phase buffers of ZeRO-1/2: one flat gradient, about one run in
    three under load). The wait's copy-out reads the clone through the dispatcher; its storage
    (no operand's) is resized to 0 after the call, as `release` does for the runtime's own
    buffers: the clone lives exactly as long as the collective, every run. Nothing is done for
    another backend (NCCL reduce-scatters in place) or an asynchronous call."""
    if not dist.is_initialized() or dist.get_backend(group) != "gloo":
        yield
        return
    mode = _BackendViews(list(operands))
    with mode:
        yield
    for st in mode.found.values():
        st.resize_(0)


def release(*buffers: torch.Tensor) -> None:
    """Free the storage of temporaries a synchronous collective used, now. The wait returns
    when the collective is done, but the backend may still reference its tensors: gloo's worker
    thread drops its work (and the tensors in it) only after waking the waiter, so under load a
    rank has kept a flat gradient buffer into the next step's forward. Resizing the storage to 0
    frees it whoever holds the tensor (NCCL recorded its stream's use: the allocator still waits
    for it). Only for buffers nothing else reads afterwards."""
    for b in buffers:
        b.untyped_storage().resize_(0)


def allreduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup, scale: float = 1.0) -> None:
    """All-reduce `grads` in place as one flat buffer (one collective), times `scale`."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
    release(flat)


# one tied parameter on this rank: (canonical name, its copies here: one per chunk materialising it)
TiedEntry = tuple[str, list[nn.Parameter]]


def _summed(copies: Sequence[nn.Parameter]) -> torch.Tensor:
    """The sum of the local gradients of a parameter's copies on this rank (the gradient itself
    for one copy)."""
    g = local(copies[0].grad)
    for p in copies[1:]:
        g = g + local(p.grad)
    return g


def _spread(copies: Sequence[nn.Parameter], total: torch.Tensor) -> None:
    """Every copy's local gradient set to `total` (a copy's own gradient is left as it is)."""
    for p in copies:
        g = local(p.grad)
        if g is not total:
            g.copy_(total)


def _check_copies(entries: Sequence[TiedEntry]) -> None:
    """A rank's copies of one parameter must have equal local shapes (one layout per rank)."""
    for name, copies in entries:
        shapes = {tuple(local(p).shape) for p in copies}
        if len(shapes) > 1:
            raise PlanError(f"tied parameter {name} is held by chunks of one rank in different local shapes "
                            f"{sorted(shapes)}; re-plan with `autopar plan`")


class LocalTiedSum:
    """Copies on one rank only (several chunks of one device set read the parameter): their
    gradients summed in place, no collective."""

    def __init__(self, entries: Sequence[TiedEntry]) -> None:
        _check_copies(entries)
        self.entries = [(n, list(c)) for n, c in sorted(entries, key=lambda e: e[0]) if len(c) > 1]
        self.group, self.ranks = None, []

    def signature(self) -> list[tuple[str, int]]:
        return []

    def sync(self) -> None:
        for _, copies in self.entries:
            _spread(copies, _summed(copies))


class FlatTiedSync:
    """Copies in the same layout: sum the local gradients over `group` (one flat all-reduce);
    a rank's several copies of one parameter are summed first and all get the total."""

    def __init__(self, group: Optional[dist.ProcessGroup], entries: Sequence[TiedEntry],
                 ranks: Sequence[int] = ()) -> None:
        """`entries`: (canonical name, this rank's copies); `ranks`: the group's global ranks
        (for `check_agreement`'s message)."""
        _check_copies(entries)
        self.group, self.ranks = group, list(ranks)
        self.entries = [(n, list(c)) for n, c in sorted(entries, key=lambda e: e[0])]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, c in self.entries for p in c]

    def signature(self) -> list[tuple[str, int]]:
        """(name, elements this rank puts in the flat buffer) per entry, in buffer order."""
        return [(n, local(c[0]).numel()) for n, c in self.entries]

    def sync(self) -> None:
        sums = [_summed(c) for _, c in self.entries]
        allreduce_flat(sums, self.group)
        for (_, c), total in zip(self.entries, sums):
            _spread(c, total)


def element_index(p: torch.Tensor) -> Optional[torch.Tensor]:
    """Flat indices, in the full parameter, of this rank's local elements of `p` (None when `p`
    is a plain, whole tensor). Computed by laying out an arange with `p`'s placements (no
    communication), so every placement DTensor and FSDP use is covered."""
    if not isinstance(p, DTensor):
        return None
    dev = p.to_local().device
    ar = torch.arange(p.numel(), device=dev).view(p.shape)
    return distribute_tensor(ar, p.device_mesh, p.placements, src_data_rank=None).to_local().reshape(-1)


def holds_first_copy(p: torch.Tensor) -> bool:
    """Whether this rank adds its elements of `p`: not a second copy along a Replicate axis."""
    if not isinstance(p, DTensor):
        return True
    mesh = p.device_mesh
    return all(mesh.get_local_rank(i) == 0 for i, q in enumerate(p.placements) if q.is_replicate())


class FullTiedSync:
    """Copies in different layouts: sum over `group` in the full parameter's coordinates (see
    the module docstring). `group` holds every rank that holds any of the copies' elements
    whose sum it must see: a data-parallel replica's ranks, or all replicas under ZeRO-3."""

    def __init__(self, group: dist.ProcessGroup, entries: Sequence[TiedEntry], adds: bool = True,
                 ranks: Sequence[int] = ()) -> None:
        """`adds=False`: this rank's copy is already counted by another rank of `group` (a
        dp-averaged, unsharded copy in a group spanning the replicas of a ZeRO-3 holder)."""
        _check_copies(entries)
        self.group, self.ranks = group, list(ranks)
        self.entries = [(n, list(c)) for n, c in sorted(entries, key=lambda e: e[0])]
        self.index = [[element_index(p) for p in c] for _, c in self.entries]
        self.adds = [[adds and holds_first_copy(p) for p in c] for _, c in self.entries]
        self.numel = sum(c[0].numel() for _, c in self.entries)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, c in self.entries for p in c]

    def signature(self) -> list[tuple[str, int]]:
        """(name, full elements in the buffer) per entry, in buffer order."""
        return [(n, c[0].numel()) for n, c in self.entries]

    def sync(self) -> None:
        first = local(self.entries[0][1][0].grad)
        buf = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        off = 0
        for (_, copies), idxs, adds in zip(self.entries, self.index, self.adds):
            n = copies[0].numel()
            for p, idx, add in zip(copies, idxs, adds):
                if add:
                    g = local(p.grad).reshape(-1).to(buf.dtype)
                    if idx is None:
                        buf[off:off + n] += g
                    else:
                        buf.index_add_(0, idx + off, g)
            off += n
        dist.all_reduce(buf, group=self.group)
        off = 0
        for (_, copies), idxs in zip(self.entries, self.index):
            part = buf[off:off + copies[0].numel()]
            for p, idx in zip(copies, idxs):
                g = local(p.grad)
                g.copy_((part if idx is None else part[idx]).view_as(g))
            off += copies[0].numel()
        release(buf)


Signature = list[tuple[str, int]]      # (canonical name, elements in the flat buffer) per entry


def check_agreement(rank: int, mine: Sequence[tuple[Any, Sequence[int], Signature]],
                    everyone: Sequence[Sequence[tuple[Any, Sequence[int], Signature]]]) -> None:
    """Raise PlanError unless every rank of each of rank `rank`'s tied groups lays out the same
    flat buffer. `mine`: (key, group ranks, signature) of this rank's syncs; `everyone[r]`: rank
    r's. A flat all-reduce of buffers of different sizes hangs or aborts every rank (gloo:
    "Received data size doesn't match expected size"); found at setup it names the weight and
    the ranks instead."""
    for key, ranks, sig in mine:
        sig = [tuple(e) for e in sig]
        for r in ranks:
            theirs = {k: [tuple(e) for e in s] for k, _, s in everyone[r]}
            other = theirs.get(key)
            if other == sig:
                continue
            if other is None:
                raise PlanError(f"the tied-gradient group over ranks {list(ranks)} (parameters "
                                f"{', '.join(n for n, _ in sig)}): rank {r} does not join it, rank {rank} does; "
                                f"the ranks' plans or models differ. Re-plan with `autopar plan`")
            a, b = dict(sig), dict(other)
            name = next((n for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)), sig[0][0] if sig else "?")
            raise PlanError(f"tied parameter {name} would be summed over ranks {list(ranks)} in flat buffers "
                            f"that differ: rank {rank} holds {a.get(name, 'nothing')} elements of it "
                            f"({sum(n for _, n in sig)} in all), rank {r} {b.get(name, 'nothing')} "
                            f"({sum(n for _, n in other)} in all); the all-reduce would abort every rank. "
                            f"Re-plan with `autopar plan`, or report the model")


def _dead(refs: list, timeout_s: float = 10.0) -> None:
    """Wait until every weak reference of `refs` died (at most `timeout_s`)."""
    end = time.monotonic() + timeout_s
    while any(r() is not None for r in refs) and time.monotonic() < end:
        time.sleep(0)


class GlooFunctionalSync:
    """Tensor parallelism's collectives on gloo with the timing of `gloo_quiesced`: DTensor
    issues functional collectives (`_c10d_functional`) and waits on their output
    (`wait_tensor`); gloo's worker thread held the operands of a finished one some time after
    that wait, so a tensor the step dropped (an all-reduced gradient autograd had consumed, an
    all-gather's input) stayed alive a scheduling-dependent time (seen: gpt-tiny fp32 tp2's last
    all-reduced gradient through the optimizer step on one rank, mlp-tiny tp2's backward
    all-gathers). While this context is entered, the CPU kernels of the functional all-reduce,
    all-gather and all-to-all are replaced (a `torch.library` IMPL registration, removed on
    exit, torch's own kernels back): on a gloo group each runs synchronously on views of its
    operands (the later `wait_tensor` finds nothing left to wait for), an all-reduce in place
    on its own contiguous clone (the output, as torch's kernel makes it). An all-gather's,
    reduce-scatter's or all-to-all's input (the step's tensor) is waited for until gloo let go
    of its view; an output gloo still holds after one yield to its thread is returned as a
    copy, the storage gloo holds emptied (`_unheld`: no wait). So the operands live exactly as
    long as the step holds them. Another backend's group gets torch's
    own behaviour (the functional in-place or out variant, the work registered for its wait).
    The reduce-scatter's own clone of its input (gloo all-reduces it, made inside the op) is
    no tensor of the step; its input and output are (context parallelism's K/V gradients, the
    all-gather's backward).

    Only the collectives pay for this (a Python call each): the TorchDispatchMode this was until
    session 30 saw every op of the step, a Python dispatch per op that made gpt-small's tp step
    14-18% slower (`benchmarks/runtime_overhead.py`)."""

    _depth = 0
    _lib: Any = None

    def __enter__(self) -> "GlooFunctionalSync":
        cls = GlooFunctionalSync
        if cls._depth == 0:
            lib = torch.library.Library("_c10d_functional", "IMPL")
            lib.impl("all_reduce", _sync_all_reduce, "CPU")
            lib.impl("all_gather_into_tensor", _sync_all_gather, "CPU")
            lib.impl("reduce_scatter_tensor", _sync_reduce_scatter, "CPU")
            lib.impl("all_to_all_single", _sync_all_to_all, "CPU")
            cls._lib = lib
        cls._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        cls = GlooFunctionalSync
        cls._depth -= 1
        if cls._depth == 0:
            cls._lib._destroy()
            cls._lib = None


_GLOO_GROUPS: dict[str, Any] = {}


def _gloo_group(name: str) -> Optional[dist.ProcessGroup]:
    """The process group named `name` when its backend is gloo, else None (cached by name)."""
    hit = _GLOO_GROUPS.get(name)
    if hit is None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            pg = _resolve_process_group(name)
            hit = pg if dist.get_backend(pg) == "gloo" else False
        except Exception:   # noqa: BLE001 - not a group this rank knows: torch's behaviour
            hit = False
        _GLOO_GROUPS[name] = hit
    return hit or None


def _let_go(ref: weakref.ref) -> bool:
    """Whether gloo let go of the view `ref` follows, after one yield to its worker thread."""
    if ref() is None:
        return True
    time.sleep(0)
    return ref() is None


def _unheld(out: torch.Tensor, ref: weakref.ref) -> torch.Tensor:
    """A collective's finished output `out` (a tensor of the kernel's own), of which gloo may
    still hold the view `ref` follows: `out` itself when gloo let go, else a copy of it, the
    storage gloo holds emptied (`release`): the result lives as long as the step holds it, and
    nobody waits for gloo's thread (that wait, at every collective, cost a loaded machine's
    scheduling latency each time)."""
    if _let_go(ref):
        return out
    fresh = torch.empty_like(out)
    fresh.copy_(out)
    out.untyped_storage().resize_(0)
    return fresh


def _settled(run: Callable[..., Any], *views: torch.Tensor) -> None:
    """`run(*views)` (a synchronous collective on `views`), returning once gloo let go of them."""
    if not _EXACT_MEMORY:
        run(*views)
        return
    refs = [weakref.ref(v) for v in views]
    run(*views)
    del views
    if not all(_let_go(r) for r in refs):
        _dead(refs)


def _sync_all_reduce(inp: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    out = inp.clone(memory_format=torch.contiguous_format)
    if _gloo_group(group_name) is None:
        return _FUNCOL.all_reduce_.default(out, reduce_op, group_name)
    view = out.view(out.shape)
    ref = weakref.ref(view)
    _FUNCOL.all_reduce_.default(view, reduce_op, group_name)
    _FUNCOL.wait_tensor.default(view)
    del view
    return _unheld(out, ref)


def _sync_all_gather(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    out = inp.new_empty((inp.shape[0] * group_size, *inp.shape[1:]) if inp.dim() else (group_size,))
    if _gloo_group(group_name) is None:
        return _FUNCOL.all_gather_into_tensor_out.default(inp, group_size, group_name, out=out)
    box = [out.view(out.shape)]     # the view gloo gets, dropped after (a list: `run` reads it)
    ref = weakref.ref(box[0])

    def run(v: torch.Tensor) -> None:
        _FUNCOL.all_gather_into_tensor_out.default(v, group_size, group_name, out=box[0])
        _FUNCOL.wait_tensor.default(box[0])

    _settled(run, inp.view(inp.shape))    # the step's input: waited for
    box.clear()
    return _unheld(out, ref)


def _sync_reduce_scatter(inp: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    out = inp.new_empty((inp.shape[0] // group_size, *inp.shape[1:]))
    if _gloo_group(group_name) is None:
        return _FUNCOL.reduce_scatter_tensor_out.default(inp, reduce_op, group_size, group_name, out=out)
    box = [out.view(out.shape)]
    ref = weakref.ref(box[0])

    def run(v: torch.Tensor) -> None:
        _FUNCOL.reduce_scatter_tensor_out.default(v, reduce_op, group_size, group_name, out=box[0])
        _FUNCOL.wait_tensor.default(box[0])

    _settled(run, inp.view(inp.shape))    # the step's input: waited for
    box.clear()
    return _unheld(out, ref)


def _sync_all_to_all(inp: torch.Tensor, output_split_sizes: list, input_split_sizes: list,
                     group_name: str) -> torch.Tensor:
    n = (sum(output_split_sizes) if output_split_sizes
         else inp.shape[0])   # no splits: equal chunks, the input's size
    out = inp.new_empty((n, *inp.shape[1:]))
    pg = _gloo_group(group_name)
    if pg is None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        work = dist.all_to_all_single(out, inp.contiguous(), list(output_split_sizes) or None,
                                      list(input_split_sizes) or None, group=_resolve_process_group(group_name),
                                      async_op=True)
        torch._C._distributed_c10d._register_work(out, work)
        return out
    box = [out.view(out.shape)]
    ref = weakref.ref(box[0])

    def run(v: torch.Tensor) -> None:
        dist.all_to_all_single(box[0], v, list(output_split_sizes) or None, list(input_split_sizes) or None,
                               group=pg)

    _settled(run, inp.contiguous().view(inp.shape))
    box.clear()
    return _unheld(out, ref)


_FUNCOL = torch.ops._c10d_functional
