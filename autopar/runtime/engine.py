"""Executing a Plan on this rank: meshes, stage modules, data/tensor/pipeline parallelism, ZeRO,
recomputation and the optimizer. `ParallelModel.step(batch)` runs one training iteration on the
*global* batch (every rank passes the same global batch; each takes its rows).

How each part of the plan is executed:

* Stage meshes: one `DeviceMesh` per distinct stage device set (`mesh_shape`,
  `mesh_axis_names`), created on every rank in stage order.
* "tp" axes: the stage's parameters become DTensors on the tp sub-mesh with the tp entries of
  `placements` (`spmd.distribute_params`); activations are DTensors inside the stage and plain
  (replicated) tensors at its boundaries.
* "dp" axes: the batch is split by rows; gradients are averaged over the dp group after the
  backward in one flat all-reduce per stage (zero_stage 0), one flat reduce-scatter + sharded
  AdamW + one all-gather of the updated parameters (zero_stage 1 and 2: optimizer state, and the
  gradients once reduced, live sharded), or `fully_shard` on the dp sub-mesh per layer
  (zero_stage 3, or any "S(0)" on a dp axis), rooted at the module a pipeline stage holds.
* Pipelines (more than one distinct device set): `torch.distributed.pipelining.PipelineStage`
  per chunk, holding only its layers under their original FQNs; schedule from the plan (gpipe,
  1f1b, interleaved_1f1b). The loss is computed on the last stage. Parameters tied across stages
  (GPT's embedding and output weight) live on both stages and their gradients are summed over a
  group joining the two copies (Megatron's embedding group; `tied_grads`).
* Stages of different tp degrees (Alpa's free sub-mesh per stage, one dp degree):
  `pipeline_p2p.FanoutPipelineStage`; every rank of a stage runs the schedule, each receives
  every transfer once from one rank of the neighbour (so a rank may send to several ranks of a
  wider neighbour). Interleaving still needs equal stage meshes.
* Recompute: `torch.utils.checkpoint` (non-reentrant) around each layer ("full") or around each
  layer's attention child ("selective"; the whole layer when it has none).
* Precision (`precision`): bf16/fp16 plans keep 2-byte parameters and gradients (synced in the
  2-byte dtype) and step fp32 masters, as the planner's memory and communication model
  (ZeRO-3: FSDP's fp32 shards are the masters, gathered and reduced in the 2-byte dtype);
  forward and loss run under `torch.autocast` on the device type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.models.registry import ModelBundle, call_batch_fn
from autopar.runtime.materialize import canonical_names, materialize
from autopar.runtime.pipeline_p2p import FanoutPipelineStage, replica_ranks
from autopar.runtime.precision import MasterWeights, cast_parameters_, fsdp_policy, low_dtype
from autopar.runtime.spmd import (
    SPMDModule,
    allow_implicit_replication,
    distribute_params,
    grads_to_param_layout,
    register_extra_strategies,
)
from autopar.runtime.tied_grads import FlatTiedSync, FullTiedSync, all_gather_flat, allreduce_flat, reduce_scatter_flat
from autopar.runtime.vocab_loss import VocabParallelLoss
from autopar.schema.errors import PlanError
from autopar.schema.placement import is_shard, shard_dim
from autopar.schema.plan import Plan, StagePlan
from cost_models.schedules import SCHEDULES, schedule_kind, torch_schedule

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, lr 1e-3 (torch defaults otherwise). foreach off: the same kernels as one process."""
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


# ---------------------------------------------------------------------------------------------
# model families: how layers chain and where the loss comes from, for pipeline stages
# ---------------------------------------------------------------------------------------------
@dataclass
class Family:
    """How a model decomposes into layers for pipelining: `between(fqn, x)` is applied after a
    layer (e.g. an activation), `loss(output, *targets)` ends the last stage."""

    loss: Callable[..., torch.Tensor]
    between: Callable[[str, torch.Tensor, bool], torch.Tensor] = lambda fqn, x, last: x
    num_inputs: int = 1


def family_of(model: nn.Module) -> Family:
    from autopar.models.gpt import GPT
    from autopar.models.mlp import MLP

    if isinstance(model, GPT):
        return Family(loss=lambda logits, tgt: F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten()))
    if isinstance(model, MLP):
        return Family(loss=lambda out, y: F.mse_loss(out, y),
                      between=lambda fqn, x, last: x if last else F.relu(x))
    fn = getattr(model, "pipeline_loss", None)
    if callable(fn):
        return Family(loss=fn)
    raise PlanError(f"cannot cut {type(model).__name__} into pipeline stages: autopar knows the layer "
                    f"chaining and loss of the zoo GPT and MLP; give the model a "
                    f"`pipeline_loss(output, *targets)` method, or plan it without pipelining (pp=1)")


