"""Compute time of ops, op lists and captured graphs against a device (roofline plus overhead).

Model, per op (forward):
    t = max(FLOPs / (peak(dtype) * eff), bytes / (memory_bandwidth * memory_efficiency)) + overhead
where `eff` is the GEMM efficiency curve of the device (a function of the GEMM's FLOPs: small
GEMMs run far below peak) for matrix ops, and 1 against the vector (fp32, non-tensor-core) peak
for every other op, which in practice makes them memory-bound.

Backward, per op family:
- matrix ops compute the input gradient and the weight gradient, 2x the forward FLOPs; a fused
  (flash) attention kernel recomputes QK^T in its backward: 5 matmuls against 2, 2.5x;
- element-wise and normalisation ops are memory-bound: their backward reads the output gradient
  and what the forward saved and writes the input gradient, about 1.5x-2x the forward bytes
  (`backward_bytes_factor`); an add only passes its gradient on.
Recomputation adds one more forward of the recomputed ops (all of them under "full", the
attention core under "selective", Korthikanti et al. 2022).

Views are free, but a `reshape` (or `flatten`) whose input's strides allow no view copies, and a
`.contiguous()` of a tensor already laid out contiguously copies nothing: which is which depends
on the strides the kernels of the device type and the software's attention kernel give
(`cost_models.layouts`, the walk the memory model reads too, once per graph). Callers pass its
answer as `copies`. A copying reshape is ATen's `_unsafe_view(self.clone(contiguous))`
(`reshape`'s composite): forward, one copy, its output's bytes read and written, priced as a
`clone`/`contiguous` of them (`reshape_copy_time`). Backward (autograd, measured with torch
2.13's profiler): `_unsafe_view`'s backward reshapes the (contiguous) gradient back, a view;
`clone`'s passes it on; then the gradient goes back through the views the reshape read. Behind a
transpose (`out.transpose(1, 2).reshape(b, s, h * d)` of an unfused attention's output) it
arrives at its producer transposed, and the producer's backward copies it (a matmul's: one
`clone`, as after an explicit `.contiguous()`): the output's bytes read and written again.
Behind an `expand` (the grouped-query repeat `k[:, :, None].expand(...).reshape(...)`) the
expand's backward sums it over the repeated dim: the output's bytes read, the kv-sized gradient
written. So the backward reads the output's bytes and writes the smallest tensor of the view
chain the reshape read.

The optimizer step is memory-bound: AdamW reads and writes every parameter's master weight,
two moments, and gradient (`optimizer_step_time`).

Measured profiles (`autopar profile`) may carry what these formulas guess, and then it is used
instead: the backward rate of element-wise / normalisation / loss ops (`op_backward_flops`; on a
CPU the backward kernels run at their own rates, not the forward's), a linear layer's backward
over forward time (`matmul_backward_ratio`, instead of 2), the fused attention kernel's
forward and backward rates by size (`attention_flops`; on a CPU it runs far below the GEMM rate),
and the optimizer step's cost per parameter tensor and per element (`optimizer_step`; a step that
updates one tensor at a time runs ~10 small kernels per tensor). Profiles without them (the
bundled GPU ones) are costed by the formulas alone. A GPU profile may carry published kernel
speeds instead: the fused attention kernel's (`attention_flops`) and, for software that runs
attention unfused, the speed of its batched GEMMs and softmax together (`unfused_attention_flops`,
`attention_time`).

What the software does is not the device's: the attention kernel (fused or unfused) is the
`SoftwareSpec`'s choice, passed as `attention_kernel` (default "fused", what `autopar run` runs);
so is whether element-wise ops run one kernel each (eager PyTorch, what `autopar run` runs) or
a chain of them as one kernel (torch.compile, Megatron's fused bias-GELU): `fusion`, the
graph's chains (`cost_models.fusion`, `fusion_of`), None when eager.

Graphs are captured in fp32 on the meta device; `dtype` rescales every floating-point tensor's
bytes to the training dtype (bf16: half), so a bf16 run is assessed from an fp32 capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Optional, Sequence, Union

from autopar.capture.flops import VIEW_OPS
from autopar.schema.cluster import DeviceSpec, EfficiencyPoint
from autopar.schema.software import ATTENTION_KERNELS, POINTWISE_FUSIONS, AttentionKernel, PointwiseFusion
from cost_models.fused_loss import is_fused_loss, is_half_loss
from cost_models.fusion import FusedChains, chain_member_time, graph_pointwise_chains

MATRIX_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul",
                        "scaled_dot_product_attention", "convolution", "_convolution",
                        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                        "conv1d", "conv2d", "conv3d", "einsum", "grouped_mm"})

# fused attention kernels: backward recomputes the scores (flash attention, Dao et al. 2022)
FUSED_ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                             "_scaled_dot_product_efficient_attention"})

# bytes per element of a training dtype
DTYPE_SIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

Recompute = Literal["none", "selective", "full"]

# Generic efficiency curve, used when a profile has none: fraction of the dense tensor-core peak
# reached by a GEMM of F FLOPs. Median efficiency per half-decade of FLOPs of the measured sm_90
# (H100) cuBLAS bf16 table in OpenXLA (xla/service/gpu/model/matmul_interpolator_data.h): a 1e8-FLOP
# GEMM (~256^3) is launch/latency bound at ~2%, 1e10 (~1700^3) reaches about half, >= 1e11 saturates
# near 77% (Maximum Achievable Matmul FLOPS, S. Bekman's ml-engineering, finds ~80% at best).
GENERIC_CURVE: tuple[tuple[float, float], ...] = (
    (1e8, 0.022), (3.16e8, 0.044), (1e9, 0.129), (3.16e9, 0.307), (1e10, 0.531), (3.16e10, 0.686),
    (1e11, 0.765), (1e12, 0.775))


def _dtype_fallbacks(dtype: str) -> tuple[str, str]:
    """`dtype`, then the one a measured table may stand in with (bf16<->fp16, tf32->fp32)."""
    return dtype, {"bf16": "fp16", "fp16": "bf16", "tf32": "fp32"}.get(dtype, dtype)


def _log_interp(pts: Sequence[tuple[float, ...]], x: float) -> tuple[float, ...]:
    """The values of sorted points (x, v1, v2, ...) at `x`: linear in log(x) between points,
    constant beyond the ends."""
    if x <= pts[0][0]:
        return tuple(pts[0][1:])
    if x >= pts[-1][0]:
        return tuple(pts[-1][1:])
    lx = math.log(x)
    for p0, p1 in zip(pts, pts[1:]):
        if x <= p1[0]:
            t = (lx - math.log(p0[0])) / (math.log(p1[0]) - math.log(p0[0]))
            return tuple(a + t * (b - a) for a, b in zip(p0[1:], p1[1:]))
    return tuple(pts[-1][1:])


def _curve(device: DeviceSpec, dtype: str) -> list[tuple[float, float]]:
    for d in _dtype_fallbacks(dtype):
        pts: list[EfficiencyPoint] = device.gemm_efficiency.get(d) or []
        if pts:
            return sorted((p.flops, p.efficiency) for p in pts)
    return list(GENERIC_CURVE)


def gemm_efficiency(device: DeviceSpec, flops: float, dtype: str) -> float:
    """Achieved fraction of peak for a matrix op of `flops` FLOPs: the device's measured curve for
    `dtype` (bf16<->fp16, tf32->fp32 fall back to each other) interpolated linearly in
    log(FLOPs), constant beyond its ends; the generic curve when the profile has none."""
    return _log_interp(_curve(device, dtype), flops)[0]


def memory_time(nbytes: float, device: DeviceSpec) -> float:
    """Seconds to move `nbytes` (read plus written) at the device's achieved memory bandwidth."""
    return nbytes / (device.memory_bandwidth * device.memory_efficiency)


