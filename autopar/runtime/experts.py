"""Expert parallelism at run time (`Plan.experts`): each expert block's experts sharded over
groups of `ep` consecutive data-parallel ranks, tokens exchanged with `all_to_all_single`.

DTensor has no all-to-all placement (a token's destination depends on the router's values, not
on a layout), so the plan's experts modules are replaced by `ExpertParallelExperts`, a runtime
module around the model's own one: it keeps the rank's slice of the stacked expert weights, and
per forward (dropless, as the one-process run: no capacity, no dropped token)

1. sorts the rank's T x k token-expert pairs by expert (the one-process order) and counts them
   per expert;
2. exchanges the counts (one all-to-all of E integers: the split sizes, data dependent, which
   is why this runs outside any captured graph);
3. dispatches the pairs' rows to the ranks holding their experts (all-to-all, split sizes from
   the counts), runs the model's experts module on them with the local expert count (rows
   grouped by local expert, routing weight 1);
4. returns the results (all-to-all back), weights them by the router's top-k weights and sums
   each token's k rows in the one-process order.

The backward runs the two row exchanges reversed (`_AllToAll`), so per block and micro-batch:
3 all-to-alls forward, 2 backward (`inter_op.experts.A2A_FORWARD`, `A2A_BACKWARD`). The expert
gradients are averaged over the dp / ep ranks holding the same experts (`ExpertGroups.sync`),
the dense ones over dp as before. In a pipeline, each stage's dp ranks form its own ep groups
and the module is replaced in the traced chunk (torch's unflattened program keeps a module per
FQN; `argument_roles` reads the order its inputs come in), the model's own experts module
running behind the exchange in place of the traced one, whose ops hold the one-process row
counts (`eager_experts`); a rank holding several interleaved
chunks replaces the experts of each, all exchanging over its stage's groups (every chunk of a
rank has the same device set, and the ranks of a device set run the same chunk and micro-batch
order, so their all-to-alls pair up). Checkpoints and `full_state` see each stacked weight whole
(`ExpertGroups.global_view`: a DTensor sharded over ep), so a checkpoint resumes in any
layout (not yet under ZeRO-1/2, whose expert shard `checkpoint` refuses, nor ZeRO-3). ZeRO-1/2
shard the expert weights' optimizer state over the ranks holding the same experts
(`zero_setup`); ZeRO-3 makes each experts module an FSDP unit over those ranks
(`ExpertGroups.fully_shard`). With tensor parallelism the experts are replicated over tp:
each tp coordinate's dp ranks form their own ep groups (`expert_meshes`). A stage run op by op
as solved (every tp stage: issue 20, one executor) runs each expert block's ops (replicated in
the solution: the ILP keeps them so, `inter_op.ilp_provider.IlpProvider._expert_ops`) as one
call of this module on its inputs
(`program_calls`, `intra_op.execute.ShardedProgram.replace_modules`), under ZeRO-3 too (each
expert block's call nested in its layer's FSDP unit's run of ops). Either in one stage (in a
pipeline the counted collectives differ from the plan's; moe-tiny with tp does not run in
pipeline chunks even at ep 1), ZeRO-3 only as solved (`check_executable`).

Expert tensor parallelism (`Plan.experts.expert_tp` = tp, Megatron-Core's ETP): each rank keeps
1/tp of each of its experts (`shard_experts`: the input projections' output columns, a fused
gate/up projection's halves split apart so a rank's gate and up columns pair up, the output
projection's input rows; `ExpertBlockPlan.tp_split`); the rows a rank receives are the same on
every tp rank of its ep group's tp coordinate, so the model's experts module runs on them with
the rank's slices and its output, partial sums over tp, is all-reduced over the stage's tp group
(`_ReduceFromTP`), the gradient of its input likewise in the backward (`_CopyToTP`): per block
and micro-batch one all-reduce forward, one backward (`inter_op.experts.ETP_FORWARD`,
`ETP_BACKWARD`). Executed op by op as solved in one stage without cp, under any ZeRO stage
(`check_executable`; ZeRO-1/2's expert shard and ZeRO-3's expert FSDP units over the ranks
holding the same experts, as without ETP, hold the rank's tp slices); checkpoints and
`full_state` of such plans are refused (a stacked weight's whole view would interleave the tp
slices of a fused gate/up projection).

Folded (`Plan.experts.folded`, Megatron-Core's MoE parallel folding): the expert mesh
(expert-dp, ep) lies over all the stage's dp x tp ranks in device order (tp innermost), apart
from the dense (dp, tp) mesh (`expert_meshes`), so ep may exceed dp. The block's inputs arrive
replicated over tp (the solution runs its ops replicated); each tp rank takes its 1/tp of the
tokens (`_SplitToTP`), exchanges them over its folded ep group and all-gathers the block's
output over tp (`_GatherFromTP`); in the backward the gradients of its inputs (hidden states and
top-k weights, one buffer) are all-gathered over tp: per block and micro-batch one all-gather
forward, one backward (`inter_op.experts.FOLD_FORWARD`, `FOLD_BACKWARD`). The expert gradients
are averaged over the ranks ep apart holding the same experts, as without folding (ZeRO-1/2's
flat shard and ZeRO-3's FSDP units over them). Executed op by op as solved without cp, in one
stage or in pipeline stages (each stage's folded groups; interleaved too: the tp ranks of a
device set run the same chunk and micro-batch order, so their all-gathers pair up), under any
ZeRO stage (`check_executable`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.runtime.tied_grads import all_gather_flat, allreduce_flat, reduce_scatter_flat, release
from autopar.schema.errors import PlanError
from autopar.schema.plan import Plan

ROLES = ("hidden", "index", "weights")    # the experts interface's argument order


def check_executable(plan: Plan) -> None:
    """PlanError unless this runtime executes the plan's expert parallelism."""
    if plan.experts is None or plan.experts.ep == 1:
        return
    if plan.experts.folded:
        solved = all(s.op_layouts is not None for s in plan.stages)
        why = [w for w, bad in (("DTensor's path (no solved op layouts)", not solved),
                                ("context parallelism", plan.cp > 1),
                                ("stage meshes other than (dp, tp)",
                                 any(tuple(n for n, k in zip(s.mesh_axis_names, s.mesh_shape) if k > 1)
                                     not in (("dp", "tp"), ("tp",)) for s in plan.stages))) if bad]
        if why:
            raise PlanError(f"experts folded over dp x tp (ep={plan.experts.ep}, expert_dp={plan.experts.expert_dp}) "
                            f"are executed op by op as solved, without cp; the plan has {', '.join(why)}: re-plan "
                            f"with Constraints(expert_dp=dp // ep) and an ep dividing dp (not folded), or within "
                            f"those")
        return
    etp = plan.experts.expert_tp
    if etp > 1:
        solved = all(s.op_layouts is not None for s in plan.stages)
        why = [w for w, bad in (("no per-op layouts", not solved),
                                ("pipeline stages", len({tuple(s.devices) for s in plan.stages}) > 1),
                                ("context parallelism", plan.cp > 1)) if bad]
        if why:
            raise PlanError(f"expert tensor parallelism (expert_tp={etp}) is executed op by op as solved, in one "
                            f"stage without cp; the plan has {', '.join(why)}: re-plan with "
                            f"Constraints(expert_tp=1) (the experts replicated over tp) or within those")
    # a tp plan without per-op layouts is refused as a whole (`runtime.validate`: one executor)
    tp = plan.tp > 1
    why = [w for w, bad in (("context parallelism in pipeline stages",
                             tp and plan.cp > 1 and len({tuple(s.devices) for s in plan.stages}) > 1),
                            ("stage meshes other than (dp, tp) or (dp, cp, tp)",
                             tp and any(tuple(n for n, k in zip(s.mesh_axis_names, s.mesh_shape) if k > 1)
                                        not in (("dp", "tp"), ("dp", "cp", "tp")) for s in plan.stages))) if bad]
    if why:
        raise PlanError(f"expert parallelism (ep={plan.experts.ep}) with tensor parallelism (tp={plan.tp}) is "
                        f"executed op by op as solved (with cp in one stage), experts replicated over tp; the "
                        f"plan has {', '.join(why)}: re-plan with Constraints(tp=1), or ep=1")


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with split sizes; its backward the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