def stage_loss(family: Family, out: Any, *targets: Any) -> torch.Tensor:
    """The family's loss on a last pipeline stage's output, as a plain tensor. Logits a
    vocabulary-parallel head left sharded over the classes (a DTensor) are read in place: a
    cross-entropy on them runs vocabulary-parallel (`vocab_loss`), with no all-gather."""
    if not isinstance(out, DTensor):
        return _compact(family.loss(out, *targets))
    try:
        with VocabParallelLoss():
            loss = family.loss(out, *targets)
    except Exception as e:  # noqa: BLE001 - a user's loss that cannot take a DTensor
        raise PlanError(f"the model's pipeline loss failed on vocabulary-sharded logits (a DTensor "
                        f"{tuple(out.shape)}, {out.placements}): {type(e).__name__}: {e}; make it "
                        f"work on DTensors, or plan the output layer replicated") from e
    return _compact(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def _compact(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, or a copy of it where its storage is larger than its value: torch.pipelining keeps
    every micro-batch's loss until the step ends, and some losses are a scalar view of their
    elementwise buffer (CPU's mse_loss: 8 KiB behind a 4-byte loss, torch 2.13)."""
    if isinstance(loss, torch.Tensor) and loss.untyped_storage().nbytes() > loss.numel() * loss.element_size():
        return loss.clone()
    return loss


def get_submodule(root: nn.Module, fqn: str) -> nn.Module:
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        raise PlanError(f"the plan names layer {fqn!r}, which the model does not have") from None


class StageCore(nn.Module):
    """The layers of one pipeline chunk, kept at their original FQNs (so parameter names, plan
    placements and checkpoint keys match the full model), run in order."""

    def __init__(self, root: nn.Module, layers: Sequence[str], family: Family, is_last: bool) -> None:
        super().__init__()
        self.order = list(layers)
        self.family = family
        self.is_last = is_last
        self._mods: list[nn.Module] = []
        for fqn in self.order:
            mod = get_submodule(root, fqn)
            parent: nn.Module = self
            parts = fqn.split(".")
            for part in parts[:-1]:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(parts[-1], mod)
            self._mods.append(mod)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.order)
        for i, (fqn, mod) in enumerate(zip(self.order, self._mods)):
            x = mod(x)
            x = self.family.between(fqn, x, self.is_last and i == n - 1)
        return x


def is_repeated_block(fqn: str) -> bool:
    """Recomputation covers the repeated blocks (`blocks.3`), as in Megatron; the embedding and
    head run once (checkpointing a vocab-parallel embedding would also re-materialise its
    DTensor mask buffer, which torch refuses)."""
    return fqn.rsplit(".", 1)[-1].isdigit()


def apply_recompute(layer: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    target = layer
    if mode == "selective":
        for name in ("attn", "attention", "self_attn"):
            if isinstance(getattr(layer, name, None), nn.Module):
                target = getattr(layer, name)
                break
    orig = target.forward

    def fwd(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(orig, *args, use_reentrant=False, **kwargs)

    target.forward = fwd  # instance attribute: hooks (fully_shard) still run around __call__


def _quiet_view_output_warning() -> None:
    """Silence FSDP's warning that an `SPMDModule` root returns a view: its plain output (the
    local tensor of a replicated DTensor) is only sent on or fed to the loss by torch.pipelining,
    never modified in place, which is what the warning is about."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPSPMDModule\) returned a view",
                            category=UserWarning)


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
    kinds: tuple[str, ...]               # "dp" / "tp" per axis
    dp_mesh: Optional[DeviceMesh] = None
    tp_mesh: Optional[DeviceMesh] = None
    dp_size: int = 1
    tp_size: int = 1

    def submesh(self, kind: str) -> Optional[DeviceMesh]:
        names = tuple(n for n, k in zip(self.axis_names, self.kinds) if k == kind)
        if not names:
            return None
        if len(names) == 1:
            return self.mesh[names[0]]
        return self.mesh[names]._flatten(f"{kind}_flat")


def _coord(devices: Sequence[int], rank: int) -> int:
    return list(devices).index(rank)


def fsdp_sharded(plan: Plan, stages: Optional[Sequence[StagePlan]] = None) -> bool:
    """Whether `stages` (default: all the plan's) run under `fully_shard` (ZeRO-3, or a dp axis
    placed "S(0)") with more than one data-parallel replica."""
    stages = plan.stages if stages is None else stages
    if not stages or stages[0].axis_size("dp") <= 1:
        return False
    return plan.zero_stage == 3 or any(
        is_shard(pl[i]) for s in stages for pl in s.placements.values()
        for i, k in enumerate(s.mesh_axis_names) if k == "dp")


def _mesh_kinds(stages: Sequence[StagePlan]) -> set[tuple[tuple[int, ...], tuple[str, ...]]]:
    """The distinct (mesh_shape, mesh_axis_names) of `stages`."""
    return {(tuple(s.mesh_shape), tuple(s.mesh_axis_names)) for s in stages}


# ---------------------------------------------------------------------------------------------
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
            if a not in ("dp", "tp"):
                raise PlanError(f"stage {s.index}: mesh axis {a!r} is neither 'dp' nor 'tp'")
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
        aliases = canonical_names(model)
        covered = set()
        for s in stages:
            for fqn in s.layers:
                for n, _ in get_submodule(model, fqn).named_parameters(remove_duplicate=False):
                    covered.add(aliases.get(f"{fqn}.{n}", f"{fqn}.{n}"))
        missing = sorted(set(aliases.values()) - covered)
        if missing:
            raise PlanError(f"the plan's stages leave parameters out: {', '.join(missing[:5])}")
    solved = [s.index for s in stages if s.op_layouts is not None]
    if solved and (fsdp_sharded(plan, stages) or stages[0].axis_size("tp") < 2 or len(solved) < nst
                   or len(_mesh_kinds(stages)) > 1):
        raise PlanError(f"stage {solved[0]} carries op_layouts, which the runtime executes only for "
                        f"tensor-parallel stages of one mesh, every stage solved, without ZeRO-3; "
                        f"re-plan with `autopar plan`")
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


class ParallelModel:
    """One rank's share of a planned training job. Every rank of the job builds one (a
    collective). `step(batch)` takes the global batch and returns the loss (mean over it).
    The bundle's model (on meta) is materialised in place, this rank's layers only: build a
    fresh bundle for each ParallelModel."""

    def __init__(self, plan: Plan, bundle: ModelBundle, *, seed: int = 0,
                 optimizer_factory: Optional[OptimizerFactory] = None,
                 device: Optional[torch.device] = None) -> None:
        if not dist.is_initialized():
            raise PlanError("ParallelModel needs torch.distributed initialised (run under torchrun, "
                            "or use autopar.runtime.run which launches it)")
        self.plan = plan
        self.bundle = bundle
        self.seed = seed
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if self.world != plan.world_size:
            raise PlanError(f"the plan needs {plan.world_size} processes, this job has {self.world}")
        self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                 if torch.cuda.is_available() and dist.get_backend() == "nccl"
                                 else torch.device("cpu"))
        self.device_type = self.device.type
        self.low = low_dtype(plan.dtype)      # bf16/fp16 weights and gradients, fp32 masters
        self.opt_factory = optimizer_factory or default_optimizer
        register_extra_strategies()
        self.interleaved: dict[str, tuple[int, int]] = {}     # set by the executor's builds
        self.tp_group = None
        self.stages = sorted(plan.stages, key=lambda s: s.index)
        self._check_plan()
        self._build_meshes()
        self.model = bundle.model
        self.aliases = canonical_names(self.model)
        if self.pp == 1:
            self._build_single()
        else:
            self._build_pipeline()
        self._build_tied_groups()
        self._build_optimizer()
        self.steps_done = 0

    # -- plan checks ---------------------------------------------------------------------
    def _check_plan(self) -> None:
        v = validate_plan(self.plan, self.model if hasattr(self, "model") else self.bundle.model)
        self.devsets = v["devsets"]
        self.pp = len(self.devsets)
        self.chunks_per_device = v["chunks_per_device"]
        self.representatives = {ds[0] for ds in self.devsets}

    def _build_meshes(self) -> None:
        self.meshes: dict[tuple[int, ...], StageMesh] = {}
        for s in self.stages:
            key = tuple(s.devices)
            if key in self.meshes:
                continue
            names = unique_axis_names(s.mesh_axis_names)
            mesh = DeviceMesh(self.device_type, torch.tensor(s.devices, dtype=torch.int).view(*s.mesh_shape),
                              mesh_dim_names=names)
            sm = StageMesh(key, mesh, names, tuple(s.mesh_axis_names))
            sm.dp_size = s.axis_size("dp")
            sm.tp_size = s.axis_size("tp")
            if self.rank in key:
                sm.dp_mesh = sm.submesh("dp")
                sm.tp_mesh = sm.submesh("tp")
            self.meshes[key] = sm
        mine = [s for s in self.stages if self.rank in s.devices]
        if not mine:
            raise PlanError(f"rank {self.rank} is in no stage of the plan")
        self.my_stages = mine
        self.my_mesh = self.meshes[tuple(mine[0].devices)]
        self.coord = _coord(mine[0].devices, self.rank)
        sm = self.my_mesh
        self.dp_size, self.tp_size = sm.dp_size, sm.tp_size
        self.dp_rank = sm.dp_mesh.get_local_rank() if sm.dp_mesh is not None else 0
        self.tp_rank = sm.tp_mesh.get_local_rank() if sm.tp_mesh is not None else 0
        self.dp_group = sm.dp_mesh.get_group() if sm.dp_mesh is not None and self.dp_size > 1 else None
        self.zero3 = fsdp_sharded(self.plan, mine)
        self.zero12 = self.plan.zero_stage in (1, 2) and self.dp_size > 1 and not self.zero3

    def _tp_placements(self, s: StagePlan) -> dict[str, tuple[str, ...]]:
        idx = [i for i, k in enumerate(s.mesh_axis_names) if k == "tp"]
        out = {}
        for fqn, pl in s.placements.items():
            sel = tuple(pl[i] for i in idx)
            if len(idx) > 1:  # flattened tp axes: sharded only if every tp axis agrees
                sel = (sel[0],) if len(set(sel)) == 1 else ("R",)
            out[fqn] = sel
        return out

    # -- single stage (no pipeline) ------------------------------------------------------
    def _build_single(self) -> None:
        s = self.stages[0]
        model = self.model
        if s.op_layouts is not None:
            self._build_solved(s)
            return
        for fqn in s.layers:
            if is_repeated_block(fqn):
                apply_recompute(get_submodule(model, fqn), s.recompute)
        materialize(model, seed=self.seed, device=self.device, aliases=self.aliases)
        if self.tp_size > 1:
            distribute_params(model, self.my_mesh.tp_mesh, self._tp_placements(s), aliases=self.aliases,
                              src_data_rank=None)
        if self.zero3:
            self._fully_shard(model, s.fsdp_units or [])
        runner: nn.Module = model
        if self.tp_size > 1:
            runner = SPMDModule(model, self.my_mesh.tp_mesh, [None] * len(self.bundle.example_inputs))
        self.runner = runner
        self.local_modules = [model]
        self.pipe_stages = []
        self.schedule = None

    def _build_solved(self, s: StagePlan) -> None:
        """The stage run op by op as the plan solved it (`StagePlan.op_layouts`): the model's
        program (torch.export, with its loss: the capture the planner solved, so op names match)
        interpreted over DTensors on the tp sub-mesh, each op's inputs redistributed to the
        layouts its strategy reads (`autopar.intra_op.execute`). Data parallelism and ZeRO-1/2
        stay this engine's (flat gradient sync over the dp sub-mesh of the local shards)."""
        from autopar.intra_op.execute import parallelize_graph

        model = self.model
        materialize(model, seed=self.seed, device=self.device, aliases=self.aliases)
        example = self._real_microbatch()
        sol = s.op_layouts.solution((self.tp_size,))
        self.runner = parallelize_graph(model, example, sol, self.my_mesh.tp_mesh, param_dtype=self.low,
                                        recompute=s.op_layouts.recompute_regions())
        self._note_interleaved(self.runner.layouts)
        self.local_modules = [model]
        self.pipe_stages = []
        self.schedule = None

    def _note_interleaved(self, layouts: dict[str, tuple[int, int, int]]) -> None:
        """The parameters the executor holds chunk-interleaved over tp (`ShardedProgram.layouts`:
        fqn -> (dim, chunks, ways)), by canonical name: `full_state` and checkpoints see them in
        the model's row order (`runtime.interleaved`)."""
        self.interleaved = {self.aliases.get(f, f): (dim, chunks) for f, (dim, chunks, ways) in layouts.items()
                            if ways > 1}
        self.tp_group = self.my_mesh.tp_mesh.get_group() if self.interleaved else None

    def _real_microbatch(self) -> tuple:
        """One micro-batch of real inputs on this device (what torch.export traces the program with)."""
        mb = self.plan.microbatch_size
        if self.bundle.batch_fn is not None:
            batch = call_batch_fn(self.bundle.batch_fn, 0, mb, self.seed)
        else:
            batch = tuple(torch.zeros((mb,) + tuple(x.shape[1:]), dtype=x.dtype)
                          if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in self.bundle.example_inputs)
        return tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in batch)

    def _fully_shard(self, model: nn.Module, units: Sequence[str], root: Optional[nn.Module] = None) -> None:
        """ZeRO-3: `fully_shard` on the dp sub-mesh for each of the plan's `units` (modules of
        `model`, `StagePlan.fsdp_units`: the planner chose them from which ops read which
        parameter), then on `root` (default `model`; a module holding `model`) as the root unit,
        which keeps the other parameters (tied, read outside their module). A pipeline stage
        passes the module its PipelineStage holds as `root`: torch.pipelining drives FSDP
        (gradient sync and resharding on the last micro-batch only) only when the stage's module
        is the FSDP root, and with tp that is the SPMDModule around the stage's layers."""
        from torch.distributed.fsdp import fully_shard

        mesh = self.my_mesh.dp_mesh
        mp = {"mp_policy": fsdp_policy(self.low)} if self.low is not None else {}
        # with tp, parameters are already DTensors on the sibling tp sub-mesh: FSDP2 makes them
        # 2-D (Shard on dp, the planned placement on tp)
        for fqn in units:
            fully_shard(get_submodule(model, fqn), mesh=mesh, **mp)
        root = model if root is None else root
        if isinstance(root, SPMDModule):
            _quiet_view_output_warning()
        fully_shard(root, mesh=mesh, **mp)
        self._fsdp_root = root

    # -- pipeline ------------------------------------------------------------------------
    def _stage_shapes(self, mb: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Example (input, output) of every chunk for one micro-batch: shapes and dtypes from a
        run on fake tensors of this device type (no memory), under the plan's autocast, so a
        stage boundary that autocast makes bf16 gets bf16 send and receive buffers."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.func import functional_call

        ex = self.bundle.example_inputs[0]
        fam = self.family
        out = []
        nst = len(self.stages)
        with FakeTensorMode(), torch.no_grad(), self._autocast_ctx():
            x = torch.empty((mb,) + tuple(ex.shape[1:]), dtype=ex.dtype, device=self.device)
            for i, s in enumerate(self.stages):
                ins = x
                for j, fqn in enumerate(s.layers):
                    mod = get_submodule(self.model, fqn)
                    state = {n: torch.empty(t.shape, dtype=self._compute_dtype(t), device=self.device)
                             for n, t in mod.named_parameters()}
                    state.update({n: torch.empty(t.shape, dtype=t.dtype, device=self.device)
                                  for n, t in mod.named_buffers()})
                    x = functional_call(mod, state, (x,))
                    x = fam.between(fqn, x, i == nst - 1 and j == len(s.layers) - 1)
                out.append((ins, x))
        def meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.is_floating_point())
        return [(meta(a), meta(b)) for a, b in out]

    def _example_microbatch(self) -> tuple:
        """The model's inputs at the plan's micro-batch size, on meta (what the tracer needs)."""
        mb = self.plan.microbatch_size
        return tuple(torch.empty((mb,) + tuple(x.shape[1:]), dtype=x.dtype, device="meta")
                     if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                     for x in self.bundle.example_inputs)

    def _graph_shapes(self, chunks: list) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
        """`_stage_shapes` for traced chunks (`graph_stages.Chunk`): each run on fake tensors in
        order, under the plan's autocast, with autograd on so every boundary tensor says whether
        it needs a gradient; a chunk's inputs are what the previous one sends (the first
        chunk's, the first model input, what the schedule hands it)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.func import functional_call

        from autopar.runtime.graph_stages import FedChunk

        ex = self._example_microbatch()
        out = []
        with FakeTensorMode(allow_non_fake_inputs=True), self._autocast_ctx():
            inputs = [torch.empty(x.shape, dtype=x.dtype, device=self.device) if isinstance(x, torch.Tensor) else x
                      for x in ex]
            received: tuple = (inputs[0],)
            for ch in chunks:
                state = {n: torch.empty(t.shape, dtype=self._compute_dtype(t), device=self.device,
                                        requires_grad=t.is_floating_point())
                         for n, t in ch.module.named_parameters(remove_duplicate=False)}
                state.update({n: torch.empty(t.shape, dtype=t.dtype, device=self.device)
                              for n, t in ch.module.named_buffers(remove_duplicate=False)})

                def bound(*a: Any, gm: nn.Module = ch.module, st: dict = state) -> Any:
                    return functional_call(gm, st, a, tie_weights=False)

                y = FedChunk(bound, ch.sources, ch.sends).run(received, lambda k: inputs[k])
                sent = y if isinstance(y, tuple) else (y,)
                out.append((received, sent))
                received = tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                                 for t in sent)

        def meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
        return [(tuple(meta(a) for a in ins), tuple(meta(b) for b in outs)) for ins, outs in out]

    def _compute_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype parameter `p` computes in: the plan's low precision for floating ones."""
        return self.low if self.low is not None and p.is_floating_point() else p.dtype

    def _build_solved_pipeline(self) -> None:
        """A pipeline whose chunks run op by op as solved (every stage carries `op_layouts`):
        each of the rank's chunks a `ProgramChunk` of the model's program
        (`autopar.intra_op.pipeline_chunks`) on the stage's tp sub-mesh, held by a torch
        PipelineStage; only the parameters the rank's chunks read are materialised."""
        from autopar.intra_op.pipeline_chunks import parallelize_chunks

        self.family = None
        self.hetero = False
        self._build_pp_groups()
        mine = [i for i, s in enumerate(self.stages) if self.rank in s.devices]
        sol = _merged_solution([self.stages[i].op_layouts for i in mine], (self.tp_size,))
        chunk_ops = [[op for lay in s.op_layouts.layers for op in lay.ops] for s in self.stages]
        receives = [s.op_layouts.receives for s in self.stages]
        chunks, params = parallelize_chunks(
            self.model, self._real_microbatch(), sol, self.my_mesh.tp_mesh, chunk_ops, receives, mine,
            materialize=lambda own: materialize(self.model, seed=self.seed, device=self.device,
                                                aliases=self.aliases, only=own),
            aliases=self.aliases, device=self.device, autocast=self._autocast_ctx,
            compute_dtype=self._compute_dtype, param_dtype=self.low,
            recompute=[r for i in mine for r in self.stages[i].op_layouts.recompute_regions()])
        self.chunk_params = dict(enumerate(params))
        if chunks:
            self._note_interleaved(chunks[0].prog.layouts)
        self.pipe_stages, self.local_modules, self.fed_chunks = [], [], []
        for ch in chunks:
            self.fed_chunks.append(ch)
            self.pipe_stages.append(self._make_stage(ch, ch.index, *ch.examples))
            self.local_modules.append(ch.holder)
        self.runner = None
        self._make_schedule()

    def _build_pipeline(self) -> None:
        if self.stages[0].op_layouts is not None:
            self._build_solved_pipeline()
            return
        try:
            self.family: Optional[Family] = family_of(self.model)
        except PlanError:
            self.family = None        # cut from the traced model (`graph_stages`)
        nst = len(self.stages)
        covered = {}
        for s in self.stages:
            for fqn in s.layers:
                for n, _ in get_submodule(self.model, fqn).named_parameters(remove_duplicate=False):
                    covered[self.aliases.get(f"{fqn}.{n}", f"{fqn}.{n}")] = True
        missing = [n for n in set(self.aliases.values()) if n not in covered]
        if missing:
            raise PlanError(f"the plan's stages leave parameters out: {', '.join(sorted(missing)[:5])}")
        chunks = None
        if self.family is None:
            from autopar.runtime.graph_stages import split_model

            chunks = split_model(self.model, self._example_microbatch(), [s.layers[0] for s in self.stages[1:]],
                                 self.device, param_dtype=self.low)
        shapes = (self._graph_shapes(chunks) if chunks is not None
                  else self._stage_shapes(self.plan.microbatch_size))
        self.hetero = len(_mesh_kinds(self.stages)) > 1
        if self.hetero:
            self._build_replica_groups()
        else:
            self._build_pp_groups()
        self.pipe_stages = []
        self.local_modules = []
        self.fed_chunks = []
        self.chunk_params: dict[int, set[str]] = {}
        for i, s in enumerate(self.stages):
            if chunks is not None:
                self.chunk_params[i] = {self.aliases.get(n, n) for n, _ in
                                        chunks[i].module.named_parameters(remove_duplicate=False)}
            if self.rank not in s.devices:
                continue
            last = i == nst - 1
            core: nn.Module = (StageCore(self.model, s.layers, self.family, last) if chunks is None
                               else chunks[i].module)
            for fqn in s.layers:
                if is_repeated_block(fqn):
                    apply_recompute(get_submodule(core, fqn), s.recompute)
            materialize(core, seed=self.seed, device=self.device, aliases=self.aliases,
                        template=self.model if chunks is not None else None)
            if self.tp_size > 1:
                distribute_params(core, self.my_mesh.tp_mesh, self._tp_placements(s),
                                  aliases=self.aliases, src_data_rank=None)
            mod: nn.Module = core
            if self.tp_size > 1:
                # a traced last chunk computes the loss inside: vocabulary-parallel there
                mod = SPMDModule(core, self.my_mesh.tp_mesh, [None], loss_inside=chunks is not None and last,
                                 loss_output=chunks is None and last)
            if chunks is not None:
                from autopar.runtime.graph_stages import FedChunk

                mod = FedChunk(mod, chunks[i].sources, chunks[i].sends)
                self.fed_chunks.append(mod)
            if self.zero3:
                self._fully_shard(core, s.fsdp_units or [], root=mod)   # the FSDP root: what the stage holds
            self.pipe_stages.append(self._make_stage(mod, i, *shapes[i]))
            self.local_modules.append(core)
        self.runner = None
        self._make_schedule()

    def _build_pp_groups(self) -> None:
        """Equal stage meshes: one pipeline group per mesh coordinate, ranks in stage order."""
        ncoord = len(self.devsets[0])
        self.pp_group = None
        self.pp_group_ranks: list[int] = []
        for c in range(ncoord):
            ranks = [ds[c] for ds in self.devsets]
            g = dist.new_group(ranks)
            if self.rank in ranks:
                self.pp_group = g
                self.pp_group_ranks = ranks

    def _build_replica_groups(self) -> None:
        """Stage meshes of different tp degrees (`pipeline_p2p`): per data-parallel replica, the
        ranks of every stage (tp order) and one group holding them all for the point-to-point
        ops. On NCCL the group's communicator is created here, by every member: torch.pipelining
        would create it lazily inside a batch only some members join."""
        per_stage = [replica_ranks(s.devices, s.mesh_shape, s.mesh_axis_names) for s in self.stages]
        self.replica_stage_ranks: list[list[int]] = []
        self.pp_group = None
        for d in range(len(per_stage[0])):
            ranks = [st[d] for st in per_stage]
            members = sorted(r for rs in ranks for r in rs)
            g = None if len(members) == self.world else dist.new_group(members)
            if self.rank in members:
                self.replica_stage_ranks, self.pp_group = ranks, g
        if self.device_type == "cuda":
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.pp_group)

    def _make_stage(self, mod: nn.Module, i: int, ins: Any, outs: Any) -> Any:
        """The torch.pipelining stage of chunk `i` with static shapes from the meta run: `ins`
        and `outs` a tensor or a tuple of tensors (several cross a traced model's boundary);
        a received floating tensor gets a gradient to send back unless the sender's run said it
        needs none (`_graph_shapes`)."""
        from torch.distributed.pipelining import PipelineStage

        nst = len(self.stages)
        ins = ins if isinstance(ins, tuple) else (ins,)
        outs = outs if isinstance(outs, tuple) else (outs,)

        def example(t: torch.Tensor, grad: bool) -> torch.Tensor:
            x = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            return x.requires_grad_(True) if grad else x

        ex_in = tuple(example(t, t.requires_grad) for t in ins)
        ex_out = tuple(example(t, False) for t in outs)
        in_grad = tuple(torch.empty_like(x) if x.requires_grad and i > 0 else None for x in ex_in)
        out_grad = tuple(torch.empty_like(x) if t.requires_grad and i < nst - 1 else None for x, t in zip(ex_out, outs))
        for x, t in zip(ex_out, outs):
            x.requires_grad_(t.requires_grad)
        meta = dict(input_args=ex_in, output_args=ex_out, input_grads=in_grad, output_grads=out_grad)
        if self.hetero:
            return FanoutPipelineStage(mod, i, nst, self.device, ranks=self.replica_stage_ranks,
                                       group=self.pp_group, **meta)
        return PipelineStage(mod, i, nst, self.device, group=self.pp_group, **meta)

    def _make_schedule(self) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        M = self.plan.num_microbatches
        fam = self.family
        if fam is None:
            # a traced last chunk returns the loss itself
            loss_fn = lambda out, tgt: _compact(out.full_tensor() if isinstance(out, DTensor) else out)  # noqa: E731
        else:
            loss_fn = lambda out, tgt: stage_loss(fam, out, tgt)  # noqa: E731
        cls = torch_schedule(self.plan.schedule, self.pp, M, len(self.pipe_stages))
        if cls == "ScheduleInterleaved1F1B":
            if M % self.pp != 0:
                raise PlanError(f"interleaved 1F1B needs num_microbatches ({M}) to be a multiple of "
                                f"the pipeline depth ({self.pp})")
            sched = ScheduleInterleaved1F1B(self.pipe_stages, n_microbatches=M, loss_fn=loss_fn)
        elif cls == "ScheduleGPipe":
            # also 1F1B with fewer micro-batches than stages, which torch's 1F1B refuses: it
            # degenerates to GPipe (all forwards, then all backwards), same maths and transfers
            sched = ScheduleGPipe(self.pipe_stages[0], n_microbatches=M, loss_fn=loss_fn)
        else:
            sched = Schedule1F1B(self.pipe_stages[0], n_microbatches=M, loss_fn=loss_fn)
        self.schedule = sched
        if self.hetero:
            return  # FanoutPipelineStage finds its peers itself (one stage per rank)
        # stage i lives on group rank of devsets[i % pp][coord]
        sorted_ranks = sorted(self.pp_group_ranks)
        mapping = {i: sorted_ranks.index(self.pp_group_ranks[i % self.pp]) for i in range(len(self.stages))}
        if len(self.pipe_stages) > 1 and any(mapping[i] != i % self.pp for i in mapping):
            raise PlanError("interleaved pipelines need the stage device sets in increasing rank order "
                            f"(got {[list(d) for d in self.devsets]}); renumber the devices of the plan")
        sched.stage_index_to_group_rank = mapping
        for st in self.pipe_stages:
            st.stage_index_to_group_rank = mapping

    # -- tied parameters across stages ---------------------------------------------------
    def _build_tied_groups(self) -> None:
        """Parameters held by more than one stage device set: their gradients are summed over a
        group joining the copies (`tied_grads`): one per mesh coordinate when the holders hold
        them in one layout (equal meshes and placements), else one per data-parallel replica
        over all the holders' ranks (one over all replicas under ZeRO-3, whose replicas hold
        different shards)."""
        self.tied: list[FlatTiedSync | FullTiedSync] = []
        self.checkpoint_skip: set[str] = set()
        if self.pp == 1:
            return
        for dss, names in self._tied_sets().items():
            if self._same_layout(dss, names):
                groups = [[self.devsets[d][c] for d in dss] for c in range(len(self.devsets[dss[0]]))]
                sync = FlatTiedSync
            else:
                groups = self._full_tied_groups(dss)
                sync = FullTiedSync
                self._mark_checkpoint_skip(dss, names)
            for ranks in groups:
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    extra = {}
                    if sync is FullTiedSync and len(groups) == 1 and not self.zero3:
                        # one group over every dp replica (a ZeRO-3 holder): this stage's
                        # copy is the same dp-averaged tensor on each replica; count it once
                        extra["adds"] = self.dp_rank == 0
                    self.tied.append(sync(g, self._local_params(names), **extra))

    def _tied_sets(self) -> dict[tuple[int, ...], list[str]]:
        """{device-set indices holding them: canonical names} of the parameters held by more
        than one device set."""
        holders: dict[str, list[int]] = {}
        for si in range(len(self.stages)):
            for canon in self._stage_params(si):
                ds = si % self.pp
                if ds not in holders.setdefault(canon, []):
                    holders[canon].append(ds)
        bykey: dict[tuple[int, ...], list[str]] = {}
        for k, v in sorted(holders.items()):
            if len(v) > 1:
                bykey.setdefault(tuple(v), []).append(k)
        return bykey

    def _same_layout(self, dss: Sequence[int], names: Sequence[str]) -> bool:
        """Whether the device sets `dss` hold the parameters `names` in one layout: equal stage
        meshes and, for each parameter, equal placements in every holding stage (rank c of each
        then holds the same elements). A planner may place a tied embedding replicated on one
        stage and vocabulary-sharded on another of the same mesh."""
        if len(_mesh_kinds([self.stages[d] for d in dss])) != 1:
            return False
        return all(len({self._placement_of(s, n) for s in self._holders(dss, n)}) == 1 for n in names)

    def _holders(self, dss: Sequence[int], canon: str) -> list[StagePlan]:
        """The stages on device sets `dss` holding the parameter of canonical name `canon`."""
        return [s for si, s in enumerate(self.stages) if si % self.pp in dss and canon in self._stage_params(si)]

    def _stage_params(self, si: int) -> set[str]:
        """Canonical names of the parameters chunk `si` holds: a traced chunk's own (it holds a
        weight it reads outside the modules it runs, a tied head's), else its layers'."""
        if si in getattr(self, "chunk_params", {}):
            return self.chunk_params[si]
        return {self.aliases.get(f"{fqn}.{n}", f"{fqn}.{n}") for fqn in self.stages[si].layers
                for n, _ in get_submodule(self.model, fqn).named_parameters(remove_duplicate=False)}

    def _placement_of(self, s: StagePlan, canon: str) -> tuple[str, ...]:
        """Stage `s`'s placement of the parameter `canon` as `distribute_params` and FSDP read
        it: the canonical name's entry, else an alias's, else replicated."""
        pl = s.placements.get(canon)
        if pl is None:
            pl = next((v for k, v in s.placements.items() if self.aliases.get(k, k) == canon), None)
        return tuple(pl) if pl is not None else ("R",) * len(s.mesh_shape)

    def _full_tied_groups(self, dss: Sequence[int]) -> list[list[int]]:
        """Rank groups of a `FullTiedSync` across device sets `dss` of different meshes."""
        per = [replica_ranks(self.stages[d].devices, self.stages[d].mesh_shape, self.stages[d].mesh_axis_names)
               for d in dss]
        if fsdp_sharded(self.plan, [self.stages[d] for d in dss]):
            return [sorted(r for st in per for rs in st for r in rs)]
        return [sorted(r for st in per for r in st[rep]) for rep in range(len(per[0]))]

    def _mark_checkpoint_skip(self, dss: Sequence[int], names: Sequence[str]) -> None:
        """Tied copies in different layouts are saved once, by the first holder (DCP refuses a
        key that one rank saves whole and another sharded); every copy still loads it."""
        if any(self.rank in self.devsets[d] for d in dss[1:]):
            self.checkpoint_skip.update(names)

    def _local_params(self, names: Sequence[str]) -> list[nn.Parameter]:
        """This rank's parameters with canonical names in `names`, each once."""
        params: list[nn.Parameter] = []
        for core in self.local_modules:
            for n, p in core.named_parameters(remove_duplicate=False):
                if self.aliases.get(n, n) in names and all(p is not q for q in params):
                    params.append(p)
        return params

    # -- optimizer -----------------------------------------------------------------------
    def local_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(canonical FQN, parameter) of this rank, each parameter once."""
        out, seen = [], set()
        for core in self.local_modules:
            for n, p in core.named_parameters(remove_duplicate=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                out.append((self.aliases.get(n, n), p))
        return out

    def _build_optimizer(self) -> None:
        """The optimizer over this rank's parameters; under mixed precision over fp32 masters
        (`precision`): ZeRO 0 `MasterWeights`, ZeRO-1/2 the flat fp32 shard, ZeRO-3 FSDP's fp32
        shards. The masters are taken from the fp32 initial values, then the parameters cast."""
        self.params = [p for _, p in self.local_named_parameters()]
        self.masters: Optional[MasterWeights] = None
        if self.zero12:
            self._zero12_setup()
        elif self.low is not None and not self.zero3:
            self.masters = MasterWeights(self.params)
            self.optimizer = self.opt_factory(self.masters.masters)
        else:
            self.optimizer = self.opt_factory(self.params)
        if self.low is not None and not self.zero3:
            cast_parameters_(self.params, self.low)

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def _zero12_setup(self) -> None:
        D = self.dp_size
        locs = [self._local(p.data) for p in self.params]
        n = sum(t.numel() for t in locs)
        self.flat_numel = n
        self.shard_size = math.ceil(n / D)
        flat = torch.zeros(self.shard_size * D, dtype=locs[0].dtype, device=self.device)
        torch.cat([t.reshape(-1) for t in locs], out=flat[:n])
        lo = self.dp_rank * self.shard_size
        self.flat_shard = nn.Parameter(flat[lo:lo + self.shard_size].clone())
        self.optimizer = self.opt_factory([self.flat_shard])

    # -- step ----------------------------------------------------------------------------
    def local_batch(self, batch: Sequence[Any]) -> "LocalBatch":
        """This rank's share of the global `batch`, as the step keeps it: its dp replica's rows of
        every batched input, copied onto the device (so the global batch can be dropped: a CPU
        slice would be a view holding all of it), and in a pipeline only what the rank's stages
        read (the first input on the first stage, the targets on the last; `None` elsewhere), as
        the planner counts (`inter_op.search`, the batch a stage holds). Idempotent: a
        `LocalBatch` is returned as is. Callers that keep the global batch alive through the
        step hold it too; `worker.train` passes the local one."""
        if isinstance(batch, LocalBatch):
            return batch
        G = self.plan.global_batch_size
        D = self.dp_size
        first = self.pp == 1 or any(st.is_first for st in self.pipe_stages)
        last = self.pp == 1 or any(st.is_last for st in self.pipe_stages)
        fed = set().union(*(f.model_inputs for f in getattr(self, "fed_chunks", [])))
        out = []
        for i, x in enumerate(batch):
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                if x.shape[0] != G:
                    raise PlanError(f"the batch has {x.shape[0]} rows, the plan's global batch size is {G}")
                needed = (i == 0 and first) or i in fed if getattr(self, "fed_chunks", None) else (
                    first if i == 0 else last)
                if not needed:
                    x = None
                else:
                    rows = G // D
                    x = x.narrow(0, self.dp_rank * rows, rows).to(self.device, copy=True)
            out.append(x)
        return LocalBatch(out)

    def step(self, batch: Sequence[Any]) -> float:
        """One training iteration on the global `batch`; returns the mean loss over it (on every
        rank)."""
        return self.reduce_loss(self.train_step(batch))

    @property
    def collectives_in_compute(self) -> bool:
        """Whether forward/backward can issue collectives (DTensor tp, FSDP, pipelines); when
        not, every collective of a step is in `sync_and_update`."""
        return self.tp_size > 1 or self.zero3 or self.pp > 1

    def train_step(self, batch: Sequence[Any], counter: Any = None) -> tuple[float, int]:
        """Forward, backward, gradient sync and optimizer update; returns this rank's (sum of
        reported micro-batch losses, their number). No communication beyond the plan's.
        `counter` (a CollectiveCounter) is active wherever collectives can run: the whole step,
        or only the gradient sync when forward/backward cannot communicate (its per-op cost then
        stays out of the compute)."""
        if counter is not None and self.collectives_in_compute:
            with counter:
                loss_sum, n = self.forward_backward(batch)
                self.sync_and_update()
        else:
            loss_sum, n = self.forward_backward(batch)
            self.sync_and_update(counter)
        self.steps_done += 1
        return loss_sum, n

    def reduce_loss(self, local: tuple[float, int]) -> float:
        """Mean loss over the global batch from every rank's `train_step` result (a collective)."""
        t = torch.tensor([local[0], float(local[1])], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)  # on the device: NCCL reduces device tensors only
        t = t.cpu()
        return float(t[0] / t[1]) if t[1] > 0 else float("nan")

    def _autocast_ctx(self) -> Any:
        """Autocast to the plan's bf16/fp16 (norms, softmax and the loss in fp32), else nothing."""
        if self.low is None:
            return _nullctx()
        return torch.autocast(self.device_type, dtype=self.low)

    def forward_backward(self, batch: Sequence[Any]) -> tuple[float, int]:
        """Returns (sum of micro-batch losses this rank reports, their number)."""
        local = self.local_batch(batch)
        M = self.plan.num_microbatches
        reporter_tp = self.tp_rank == 0
        ctx = self._autocast_ctx()
        if self.pp == 1:
            allow_implicit_replication()
            total = 0.0
            mbs = [torch.tensor_split(x, M) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * M
                   for x in local]
            for m in range(M):
                if self.zero3 and M > 1:
                    self._fsdp_root.set_requires_gradient_sync(m == M - 1)
                args = [mb[m] for mb in mbs]
                with ctx:
                    loss = self.runner(*args)
                (loss / M).backward()
                total += float(loss.detach())
            return (total if reporter_tp else 0.0), (M if reporter_tp else 0)
        # pipeline
        is_first = any(st.is_first for st in self.pipe_stages)
        is_last = any(st.is_last for st in self.pipe_stages)
        inputs, targets = local[0], local[1:] if len(local) > 1 else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        for fed in self.fed_chunks:
            fed.start_step(local, M)
        if is_last:
            if self.fed_chunks:
                # the traced chunk reads its targets itself; the schedule only needs M of them
                kwargs["target"] = torch.zeros(M, device=self.device)
            else:
                kwargs["target"] = targets[0] if len(targets) == 1 else targets
            kwargs["losses"] = losses
        with ctx:
            # return_outputs=False: the last stage would otherwise keep every micro-batch's
            # output (the logits) until the step ends, which no plan counts
            if is_first:
                self.schedule.step(inputs, return_outputs=False, **kwargs)
            else:
                self.schedule.step(return_outputs=False, **kwargs)
        if is_last and reporter_tp:
            return float(sum(float(l.detach()) for l in losses)), len(losses)
        return 0.0, 0

    def sync_and_update(self, counter: Any = None) -> None:
        """Gradient sync (the plan's collectives) then the optimizer update. `counter`, when
        given, is active around the sync only (the update issues no collectives, except ZeRO-1/2's
        all-gather, which sits inside the sync there)."""
        with (counter if counter is not None else _nullctx()):
            grads_to_param_layout(self.params)
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if self.zero12:
                self._zero12_step()
            else:
                if self.dp_group is not None and not self.zero3:
                    allreduce_flat([self._local(p.grad) for p in self.params], self.dp_group,
                                   1.0 / self.dp_size)
                for t in self.tied:
                    t.sync()
        if self.masters is not None:
            self.masters.step(self.optimizer)
        elif not self.zero12:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def _zero12_step(self) -> None:
        """Tied copies first (sum), then reduce-scatter over dp, sharded update, all-gather.
        Each gradient is freed as soon as it is copied into the flat buffer, and each buffer as
        soon as it is used, so the sync holds one gradient-sized buffer at a time beside the
        weights (`cost_models.memory.runtime_phases` counts exactly these)."""
        for t in self.tied:
            t.sync()
        D, S, n = self.dp_size, self.shard_size, self.flat_numel
        dtype = self._local(self.params[0].grad).dtype
        flat = torch.empty(S * D, dtype=dtype, device=self.device)
        flat[n:].zero_()
        off = 0
        for p in self.params:
            g = self._local(p.grad)
            flat[off:off + g.numel()].copy_(g.reshape(-1))
            off += g.numel()
            p.grad = None
        shard = torch.empty(S, dtype=flat.dtype, device=self.device)
        reduce_scatter_flat(shard, flat, group=self.dp_group)
        del flat
        shard.mul_(1.0 / D)
        self.flat_shard.grad = shard.to(self.flat_shard.dtype)   # the fp32 master shard's
        del shard
        self.optimizer.step()
        self.flat_shard.grad = None
        full = torch.empty(S * D, dtype=dtype, device=self.device)   # the parameters' dtype
        all_gather_flat(full, self.flat_shard.data.to(full.dtype), group=self.dp_group)
        off = 0
        with torch.no_grad():
            for p in self.params:
                loc = self._local(p.data)
                loc.copy_(full[off:off + loc.numel()].view_as(loc))
                off += loc.numel()

    def model_state_bytes(self) -> int:
        """Bytes of this rank's parameters, fp32 masters (mixed precision) or flat optimizer
        shard (ZeRO-1/2), and optimizer state (local shards)."""
        n = 0
        seen = set()
        for p in self.params + (self.masters.masters if self.masters is not None else []) + (
                [self.flat_shard] if self.zero12 else []):
            n += self._local(p.data).numel() * p.element_size()
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and id(v) not in seen:
                    seen.add(id(v))
                    n += self._local(v).numel() * v.element_size()
        return n

    # -- views ---------------------------------------------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """Full parameter values by canonical FQN, gathered (a collective when sharded). For
        tests and export; every rank gets the parameters it holds."""
        from torch.distributed.tensor import DTensor

        from autopar.intra_op.execute import deinterleave

        out = {}
        for n, p in self.local_named_parameters():
            t = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            if n in self.interleaved:
                t = deinterleave(t, *self.interleaved[n], self.tp_size)
            out[n] = t
        return out


def _merged_solution(layouts: Sequence[Any], mesh_shape: tuple[int, ...]) -> Any:
    """One ShardingSolution of several chunks' `StageLayouts` (a rank's interleaved chunks): a
    parameter two of them read must be stored in one layout."""
    sols = [lay.solution(mesh_shape) for lay in layouts]
    out = sols[0]
    for s in sols[1:]:
        for fqn, pl in s.param_placements.items():
            if out.param_placements.setdefault(fqn, pl) != pl:
                raise PlanError(f"{fqn} is read in two layouts by chunks of one rank "
                                f"({out.param_placements[fqn]} and {pl}); re-plan with `autopar plan`")
        out.op_choices.update(s.op_choices)
        out.input_placements.update(s.input_placements)
        out.junctions.update(s.junctions)
        out.param_layouts.update(s.param_layouts)
    return out


class LocalBatch(tuple):
    """A rank's share of a step's batch (`ParallelModel.local_batch`); `train_step` and `step`
    take it or the global batch."""


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