def vector_peak(device: DeviceSpec) -> float:
    """FLOP/s of non-matrix (CUDA-core / SIMD) work: the measured `vector_flops` when the profile
    has it (on CPUs transcendental element-wise ops run far below the GEMM peak), else the fp32
    peak."""
    return device.vector_flops or device.peak_flops.get("fp32") or min(device.peak_flops.values())


def _roofline(flops: float, rate: float, bytes_moved: float, device: DeviceSpec) -> float:
    """Seconds of one kernel: the slower of its FLOPs at `rate` and its bytes at the achieved
    memory bandwidth, plus the fixed per-kernel overhead."""
    return max(flops / rate, memory_time(bytes_moved, device)) + device.kernel_overhead_s


def op_time(op: str, flops: float, bytes_moved: float, device: DeviceSpec, dtype: str = "bf16") -> float:
    """Forward seconds of one op with `flops` FLOPs and `bytes_moved` bytes (0 for free views)."""
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    if op in MATRIX_OPS:
        rate = device.peak(dtype) * gemm_efficiency(device, flops, dtype)
    else:
        rate = device.op_flops.get(op) or vector_peak(device)
    return _roofline(flops, rate, bytes_moved, device)


def backward_factor(op: str) -> float:
    """Backward FLOPs relative to forward: matrix ops compute input and weight gradients (2x);
    fused attention also recomputes its scores (2.5x); other ops about 1x."""
    if op in FUSED_ATTENTION:
        return 2.5
    return 2.0 if op in MATRIX_OPS else 1.0


# backward bytes relative to forward bytes for memory-bound ops
_BWD_BYTES = {"add": 1.0, "sub": 1.0, "embedding": 2.0, "layer_norm": 2.0, "native_layer_norm": 2.0,
              "rms_norm": 2.0, "gelu": 1.5, "silu": 1.5, "relu": 1.5, "tanh": 1.5, "sigmoid": 1.5,
              "softmax": 1.5, "_softmax": 1.5, "_safe_softmax": 1.5, "log_softmax": 1.5, "_log_softmax": 1.5,
              "dropout": 1.5, "native_dropout": 1.5, "mul": 2.0, "div": 1.5, "cross_entropy_loss": 2.0,
              "to": 1.0, "_to_copy": 1.0, "clone": 1.0, "contiguous": 1.0, "arange": 0.0, "zeros": 0.0,
              "ones": 0.0, "full": 0.0, "empty": 0.0, "masked_fill": 1.0}


# backward bytes relative to forward bytes where CUDA's kernels differ from the generic rule.
# Layer norm: PyTorch's backward (aten/src/ATen/native/cuda/layer_norm_kernel.cu,
# LayerNormBackwardKernelImplInternal) runs two kernels over the activation: one reads dY and X
# and writes dX, one (GammaBetaBackward) reads dY and X again for the weight and bias gradients:
# 5 activation-sized accesses against the forward's 2 (X read, Y written). Measured on an H100
# (benchmarks/results/h100-2026-11-25/profiles: layer_norm_grad_input and GammaBetaBackward each a
# call of native_layer_norm_backward, 96 + 100 of each in GPT-3 1.3B's step).
_CUDA_BWD_BYTES = {"layer_norm": 2.5, "native_layer_norm": 2.5}


def backward_bytes_factor(op: str, device_type: Optional[str] = None) -> float:
    """Backward bytes relative to forward bytes: the gradient read plus the saved tensors read plus
    the input gradient written (1.5x for a unary op, 2x with a weight gradient); matrix ops are
    costed by FLOPs instead (their bytes scale with the same 2x). A cross-entropy: eager, its
    forward reads the logits and writes the log-probabilities (2 tensors), its backward writes the
    log-probabilities' gradient (nll_loss_backward's zeros) and log_softmax's backward reads it and
    the log-probabilities and writes the logits' (4); fused, 1 read forward, 1 read and 1 write
    backward: 2x either way. On CUDA (`device_type`) a layer norm's backward is 2.5x
    (`_CUDA_BWD_BYTES`: two kernels each reading the gradient and the input)."""
    if op in MATRIX_OPS:
        return backward_factor(op)
    if device_type == "cuda" and op in _CUDA_BWD_BYTES:
        return _CUDA_BWD_BYTES[op]
    return _BWD_BYTES.get(op, 1.5)


def measured_backward_rate(op: str, device: DeviceSpec) -> Optional[float]:
    """FLOP/s of `op`'s backward measured by the profiler (its FLOPs counted as the forward's:
    the forward's FLOPs over the backward's time), or None when the profile has none for `op`."""
    return (device.op_backward_flops or {}).get(op)


def op_backward_time(op: str, flops: float, bytes_moved: float, device: DeviceSpec,
                     dtype: str = "bf16") -> float:
    """Backward seconds of one op (see `backward_factor` / `backward_bytes_factor`); a non-matrix
    op whose backward the profile measured runs at that rate instead of the forward's."""
    bf, bb = backward_factor(op), backward_bytes_factor(op, device.device_type)
    if bf == 0 and bb == 0:
        return 0.0
    if op in MATRIX_OPS:
        # two GEMMs of the forward's size (input grad, weight grad), each at the forward's efficiency
        n = max(1, round(bf))
        t = n * op_time(op, flops * bf / n, bytes_moved * bb / n, device, dtype)
        if device.matmul_backward_ratio is not None and op not in FUSED_ATTENTION:
            # measured: the weight gradient's transposed GEMM and the bias sum run below the forward
            t *= device.matmul_backward_ratio / bf
        return t
    rate = measured_backward_rate(op, device)
    if rate is not None and (flops > 0 or bytes_moved > 0):
        return _roofline(flops, rate, bytes_moved * bb, device)   # the rate counts forward FLOPs
    return op_time(op, flops * bf, bytes_moved * bb, device, dtype)


def optimizer_bytes_per_param(policy: str = "bf16", optimizer: str = "adamw") -> float:
    """Bytes read plus written per parameter by one optimizer step.

    AdamW under bf16/fp16 mixed precision reads the grad (2), fp32 master (4), m (4), v (4) and
    writes master, m, v (12) and the bf16 weight copy (2): 28 bytes (30 reading fp32 gradients,
    the "_fp32grad" policies). In fp32: reads w, g, m, v
    (16), writes w, m, v (12): 28. SGD with momentum: reads w, g, buf, writes w, buf."""
    opt = optimizer.lower()
    if opt in ("adamw", "adam") and policy.endswith("_param"):
        return 14.0     # no master: reads w, g, m, v and writes w, m, v, each 2 bytes
    if opt in ("adamw", "adam"):
        return 30.0 if policy.endswith("_fp32grad") else 28.0     # an fp32 gradient read: 4, not 2
    if opt in ("sgd", "sgd_momentum"):
        w = DTYPE_SIZE.get(policy, 4)
        return (2 * 4 + w) + 2 * 4 + (w if policy != "fp32" else 0)
    raise ValueError(f"unknown optimizer {optimizer!r}; one of adamw, adam, sgd")


