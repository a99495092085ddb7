"""A shorter step with the full step's memory peak and collectives (`autopar verify`).

A step's micro-batches are alike: a pipeline rank's memory at each action is decided by its
schedule's state then (what it holds per chunk: activations, sends, receive buffers, gradients;
`cost_models.schedules.step_states`), and the same state recurs for every micro-batch of the
steady phase. `reduced_microbatches` finds the fewest micro-batches m' whose step has the same
maximal states on the rank as the plan's m (rank r of 1F1B over p stages: max(p, 2p - 1 - 2r); GPipe and most
interleaved plans: none shorter; no pipeline: 3): stepping m' reaches the same peak, for a
fraction m'/m of the work. `shortened(plan)` is the plan with m' micro-batches of the same size.

What differs between the two steps is known and put back: the step's batch (m' of m
micro-batches: the tracker's "inputs", scaled by m/m', `full_inputs`), and the collectives of
the forward/backward phase (`extrapolate`): transfers scale with m (every micro-batch crosses
every boundary once each way); every other collective is attributed to the micro-batch whose
action (`forward_one_chunk`, `backward_one_chunk`, the runner's forward without a pipeline) ran
last when it was issued (`MicrobatchTags`), the micro-batches between the first and the last
must have issued the same ones (checked: `ShortStepError` otherwise), and the m - m' missing
micro-batches are counted as one of those. Collectives of the gradient sync and the optimizer
step do not depend on m. Not shortened: ZeRO-3 in a pipeline (FSDP's gathers there follow the
order of the actions, whether a unit was resharded since its last one, not the micro-batch).
What the shorter step holds less than the full one and is not put back: the last stage's loss
per micro-batch (a 4-byte scalar each, kept to report the step's loss).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator, Optional, Sequence

from cost_models.schedules import reduced_microbatches

__all__ = ["ShortStepError", "MicrobatchTags", "shortened", "extrapolate", "full_inputs", "P2P_KINDS"]

P2P_KINDS = frozenset(("send_recv", "recv"))
FORWARD_BACKWARD = "forward_backward"
MIN_MICROBATCHES = 4


class ShortStepError(ValueError):
    """The shorter step's collectives do not extrapolate (its middle micro-batches differ)."""


def shortened(plan: Any, position: Optional[int] = None) -> tuple[Any, int]:
    """(the plan with the fewest micro-batches whose step reaches the same states, that number);
    the plan itself when no fewer do. `position`: for the rank at that place of the pipeline
    only (0 .. pp - 1), else for every rank."""
    m = plan.num_microbatches
    if plan.zero_stage == 3 and plan.pp > 1:
        return plan, m    # FSDP's gathers in a pipeline follow the order of the actions: all run
    k = reduced_microbatches(plan.schedule, plan.pp, m, plan.virtual_stages, rank=position)
    # at least two middle micro-batches, whose collectives are checked equal (`extrapolate`)
    k = max(k, MIN_MICROBATCHES)
    if plan.virtual_stages > 1:
        k = -(-k // plan.pp) * plan.pp
    if k >= m:
        return plan, m
    return plan.model_copy(update={"num_microbatches": k,
                                   "global_batch_size": plan.global_batch_size // m * k}), k


class MicrobatchTags:
    """The micro-batch whose action ran last (`current`, None before the first): set by wrappers
    around the pipeline stages' actions, or around the runner's forward without a pipeline."""

    def __init__(self) -> None:
        self.current: Optional[int] = None

    @contextlib.contextmanager
    def installed(self, pm: Any) -> Iterator[None]:
        """Wrap `pm`'s actions for the duration (instance attributes, removed after)."""
        undo: list = []

        def wrap(obj: Any, name: str, index_of: Any) -> None:
            orig = getattr(obj, name)

            def wrapped(*a: Any, **k: Any) -> Any:
                self.current = index_of(a, k)
                return orig(*a, **k)

            setattr(obj, name, wrapped)
            undo.append((obj, name))

        stages = list(getattr(pm, "pipe_stages", None) or []) if getattr(pm, "pp", 1) > 1 else []
        if stages:
            for st in stages:
                for name, key in (("forward_one_chunk", "fwd_chunk_id"), ("backward_one_chunk", "bwd_chunk_id"),
                                  ("backward_weight_one_chunk", "bwd_chunk_id")):
                    if hasattr(st, name):
                        wrap(st, name, lambda a, k, key=key: int(a[0]) if a else int(k[key]))
        else:
            count = iter(range(1 << 62))

            def pre(*_: Any) -> None:
                self.current = next(count)

            runner = pm.runner
            if hasattr(runner, "register_forward_pre_hook"):
                h = runner.register_forward_pre_hook(pre)
                undo.append(h.remove)
            else:
                wrap(pm, "runner", lambda a, k: pre() or self.current)
        try:
            yield
        finally:
            for u in undo:
                u() if callable(u) else delattr(*u)


def extrapolate(events: Sequence[tuple[str, tuple[int, ...]]], phases: Sequence[str],
                tags: Sequence[Optional[int]], run: int, full: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The collectives of a `full`-micro-batch step, as (kind, group ranks, phase), from those of
    a `run`-micro-batch one (`events`, each with its phase and micro-batch tag); see the module
    docstring. Raises ShortStepError when they do not extrapolate."""
    out = [(k, r, ph) for (k, r), ph in zip(events, phases)]
    if run == full:
        return out
    if run < MIN_MICROBATCHES:
        raise ShortStepError(f"{run} micro-batches have no middle one to stand for the other {full - run}")
    kept: list[tuple[str, tuple[int, ...], str]] = []
    p2p: Counter = Counter()
    buckets: dict[int, Counter] = {}
    for (k, r), ph, tag in zip(events, phases, tags):
        if ph != FORWARD_BACKWARD:
            kept.append((k, r, ph))
        elif k in P2P_KINDS:
            p2p[(k, r)] += 1
        else:
            kept.append((k, r, ph))
            if tag is not None:
                buckets.setdefault(tag, Counter())[(k, r)] += 1
    middle = [buckets.get(i, Counter()) for i in range(1, run - 1)]
    if any(b != middle[0] for b in middle[1:]):
        i = next(i for i, b in enumerate(middle[1:], 2) if b != middle[0])
        raise ShortStepError(f"micro-batch {i} issued other collectives than micro-batch 1 "
                             f"({dict(buckets.get(i, {}))} against {dict(middle[0])}): the step does not "
                             f"extrapolate to {full} micro-batches")
    for (k, r), n in middle[0].items():
        kept += [(k, r, FORWARD_BACKWARD)] * (n * (full - run))
    for (k, r), n in p2p.items():
        if n * full % run:
            raise ShortStepError(f"{n} transfers ({k} on ranks {r[:4]}...) in {run} micro-batches do not scale "
                                 f"to {full}")
        kept += [(k, r, FORWARD_BACKWARD)] * (n * full // run)
    return kept


def full_inputs(detail_inputs: int, run: int, full: int) -> int:
    """The bytes the step's batch would add with `full` micro-batches over `run` of them (the
    tracker's "inputs" at the peak is `run` micro-batches of the rank's batch)."""
    return 0 if run == full or run == 0 else detail_inputs * (full - run) // run
