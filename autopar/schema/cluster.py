"""Hardware descriptions: a device, a link class, and a cluster of identical nodes.

Units: FLOP/s, bytes, bytes/s (per device and direction), seconds. Every bundled figure carries
its source in `sources` (field name -> where the number comes from).

Hardware only: what the software does on it (the attention kernel, overlap of communication with
compute) is a `autopar.schema.software.SoftwareSpec`, chosen apart and recorded in the plan.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from autopar.schema.errors import PlanError
from autopar.schema.files import read_mapping

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


class SoftwareInHardwareWarning(FutureWarning):
    """A cluster file describes software (the attention kernel) in its hardware profile."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class EfficiencyPoint(_Strict):
    """One point of a GEMM efficiency curve: a GEMM of `flops` FLOPs runs at `efficiency` x peak."""

    flops: float = Field(gt=0)
    efficiency: float = Field(gt=0, le=1)


class MeasuredCollective(_Strict):
    """A measured collective: `kind` over `num_devices` devices moving `bytes` took `seconds`."""

    kind: str
    num_devices: int = Field(ge=2)
    bytes: float = Field(gt=0)
    seconds: float = Field(gt=0)


class AttentionPoint(_Strict):
    """Measured rate of the fused attention kernel at one size. `flops_per_head` is the forward
    FLOPs of one (batch, head) slice, 4 * s_q * s_k * d (the capture's count), which sets how well
    the kernel's tiles fill; the rates count FLOPs as the cost model does: the forward's for the
    forward, 2.5x the forward's for the backward (it recomputes the scores)."""

    flops_per_head: float = Field(gt=0)
    forward_flops: float = Field(gt=0, description="FLOP/s of the forward")
    backward_flops: float = Field(gt=0, description="FLOP/s of the backward (2.5x the forward's FLOPs)")
    head_dim: Optional[int] = Field(
        default=None, ge=1, description="the head dimension it was measured at; a table with several "
        "is read at the measured head dimension nearest the op's (the kernel's tiles depend on it); "
        "None: any")


class UnfusedAttentionPoint(_Strict):
    """Measured speed of attention run unfused (QK^T and PV as batched GEMMs around a softmax
    that reads and writes the b*a*s*s scores: PyTorch's standard attention, Megatron-LM 2021) at one
    shape, forward + backward together, as published: `flops` is FLOP/s counted as the source
    counts them, 4 * s^2 * d forward FLOPs per (batch, head) slice and 3.5x that for forward +
    backward, the whole s x s square (no causal mask)."""

    head_dim: int = Field(ge=1, description="head dimension d it was measured at")
    seq: int = Field(ge=1, description="sequence length s (queries = keys)")
    flops: float = Field(gt=0, description="FLOP/s of forward + backward, 3.5 * 4 * s^2 * d per slice")


class OptimizerCost(_Strict):
    """Measured seconds of one optimizer step as the runtime runs it (one tensor at a time):
    a fixed cost per parameter tensor (the per-tensor kernels and their dispatch) plus a cost
    per parameter element."""

    optimizer: Literal["adamw"] = "adamw"
    per_tensor_s: float = Field(ge=0, description="seconds per parameter tensor and step")
    per_element_s: float = Field(ge=0, description="seconds per parameter element and step")


class AlignmentPoint(_Strict):
    """A matrix op's efficiency when its least-aligned contiguous dimension (the reduction
    dimension K or the output's N, not the rows M) is a multiple of `bytes` bytes and of no larger
    power of two up to the next point, relative to the same op with every dimension aligned."""

    bytes: int = Field(ge=1, description="alignment of K and N in bytes (element size x largest power of two "
                                         "dividing the dimension)")
    efficiency: float = Field(gt=0, le=1, description="fraction of the aligned op's rate")


