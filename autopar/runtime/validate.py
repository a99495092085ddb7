"""What the runtime checks of a plan before any process group exists."""

from __future__ import annotations

import torch.nn as nn

from autopar.runtime.materialize import canonical_names
from autopar.runtime.meshes import _mesh_kinds
from autopar.schema.errors import PlanError
from autopar.schema.mesh_axes import MESH_AXIS_KINDS
from autopar.schema.placement import shard_dim
from autopar.schema.plan import Plan, StagePlan
from cost_models.schedules import SCHEDULES, schedule_kind


def get_submodule(root: nn.Module, fqn: str) -> nn.Module:
    """The module a plan names (`StagePlan.layers`, `fsdp_units`), or a PlanError naming it."""
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        raise PlanError(f"the plan names layer {fqn!r}, which the model does not have") from None


def stage_parameters(model: nn.Module, stage: StagePlan, aliases: dict[str, str]) -> set[str]:
    """Canonical names of the parameters `stage` holds: those under the modules it runs
    (`layers`) and those its placements name, which the planner gives it for every parameter its
    ops read (`planner._placements`), held by no module of the stage or by none at all (a gain
    read in the model's own forward, a tied head written `x @ emb.weight.t()`). A parameter
    several stages read is held by each, its gradients summed (`tied_groups`)."""
    held = {aliases.get(f"{fqn}.{n}", f"{fqn}.{n}") for fqn in stage.layers
            for n, _ in get_submodule(model, fqn).named_parameters(remove_duplicate=False)}
    return held | {aliases.get(f, f) for f in stage.placements}


def check_covered(model: nn.Module, stages: list[StagePlan], aliases: dict[str, str]) -> None:
    """A PlanError naming the model's parameters no stage holds (`stage_parameters`)."""
    covered = set().union(*(stage_parameters(model, s, aliases) for s in stages))
    missing = sorted(set(aliases.values()) - covered)
    if missing:
        raise PlanError(f"the plan's stages leave parameters out: {', '.join(missing[:5])}; place each in the "
                        f"stages whose ops read it (their `placements`), or re-plan with `autopar plan`")


def validate_plan(plan: Plan, model: nn.Module) -> dict:
    """Check, without any process group, that the runtime can execute `plan` on `model`; raise
    PlanError saying what cannot. Returns derived facts (device sets in stage order, chunks per
    device set)."""
    stages = sorted(plan.stages, key=lambda s: s.index)
    used = sorted({d for s in stages for d in s.devices})
    if used != list(range(len(used))):
        raise PlanError(f"the plan's stages use devices {used}; the runtime needs ranks 0..{len(used) - 1}")
    for s in stages:
        for a in s.mesh_axis_names:
            if a not in MESH_AXIS_KINDS:
                raise PlanError(f"stage {s.index}: mesh axis {a!r} is not one of {', '.join(MESH_AXIS_KINDS)}")
        for fqn in s.layers:
            get_submodule(model, fqn)
    devsets: list[tuple[int, ...]] = []
    for s in stages:
        t = tuple(s.devices)
        if t not in devsets:
            devsets.append(t)
    pp = len(devsets)
    dps = {s.axis_size("dp") for s in stages}
    if len(dps) > 1:
        raise PlanError(f"stages with different data-parallel degrees {sorted(dps)} are not supported")
    nst = len(stages)
    M = plan.num_microbatches
    if pp > 1:
        for i, s in enumerate(stages):
            if tuple(s.devices) != devsets[i % pp]:
                raise PlanError(f"stage {s.index} runs on {s.devices}, expected {list(devsets[i % pp])}: "
                                f"chunks must go round the device sets in order (interleaving)")
        v = nst // pp
        if v * pp != nst:
            raise PlanError(f"{nst} stages over {pp} device sets: not a whole number of chunks")
        if not schedule_kind(plan.schedule).interleaved and v > 1:
            interleaved = [k.name for k in SCHEDULES.values() if k.interleaved]
            raise PlanError(f"{v} chunks per device need schedule {' or '.join(interleaved)}, not {plan.schedule}")
        if v > 1 and len(_mesh_kinds(stages)) > 1:
            raise PlanError("interleaved pipelines need equal stage meshes (chunks go round the device "
                            f"sets), got {sorted(_mesh_kinds(stages))}; plan them with equal stage meshes")
        if v > 1 and M % pp != 0:
            raise PlanError(f"interleaved 1F1B needs num_microbatches ({M}) to be a multiple of "
                            f"the pipeline depth ({pp})")
        check_covered(model, stages, canonical_names(model))
    refused = plan.search.get("tp_executor") if isinstance(plan.search, dict) else None
    for s in stages:
        if s.axis_size("tp") > 1 and s.op_layouts is None:
            # tensor parallelism runs only op by op as solved (`autopar.intra_op.execute`; issue
            # 20, one executor): a plan the planner could not solve says why, a plan written by
            # hand (parameter placements alone) is re-planned
            why = (f"the planner's tensor parallelism {refused}" if refused else
                   "re-plan with `autopar plan` (placements alone do not say how each op runs)")
            raise PlanError(f"stage {s.index} is tensor-parallel (tp {s.axis_size('tp')}) but the plan carries no "
                            f"per-op layouts (op_layouts), which `autopar run` executes tensor parallelism by: {why}")
    solved = [s.index for s in stages if s.op_layouts is not None]
    if solved and (max(s.axis_size("tp") for s in stages) < 2 or len(solved) < nst):
        raise PlanError(f"stage {solved[0]} carries op_layouts, which the runtime executes only for "
                        f"plans with a tensor-parallel stage, every stage solved; re-plan with `autopar plan`")
    for a, b in zip(stages, stages[1:]):
        if solved and a.axis_size("tp") != b.axis_size("tp"):
            sharded = {n: pl for n, pl in b.op_layouts.receives.items() if any(p != "R" for p in pl)}
            if sharded:
                n, pl = next(iter(sharded.items()))
                raise PlanError(f"stage {b.index} (tp {b.axis_size('tp')}) receives {n} laid out {pl} from stage "
                                f"{a.index} (tp {a.axis_size('tp')}): between stages of different tp degrees "
                                f"tensors cross replicated; re-plan with `autopar plan`")
    names = dict(model.named_parameters(remove_duplicate=False))
    for s in stages:
        for fqn, pl in s.placements.items():
            p = names.get(fqn)
            if p is None:
                raise PlanError(f"stage {s.index} places {fqn!r}, which the model does not have")
            for _ax, q in zip(s.mesh_shape, pl):
                d = shard_dim(q)
                if d is not None:
                    if not -p.dim() <= d < p.dim():
                        raise PlanError(f"placement {q} of {fqn} does not fit its shape {tuple(p.shape)}")
    return {"devsets": devsets, "chunks_per_device": nst // pp}
