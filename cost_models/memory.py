"""Memory per device: model states (precision policy x ZeRO stage), activations of one micro-batch
from the liveness of the captured graph, micro-batches in flight by pipeline schedule, and the
peak against the device's capacity.

Activations: a tensor is held from the forward to the backward when some op saves it for its
backward. Rules per op family (what PyTorch's autograd formulas save; views share their base's
storage, so a tensor saved twice, or through two views, counts once):
- matrix ops (linear, mm, bmm, matmul, addmm, baddbmm, conv): their activation inputs
  (parameters are model states, not activations);
- fused attention (scaled_dot_product_attention): q, k, v, its output and the log-sum-exp
  (fp32, one per query row); never the s x s scores;
- softmax, log-softmax, tanh, sigmoid, exp, rsqrt: their output;
- gelu, silu, pow and other non-linear unary ops: their input;
- layer/RMS norm: their input plus mean and rstd (fp32, one per row);
- dropout: its mask (1 byte per element);
- mul/div by a tensor: its activation operands; add, sub, casts, copies, concatenation, views: nothing;
- embedding: its indices; cross-entropy: its logits and targets;
- anything else: all its activation inputs (conservative).
Recomputation (Korthikanti et al. 2022, arXiv 2205.05198):
- "selective" drops what the attention core (scores, softmax, dropout on probabilities, the
  matmul with V) saves of its own intermediates; it keeps Q, K, V and re-runs the core;
- "full" keeps only each layer's inputs (tensors a layer reads from outside it); ops outside the
  repeated layers keep their tensors; one layer's full activations are live again while its
  backward runs (`working_bytes`).
Captures are fp32 on meta: `dtype` rescales floating-point tensors to the training dtype, so the
figures are those of a bf16/fp16 run (masks and indices keep their size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Optional, Union

from autopar.capture.flops import VIEW_OPS
from autopar.schema.cluster import DeviceSpec
from cost_models.compute import DTYPE_SIZE, MATRIX_OPS, FUSED_ATTENTION, attention_core, bytes_scale

Recompute = Literal["none", "selective", "full"]
ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]

# bytes per parameter: (weights, gradients, optimizer states incl. fp32 master) by precision policy
PRECISION_POLICIES: dict[str, tuple[float, float, float]] = {
    "bf16": (2, 2, 12),   # bf16 weights + grads; fp32 master, Adam m and v
    "fp16": (2, 2, 12),
    "fp32": (4, 4, 8),    # fp32 weights + grads; Adam m and v
}

SAVE_OUTPUT = frozenset({"softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "tanh",
                         "sigmoid", "exp", "rsqrt", "sqrt", "relu"})
SAVE_INPUT = frozenset({"gelu", "silu", "mish", "elu", "leaky_relu", "pow", "log", "sin", "cos",
                        "abs", "hardswish", "softplus"})
SAVE_NOTHING = frozenset({"add", "sub", "neg", "cat", "stack", "clone", "contiguous", "to", "_to_copy",
                          "copy_", "arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like",
                          "new_zeros", "new_ones", "sum", "mean", "tril", "triu", "scalar_tensor",
                          "_assert_tensor_metadata", "lift_fresh_copy", "type_as", "fill_", "detach"})
NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm",
                   "native_batch_norm", "_native_batch_norm_legit", "_fused_rms_norm"})
DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})


# -- model states ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelStates:
    """Bytes per device of weights, gradients and optimizer states."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(num_params: float, policy: str = "bf16", zero_stage: int = 0, dp: int = 1) -> ModelStates:
    """Model-state bytes per device for `num_params` parameters (already divided by tensor and
    pipeline parallelism) under `policy` and ZeRO `zero_stage` over `dp` data-parallel ranks
    (Rajbhandari et al. 2020): stage 1 shards the optimizer states, 2 also the gradients, 3 also
    the weights. bf16 + AdamW: 16 bytes/param; ZeRO-1 4+12/N, ZeRO-2 2+14/N, ZeRO-3 16/N."""
    if policy not in PRECISION_POLICIES:
        raise ValueError(f"unknown precision policy {policy!r}; one of {', '.join(PRECISION_POLICIES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    w, g, o = (num_params * x for x in PRECISION_POLICIES[policy])
    n = max(int(dp), 1)
    return ModelStates(weights=w / n if zero_stage >= 3 else w,
                       gradients=g / n if zero_stage >= 2 else g,
                       optimizer=o / n if zero_stage >= 1 else o)


# -- activations ----------------------------------------------------------------------------------

@dataclass
class ActivationMemory:
    """Activation bytes of one micro-batch held between forward and backward.

    `per_layer[fqn]` is what each repeated layer holds (key None: ops outside every layer);
    `working_bytes` is the transient extra while one layer is recomputed for its backward."""

    saved_bytes: float = 0.0
    per_layer: dict[Optional[str], float] = field(default_factory=dict)
    working_bytes: float = 0.0

    @property
    def peak_bytes(self) -> float:
        return self.saved_bytes + self.working_bytes


Shard = Union[float, Callable[..., float]]


def _tensor_inputs(node, by_name: dict) -> list[str]:
    """Names of the activation (non-parameter, non-buffer, non-constant) tensor inputs of `node`."""
    return [i for i in node.inputs if i in by_name and by_name[i].kind in ("call", "input")]


def saved_tensors(node, by_name: dict, dtype: str = "bf16") -> list[tuple[str, Optional[float]]]:
    """What `node` saves for its backward: (tensor name, None) for a graph tensor (sized by the
    caller from its base), or (private key, bytes) for a tensor the op makes on the side (a dropout
    mask, norm statistics, attention log-sum-exp). See the module docstring for the rules."""
    op = node.op
    if op in VIEW_OPS or node.target == "getitem" or op in SAVE_NOTHING:
        return []
    ins = _tensor_inputs(node, by_name)
    out = node.outputs[0] if node.outputs else None
    if op in MATRIX_OPS and op not in FUSED_ATTENTION:
        if op in ("addmm", "baddbmm"):
            ins = [i for i in ins if i != (node.inputs[0] if node.inputs else None)]
        return [(i, None) for i in ins]
    if op in FUSED_ATTENTION:
        extra = []
        if out is not None:
            rows = math.prod(int(d) for d in out.shape[:-1])
            extra = [(node.name + ":lse", 4.0 * rows)]
        return [(i, None) for i in ins[:3]] + [(node.name, None)] + extra
    if op in SAVE_OUTPUT:
        return [(node.name, None)]
    if op in SAVE_INPUT:
        return [(i, None) for i in ins[:1]]
    if op in NORMS:
        rows = math.prod(int(d) for d in out.shape[:-1]) if out is not None and out.shape else 0
        return [(i, None) for i in ins[:1]] + [(node.name + ":stats", 2 * 4.0 * rows)]
    if op in DROPOUTS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if not train or not isinstance(p, (int, float)) or p <= 0 or out is None:
            return []
        return [(node.name + ":mask", 1.0 * out.numel)]
    if op in ("mul", "div", "true_divide", "mul_", "div_"):
        # by a tensor (activation or parameter): each gradient needs the other operand; by a scalar: nothing
        return [(i, None) for i in ins] if len(node.inputs) >= 2 else []
    if op in ("embedding", "index_select", "gather", "index"):
        return [(i, None) for i in ins if by_name[i].outputs and "int" in by_name[i].outputs[0].dtype]
    if op in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "mse_loss", "l1_loss", "smooth_l1_loss"):
        return [(i, None) for i in ins]
    if op in ("masked_fill", "where"):
        return [(i, None) for i in ins if by_name[i].outputs and by_name[i].outputs[0].dtype == "bool"]
    return [(i, None) for i in ins]


