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

    def submesh(self, kind: str | tuple[str, ...], member: bool = True) -> Optional[DeviceMesh]:
        """The axes of `kind` (or of any of several kinds), flattened into one when several
        have size > 1; None without. `member=False` (a rank outside the stage): only take part
        in the flattened axis's process-group creation, which is collective over the world,
        and return None."""
        kinds = (kind,) if isinstance(kind, str) else kind
        names = self._names(kinds)
        if not names:
            return None
        flat = f"{'_'.join(kinds)}_flat"
        if len(names) == 1:
            return self.mesh[names[0]] if member else None
        if not member:
            _flat_groups_elsewhere(self.mesh, names, flat)
            return None
        return self.mesh[names]._flatten(flat)


def _flat_groups_elsewhere(mesh: DeviceMesh, names: tuple[str, ...], flat: str) -> None:
    """On a rank outside `mesh`, the process groups that `mesh[names]._flatten(flat)` makes on
    its ranks, made in the same order. Since torch's layout-based DeviceMesh (2.9+) a rank
    outside a mesh cannot slice some of its axes (the slice's `mesh` tensor needs the local
    rank: "...it needs to contain the local rank"), so it makes the groups without a mesh,
    by the call `_flatten` makes (`DeviceMesh._init_one_process_group` on the collapsed
    layout of the slice). Older torch slices such a mesh, as before."""
    if not hasattr(mesh, "_layout") or not hasattr(DeviceMesh, "_init_one_process_group"):
        mesh[names]._flatten(flat)
        return
    from torch.distributed._mesh_layout import _MeshLayout

    layout = _MeshLayout([mesh._get_slice_mesh_layout(names).collapse()])
    DeviceMesh._init_one_process_group(layout[0], mesh._rank_map, flat, (None, None))


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
