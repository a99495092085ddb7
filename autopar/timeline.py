"""Pipeline timelines: when each stage runs the forward and backward of each micro-batch.

An event simulation of the schedule (GPipe, 1F1B, interleaved 1F1B) from per-micro-batch stage
times: a forward waits for the previous stage's forward of the same micro-batch, a backward for
the next stage's backward, and each device runs its work in the schedule's order. Used by
`autopar show --plot` and as a check of the planner's bubble formula.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.schema import Plan


@dataclass(frozen=True)
class Event:
    device_group: int     # pipeline position (index of the distinct device set)
    stage: int            # model chunk index in pipeline order
    microbatch: int
    kind: str             # "F" or "B"
    start: float
    end: float


def device_order(schedule: str, p: int, m: int, v: int, pos: int) -> list[tuple[str, int, int]]:
    """The order in which pipeline position `pos` runs (kind, chunk, micro-batch), as Megatron
    orders it (`cost_models.schedules.held_split` reads torch's own lists for memory)."""
    from cost_models.schedules import schedule_kind

    kind = schedule_kind(schedule)
    if kind.name == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if not kind.interleaved or v == 1:
        warm = min(p - pos - 1, m)
        order = [("F", 0, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                order.append(("F", 0, f))
                f += 1
            order.append(("B", 0, b))
            b += 1
        return order
    # interleaved 1F1B (Megatron): micro-batches in groups of p, chunks round-robin
    total = m * v

    def fwd_id(k: int) -> tuple[int, int]:
        group, r = divmod(k, p * v)
        return r // p, group * p + r % p

    def bwd_id(k: int) -> tuple[int, int]:
        c, i = fwd_id(k)
        return v - 1 - c, i

    warm = min((p - pos - 1) * 2 + (v - 1) * p, total)
    order = [("F", *fwd_id(k)) for k in range(warm)]
    f, b = warm, 0
    while b < total:
        if f < total:
            order.append(("F", *fwd_id(f)))
            f += 1
        order.append(("B", *bwd_id(b)))
        b += 1
    return order


def simulate(schedule: str, fwd: list[float], bwd: list[float], m: int, v: int = 1) -> list[Event]:
    """Events for stage times `fwd[s]`, `bwd[s]` (s over p·v model chunks in pipeline order)."""
    n = len(fwd)
    p = n // v
    assert p * v == n, "number of stages must be a multiple of virtual stages"
    stage_of = lambda pos, c: c * p + pos  # noqa: E731 - chunk c of position pos
    orders = [device_order(schedule, p, m, v, pos) for pos in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    idx = [0] * p
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for pos in range(p):
            while idx[pos] < len(orders[pos]):
                kind, c, i = orders[pos][idx[pos]]
                s = stage_of(pos, c)
                if kind == "F":
                    deps = [("F", s - 1, i)] if s > 0 else []
                else:
                    deps = [("F", s, i)] + ([("B", s + 1, i)] if s < n - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[pos]] + [done[d] for d in deps])
                end = start + (fwd[s] if kind == "F" else bwd[s])
                done[(kind, s, i)] = end
                free[pos] = end
                events.append(Event(pos, s, i, kind, start, end))
                idx[pos] += 1
                progress = True
    if any(idx[pos] < len(orders[pos]) for pos in range(p)):
        raise RuntimeError(f"schedule {schedule} deadlocked (p={p}, m={m}, v={v})")
    return events


def plan_timeline(plan: Plan) -> list[Event]:
    """Simulated timeline of one iteration of `plan` from its per-stage predictions."""
    from cost_models.schedules import schedule_kind

    m = plan.num_microbatches
    v = plan.virtual_stages if schedule_kind(plan.schedule).interleaved else 1
    ordered = sorted(plan.stages, key=lambda s: (s.virtual_chunk, s.index))
    fwd, bwd = [], []
    for s in ordered:
        sp = s.predicted
        per_mb = ((sp.compute_s + sp.communication_s) / m) if sp else 1.0
        f = getattr(sp, "forward_s", None) if sp else None
        b = getattr(sp, "backward_s", None) if sp else None
        if not f or not b:
            f, b = per_mb / 3, 2 * per_mb / 3
        fwd.append(f)
        bwd.append(b)
    if len(ordered) % v:
        v = 1
    return simulate(plan.schedule if len(ordered) > 1 else "gpipe", fwd, bwd, m, v)
