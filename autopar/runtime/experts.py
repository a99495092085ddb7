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
the dense ones over dp as before. Checkpoints and `full_state` see each stacked weight whole
(`ExpertGroups.global_view`: a DTensor sharded over ep), so a checkpoint resumes in any
layout. Executed here: one pipeline stage without tensor parallelism or ZeRO
(`check_executable`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.runtime.tied_grads import allreduce_flat
from autopar.schema.errors import PlanError
from autopar.schema.plan import Plan


def check_executable(plan: Plan) -> None:
    """PlanError unless this runtime executes the plan's expert parallelism."""
    if plan.experts is None or plan.experts.ep == 1:
        return
    why = [w for w, bad in (("pipeline stages", plan.pp > 1), ("tensor parallelism", plan.tp > 1),
                            (f"ZeRO stage {plan.zero_stage}", plan.zero_stage > 0),
                            ("op-by-op layouts", any(s.op_layouts is not None for s in plan.stages))) if bad]
    if why:
        raise PlanError(f"expert parallelism (ep={plan.experts.ep}) is executed on one pipeline stage without "
                        f"tensor parallelism or ZeRO in this version; the plan has {', '.join(why)}: re-plan "
                        f"with Constraints(pp=1, tp=1, zero_stage=0) or ep=1")


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


class ExpertParallelExperts(nn.Module):
    """The model's experts module (`inner`, holding this rank's experts [rank E/ep, (rank+1)
    E/ep)) behind the token exchange over `group` (the module docstring). Called as the module
    it replaces: (hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)."""

    def __init__(self, inner: nn.Module, num_experts: int, group: dist.ProcessGroup, ep: int) -> None:
        super().__init__()
        # the inner module's parameters and children registered here under their own names,
        # so the model's parameter names stay those of the plan and the one-process model
        self._inner = (inner,)
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, p in inner.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.num_experts, self.ep, self.group = num_experts, ep, group
        self.local = num_experts // ep

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, k = top_k_index.shape
        E, ep, L = self.num_experts, self.ep, self.local
        ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        rows = hidden[perm // k]
        counts = torch.bincount(ids, minlength=E)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        send_split = counts.view(ep, L).sum(1).tolist()
        recv_split = recv.view(ep, L).sum(1).tolist()
        got = _AllToAll.apply(rows, recv_split, send_split, self.group)
        # received: by source rank, then by local expert; grouped by local expert for the GEMMs
        local_ids = torch.repeat_interleave(torch.arange(L, device=recv.device).repeat(ep), recv)
        lid, order = torch.sort(local_ids, stable=True)
        y = self._inner[0](got[order], lid.unsqueeze(1), torch.ones(lid.shape[0], 1, dtype=top_k_weights.dtype,
                                                                  device=lid.device))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0], device=order.device)
        out_rows = _AllToAll.apply(y[back], send_split, recv_split, self.group)
        out_rows = out_rows * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(out_rows.dtype)
        out = torch.zeros((T,) + tuple(hidden.shape[1:]), dtype=out_rows.dtype, device=hidden.device)
        return out.index_add(0, perm // k, out_rows).to(hidden.dtype)


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

    def global_view(self, t: torch.Tensor) -> DTensor:
        """A local expert slice (a parameter or its optimizer state) as the DTensor of the whole
        stack: sharded over ep on dim 0, replicated over the expert-dp copies. Checkpoints store
        it so (`runtime.checkpoint`: any layout resumes it) and `full_state` gathers it; shares
        `t`'s storage, so a checkpoint load fills the live slice."""
        return DTensor.from_local(t, self.mesh, [Replicate(), Shard(0)], run_check=False)

    def sync(self, dp: int) -> None:
        """Average the expert gradients as the one-process run: summed over their copies (each
        holds the gradient of its ep group's tokens), over the dp replicas of the batch."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.edp_group is not None:
            allreduce_flat(grads, self.edp_group, 1.0 / dp)
        else:
            for g in grads:
                g.mul_(1.0 / dp)


def expert_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The (expert-dp, ep) mesh of the stage's dp ranks: ep consecutive ranks share one copy of
    every expert. Every rank builds it (its groups are made collectively)."""
    ep = plan.experts.ep
    devs = sorted(plan.stages, key=lambda s: s.index)[0].devices   # one stage, tp = 1: dp order
    return DeviceMesh(device_type, torch.tensor(devs, dtype=torch.int).view(len(devs) // ep, ep),
                      mesh_dim_names=("edp", "ep"))


def shard_experts(model: nn.Module, plan: Plan, device_type: str) -> ExpertGroups:
    """Replace each of the plan's experts modules in `model` (materialised) by an
    `ExpertParallelExperts` holding this rank's slice of its stacked weights."""
    ex = plan.experts
    mesh = expert_mesh(plan, device_type)
    ep_group = mesh.get_group("ep")
    edp_group = mesh.get_group("edp") if mesh.size(0) > 1 else None
    ep_rank = mesh.get_local_rank("ep")
    params: list[nn.Parameter] = []
    names: dict[str, int] = {}
    for b in ex.blocks:
        parent_name, _, child = b.module.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        inner = getattr(parent, child)
        per = b.num_experts // ex.ep
        for w in b.weights:
            name = w[len(b.module) + 1:]
            owner_name, _, pname = name.rpartition(".")
            owner = inner.get_submodule(owner_name) if owner_name else inner
            full = getattr(owner, pname)
            local = nn.Parameter(full.detach()[ep_rank * per:(ep_rank + 1) * per].clone(),
                                 requires_grad=full.requires_grad)
            setattr(owner, pname, local)
            params.append(local)
            names[w] = id(local)
        if isinstance(getattr(inner, "num_experts", None), int):
            inner.num_experts = per          # Hugging Face's experts read their count from it
        setattr(parent, child, ExpertParallelExperts(inner, b.num_experts, ep_group, ex.ep))
    return ExpertGroups(ex.ep, ep_rank, mesh, ep_group, edp_group, params, names)