def optimizer_step_time(num_params: float, device: DeviceSpec, policy: str = "bf16",
                        optimizer: str = "adamw", shard: float = 1.0, num_tensors: int = 1,
                        param_tensors: Optional[int] = None) -> float:
    """Seconds of one optimizer step over `num_params / shard` parameters on one device.

    With the profile's measured step cost (`device.optimizer_step`, AdamW/Adam): `per_element_s`
    per parameter element plus `per_tensor_s` per parameter tensor, `param_tensors` of them (the
    runtime updates one tensor at a time; a ZeRO flat shard is one tensor; default `num_tensors`).
    Otherwise memory-bound: `optimizer_bytes_per_param` over the achieved memory bandwidth, plus
    one kernel launch per `num_tensors` (multi-tensor apply launches a handful)."""
    if num_params <= 0:
        return 0.0
    elems = num_params / max(shard, 1.0)
    cost = device.optimizer_step
    if cost is not None and optimizer.lower() in ("adamw", "adam"):
        tensors = num_tensors if param_tensors is None else param_tensors
        return elems * cost.per_element_s + max(tensors, 1) * cost.per_tensor_s
    nbytes = elems * optimizer_bytes_per_param(policy, optimizer)
    return memory_time(nbytes, device) + num_tensors * device.kernel_overhead_s


def grad_accumulation_bytes(policy: str = "bf16") -> float:
    """Bytes one micro-batch's gradient accumulation moves per parameter: the accumulated
    gradient and the new one read, the sum written (3 gradient-sized accesses); into fp32
    gradients beside 2-byte weights (the "_fp32grad" policies, `SoftwareSpec.grad_dtype`) the new
    one is the weights' dtype: 2 + 4 + 4."""
    from cost_models.memory import PRECISION_POLICIES
    if policy in PRECISION_POLICIES:
        w, g, _ = PRECISION_POLICIES[policy]
        return min(w, g) + 2.0 * g
    return 3.0 * DTYPE_SIZE.get(policy, 4)


def param_cast_bytes(param_dtype: str, dtype: str) -> float:
    """Bytes per parameter element one micro-batch moves casting parameters kept in fp32 for a
    2-byte `dtype` run under autocast (`SoftwareSpec.param_dtype` "fp32"); 0 when they are kept in
    the training dtype or the run is fp32.

    Forward: each weight is cast to the 2-byte dtype where a matrix op reads it, once per
    micro-batch (the fused dense / MLP of flash-attn call `weight.to(torch.get_autocast_gpu_dtype())`
    inside their autograd functions, flash_attn/ops/fused_dense.py; autocast's own weight-cast
    cache lives only as long as the autocast region, one training step of Lightning's
    `precision: bf16`): 4 bytes read, 2 written. Backward: the matrix op hands back a 2-byte weight
    gradient, and autograd's engine casts every gradient to its input's dtype before accumulating
    it (`validate_outputs`, torch/csrc/autograd/engine.cpp): 2 read, 4 written. 12 bytes in all;
    the fp32 accumulation that follows is `grad_accumulation_bytes("fp32")`. Every parameter is
    counted as cast (layer norms' and embeddings' are not: under 0.1% of a GPT's and, tied, its
    embedding is cast for the head)."""
    if param_dtype != "fp32" or DTYPE_SIZE.get(dtype, 4) >= 4:
        return 0.0
    low = DTYPE_SIZE[dtype]
    return (4.0 + low) + (low + 4.0)


def loss_scaling_bytes(loss_scaling: str, dtype: str) -> float:
    """Bytes per gradient element one optimizer step moves under dynamic loss scaling of an fp16
    run (`SoftwareSpec.loss_scaling` "dynamic"); 0 otherwise (bf16 and fp32 runs scale nothing).

    Before the optimizer steps, every gradient it steps is multiplied by the inverse scale and
    checked for inf/NaN in one multi-tensor pass, `torch._amp_foreach_non_finite_check_and_unscale_`
    (torch's `GradScaler.unscale_`, which PyTorch Lightning's precision 16 calls once a step before
    gradient clipping; Megatron-LM's `_unscale_main_grads_and_check_for_nan` over its fp32 main
    gradients): each fp32 gradient read and written, 8 bytes an element. GradScaler refuses 2-byte
    gradients ("Attempting to unscale FP16 gradients"), so the gradients it unscales are fp32 in
    every recipe that scales. The step's host synchronisation on the inf flag (`found_inf.item()`)
    is not priced: no source read sizes what it exposes."""
    if loss_scaling != "dynamic" or dtype != "fp16":
        return 0.0
    return 8.0


def unscale_time(grad_elems: float, device: DeviceSpec, nbytes: float, dp: int = 1, zero: int = 0,
                 zero_optimizer: str = "flat") -> float:
    """Seconds of one step's unscale and inf check (`loss_scaling_bytes`, `nbytes` a gradient
    element; 0 when 0) over the gradients one device's optimizer steps, of a stage holding
    `grad_elems` parameter elements: all of them without ZeRO and under torch's
    ZeroRedundancyOptimizer (ZeRO-1 "zero_redundancy": GradScaler.unscale_ walks the optimizer's
    param_groups, which hold every parameter, torch/distributed/optim/zero_redundancy_optimizer.py),
    a 1/dp shard where the optimizer steps a flat shard of them (ZeRO-1/2 "flat", ZeRO-3: Megatron's
    distributed optimizer unscales its shard's main gradients). Memory-bound, one multi-tensor
    kernel (`kernel_overhead_s`)."""
    if nbytes <= 0 or grad_elems <= 0:
        return 0.0
    whole = zero == 0 or dp <= 1 or (zero == 1 and zero_optimizer == "zero_redundancy")
    return memory_time(grad_elems / (1 if whole else dp) * nbytes, device) + device.kernel_overhead_s


def grad_accumulation_time(num_params: float, device: DeviceSpec, policy: str = "bf16",
                           num_microbatches: int = 1, shard: float = 1.0) -> float:
    """Seconds spent adding each micro-batch's weight gradients into the accumulated gradients over
    one step: after the first micro-batch, `grad_accumulation_bytes` per parameter (6 in bf16,
    12 in fp32) and one kernel, per micro-batch."""
    if num_params <= 0 or num_microbatches <= 1:
        return 0.0
    nbytes = num_params / max(shard, 1.0) * grad_accumulation_bytes(policy)
    return (num_microbatches - 1) * (memory_time(nbytes, device) + device.kernel_overhead_s)


# -- op lists and graphs -------------------------------------------------------------------------

