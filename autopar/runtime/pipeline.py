"""Pipeline stages of `ParallelModel` (a mixin): torch.pipelining `PipelineStage`s holding a
rank's chunks, cut from the traced model at the planned layer boundaries, the loss inside the
last chunk (`graph_stages`: any model, no knowledge of its family), or, with tensor parallelism
run as solved, from the exported program (`intra_op.pipeline_chunks`); static send/receive
shapes; the pipeline groups; the schedule (`cost_models.schedules`)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.models.positions import traced_positions
from autopar.runtime.context_parallel import check_traced_positions
from autopar.runtime.experts import program_calls
from autopar.runtime.materialize import materialize
from autopar.runtime.meshes import _mesh_kinds
from autopar.runtime.pipeline_p2p import FanoutPipelineStage, JustInTimeStage, replica_ranks
from autopar.runtime.recompute import apply_stage_recompute
from autopar.runtime.validate import check_covered
from autopar.schema.errors import PlanError
from cost_models.schedules import torch_schedule


def compact_loss(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, or a copy of it where its storage is larger than its value or it is a view:
    torch.pipelining keeps every micro-batch's loss until the step ends, and some losses are a
    scalar view of their elementwise buffer (CPU's mse_loss: 8 KiB behind a 4-byte loss, torch
    2.13); a loss that is no view can be detached in place once its backward ran
    (`pipeline_p2p.JustInTimeStage.backward_one_chunk`), which frees its graph."""
    if isinstance(loss, torch.Tensor) and (loss._is_view() or
                                           loss.untyped_storage().nbytes() > loss.numel() * loss.element_size()):
        return loss.clone()
    return loss