class _CopyToTP(torch.autograd.Function):
    """The experts' input under expert tensor parallelism: as it is in the forward (replicated
    over tp), its gradient all-reduced over tp in the backward (each rank's column-parallel
    input projections give a partial one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """The experts' output under expert tensor parallelism: the row-parallel output projection's
    partial sums all-reduced over tp in the forward; the gradient as it is (replicated)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = y.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _SplitToTP(torch.autograd.Function):
    """Folding: this tp rank's 1/tp of the block's tokens (hidden states and top-k weights,
    replicated over tp); in the backward the slices' gradients all-gathered over tp into the
    whole ones (one buffer of both, in the wider dtype)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weights: torch.Tensor, group: dist.ProcessGroup, size: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0] // size
        ctx.group, ctx.size, ctx.width, ctx.k = group, size, hidden.shape[1], weights.shape[1]
        ctx.dtypes = (hidden.dtype, weights.dtype)
        return hidden[rank * n:(rank + 1) * n].clone(), weights[rank * n:(rank + 1) * n].clone()

    @staticmethod
    def backward(ctx: Any, gh: Optional[torch.Tensor], gw: Optional[torch.Tensor]) -> tuple:
        dt = torch.promote_types(*ctx.dtypes)
        n = (gh if gh is not None else gw).shape[0]
        dev = (gh if gh is not None else gw).device
        gh = gh if gh is not None else torch.zeros(n, ctx.width, dtype=dt, device=dev)
        gw = gw if gw is not None else torch.zeros(n, ctx.k, dtype=dt, device=dev)
        mine = torch.cat([gh.to(dt), gw.to(dt)], dim=1).contiguous()
        full = mine.new_empty((n * ctx.size,) + tuple(mine.shape[1:]))
        all_gather_flat(full.view(-1), mine.view(-1), group=ctx.group)
        return (full[:, :ctx.width].to(ctx.dtypes[0]).contiguous(),
                full[:, ctx.width:].to(ctx.dtypes[1]).contiguous(), None, None, None)


class _GatherFromTP(torch.autograd.Function):
    """Folding: the block's output of this tp rank's tokens all-gathered over tp (replicated
    again, as the solution has it); the gradient's own rows in the backward (replicated)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int) -> torch.Tensor:
        ctx.rank, ctx.n = rank, y.shape[0]
        mine = y.contiguous()
        full = mine.new_empty((mine.shape[0] * size,) + tuple(mine.shape[1:]))
        all_gather_flat(full.view(-1), mine.view(-1), group=group)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None, None, None


