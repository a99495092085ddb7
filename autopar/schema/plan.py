"""The plan: what `autopar.plan` returns, `autopar show` prints and `autopar run` executes.

Versioned JSON (`format_version`); a file written by a newer autopar is refused with a message,
never misread. Mesh axes of a stage are named by their kind (`schema.mesh_axes`): "dp" axes split the
batch (parameters replicated, or sharded when ZeRO is on), "cp" axes split every sequence
(context parallelism), "tp" axes hold the tensor-parallel placements in `placements`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from autopar.schema.cluster import ClusterSpec, validation_message
from autopar.schema.constraints import Recompute, Schedule, Zero3GradSync
from autopar.schema.errors import PlanError
from autopar.schema.experts import ExpertParallelism
from autopar.schema.layouts import StageLayouts
from autopar.schema.mesh_axes import MESH_AXIS_KINDS
from autopar.schema.placement import Placement  # "R", "S(d)" or "P", validated
from autopar.schema.software import SoftwareSpec, preset_for_attention_kernel

# 15: recompute "norm_act" (Megatron-Core's output-discarding recomputation of the norms and the
# routed experts' activation) and `StagePlan.recompute_acts`; a reader of 14 or earlier does not
# know the value; plans of 14 and earlier read as they were;
# 14: `Plan.zero3_grad_sync` (ZeRO-3's gradients reduce-scattered in every micro-batch's
# backward; a reader of 13 or earlier would hold them unsharded until the last one); plans of 13
# and earlier have none and read as "step";
# 13: `Plan.experts.folded` (MoE parallel folding: the expert mesh over the stage's dp x tp
# ranks, ep may exceed dp; a reader of 12 or earlier would take ep for a sub-axis of dp); plans
# of 12 and earlier have none and read as not folded;
# 12: `Plan.experts.expert_tp` (expert tensor parallelism, each expert split over tp, and the
# blocks' `tp_split`; a reader of 11 or earlier would run the experts replicated over tp);
# plans of 11 and earlier have none and read as expert_tp 1;
# 11: the "cp" mesh axis kind (context parallelism, `schema.mesh_axes`; a reader of 10 or earlier
# would take a cp rank for a data-parallel one); plans of 10 and earlier have no cp axis and read
# as they were;
# 10: recompute "attention" (the module holding each attention core checkpointed whole, its
# `recompute_modules`; a reader of 9 or earlier does not know the value);
# 9: `StagePlan.recompute_ops` (selective recomputation of the attention core's ops, torch's
# selective checkpoint; a plan of 8 or earlier checkpoints its "selective" modules whole);
# 8: `Plan.experts` (expert parallelism of a mixture-of-experts model; plans of 7 and earlier
# have none and read as such); 7: the software the plan assumes (`Plan.software`; the device's
# attention_kernel moved there) and `Plan.sequence_parallel`; 4: pipeline chunks carry
# op_layouts (`StageLayouts.receives`); 3 added op_layouts
PLAN_FORMAT_VERSION = 15

TrainingDtype = Literal["fp32", "bf16", "fp16"]
TRAINING_DTYPES: tuple[str, ...] = get_args(TrainingDtype)



class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelInfo(_Model):
    """What the plan was made for; `fingerprint` identifies the captured graph."""

    name: str
    num_params: int = Field(ge=0)
    fingerprint: str
    num_layers: int = Field(ge=1)
    flops_per_sample: float = Field(ge=0, description="training FLOPs of one sample (fwd+bwd, no recompute)")
    tokens_per_sample: int = Field(default=1, ge=1)


MemoryPhase = Literal["forward_backward", "grad_sync", "optimizer_step"]


class PhasePrediction(_Model):
    """Per-device memory at the peak of one phase of the step, by category (they add up to
    `peak_memory_bytes`): what a tracker's per-phase peak is compared with."""

    weights_bytes: float = Field(ge=0)
    gradients_bytes: float = Field(ge=0)
    optimizer_bytes: float = Field(ge=0)
    activations_bytes: float = Field(ge=0)
    buffers_bytes: float = Field(ge=0)
    peak_memory_bytes: float = Field(ge=0)