class PipelineStages:
    """The pipeline part of `engine.ParallelModel` (its attributes are the engine's)."""

    def _example_microbatch(self) -> tuple:
        """The model's inputs at the plan's micro-batch size, on meta (what the tracer needs):
        under context parallelism the rank's tokens of each sequence (`ContextParallel.
        local_tokens`), as its chunks receive them."""
        mb = self.plan.microbatch_size
        out = tuple(torch.empty((mb,) + tuple(x.shape[1:]), dtype=x.dtype, device="meta")
                    if isinstance(x, torch.Tensor) and x.dim() > 0 else x
                    for x in self.bundle.example_inputs)
        return out if self.cp is None else tuple(self.cp.local_tokens(x) if isinstance(x, torch.Tensor) else x
                                                 for x in out)

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

    def _build_solved_pipeline(self) -> None:
        """A pipeline whose chunks run op by op as solved (every stage carries `op_layouts`):
        each of the rank's chunks a `ProgramChunk` of the model's program
        (`autopar.intra_op.pipeline_chunks`) on the stage's tp sub-mesh, held by a torch
        PipelineStage; only the parameters the rank's chunks read are materialised. Stages of
        different tp degrees (Alpa's sub-mesh choice) are joined by `pipeline_p2p`'s fan-out;
        a chunk whose successor has another tp degree hands its tensors over replicated
        (`ProgramChunk`'s `handover`, as the plan's `chunk_layouts` solved it)."""
        from autopar.intra_op.pipeline_chunks import parallelize_chunks

        self.hetero = len(_mesh_kinds(self.stages)) > 1
        if self.hetero:
            self._build_replica_groups()
        else:
            self._build_pp_groups()
        mine = [i for i, s in enumerate(self.stages) if self.rank in s.devices]
        tps = [s.axis_size("tp") for s in self.stages]
        handover = {i for i in range(len(tps) - 1) if tps[i] != tps[i + 1]}
        sol = _merged_solution([self.stages[i].op_layouts for i in mine], (self.tp_size,))
        chunk_ops = [[op for lay in s.op_layouts.layers for op in lay.ops] for s in self.stages]
        # every chunk's op choices, in pipeline order: what the program traced for this device is
        # matched against (`execute.fitting_program`)
        every = SimpleNamespace(op_choices={k: c for s in self.stages
                                            for k, c in s.op_layouts.solution((s.axis_size("tp"),)).op_choices.items()})
        receives = [s.op_layouts.receives for s in self.stages]
        chunks, params = parallelize_chunks(
            self.model, self._real_microbatch(), sol, self.my_mesh.tp_mesh, chunk_ops, receives, mine,
            materialize=lambda own: materialize(self.model, seed=self.seed, device=self.device,
                                                aliases=self.aliases, only=own),
            aliases=self.aliases, device=self.device, autocast=self._autocast_ctx,
            compute_dtype=self._compute_dtype, param_dtype=self.low,
            recompute=[r for i in mine for r in self.stages[i].op_layouts.recompute_regions()],
            discard=[r for i in mine for r in self.stages[i].op_layouts.discard_regions()],
            units={i: self.stages[i].fsdp_units or [] for i in mine} if self.zero3 else None,
            handover=handover, context=self.cp.program() if self.cp is not None else None, every=every)
        self.chunk_params = dict(enumerate(params))
        if chunks:
            self._note_interleaved(chunks[0].prog.layouts)
        if self.plan.ep > 1:
            # expert parallelism: every rank builds the expert meshes (collective); each expert
            # block of the rank's chunks runs as its token exchange (`runtime.experts`), as in
            # one stage (`_build_solved`)
            self._shard_experts(nn.Module())
            layers = [f for i in mine for f in self.stages[i].layers]

            def own(fqn: str) -> bool:
                return any(fqn == f or fqn.startswith(f + ".") for f in layers)

            self._shard_experts(self.model, own)
            for ch in chunks:
                ch.rehold()
            if chunks:
                chunks[0].prog.replace_modules(program_calls(self.model, self.plan, own),
                                               running={n for ch in chunks for n in ch.nodes})
                acts = [a for i in mine if self.stages[i].recompute == "norm_act"
                        for a in self.stages[i].recompute_acts or []]
                if acts:
                    # the experts' activations discarded by the experts modules themselves
                    # (their ops no longer run as the program's), as on a module-cut stage
                    from autopar.runtime.discard import apply_discard

                    apply_discard(self.model, None, acts)
        if self.zero3:
            self._shard_solved_chunks(chunks)
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
        check_covered(self.model, self.stages, self.aliases)
        from autopar.runtime.graph_stages import FedChunk, split_model

        # under context parallelism the chunks are traced on a rank's tokens, their positions
        # an op that reads the rank's when it runs (`models.positions.traced_positions`)
        cuts = [s.layers[0] for s in self.stages[1:]]
        with traced_positions() if self.cp is not None else contextlib.nullcontext():
            chunks = split_model(self.model, self._example_microbatch(), cuts, self.device, param_dtype=self.low)
        if self.cp is not None:
            # a model that makes its own positions: its aranges of them made the op, its input
            # shifts done on the whole sequence (`ContextParallel.adopt_chunks`)
            self.cp.adopt_chunks(chunks, lambda ins: split_model(self.model, ins, cuts, self.device,
                                                                 param_dtype=self.low), self._example_microbatch())
            check_traced_positions([ch.module for ch in chunks])
        shapes = self._graph_shapes(chunks)
        self.hetero = len(_mesh_kinds(self.stages)) > 1
        if self.hetero:
            self._build_replica_groups()
        else:
            self._build_pp_groups()
        self.pipe_stages = []
        self.local_modules = []
        self.fed_chunks = []
        self.chunk_params: dict[int, set[str]] = {}
        if self.plan.ep > 1:       # every stage's expert meshes, built by every rank (collective)
            self._shard_experts(nn.Module())
        for i, s in enumerate(self.stages):
            self.chunk_params[i] = {self.aliases.get(n, n) for n, _ in
                                    chunks[i].module.named_parameters(remove_duplicate=False)}
            if self.rank not in s.devices:
                continue
            core: nn.Module = chunks[i].module
            if self.cp is not None:     # before recomputation wraps its modules (`ContextParallel.install`)
                self.cp.install(core, check=False)
            apply_stage_recompute(core, s)
            materialize(core, seed=self.seed, device=self.device, aliases=self.aliases, template=self.model)
            if self.plan.ep > 1:
                # each experts module runs as the model's own code, its traced one baked at the
                # one-process shapes (`runtime.experts`)
                self._shard_experts(core, template=self.model)
            mod = FedChunk(core, chunks[i].sources, chunks[i].sends)
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
        return JustInTimeStage(mod, i, nst, self.device, group=self.pp_group, **meta)

    def _make_schedule(self) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        M = self.plan.num_microbatches
        # the last chunk returns the loss itself
        loss_fn = lambda out, tgt: compact_loss(out.full_tensor() if isinstance(out, DTensor) else out)  # noqa: E731
        cls = torch_schedule(self.plan.schedule, self.pp, M, len(self.pipe_stages))
        if cls == "ScheduleInterleaved1F1B":
            if M % self.pp != 0:
                raise PlanError(f"interleaved 1F1B needs num_microbatches ({M}) to be a multiple of "
                                f"the pipeline depth ({self.pp})")
            sched = _interleaved_class()(self.pipe_stages, n_microbatches=M, loss_fn=loss_fn)
        elif cls == "ScheduleGPipe":
            # also 1F1B with fewer micro-batches than stages, which torch's 1F1B refuses: it
            # degenerates to GPipe (all forwards, then all backwards), same maths and transfers
            sched = ScheduleGPipe(self.pipe_stages[0], n_microbatches=M, loss_fn=loss_fn)
        else:
            sched = Schedule1F1B(self.pipe_stages[0], n_microbatches=M, loss_fn=loss_fn)
        self.schedule = sched
        if self.hetero:
            _vote_now(sched)
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
        _vote_now(sched)