class ExpertParallelExperts(nn.Module):
    """The model's experts module (`inner`, holding this rank's experts [rank E/ep, (rank+1)
    E/ep)) behind the token exchange over `group` (the module docstring). Called as the module
    it replaces: (hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)."""

    def __init__(self, inner: nn.Module, num_experts: int, group: dist.ProcessGroup, ep: int,
                 roles: tuple[str, ...] = ROLES, inner_roles: Optional[tuple[str, ...]] = None,
                 tp_group: Optional[dist.ProcessGroup] = None,
                 fold: Optional[tuple[dist.ProcessGroup, int, int]] = None) -> None:
        """`tp_group`: expert tensor parallelism's group (`inner` holds this rank's tp slices of
        its experts; None: replicated over tp). `fold`: (the tp group, its size, this rank's
        place in it) where the experts are folded over dp x tp (each tp rank runs 1/tp of the
        tokens). `roles`: the order the caller passes hidden,
        index and weights in (`argument_roles`: a traced pipeline chunk calls its module with
        them in another order); `inner_roles`:
        the order `inner` takes them in (default `roles`; the interface's own for the eager
        module that replaces a traced one, `eager_experts`)."""
        super().__init__()
        self.roles = roles
        self.inner_roles = roles if inner_roles is None else inner_roles
        # the inner module's parameters and children registered here under their own names,
        # so the model's parameter names stay those of the plan and the one-process model
        self._inner = (inner,)
        for name, child in inner.named_children():
            self.add_module(name, child)
        self._direct = [name for name, _ in inner.named_parameters(recurse=False)]
        for name, p in inner.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.num_experts, self.ep, self.group = num_experts, ep, group
        self.local = num_experts // ep
        self.tp_group = tp_group
        self.fold = fold

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        got_args = dict(zip(self.roles, args))
        tp_mesh = None
        if any(isinstance(a, DTensor) for a in args):
            # tensor parallelism (DTensor's path): the block's inputs are replicated over tp,
            # each tp rank exchanges over its own ep group and runs the (replicated) experts
            # on plain tensors; the output is handed back replicated
            tp_mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
            got_args = {r: _replicated_local(a) for r, a in got_args.items()}
        out = (self._folded(*(got_args[r] for r in ROLES)) if self.fold is not None
               else self._exchange(*(got_args[r] for r in ROLES)))
        if tp_mesh is not None:
            out = DTensor.from_local(out, tp_mesh, [Replicate()] * tp_mesh.ndim, run_check=False)
        return out

    def _folded(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Folding: this tp rank's 1/tp of the tokens through the exchange, the output
        all-gathered over tp (the module docstring)."""
        group, size, rank = self.fold
        T = hidden.shape[0]
        if T % size:
            raise PlanError(f"experts folded over tp={size}: the block's {T} tokens do not divide by tp; re-plan "
                            f"with a micro-batch whose tokens do, or Constraints(expert_dp=dp // ep)")
        n = T // size
        h, w = _SplitToTP.apply(hidden, top_k_weights, group, size, rank)
        out = self._exchange(h, top_k_index[rank * n:(rank + 1) * n], w)
        return _GatherFromTP.apply(out, group, size, rank)

    def _exchange(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """The forward on plain tensors (the module docstring's steps)."""
        T, k = top_k_index.shape
        E, ep, L = self.num_experts, self.ep, self.local
        ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        # each pair's token: one tensor, read by the rows' gather and the combine (each saves it)
        token = perm // k
        if isinstance(ids, FakeTensor):
            # `autopar verify` steps on fake tensors: no routing exists, so the pairs are taken
            # as spread evenly (the same collectives, sizes of the balanced case)
            counts = torch.zeros(E, dtype=torch.long, device=ids.device)
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self.group)
            even = [T * k // ep + (1 if i < T * k % ep else 0) for i in range(ep)]
            send_split = recv_split = even
            per = [n // L + (1 if e < n % L else 0) for n in even for e in range(L)]
            local_ids = torch.repeat_interleave(torch.arange(L, device=ids.device).repeat(ep),
                                                torch.tensor(per, device=ids.device), output_size=sum(per))
        else:
            counts = torch.bincount(ids, minlength=E)
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self.group)
            send_split = counts.view(ep, L).sum(1).tolist()
            recv_split = recv.view(ep, L).sum(1).tolist()
            # received: by source rank, then by local expert
            local_ids = torch.repeat_interleave(torch.arange(L, device=recv.device).repeat(ep), recv)
        # the rows sent are freed once sent, the rows received once sorted (neither is saved:
        # the exchange saves nothing, the gathers their indices): held to the block's end, each
        # was a [pairs, H] tensor more at the forward's moments (`inter_op.experts`)
        got = _AllToAll.apply(hidden[token], recv_split, send_split, self.group)
        # grouped by local expert for the GEMMs
        lid, order = torch.sort(local_ids, stable=True)
        x = got[order]
        del got
        # unit weights in the rows' dtype: the product by them is the rows themselves in any
        # dtype, and an fp32 one (the router's) would promote the module's combine to fp32
        ones = torch.ones(lid.shape[0], 1, dtype=x.dtype, device=lid.device)
        if self.tp_group is not None:
            x = _CopyToTP.apply(x, self.tp_group)
        call = {"hidden": x, "index": lid.unsqueeze(1), "weights": ones}
        del x
        inner = self._inner[0]
        for name in self._direct:
            # the parameters held here, as they are now: FSDP (ZeRO-3, `ExpertGroups.fully_shard`)
            # swaps this module's for its gathered ones around each forward and backward
            inner._parameters[name] = self._parameters[name]
        y = inner(*(call.pop(r) for r in self.inner_roles))
        if self.tp_group is not None:
            y = _ReduceFromTP.apply(y, self.tp_group)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0], device=order.device)
        out_rows = _AllToAll.apply(y[back], send_split, recv_split, self.group)
        del y
        out_rows = out_rows * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(out_rows.dtype)
        out = torch.zeros((T,) + tuple(hidden.shape[1:]), dtype=out_rows.dtype, device=hidden.device)
        return out.index_add_(0, token, out_rows).to(hidden.dtype)


