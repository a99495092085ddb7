"""Pipeline schedules as `torch.distributed.pipelining` runs them, for the memory model.

What a pipeline rank holds at its peak is decided by the order in which its schedule runs
forwards and backwards: every chunk forward keeps that chunk's activations of one micro-batch
until the matching backward has run. Rather than a closed formula per schedule (which drifted
from the runtime once already: interleaving was counted a chunk at a time), the counts come
from torch's own per-rank action lists (`_get_pipeline_order` of `ScheduleGPipe` and
`Schedule1F1B`, `_calculate_single_rank_operations` of `ScheduleInterleaved1F1B`), i.e. the
order the runtime executes.

`torch_schedule(kind, p, m, v)` names the torch class the runtime builds for a plan (one place:
the engine asks it too); `held_moments(...)` gives, for one rank, what it holds at every moment
its peak can fall on (after a forward, at a backward's start), before and after its first
backward (weight gradients exist only after it): per local chunk, the micro-batches whose
activations are held, the outputs and input gradients the schedule's sends still reference
(each torch runner keeps them differently: read from its code, `_walk_1f1b`, `_walk_actions`),
whether the chunk's gradients exist, and the receive buffers alive: the runtime makes a
chunk's receive buffer when its schedule posts the receive and drops it after that
micro-batch's backward (`autopar.runtime.pipeline_p2p.JustInTimeStage`, as Megatron-LM's
p2p_communication does), so how many are alive follows the same order of actions, and, for the
lock-step runner of the interleaved schedule, its neighbours' (a receive is posted in the time
step its sender runs). `held_split(...)` is its activation part.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from functools import lru_cache
from operator import ge
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, Optional

import numpy as np

TorchSchedule = Literal["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"]


@dataclass(frozen=True)
class ScheduleKind:
    """One pipeline schedule as every part of autopar sees it: its plan name, whether a device
    group holds several model chunks (virtual stages), the torch.pipelining class the runtime
    builds, and its bubble. The search, the memory model, the timeline, the CLI, the plan's
    schema and the runtime all read this registry (`SCHEDULES`, `schedule_kind`)."""

    name: str
    interleaved: bool                 # several chunks per device group (`virtual_stages` > 1)
    torch_class: TorchSchedule
    description: str
    # where the schedule's pipeline sends run beside the compute (`SoftwareSpec.
    # pipeline_send_overlap`), which compute they run beside: "same", a forward send beside the
    # next micro-batch's forward and a gradient send beside the next backward (all forwards,
    # then all backwards); "opposite", a forward send beside the backward after it and a
    # gradient send beside the next forward (one forward, one backward)
    sends_beside: Literal["same", "opposite"] = "opposite"

    def runtime_class(self, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> TorchSchedule:
        """The class the runtime runs: torch's 1F1B needs at least as many micro-batches as
        stages; with fewer it degenerates to GPipe (same maths and transfers), so GPipe runs.
        Interleaving with one chunk per group is 1F1B: torch's interleaved schedule would warm
        up 2(p - 1 - r) forwards there (its factor 2 is for v > 1), holding twice 1F1B's
        activations for the same order of work."""
        if virtual_stages > 1:
            if not self.interleaved:
                raise ValueError(f"schedule {self.name} runs one chunk per device group, not {virtual_stages}")
            return "ScheduleInterleaved1F1B"
        if self.name == "gpipe" or num_microbatches < num_stages:
            return "ScheduleGPipe"
        return "Schedule1F1B"

    def bubble_fraction(self, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
        """Idle time over busy time of a pipeline of equal stages: (p - 1) / m, divided by the
        chunks per group when interleaved (Narayanan et al. 2021, §2.2)."""
        v = virtual_stages if self.interleaved else 1
        return (num_stages - 1) / (v * max(num_microbatches, 1))


SCHEDULES: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", False, "ScheduleGPipe", "all forwards, then all backwards (GPipe)", "same"),
    ScheduleKind("1f1b", False, "Schedule1F1B", "one forward, one backward (PipeDream-Flush)"),
    ScheduleKind("interleaved_1f1b", True, "ScheduleInterleaved1F1B",
                 "1F1B over several model chunks per device group (Megatron's interleaving)"),
)}


def schedule_kind(name: str) -> ScheduleKind:
    """The registered schedule `name`; a ValueError naming the choices otherwise."""
    kind = SCHEDULES.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")
    return kind


def executed_schedule(kind: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> ScheduleKind:
    """The schedule a plan of `kind` runs as (`ScheduleKind.runtime_class`): 1F1B with fewer
    micro-batches than stages runs as GPipe, interleaving with one chunk per group as 1F1B."""
    cls = torch_schedule(kind, num_stages, num_microbatches, virtual_stages)
    return next(k for k in SCHEDULES.values() if k.torch_class == cls)


def torch_schedule(kind: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> TorchSchedule:
    """The torch.pipelining schedule class the runtime runs for a plan's `kind` with
    `num_stages` device groups, `num_microbatches` and `virtual_stages` chunks per group
    (`ScheduleKind.runtime_class`)."""
    return schedule_kind(kind).runtime_class(num_stages, num_microbatches, virtual_stages)


@lru_cache(maxsize=256)
def backwards_in_a_row(kind: str, num_stages: int, rank: int, num_microbatches: int) -> bool:
    """Whether a one-chunk rank runs a backward right after another, no forward between: then
    it starts with every FSDP unit its previous backward gathered, since torch.pipelining runs
    each backward with `set_reshard_after_backward(False)` (`_PipelineStageBase.
    backward_maybe_with_nosync`, torch 2.13; resharded by `perform_reduce_grad` after the
    last), where a forward between frees them again (its units reshard after it). GPipe: all
    backwards after all forwards; 1F1B (`Schedule1F1B._step_microbatches`): min(m, p - rank)
    warm-up forwards, then backward and forward in turn, the last warm-up - 1 backwards in a
    row at the end."""
    cls = torch_schedule(kind, num_stages, num_microbatches)
    m, p = int(num_microbatches), int(num_stages)
    if cls == "ScheduleGPipe":
        return m > 1
    if cls == "Schedule1F1B":
        return min(m, p - int(rank)) >= 2
    return False


def _rank_actions(cls_name: TorchSchedule, p: int, m: int, v: int, rank: int) -> list:
    """torch's action list of one rank (None entries are idle steps; read-only: cached, since
    the lock-step walk of a rank reads its neighbours' lists too, and torch builds an
    interleaved rank's list in O(m v) Python)."""
    from torch.distributed.pipelining import schedules as S

    if cls_name == "ScheduleInterleaved1F1B":
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"interleaved 1F1B needs the {m} micro-batches to be a multiple of {rounds} rounds")
        ns = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p,
                             _n_microbatches=m)
        return S.ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, rank)
    return _pipeline_order(cls_name, p, m)[rank]


