"""Executing a Plan on this rank: meshes, stage modules, data/tensor/pipeline parallelism, ZeRO,
recomputation and the optimizer. `ParallelModel.step(batch)` runs one training iteration on the
*global* batch (every rank passes the same global batch; each takes its rows).

`ParallelModel` (here: its build, the step, the optimizer and precision) composes one module
per concern: `pipeline.PipelineStages` (stages, groups, schedule), `tied_groups.TiedParameters`
(parameters held by several stages), `zero.ZeroSharding` (FSDP2 units, ZeRO-1/2's flat shards);
beside them `meshes` (stage meshes), `validate` (the plan checks), `graph_stages` (pipeline
chunks cut from the traced model, for any model), `recompute` (checkpointing of module-cut
stages), and the executor for stages run op by op as solved (`autopar.intra_op.execute`, `intra_op.pipeline_chunks`).

How each part of the plan is executed:

* Stage meshes: one `DeviceMesh` per distinct stage device set (`mesh_shape`,
  `mesh_axis_names`), created on every rank in stage order.
* "tp" axes: one executor (issue 20). Every tp stage carries its solved per-op layouts
  (`op_layouts`: the planner's, from the intra-op ILP, or for the analytic rules solved with
  their placements pinned, `inter_op.pinned_layouts`; stages of one tp degree or several): the
  model's exported program runs op by op as solved on the tp sub-mesh (`intra_op.execute`; a
  pipeline's chunks cut from it, `intra_op.pipeline_chunks`); under ZeRO-3 FSDP2 shards its
  tp DTensors over dp, each unit's ops one call of an FSDP forward method of its module
  (`zero.ZeroSharding._shard_solved`, `_shard_solved_chunks`). A tp stage without layouts is
  refused (`validate`); nothing here knows a model class or matches a module's name.
* "dp" axes: the batch is split by rows; gradients are averaged over the dp group after the
  backward in one flat all-reduce per stage (zero_stage 0), one flat reduce-scatter + sharded
  AdamW + one all-gather of the updated parameters (zero_stage 1 and 2: optimizer state, and the
  gradients once reduced, live sharded), or `fully_shard` on the dp sub-mesh per layer
  (zero_stage 3, or any "S(0)" on a dp axis), rooted at the module a pipeline stage holds (a
  stage run as solved: at its program, `ShardedProgram`, or pipeline chunk, `ProgramChunk`).
* Pipelines (more than one distinct device set): `torch.distributed.pipelining.PipelineStage`
  per chunk, holding only its layers under their original FQNs; schedule from the plan (gpipe,
  1f1b, interleaved_1f1b). The loss is computed on the last stage. Parameters tied across stages
  (GPT's embedding and output weight) live on both stages and their gradients are summed over a
  group joining the two copies (Megatron's embedding group; `tied_grads`).
* Stages of different tp degrees (Alpa's free sub-mesh per stage, one dp degree):
  `pipeline_p2p.FanoutPipelineStage`; every rank of a stage runs the schedule, each receives
  every transfer once from one rank of the neighbour (so a rank may send to several ranks of a
  wider neighbour); run as solved, tensors cross such a boundary replicated (the sender
  redistributes first, `intra_op.pipeline_chunks`). Interleaving still needs equal stage meshes.
* Recompute: `torch.utils.checkpoint` (non-reentrant) around each layer ("full"); under
  "selective" each layer's attention core alone, under torch's selective checkpoint
  (`selective`: the plan's `recompute_ops` MUST_RECOMPUTE, the rest saved); under "attention"
  the module holding each attention core (the plan's `recompute_modules`), checkpointed whole;
  under "norm_act" the norms' and expert activations' outputs freed once saved and re-made in
  the backward (`discard`, Megatron-Core's output-discarding recomputation).
* Precision (`precision`): bf16/fp16 plans keep 2-byte parameters and gradients (synced in the
  2-byte dtype) and step fp32 masters, as the planner's memory and communication model
  (ZeRO-3: FSDP's fp32 shards are the masters, gathered and reduced in the 2-byte dtype);
  forward and loss run under `torch.autocast` on the device type.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.models.registry import ModelBundle, call_batch_fn
from autopar.runtime import context_parallel
from autopar.runtime.context_parallel import ContextParallel
from autopar.runtime.experts import ExpertGroups, check_executable, expert_meshes, program_calls, shard_experts
from autopar.runtime.local_optim import LocalShards, localize
from autopar.runtime.materialize import canonical_names, materialize
from autopar.runtime.meshes import StageMesh, _coord, _mesh_kinds, fsdp_sharded, unique_axis_names  # noqa: F401
from autopar.runtime.pipeline import PipelineStages
from autopar.runtime.precision import MasterWeights, cast_parameters_, low_dtype
from autopar.runtime.recompute import apply_stage_recompute
from autopar.runtime.spmd import allow_implicit_replication, grads_to_param_layout, register_extra_strategies
from autopar.runtime.tied_grads import allreduce_flat, gloo_memory_exact
from autopar.runtime.tied_groups import TiedParameters
from autopar.runtime.validate import validate_plan  # noqa: F401
from autopar.runtime.zero import ZeroSharding
from autopar.schema.errors import PlanError
from autopar.schema.mesh_axes import GRADIENT_SYNC_KINDS
from autopar.schema.plan import Plan, StagePlan

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: list[nn.Parameter], fused: Optional[bool] = None) -> torch.optim.Optimizer:
    """AdamW, lr 1e-3 (torch defaults otherwise). On CUDA the fused kernel, one parameter group per
    device mesh (DTensors of different meshes never meet in one kernel): GPT-3 1.3B's 292 tensors
    step in 16.6 ms on an H100 against 41 ms one tensor at a time, with no temporaries
    (`benchmarks/gpu_step.py optimizer`). Elsewhere one tensor at a time (foreach off): the same
    kernels as one process, and no multi-tensor temporaries. `fused` forces the choice (verify
    steps a GPU plan's program on CPU with the GPU's optimizer; the memory model follows
    `cost_models.memory.fused_optimizer`)."""
    params = list(params)
    if fused is None:
        fused = bool(params) and all(p.is_cuda for p in params)
    if fused:
        groups: dict[Any, list[nn.Parameter]] = {}
        for p in params:
            mesh = getattr(p, "device_mesh", None)
            groups.setdefault(id(mesh) if mesh is not None else None, []).append(p)
        return torch.optim.AdamW([{"params": g} for g in groups.values()], lr=1e-3, fused=True)
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


class _InputsReordered(nn.Module):
    """`inner` fed the model inputs it reads, in its order (`order`: their indices)."""

    def __init__(self, inner: nn.Module, order: list[int]) -> None:
        super().__init__()
        self.inner, self.order = inner, order

    def forward(self, *inputs: Any) -> Any:
        return self.inner(*(inputs[i] for i in self.order))


class ParallelModel(PipelineStages, TiedParameters, ZeroSharding):
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
        self.expert_groups: Optional[ExpertGroups] = None       # expert parallelism (`runtime.experts`)
        self.fsdp_scalars: list[nn.Parameter] = []             # ZeRO-3's 0-D parameters (`zero`)
        self.tp_group = None
        self.stages = sorted(plan.stages, key=lambda s: s.index)
        self._check_plan()
        with unset_fake_temporarily():   # meshes hold rank ids: real tensors even when the step is fake (verify)
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
        check_executable(self.plan)
        context_parallel.check_executable(self.plan)
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
            # the ranks holding the same parameter shards: they sync gradients and share ZeRO's
            # shards (data- and context-parallel ranks alike)
            sm.dp_size = s.axis_size("dp") * s.axis_size("cp")
            sm.tp_size = s.axis_size("tp")
            # a flattened submesh (dp x cp, or several tp axes: a new process group) is made by
            # every rank, for every stage, in one order: group creation is collective over the
            # world, so a pipeline's stages must not each make only their own (it hung
            # pp2 x dp2 x cp2, and pp2 x cp2 while a size-1 dp axis was flattened with cp)
            member = self.rank in key
            sync = sm.submesh(GRADIENT_SYNC_KINDS, member) if sm.flattens(GRADIENT_SYNC_KINDS) else None
            tp = sm.submesh("tp", member) if sm.flattens("tp") else None
            if member:
                sm.dp_mesh = sync if sync is not None else sm.submesh(GRADIENT_SYNC_KINDS)
                sm.tp_mesh = tp if tp is not None else sm.submesh("tp")
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
        # the batch split: its rows over the dp axes alone, every sequence over the cp axes
        # (`runtime.context_parallel`); the gradient sync above spans both
        s0 = mine[0]
        self.batch_split, self.batch_rank = s0.axis_size("dp"), 0
        self.cp: Optional[ContextParallel] = None
        if s0.axis_size("cp") > 1:
            rows = sm.submesh("dp")
            self.batch_rank = rows.get_local_rank() if rows is not None else 0
            cpm = sm.submesh("cp")
            self.cp = ContextParallel(cpm.get_group(), cpm.get_local_rank(), s0.axis_size("cp"),
                                      self.plan.model.tokens_per_sample)
        else:
            self.batch_rank = self.dp_rank
        self.zero3 = fsdp_sharded(self.plan, mine)
        self.zero12 = self.plan.zero_stage in (1, 2) and self.dp_size > 1 and not self.zero3

    # -- single stage (no pipeline) ------------------------------------------------------
    def _build_single(self) -> None:
        s = self.stages[0]
        model = self.model
        if s.op_layouts is not None:
            self._build_solved(s)
            return
        order: Optional[list[int]] = None
        if self.cp is not None:
            model, order = self._own_positions_program(model)
            # before recomputation wraps its modules (`ContextParallel.install`); a traced program
            # holds the positions op (`adopt_positions` checked: its fake kernel reads none)
            self.cp.install(model, check=model is self.model)
        apply_stage_recompute(model, s)
        materialize(model, seed=self.seed, device=self.device, aliases=self.aliases,
                    template=self.model if model is not self.model else None)
        if self.plan.ep > 1:
            self._shard_experts(model)
        if self.zero3:
            self._fully_shard(model, s.fsdp_units or [])
        runner: nn.Module = model
        if order is not None:
            runner = _InputsReordered(runner, order)
        self.runner = runner
        self.local_modules = [model]
        self.pipe_stages = []
        self.schedule = None

    def _own_positions_program(self, model: nn.Module) -> tuple[nn.Module, Optional[list[int]]]:
        """(the module a context-parallel stage runs, the model inputs its forward takes in
        order or None for all of them as given): the model itself where its forward reads its
        positions from `models.positions.token_positions` (a forward on meta tells); else, a
        model that makes its own (a Hugging Face model wrapped by its user), its program traced
        at the rank's tokens as one chunk (`graph_stages.split_model`: a GraphModule calling
        the model's submodules under their FQNs, so recomputation, FSDP units and checkpoints
        address it as the model) with its positions `arange`s the op that reads the rank's and
        the inputs it shifts itself shifted on the whole sequence
        (`ContextParallel.adopt_positions`). Expert parallelism there is refused."""
        from autopar.capture.own_positions import reads_positions, widened
        from autopar.models.positions import traced_positions
        from autopar.runtime.graph_stages import split_model

        local = self._example_microbatch()
        try:
            with traced_positions():
                chunk = split_model(model, local, [], self.device, param_dtype=self.low)[0]
        except PlanError as e:
            # not traceable: its own forward runs, refused at the first one where it reads no
            # positions (`ContextParallel.install`)
            log.info("context parallelism: %s could not be traced at a rank's tokens (%s); its own forward "
                     "runs", type(model).__name__, e)
            return model, None
        if reads_positions(chunk.module):
            return model, None
        if self.plan.ep > 1:
            raise PlanError("context parallelism with expert parallelism needs a model that takes its token "
                            "positions from autopar.models.positions.token_positions; this one makes its own: "
                            "re-plan with ep=1 or cp=1")
        if any(kind != "input" for kind, _ in chunk.sources):
            raise PlanError(f"the traced program of {type(model).__name__} reads {chunk.sources}, not the model's "
                            f"inputs alone: re-plan with cp=1")
        holders = [n.name for n in chunk.module.graph.nodes if n.op == "placeholder"]
        size = self.cp.seq // self.cp.size

        def whole(s: int) -> nn.Module:
            with traced_positions():
                return split_model(model, widened(local, size, s), [], self.device, param_dtype=self.low)[0].module

        self.cp.adopt_positions(chunk.module, whole, {h: i for h, (_, i) in zip(holders, chunk.sources)})
        order = [i for _, i in chunk.sources]
        return chunk.module, (None if order == list(range(len(local))) else order)

    def _shard_experts(self, module: nn.Module, only: Optional[Callable[[str], bool]] = None,
                       template: Optional[nn.Module] = None) -> None:
        """Expert parallelism (`runtime.experts`) on `module` (the model, or a pipeline chunk of
        this rank's stage): its experts modules replaced, their slices added to `expert_groups`
        (`only`: the blocks that are this rank's; `template`: the model on meta, whose experts
        modules run in a traced chunk's place, `shard_experts`). The meshes of every stage
        are built on the first call (collective)."""
        with unset_fake_temporarily():   # the meshes hold rank ids (as `_build_meshes`)
            if not hasattr(self, "_expert_meshes"):
                self._expert_meshes = expert_meshes(self.plan, self.device_type)
            mesh = self._expert_meshes[tuple(self.my_stages[0].devices)]
            self.expert_groups = shard_experts(module, self.plan, mesh, self.expert_groups, only, template)

    def _build_solved(self, s: StagePlan) -> None:
        """The stage run op by op as the plan solved it (`StagePlan.op_layouts`): the model's
        program (torch.export, with its loss: the capture the planner solved, so op names match)
        interpreted over DTensors on the tp sub-mesh, each op's inputs redistributed to the
        layouts its strategy reads (`autopar.intra_op.execute`). Data parallelism and ZeRO-1/2
        stay this engine's (flat gradient sync over the dp sub-mesh of the local shards);
        ZeRO-3 is FSDP2 over the dp sub-mesh on the executor's tp DTensors, each unit's ops one
        FSDP forward call (`zero.ZeroSharding._shard_solved`)."""
        from autopar.intra_op.execute import parallelize_graph

        model = self.model
        materialize(model, seed=self.seed, device=self.device, aliases=self.aliases)
        example = self._real_microbatch()
        # context parallelism: the program of this rank's tokens, its attention over every cp
        # rank's keys and values (`context_parallel.ProgramContext`)
        context = self.cp.program() if self.cp is not None else None
        sol = s.op_layouts.solution((self.tp_size,))
        self.runner = parallelize_graph(model, example, sol, self.my_mesh.tp_mesh, param_dtype=self.low,
                                        recompute=s.op_layouts.recompute_regions(), context=context,
                                        discard=s.op_layouts.discard_regions())
        self._note_interleaved(self.runner.layouts)
        if self.plan.ep > 1:
            # expert parallelism: each expert block's ops run as this rank's token exchange over
            # its ep group and its slice of the experts (`runtime.experts.program_calls`)
            self._shard_experts(model)
            self.runner.replace_modules(program_calls(model, self.plan))
            if s.recompute == "norm_act" and s.recompute_acts:
                # the experts' ops no longer run as the program's: their activations are
                # discarded by the experts modules themselves, as on a module-cut stage
                from autopar.runtime.discard import apply_discard

                apply_discard(model, None, s.recompute_acts)
        if self.zero3:
            self._shard_solved(self.runner, s.fsdp_units or [])
        self.local_modules = [model]
        self.pipe_stages = []
        self.schedule = None

    def programs_traced_on_meta(self) -> list[str]:
        """Why this rank's solved programs were traced on the meta device rather than for the
        device the rank computes on (`execute.meta_program`, `fitting_program`): a model
        branching on its device then runs the meta device's branch. Empty where each was traced
        for its device, or nothing runs op by op."""
        progs = [self.runner.program] if getattr(self.runner, "program", None) is not None else []
        progs += [ch.prog.program for ch in getattr(self, "fed_chunks", []) if getattr(ch, "prog", None) is not None]
        out = []
        for prog in progs:
            if getattr(prog, "autopar_traced_device", None) is None:
                out.append(getattr(prog, "autopar_trace_fallback", None)
                           or "its program for the device does not fit the plan's solution (see the log)")
        return sorted(set(out))

    def _note_interleaved(self, layouts: dict[str, tuple[int, int, int]]) -> None:
        """The parameters the executor holds chunk-interleaved over tp (`ShardedProgram.layouts`:
        fqn -> (dim, chunks, ways)), by canonical name: `full_state` and checkpoints see them in
        the model's row order (`runtime.interleaved`)."""
        self.interleaved = {self.aliases.get(f, f): (dim, chunks) for f, (dim, chunks, ways) in layouts.items()
                            if ways > 1}
        self.tp_group = self.my_mesh.tp_mesh.get_group() if self.interleaved else None

    def _real_microbatch(self) -> tuple:
        """One micro-batch of real inputs on this device (what torch.export traces the program
        with); under context parallelism this rank's tokens of it."""
        mb = self.plan.microbatch_size
        if self.bundle.batch_fn is not None:
            batch = call_batch_fn(self.bundle.batch_fn, 0, mb, self.seed)
        else:
            batch = tuple(torch.zeros((mb,) + tuple(x.shape[1:]), dtype=x.dtype)
                          if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in self.bundle.example_inputs)
        if self.cp is not None:
            batch = tuple(self.cp.local_tokens(x) if isinstance(x, torch.Tensor) else x for x in batch)
        return tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in batch)


    # -- pipeline ------------------------------------------------------------------------


    def _compute_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype parameter `p` computes in: the plan's low precision for floating ones."""
        return self.low if self.low is not None and p.is_floating_point() else p.dtype


    # -- tied parameters across stages ---------------------------------------------------


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
        shards, and fp32 masters for expert weights FSDP leaves alone). The masters are taken
        from the fp32 initial values, then the parameters cast."""
        self.params = [p for _, p in self.local_named_parameters()]
        self.masters: Optional[MasterWeights] = None
        self.local_shards: Optional[LocalShards] = None
        eg = self.expert_groups
        # ZeRO-3 with one copy of each expert (ep = dp): FSDP leaves the expert weights alone
        # (`ExpertGroups.fully_shard`); under mixed precision they get fp32 masters as ZeRO 0's
        loose = list(eg.params) if self.zero3 and self.low is not None and eg is not None and not eg.fsdp else []
        # ZeRO-3's 0-D parameters, which FSDP leaves alone too (`zero.ZeroSharding._fully_shard`)
        if self.zero3 and self.low is not None:
            loose += self.fsdp_scalars
        if self.zero12:
            self._zero12_setup()
        else:
            if self.low is not None and not self.zero3:
                self.masters = MasterWeights(self.params)
                self.optimizer = self.opt_factory(self.masters.masters)
            elif loose:
                self.masters = MasterWeights(loose)
                own = {id(p) for p in loose}
                self.optimizer = self.opt_factory([p for p in self.params if id(p) not in own] + self.masters.masters)
            else:
                self.optimizer = self.opt_factory(self.params)
            if not self.zero3:
                # an element-wise optimizer steps the DTensors' local shards (`local_optim`);
                # FSDP2's sharded parameters (ZeRO-3) are left to FSDP
                self.local_shards = localize(self.optimizer, self.masters.masters if self.masters else self.params)
                if self.local_shards is not None:
                    self.optimizer = self.local_shards.optimizer
        if self.low is not None and not self.zero3:
            cast_parameters_(self.params, self.low)
        elif loose:
            cast_parameters_(loose, self.low)

    def _local(self, t: torch.Tensor) -> torch.Tensor:

        return t.to_local() if isinstance(t, DTensor) else t


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
        D = self.batch_split
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
                    x = x.narrow(0, self.batch_rank * rows, rows)
                    if self.cp is not None:
                        x = self.cp.split_input(i, x)
                    x = x.to(self.device, copy=True)
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
        return self.tp_size > 1 or self.zero3 or self.pp > 1 or self.plan.ep > 1 or self.cp is not None

    def train_step(self, batch: Sequence[Any], counter: Any = None, exact_memory: bool = True) -> tuple[float, int]:
        """Forward, backward, gradient sync and optimizer update; returns this rank's (sum of
        reported micro-batch losses, their number). No communication beyond the plan's.
        `counter` (a CollectiveCounter) is active wherever collectives can run: the whole step,
        or only the gradient sync when forward/backward cannot communicate (its per-op cost then
        stays out of the compute). `exact_memory=False` (a step whose memory nobody measures)
        lets gloo's worker thread drop a finished collective's operands when it gets to it
        (`_gloo_sync`, `tied_grads.gloo_memory_exact`: a yield to that thread per collective, on
        a loaded machine several milliseconds a step)."""
        with self._gloo_sync() if exact_memory else gloo_memory_exact(False):
            if counter is not None and self.collectives_in_compute:
                with counter:
                    loss_sum, n = self.forward_backward(batch)
                    self.sync_and_update()
            else:
                loss_sum, n = self.forward_backward(batch)
                self.sync_and_update(counter)
        self.steps_done += 1
        return loss_sum, n

    def _gloo_sync(self) -> Any:
        """Tensor or context parallelism on gloo: their functional collectives (DTensor's, cp's
        K/V all-gather and its backward's reduce-scatter) return once gloo let go of their
        operands (`tied_grads.GlooFunctionalSync`), so a tensor the step drops is freed then,
        every run alike; else nothing. (cp alone: a gathered V and its input, 96 KiB, held by
        gloo's worker thread into block 0's recomputed MLP moved one rank's peak there under
        load, the memory harness's cp2_full_fp32 at -7.6%.)"""
        if (self.tp_size > 1 or self.cp is not None) and dist.is_initialized() and dist.get_backend() == "gloo":
            from autopar.runtime.tied_grads import GlooFunctionalSync

            return GlooFunctionalSync()
        return _nullctx()

    def reduce_loss(self, local: tuple[float, int]) -> float:
        """Mean loss over the global batch from every rank's `train_step` result (a collective)."""
        t = torch.tensor([local[0], float(local[1])], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)  # on the device: NCCL reduces device tensors only
        t = t.cpu()
        return float(t[0] / t[1]) if t[1] > 0 else float("nan")

    def _cp_ctx(self) -> Any:
        """Context parallelism's forward and backward (`ContextParallel.active`), else nothing."""
        return self.cp.active() if self.cp is not None else _nullctx()

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
                    # "step": the gradients accumulate unsharded and the last micro-batch's
                    # backward reduce-scatters them; "microbatch": every backward does, FSDP2
                    # adding each result into the fp32 gradient shard (`Plan.zero3_grad_sync`)
                    every = self.plan.zero3_grad_sync == "microbatch"
                    self._fsdp_root.set_requires_gradient_sync(every or m == M - 1)
                args = [mb[m] for mb in mbs]
                with self._cp_ctx():
                    with ctx:
                        loss = self.runner(*args)
                    (loss / M).backward()
                total += loss_value(loss)
                # else the loop's variable keeps this micro-batch's loss, and the storage behind
                # it (CPU's mse_loss: its unreduced fp32 loss), through the next forward
                del loss
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
                # (one element's storage: what the step holds does not grow with M)
                kwargs["target"] = torch.zeros(1, device=self.device).expand(M)
            else:
                kwargs["target"] = targets[0] if len(targets) == 1 else targets
            kwargs["losses"] = losses
        # the executor's chunks under context parallelism: the rank's positions for the step,
        # backward recomputation included (`context_parallel.ProgramContext`); the traced
        # module chunks set them in each forward (`ContextParallel.install`)
        cp_ctx = self._cp_ctx() if self.runner is None and self.stages[0].op_layouts is not None else _nullctx()
        with ctx, cp_ctx:
            # return_outputs=False: the last stage would otherwise keep every micro-batch's
            # output (the logits) until the step ends, which no plan counts
            if is_first:
                self.schedule.step(inputs, return_outputs=False, **kwargs)
            else:
                self.schedule.step(return_outputs=False, **kwargs)
        if is_last and reporter_tp:
            return float(sum(loss_value(l) for l in losses)), len(losses)
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
                experts = self.expert_groups
                own = {id(p) for p in experts.params} if experts is not None else set()
                if self.dp_group is not None and not self.zero3:
                    allreduce_flat([self._local(p.grad) for p in self.params if id(p) not in own], self.dp_group,
                                   1.0 / self.dp_size)
                elif self.dp_group is not None and self.fsdp_scalars:
                    # ZeRO-3's 0-D parameters, replicated over dp: averaged as ZeRO 0's (one flat
                    # all-reduce per step; `planner.assemble` counts it)
                    allreduce_flat([self._local(p.grad) for p in self.fsdp_scalars], self.dp_group,
                                   1.0 / self.dp_size)
                if experts is not None:
                    experts.sync(self.dp_size)
                for t in self.tied:
                    t.sync()
        step = self.local_shards.step if self.local_shards is not None else self.optimizer.step
        if self.masters is not None:
            self.masters.step(step)
        elif not self.zero12:
            step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None


    def model_state_bytes(self) -> int:
        """Bytes of this rank's parameters, fp32 masters (mixed precision) or flat optimizer
        shard (ZeRO-1/2), and optimizer state (local shards)."""
        n = 0
        seen = set()
        eg = self.expert_groups
        for p in self.params + (self.masters.masters if self.masters is not None else []) + (
                [self.flat_shard] if self.zero12 else []) + (
                [eg.flat_shard] if eg is not None and eg.flat_shard is not None else []):
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

        from autopar.intra_op.execute import deinterleave

        out = {}
        eg = self.expert_groups
        for n, p in self.local_named_parameters():
            if eg is not None and n in eg.names:
                p = eg.global_view(p.detach())
            t = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            if n in self.interleaved:
                t = deinterleave(t, *self.interleaved[n], self.tp_size)
            out[n] = t
        return out


def loss_value(loss: torch.Tensor) -> float:
    """A micro-batch loss as a float; NaN for a fake tensor (`autopar verify` steps the program
    on fake tensors: nothing has a value)."""
    t = loss.detach()
    local = t._local_tensor if isinstance(t, DTensor) else t
    return float("nan") if isinstance(local, FakeTensor) else float(t)


class LocalBatch(tuple):
    """A rank's share of a step's batch (`ParallelModel.local_batch`); `train_step` and `step`
    take it or the global batch."""


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
