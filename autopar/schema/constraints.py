"""User constraints on the plan search: any field left None is searched."""

from __future__ import annotations

from typing import Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cost_models.schedules import SCHEDULES as _REGISTRY

# the names of `cost_models.schedules.SCHEDULES`, the one registry of pipeline schedules (a
# Literal for the schema's validation; checked against the registry here)
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
assert SCHEDULES == tuple(_REGISTRY), "Schedule must name the registered schedules"
# recomputation policies, the one registry: "none"; "norm_act" Megatron-Core's output-discarding
# recomputation of each block's norms and the routed experts' activation (`--recompute-modules
# layernorm moe_act`: their outputs freed once the next op saved them, re-made in the backward,
# `cost_models.memory.norm_act_regions`, `runtime.discard`); "selective" the attention core's
# ops alone (Korthikanti et al. 2022); "attention" the module holding the attention core,
# checkpointed whole (its projections too: with a fused attention kernel the core alone frees
# almost nothing, the module frees its projections' inputs and outputs); "full" each repeated
# block. Listed by the forward each usually re-runs (element-wise ops < core < its module < the
# block); the search takes the fastest that fits, whatever the order (`inter_op.search`)
Recompute = Literal["none", "norm_act", "selective", "attention", "full"]
RECOMPUTES: tuple[str, ...] = get_args(Recompute)
# the parts of a model outside its repeated blocks that can take a pipeline layer slot of their
# own (Megatron-Core's --account-for-embedding-in-pipeline-split and
# --account-for-loss-in-pipeline-split, megatron/core/transformer/transformer_block.py
# `get_num_layers_to_build`): "embedding", the ops before the first block; "loss", the ops after
# the last (final norm, output layer, loss). The one registry (`inter_op.layers.build_layers`)
SplitSlot = Literal["embedding", "loss"]
SPLIT_SLOTS: tuple[str, ...] = get_args(SplitSlot)
# when ZeRO-3 reduce-scatters gradients of a step of several micro-batches (`Plan.zero3_grad_sync`)
Zero3GradSync = Literal["step", "microbatch"]


class Constraints(BaseModel):
    """Pins parts of the plan. `dp * cp * tp * pp` must equal the device count when all are set
    (cp: 1 when unset and not searched)."""

    model_config = ConfigDict(extra="forbid")

    dp: Optional[int] = Field(default=None, ge=1, description="data-parallel degree")
    tp: Optional[int] = Field(default=None, ge=1, description="tensor-parallel degree")
    pp: Optional[int] = Field(default=None, ge=1, description="number of pipeline stages")
    microbatch_size: Optional[int] = Field(default=None, ge=1)
    num_microbatches: Optional[int] = Field(default=None, ge=1)
    schedule: Optional[Schedule] = None
    virtual_stages: Optional[int] = Field(default=None, ge=1, description="model chunks per device (interleaved)")
    recompute: Optional[Recompute] = None
    zero_stage: Optional[int] = Field(default=None, ge=0, le=3)
    zero3_grad_sync: Optional[Zero3GradSync] = Field(
        default=None, description="when ZeRO-3 reduce-scatters the gradients of a step of several micro-batches: "
        "\"step\", once, in the last micro-batch's backward (the others accumulate unsharded gradients: "
        "fewer collectives, a whole gradient per parameter held); \"microbatch\", in every micro-batch's "
        "backward, each unit's gradient reduce-scattered as its backward ends and its fp32 shard accumulated "
        "(Megatron-FSDP's and the distributed optimizer's way: m reduce-scatters, 4 / dp bytes a parameter); "
        "None: \"step\", or \"microbatch\" where that does not fit (one pipeline stage only: "
        "torch.pipelining syncs after the last micro-batch)")
    ep: Optional[int] = Field(default=None, ge=1, description="expert-parallel degree of a mixture-of-experts "
                              "model: its routed experts sharded over groups of ep data-parallel ranks (ep "
                              "divides dp and the expert count; or, folded, over ep of the stage's dp x tp ranks, "
                              "ep dividing dp x tp: see expert_dp), tokens exchanged by all-to-all; None: searched "
                              "where the model has experts (1 for a dense model)")
    expert_tp: Optional[int] = Field(default=None, ge=1, description="expert tensor parallelism of a mixture-of-"
                                     "experts model with ep > 1: 1, its experts replicated over tp; tp, each "
                                     "expert's projections split over the tp ranks (Megatron-Core's ETP; the "
                                     "expert weights' hidden dim divisible by tp); None: searched (both where "
                                     "tp > 1 and the dims divide)")
    expert_dp: Optional[int] = Field(default=None, ge=1, description="copies of each expert (expert data "
                                     "parallelism) of a mixture-of-experts model: dp / ep, the experts replicated "
                                     "over tp or split over it (expert_tp), or dp x tp / ep, the expert mesh folded "
                                     "over the stage's dp x tp ranks (Megatron-Core's MoE parallel folding, "
                                     "expert_tp 1; what Megatron calls EDP); None: searched. An ep above dp "
                                     "(dividing dp x tp) is folded")
    account_in_split: Optional[tuple[SplitSlot, ...]] = Field(
        default=None, description="the parts outside the repeated blocks cut into pipeline chunks as layer "
        "slots of their own: \"embedding\" (the ops before the first block) and/or \"loss\" (the ops after the "
        "last: final norm, output layer, loss), as Megatron-Core's --account-for-embedding-in-pipeline-split / "
        "--account-for-loss-in-pipeline-split: a chunk may then hold the embedding or the loss alone, and a "
        "model of L blocks has up to L + 2 slots for pp x virtual_stages chunks; () joins them to the first and "
        "last block; None: both where the pinned pp x virtual_stages exceeds the blocks, else none (a free "
        "search does not try them)")
    stage_tp: Optional[tuple[int, ...]] = Field(
        default=None, min_length=1, description="the tensor-parallel degree of each pipeline stage, in "
        "model order (Alpa's sub-mesh choice: stages may differ, e.g. (1, 1, 2)); sets pp to its length and "
        "dp to the devices over sum(stage_tp); each stage's dp x tp devices a power-of-two slice of a node or "
        "whole nodes; not with the interleaved schedule")
    cp: Optional[int] = Field(
        default=None, ge=1, description="context-parallel degree: every sample's sequence split over cp ranks "
        "(two chunks each, causal load balance), the attention all-gathering keys and values over them; a "
        "power of two with 2 x cp dividing the sequence; None: searched where the sequence is long "
        "(`inter_op.context_parallel.LONG_SEQUENCE`) or no plan fits without it")
    sequence_parallel: Optional[bool] = Field(
        default=None, description="Megatron-SP on the tensor-parallel axis (norms, dropout and residual "
        "adds on sequence slices, the residual stream split along its tokens between layers; needs the "
        "intra-op ILP); None: the search tries both where tp > 1 (with the ILP; off with the analytic rules)")

    @field_validator("account_in_split")
    @classmethod
    def _distinct(cls, v: Optional[tuple[str, ...]]) -> Optional[tuple[str, ...]]:
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"account_in_split {v}: name each of {', '.join(SPLIT_SLOTS)} at most once")
        return v

    @field_validator("stage_tp")
    @classmethod
    def _positive(cls, v: Optional[tuple[int, ...]]) -> Optional[tuple[int, ...]]:
        if v is not None and any(t < 1 for t in v):
            raise ValueError(f"stage_tp {v}: every degree must be at least 1")
        return v

    def pinned(self) -> dict[str, object]:
        return {k: v for k, v in self.model_dump().items() if v is not None}
