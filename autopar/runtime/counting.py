"""Counting the collectives that ran, and the convention the plan's `predicted.collectives` uses.

Convention (per optimizer step, by kind: all_reduce, all_gather, reduce_scatter, all_to_all,
broadcast, send_recv):

* A collective issued by every group along a mesh axis of a stage (the SPMD program of the stage
  issues it on every device) counts **once per stage** - not once per group, not once per rank.
  E.g. dp4 with one flat gradient bucket: all_reduce = 1; pp2 x dp2: all_reduce = 2 (one per
  stage).
* One point-to-point transfer (an activation forward or a gradient backward between adjacent
  stages, per micro-batch) counts **once** as send_recv (at the receiver). Under pp x dp the dp
  replicas' pipelines run the same transfers in parallel; they count once. When adjacent stages
  have different tp degrees, every rank of the receiving stage gets its own copy of the
  (replicated) tensor (`autopar.runtime.pipeline_p2p`): still one transfer - it is counted where
  it is received, once per receiving stage.
* A collective whose group spans stages (the gradient sync of a parameter tied between the first
  and the last stage) counts once; parameters held by one set of stages share it, another set
  of holders has its own.
* Coalesced calls count once. Collectives outside the step (initialisation, metrics, checkpoint)
  are not counted.

What the runtime's layouts issue (for planners matching the count):

* dp gradient sync, once per stage per step (after all micro-batches): zero_stage 0 -> 1
  all_reduce (one flat bucket); zero_stage 1/2 -> 1 reduce_scatter + 1 all_gather.
* zero_stage 3 (`fully_shard`): U units per stage = the stage's layers whose parameters no other
  layer of the stage shares, + the stage root when it holds parameters directly (tied ones).
  Without pipelining: all_gather = M·U (forward) + M·(U − 1 if the root holds parameters, else
  U) (backward; the root is not resharded after forward); reduce_scatter = U, or M·U where
  the plan reduce-scatters every micro-batch (`Plan.zero3_grad_sync` "microbatch"). In a pipeline
  (torch.pipelining drives the stage's FSDP root, a program chunk with tp: gradient sync and
  resharding after the last micro-batch only): all_gather = U·(M + 1), reduce_scatter = U.
* tp, a stage with solved per-op layouts (`StagePlan.op_layouts`, executed op by op): the
  layouts' collectives per micro-batch (forward, backward, parameter-gradient redistributions,
  and under recomputation the checkpointed region's forward collectives again), times M.
  A tp stage without them is refused (`runtime.validate`; issue 20, one executor).
* pp: send_recv = 2·M·(chunks − 1); +1 all_reduce per set of stages holding tied parameters
  (parameters held by the same stages share one flat buffer).
* recompute re-runs the forward collectives of the recomputed region in the backward: a tp
  stage's checkpointed regions re-run whole (`op_layouts.collectives["recompute"]`).

Measured: every rank counts what it issues (a TorchDispatchMode that sees c10d and functional
collectives, DTensor's included); `global_counts` combines them: only one representative rank
per distinct stage device set (the device at mesh coordinate 0) contributes, a collective counted
with weight 1/(representatives in its group), receives with weight 1, sends 0 (every rank of a
stage receives each transfer exactly once, while a stage's rank 0 may send one to several ranks
of a wider neighbour, or none to a narrower one).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_KIND = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    # DTensor's Shard(i) -> Shard(j) exchange (the executor's `_all_to_all`): one op whose kernel
    # calls the process group itself, so no c10d op is dispatched inside it (nor on fake tensors)
    "shard_dim_alltoall": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send_recv", "recv_": "recv", "recv_any_source_": "recv",
    "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce",
}
_NAMESPACES = frozenset(("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor"))
from torch.distributed.tensor import DTensor as _DTensor  # noqa: E402

_DEVICE = torch.ops.prim.device.default


def _group_ranks(func: Any, args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in list(args) + list(kwargs.values()):
        pg = a if isinstance(a, dist.ProcessGroup) else None
        if pg is None and isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
            except Exception:
                pg = None
        if pg is not None:
            try:
                return tuple(dist.get_process_group_ranks(pg))
            except Exception:
                return ()
        if isinstance(a, str) and func.namespace != "c10d":
            try:
                return tuple(dist.get_process_group_ranks(_resolve_process_group(a)))
            except Exception:
                continue
    return ()


class CollectiveCounter(TorchDispatchMode):
    """Records (kind, group ranks) of every collective issued while active."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, tuple[int, ...]]] = []
        self.enabled = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:   # a fake tensor's device, asked at most ops (`autopar verify`): no collective
            return func(*args, **(kwargs or {}))
        if _DTensor in types:
            return NotImplemented  # let DTensor desugar into collectives first, then see them
        kwargs = kwargs or {}
        self.observe(func, args, kwargs)
        return func(*args, **kwargs)

    def observe(self, func: Any, args: Sequence[Any], kwargs: dict) -> None:
        """Record op `func` when it is a collective (its kind and group ranks), before it runs:
        what `__torch_dispatch__` does for an op on plain or fake tensors (DTensor ops are let
        through first, their collectives seen when they run)."""
        if func.namespace in _NAMESPACES and self.enabled:
            kind = _KIND.get(func._opname)
            if kind is not None:
                self.events.append((kind, _group_ranks(func, args, kwargs)))

    def local_counts(self) -> dict[str, int]:
        """This rank's counts, a receive counted as one send_recv and sends not at all."""
        return dict(Counter("send_recv" if k == "recv" else k for k, _ in self.events if k != "send_recv"))

    def reset(self) -> None:
        self.events = []


def combine(events_by_rank: dict[int, list[tuple[str, tuple[int, ...]]]],
            representatives: set[int]) -> dict[str, int]:
    """Apply the convention above to every rank's events (see module docstring)."""
    total: Counter = Counter()
    for r in representatives:
        for kind, ranks in events_by_rank.get(r, []):
            if kind == "send_recv":
                continue
            if kind == "recv":
                total["send_recv"] += 1.0
                continue
            n = len(set(ranks) & representatives) if ranks else 1
            total[kind] += 1.0 / max(n, 1)
    return {k: int(round(v)) for k, v in sorted(total.items()) if round(v) > 0}


def global_counts(counter: CollectiveCounter, representatives: set[int]) -> dict[str, int]:
    """Collective call: every rank passes its counter; returns the combined counts on all ranks."""
    world = dist.get_world_size()
    was = counter.enabled
    counter.enabled = False
    try:
        if world == 1:
            return combine({0: counter.events}, {0})
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, counter.events)
        import os

        if os.environ.get("AUTOPAR_DEBUG_COLLECTIVES") and dist.get_rank() == 0:
            for i, ev in enumerate(gathered):
                print(f"[collectives] rank {i}: {ev}", flush=True)
        return combine({i: ev for i, ev in enumerate(gathered)}, representatives)
    finally:
        counter.enabled = was