@dataclass
class ComputeTime:
    """Seconds of forward, backward and recomputation of a list of ops (one micro-batch)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    per_layer: dict[Optional[str], float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s

    def __add__(self, other: "ComputeTime") -> "ComputeTime":
        per = dict(self.per_layer)
        for k, v in other.per_layer.items():
            per[k] = per.get(k, 0.0) + v
        return ComputeTime(self.forward_s + other.forward_s, self.backward_s + other.backward_s,
                           self.recompute_s + other.recompute_s, per)


Shard = Union[float, Callable[..., float]]


def bytes_scale(tensor_dtype: str, dtype: str) -> float:
    """Factor turning the bytes of a captured floating-point tensor into bytes at the training
    `dtype` (captures are fp32 on meta; a bf16 run moves half the bytes). Integer/bool tensors keep
    their size."""
    if tensor_dtype in ("float32", "float64", "float16", "bfloat16"):
        from autopar.capture.graph import DTYPE_BYTES

        return DTYPE_SIZE.get(dtype, 4) / DTYPE_BYTES[tensor_dtype]
    return 1.0


def attention_core(nodes: Iterable) -> set[str]:
    """Names of the ops of each attention core (scores, softmax, dropout on probabilities, and the
    two batched matmuls around them): what selective recomputation re-runs. Found structurally:
    a softmax, the chain of ops from the score matmul up to it, and the ops from it down to the
    matmul with V; a fused attention op is a core by itself. A mixture-of-experts router's
    softmax is no core: its chain holds the router's top-k (the softmax feeds the top-k, or
    normalises the top-k's values), which no attention core holds; walked as a core, its chain
    ran through the router's gate and the norm before it and on into the expert dispatch, and
    `cost_models.memory.selective_ops` (the run of ops from the first core op to the last) then
    spanned the attention's output projection, the router and the expert GEMMs."""
    nodes = list(nodes)
    by_name = {n.name: n for n in nodes}
    cons: dict[str, list] = {n.name: [] for n in nodes}
    for n in nodes:
        for i in n.inputs:
            if i in cons:
                cons[i].append(n)
    core: set[str] = set()
    for n in nodes:
        if n.op in FUSED_ATTENTION:
            core.add(n.name)
        if n.op not in ("softmax", "_softmax", "_safe_softmax"):
            continue
        chain = {n.name}
        # up: to the score matmul
        cur = n
        for _ in range(8):
            prev = [by_name[i] for i in cur.inputs if i in by_name and by_name[i].kind == "call"]
            if not prev:
                break
            cur = prev[0]
            chain.add(cur.name)
            if cur.op in ("bmm", "matmul", "baddbmm"):
                break
        # down: to the matmul with V
        frontier = [n]
        for _ in range(8):
            nxt = [c for f in frontier for c in cons.get(f.name, [])]
            if not nxt:
                break
            for c in nxt:
                chain.add(c.name)
            if any(c.op in ("bmm", "matmul") for c in nxt):
                break
            frontier = nxt
        if not any(by_name[x].op == "topk" for x in chain):
            core |= chain
    return core