def _replicated_local(t: Any) -> Any:
    """A DTensor input of the experts block as its local tensor, which must be the whole one
    (replicated over tp: the experts run replicated, `check_executable`)."""
    if not isinstance(t, DTensor):
        return t
    if any(not isinstance(p, Replicate) for p in t.placements):
        t = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
    return t.to_local()


@dataclass
class ExpertGroups:
    """This rank's expert groups: the (expert-dp, ep) mesh over the stage's dp ranks, `ep_group`
    (the ranks sharing one copy of every expert), `edp_group` (the ranks holding the same
    experts; None when there is one copy), and the local expert parameters by canonical name
    (whose gradients `sync` averages apart from the dense ones)."""

    ep: int
    ep_rank: int
    mesh: DeviceMesh
    ep_group: Any
    edp_group: Optional[Any]
    params: list[nn.Parameter]
    names: dict[str, int] = field(default_factory=dict)     # canonical FQN -> id of its parameter

    flat_shard: Optional[nn.Parameter] = None     # ZeRO-1/2: this rank's shard of the expert weights
    fsdp: bool = False                            # ZeRO-3: FSDP shards and reduces them (`fully_shard`)
    fsdp_params: list[nn.Parameter] = field(default_factory=list)     # ... its sharded parameters
    etp: int = 1                                  # expert tensor parallelism: each expert over tp

    def fully_shard(self, module: nn.Module, mp: dict) -> set[nn.Parameter]:
        """ZeRO-3: each experts module of `module` (`ExpertParallelExperts`) an FSDP unit over
        the expert-dp ranks (those holding the same experts), before the dense units are made
        over dp (which then leave its parameters alone), as torchtitan shards experts. FSDP's
        reduce-scatter averages over the expert-dp ranks; `sync` then divides by ep, making
        the one-process average over dp (a divide factor of dp in FSDP would take NCCL's
        PreMulSum, which gloo lacks). With one copy of each expert (ep = dp) there is nothing to shard: the
        parameters are returned, for the dense units to ignore, and `sync` averages them.
        Called before the parameters are read into `params` (FSDP replaces them)."""
        from torch.distributed.fsdp import fully_shard

        wrappers = [m for m in module.modules() if isinstance(m, ExpertParallelExperts)]
        if self.mesh.size(0) == 1:
            return {p for w in wrappers for p in w.parameters()}
        for w in wrappers:
            from autopar.runtime.zero import gloo_fsdp_comms

            before = list(w.parameters())
            gloo_fsdp_comms(fully_shard(w, mesh=self.mesh["edp"], **mp))
            after = list(w.parameters())
            self.fsdp_params.extend(after)
            # FSDP replaced the module's parameters by its sharded ones: `params` (and `names`)
            # name those, so the rank's whole local slices made by `shard_experts` are freed (held
            # here they stayed alive through training, fp32, beside their shards: 48 KiB on
            # moe-tiny dp4 x ep2, tracked as "other")
            swap = {id(b): a for b, a in zip(before, after)}
            self.params[:] = [swap.get(id(p), p) for p in self.params]
            self.names.update({n: id(swap[i]) for n, i in self.names.items() if i in swap})
        self.fsdp = True
        return set()

    def zero_setup(self) -> nn.Parameter:
        """ZeRO-1/2: the expert weights' flat shard over the expert-dp ranks (the whole flat
        where each expert has one copy), the optimizer's parameter for them (made before the
        weights are cast: under mixed precision it is their fp32 master)."""
        D, r = self.mesh.size(0), self.mesh.get_local_rank("edp")
        n = sum(p.numel() for p in self.params)
        self._size = math.ceil(n / D)
        flat = torch.zeros(self._size * D, dtype=self.params[0].dtype, device=self.params[0].device)
        torch.cat([p.data.reshape(-1) for p in self.params], out=flat[:n])
        self.flat_shard = nn.Parameter(flat[r * self._size:(r + 1) * self._size].clone())
        return self.flat_shard

    def zero_reduce(self, dp: int) -> None:
        """ZeRO-1/2: the expert gradients into the flat shard's gradient: reduce-scattered over
        the expert-dp ranks (none where there is one copy), averaged over the dp replicas of the
        batch (as `sync`); each gradient freed once copied."""
        D = self.mesh.size(0)
        dtype = self.params[0].grad.dtype
        flat = torch.zeros(self._size * D, dtype=dtype, device=self.flat_shard.device)
        off = 0
        for p in self.params:
            flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
            off += p.numel()
            p.grad = None
        if self.edp_group is not None:
            shard = torch.empty(self._size, dtype=dtype, device=flat.device)
            reduce_scatter_flat(shard, flat, group=self.edp_group)
            release(flat)          # gloo's thread may still hold it (`tied_grads.release`)
        else:
            shard = flat
        self.flat_shard.grad = (shard * (1.0 / dp)).to(self.flat_shard.dtype)
        release(shard)

    def zero_gather(self) -> None:
        """ZeRO-1/2, after the step: the updated shards all-gathered over the expert-dp ranks
        and copied back into the expert weights (in their dtype)."""
        self.flat_shard.grad = None
        D = self.mesh.size(0)
        dtype = self.params[0].dtype
        mine = self.flat_shard.data.to(dtype)
        if self.edp_group is not None:
            full = torch.empty(self._size * D, dtype=dtype, device=mine.device)
            all_gather_flat(full, mine, group=self.edp_group)
        else:
            full = mine
        off = 0
        with torch.no_grad():
            for p in self.params:
                p.data.copy_(full[off:off + p.numel()].view_as(p))
                off += p.numel()
        # the gathered buffer and a cast copy of the shard, not the shard itself (fp32: `mine`
        # is it), freed now whoever holds them (gloo's thread, `tied_grads.release`)
        shard_storage = self.flat_shard.data.untyped_storage()._cdata   # not data_ptr: 0 when fake
        for t in (full, mine):
            if t.untyped_storage()._cdata != shard_storage:
                release(t)

    def global_view(self, t: torch.Tensor) -> DTensor:
        """A local expert slice (a parameter or its optimizer state) as the DTensor of the whole
        stack: sharded over ep on dim 0, replicated over the expert-dp copies. Checkpoints store
        it so (`runtime.checkpoint`: any layout resumes it) and `full_state` gathers it; shares
        `t`'s storage, so a checkpoint load fills the live slice."""
        if self.etp > 1:
            raise PlanError(f"checkpoints and full_state of plans with expert tensor parallelism "
                            f"(expert_tp={self.etp}) are not supported yet (a fused gate/up weight's tp slices "
                            f"interleave in its whole view); run without --checkpoint-dir, or re-plan with "
                            f"Constraints(expert_tp=1)")
        return DTensor.from_local(t, self.mesh, [Replicate(), Shard(0)] + [Replicate()] * (self.mesh.ndim - 2),
                                  run_check=False)

    def sync(self, dp: int) -> None:
        """Average the expert gradients as the one-process run: summed over their copies (each
        holds the gradient of its ep group's tokens), over the dp replicas of the batch."""
        if self.fsdp:
            # reduce-scattered (averaged over the expert-dp ranks) by FSDP (`fully_shard`)
            for p in self.fsdp_params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.ep)
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.edp_group is not None:
            allreduce_flat(grads, self.edp_group, 1.0 / dp)
        else:
            for g in grads:
                g.mul_(1.0 / dp)


