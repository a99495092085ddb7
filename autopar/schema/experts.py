"""How a plan places a mixture-of-experts model's routed experts (`Plan.experts`).

Expert parallelism is a sub-axis of data parallelism (Megatron-Core's and torchtitan's layout):
every stage's dp ranks still split the batch and hold the dense weights; consecutive groups of
`ep` dp ranks split each expert block's experts (rank i of a group holds experts
[i E/ep, (i+1) E/ep)), exchanging the token-expert pairs with `all_to_all_single` and split sizes
counted at run time (dropless: no token is dropped, so the exchange's sizes vary with the
routing); the dp/ep groups of ranks holding the same experts average their gradients (expert
data parallelism). The stage meshes keep their ("dp", "tp") axes: ep refines the dp axis and is
recorded here.

With tensor parallelism the experts are replicated over tp (`expert_tp` 1: each tp coordinate's
dp ranks form their own ep groups) or split over it (`expert_tp` = tp, Megatron-Core's expert
tensor parallelism): each expert's input projection column-parallel and its output projection
row-parallel over the stage's tp ranks (the dim of each stacked weight that is not the token
width, `ExpertBlockPlan.tp_split`), the experts' output all-reduced over tp in the forward and
the gradient of their (replicated) input in the backward.

Folded (`folded`, Megatron-Core's MoE parallel folding, Liu et al. 2025, arXiv 2504.14960): the
expert layers get their own mesh over the stage's ranks, (expert_dp, ep) with ep x expert_dp =
dp x tp, independent of the dense (dp, tp) one: ep consecutive ranks of the stage (in its device
order, tp innermost) share one copy of every expert, so ep may exceed dp (drawn across the tp and
dp ranks), and the ranks ep apart hold the same experts (expert data parallelism over the tp
ranks too). The experts are not split over tp (expert_tp 1); each tp rank takes 1/tp of the
block's tokens (replicated over tp in the dense layers), exchanges them over its ep group, and
the block's output is all-gathered over tp (the gradient of its inputs likewise in the backward).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# how "node_deduplicated_all_to_all" moves a token (`autopar.inter_op.experts.ExpertCosting.exchange_time`)
NODE_NOTE = (": over the network once to each node holding any of its experts, over NVLink once to each rank "
             "there, the two at once, DeepEP's internode kernels")
TokenExchange = Literal["dropless_all_to_all", "deduplicated_all_to_all", "node_deduplicated_all_to_all"]


class ExpertBlockPlan(BaseModel):
    """One expert block: the module the runtime replaces and its stacked weights."""

    model_config = ConfigDict(extra="forbid")

    module: str = Field(description="FQN of the experts module (called as (hidden, top_k_index, top_k_weights))")
    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    weights: list[str] = Field(min_length=1, description="parameter FQNs stacked over experts on dim 0")
    tp_split: list[tuple[int, int]] = Field(
        default_factory=list, description="per weight, (dim, pieces): how expert tensor parallelism splits "
        "it over tp: the dim that is not the token width, cut into `pieces` equal parts (2 for a fused "
        "gate/up projection, whose halves are each split) and each part split over the tp ranks; empty where "
        "the weights' dims do not allow it (the experts then stay replicated over tp)")


class ExpertParallelism(BaseModel):
    """The experts' placement and what its exchange costs, per micro-batch."""

    model_config = ConfigDict(extra="forbid")

    ep: int = Field(ge=1, description="ranks sharing one copy of every expert (divides dp; folded: divides dp x tp)")
    expert_dp: int = Field(ge=1, description="copies of each expert (dp / ep; folded: dp x tp / ep): its "
                           "gradients are averaged over them")
    blocks: list[ExpertBlockPlan] = Field(min_length=1)
    exchange: TokenExchange = "dropless_all_to_all"
    imbalance: float = Field(ge=1.0, description="the most-loaded rank's token-expert pairs over the mean, "
                             "costed in the exchange and the expert GEMMs (an estimate; 1 under fake balanced "
                             "routing, SoftwareSpec.expert_routing)")
    dispatch_bytes: float = Field(ge=0, description="bytes one rank sends in one block's dispatch, per "
                                  "micro-batch (token-expert pairs x width x element size, the imbalance "
                                  "included; deduplicated: tokens x the ranks each reaches, SoftwareSpec."
                                  "expert_dispatch 'ranks'; the combine returns as many; node deduplicated, "
                                  "SoftwareSpec.expert_dispatch 'nodes' over several nodes: the rows NVLink "
                                  "carries, the network a token once per node holding its experts)")
    expert_tp: int = Field(default=1, ge=1, description="expert tensor parallelism: 1, the experts replicated "
                           "over tp; tp, each expert's projections split over the stage's tp ranks (input "
                           "projections column-parallel, output projection row-parallel), its output "
                           "all-reduced over tp (forward) and its input's gradient (backward)")
    folded: bool = Field(default=False, description="MoE parallel folding: the expert mesh (expert_dp, ep) "
                         "over the stage's dp x tp ranks (ep consecutive ranks, tp innermost), each tp rank taking "
                         "1/tp of the block's tokens, the block's output all-gathered over tp (its inputs' "
                         "gradient in the backward); expert_tp 1")

    def summary(self) -> str:
        """What `autopar show` prints about the experts."""
        b = self.blocks[0]
        per = b.num_experts // self.ep
        etp = (f"; each expert tensor-parallel over tp={self.expert_tp} (expert_tp: gate/up projections "
               f"column-parallel, down projection row-parallel, the output all-reduced over tp)"
               if self.expert_tp > 1 else "")
        where = ("consecutive ranks of the stage's dp x tp ranks (folded: the expert mesh apart from the dense "
                 "one, each tp rank taking 1/tp of the tokens, the output all-gathered over tp)" if self.folded
                 else "consecutive dp ranks")
        return (f"experts: {len(self.blocks)} blocks of {b.num_experts} routed experts (top-{b.top_k}), ep={self.ep}: "
                f"{per} expert{'s' if per > 1 else ''} per rank in groups of {self.ep} {where}, "
                f"each expert held by {self.expert_dp} rank{'s' if self.expert_dp > 1 else ''} (expert data "
                f"parallelism); tokens exchanged by all_to_all ({self.exchange.replace('_', ' ')}"
                f"{NODE_NOTE if self.exchange == 'node_deduplicated_all_to_all' else ''}, "
                f"{self.dispatch_bytes / 2**20:.3g} MiB sent per rank, block and micro-batch each way, "
                f"routing imbalance {self.imbalance:g}x{', an estimate' if self.imbalance > 1 else ''}){etp}")