class StagePrediction(_Model):
    """Per-iteration time split and per-device memory of one stage. The memory figures are
    those at the device's peak, reached in `peak_phase` of the step; they add up to
    `peak_memory_bytes`."""

    compute_s: float = Field(ge=0)
    communication_s: float = Field(ge=0)
    bubble_s: float = Field(ge=0)
    weights_bytes: float = Field(ge=0)
    gradients_bytes: float = Field(ge=0)
    optimizer_bytes: float = Field(ge=0, description="optimizer moments and fp32 master weights")
    activations_bytes: float = Field(ge=0, description="saved activations in flight, recomputation's working set")
    buffers_bytes: float = Field(default=0, ge=0, description="the runtime's transient buffers (flat "
                                 "communication buffers, gathered ZeRO-3 layers)")
    peak_phase: MemoryPhase = "forward_backward"
    peak_memory_bytes: float = Field(ge=0)
    # each phase's own peak (the one in `peak_phase` is the figures above); empty in plans of
    # format_version 5 and earlier
    phases: dict[MemoryPhase, PhasePrediction] = Field(default_factory=dict)


def _folded(fqns: list[str]) -> str:
    """Module FQNs with their block indices folded: `blocks.*.attn (24)`."""
    return _fold_counts(fqns, r"\.\d+(?=\.|$)", ".*")


def _folded_ops(names: list[str]) -> str:
    """Op names with their per-copy suffixes folded: `matmul (48), softmax (24)`."""
    return _fold_counts(names, r"_\d+$", "")


def _fold_counts(names: list[str], pattern: str, repl: str) -> str:
    """`names` with `pattern` replaced by `repl`, each distinct result once with its count."""
    import re

    counts: dict[str, int] = {}
    for n in names:
        k = re.sub(pattern, repl, n)
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k} ({c})" if c > 1 else k for k, c in counts.items())