class DeviceSpec(_Strict):
    """One accelerator (or one CPU process when profiling a CPU machine)."""

    name: str = Field(min_length=1)
    peak_flops: dict[str, float] = Field(description="dense peak FLOP/s by dtype (bf16, fp16, fp32, ...)")
    memory_bytes: float = Field(gt=0, description="device memory in bytes")
    memory_bandwidth: float = Field(gt=0, description="memory bandwidth in bytes/s")
    gemm_efficiency: dict[str, list[EfficiencyPoint]] = Field(
        default_factory=dict, description="achieved fraction of peak by GEMM size, per dtype")
    memory_efficiency: float = Field(default=0.8, gt=0, le=1,
                                     description="achieved fraction of memory bandwidth for streaming ops")
    kernel_overhead_s: float = Field(default=5e-6, ge=0, description="fixed launch cost per kernel")
    op_flops: dict[str, float] = Field(
        default_factory=dict, description="measured FLOP/s of particular non-matrix ops by ATen name "
        "(gelu, softmax, ...); they override vector_flops for those ops")
    vector_flops: Optional[float] = Field(
        default=None, gt=0, description="FLOP/s achieved by element-wise and reduction ops, their "
        "FLOPs counted as autopar's capture counts them; None: the fp32 peak (GPUs, where such ops "
        "are bound by memory bandwidth anyway)")
    op_backward_flops: Optional[dict[str, float]] = Field(
        default=None, description="measured FLOP/s of the backward of particular non-matrix ops by "
        "ATen name, their FLOPs counted as the forward's; None: the backward runs at the forward's "
        "rate (op_flops / vector_flops), bound by memory bandwidth")
    matmul_backward_ratio: Optional[float] = Field(
        default=None, gt=0, description="measured backward over forward time of a linear layer (input "
        "and weight gradients, bias sum) at a representative transformer shape; None: 2 (two GEMMs of "
        "the forward's size at its efficiency)")
    attention_flops: Optional[dict[str, list[AttentionPoint]]] = Field(
        default=None, description="measured forward and backward rates of the fused attention kernel "
        "by dtype and size; None: fused attention runs at the GEMM efficiency curve")
    attention_head_dims: Optional[list[int]] = Field(
        default=None, description="the head dimensions the fused attention kernel of attention_flops is "
        "compiled for (ascending): a head dimension between two runs the next one up, at its time (the "
        "kernel computes the padded width); None: every head dimension its own kernel")
    unfused_attention_flops: Optional[dict[str, list[UnfusedAttentionPoint]]] = Field(
        default=None, description="measured forward + backward speed of attention run unfused (batched "
        "QK^T and PV GEMMs around a softmax over the materialised scores) by dtype, head dimension and "
        "sequence length; None: its GEMMs and softmax priced by the roofline (GEMM curve, memory bandwidth)")
    gemm_alignment: Optional[list[AlignmentPoint]] = Field(
        default=None, description="measured efficiency of matrix ops whose K or N is not a multiple of "
        "the kernel's preferred alignment (cuBLAS takes slower kernels below 16 bytes), by alignment in "
        "bytes; None: no penalty")
    optimizer_step: Optional[OptimizerCost] = Field(
        default=None, description="measured cost of one optimizer step per parameter tensor and "
        "per element; None: memory-bound bytes per parameter over memory_bandwidth")
    driver_reserved_bytes: float = Field(
        default=0.0, ge=0, description="memory_bytes less the memory CUDA reports for the device "
        "(cudaMemGetInfo's total, torch's 'total capacity'): what the driver keeps. A difference, so a "
        "device whose memory_bytes is changed (a larger part, a lifted bound) keeps it. The software's "
        "per-process terms and fragmentation come off the rest (`cost_models.memory.usable_memory`)")
    collective_channels: Optional[int] = Field(
        default=None, ge=1, description="channels NCCL builds for a collective among the node's devices "
        "(its ring count on this topology); each holds the software's collective_buffer_bytes_per_channel "
        "on every device; None: no collective buffers counted")
    device_type: Literal["cuda", "cpu"] = Field(
        default="cuda", description="the torch device type the runtime trains on: it sets which ops "
                                    "mixed precision (torch.autocast) keeps in fp32, so what they save")
    sm_count: Optional[int] = Field(
        default=None, ge=1, description="streaming multiprocessors of the device: what a library that "
        "reserves some for its communication kernels leaves its GEMMs (`SoftwareSpec.tp_comm_overlap`); "
        "None: not known (such a reservation is not priced, the plan says so)")
    sources: dict[str, str] = Field(default_factory=dict)
    # a device's `attention_kernel` from a file written before software was apart from hardware
    # (`_software_moved`); the planner takes it as the software's when none is given
    _legacy_attention_kernel: Optional[str] = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _software_moved(cls, data: Any, handler: Any) -> "DeviceSpec":
        """`attention_kernel` was a device field; it is a software choice now
        (`autopar.schema.software.SoftwareSpec`). A file that still sets it loads, with a
        warning: its value is kept aside (`legacy_attention_kernel`) for the planner to use
        when no software is given."""
        legacy = None
        if isinstance(data, dict) and "attention_kernel" in data:
            data = dict(data)
            legacy = data.pop("attention_kernel")
            sources = data.get("sources")
            if isinstance(sources, dict) and "attention_kernel" in sources:
                data["sources"] = {k: v for k, v in sources.items() if k != "attention_kernel"}
            if legacy not in ("fused", "unfused"):
                raise ValueError(f"attention_kernel must be fused or unfused (got {legacy!r}); it is a "
                                 f"software choice now: remove it from the device and pass the software "
                                 f"(autopar plan --software NAME|FILE, autopar.plan(..., software=...))")
            warnings.warn(f"device.attention_kernel ({legacy}) describes the software, not the hardware: "
                          f"remove it from the cluster file and choose the software instead (autopar plan "
                          f"--software NAME|FILE, autopar.plan(..., software=...); bundled: autopar "
                          f"(fused, the default), megatron-lm-2021 (unfused)); until then plans of this "
                          f"cluster given no software use attention_kernel={legacy}",
                          SoftwareInHardwareWarning, stacklevel=2)
        obj = handler(data)
        if legacy is not None:
            obj._legacy_attention_kernel = legacy
        return obj

    @model_serializer(mode="wrap")
    def _omit_unknown_sms(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump without `sm_count` where it is not known: a plan file of a device profile
        written before the field existed (and its digest) is what it was."""
        out = handler(self)
        if isinstance(out, dict) and out.get("sm_count", 0) is None:
            out.pop("sm_count")
        return out

    @property
    def legacy_attention_kernel(self) -> Optional[str]:
        """The `attention_kernel` an old cluster file set on this device, or None."""
        return self._legacy_attention_kernel

    @field_validator("peak_flops")
    @classmethod
    def _check_peaks(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("needs at least one dtype, e.g. {bf16: 312e12}")
        for k, x in v.items():
            if k not in DTYPES:
                raise ValueError(f"unknown dtype {k!r}; use one of {', '.join(DTYPES)}")
            if not x > 0:
                raise ValueError(f"peak for {k} must be > 0, got {x}")
        return v

    @field_validator("op_backward_flops")
    @classmethod
    def _check_rates(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for k, x in (v or {}).items():
            if not x > 0:
                raise ValueError(f"rate for {k} must be > 0 FLOP/s, got {x}")
        return v

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`, falling back bf16<->fp16 and tf32->fp32."""
        for d in (dtype, {"bf16": "fp16", "fp16": "bf16", "tf32": "fp32"}.get(dtype, dtype), "fp32"):
            if d in self.peak_flops:
                return self.peak_flops[d]
        return max(self.peak_flops.values())


class LinkSpec(_Strict):
    """A class of links (inside a node, or between nodes)."""

    bandwidth: float = Field(gt=0, description="bytes/s per device and direction")
    latency: float = Field(ge=0, description="seconds per message hop (alpha)")
    measured: list[MeasuredCollective] = Field(
        default_factory=list, description="measured collective timings; override the formulas")
    sources: dict[str, str] = Field(default_factory=dict)


class ClusterSpec(_Strict):
    """A cluster of `num_nodes` identical nodes with `devices_per_node` devices each."""

    name: str = "custom"
    num_nodes: int = Field(default=1, ge=1)
    devices_per_node: int = Field(ge=1)
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: Optional[LinkSpec] = None
    description: str = ""
    sources: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _inter_node_needed(self) -> "ClusterSpec":
        if self.num_nodes > 1 and self.inter_node is None:
            raise ValueError("inter_node: a cluster of more than one node needs an inter_node link "
                             "(bandwidth in bytes/s per device, latency in s)")
        return self

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def link_between(self, rank_a: int, rank_b: int) -> LinkSpec:
        """The link class two global ranks talk over."""
        same = rank_a // self.devices_per_node == rank_b // self.devices_per_node
        return self.intra_node if same or self.inter_node is None else self.inter_node

    @classmethod
    def load(cls, name_or_path: str | Path, num_nodes: int | None = None) -> "ClusterSpec":
        """Load a bundled profile by name (see `bundled_clusters()`) or a YAML/JSON file."""
        path = _resolve_profile(str(name_or_path))
        data = read_mapping(path, "cluster", "num_nodes, devices_per_node, device, intra_node, inter_node")
        if num_nodes is not None:
            data["num_nodes"] = num_nodes
        data.setdefault("name", path.stem)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise PlanError(f"invalid cluster file {path}: {validation_message(e)}") from None


def validation_message(e: ValidationError) -> str:
    """One line naming each bad field and what it must be."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        inp = err.get("input")
        got = f" (got {inp!r})" if inp is not None and not isinstance(inp, (dict, list)) else ""
        parts.append(f"field '{loc}': {msg}{got}" if err["loc"] else f"{msg}{got}")
    return "; ".join(parts)


def bundled_profiles_dir() -> Path:
    import hardware_profiles  # data package shipped beside autopar

    return Path(hardware_profiles.__file__).parent


def bundled_clusters() -> list[str]:
    return sorted(p.stem for p in bundled_profiles_dir().glob("*.yaml"))


def _resolve_profile(name: str) -> Path:
    p = Path(name)
    if p.suffix.lower() in (".yaml", ".yml", ".json") or p.exists() or "/" in name:
        if not p.exists():
            raise PlanError(f"cluster file {name} does not exist; give a bundled name "
                            f"({', '.join(bundled_clusters())}) or a YAML/JSON path")
        return p
    cand = bundled_profiles_dir() / f"{name}.yaml"
    if not cand.exists():
        raise PlanError(f"unknown cluster {name!r}; bundled: {', '.join(bundled_clusters())} "
                        f"(or give a YAML/JSON file path)")
    return cand