def attention_time(q_shape: tuple, k_shape: tuple, v_shape: tuple, device: DeviceSpec, dtype: str = "bf16",
                   shard: float = 1.0, dropout_p: float = 0.0,
                   kernel: AttentionKernel = "fused", causal: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one scaled-dot-product attention with the given q/k/v shapes
    (batch and head dims first), its batch*heads divided by `shard`, run by the software's
    attention `kernel` (`SoftwareSpec.attention_kernel`).

    `kernel == "fused"` (FlashAttention): one matrix op of the QK^T and PV FLOPs at the device's
    measured attention rates (causal kernels, `DeviceSpec.attention_flops`; a non-causal one
    does twice the work, `NONCAUSAL_WORK`) or else the GEMM curve, backward 2.5x (it recomputes
    the scores). "unfused" (Megatron-LM 2021, PyTorch's
    math path): QK^T and PV as batched GEMMs (roofline on their bytes: with a head dim of 64-128 they
    are close to memory-bound), a softmax (with scale and mask fused) that reads and writes the
    b*a*s*s scores, and a dropout on the probabilities when `dropout_p > 0`; backward: 2x the GEMMs,
    1.5x the bytes of softmax and dropout. Where the profile measured the unfused core
    (`DeviceSpec.unfused_attention_flops`: the GEMMs and softmax forward + backward) its measured
    time replaces the roofline's (`unfused_attention_score_time`; the roofline's where that is
    more, as for slices far smaller than measured, where fixed per-kernel costs dominate), split
    between forward and backward in the roofline's proportion; the dropout stays the roofline's
    (the measurement ran none)."""
    *bq, sq, d = (int(x) for x in q_shape)
    sk, dv = int(k_shape[-2]), int(v_shape[-1])
    bh = math.prod(bq) / max(shard, 1.0)
    esz = DTYPE_SIZE.get(dtype, 4)
    qk_flops, pv_flops = 2.0 * bh * sq * sk * d, 2.0 * bh * sq * sk * dv
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    if kernel == "fused":
        nbytes = esz * bh * (sq * d + sk * d + sk * dv + sq * dv)
        flops = qk_flops + pv_flops
        # the kernel compiled for the next head dimension up computes the padded width: its rate at
        # that width, on the FLOPs of the op's own (`DeviceSpec.attention_head_dims`)
        width = max(d, dv)
        padded = kernel_head_dim(device, width)
        rates = attention_rates(device, flops / max(bh, 1e-9) * padded / width, dtype, head_dim=padded)
        if rates is not None and padded != width:
            rates = (rates[0] * width / padded, rates[1] * width / padded)
        if rates is not None and not causal:
            # the tables are causal kernels' rates on whole (undiscounted) FLOPs: a causal kernel
            # skips the score tiles above the diagonal, about half; a full square does them all
            # (ESTIMATE: half the causal rate, i.e. the kernel's own rate on the work it does)
            rates = (rates[0] / NONCAUSAL_WORK, rates[1] / NONCAUSAL_WORK)
        if rates is not None:
            bf = backward_factor("scaled_dot_product_attention")
            return (_roofline(flops, rates[0], nbytes, device),
                    _roofline(flops * bf, rates[1], nbytes * bf, device))
        f = op_time("scaled_dot_product_attention", flops, nbytes, device, dtype)
        return f, op_backward_time("scaled_dot_product_attention", flops, nbytes, device, dtype)
    scores = bh * sq * sk * esz
    qk_bytes = esz * bh * (sq * d + sk * d) + scores
    pv_bytes = scores + esz * bh * (sk * dv + sq * dv)
    fwd = (op_time("bmm", qk_flops, qk_bytes, device, dtype) + op_time("bmm", pv_flops, pv_bytes, device, dtype)
           + op_time("softmax", 5 * scores / esz, 2 * scores, device, dtype))
    bwd = (op_backward_time("bmm", qk_flops, qk_bytes, device, dtype)
           + op_backward_time("bmm", pv_flops, pv_bytes, device, dtype)
           + op_backward_time("softmax", 5 * scores / esz, 2 * scores, device, dtype))
    per_score = unfused_attention_score_time(device, sq, sk, (d + dv) / 2, dtype)
    if per_score is not None:
        # measured: the GEMMs and softmax forward + backward as the device ran them, split between
        # forward and backward as the roofline above splits them (ESTIMATE: the source gives the
        # sum); never below the roofline, which bounds it from below (far below the measured
        # sizes the kernels' fixed overheads, which the per-score time leaves out, dominate)
        core = max(bh * sq * sk * per_score, fwd + bwd)
        fwd, bwd = core * fwd / (fwd + bwd), core * bwd / (fwd + bwd)
    if dropout_p > 0:
        drop_bytes = 2 * scores + scores / esz            # read, write, 1-byte mask
        fwd += op_time("dropout", 2 * scores / esz, drop_bytes, device, dtype)
        bwd += op_backward_time("dropout", 2 * scores / esz, drop_bytes, device, dtype)
    return fwd, bwd


# FLOPs per score element and unit of head dimension by which the unfused-attention speeds are
# published: 4 s^2 d forward per (batch, head) slice (QK^T and PV, 2 s^2 d each), the backward
# 2.5x that, forward + backward 3.5x (Dao 2023's count, benchmarks/benchmark_flash_attention.py)
UNFUSED_FWD_BWD_FLOPS_PER_SCORE = 3.5 * 4


def unfused_attention_score_time(device: DeviceSpec, seq_q: int, seq_k: int, head_dim: float,
                                 dtype: str) -> Optional[float]:
    """Seconds of forward + backward of the unfused attention core (QK^T, softmax, PV and their
    backward) per score element, i.e. per (batch, head) slice and query-key pair, from the profile's
    measured `unfused_attention_flops` for `dtype` (bf16<->fp16, tf32->fp32 stand in for each other);
    None when the profile measured none (then the roofline prices its ops).

    A point's time per score element is `UNFUSED_FWD_BWD_FLOPS_PER_SCORE * d / rate`; per measured
    head dimension it is read at sqrt(seq_q * seq_k), linear in log(s) between measured lengths and
    constant beyond them; across head dimensions it is linear in d (the score traffic is the same at
    every d, the GEMM FLOPs grow with d), between the two measured dimensions around `head_dim`
    or, outside them, along the line through the two nearest."""
    table = device.unfused_attention_flops or {}
    pts = next((table[d] for d in _dtype_fallbacks(dtype) if table.get(d)), None)
    if not pts:
        return None
    s = math.sqrt(seq_q * seq_k)
    by_dim: dict[int, list[tuple[float, float]]] = {}
    for p in pts:
        by_dim.setdefault(p.head_dim, []).append((p.seq, UNFUSED_FWD_BWD_FLOPS_PER_SCORE * p.head_dim / p.flops))
    per_dim = sorted((hd, _log_interp(sorted(v), s)[0]) for hd, v in by_dim.items())
    if len(per_dim) == 1:
        return per_dim[0][1]
    lo = max([p for p in per_dim[:-1] if p[0] <= head_dim] or [per_dim[0]])
    hi = per_dim[per_dim.index(lo) + 1]
    t = lo[1] + (head_dim - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0])
    return t if t > 0 else min(lo, hi, key=lambda p: abs(p[0] - head_dim))[1]


# how much more work a non-causal attention's kernel does than a causal one's on the same shapes
# (the causal one skips the tiles above the diagonal): an ESTIMATE, the FLOP ratio; measured rates
# of non-causal kernels would replace it
NONCAUSAL_WORK = 2.0


def kernel_head_dim(device: DeviceSpec, head_dim: int) -> int:
    """The head dimension the device's fused attention kernel runs `head_dim` at: the smallest of
    its compiled ones (`DeviceSpec.attention_head_dims`) not below it; `head_dim` itself when the
    device lists none or it is above them all."""
    dims = sorted(device.attention_head_dims or ())
    return next((x for x in dims if x >= head_dim), int(head_dim))


def attention_rates(device: DeviceSpec, flops_per_head: float, dtype: str,
                    head_dim: Optional[int] = None) -> Optional[tuple[float, float]]:
    """(forward, backward) FLOP/s of the fused attention kernel for slices of `flops_per_head`
    forward FLOPs, from the profile's measured `attention_flops` for `dtype` (bf16<->fp16 and
    tf32->fp32 fall back to each other): linear in log(FLOPs) between measured sizes, constant
    beyond them. Where the table was measured at several head dimensions, the points of the one
    nearest `head_dim` (in log; None: every point) are read. None when the profile measured none
    (then the GEMM curve stands in)."""
    table = device.attention_flops or {}
    for d in _dtype_fallbacks(dtype):
        pts = table.get(d) or []
        dims = {p.head_dim for p in pts if p.head_dim is not None}
        if head_dim is not None and len(dims) > 1:
            near = min(dims, key=lambda x: (abs(math.log(x / head_dim)), x))
            pts = [p for p in pts if p.head_dim in (near, None)]
        pts = sorted((p.flops_per_head, p.forward_flops, p.backward_flops) for p in pts)
        if pts:
            return _log_interp(pts, flops_per_head)
    return None


def attention_heads_broadcast(node, by_name: Optional[dict]) -> bool:
    """Whether a `scaled_dot_product_attention` call's key or value has another head count than
    its query (multi-query attention passing one K/V head for torch to broadcast) without
    `enable_gqa`: no fused kernel takes it (`check_batch_size_and_num_heads_dense`,
    aten/src/ATen/native/transformers/sdp_utils_cpp.h); torch's math path broadcasts the head
    (`cost_models.memory.attention_is_fused`)."""
    if by_name is None or node.op != "scaled_dot_product_attention" or len(node.inputs) < 3:
        return False
    gqa = node.args[7] if len(node.args) > 7 else node.kwargs.get("enable_gqa", False)
    if gqa is True:
        return False
    shapes = []
    for i in node.inputs[:3]:
        n = by_name.get(i)
        if n is None or not n.outputs or len(n.outputs[0].shape) != 4:
            return False
        shapes.append(n.outputs[0].shape)
    return not (shapes[0][-3] == shapes[1][-3] == shapes[2][-3])


def _attention_node_time(n, index: dict, device: DeviceSpec, dtype: str, shard: float,
                         kernel: AttentionKernel = "fused") -> Optional[tuple[float, float]]:
    shapes = []
    for i in n.inputs[:3]:
        src = index.get(i)
        if src is None or not src.outputs:
            return None
        shapes.append(tuple(int(x) for x in src.outputs[0].shape))
    if len(shapes) < 3 or len(shapes[0]) < 2:
        return None
    p = n.args[4] if len(n.args) > 4 and isinstance(n.args[4], (int, float)) else n.kwargs.get("dropout_p", 0.0)
    if attention_heads_broadcast(n, index):
        kernel = "unfused"          # torch's math path: batched GEMMs around a softmax
    return attention_time(shapes[0], shapes[1], shapes[2], device, dtype, shard, float(p or 0.0), kernel,
                          causal=attention_is_causal(n))


def attention_is_causal(n) -> bool:
    """Whether an attention node runs a causal kernel: `is_causal` set and no mask tensor (a mask
    makes the kernel compute every score tile)."""
    flag = n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False)
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    return bool(flag is True and mask is None)


def alignment_bytes(dim: int, esz: int) -> int:
    """Bytes of the largest power-of-two alignment of a dimension of `dim` elements of `esz` bytes."""
    d = int(dim)
    return esz * (d & -d) if d > 0 else esz


def gemm_alignment_factor(n, index: Optional[dict], device: DeviceSpec, dtype: str) -> float:
    """Fraction of its aligned rate a captured matrix op runs at on `device` given the alignment of
    its contiguous dimensions (`DeviceSpec.gemm_alignment`): K, the last dimension of its first
    input, and N, its output's last. An H100 runs an LM head of vocabulary 50257 (odd) at about a
    fifth of the rate of 50304 (`benchmarks/results/h100-2026-11-25/gemm_alignment.txt`). The
    unsharded dimensions are judged: a tensor-parallel split of an aligned N usually stays
    aligned. 1 when the profile has no table or the shapes are unknown."""
    table = device.gemm_alignment
    if not table or n.op not in MATRIX_OPS or n.op in FUSED_ATTENTION or not n.outputs:
        return 1.0
    src = (index or {}).get(n.inputs[0]) if n.inputs else None
    if src is None or not src.outputs or not src.outputs[0].shape or not n.outputs[0].shape:
        return 1.0
    try:
        k, nn_ = int(src.outputs[0].shape[-1]), int(n.outputs[0].shape[-1])
    except (TypeError, ValueError):   # a symbolic dimension: unknown alignment
        return 1.0
    esz = DTYPE_SIZE.get(dtype, 4)
    worst = min(alignment_bytes(k, esz), alignment_bytes(nn_, esz))
    pts = sorted((p.bytes, p.efficiency) for p in table)
    eff = pts[0][1]
    for b, e in pts:
        if worst >= b:
            eff = e
    return eff


Copies = tuple[frozenset, frozenset]


def reshape_copy_time(n, device: DeviceSpec, dtype: str = "bf16", shard: float = 1.0,
                      index: Optional[dict] = None, fp32: Optional[frozenset] = None) -> tuple[float, float]:
    """(forward, backward) seconds of a reshape that copies (see the module docstring), its
    bytes divided by `shard`: forward a `contiguous` copy of its output (read and written);
    backward its gradient read and the gradient of the smallest tensor of the view chain it
    read (`index`, name -> node: through views back to the op that made the data) written,
    the output's size behind a transpose, a key/value head's behind an expand. `fp32`: see
    `node_time` (a copy of a tensor the run holds in fp32 moves 4-byte elements)."""
    if not n.outputs:
        return 0.0, 0.0
    out = n.outputs[0]
    wide = fp32 is not None and n.name in fp32 and out.dtype in _FLOATING
    scale = (1.0 if wide else bytes_scale(out.dtype, dtype)) / max(float(shard), 1.0)
    numel = src = float(out.numel)
    index = index or {}
    cur = index.get(n.inputs[0]) if n.inputs else None
    for _ in range(32):
        if cur is None or not cur.outputs:
            break
        src = min(src, float(cur.outputs[0].numel))
        if cur.kind != "call" or cur.op not in VIEW_OPS or not cur.inputs:
            break
        cur = index.get(cur.inputs[0])
    esz = out.nbytes / max(numel, 1.0)
    return (op_time("contiguous", 0.0, 2.0 * numel * esz * scale, device, dtype),
            op_time("contiguous", 0.0, (numel + src) * esz * scale, device, dtype))


_FLOATING = ("float32", "float64", "float16", "bfloat16")


def fp32_extra_bytes(n, index: dict, fp32: frozenset, dtype: str) -> float:
    """The bytes op `n` moves beyond what its captured bytes at the training `dtype` give
    (`bytes_scale`) because tensors it writes or reads are fp32 in the run (`fp32`: names,
    `cost_models.memory.graph_fp32_tensors`): each such tensor's bytes at 4 bytes an element
    less at `dtype`'s, as `autopar.capture.flops.node_cost` counts them (every input read once,
    an embedding's table not: the rows it reads are its output's size). An op's fp32 output
    (an RMSNorm's upcast region, a softmax autocast runs in fp32, a product type promotion
    makes fp32) is written at 4 bytes, an fp32 input read at 4, and an op of CUDA autocast's
    fp32 list reads its 2-byte inputs' fp32 copies (4 bytes). Matrix ops and attention are
    left as they are: autocast runs them on a 2-byte copy of an fp32 input (the cast kernels
    are `autocast_cast_time`'s). 0 in an fp32 run, where the op's output is not floating (its bytes
    already unscaled), or where the op moves nothing (a view of an fp32 tensor copies none of
    it; a view that copies is `reshape_copy_time`'s)."""
    if not n.outputs or n.op in MATRIX_OPS or n.op in FUSED_ATTENTION or n.bytes_moved <= 0:
        return 0.0
    s = bytes_scale(n.outputs[0].dtype, dtype)
    if s >= 1.0:
        return 0.0
    extra = 0.0
    if n.name in fp32:
        extra += sum(o.nbytes for o in n.outputs if o.dtype in _FLOATING)
    if n.op == "cross_entropy_loss" and not is_fused_loss(n) and not is_half_loss(n) and n.inputs \
            and n.inputs[0] in index:
        # the eager loss's log-probabilities (`node_cost`): fp32 in any mixed-precision run
        src = index[n.inputs[0]]
        extra += src.outputs[0].nbytes if src.outputs and src.outputs[0].dtype in _FLOATING else 0.0
    ins = n.inputs[1:] if n.op in ("embedding", "index_select", "gather", "index") else n.inputs
    from cost_models.memory import CUDA_FP32_OPS  # memory imports this module
    cast_up = n.op in CUDA_FP32_OPS and n.name in fp32
    for i in ins:
        src = index.get(i)
        if (i in fp32 or cast_up) and src is not None and src.outputs and src.outputs[0].dtype in _FLOATING:
            # an fp32 input, or autocast's fp32 copy of a 2-byte one (`autocast_casts`)
            extra += src.outputs[0].nbytes
    return extra * (1.0 - s)


def autocast_casts(n, index: dict, fp32: frozenset, dtype: str) -> list[tuple[float, bool]]:
    """The cast kernels autocast runs for op `n` of a mixed-precision run (the rules the memory
    model sizes the copies by, `cost_models.memory`): (elements, whether autograd runs the cast's
    backward, a cast of the gradient back, `ToCopyBackward`). A matrix op (attention too: both
    on autocast's lower-precision list) reading a floating activation the run holds in fp32
    (`fp32`: a norm's output, an upcast region's) casts it to the training dtype, once per op
    reading it (autocast caches casts of parameters only: a post-norm block's q, k and v
    projections make three). An op of CUDA autocast's fp32 list (`CUDA_FP32_OPS`: a layer norm,
    whose output `fp32` holds) casts each 2-byte floating input up to fp32, its weight and bias
    too (no cache for up-casts); ops that autocast gives an fp32 `dtype` instead
    (`CUDA_FP32_DTYPE_OPS`: a softmax) read the 2-byte input as it is. The model's own inputs
    need no gradient. Empty in an fp32 run (`fp32` empty)."""
    if not fp32 or DTYPE_SIZE.get(dtype, 4) >= 4 or not n.outputs:
        return []
    from cost_models.memory import CUDA_FP32_OPS  # memory imports this module

    out: list[tuple[float, bool]] = []
    if n.op in MATRIX_OPS:
        for i in n.inputs:
            src = index.get(i)
            if i in fp32 and src is not None and src.kind in ("call", "input") and src.outputs \
                    and src.outputs[0].dtype in _FLOATING:
                out.append((float(src.outputs[0].numel), src.kind == "call"))
    elif n.op in CUDA_FP32_OPS and n.name in fp32:
        for i in n.inputs:
            src = index.get(i)
            if i not in fp32 and src is not None and src.kind in ("call", "input", "param") and src.outputs \
                    and src.outputs[0].dtype in _FLOATING:
                out.append((float(src.outputs[0].numel), src.kind != "input"))
    return out


def autocast_cast_time(n, index: dict, fp32: frozenset, device: DeviceSpec, dtype: str = "bf16",
                       shard: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of the cast kernels autocast runs for op `n`
    (`autocast_casts`), their elements divided by `shard`: each reads its elements at one width
    and writes them at the other (4 and 2 bytes in a bf16 run), one kernel; its backward, where
    the input needs a gradient, the same bytes the other way (measured on an H100: the `copy_`
    kernels of GPT-3 1.3B's step, 2548 of them, 67 ms, 10.5% of the GPU time, unpriced before;
    benchmarks/results/h100-2026-11-25/profiles/profile_gpt3-1.3b-mb4-none.txt)."""
    esz = DTYPE_SIZE.get(dtype, 4)
    fwd = bwd = 0.0
    for numel, grad in autocast_casts(n, index, fp32, dtype):
        t = op_time("_to_copy", 0.0, numel * (4.0 + esz) / max(float(shard), 1.0), device, dtype)
        fwd += t
        bwd += t if grad else 0.0
    return fwd, bwd


def bias_grad_time(n, index: dict, device: DeviceSpec, dtype: str = "bf16", shard: float = 1.0) -> float:
    """Backward seconds of a linear layer's bias gradient: a sum of the output's gradient over its
    rows (`linear`'s backward, tools/autograd/derivatives.yaml: `grad.sum(0)` over the flattened
    rows), a memory-bound reduction outside the two GEMMs: the output's bytes read, one kernel.
    Measured on an H100: 388 `aten::sum` calls, 16.9 ms of GPT-3 1.3B's step, beside 330 ms of
    GEMMs (benchmarks/results/h100-2026-11-25/profiles/profile_gpt3-1.3b-mb4-none.txt). 0 for a
    matrix op without a bias parameter, and where the profile measured a linear layer's backward
    with its bias sum (`matmul_backward_ratio`)."""
    if device.matmul_backward_ratio is not None or not n.outputs:
        return 0.0
    bias = n.inputs[2] if n.op == "linear" and len(n.inputs) > 2 else (
        n.inputs[0] if n.op == "addmm" and n.inputs else None)
    src = index.get(bias) if bias is not None else None
    if src is None or src.kind != "param":
        return 0.0
    out = n.outputs[0]
    return op_time("sum", 0.0, out.nbytes * bytes_scale(out.dtype, dtype) / max(float(shard), 1.0), device, dtype)


# ops splitting a tensor into views whose gradients autograd puts back together: split's,
# chunk's and unbind's backward (`split_backward`, `unbind_backward` in torch's
# tools/autograd/derivatives.yaml) is a `cat` / `stack` of the pieces' gradients into a new
# tensor of the input's size (zeros for a piece that got none)
SPLITS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "unsafe_split"})


def priced(n, copies: Optional["Copies"] = None) -> bool:
    """Whether `node_time` can give captured op `n` any time: it has FLOPs or bytes, is a
    reshape that copies (`copies`), a split whose backward concatenates (`SPLITS`), or a tensor
    autograd sums gradients into (`copies.grad_sums`)."""
    return n.flops > 0 or n.bytes_moved > 0 or (copies is not None and n.name in copies[0]) \
        or (n.op in SPLITS and bool(n.inputs)) or n.name in getattr(copies, "grad_sums", {})


def split_backward_time(n, index: dict, device: DeviceSpec, dtype: str = "bf16", shard: float = 1.0,
                        attention_kernel: AttentionKernel = "fused", fp32: Optional[frozenset] = None) -> float:
    """Backward seconds of a split (`SPLITS`; its forward is views, free): the `cat` of its
    pieces' gradients, the input's bytes read and written. Where the split's input is not laid
    out contiguously (`cost_models.layouts.chain_strides`: GPT's fused projection
    `qkv.view(b, s, heads, 3 * d).transpose(1, 2).split(d, -1)`), the concatenated gradient,
    contiguous in that permuted shape, reaches the op that made the data through the inverse
    views as a copy (the view's backward reshapes a transposed tensor; or the producer's
    backward copies it, as after a transposing reshape, `reshape_copy_time`): its bytes read
    and written again. Measured on an H100 (GPT-3 1.3B, mb 4: `cat` 208 us and a strided
    `copy_` 151 us a layer, 20 and 14.5 ms of the step; benchmarks/results/h100-2026-11-25/
    profiles/profile_gpt3-1.3b-mb4-none.txt), both unpriced before; the roofline prices them at
    the copy bandwidth, below what the strided kernels took."""
    from cost_models.layouts import chain_strides, contiguous_strides  # layouts imports this module

    src = index.get(n.inputs[0]) if n.inputs else None
    if src is None or not src.outputs or src.outputs[0].dtype not in _FLOATING:
        return 0.0
    out = src.outputs[0]
    wide = fp32 is not None and src.name in fp32
    nbytes = out.nbytes * (1.0 if wide else bytes_scale(out.dtype, dtype)) / max(float(shard), 1.0)
    t = op_time("cat", 0.0, 2.0 * nbytes, device, dtype)
    st = chain_strides(src.name, index, device.device_type, attention_kernel)
    try:
        shape = tuple(int(d) for d in out.shape)
    except (TypeError, ValueError):
        return t
    if st is not None and tuple(s for s, d in zip(st, shape) if d != 1) != \
            tuple(s for s, d in zip(contiguous_strides(shape), shape) if d != 1):
        t += op_time("contiguous", 0.0, 2.0 * nbytes, device, dtype)
    return t


def grad_sum_time(n, device: DeviceSpec, dtype: str = "bf16", shard: float = 1.0,
                  copies: Optional[Copies] = None, fp32: Optional[frozenset] = None,
                  index: Optional[dict] = None) -> float:
    """Backward seconds of the adds autograd runs summing gradients that op `n` hands to tensors
    other ops read too (`copies.grad_sums`, `cost_models.layouts.gradient_sums`; `index`, name
    -> node, gives their sizes): each reads two tensors of the tensor's size and writes one (at
    4 bytes an element where the run holds it in fp32, `fp32`), one kernel; its bytes divided by
    `shard`. 0 where `copies` carries no sums."""
    t = 0.0
    for name in getattr(copies, "grad_sums", {}).get(n.name, ()):
        src = (index or {}).get(name)
        if src is None or not src.outputs:
            continue
        out = src.outputs[0]
        wide = fp32 is not None and name in fp32 and out.dtype in _FLOATING
        nbytes = 3.0 * out.nbytes * (1.0 if wide else bytes_scale(out.dtype, dtype)) / max(float(shard), 1.0)
        t += op_time("add", 0.0, nbytes, device, dtype)
    return t


def node_time(n, device: DeviceSpec, dtype: str = "bf16", shard: float = 1.0,
              index: Optional[dict] = None, attention_kernel: AttentionKernel = "fused",
              copies: Optional[Copies] = None, fusion: Optional[FusedChains] = None,
              fp32: Optional[frozenset] = None) -> tuple[float, float]:
    """(forward, backward) seconds of one captured op (`op_node_time`), its backward with the
    sums of its output's gradients autograd runs (`grad_sum_time`; eager software only: a
    compiler fuses them)."""
    fwd, bwd = op_node_time(n, device, dtype, shard, index, attention_kernel, copies, fusion, fp32)
    if fusion is None:
        bwd += grad_sum_time(n, device, dtype, shard, copies, fp32, index)
    return fwd, bwd


def op_node_time(n, device: DeviceSpec, dtype: str = "bf16", shard: float = 1.0,
                 index: Optional[dict] = None, attention_kernel: AttentionKernel = "fused",
                 copies: Optional[Copies] = None, fusion: Optional[FusedChains] = None,
                 fp32: Optional[frozenset] = None) -> tuple[float, float]:
    """(forward, backward) seconds of one captured op at a concrete batch with its work split
    `shard` ways: the roofline with the GEMM curve, the measured backward rates, attention as the
    software's `attention_kernel` runs it (`attention_time`; `index`, name -> node, gives its
    inputs' shapes). Floating-point
    bytes are rescaled to `dtype` (the capture is fp32). The analytic provider and the intra-op
    ILP both price ops with this, so their layer costs differ only in the layouts. `copies`:
    (reshapes that copy, `contiguous` calls that copy nothing) of the op's graph on `device`
    (`cost_models.layouts.graph_layout_copies`); None: every view free, every `contiguous` a
    copy. `fusion`: the graph's element-wise chains that the software runs as one kernel each
    (`cost_models.fusion`, under `SoftwareSpec.pointwise_fusion == "fused"`): a member is
    priced as its share of its chain's kernel; None: every op its own kernel (eager). `fp32`:
    the tensors a mixed-precision run holds in fp32 (`cost_models.memory.graph_fp32_tensors`,
    the memory model's rule): what the op reads or writes of them moves 4 bytes an element,
    not the training dtype's (`fp32_extra_bytes`), and the casts autocast makes for it are
    its kernels too (`autocast_cast_time`); None: every floating tensor at `dtype`."""
    if fusion is not None and n.name in fusion:
        return chain_member_time(n.name, fusion, device, dtype, shard)
    if n.op in SPLITS:
        return 0.0, split_backward_time(n, index or {}, device, dtype, shard, attention_kernel, fp32)
    if copies is not None:
        if n.name in copies[0]:
            return reshape_copy_time(n, device, dtype, shard, index, fp32)
        if n.name in copies[1]:
            return 0.0, 0.0
    f = max(float(shard), 1.0)
    tdt = n.outputs[0].dtype if n.outputs else "float32"
    flops, nbytes = n.flops / f, n.bytes_moved * bytes_scale(tdt, dtype) / f
    casts = (0.0, 0.0)
    if fp32:
        nbytes += fp32_extra_bytes(n, index or {}, fp32, dtype) / f
        if fusion is None:   # fusing software folds the casts into its kernels
            casts = autocast_cast_time(n, index or {}, fp32, device, dtype, f)
    att = (_attention_node_time(n, index or {}, device, dtype, f, attention_kernel) if n.op in FUSED_ATTENTION
           else None)
    if att is not None:
        fwd, bwd = att
    elif n.op == "grouped_mm":
        w = (index or {}).get(n.inputs[1]) if len(n.inputs) > 1 else None
        groups = int(w.outputs[0].shape[0]) if w is not None and w.outputs and len(w.outputs[0].shape) == 3 else 1
        fwd, bwd = grouped_gemm_time(flops, nbytes, groups, device, dtype)
    else:
        fwd = op_time(n.op, flops, nbytes, device, dtype)
        bwd = op_backward_time(n.op, flops, nbytes, device, dtype)
        align = gemm_alignment_factor(n, index, device, dtype)
        if align < 1.0:
            fwd, bwd = fwd / align, bwd / align
        if n.op in ("linear", "addmm"):
            bwd += bias_grad_time(n, index or {}, device, dtype, f)
    if n.op in ("arange", "zeros", "ones", "full", "empty") or n.op == "to" and not n.inputs:
        bwd = 0.0
    return fwd + casts[0], bwd + casts[1]


def grouped_gemm_time(flops: float, bytes_moved: float, groups: int, device: DeviceSpec,
                      dtype: str = "bf16") -> tuple[float, float]:
    """(forward, backward) seconds of a grouped GEMM of `flops` over `groups` expert matrices:
    `groups` GEMMs of the average size, each at the device's GEMM efficiency for that size (the
    profile's curve; no grouped-GEMM kernel is measured separately, and routing imbalance inside
    the group is the caller's to add). Fine-grained experts are small GEMMs: 64 experts of a
    4096-token micro-batch top-6 get 384 rows each."""
    g = max(int(groups), 1)
    return (g * op_time("mm", flops / g, bytes_moved / g, device, dtype),
            g * op_backward_time("mm", flops / g, bytes_moved / g, device, dtype))


def op_list_time(nodes: Iterable, device: DeviceSpec, dtype: str = "bf16", *,
                 recompute: Recompute | bool = "none", shard: Shard = 1.0,
                 index: Optional[dict] = None, attention_kernel: AttentionKernel = "fused",
                 copies: Optional[Copies] = None, fusion: Optional[FusedChains] = None,
                 fp32: Optional[frozenset] = None) -> ComputeTime:
    """Training compute seconds (forward + backward + recomputation) of captured ops at a concrete
    batch, attention run by the software's `attention_kernel`. Each op's FLOPs and bytes are
    divided by `shard` (a number, or a function of the op node giving its sharding factor, e.g.
    the tensor-parallel degree for the ops it splits).
    Floating-point bytes are rescaled to `dtype` (see `bytes_scale`). `index` (name -> node) lets
    attention ops find their inputs' shapes when those are not in `nodes`. `copies`: see
    `node_time` (the reshapes that copy are charged, the `contiguous` calls that copy nothing
    are not); `fusion`: see `node_time` (element-wise chains as one kernel each); `fp32`: see
    `node_time` (the tensors a mixed-precision run holds in fp32)."""
    rec = "full" if recompute is True else ("none" if recompute is False else recompute)
    if rec not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    nodes = list(nodes)
    index = {**(index or {}), **{n.name: n for n in nodes}}
    nodes = [n for n in nodes if n.kind == "call"]
    core = attention_core(nodes) if rec == "selective" else set()
    out = ComputeTime()
    for n in nodes:
        if not priced(n, copies):
            continue
        f = shard(n) if callable(shard) else shard
        fwd, bwd = node_time(n, device, dtype, f, index, attention_kernel, copies, fusion, fp32)
        re = fwd if rec == "full" or n.name in core else 0.0
        out.forward_s += fwd
        out.backward_s += bwd
        out.recompute_s += re
        out.per_layer[n.layer] = out.per_layer.get(n.layer, 0.0) + fwd + bwd + re
    return out


def graph_compute_time(graph, device: DeviceSpec, dtype: str = "bf16", *,
                       recompute: Recompute | bool = "none", shard: Shard = 1.0,
                       layers: Optional[Iterable[Optional[str]]] = None,
                       attention_kernel: AttentionKernel = "fused",
                       pointwise_fusion: PointwiseFusion = "eager", autocast: bool = True) -> ComputeTime:
    """Training compute seconds of one micro-batch of a captured `OpGraph` at a concrete batch
    (`graph.at_batch(b)`), optionally only the ops of `layers` (layer FQNs; None names the ops
    outside every layer). See `op_list_time` for `recompute`, `shard` and `attention_kernel`;
    the reshapes that copy on `device.device_type` are charged (`node_time`'s `copies`), and
    under `pointwise_fusion == "fused"` (the software's) each element-wise chain is one kernel
    (`cost_models.fusion`); `autocast`: the software's mixed precision (`SoftwareSpec.autocast`:
    which tensors a bf16/fp16 run holds in fp32, `cost_models.memory.graph_fp32_tensors`)."""
    # layouts and memory import this module
    from cost_models.layouts import graph_layout_copies
    from cost_models.memory import graph_fp32_tensors

    if graph.batch_size is None and any(o.is_batched for n in graph.nodes for o in n.outputs):
        raise ValueError("the graph has symbolic batch dimensions; call graph.at_batch(b) first")
    nodes = graph.calls
    if layers is not None:
        keep = set(layers)
        nodes = [n for n in nodes if n.layer in keep]
    return op_list_time(nodes, device, dtype, recompute=recompute, shard=shard,
                        index={n.name: n for n in graph.nodes}, attention_kernel=attention_kernel,
                        copies=graph_layout_copies(graph, device.device_type, attention_kernel),
                        fusion=fusion_of(graph, device, attention_kernel, pointwise_fusion),
                        fp32=graph_fp32_tensors(graph, device.device_type, dtype, attention_kernel, autocast))


def fusion_of(graph, device: DeviceSpec, attention_kernel: AttentionKernel = "fused",
              pointwise_fusion: PointwiseFusion = "eager") -> Optional[FusedChains]:
    """The element-wise chains `node_time` prices as one kernel each when the software fuses
    them (`SoftwareSpec.pointwise_fusion == "fused"`: `cost_models.fusion.graph_pointwise_chains`
    of `graph` on `device`), else None (eager: one kernel per op)."""
    if pointwise_fusion not in POINTWISE_FUSIONS:
        raise ValueError(f"pointwise fusion must be one of {', '.join(POINTWISE_FUSIONS)}, got {pointwise_fusion!r}")
    if pointwise_fusion in ("norm_moe", "norm"):
        from cost_models.fusion import graph_module_groups
        return graph_module_groups(graph, device.device_type, attention_kernel, experts=pointwise_fusion == "norm_moe")
    if pointwise_fusion == "eager":
        return None
    return graph_pointwise_chains(graph, device.device_type, attention_kernel)