class StagePlan(_Model):
    """One pipeline stage: its devices, logical mesh, layers and shardings."""

    index: int = Field(ge=0)
    devices: list[int] = Field(min_length=1, description="global ranks, row-major over mesh_shape")
    mesh_shape: tuple[int, ...] = Field(min_length=1)
    mesh_axis_names: tuple[str, ...] = Field(min_length=1)
    layers: list[str] = Field(min_length=1, description="module FQNs of the layers, in order")
    recompute: Recompute = "none"
    recompute_modules: Optional[list[str]] = Field(
        default=None, description="the modules recomputation runs in, found by the planner from the captured "
        "ops: under \"full\" each repeated block, checkpointed whole (torch.utils.checkpoint); under "
        "\"selective\" the module holding each attention core, where a stage run module by module recomputes "
        "the ops of `recompute_ops` (or, in a plan without them, format_version 8 and earlier, checkpoints the "
        "module whole); under \"attention\" that module, checkpointed whole (its projections too); under "
        "\"norm_act\" each block's norm modules, whose outputs are freed once read and re-made in the backward "
        "(Megatron-Core's output-discarding recomputation, `runtime.discard`); null with recompute \"none\"")
    recompute_acts: Optional[list[str]] = Field(
        default=None, description="under \"norm_act\": the experts modules whose activation (from the activation "
        "call through the element-wise ops after it, up to the output projection) is freed once read and re-made "
        "in the backward, Megatron-Core's \"moe_act\"; empty for a model without routed experts; null under "
        "the other policies")
    recompute_ops: Optional[list[str]] = Field(
        default=None, description="under \"selective\": the captured ops re-run in the backward (each "
        "layer's attention core, the ops from its score matmul to its product with V or one fused attention "
        "op), run under torch's selective activation checkpoint, these ops MUST_RECOMPUTE and every other op "
        "saving as without recomputation; null under the other policies")
    placements: dict[str, tuple[Placement, ...]] = Field(
        default_factory=dict, description="parameter FQN -> placement per mesh axis")
    virtual_chunk: int = Field(default=0, ge=0, description="model chunk index under interleaving")
    fsdp_units: Optional[list[str]] = Field(
        default=None, description="ZeRO-3: the modules FSDP shards as their own units, in order (the stage's "
        "root unit holds the other parameters); null without ZeRO-3")
    op_layouts: Optional[StageLayouts] = Field(
        default=None, description="the solved layout of every op on the stage's tp axis, which `autopar run` "
        "executes op by op; null without tp (a tp stage without them is refused by `autopar run`: "
        "Plan.search['tp_executor'] says why the planner made none)")
    predicted: Optional[StagePrediction] = None

    @model_validator(mode="after")
    def _check(self) -> "StagePlan":
        n = 1
        for s in self.mesh_shape:
            n *= s
        if n != len(self.devices):
            raise ValueError(f"mesh_shape {self.mesh_shape} holds {n} devices but devices lists {len(self.devices)}")
        if len(self.mesh_axis_names) != len(self.mesh_shape):
            raise ValueError("mesh_axis_names needs one name per mesh axis")
        bad = [a for a in self.mesh_axis_names if a not in MESH_AXIS_KINDS]
        if bad:
            raise ValueError(f"mesh_axis_names: {bad[0]!r} is not a mesh axis kind; one of "
                             f"{', '.join(MESH_AXIS_KINDS)}")
        for fqn, pl in self.placements.items():
            if len(pl) != len(self.mesh_shape):
                raise ValueError(f"placements[{fqn!r}] needs one entry per mesh axis")
        if self.recompute_ops is not None and self.recompute != "selective":
            raise ValueError(f"recompute_ops names the ops selective recomputation re-runs, but recompute is "
                             f"{self.recompute!r}; drop recompute_ops or set recompute to \"selective\"")
        if self.recompute_acts is not None and self.recompute != "norm_act":
            raise ValueError(f"recompute_acts names the experts modules \"norm_act\" recomputes the activation of, "
                             f"but recompute is {self.recompute!r}; drop recompute_acts or set recompute to "
                             f"\"norm_act\"")
        if self.recompute == "norm_act" and self.recompute_acts is None:
            raise ValueError("recompute=\"norm_act\" needs recompute_acts, the experts modules whose activation "
                             "it recomputes ([] for a model without routed experts); re-plan with `autopar plan`")
        if self.recompute != "none" and self.recompute_modules is None:
            raise ValueError(f"recompute={self.recompute!r} needs recompute_modules, the modules to checkpoint "
                             f"(plans of format_version 4 and earlier predate them); re-plan with `autopar plan`")
        if self.op_layouts is not None and self.op_layouts.mesh_axis not in self.mesh_axis_names:
            raise ValueError(f"op_layouts are for mesh axis {self.op_layouts.mesh_axis!r}, which the stage "
                             f"does not have")
        return self

    def sharding_summary(self, limit: int = 8) -> str:
        """The non-replicated weights, with layer indices folded (`blocks.*.mlp.fc.weight`)."""
        import re

        seen: dict[str, tuple[str, ...]] = {}
        for fqn, pl in self.placements.items():
            if any(x != "R" for x in pl):
                seen.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), pl)
        items = [f"{k} [{', '.join(f'{a}:{x}' for a, x in zip(self.mesh_axis_names, v))}]"
                 for k, v in list(seen.items())[:limit]]
        more = f" (+{len(seen) - limit} more)" if len(seen) > limit else ""
        return "".join(f"\n  {i}" for i in items) + (f"\n  {more.strip()}" if more else "")

    def recompute_summary(self) -> str:
        """What the backward re-runs, folded: `selective: ops scaled_dot_product_attention (24)`."""
        if self.recompute == "selective" and self.recompute_ops is not None:
            return f"selective: ops {_folded_ops(self.recompute_ops) or 'none (no attention core)'}"
        if not self.recompute_modules:
            # a chunk of no repeated block (the embedding or the loss alone: `account_in_split`)
            return f"{self.recompute}: nothing to recompute (no repeated block in this chunk)"
        if self.recompute == "selective":
            return f"selective: modules {_folded(self.recompute_modules or [])} checkpointed whole"
        if self.recompute == "norm_act":
            acts = f"; activations in {_folded(self.recompute_acts)}" if self.recompute_acts else ""
            return (f"norm_act: outputs discarded and re-made: norms {_folded(self.recompute_modules or []) or 'none'}"
                    f"{acts}")
        return f"{self.recompute}: modules {_folded(self.recompute_modules or [])} checkpointed whole"

    def axis_size(self, name: str) -> int:
        """Product of the sizes of axes called `name` (1 when there is none)."""
        n = 1
        for a, s in zip(self.mesh_axis_names, self.mesh_shape):
            if a == name:
                n *= s
        return n