def _bases(nodes: list, by_name: dict) -> dict[str, str]:
    """Each tensor name -> the name of the tensor owning its storage (through views)."""
    base: dict[str, str] = {}
    for n in nodes:
        if n.kind == "call" and (n.op in VIEW_OPS or n.target == "getitem") and n.inputs:
            src = n.inputs[0]
            prod = by_name.get(src)
            if n.target == "getitem" and prod is not None and prod.kind == "call" and not (
                    prod.op in VIEW_OPS):
                base[n.name] = n.name          # an output of a multi-output op, not a view
            else:
                base[n.name] = base.get(src, src)
        else:
            base[n.name] = n.name
    return base


def activation_memory(graph, dtype: str = "bf16", recompute: Recompute | bool = "none", *,
                      layers: Optional[Iterable[Optional[str]]] = None, shard: Shard = 1.0) -> ActivationMemory:
    """Activation bytes of one micro-batch of `graph` (at a concrete batch, `graph.at_batch(b)`),
    optionally restricted to `layers` (FQNs; None names the ops outside every layer), with
    floating-point tensors at `dtype` and each tensor's bytes divided by `shard` (a number, or a
    function of the node producing it, e.g. tensor parallelism for the tensors it splits)."""
    rec = "full" if recompute is True else ("none" if recompute is False else recompute)
    if rec not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if graph.batch_size is None and any(o.is_batched for n in graph.nodes for o in n.outputs):
        raise ValueError("the graph has symbolic batch dimensions; call graph.at_batch(b) first")
    nodes = list(graph.nodes)
    by_name = {n.name: n for n in nodes}
    base = _bases(nodes, by_name)
    calls = [n for n in nodes if n.kind == "call"]
    core = attention_core(calls) if rec == "selective" else set()
    keep = None if layers is None else set(layers)

    def size(name: str) -> float:
        b = by_name[base[name]]
        if not b.outputs:
            return 0.0
        o = b.outputs[0]
        f = shard(b) if callable(shard) else shard
        return o.nbytes * bytes_scale(o.dtype, dtype) / max(float(f), 1.0)

    def side(nbytes: float, owner) -> float:
        # masks are 1 byte/element, norm statistics and log-sum-exp stay fp32 in mixed precision
        f = shard(owner) if callable(shard) else shard
        return nbytes / max(float(f), 1.0)

    # what every op saves, attributed to its layer (first saver wins)
    owner_layer: dict[str, Optional[str]] = {}
    nbytes_of: dict[str, float] = {}
    full_layer: dict[Optional[str], float] = {}
    for n in calls:
        for name, extra in saved_tensors(n, by_name, dtype):
            if extra is None:
                key = base.get(name, name)
                if key not in by_name or by_name[key].kind not in ("call", "input"):
                    continue
                if rec == "selective" and n.name in core and key in core:
                    continue
                b = size(name)
            else:
                key = name
                if rec == "selective" and n.name in core:
                    continue
                b = side(extra, n)
            if key in owner_layer:
                continue
            owner_layer[key] = n.layer
            nbytes_of[key] = b
    if rec == "full":
        # per layer: everything it saves is recomputed; it keeps only its inputs from outside
        for k, l in owner_layer.items():
            full_layer[l] = full_layer.get(l, 0.0) + nbytes_of[k]
        kept_owner: dict[str, Optional[str]] = {}
        kept_bytes: dict[str, float] = {}
        for k, l in owner_layer.items():
            if l is None:
                kept_owner[k], kept_bytes[k] = None, nbytes_of[k]
        for n in calls:
            if n.layer is None:
                continue
            for i in n.inputs:
                p = by_name.get(i)
                if p is None or p.kind not in ("call", "input"):
                    continue
                b = base.get(i, i)
                if by_name[b].layer == n.layer or (by_name[i].layer == n.layer):
                    continue
                key = b
                if key in kept_owner and kept_owner[key] is not None:
                    continue
                kept_owner[key], kept_bytes[key] = n.layer, size(i)
        owner_layer, nbytes_of = kept_owner, kept_bytes
    out = ActivationMemory()
    for k, l in owner_layer.items():
        if keep is not None and l not in keep:
            continue
        out.per_layer[l] = out.per_layer.get(l, 0.0) + nbytes_of[k]
        out.saved_bytes += nbytes_of[k]
    if rec == "full":
        cand = [v for l, v in full_layer.items() if l is not None and (keep is None or l in keep)]
        out.working_bytes = max(cand, default=0.0)
    return out


