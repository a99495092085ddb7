"""The distinct kinds of rank of a plan, found from the plan alone (no process group): what
`autopar verify` builds once each instead of every rank.

Two ranks are of one kind when they run the same stages (device set) and hold the same local
shard of every parameter. Within a device set shards differ only where a sharded dimension does
not divide evenly (DTensor's and FSDP2's ceil-divided chunks leave the last coordinates smaller
or empty), so a plan usually has one kind per device set. The kind's rank is the first of them
in the device set's order: the device set's representative (coordinate 0), whose collectives
`runtime.counting` combines, is always one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Sequence

import torch.nn as nn

from autopar.runtime.materialize import canonical_names
from autopar.runtime.meshes import fsdp_sharded, unique_axis_names
from autopar.schema.mesh_axes import GRADIENT_SYNC_KINDS
from autopar.schema.placement import shard_dim
from autopar.schema.plan import Plan, StagePlan


@dataclass
class RankKind:
    """One kind of rank: `rank` is built, standing for `ranks` (itself included)."""

    rank: int
    stages: list[int]
    coordinate: dict[str, int]
    ranks: list[int] = field(default_factory=list)
    representative: bool = False


def chunk_len(size: int, parts: int, index: int) -> int:
    """The length of chunk `index` of `size` split into `parts` (DTensor's Shard and FSDP2's
    torch.chunk: ceil-divided chunks, the last ones shorter or empty)."""
    full = -(-size // parts)
    start = full * index
    return max(0, min(size, start + full) - start)


def _coordinate(s: StagePlan, rank: int) -> list[int]:
    i = s.devices.index(rank)
    out = []
    for n in reversed(s.mesh_shape):
        out.append(i % n)
        i //= n
    return out[::-1]


def _flat(coord: Sequence[int], sizes: Sequence[int]) -> int:
    i = 0
    for c, n in zip(coord, sizes):
        i = i * n + c
    return i


def expected_shards(plan: Plan, model: nn.Module, rank: int, *,
                    shapes: dict[str, tuple[int, ...]] | None = None,
                    aliases: dict[str, str] | None = None,
                    held: Sequence[str] = ()) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> the local shard shape `rank` holds under the plan's
    placements (`StagePlan.placements` of the rank's stages): "S(d)" on the tp axes splits
    dimension d (several tp axes flattened, sharded only where they all agree, as the runtime
    does), and under FSDP (ZeRO-3, or "S(0)" on a dp axis) dimension 0 of that over the dp axes.
    `held`: canonical names the rank holds (once built); those without a placement are
    replicated over tp, as the runtime takes a parameter the placements leave out."""
    aliases = canonical_names(model) if aliases is None else aliases
    if shapes is None:
        shapes = {aliases.get(n, n): tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    mine = [s for s in plan.stages if rank in s.devices]
    zero3 = fsdp_sharded(plan, mine)
    out: dict[str, tuple[int, ...]] = {}
    ep = plan.experts.ep if plan.experts is not None else 1
    per_rank = {w: b.num_experts // ep for b in plan.experts.blocks for w in b.weights} if ep > 1 else {}
    etp_split = ({w: d for b in plan.experts.blocks for w, (d, _) in zip(b.weights, b.tp_split)}
                 if ep > 1 and plan.experts.expert_tp > 1 else {})
    for s in mine:
        coord = _coordinate(s, rank)
        tp = [i for i, k in enumerate(s.mesh_axis_names) if k == "tp"]
        dp = [i for i, k in enumerate(s.mesh_axis_names) if k in GRADIENT_SYNC_KINDS]   # FSDP's shard axes
        tp_size, tp_c = prod(s.mesh_shape[i] for i in tp), _flat([coord[i] for i in tp], [s.mesh_shape[i] for i in tp])
        dp_size, dp_c = prod(s.mesh_shape[i] for i in dp), _flat([coord[i] for i in dp], [s.mesh_shape[i] for i in dp])
        placements = dict(s.placements)
        if s is mine[0]:
            named = {aliases.get(f, f) for f in placements}
            placements.update({n: ("R",) * len(s.mesh_shape) for n in held if n not in named})
        for fqn, pl in placements.items():
            name = aliases.get(fqn, fqn)
            if name not in shapes:
                continue   # the model has no such parameter: the build reports it
            shape = list(shapes[name])
            if name in per_rank and shape:
                if name in etp_split and tp_size > 1 and shape[0] != per_rank[name]:
                    # expert tensor parallelism: 1/tp of its split dim (a shape read off the
                    # whole stack; one with E/ep experts is a built rank's slice, already split)
                    shape[etp_split[name]] //= tp_size
                shape[0] = per_rank[name]
            sel = {pl[i] for i in tp}
            d = shard_dim(sel.pop()) if len(sel) == 1 else None
            if d is not None and tp_size > 1 and d < len(shape):
                shape[d] = chunk_len(shape[d], tp_size, tp_c)
            if zero3 and shape and name in per_rank and plan.experts.folded:
                # folded: FSDP over the ranks ep apart in the stage's dp x tp order (tp
                # innermost: `runtime.experts.expert_meshes`)
                shape[0] = chunk_len(shape[0], dp_size * tp_size // ep, (dp_c * tp_size + tp_c) // ep)
            elif zero3 and shape and name in per_rank:
                # FSDP over the ranks holding the same experts (consecutive groups of ep dp
                # ranks: `runtime.experts.expert_meshes`); none where each expert has one copy
                shape[0] = chunk_len(shape[0], dp_size // ep, dp_c // ep)
            elif zero3 and shape:
                shape[0] = chunk_len(shape[0], dp_size, dp_c)
            out[name] = tuple(shape)
    return out


def rank_kinds(plan: Plan, model: nn.Module) -> list[RankKind]:
    """The plan's kinds of rank, in stage order (see the module docstring)."""
    aliases = canonical_names(model)
    shapes = {aliases.get(n, n): tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    devsets: list[tuple[int, ...]] = []
    for s in sorted(plan.stages, key=lambda s: s.index):
        if tuple(s.devices) not in devsets:
            devsets.append(tuple(s.devices))
    kinds: list[RankKind] = []
    for ds in devsets:
        stages = sorted(s.index for s in plan.stages if tuple(s.devices) == ds)
        first = next(s for s in plan.stages if tuple(s.devices) == ds)
        seen: dict[tuple, RankKind] = {}
        for r in ds:
            sig = tuple(sorted(expected_shards(plan, model, r, shapes=shapes, aliases=aliases).items()))
            if sig in seen:
                seen[sig].ranks.append(r)
                continue
            coord = dict(zip(unique_axis_names(first.mesh_axis_names), _coordinate(first, r)))
            seen[sig] = RankKind(rank=r, stages=stages, coordinate=coord, ranks=[r], representative=r == ds[0])
        kinds.extend(seen.values())
    return kinds