class Prediction(_Model):
    """The cost model's prediction for one training iteration."""

    iteration_time_s: float = Field(ge=0)
    samples_per_s: float = Field(ge=0)
    tokens_per_s: float = Field(ge=0)
    tflops_per_device: float = Field(ge=0)
    peak_memory_bytes: float = Field(ge=0, description="largest per-device peak over stages")
    usable_memory_bytes: float = Field(default=0, ge=0, description="what a plan may fill of a device: "
                                       "its memory less the headroom kept for the allocator and runtime")
    collectives: dict[str, int] = Field(default_factory=dict, description="one step, by kind")
    compute_s: float = Field(default=0, ge=0)
    communication_s: float = Field(default=0, ge=0)
    bubble_s: float = Field(default=0, ge=0)


class Plan(_Model):
    """A complete parallel training plan."""

    format_version: int = PLAN_FORMAT_VERSION
    autopar_version: str = ""
    model: ModelInfo
    cluster: ClusterSpec
    software: SoftwareSpec = Field(description="what the training software does on the cluster (attention "
                                   "kernel, overlap of the gradient sync), as the predictions assume it")
    dtype: TrainingDtype = "bf16"
    global_batch_size: int = Field(ge=1)
    microbatch_size: int = Field(ge=1)
    num_microbatches: int = Field(ge=1)
    schedule: Schedule = "1f1b"
    virtual_stages: int = Field(default=1, ge=1)
    zero_stage: int = Field(default=0, ge=0, le=3)
    zero3_grad_sync: Zero3GradSync = Field(
        default="step", description="under ZeRO-3 with several micro-batches: \"step\", the gradients "
        "accumulated unsharded and reduce-scattered in the last micro-batch's backward; \"microbatch\", "
        "reduce-scattered in every micro-batch's backward (each unit as its backward ends), their fp32 shards "
        "accumulated (one pipeline stage)")
    sequence_parallel: bool = Field(default=False, description="Megatron-SP on the tp axis: the stages' "
                                    "op_layouts split norms, dropout and residual adds along the tokens")
    stages: list[StagePlan] = Field(min_length=1)
    experts: Optional[ExpertParallelism] = Field(default=None, description="where a mixture-of-experts model's "
                                                 "routed experts live (expert parallelism); null: replicated "
                                                 "like the other weights, or a dense model")
    predicted: Prediction
    search: dict[str, float | int | str] = Field(default_factory=dict, description="search statistics")

    @model_validator(mode="before")
    @classmethod
    def _software_from_device(cls, data: Any) -> Any:
        """A plan without `software` (format_version 6 and earlier, or built without one): its
        device's `attention_kernel`, the only software choice before software was apart from
        hardware (the gradient sync never overlapped), becomes the preset with those choices
        (`preset_for_attention_kernel`: fused "autopar", unfused "megatron-lm-2021"), the field
        leaves the device, and the plan is of this format_version."""
        if not isinstance(data, dict) or "software" in data:
            return data
        cluster = data.get("cluster")
        device = cluster.get("device") if isinstance(cluster, dict) else getattr(cluster, "device", None)
        if isinstance(device, dict):
            kernel = device.get("attention_kernel", "fused")
            if kernel not in ("fused", "unfused"):
                return data                 # the device's validation names the field
            device = {k: v for k, v in device.items() if k != "attention_kernel"}
            if isinstance(device.get("sources"), dict):
                device["sources"] = {k: v for k, v in device["sources"].items() if k != "attention_kernel"}
            cluster = {**cluster, "device": device}
        else:
            kernel = getattr(device, "legacy_attention_kernel", None) or "fused"
        out = {**data, "software": preset_for_attention_kernel(kernel).model_dump()}
        if cluster is not None:
            out["cluster"] = cluster
        if isinstance(data.get("format_version"), int):
            out["format_version"] = max(data["format_version"], PLAN_FORMAT_VERSION)
        return out

    @model_validator(mode="after")
    def _check(self) -> "Plan":
        used = [d for s in self.stages for d in s.devices]
        if any(d < 0 or d >= self.cluster.num_devices for d in used):
            raise ValueError(f"stage devices must be ranks in [0, {self.cluster.num_devices})")
        dp = self.stages[0].axis_size("dp")
        if self.zero_stage == 3 and dp * self.stages[0].axis_size("cp") > 1:
            missing = [s.index for s in self.stages if s.fsdp_units is None]
            if missing:
                raise ValueError(f"stage {missing[0]} has no fsdp_units, which a ZeRO-3 plan needs (plans of "
                                 f"format_version 1 predate them); re-plan with `autopar plan`")
        if self.zero3_grad_sync == "microbatch" and (self.zero_stage != 3 or self.pp > 1):
            raise ValueError(f"zero3_grad_sync=\"microbatch\" needs zero_stage 3 and one pipeline stage (torch."
                             f"pipelining syncs a stage's gradients after its last micro-batch); this plan has "
                             f"zero_stage {self.zero_stage} and pp {self.pp}: set zero3_grad_sync to \"step\"")
        if self.experts is not None and self.experts.folded:
            ranks = dp * self.stages[0].axis_size("tp")
            if self.experts.expert_dp * self.experts.ep != ranks or self.experts.expert_tp != 1:
                raise ValueError(f"experts (folded): ep={self.experts.ep} x expert_dp={self.experts.expert_dp} must "
                                 f"equal the stage's dp x tp = {ranks} ranks, with expert_tp 1")
        elif self.experts is not None and (dp % self.experts.ep or self.experts.expert_dp * self.experts.ep != dp):
            raise ValueError(f"experts: ep={self.experts.ep} x expert_dp={self.experts.expert_dp} must equal the "
                             f"data-parallel degree {dp}")
        if self.experts is not None and self.experts.expert_tp > 1:
            tps = {s.axis_size("tp") for s in self.stages}
            if tps != {self.experts.expert_tp}:
                raise ValueError(f"experts: expert_tp={self.experts.expert_tp} must be 1 or the stages' tensor-"
                                 f"parallel degree ({sorted(tps)})")
            bad = [b.module for b in self.experts.blocks if len(b.tp_split) != len(b.weights)]
            if bad:
                raise ValueError(f"experts: expert_tp={self.experts.expert_tp} needs every block's tp_split "
                                 f"(one (dim, pieces) per weight); {bad[0]} has none")
        if self.microbatch_size * self.num_microbatches * dp != self.global_batch_size:
            raise ValueError(f"microbatch_size ({self.microbatch_size}) x num_microbatches "
                             f"({self.num_microbatches}) x data-parallel degree ({dp}) must equal "
                             f"global_batch_size ({self.global_batch_size})")
        return self

    # -- derived ---------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return len({tuple(s.devices) for s in self.stages})

    @property
    def dp(self) -> int:
        return self.stages[0].axis_size("dp")

    @property
    def ep(self) -> int:
        return self.experts.ep if self.experts is not None else 1

    @property
    def tp(self) -> int:
        return self.stages[0].axis_size("tp")

    @property
    def cp(self) -> int:
        """The context-parallel degree: ranks splitting each sequence (1: none)."""
        return self.stages[0].axis_size("cp")

    @property
    def world_size(self) -> int:
        return len({d for s in self.stages for d in s.devices})

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "Plan":
        data = parse_json(text, source, "autopar plan ... -o FILE")
        if not isinstance(data, dict):
            raise PlanError(f"{source} is not a plan: expected a JSON object")
        return validate_versioned(cls, data, source, "plan", PLAN_FORMAT_VERSION, "re-plan with this version")

    def save(self, path: str | Path) -> None:
        """Write atomically: the file is either the whole plan or left untouched."""
        write_atomic(Path(path), self.to_json())

    @staticmethod
    def json_schema() -> dict:
        return Plan.model_json_schema()

    # -- text ------------------------------------------------------------------------------
    def summary(self) -> str:
        """A table of the stages and the plan's totals (what `autopar show` prints)."""
        p = self.predicted
        tps = [s.axis_size("tp") for s in sorted(self.stages, key=lambda s: s.index)]
        tp = str(self.tp) if len(set(tps)) == 1 else ",".join(map(str, tps)) + " (per stage)"
        head = (f"autopar plan for {self.model.name} ({format_count(self.model.num_params)} params) on "
                f"{self.cluster.num_devices} x {self.cluster.device.name} "
                f"({self.cluster.num_nodes} node{'s' if self.cluster.num_nodes > 1 else ''})\n"
                f"dp={self.dp}{f' (ep={self.ep})' if self.ep > 1 else ''}{f' cp={self.cp}' if self.cp > 1 else ''} "
                f"tp={tp} pp={self.pp}  "
                f"schedule={self.schedule}"
                f"{f' (v={self.virtual_stages})' if self.virtual_stages > 1 else ''}  "
                f"global batch={self.global_batch_size}  micro-batch={self.microbatch_size} x "
                f"{self.num_microbatches}  zero={self.zero_stage}"
                f"{' (gradients reduce-scattered every micro-batch)' if self.zero3_grad_sync == 'microbatch' else ''}"
                f"  dtype={self.dtype}\n"
                f"{self.software.summary()}")
        cols = ["stage", "devices", "mesh", "layers", "recompute", "compute s", "comm s", "bubble s",
                "memory", "capacity"]
        rows = []
        for s in self.stages:
            sp = s.predicted
            devs = f"{s.devices[0]}-{s.devices[-1]}" if len(s.devices) > 1 else str(s.devices[0])
            lay = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})"
            mesh = "x".join(f"{n}{a}" for n, a in zip(s.mesh_shape, s.mesh_axis_names))
            rows.append([str(s.index), devs, mesh, lay, s.recompute,
                         _secs(sp.compute_s) if sp else "-", _secs(sp.communication_s) if sp else "-",
                         _secs(sp.bubble_s) if sp else "-",
                         format_bytes(sp.peak_memory_bytes) if sp else "-",
                         format_bytes(self.cluster.device.memory_bytes)])
        table = format_table(cols, rows)
        shard_lines = _stage_runs([(s.index, sharding) for s in self.stages if (sharding := s.sharding_summary())],
                                  sep=":")
        if shard_lines:
            table += "\nsharded weights (placement per mesh axis; the rest replicated):\n" + "\n".join(shard_lines)
        rc_lines = _stage_runs([(s.index, s.recompute_summary()) for s in self.stages if s.recompute != "none"])
        if rc_lines:
            table += "\nrecomputed in the backward:\n" + "\n".join(rc_lines)
        coll = ", ".join(f"{k}={v}" for k, v in sorted(p.collectives.items())) or "none"
        tail = (f"predicted: {p.iteration_time_s:.4g} s/iteration, {p.samples_per_s:.4g} samples/s, "
                f"{p.tflops_per_device:.4g} TFLOP/s per device, peak memory "
                f"{format_bytes(p.peak_memory_bytes)}")
        if p.usable_memory_bytes:
            cap = self.cluster.device.memory_bytes
            tail += (f" of {format_bytes(p.usable_memory_bytes)} usable ({format_bytes(cap - p.usable_memory_bytes)}"
                     f" of the device's {format_bytes(cap)} kept as headroom for what is not a tensor of the "
                     f"step: what the driver keeps, the CUDA context, library workspaces, NCCL buffers, allocator "
                     f"fragmentation; cost_models.memory.usable_memory_terms)")
        top = max((s for s in self.stages if s.predicted), key=lambda s: s.predicted.peak_memory_bytes, default=None)
        if top is not None:
            sp = top.predicted
            parts = [("weights", sp.weights_bytes), ("gradients", sp.gradients_bytes),
                     ("optimizer", sp.optimizer_bytes), ("activations", sp.activations_bytes),
                     ("buffers", sp.buffers_bytes)]
            tail += (f"\npeak memory at {sp.peak_phase.replace('_', ' ')} of stage {top.index}: "
                     + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts if v))
            others = [(k, v) for k, v in sp.phases.items() if k != sp.peak_phase]
            if others:
                tail += " (its other phases' peaks: " + ", ".join(
                    f"{k.replace('_', ' ')} {format_bytes(v.peak_memory_bytes)}" for k, v in others) + ")"
        if self.experts is not None:
            tail += "\n" + self.experts.summary()
            if self.search.get("ep_executor"):
                tail += f"; {self.search['ep_executor']}"
        tail += f"\ncollectives per step: {coll}"
        if self.search.get("tp_counts_fallback"):
            tail += f" (counted another way for {self.search['tp_counts_fallback']})"
        solved = [s for s in self.stages if s.op_layouts is not None]
        if self.cp > 1:
            tail += (f"\ncontext parallelism over {self.cp} ranks: each sequence in {2 * self.cp} chunks, two per "
                     f"rank (causal load balance), the attention's keys and values all-gathered over the cp axis, "
                     f"their gradients reduce-scattered")
            if self.search.get("cp_executor"):
                tail += f"; {self.search['cp_executor']}"
        if self.sequence_parallel:
            tail += "\nsequence parallelism (Megatron-SP) on the tp axis: norms, dropout and residual adds on " \
                    "sequence slices"
        if solved:
            tail += "\ntensor parallelism executed op by op as solved: " + ", ".join(_stage_runs(
                [(s.index, f"{s.op_layouts.num_ops} ops, {_plural(len(s.op_layouts.signatures), 'distinct layer')}")
                 for s in solved], fmt="{stages} ({text})"))
            if self.search.get("op_layouts"):
                tail += f" ({self.search['op_layouts']})"
        elif max(tps) > 1 and self.search.get("tp_executor"):
            tail += f"\ntensor parallelism {self.search['tp_executor']}"
        if self.search.get("zero3_units"):
            tail += f"\nZeRO-3 units: {self.search['zero3_units']}"
        if self.search.get("selective_fallback"):
            tail += f"\nselective recomputation, {self.search['selective_fallback']}"
        if self.search.get("skipped"):
            tail += f"\nleft out by the search (the runtime cannot run them): {self.search['skipped']}"
        return f"{head}\n{table}\n{tail}"


