"""ZeRO on the data-parallel axis (`ParallelModel`'s mixin): FSDP2 units for ZeRO-3, and ZeRO-1/2's
flat reduce-scatter, sharded AdamW and all-gather of the updated parameters."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn as nn

from autopar.runtime.precision import fsdp_policy
from autopar.runtime.tied_grads import (
    all_gather_flat,
    exact_gloo_memory,
    gloo_copies_released,
    reduce_scatter_flat,
    release,
)
from autopar.runtime.validate import get_submodule


def gloo_fsdp_comms(module: nn.Module) -> None:
    """On gloo, give the FSDP2 unit `module` FSDP's default all-gather and reduce-scatter with
    their timing made the same every run: gloo's worker thread lets go of FSDP's flat
    all-gather buffer once that unit's copy-out returned (`wait_for_unshard`, the all-gather's
    views followed as `tied_grads.gloo_quiesced` does: else the buffer FSDP frees after its
    copy-out lived on until the thread got back to its queue, milliseconds under load), and the
    reduce-scatter frees gloo's copy of its input as it returns
    (`tied_grads.gloo_copies_released`). Asynchronous calls (none in FSDP2's default
    unsharding) and other backends are left as FSDP makes them.

    The wait for gloo's thread comes after the copy-out, not as the all-gather returns (until
    session 30): the buffer is FSDP's through the copy-out either way, so nothing is freed at
    another moment, and the copy-out gives the thread the time it needs (a wait right after the
    call paid the thread's scheduling latency at every all-gather, most under load)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class GlooAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if async_op or not exact_gloo_memory():
                return super().__call__(output_tensor, input_tensor, group, async_op)
            # a pending all-gather not yet settled by a copy-out (none in FSDP's order) first
            _PENDING_GATHERS.settle()
            return _PENDING_GATHERS.issue(
                lambda out, inp: super(GlooAllGather, self).__call__(out, inp, group, async_op),
                output_tensor, input_tensor)

    class GlooReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if async_op or not exact_gloo_memory():
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            with gloo_copies_released(group, output_tensor, input_tensor):
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

    groups = module._get_fsdp_state()._fsdp_param_groups
    if groups and dist.get_backend(groups[0]._reduce_scatter_process_group) == "gloo":
        module.set_custom_all_gather(GlooAllGather())
        module.set_custom_reduce_scatter(GlooReduceScatter())
        for g in groups:
            g.wait_for_unshard = _settling(g.wait_for_unshard)


class _PendingGathers:
    """Weak references to the views FSDP's synchronous gloo all-gathers ran on, until a
    copy-out ends (`settle`: wait until gloo let go of them)."""

    def __init__(self) -> None:
        self.refs: list = []

    def issue(self, collective, *operands: torch.Tensor):
        import weakref

        views = [t.view(t.shape) for t in operands]
        self.refs.extend(weakref.ref(v) for v in views)
        return collective(*views)

    def settle(self) -> None:
        if self.refs:
            from autopar.runtime.tied_grads import _dead

            _dead(self.refs)
            self.refs = []


_PENDING_GATHERS = _PendingGathers()


def _settling(wait_for_unshard):
    """FSDP's `wait_for_unshard` (the copy-out), returning once gloo let go of the all-gather."""
    def wrapped(*a, **k):
        try:
            return wait_for_unshard(*a, **k)
        finally:
            _PENDING_GATHERS.settle()
    return wrapped


def _quiet_view_output_warning() -> None:
    """Silence FSDP's warning that a `ShardedProgram` or `ProgramChunk` root returns a view: its
    plain output (the local tensor of a replicated DTensor: the loss, or what torch.pipelining
    sends on or feeds to the loss) is never modified in place, which is what the warning is
    about."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(ShardedProgram|ProgramChunk)\) "
                            r"returned a view", category=UserWarning)


def _run_region(module: nn.Module, region, *inputs):
    """A unit's run of ops as a method of its module (FSDP's forward hooks run around it)."""
    return region(*inputs)


def _unit_calls(model: nn.Module, units: Sequence[str]) -> dict:
    """{unit: its module's FSDP forward method running a run of ops} (`ShardedProgram.run_units`)."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    calls = {}
    for fqn in units:
        mod = get_submodule(model, fqn)
        mod._autopar_ops = types.MethodType(_run_region, mod)
        register_fsdp_forward_method(mod, "_autopar_ops")
        calls[fqn] = mod._autopar_ops
    return calls


def scalar_params(*modules: nn.Module) -> list[nn.Parameter]:
    """The 0-D parameters of `modules`, each once (FSDP2 cannot shard a scalar: ZeRO-3 leaves
    them replicated over dp, `ZeroSharding._fully_shard`)."""
    out, seen = [], set()
    for mod in modules:
        for p in mod.parameters():
            if p.dim() == 0 and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class ZeroSharding:
    """The ZeRO part of `engine.ParallelModel` (its attributes are the engine's).
    `fsdp_scalars`: the 0-D parameters ZeRO-3 left out of `fully_shard` (replicated over dp,
    their gradients all-reduced by `sync_and_update`)."""

    fsdp_scalars: list[nn.Parameter]

    def _fully_shard(self, model: nn.Module, units: Sequence[str], root: Optional[nn.Module] = None) -> None:
        """ZeRO-3: `fully_shard` on the dp sub-mesh for each of the plan's `units` (modules of
        `model`, `StagePlan.fsdp_units`: the planner chose them from which ops read which
        parameter), then on `root` (default `model`; a module holding `model`) as the root unit,
        which keeps the other parameters (tied, read outside their module). A pipeline stage
        passes the module its PipelineStage holds as `root`: torch.pipelining drives FSDP
        (gradient sync and resharding on the last micro-batch only) only when the stage's module
        is the FSDP root (a tp stage runs op by op: `_shard_solved`)."""
        from torch.distributed.fsdp import fully_shard

        mesh = self.my_mesh.dp_mesh
        mp = {"mp_policy": fsdp_policy(self.low)} if self.low is not None else {}
        experts = getattr(self, "expert_groups", None)
        ignored: set[nn.Parameter] = set()
        if experts is not None:
            # expert parallelism: the experts sharded over the ranks holding the same ones first
            # (`runtime.experts.ExpertGroups.fully_shard`); with one copy each, left out
            ignored |= experts.fully_shard(model, mp)
        root = model if root is None else root
        # 0-D parameters (a logit scale): FSDP2 shards none (nothing to split on dim 0), the
        # plan keeps them replicated over dp ("R", `planner._placements`), and
        # `sync_and_update` averages their gradients over dp in one flat all-reduce
        scalars = scalar_params(root, model)
        if scalars:
            ignored |= set(scalars)
            seen = {id(p) for p in self.fsdp_scalars}
            self.fsdp_scalars.extend(p for p in scalars if id(p) not in seen)
        if ignored:
            mp = dict(mp, ignored_params=ignored)
        # with tp, parameters are already DTensors on the sibling tp sub-mesh: FSDP2 makes them
        # 2-D (Shard on dp, the planned placement on tp)
        for fqn in units:
            gloo_fsdp_comms(fully_shard(get_submodule(model, fqn), mesh=mesh, **mp))
        from autopar.intra_op.execute import ShardedProgram
        from autopar.intra_op.pipeline_chunks import ProgramChunk

        if isinstance(root, (ShardedProgram, ProgramChunk)):
            _quiet_view_output_warning()
        gloo_fsdp_comms(fully_shard(root, mesh=mesh, **mp))
        self._fsdp_root = root

    def _shard_solved(self, prog: nn.Module, units: Sequence[str]) -> None:
        """ZeRO-3 of a stage run op by op as solved (`intra_op.execute.ShardedProgram` `prog`):
        the plan's units and the program as the root `fully_shard`ed on the dp sub-mesh over
        the executor's tp DTensors (2-D parameters, as torchtitan composes FSDP2 with tp), and
        each unit's ops run as one call of an FSDP forward method of its module
        (`register_fsdp_forward_method`; `ShardedProgram.run_units`). The program does not call
        the modules' forwards, so their FSDP hooks would not fire; through that method FSDP does
        what it does around a module's forward: the unit is gathered before its ops and freed
        after them (the root's parameters stay gathered through the forward), gathered again
        when the gradients reach its outputs, and its gradients reduce-scattered once they
        have all been accumulated (on the last micro-batch: `set_requires_gradient_sync`; on
        every one under `Plan.zero3_grad_sync` "microbatch", each added into the shard). So
        the collectives are the module path's (`planner._zero3_counts`) and the memory FSDP's."""
        self._fully_shard(prog.model, units, root=prog)
        prog.run_units(_unit_calls(prog.model, units))

    def _shard_solved_chunks(self, chunks: Sequence[nn.Module]) -> None:
        """ZeRO-3 of a pipeline run as solved (`intra_op.pipeline_chunks.ProgramChunk`s): each
        chunk the FSDP root of its units (its `holder` holds the unit modules themselves and
        the root's parameters), as the module path roots FSDP at what the PipelineStage holds
        (torch.pipelining then drives it: gradient sync and resharding after the last
        micro-batch); each unit's ops one FSDP call, as `_shard_solved`."""
        calls = {}
        for ch in chunks:
            self._fully_shard(ch.holder, ch.units, root=ch)
            calls.update(_unit_calls(ch.holder, ch.units))
        if chunks:
            chunks[0].prog.run_units(calls, running={n for ch in chunks for n in ch.nodes})

    def _zero12_setup(self) -> None:
        """The flat dp shard of the parameters and the optimizer over it; under expert
        parallelism the expert weights are left out (`zero_params`): their own flat shard over
        the ranks holding the same experts (`runtime.experts.ExpertGroups.zero_setup`) is the
        optimizer's second parameter."""
        D = self.dp_size
        experts = getattr(self, "expert_groups", None)
        own = {id(p) for p in experts.params} if experts is not None else set()
        self.zero_params = [p for p in self.params if id(p) not in own]
        locs = [self._local(p.data) for p in self.zero_params]
        n = sum(t.numel() for t in locs)
        self.flat_numel = n
        self.shard_size = math.ceil(n / D)
        flat = torch.zeros(self.shard_size * D, dtype=locs[0].dtype, device=self.device)
        torch.cat([t.reshape(-1) for t in locs], out=flat[:n])
        lo = self.dp_rank * self.shard_size
        self.flat_shard = nn.Parameter(flat[lo:lo + self.shard_size].clone())
        shards = [self.flat_shard]
        if experts is not None:
            shards.append(experts.zero_setup())
        self.optimizer = self.opt_factory(shards)

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
        for p in self.zero_params:
            g = self._local(p.grad)
            flat[off:off + g.numel()].copy_(g.reshape(-1))
            off += g.numel()
            p.grad = None
            del g           # else the loop's variable keeps the last gradient through the step
        shard = torch.empty(S, dtype=flat.dtype, device=self.device)
        reduce_scatter_flat(shard, flat, group=self.dp_group)
        release(flat)
        shard.mul_(1.0 / D)
        self.flat_shard.grad = shard.to(self.flat_shard.dtype)   # the fp32 master shard's
        if self.flat_shard.grad is not shard:
            release(shard)
        del shard
        experts = getattr(self, "expert_groups", None)
        if experts is not None:
            experts.zero_reduce(D)
        self.optimizer.step()
        self.flat_shard.grad = None
        if experts is not None:
            experts.zero_gather()
        full = torch.empty(S * D, dtype=dtype, device=self.device)   # the parameters' dtype
        mine = self.flat_shard.data.to(full.dtype)
        all_gather_flat(full, mine, group=self.dp_group)
        if mine.untyped_storage()._cdata != self.flat_shard.data.untyped_storage()._cdata:   # not data_ptr: 0 when fake
            release(mine)
        off = 0
        with torch.no_grad():
            for p in self.zero_params:
                loc = self._local(p.data)
                loc.copy_(full[off:off + loc.numel()].view_as(loc))
                off += loc.numel()
        release(full)