def _vote_now(sched: Any) -> None:
    """Hold torch.pipelining's warm-up vote (each stage's metadata static or inferred: a send
    and a receive between neighbouring stages each way) now, at setup, instead of inside the
    first step, so that every step's collectives are the plan's; the step then keeps the modes
    settled here (a switch between training and evaluation votes again, as torch does). On a
    fake process group `_vote_static` settles it without messages."""
    if dist.get_backend() == "fake":
        _vote_static(sched)
        return
    stages = list(getattr(sched, "_stages", None) or [sched._stage])
    first = sched._warmup_p2p
    voted_with = sched._has_backward
    first(stages, voted_with, False)

    def settled(stages: list, has_backward: bool, p2p_done: bool) -> None:
        if has_backward != voted_with:
            first(stages, has_backward, p2p_done)

    sched._warmup_p2p = settled


def _vote_static(sched: Any) -> None:
    """On a fake process group (`autopar verify`: no values travel) settle torch.pipelining's
    first-step warm-up vote without reading a received value: every stage here is built with
    static shapes (`_make_stage`), so the vote's outcome is STATIC on every rank; a stage that
    would need dynamic metadata inference is an error."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for st in stages:
            if InferenceMode.needs_dynamic(st._user_meta, has_backward):
                raise PlanError(f"pipeline stage {st.stage_index} lacks static shapes, which a fake process "
                                f"group cannot infer")
            st._inference_mode = InferenceMode.STATIC

    sched._warmup_p2p = warmup


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
        out.junction_readers.update(s.junction_readers)
        out.param_layouts.update(s.param_layouts)
    return out


def _interleaved_class() -> type:
    """torch's interleaved 1F1B (its order of actions), run by torch's lock-step runner
    (`PipelineScheduleMulti._step_microbatches`): each time step's sends and receives are
    posted together and waited in that step. The runner torch 2.13 gives the class
    (`_PipelineScheduleRuntime._step_microbatches`) keeps every send's Work, and so the tensor
    it sends, until the step ends: the outputs and input gradients of all the rank's chunk
    micro-batches, gigabytes at scale (`cost_models.schedules.held_moments` counts what each
    runner keeps). The lock-step runner does not end an FSDP stage's step as torch's other
    schedules do (`perform_reduce_grad` after the last backward: FSDP's post-backward, the
    gradients reduce-scattered and resharded, then scaled): it only scales the stage's
    gradients, which FSDP still holds unsharded and unreduced, so under ZeRO-3 no gradient
    was synced over dp (the losses left one process's at the second step). It is done here
    after the runner, for the stages that are FSDP roots."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleInterleaved1F1B

    class Interleaved1F1B(ScheduleInterleaved1F1B):
        def _step_microbatches(self, *args: Any, **kwargs: Any) -> Any:
            out = PipelineScheduleMulti._step_microbatches(self, *args, **kwargs)
            for stage in self._stages:
                if isinstance(stage.submod, FSDPModule):
                    stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)
            return out

    return Interleaved1F1B

