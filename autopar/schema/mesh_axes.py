"""The kinds of a stage's mesh axes, the one registry the planner, the plan and the runtime read.

- "dp": data parallelism, the batch split (parameters replicated, or sharded under ZeRO);
- "cp": context parallelism, every sample's sequence split (each rank two chunks, i and
  2 cp - 1 - i, so causal attention's work balances), the attention gathering keys and values
  over the axis; parameters replicated, their gradients synced over dp and cp together;
- "tp": tensor parallelism, the placements of `StagePlan.placements` / `op_layouts`.

A stage's axes are listed outermost first in `STAGE_AXIS_ORDER` (tp innermost: the fastest
links; cp next, so its exchange stays on them where dp x tp does not fill a node).
"""

from __future__ import annotations

from typing import Literal, get_args

MeshAxisKind = Literal["dp", "cp", "tp"]
MESH_AXIS_KINDS: tuple[str, ...] = get_args(MeshAxisKind)
STAGE_AXIS_ORDER: tuple[str, ...] = ("dp", "cp", "tp")
# the kinds whose ranks each hold a replica of the parameters and sync their gradients
GRADIENT_SYNC_KINDS: tuple[str, ...] = ("dp", "cp")


def stage_mesh(dp: int, cp: int, tp: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(mesh_shape, mesh_axis_names) of a stage of dp x cp x tp devices, in `STAGE_AXIS_ORDER`;
    the cp axis only where cp > 1 (plans without context parallelism keep their (dp, tp) mesh)."""
    sizes = {"dp": dp, "cp": cp, "tp": tp}
    names = tuple(k for k in STAGE_AXIS_ORDER if k != "cp" or cp > 1)
    return tuple(sizes[k] for k in names), names