def _stage_runs(items: list[tuple[int, str]], sep: str = ": ", fmt: str = "") -> list[str]:
    """One line per run of consecutive stages saying the same (`items`: (stage index, text)
    in stage order): "stage 3: x", "stages 1-62: y" (a 64-stage plan's 62 equal middle stages
    in one line)."""
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1][1] == items[i][1] and items[j + 1][0] == items[j][0] + 1:
            j += 1
        stages = f"stage {items[i][0]}" if i == j else f"stages {items[i][0]}-{items[j][0]}"
        out.append(fmt.format(stages=stages, text=items[i][1]) if fmt else f"{stages}{sep}{items[i][1]}")
        i = j + 1
    return out


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _secs(x: float) -> str:
    """Seconds to 4 significant digits; float noise below a nanosecond shows as 0."""
    return "0" if abs(x) < 1e-9 else f"{x:.4g}"


def format_bytes(n: float) -> str:
    """Bytes in binary units: 512 B, 3.2 MiB, 57.26 GiB."""
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def format_count(n: float) -> str:
    """12.3B, 45.6M, 7.8K."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def format_table(cols: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join([line, sep, *body])


def parse_json(text: str, source: str, remake: str) -> Any:
    """`text` parsed, or a PlanError naming `source` and the command that re-creates it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{source} is not valid JSON (truncated or corrupted?): {e.msg}, line "
                        f"{e.lineno}; re-create it with `{remake}`") from None


def validate_versioned(cls: Any, data: dict, source: str, what: str, newest: int, redo: str) -> Any:
    """`cls` (a pydantic model of an autopar file kind, `what`) from `data`: refused with a
    PlanError when it has no integer `format_version`, one newer than this autopar reads
    (`newest`; `redo` says how to make a readable one), or fields that do not validate."""
    ver = data.get("format_version")
    if not isinstance(ver, int):
        raise PlanError(f"{source} is not an autopar {what}: it has no integer format_version")
    if ver > newest:
        raise PlanError(f"{source} has format_version {ver}, newer than this autopar reads "
                        f"({newest}); upgrade autopar or {redo}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise PlanError(f"{source} is not a valid {what}: {validation_message(e)}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    path = Path(path)
    d = path.parent if str(path.parent) else Path(".")
    if not d.exists():
        raise PlanError(f"cannot write {path}: directory {d} does not exist")
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_plan(path: str | Path) -> Plan:
    """Read a plan file, with a clear error when it is missing, truncated or from a newer autopar."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file {p} does not exist; make one with `autopar plan ... -o {p}`") from None
    except OSError as e:
        raise PlanError(f"cannot read plan file {p}: {e.strerror}") from None
    return Plan.from_json(text, source=f"plan file {p}")