# -- schedules and peak ---------------------------------------------------------------------------

def inflight_microbatches(schedule: ScheduleName | str, num_stages: int, stage: int, num_microbatches: int,
                          virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` (0-based) holds at once, in units of one
    micro-batch through all of the stage's layers.

    GPipe: all m. 1F1B: min(p - stage, m) (Narayanan et al. 2021). Interleaved 1F1B with v model
    chunks per device (Megatron-LM's schedule): rank r runs (p - r - 1)·2 + (v - 1)·p warm-up
    chunk-forwards then one more before its first backward, each holding 1/v of the stage's
    layers: ((p - r - 1)·2 + (v - 1)·p + 1)/v, capped at m; for r = 0 that is p + (p - 1)/v
    (Korthikanti et al. 2022, §4.2.3)."""
    p, m, r, v = int(num_stages), int(num_microbatches), int(stage), max(int(virtual_stages), 1)
    if not 0 <= r < p:
        raise ValueError(f"stage {r} is outside 0..{p - 1}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or (schedule == "interleaved_1f1b" and v == 1):
        return float(min(p - r, m))
    if schedule == "interleaved_1f1b":
        return float(min(((p - r - 1) * 2 + (v - 1) * p + 1) / v, m))
    raise ValueError(f"unknown schedule {schedule!r}; one of gpipe, 1f1b, interleaved_1f1b")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one device, by part."""

    model_states: ModelStates
    activations: float       # saved activations of the micro-batches in flight
    working: float           # transient: a recomputed layer, buffers
    capacity: float

    @property
    def peak(self) -> float:
        return self.model_states.total + self.activations + self.working

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity


# fraction of device memory usable by tensors: CUDA context (~0.5-1 GiB), the caching allocator's
# fragmentation and NCCL buffers take the rest (PyTorch CUDA memory management notes).
USABLE_FRACTION = 0.92


def usable_memory(device: DeviceSpec) -> float:
    """Bytes of `device` memory a plan may fill (`USABLE_FRACTION` of its capacity)."""
    return device.memory_bytes * USABLE_FRACTION


def peak_memory(num_params: float, activation_bytes: float, device: DeviceSpec, *,
                schedule: ScheduleName | str = "1f1b", num_stages: int = 1, stage: int = 0,
                num_microbatches: int = 1, virtual_stages: int = 1, policy: str = "bf16",
                zero_stage: int = 0, dp: int = 1, working_bytes: float = 0.0) -> MemoryBreakdown:
    """Peak bytes per device of a pipeline stage: model states of its `num_params` parameters
    (per device, after tensor parallelism), `activation_bytes` of one micro-batch of the stage
    times the micro-batches in flight, plus `working_bytes`; against `usable_memory(device)`."""
    states = model_state_bytes(num_params, policy, zero_stage, dp)
    n = inflight_microbatches(schedule, num_stages, stage, num_microbatches, virtual_stages)
    return MemoryBreakdown(states, activation_bytes * n, working_bytes, usable_memory(device))


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, recompute: Recompute = "none",
                            sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022's closed form for one transformer layer's activations (16-bit):
    s·b·h·(34 + 5·a·s/h) without parallelism, s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor
    parallelism t, 34/t without the score terms under selective recompute, 2·s·b·h under full.
    A reference for tests and sanity checks; the planner uses `activation_memory`."""
    if recompute == "full":
        return 2.0 * s * b * h / (t if sequence_parallel else 1)
    score = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    base = 34.0 / t if sequence_parallel else 10.0 + 24.0 / t
    return s * b * h * (base + score)
