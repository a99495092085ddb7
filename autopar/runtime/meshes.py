"""Stage meshes: one `DeviceMesh` per distinct stage device set, and the facts about a plan's
stages the runtime derives from them."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional, Sequence

from torch.distributed.device_mesh import DeviceMesh

from autopar.schema.mesh_axes import GRADIENT_SYNC_KINDS
from autopar.schema.placement import is_shard
from autopar.schema.plan import Plan, StagePlan


def unique_axis_names(names: Sequence[str]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        k = seen.get(n, 0)
        seen[n] = k + 1
        out.append(n if k == 0 else f"{n}_{k}")
    return tuple(out)


@dataclass
class StageMesh:
    devices: tuple[int, ...]
    mesh: DeviceMesh
    axis_names: tuple[str, ...]          # unique names
    kinds: tuple[str, ...]               # the kind of each axis (`schema.mesh_axes`)
    dp_mesh: Optional[DeviceMesh] = None
    tp_mesh: Optional[DeviceMesh] = None
    dp_size: int = 1
    tp_size: int = 1

    def _names(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        """The axes of `kinds`; of several, those of size > 1 (a size-1 axis adds nothing to a
        flattened group, and leaving it out spares a process group)."""
        names = tuple(n for n, k in zip(self.axis_names, self.kinds) if k in kinds)
        if len(names) > 1:
            big = tuple(n for n in names if self.mesh.size(self.axis_names.index(n)) > 1)
            names = big or names[:1]
        return names

    def flattens(self, kind: str | tuple[str, ...]) -> bool:
        """Whether `submesh(kind)` makes a new process group (several axes of size > 1):
        group creation is collective over the world, so every rank, in every stage or not,
        must ask for it in one order."""
        return len(self._names((kind,) if isinstance(kind, str) else kind)) > 1

    def submesh(self, kind: str | tuple[str, ...]) -> Optional[DeviceMesh]:
        """The axes of `kind` (or of any of several kinds), flattened into one when several
        have size > 1; None without."""
        kinds = (kind,) if isinstance(kind, str) else kind
        names = self._names(kinds)
        if not names:
            return None
        if len(names) == 1:
            return self.mesh[names[0]]
        return self.mesh[names]._flatten(f"{'_'.join(kinds)}_flat")


def _coord(devices: Sequence[int], rank: int) -> int:
    return list(devices).index(rank)


def fsdp_sharded(plan: Plan, stages: Optional[Sequence[StagePlan]] = None) -> bool:
    """Whether `stages` (default: all the plan's) run under `fully_shard` (ZeRO-3, or a dp axis
    placed "S(0)") with more than one replica of the parameters (data- and context-parallel
    ranks alike: `GRADIENT_SYNC_KINDS`)."""
    stages = plan.stages if stages is None else stages
    if not stages or prod(stages[0].axis_size(k) for k in GRADIENT_SYNC_KINDS) <= 1:
        return False
    return plan.zero_stage == 3 or any(
        is_shard(pl[i]) for s in stages for pl in s.placements.values()
        for i, k in enumerate(s.mesh_axis_names) if k in GRADIENT_SYNC_KINDS)


def _mesh_kinds(stages: Sequence[StagePlan]) -> set[tuple[tuple[int, ...], tuple[str, ...]]]:
    """The distinct (mesh_shape, mesh_axis_names) of `stages`."""
    return {(tuple(s.mesh_shape), tuple(s.mesh_axis_names)) for s in stages}