@lru_cache(maxsize=1024)
def _pipeline_order(cls_name: TorchSchedule, p: int, m: int) -> dict:
    """Every rank's action list of a single-stage schedule (torch builds them all at once)."""
    from torch.distributed.pipelining import schedules as S

    ns = SimpleNamespace(_num_stages=p, _n_microbatches=m)
    cls = S.ScheduleGPipe if cls_name == "ScheduleGPipe" else S.Schedule1F1B
    return cls._get_pipeline_order(ns)


# what a moment vector holds, per local chunk: `ACTS` chunk micro-batches whose activations are
# held (forward ran, backward not yet); `SENT_OUTPUTS` outputs of micro-batches whose backward
# already ran, still referenced by a forward send; `SENT_GRADS` input gradients a backward send
# still references; `GRADS` 1 where the chunk's weight gradients exist (a backward of it ran);
# `RECV_INPUTS` receive buffers of the chunk's input alive (received, its backward not yet run:
# the buffer is the chunk's input, which its forward keeps); `RECV_GRADS` receive buffers of the
# gradient of the chunk's output alive (received, its backward not yet run)
ACTS, SENT_OUTPUTS, SENT_GRADS, GRADS, RECV_INPUTS, RECV_GRADS = range(6)
_ROWS = 6


class _Walk:
    """One rank's step as its schedule runs it: what it holds at every moment a peak can fall
    on (after a forward; at the start of a backward, before it frees anything), split into the
    moments before its first backward and after it. A send's tensor stays allocated while the
    schedule references the send (its P2POp or its Work: gloo's and NCCL's works keep their
    tensors), which each torch schedule does differently (`_walk_1f1b`, `_walk_actions`)."""

    def __init__(self, v: int, record: bool = False) -> None:
        self.v = v
        # `record`: every state the walk passes through, as (action, chunk, moment), in `states`
        self.states: set[tuple] | None = set() if record else None
        self._act: tuple[str, int] = ("", -1)
        self.held = [0] * v
        self.done: set[tuple[int, int]] = set()            # (chunk, mb) whose backward ran
        self.made = [0] * v                                # 1 once a chunk's backward ran
        self.refs: set[tuple[str, int, int]] = set()       # ("out" | "grad", chunk, mb) referenced
        # per chunk, what the references hold now: outputs of micro-batches whose backward ran
        # (before it the output is an activation), and input gradients; kept as refs change
        self.out = [0] * v
        self.grad = [0] * v
        self.parts: tuple[list, list] = ([], [])
        self.backed = False
        # receive buffers alive, per chunk, and which (chunk, mb) they are for
        self.rin = [0] * v
        self.rgrad = [0] * v
        self.recv: set[tuple[str, int, int]] = set()

    def receive(self, what: str, c: int, i: int) -> None:
        """A receive buffer made: of chunk `c`'s input ("in") or output gradient ("grad") for
        micro-batch `i`; dropped when that micro-batch's backward of the chunk has run."""
        if (what, c, i) not in self.recv:
            self.recv.add((what, c, i))
            (self.rin if what == "in" else self.rgrad)[c] += 1

    def _count(self, ref: tuple[str, int, int], sign: int) -> None:
        what, c, i = ref
        if what == "grad":
            self.grad[c] += sign
        elif (c, i) in self.done:
            self.out[c] += sign

    def add_ref(self, ref: tuple[str, int, int]) -> None:
        if ref not in self.refs:
            self.refs.add(ref)
            self._count(ref, 1)

    def set_refs(self, refs: frozenset) -> None:
        """Replace what the schedule references (a schedule that drops its sends as it goes)."""
        for r in self.refs - refs:
            self._count(r, -1)
        for r in refs - self.refs:
            self._count(r, 1)
        self.refs = set(refs)

    def _moment(self) -> None:
        x = (*self.held, *self.out, *self.grad, *self.made, *self.rin, *self.rgrad)
        if self.states is not None:
            self.states.add((*self._act, x))
        part = self.parts[self.backed]
        if not part:
            part.append(x)
        elif all(map(ge, x, part[-1])):
            part[-1] = x        # the previous moment is dominated: it cannot be a peak
        elif not all(map(ge, part[-1], x)):
            part.append(x)      # (one the previous dominates cannot be either)

    def forward(self, c: int) -> None:
        self.held[c] += 1
        self._act = ("F", c)
        self._moment()

    def backward(self, c: int, i: int) -> None:
        self._act = ("B", c)
        self._moment()
        self.held[c] -= 1
        self.done.add((c, i))
        if ("out", c, i) in self.refs:
            self.out[c] += 1
        self.made[c] = 1
        self.backed = True
        for what, row in (("in", self.rin), ("grad", self.rgrad)):
            if (what, c, i) in self.recv:
                self.recv.discard((what, c, i))
                row[c] -= 1

    def finish(self, label: str) -> tuple[tuple, tuple]:
        if any(self.held) or self.recv:
            raise AssertionError(f"{label} ends holding {self.held}, receive buffers {sorted(self.recv)}")
        return tuple(_maximal(part) for part in self.parts)