def argument_roles(inner: nn.Module, top_k: int) -> tuple[str, ...]:
    """The order `inner` takes the experts interface's arguments in: its own for a module
    written so, or, for a traced pipeline chunk's module (torch's unflattened program orders a
    module's inputs by first use), read off its placeholders: the integer one is the index, the
    float (T, top_k) one the weights, the other the hidden states."""
    graph = getattr(inner, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return ROLES
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    roles = []
    for v in vals:
        if v is None or len(roles) >= 3:
            break
        roles.append(_value_role(v, top_k))
    if len(vals) != 3 or sorted(roles) != sorted(ROLES):
        raise PlanError(f"cannot tell the traced experts module's inputs apart (hidden, top-k index, top-k "
                        f"weights) from their shapes: {[tuple(v.shape) if v is not None else None for v in vals]}")
    return tuple(roles)


def program_calls(model: nn.Module, plan: Plan, only: Optional[Callable[[str], bool]] = None) -> dict[str, Any]:
    """For a stage run op by op as solved (`intra_op.execute.ShardedProgram.replace_modules`):
    per expert block of `plan` that `model` holds (its experts modules already replaced by
    `shard_experts`), the call that runs the block's ops as this rank's `ExpertParallelExperts`:
    the run's inputs (the hidden states, the top-k index and weights, in the program's order;
    replicated over tp, as the solution runs every op of the block) told apart by dtype and
    shape as `argument_roles` does, its one output the block's. `only`: see `shard_experts`."""
    out: dict[str, Any] = {}
    for b in plan.experts.blocks:
        if only is not None and not only(b.module):
            continue
        try:
            mod = model.get_submodule(b.module)
        except AttributeError:
            continue                        # a block of another pipeline chunk
        if not isinstance(mod, ExpertParallelExperts):
            continue

        def call(*vals: Any, mod: ExpertParallelExperts = mod, block: Any = b) -> tuple:
            # the tensors (sizes read from before the block are numbers: its shapes follow them),
            # told apart as `argument_roles` tells a traced module's inputs apart
            tensors = [v for v in vals if isinstance(v, torch.Tensor)]
            roles = [_value_role(v, block.top_k) for v in tensors]
            if len(tensors) != 3 or sorted(roles) != sorted(ROLES):
                raise PlanError(f"cannot run the ops of {block.module} with expert parallelism: they read "
                                f"{len(tensors)} tensors from before them ({', '.join(roles)}), not the hidden "
                                f"states, top-k index and top-k weights of the experts interface")
            got = dict(zip(roles, tensors))
            return (mod(*(got[r] for r in mod.roles)),)
        out[b.module] = call
    return out


def _value_role(v: torch.Tensor, top_k: int) -> str:
    """The experts interface's role of a tensor the block reads, from its dtype and shape: the
    integer one is the index, a float (T, top_k) one the weights, the other the hidden states."""
    return ("index" if not v.is_floating_point() else
            "weights" if v.dim() == 2 and v.shape[-1] == top_k else "hidden")


def expert_meshes(plan: Plan, device_type: str) -> dict[tuple[int, ...], DeviceMesh]:
    """Per stage device set, the (expert-dp, ep) mesh of its dp ranks (the devices in dp
    order), with tensor parallelism the (expert-dp, ep, tp) mesh (a (dp, tp) stage mesh: each
    tp coordinate's dp ranks form their own ep groups): ep consecutive dp ranks share one copy
    of every expert. Every rank builds every stage's, in stage order (their groups are made
    collectively)."""
    ep = plan.experts.ep
    out: dict[tuple[int, ...], DeviceMesh] = {}
    for s in sorted(plan.stages, key=lambda s: s.index):
        key = tuple(s.devices)
        if key not in out:
            tp = s.axis_size("tp")
            ids = torch.tensor(s.devices, dtype=torch.int)
            if plan.experts.folded:
                # the expert mesh over all the stage's ranks (tp innermost), and the dense tp
                # groups the folded blocks split their tokens over (`ExpertParallelExperts._folded`)
                out[key] = DeviceMesh(device_type, ids.view(len(s.devices) // ep, ep), mesh_dim_names=("edp", "ep"))
                out[key].fold_tp = DeviceMesh(device_type, ids.view(len(s.devices) // tp, tp),
                                              mesh_dim_names=("dp", "tp"))
                continue
            out[key] = (DeviceMesh(device_type, ids.view(len(s.devices) // ep, ep), mesh_dim_names=("edp", "ep"))
                        if tp == 1 else
                        DeviceMesh(device_type, ids.view(len(s.devices) // (ep * tp), ep, tp),
                                   mesh_dim_names=("edp", "ep", "tp")))
    return out


def eager_experts(traced: nn.Module, template: nn.Module, fqn: str) -> nn.Module:
    """The model's own experts module at `fqn` of `template` (the model on meta), holding the
    parameters and buffers of `traced`, a traced pipeline chunk's module of it, in their place.

    A chunk is traced once, on meta, at the micro-batch's shapes: its experts module has the
    pair count, the expert count and the token count of the one-process run baked into its ops
    (Hugging Face's grouped-GEMM path: `arange(pairs)`, `histc(bins=E)`, a view to (T, k, H)).
    Behind the token exchange it runs on a data-dependent number of rows of the rank's local
    experts, which only the model's code, run eagerly, does."""
    with unset_fake_temporarily():       # a meta module's copy, under verify's fake mode too
        eager = copy.deepcopy(template.get_submodule(fqn))
    for kind in ("parameters", "buffers"):
        mine = dict(getattr(eager, f"named_{kind}")(remove_duplicate=False))
        got = dict(getattr(traced, f"named_{kind}")(remove_duplicate=False))
        if kind == "parameters" and set(mine) != set(got):
            raise PlanError(f"the traced pipeline chunk's experts module {fqn} holds parameters "
                            f"{sorted(got)}, the model's {sorted(mine)}: cannot run it eagerly")
        for name, t in got.items():
            if name not in mine:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = eager.get_submodule(owner_name) if owner_name else eager
            if kind == "parameters":
                owner._parameters[leaf] = t
            else:
                owner._buffers[leaf] = t
    eager.train(traced.training)
    return eager


def shard_experts(model: nn.Module, plan: Plan, mesh: DeviceMesh, into: Optional[ExpertGroups] = None,
                  only: Optional[Callable[[str], bool]] = None, template: Optional[nn.Module] = None
                  ) -> ExpertGroups:
    """Replace each of the plan's experts modules that `model` (materialised: the whole model,
    or a pipeline chunk holding modules under their FQNs) has by an `ExpertParallelExperts`
    holding this rank's slice of its stacked weights, exchanging over `mesh` (this rank's
    stage's, `expert_meshes`); the parameters are added to `into` when given. `only`: which
    blocks (by module FQN) are this rank's (a solved pipeline's whole model holds every
    stage's; default all). `template`: the model on meta, for a traced pipeline chunk: its
    experts modules run as the model's own code (`eager_experts`), called in the chunk's
    argument order."""
    ex = plan.experts
    ep_group = mesh.get_group("ep")
    edp_group = mesh.get_group("edp") if mesh.size(0) > 1 else None
    ep_rank = mesh.get_local_rank("ep")
    etp = ex.expert_tp
    tp_group = mesh.get_group("tp") if etp > 1 else None
    tp_rank = mesh.get_local_rank("tp") if etp > 1 else 0
    fold = None
    if ex.folded and getattr(mesh, "fold_tp", None) is not None and mesh.fold_tp.size(1) > 1:
        fold = (mesh.fold_tp.get_group("tp"), mesh.fold_tp.size(1), mesh.fold_tp.get_local_rank("tp"))
    params: list[nn.Parameter] = into.params if into is not None else []
    names: dict[str, int] = into.names if into is not None else {}
    for b in ex.blocks:
        if only is not None and not only(b.module):
            continue
        parent_name, _, child = b.module.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
        except AttributeError:
            continue                         # a block of another pipeline chunk
        inner = getattr(parent, child, None)
        if inner is None:
            continue
        roles = argument_roles(inner, b.top_k)
        inner_roles = None
        if template is not None and isinstance(getattr(inner, "graph", None), torch.fx.Graph):
            traced = inner
            inner, inner_roles = eager_experts(inner, template, b.module), ROLES
            if getattr(traced, "_autopar_discard_acts", False):
                # norm_act: the activation regions the traced module ran (`runtime.discard`) on
                # the copy that runs in its place (they were lost: HF Mixtral ep 2 x pp 2
                # verified -17.3%, its SiLU products kept)
                from autopar.runtime.discard import discard_activations

                discard_activations(inner)
        per = b.num_experts // ex.ep
        for wi, w in enumerate(b.weights):
            name = w[len(b.module) + 1:]
            owner_name, _, pname = name.rpartition(".")
            owner = inner.get_submodule(owner_name) if owner_name else inner
            full = getattr(owner, pname)
            whole = _replicated_local(full.detach())     # tp (DTensor's path): replicated, plain here
            mine = whole[ep_rank * per:(ep_rank + 1) * per]
            if etp > 1:
                mine = _tp_slice(mine, *b.tp_split[wi], etp, tp_rank)
            local = nn.Parameter(mine.clone(), requires_grad=full.requires_grad)
            setattr(owner, pname, local)
            params.append(local)
            names[w] = id(local)
        if isinstance(getattr(inner, "num_experts", None), int):
            inner.num_experts = per          # Hugging Face's experts read their count from it
        setattr(parent, child, ExpertParallelExperts(inner, b.num_experts, ep_group, ex.ep, roles, inner_roles,
                                                     tp_group, fold))
    return into if into is not None else ExpertGroups(ex.ep, ep_rank, mesh, ep_group, edp_group, params, names,
                                                      etp=etp)


def _tp_slice(t: torch.Tensor, dim: int, pieces: int, tp: int, rank: int) -> torch.Tensor:
    """Expert tensor parallelism's slice of a stacked expert weight for tp rank `rank`: `dim`
    cut into `pieces` equal parts (a fused gate/up projection's halves), each part's `rank`-th
    of `tp` slices, concatenated (so the rank's gate and up columns pair up when its GEMM's
    output is chunked in two)."""
    parts = t.chunk(pieces, dim=dim)
    width = parts[0].shape[dim] // tp
    return torch.cat([p.narrow(dim, rank * width, width) for p in parts], dim=dim)
