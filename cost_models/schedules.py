"""Pipeline schedules as `torch.distributed.pipelining` runs them, for the memory model.

What a pipeline rank holds at its peak is decided by the order in which its schedule runs
forwards and backwards: every chunk forward keeps that chunk's activations of one micro-batch
until the matching backward has run. Rather than a closed formula per schedule (which drifted
from the runtime once already: interleaving was counted a chunk at a time), the counts come
from torch's own per-rank action lists (`_get_pipeline_order` of `ScheduleGPipe` and
`Schedule1F1B`, `_calculate_single_rank_operations` of `ScheduleInterleaved1F1B`), i.e. the
order the runtime executes.

`torch_schedule(kind, p, m, v)` names the torch class the runtime builds for a plan (one place:
the engine asks it too); `held_split(...)` gives, for one rank, the chunk micro-batches held
after every forward (the moments where the held set can peak; a backward only frees), one
row per moment and one column per local chunk, before and after the rank's first backward
(weight gradients exist only after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Literal

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
    ScheduleKind("gpipe", False, "ScheduleGPipe", "all forwards, then all backwards (GPipe)"),
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


def torch_schedule(kind: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> TorchSchedule:
    """The torch.pipelining schedule class the runtime runs for a plan's `kind` with
    `num_stages` device groups, `num_microbatches` and `virtual_stages` chunks per group
    (`ScheduleKind.runtime_class`)."""
    return schedule_kind(kind).runtime_class(num_stages, num_microbatches, virtual_stages)


def _rank_actions(cls_name: TorchSchedule, p: int, m: int, v: int, rank: int) -> list:
    """torch's action list of one rank (None entries are idle steps)."""
    from torch.distributed.pipelining import schedules as S

    if cls_name == "ScheduleInterleaved1F1B":
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"interleaved 1F1B needs the {m} micro-batches to be a multiple of {rounds} rounds")
        ns = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p,
                             _n_microbatches=m)
        return S.ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, rank)
    # single-stage schedules build every rank's list at once
    ns = SimpleNamespace(_num_stages=p, _n_microbatches=m)
    cls = S.ScheduleGPipe if cls_name == "ScheduleGPipe" else S.Schedule1F1B
    return cls._get_pipeline_order(ns)[rank]


@lru_cache(maxsize=4096)
def _profile(cls_name: TorchSchedule, p: int, m: int, v: int, rank: int) -> tuple[tuple, tuple]:
    """(moments before the rank's first backward, moments after it): held chunk micro-batches
    after each forward, the dominated moments of each part dropped."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    held = [0] * v
    parts: tuple[list, list] = ([], [])
    seen_backward = False
    for a in _rank_actions(cls_name, p, m, v, rank):
        if a is None:
            continue
        local = a.stage_index // p        # chunk c of rank r is stage c * p + r
        if a.computation_type == C.FORWARD:
            held[local] += 1
            parts[seen_backward].append(tuple(held))
        elif a.computation_type in (C.FULL_BACKWARD, C.BACKWARD_INPUT):
            held[local] -= 1
            seen_backward = True
    if any(held):
        raise AssertionError(f"{cls_name} p={p} m={m} v={v} rank {rank} ends holding {held}")
    return tuple(_maximal(x) for x in parts)


def _maximal(moments: list) -> tuple:
    """The moments no other moment dominates (the peak of a non-negative weighting is at one)."""
    uniq = sorted(set(moments), key=sum, reverse=True)
    keep: list[tuple] = []
    for x in uniq:      # a moment can only be dominated by one with at least its total
        if not any(all(b >= a for a, b in zip(x, y)) for y in keep):
            keep.append(x)
    return tuple(sorted(keep))


@lru_cache(maxsize=65536)
def sends_kept(kind: str, num_stages: int, rank: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """Outputs of micro-batches whose backward already ran that rank `rank` still holds after
    its first backward, referenced by a forward send's handle. torch's `Schedule1F1B`
    (`_step_microbatches`, torch 2.13) keeps the work of the warm-up's next-to-last forward send
    in `send_work` until the cooldown's first backward send replaces it: a non-last stage that
    warms up with two or more forwards keeps that micro-batch's output through the 1F1B phase
    (measured: mlp-tiny pp2, stage 0 held one 16 KiB output more than its in-flight micro-
    batches). GPipe waits every forward send before its backwards; the interleaved schedule is
    not counted here (unmeasured)."""
    cls = torch_schedule(kind, num_stages, num_microbatches, virtual_stages)
    warmup = min(num_microbatches, num_stages - rank)
    return int(cls == "Schedule1F1B" and rank < num_stages - 1 and warmup >= 2
               and num_microbatches > num_stages - rank)


def held_split(kind: str, num_stages: int, rank: int, num_microbatches: int,
               virtual_stages: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Chunk micro-batches rank `rank` holds after each of its forwards, split into the
    moments before its first backward (no weight gradient exists yet) and after it (the
    gradients accumulate from then on), each of shape (moments, virtual_stages): entry [t, c]
    is how many micro-batches of local chunk c (global stage c * num_stages + rank) it holds.
    Only maximal moments are kept; the second part may be empty. Cached: the arrays are
    read-only."""
    pre, post = _held_split(kind, int(num_stages), int(rank), int(num_microbatches), max(int(virtual_stages), 1))
    pre.setflags(write=False)
    post.setflags(write=False)
    return pre, post


def _held_split(kind: str, p: int, r: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0 <= r < p:
        raise ValueError(f"stage {r} is outside 0..{p - 1}")
    if p == 1 and v == 1:
        # no pipeline: micro-batches one after another, the later ones beside the gradients
        return np.ones((1, 1)), (np.ones((1, 1)) if m > 1 else np.zeros((0, 1)))
    cls = torch_schedule(kind, p, m, v)
    if cls == "ScheduleGPipe":
        return np.array([[float(m)]]), np.zeros((0, 1))
    if cls == "Schedule1F1B":
        # torch's 1F1B (its _step_microbatches and _get_pipeline_order agree): p - r forwards
        # before the first backward, then one forward and one backward each while forwards
        # remain. The tests check this against torch's action lists for many p, m
        k = float(p - r)
        return np.array([[k]]), (np.array([[k]]) if m > p - r else np.zeros((0, 1)))
    pre, post = _profile(cls, p, m, v, r)
    return np.array(pre, dtype=float).reshape(-1, v), np.array(post, dtype=float).reshape(-1, v)


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