def _walk_actions(cls_name: TorchSchedule, p: int, m: int, v: int, rank: int, sends_kept: bool,
                  record: bool = False) -> _Walk:
    """torch's action list in order. `sends_kept`: every send stays referenced until the step
    ends (`ScheduleGPipe._step_microbatches` keeps its works in `fwd_sends_to_wait` /
    `bwd_sends_to_wait`, waited and dropped only when the step returns, torch 2.13); otherwise
    a send is waited and dropped in its time step (the interleaved schedule as the runtime runs
    it, `runtime.pipeline._interleaved_class`).

    Receives: GPipe posts a micro-batch's receive right before its forward (or backward). The
    lock-step runner (`PipelineScheduleMulti._step_microbatches`) posts, after the rank's own
    action of time step t, a receive for every forward its previous rank runs at t (of the
    stage before one of its own) and every backward its next rank runs at t (of the stage after
    one of its own), waited in that step: the buffer exists from then on."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    w = _Walk(v, record)
    n = p * v
    bwd = (C.FULL_BACKWARD, C.BACKWARD_INPUT)
    lockstep = cls_name == "ScheduleInterleaved1F1B"
    mine = _rank_actions(cls_name, p, m, v, rank)
    if lockstep:
        local = {c * p + rank for c in range(v)}
        prev_ranks = sorted({(s - 1) % p for s in local if s > 0})
        next_ranks = sorted({(s + 1) % p for s in local if s < n - 1})
        lists = {q: _rank_actions(cls_name, p, m, v, q) for q in {*prev_ranks, *next_ranks}}
    for t, a in enumerate(mine):
        if a is not None:
            c = a.stage_index // p        # chunk c of rank r is stage c * p + r
            if a.computation_type == C.FORWARD:
                if not lockstep and a.stage_index > 0:
                    w.receive("in", c, a.microbatch_index)
                w.forward(c)
                if sends_kept and a.stage_index < n - 1:      # the last stage sends nothing forward
                    w.add_ref(("out", c, a.microbatch_index))
            elif a.computation_type in bwd:
                if not lockstep and a.stage_index < n - 1:
                    w.receive("grad", c, a.microbatch_index)
                w.backward(c, a.microbatch_index)
                if sends_kept and a.stage_index > 0:              # the first sends no gradient back
                    w.add_ref(("grad", c, a.microbatch_index))
        if not lockstep:
            continue
        for q in prev_ranks:
            b = lists[q][t] if t < len(lists[q]) else None
            if b is not None and b.computation_type == C.FORWARD and b.stage_index + 1 in local:
                w.receive("in", (b.stage_index + 1) // p, b.microbatch_index)
        for q in next_ranks:
            b = lists[q][t] if t < len(lists[q]) else None
            if b is not None and b.computation_type in bwd and b.stage_index - 1 in local:
                w.receive("grad", (b.stage_index - 1) // p, b.microbatch_index)
    return w


def _walk_1f1b(p: int, m: int, rank: int, record: bool = False) -> tuple[_Walk, list[tuple[str, int]]]:
    """torch's `Schedule1F1B._step_microbatches` (torch 2.13), its variables followed: the
    warm-up's sends stay in `send_work` until the cooldown replaces it (the next-to-last warm-up
    output, kept through the 1F1B phase); `fwd_sends` holds the latest output and `bwd_sends`
    the latest input gradient until the next one replaces it, so each backward after the first
    runs beside the previous micro-batch's input gradient. Returns the walk and the order of
    its forwards and backwards (checked against torch's action list by the tests)."""
    w = _Walk(1, record)
    order: list[tuple[str, int]] = []
    send_work: frozenset = frozenset()
    fwd_sends: frozenset = frozenset()
    bwd_sends: frozenset = frozenset()

    def refs() -> None:
        w.set_refs(send_work | fwd_sends | bwd_sends)

    def forward(i: int) -> None:
        refs()
        if rank > 0:                  # received right before the forward
            w.receive("in", 0, i)
        w.forward(0)
        order.append(("F", i))

    def backward(i: int) -> None:
        refs()
        if rank < p - 1:              # received right before the backward
            w.receive("grad", 0, i)
        w.backward(0, i)
        order.append(("B", i))

    # torch's stage gives the last stage no forward send and the first no backward send
    out = (lambda i: frozenset({("out", 0, i)})) if rank < p - 1 else (lambda i: frozenset())
    grad = (lambda i: frozenset({("grad", 0, i)})) if rank > 0 else (lambda i: frozenset())
    warmup = min(m, p - rank)
    for i in range(warmup):
        forward(i)
        fwd_sends = out(i)
        if i != warmup - 1:
            send_work = fwd_sends
    fwd = warmup
    bwd = 0
    while True:
        backward(bwd)
        bwd_sends = grad(bwd)
        bwd += 1
        if fwd == m:
            break
        forward(fwd)
        fwd_sends = out(fwd)
        fwd += 1
    send_work = bwd_sends
    while bwd < m:
        backward(bwd)
        bwd_sends = grad(bwd)
        send_work = bwd_sends
        bwd += 1
    return w, order


def _maximal(moments: list) -> tuple:
    """The moments no other moment dominates (the peak of a non-negative weighting is at one)."""
    uniq = sorted(set(moments), key=sum, reverse=True)
    if len(uniq) > 64:
        # the same filter on arrays (a long schedule's walk has thousands of moments)
        A = np.array(uniq)
        K = np.empty_like(A)
        k = 0
        for x in A:     # a moment can only be dominated by one with at least its total
            if k and (K[:k] >= x).all(axis=1).any():
                continue
            K[k] = x
            k += 1
        return tuple(sorted(map(tuple, K[:k].tolist())))
    keep: list[tuple] = []
    for x in uniq:
        if not any(all(map(ge, y, x)) for y in keep):
            keep.append(x)
    return tuple(sorted(keep))


@lru_cache(maxsize=65536)
def _moments(kind: str, p: int, r: int, m: int, v: int) -> tuple[tuple, tuple]:
    key = f"{kind} {p} {r} {m} {v}"
    hit = _STORE.get(key)
    if hit is not None:
        return hit
    out = _walk_moments(kind, p, r, m, v)
    _STORE.add(key, out)
    return out


def _walk_moments(kind: str, p: int, r: int, m: int, v: int) -> tuple[tuple, tuple]:
    if not 0 <= r < p:
        raise ValueError(f"stage {r} is outside 0..{p - 1}")
    if p == 1 and v == 1:
        # no pipeline: micro-batches one after another, the later ones beside the gradients
        return ((1, 0, 0, 0, 0, 0),), (((1, 0, 0, 1, 0, 0),) if m > 1 else ())
    return _walk(kind, p, r, m, v).finish(f"{torch_schedule(kind, p, m, v)} p={p} m={m} v={v} rank {r}")


def _walk(kind: str, p: int, r: int, m: int, v: int, record: bool = False) -> _Walk:
    cls = torch_schedule(kind, p, m, v)
    if cls == "Schedule1F1B":
        return _walk_1f1b(p, m, r, record)[0]
    return _walk_actions(cls, p, m, v, r, sends_kept=cls == "ScheduleGPipe", record=record)


def step_states(kind: str, num_stages: int, rank: int, num_microbatches: int,
                virtual_stages: int = 1) -> frozenset:
    """The states rank `rank` passes through in one step of its schedule that no other of its
    states dominates: (action "F" / "B", local chunk, the `held_moments` vector at that moment:
    activations held, sends referenced, gradients made, receive buffers alive, per chunk). With
    micro-batches alike, a rank's memory at an action is a non-decreasing function of its state
    (each entry counts tensors held), so two step lengths with the same maximal states reach the
    same peak (`reduced_microbatches`)."""
    v = max(int(virtual_stages), 1)
    w = _walk(kind, int(num_stages), int(rank), int(num_microbatches), v, record=True)
    groups: dict[tuple[str, int], list] = {}
    for a, c, x in w.states or ():
        groups.setdefault((a, c), []).append(x)
    return frozenset((a, c, x) for (a, c), xs in groups.items() for x in _maximal(xs))


# without a pipeline the runtime runs micro-batches one after another: the first (no gradient
# yet), the middle ones (beside the gradients) and the last (ZeRO-3 syncs gradients in it) differ
NO_PIPELINE_MICROBATCHES = 3


def reduced_microbatches(kind: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1,
                         rank: Optional[int] = None) -> int:
    """The fewest micro-batches m' <= m for which every rank of the pipeline has the same maximal
    states in a step as with m (`step_states`; the same torch class, and for the interleaved
    schedule a multiple of the depth, as the runtime requires): every state of the full step is
    then at most one of the shorter step's and the reverse, so both reach the same peak, while
    what scales with the micro-batches (transfers, per-micro-batch collectives) is m' of m.
    `rank`: for that rank of the pipeline alone (a later stage warms up fewer micro-batches:
    1F1B's rank r needs max(p, 2p - 1 - 2r))
    `autopar verify` steps m' micro-batches. GPipe, which holds every micro-batch at once, has
    no shorter equivalent. The search's walks use the closed form of the same counts
    (`equivalent_microbatches`); this walks the states, the proof the shorter step relies on."""
    p, m, v = int(num_stages), int(num_microbatches), max(int(virtual_stages), 1)
    if p == 1 and v == 1:
        return min(m, NO_PIPELINE_MICROBATCHES)
    cls = torch_schedule(kind, p, m, v)
    step = p if cls == "ScheduleInterleaved1F1B" else 1
    ranks = range(p) if rank is None else [int(rank)]
    full = {r: step_states(kind, p, r, m, v) for r in ranks}
    for k in range(step, m, step):
        if torch_schedule(kind, p, k, v) != cls or (cls == "ScheduleInterleaved1F1B" and m % k and k % p):
            continue
        if all(step_states(kind, p, r, k, v) == full[r] for r in ranks):
            return k
    return m


class _MomentStore:
    """The walks' results on disk, in the capture cache's directory when the caller uses one
    (`use_directory`: `autopar plan` does, unless `--no-cache`): a search asks for up to a few
    thousand (schedule, p, rank, m, v), each a walk of torch's action list (GPT-3 175B on 1536
    GPUs: about 2 s of its search), and every later search asks the same ones. Keyed by torch's
    version and this file's source (the walks read torch's runners), one JSON file written whole
    to a temporary file and renamed into place (`save`, after a search); a file that does not
    read back is ignored and rewritten; an unwritable directory only costs the walks (warned)."""

    def __init__(self) -> None:
        self._data: Optional[dict[str, tuple[tuple, tuple]]] = None
        self._new = 0
        self.directory: Optional[Path] = None

    def use_directory(self, directory: Optional[Path | str]) -> None:
        """Read and write the walks under `directory` (None: memory only). Walks made so far are
        kept and saved there too."""
        directory = Path(directory) if directory is not None else None
        if directory != self.directory:
            self.directory = directory
            mine = self._data or {}
            self._data = None
            if directory is not None:
                self._new += len(mine)
                self._load().update(mine)

    def path(self) -> Path:
        h = hashlib.sha256(torch_version().encode())
        h.update(Path(__file__).read_bytes())
        return Path(self.directory or ".") / "schedules" / f"moments-{h.hexdigest()[:16]}.json"

    def _load(self) -> dict[str, tuple[tuple, tuple]]:
        if self._data is None:
            self._data = {}
            if self.directory is None:
                return self._data
            try:
                raw = json.loads(self.path().read_text())
                self._data = {k: tuple(tuple(tuple(x) for x in part) for part in val) for k, val in raw.items()}
            except (OSError, ValueError, TypeError):
                pass            # none yet, or unreadable: walked again and rewritten
        return self._data

    def get(self, key: str) -> Optional[tuple[tuple, tuple]]:
        return self._load().get(key)

    def add(self, key: str, value: tuple[tuple, tuple]) -> None:
        self._load()[key] = value
        self._new += 1

    def save(self) -> None:
        """Write the walks made since the last save (if any) to disk, atomically."""
        if not self._new or self._data is None or self.directory is None:
            return
        path = self.path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".moments-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self._data, separators=(",", ":")))   # the C encoder (json.dump: Python)
            os.replace(tmp, path)
            self._new = 0
        except OSError as e:
            warnings.warn(f"autopar: could not write the schedule cache {path}: {e}", stacklevel=2)


_STORE = _MomentStore()


def save_moments() -> None:
    """Keep the schedule walks made so far on disk for later searches (`_MomentStore`), in the
    directory `moments_directory` set (nothing without one)."""
    _STORE.save()


def moments_directory(directory: Optional[Path | str]) -> None:
    """Where the schedule walks are kept across processes (`_MomentStore`); None: not on disk."""
    _STORE.use_directory(directory)


def torch_version() -> str:
    import torch

    return torch.__version__


def equivalent_microbatches(kind: str, num_stages: int, rank: int, num_microbatches: int,
                            virtual_stages: int = 1) -> int:
    """The fewest micro-batches whose walk gives rank `rank` the same maximal moments
    (`held_moments`) as `num_microbatches`: past the warm-up, each further micro-batch repeats
    the steady state's moments. Without a pipeline (one stage, one chunk): the
    `NO_PIPELINE_MICROBATCHES` kinds of micro-batch (`reduced_microbatches` says the same). torch's
    1F1B: max(p, 2p - 1 - 2r) (the rank's warm-up, its steady state once, its cool-down); the
    interleaved schedule with m a multiple of p: 3p. Both found
    by walking every m up to 80 (1F1B) and 24p (interleaved, v in 2 and 4) for p <= 4, and to 6p
    for p <= 8 (`tests/test_cost_models.py`); GPipe holds every micro-batch at once and has no
    shorter equivalent. A search asks for m up to thousands: the walks are O(m v) each.
    `reduced_microbatches` checks the same counts on the rank's states (verify's shorter step)."""
    p, r, m, v = int(num_stages), int(rank), int(num_microbatches), max(int(virtual_stages), 1)
    if p == 1 and v == 1:
        return min(m, NO_PIPELINE_MICROBATCHES)
    cls = torch_schedule(kind, p, m, v)
    if cls == "Schedule1F1B":
        m0 = max(p, 2 * p - 1 - 2 * r)
    elif cls == "ScheduleInterleaved1F1B" and m % p == 0:
        m0 = 3 * p
    else:
        return m
    return m0 if m0 < m and torch_schedule(kind, p, m0, v) == cls else m


def held_moments(kind: str, num_stages: int, rank: int, num_microbatches: int,
                 virtual_stages: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """What rank `rank` holds at the moments its peak can fall on, before its first backward
    (no weight gradient exists yet) and after it: arrays of shape (moments, 6, virtual_stages),
    entry [t, k, c] for local chunk c (global stage c * num_stages + rank): k = `ACTS` chunk
    micro-batches whose activations are held, `SENT_OUTPUTS` outputs of finished micro-batches
    a forward send still references, `SENT_GRADS` input gradients a backward send references,
    `GRADS` 1 where the chunk's weight gradients exist, `RECV_INPUTS` / `RECV_GRADS` receive
    buffers alive of the chunk's input / of its output's gradient. The bytes held at moment t are
    `sum(moments[t] * per_chunk)` with per_chunk[k, c] the bytes of each kind (one micro-batch;
    the chunk's gradients). Only maximal moments are kept."""
    v = max(int(virtual_stages), 1)
    p, r = int(num_stages), int(rank)
    parts = _moments(kind, p, r, equivalent_microbatches(kind, p, r, int(num_microbatches), v), v)
    out = tuple(np.array(part, dtype=float).reshape(-1, _ROWS, v) for part in parts)
    for a in out:
        a.setflags(write=False)
    return out[0], out[1]


def held_split(kind: str, num_stages: int, rank: int, num_microbatches: int,
               virtual_stages: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Chunk micro-batches rank `rank` holds after each of its forwards, split into the
    moments before its first backward and after it, each of shape (moments, virtual_stages):
    entry [t, c] is how many micro-batches of local chunk c it holds (`held_moments`'
    activations alone, maximal moments)."""
    out = []
    for part in held_moments(kind, num_stages, rank, num_microbatches, virtual_stages):
        v = part.shape[2]
        acts = _maximal([tuple(x) for x in part[:, ACTS, :]]) if len(part) else ()
        a = np.array(acts, dtype=float).reshape(-1, v)
        a.setflags(write=False)
        out.append(a)
    return out[0], out[1]


def held_profile(kind: str, num_stages: int, rank: int, num_microbatches: int,
                 virtual_stages: int = 1) -> np.ndarray:
    """All maximal moments of `held_split`, before and after the first backward together: the
    peak of activations `a` (bytes per micro-batch per local chunk) is `max(profile @ a)`."""
    pre, post = held_split(kind, num_stages, rank, num_microbatches, virtual_stages)
    v = pre.shape[1]
    return np.array(_maximal([tuple(x) for x in np.vstack([pre, post])]), dtype=float).reshape(-1, v)


def peak_held(kind: str, num_stages: int, rank: int, num_microbatches: int, chunk_bytes,
              virtual_stages: int = 1) -> float:
    """Largest activation bytes rank `rank` holds at once, given `chunk_bytes[c]`, one
    micro-batch's activations of its local chunk c."""
    prof = held_profile(kind, num_stages, rank, num_microbatches, virtual_stages)
    return float(np.max(prof @ np.asarray(chunk_bytes, dtype=float).reshape(-1)))
