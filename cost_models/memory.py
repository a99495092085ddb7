"""Memory per device: model states (precision policy x ZeRO stage), activations of one micro-batch
from the liveness of the captured graph, micro-batches in flight by pipeline schedule, and the
peak against the device's capacity.

Activations: a tensor is held from the forward to the backward when some op saves it for its
backward. Rules per op family (what PyTorch's autograd formulas save; views share their base's
storage, so a tensor saved twice, or through two views, counts once):
- matrix ops (linear, mm, bmm, matmul, addmm, baddbmm, conv): their activation inputs
  (parameters are model states, not activations);
- fused attention (scaled_dot_product_attention): q, k, v, a mask given as a tensor, its output
  and the log-sum-exp (fp32, one per query row); never the s x s scores; torch's math path
  where no fused kernel takes the call (`attention_is_fused`: CPU dropout, a key/value with
  fewer heads than the query without enable_gqa) saves copies of q, k and v at the query's
  heads and the probabilities (`_math_attention_saves`); software that runs attention unfused
  (`SoftwareSpec.attention_kernel`, Megatron-LM 2021) saves q, k, v, the probabilities and,
  with dropout, its mask and output (Korthikanti et al.'s count);
- softmax, log-softmax, tanh, sigmoid, exp, rsqrt: their output;
- gelu, silu, pow and other non-linear unary ops: their input;
- layer/RMS norm: their input plus mean and rstd (fp32, one per row);
- dropout: its mask (1 byte per element);
- mul/div by a tensor: its activation operands; add, sub (in place too), casts, copies, concatenation, views: nothing;
- embedding: its indices; cross-entropy: its logits and targets;
- anything else: all its activation inputs (conservative);
- the ops of a custom autograd Function's forward (Hugging Face BLOOM's GELU, a straight-through
  estimator): nothing each, the call what its forward saves for its own backward (its input,
  for BLOOM), as the runtime runs the Function on every path (`capture.functions`).
Recomputation (Korthikanti et al. 2022, arXiv 2205.05198):
- "selective" drops what the attention core (scores, softmax, dropout on probabilities, the
  matmul with V) saves of its own intermediates; it keeps Q, K, V and re-runs the core;
- "full" keeps only each layer's inputs (tensors a layer reads from outside it); ops outside the
  repeated layers keep their tensors; one layer's full activations are live again while its
  backward runs, beside the gradients its ops make (`working_bytes`).
  `selective_region="ops"` is what autopar's runtime executes (`selective_ops`: the ops of each
  layer's attention core, with the few its run of ops interleaves, e.g. the mask's slicing; the
  plan names them, `StagePlan.recompute_ops`): one checkpointed region per layer under torch's
  selective activation checkpointing, those ops MUST_RECOMPUTE: every tensor they save is
  dropped and re-made in the backward, the region keeps its inputs (non-reentrant checkpoint
  stores the function's arguments: Q, K, V), the ops outside it save as without recomputation
  (the core's output among them, which the output projection saves). With a fused attention
  kernel the core saves little of its own (the log-sum-exp; the output is kept by its reader):
  selective then buys almost no memory for one attention forward of time. `selective_region=
  "module"`: a stage run module by module whose core spans several calls, which a module's
  forward cannot cut out, checkpoints the module holding it whole (`checkpointed_module`).
- "attention" checkpoints the module holding each layer's attention core whole
  (`checkpointed_module`: its q/k/v and output projections too): the module keeps its input,
  every tensor its ops save is re-made in the backward (the region of "selective" with
  `selective_region="module"`, which does not apply to "attention").
`count_inputs=False`: graph inputs (the model's batch) are not activations: the runtime holds
the rank's rows of the step's batch through the step anyway (the planner counts them as the
stage's batch) and a micro-batch's slice of them is a view, so an op saving it adds nothing;
except a floating input read by a matrix op under mixed precision: autocast saves the 2-byte
copy it makes.
Captures are fp32 on meta: `dtype` rescales floating-point tensors to the training dtype, so the
figures are those of a bf16/fp16 run (masks and indices keep their size). `device_type` ("cuda",
"cpu") applies torch.autocast's per-device op lists as autopar's runtime runs mixed precision
(bf16 parameters under `torch.autocast(device_type)`; None: every op at `dtype`, Megatron's
convention without autocast):
- CUDA autocasts layer/group norm, softmax, log-softmax, exp, log, pow, rsqrt and the losses to
  fp32 ("CUDA Ops that can autocast to float32", torch.amp docs; `KERNEL_CUDA(..., fp32)` in
  aten/src/ATen/autocast_mode.cpp): such an op saves the fp32 copy autocast makes of its input
  (4 bytes per element) and its fp32 output, its statistics fp32;
- CPU's fp32 list has the losses but not layer norm or softmax ("CPU Ops that can autocast to
  float32"): those run in the input's 2-byte dtype, and CPU's native_layer_norm returns mean and
  rstd in that dtype too (measured: bf16 mean/rstd for a bf16 input, torch 2.13).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Optional, Sequence, Union

import numpy as np

from autopar.capture.flops import VIEW_OPS, is_view
from autopar.schema.cluster import DeviceSpec
from autopar.schema.constraints import RECOMPUTES, Recompute
from autopar.schema.constraints import Schedule as ScheduleName  # the registry's names
from autopar.schema.software import AttentionKernel
from cost_models.compute import (
    DTYPE_SIZE,
    FUSED_ATTENTION,
    MATRIX_OPS,
    attention_core,
    attention_heads_broadcast,
    bytes_scale,
)
from cost_models.fused_loss import is_fused_loss, is_half_loss
from cost_models.layouts import executor_layout_copies, graph_layout_copies, layout_copies

# bytes per parameter: (weights, gradients, optimizer states incl. fp32 master) by precision policy
PRECISION_POLICIES: dict[str, tuple[float, float, float]] = {
    "bf16": (2, 2, 12),   # bf16 weights + grads; fp32 master, Adam m and v
    "fp16": (2, 2, 12),
    "fp32": (4, 4, 8),    # fp32 weights + grads; Adam m and v
    # no master: the optimizer steps the 2-byte parameters, its moments in their dtype
    # (`SoftwareSpec.optimizer_states` "param": torch.optim.Adam on a model cast to bf16)
    "bf16_param": (2, 2, 4),
    "fp16_param": (2, 2, 4),
    # fp32 gradients beside the 2-byte weights, accumulated, reduced and stepped in fp32
    # (`SoftwareSpec.grad_dtype` "fp32": Megatron-Core's DDP under --bf16 keeps one fp32 `main_grad`
    # buffer, github.com/NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel.py
    # `grad_dtype = torch.float if self.ddp_config.grad_reduce_in_fp32` at 1e057005 line 234; 2 + 4 +
    # 12, the distributed optimizer's "6 + 12/d" for bf16 parameters and fp32 gradients,
    # docs/source/api-guide/dist_optimizer.md line 10)
    "bf16_fp32grad": (2, 4, 12),
    "fp16_fp32grad": (2, 4, 12),
}

# what each op's backward reads (tools/autograd/derivatives.yaml): its result, its input, both
SAVE_OUTPUT = frozenset({"softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "tanh",
                         "sigmoid", "exp", "rsqrt", "sqrt", "relu", "expm1", "exp2", "tan", "reciprocal",
                         "erfinv"})
SAVE_INPUT = frozenset({"gelu", "silu", "mish", "elu", "leaky_relu", "pow", "log", "sin", "cos",
                        "abs", "hardswish", "softplus", "log1p", "log2", "log10", "acos", "asin", "atan",
                        "sinh", "cosh", "erf", "erfc"})
SAVE_INPUT_AND_OUTPUT = frozenset({"cumprod", "prod", "logsumexp"})
SAVE_NOTHING = frozenset({"add", "sub", "neg", "add_", "sub_", "neg_", "cat", "stack", "clone", "contiguous", "to",
                          "_to_copy", "cumsum",
                          "copy_", "arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like",
                          "new_zeros", "new_ones", "sum", "mean", "tril", "triu", "scalar_tensor",
                          "_assert_tensor_metadata", "lift_fresh_copy", "type_as", "fill_", "detach"})
NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm",
                   "native_batch_norm", "_native_batch_norm_legit", "_fused_rms_norm"})
DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
# losses: autocast runs them in fp32 on CUDA and CPU alike (torch.amp's "ops that can autocast to
# float32" lists), so what they save and the gradient they hand back are 4-byte tensors in a
# mixed-precision step too
LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "mse_loss", "l1_loss", "smooth_l1_loss",
                    "huber_loss", "kl_div", "binary_cross_entropy_with_logits"})
# losses whose reduced (0-dim) output on CPU shares the storage of the unreduced, input-sized
# fp32 loss (torch 2.13's CPU kernels: `F.mse_loss(x, y).untyped_storage().nbytes()` is
# x.numel() * 4, also under autocast; l1, huber, cross-entropy and nll return a 4-byte scalar).
# Measured on CPU only: not assumed on CUDA. On DTensors the local kernel's output is the loss
# where the input is whole on the rank (replicated: the same storage, torch 2.13 on a fake
# process group); a loss on a split input is a partial one, reduced into a fresh scalar
LOSSES_KEEP_UNREDUCED = frozenset({"mse_loss", "smooth_l1_loss"})
# losses whose backward reads their input itself (derivatives.yaml: `mse_loss_backward(grad,
# self, target, ...)`, likewise smooth_l1, huber and BCE-with-logits): what they save is that
# tensor. A cross-entropy saves its log-probabilities instead, a tensor of its own (counted
# there as its input, the same size)
LOSSES_SAVING_INPUT = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                                 "binary_cross_entropy_with_logits"})
# ops CPU runs on an fp32 copy of their input whatever the dtype (composites that upcast)
CPU_FP32_INPUT = frozenset({"rms_norm"})
# ops CUDA's autocast runs in fp32 besides the losses, by aten short name (torch.amp docs, "CUDA
# Ops that can autocast to float32"; aten/src/ATen/autocast_mode.h, `AT_FORALL_FP32`): autocast
# casts their 2-byte inputs to fp32 first (a copy, which the op saves where it saves its input),
# and their outputs are fp32
CUDA_FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "dist", "pdist", "cdist", "_cdist_forward", "renorm", "logsumexp"})
# ops it runs with an fp32 `dtype` argument instead (`AT_FORALL_FP32_SET_OPT_DTYPE`, and `norm`'s
# `fp32_append_dtype`): they read their 2-byte input as it is (a reduction accumulates in fp32; a
# softmax casts it inside, a transient) and give fp32 outputs, so what they save of their input
# is the 2-byte tensor (`prod`, `cumprod`) and only their outputs are fp32
CUDA_FP32_DTYPE_OPS = frozenset({
    "prod", "softmax", "_softmax", "log_softmax", "_log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "norm"})
# every op whose output CUDA's autocast makes fp32 (the losses apart)
CUDA_FP32_OUTPUT_OPS = CUDA_FP32_OPS | CUDA_FP32_DTYPE_OPS


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


def param_cast_saved_bytes(param_dtype: str, dtype: str) -> float:
    """Bytes per parameter element one micro-batch's forward saves for its backward as the 2-byte
    casts of weights kept in fp32 (`SoftwareSpec.param_dtype` "fp32", a 2-byte `dtype` under
    autocast): a matrix op saves the weight it multiplied by, the cast (flash-attn's FusedDenseFunc
    `ctx.save_for_backward(x, weight)` after `weight.to(dtype)`, FusedMLPFunc its `weight1`,
    `weight2`; torch's linear under autocast its cast input), alive until the op's backward; 0
    with parameters in the training dtype (the saved weight is the parameter itself). A layer
    recomputed in full saves none."""
    if param_dtype != "fp32" or DTYPE_SIZE.get(dtype, 4) >= 4:
        return 0.0
    return float(DTYPE_SIZE[dtype])


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
    `working_bytes` is the transient extra while one layer is recomputed for its backward: the
    most, over the recomputed region's ops taken backward, of what the ops up to that one
    re-saved plus that op's output and input gradients;
    `loss_grad_bytes` what a loss's backward holds as the backward starts: its output's and its
    input's gradients, fp32 and the size of its input (the logits of a language model), live
    before any recomputation (the unreduced loss a CPU loss's 0-dim output keeps as its
    storage, `LOSSES_KEEP_UNREDUCED`, is counted in `saved_bytes`);
    `backward_bytes` what one op's backward holds at once: the gradient of its output and the
    one it makes for its input, `BACKWARD_LIVE` times the largest tensor the ops make;
    `backward_over_bytes` the most the backward holds above `saved_bytes` at any moment, taken op
    by op in reverse: the tensors still saved (autograd frees what an op saved once its backward
    ran) plus the gradients alive while that op's backward runs (`_gradient_moments`: its
    output's, those it makes, and every other not yet consumed; a loss: its fp32 gradients), or, where a
    recomputed region starts its backward, the region's re-made tensors and gradients
    (`backward_over_recompute`: the worst moment is one of those; `backward_over_grads`: of
    that moment, the gradients, the rest being re-made activations), and the loss op's moment
    apart (`backward_over_loss`, the first of the backward) from the others'
    (`backward_over_body`); `forward_over_bytes` the most the forward holds above
    `saved_bytes`: what the ops so far saved, the tensors made and still to be read, an op's
    redistributed inputs and gather buffers (0 when restricted to `layers`); `saved` what is saved by
    tensor (named by the tensor owning the storage, `bases`; `saved_of` reads it by any name)."""

    saved_bytes: float = 0.0
    per_layer: dict[Optional[str], float] = field(default_factory=dict)
    working_bytes: float = 0.0
    loss_grad_bytes: float = 0.0
    backward_bytes: float = 0.0
    backward_over_bytes: float = 0.0
    backward_over_recompute: bool = False
    # of backward_over_bytes, the op's gradients (a recomputation's moment: the rest are re-made
    # activations; a plain op's: the rest, at most 0, the activations its ops freed so far)
    backward_over_grads: float = 0.0
    backward_over_loss: Optional[float] = None   # the loss op's moment (None: no loss)
    backward_over_body: float = 0.0              # the worst of the other moments
    forward_over_bytes: float = 0.0              # the forward's worst moment above saved_bytes
    # the same without the output the layer hands on (`given_grad`'s tensor, where no op of the
    # layer saves or reads it): where the layer ends a pipeline chunk, the stage counts that
    # output once per micro-batch in flight, the one running included (its forward cache,
    # `boundary_acts`), so its forward moments must not count it again
    forward_over_given: float = 0.0
    # the position among the layer's modules (`unit_position`) of the op `forward_over_bytes`
    # falls at (None: nothing above the saved tensors)
    forward_over_at: Optional[float] = None
    # `backward_over_bytes` where `given_grad`'s gradient is no tensor of the backward's own (a
    # receive buffer, counted elsewhere): not made by the op producing it, nor passed on as a
    # new one by a sum
    backward_over_given: float = 0.0
    # whether that moment of `backward_over_given` is a recomputation's (as `backward_over_recompute`)
    # and then its gradients (as `backward_over_grads`), the given one's left out
    backward_over_given_recompute: bool = False
    backward_over_given_grads: float = 0.0
    # of saved_bytes, what no op's backward frees: alive to the step's end (a CPU mse_loss's
    # unreduced storage, which its 0-dim output keeps, `LOSSES_KEEP_UNREDUCED`)
    kept_bytes: float = 0.0
    saved: dict[str, float] = field(default_factory=dict)   # tensor (its storage's owner) -> bytes saved
    bases: dict[str, str] = field(default_factory=dict)     # tensor -> the tensor owning its storage
    # the first backward of a step (no parameter gradient exists before it): its worst moment
    # above `saved_bytes` with the parameter gradients its ops made so far alive (each op's
    # becomes `.grad`), by parts: (saved activations above or below `saved_bytes`: recomputed
    # ones, or freed ones as a negative, activation gradients, parameter gradients); one per
    # position of the op among the layer's modules (`unit_position`), since under ZeRO-3 each
    # module is a unit of its own and a moment holds its op's unit and the one prefetched
    first_moments: dict[float, tuple[float, float, float]] = field(default_factory=dict)
    # of each such moment's parameter gradients, those the ops of the layer's other modules made,
    # by their position (under ZeRO-3 a unit's are reduce-scattered as its backward ends)
    first_born: dict[float, dict[float, float]] = field(default_factory=dict)
    # the same moments of a later micro-batch's backward, gradients accumulating (every
    # parameter gradient alive already, `.grad` of the earlier micro-batches): per position the
    # worst by activations and activation gradients alone (the parameter gradients the ops made
    # so far are added into `.grad`, no new bytes), which need not be the first backward's (a
    # recomputed MLP's weight-gradient matmul, every re-made tensor alive, against a later
    # op's moment with more parameter gradients made: gpt-tiny dp2 x tp2 ZeRO-3 with full
    # recomputation and 2 micro-batches, 8 KiB of a block's re-made activations left out);
    # the same parts and `acc_born` as `first_moments` and `first_born`
    acc_moments: dict[float, tuple[float, float, float]] = field(default_factory=dict)
    acc_born: dict[float, dict[float, float]] = field(default_factory=dict)
    # of each such moment's parameter gradients (`first_moments`, `acc_moments`), the routed
    # experts' weights' (`activation_memory`'s `expert_params`): expert parallelism holds 1/ep
    # of them, and ZeRO-3 reduce-scatters them as the experts' own unit ends
    first_egrads: dict[float, float] = field(default_factory=dict)
    acc_egrads: dict[float, float] = field(default_factory=dict)
    # each recomputed region holding a fused attention op: its worst moments (above
    # `saved_bytes`, as `backward_over_bytes`) by where they fall against the attention's
    # backward, "post" (before it: the attention's re-saved tensors alive, the region's later
    # ops' backward and the attention's own forward), "at" (its backward) and "pre" (after it:
    # they are freed), each [moment, its gradients, of those the given one], with the region's
    # moment's `position` (`unit_position`) and the parameter gradients made before it
    # (`param_grads`): context parallelism adds the gathered keys and values to the first two
    # kinds alone (`inter_op.context_parallel.layer_cost`)
    attention_regions: list[dict] = field(default_factory=list)
    # the backward's moments outside recomputed regions, in a layer with a fused attention op,
    # by where they fall against it: "post" (the ops after it in the forward, whose backward
    # runs before its), "at" (its backward), "pre" (after its backward: what it saved freed),
    # "loss" (a loss op's); each [worst moment, its gradients, worst moment without the given
    # gradient (as `backward_over_given`), its gradients]: context parallelism adds the full-
    # length K and V gradients at "at" and takes the gathered K and V off "pre"
    attention_moments: dict[str, list[float]] = field(default_factory=dict)
    # the forward's worst moments by where they fall against that attention op ("pre", "at",
    # "post"), each [above `saved_bytes`, the same without the given output
    # (`forward_over_given`)]: under context parallelism its saves above its share are not yet
    # made before it, its gathered K or V is copied into sequence order at it
    forward_attention: dict[str, list[float]] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> float:
        return self.saved_bytes + self.working_bytes

    def saved_of(self, name: Optional[str]) -> float:
        """Bytes saved of tensor `name` (through its storage's owner; 0 for None or unsaved)."""
        return self.saved.get(self.bases.get(name, name), 0.0) if name else 0.0


Shard = Union[float, Callable[..., float]]


def _tensor_inputs(node, by_name: dict) -> list[str]:
    """Names of the activation (non-parameter, non-buffer, non-constant) tensor inputs of `node`."""
    return [i for i in node.inputs if i in by_name and by_name[i].kind in ("call", "input")]


def attention_is_fused(node, device_type: Optional[str] = None, attention_kernel: AttentionKernel = "fused",
                       by_name: Optional[dict] = None) -> bool:
    """Whether an attention node runs a fused kernel (flash / memory-efficient): not when the
    software runs attention unfused (`attention_kernel`, `SoftwareSpec`), nor on torch's math
    path. CPU's flash kernel takes no dropout: `scaled_dot_product_attention` with
    dropout_p > 0 runs the math path there (measured: its grad_fn is the math path's
    `UnsafeViewBackward0`, its output in standard strides); CUDA's kernels take dropout.
    Nor where the key or value has fewer heads than the query without `enable_gqa` (`by_name`
    gives the shapes; Falcon's multi-query attention passes one K/V head to 4 query heads):
    the fused kernels take equal head counts or grouped query attention asked for
    (`check_batch_size_and_num_heads_dense` in aten/src/ATen/native/transformers/
    sdp_utils_cpp.h, shared by the CPU and CUDA backends); torch broadcasts the head on its
    math path (measured on CPU, torch 2.13: a [2, 4, 16, 8] query with a 1-head key and value,
    fp32 and bf16, has the math path's grad_fn; with enable_gqa=True the flash kernel's)."""
    if attention_kernel == "unfused":
        return False
    if attention_heads_broadcast(node, by_name):
        return False
    if device_type != "cpu" or node.op != "scaled_dot_product_attention":
        return True
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return not (isinstance(p, (int, float)) and p > 0)


def _math_attention_saves(node, by_name: dict, dtype: str) -> list[tuple[str, Optional[float]]]:
    """torch's math attention (`_scaled_dot_product_attention_math`, its ops seen through a
    dispatch mode): its batched matmuls save contiguous copies of the scaled query and key
    (new tensors) and of the value where it is a transposed view or has fewer heads than the
    query (else the value itself), the softmax its probabilities (which the second matmul
    saves too, the same storage), and with dropout CPU dropout's noise and the dropped
    probabilities the second matmul saves instead (each batch x heads x queries x keys). A key
    or value with fewer heads than the query is broadcast to the query's heads before its
    matmul flattens them: its copy has the query's batch and heads (measured on CPU, torch 2.13:
    a [2, 4, 16, 8] query with a [2, 1, 16, 8] key and value saves [8, 8, 16] and [8, 16, 8]
    copies). With 2-byte inputs all of these are fp32, the value a copy too: the math path
    upcasts them (torch's default, `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp`
    off; measured on CPU, torch 2.13: every saved tensor of a bf16 call is float32)."""
    ins = _tensor_inputs(node, by_name)
    if len(ins) < 3 or not node.outputs:
        return [(i, None) for i in ins]
    q, k, v = (by_name[i].outputs[0] for i in ins[:3])
    out = node.outputs[0]
    upcast = dtype != "fp32"
    item = out.nbytes / max(out.numel, 1) * bytes_scale(out.dtype, "fp32" if upcast else dtype)
    heads = math.prod(int(d) for d in out.shape[:-2])    # the query's batch x heads
    probs = heads * int(out.shape[-2]) * int(k.shape[-2])
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    dropout = isinstance(p, (int, float)) and p > 0
    broadcast = attention_heads_broadcast(node, by_name)

    def copied(t) -> float:
        return (heads * int(t.shape[-2]) * int(t.shape[-1]) if broadcast else t.numel) * item

    copy_v = upcast or broadcast or _swaps_1_2(by_name[ins[2]])
    value = [(node.name + ":v", copied(v))] if copy_v else [(ins[2], None)]
    return [(node.name + ":q", q.numel * item), (node.name + ":k", copied(k)),
            (node.name + ":probs", (3 if dropout else 1) * probs * item)] + value


def _unfused_attention_saves(node, by_name: dict, dtype: str) -> list[tuple[str, Optional[float]]]:
    """Attention as unfused software runs it (Megatron-LM 2021: QK^T and PV batched GEMMs around
    a fused scale-mask-softmax, dropout on the probabilities), what Korthikanti et al. 2022 count
    (arXiv 2205.05198, Eq. 1): Q and K (the first GEMM's inputs), the softmax output (2 bytes per
    score at 16-bit), with dropout its mask (1 byte per score) and its output (2 bytes per
    score), and V; b x heads x queries x keys scores, in the training dtype."""
    ins = _tensor_inputs(node, by_name)
    if len(ins) < 3 or not node.outputs:
        return [(i, None) for i in ins]
    k = by_name[ins[1]].outputs[0]
    out = node.outputs[0]
    item = out.nbytes / max(out.numel, 1) * bytes_scale(out.dtype, dtype)
    scores = math.prod(int(d) for d in out.shape[:-1]) * int(k.shape[-2])
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    saves: list[tuple[str, Optional[float]]] = [(i, None) for i in ins[:3]]
    saves.append((node.name + ":probs", scores * item))
    if isinstance(p, (int, float)) and p > 0:
        saves += [(node.name + ":mask", 1.0 * scores), (node.name + ":dropped", scores * item)]
    return saves


def requires_grad(nodes: Iterable) -> dict[str, bool]:
    """Which tensors autograd tracks: parameters, floating outputs of ops reading one or such a
    tensor, and floating inputs other than the model's own (a layer subgraph's inputs made by
    other layers' ops; `stage_cost._subgraph` makes those that need no gradient constants)."""
    rg: dict[str, bool] = {}
    for n in nodes:
        if n.kind == "param":
            rg[n.name] = True
        elif n.kind == "input":
            rg[n.name] = _floating(n) and n.target != "placeholder"
        elif n.kind == "call":
            rg[n.name] = _floating(n) and any(rg.get(i, False) for i in n.inputs)
        else:
            rg[n.name] = False
    return rg


def saved_tensors(node, by_name: dict, dtype: str = "bf16", device_type: Optional[str] = None,
                  rg: Optional[dict[str, bool]] = None,
                  attention_kernel: AttentionKernel = "fused") -> list[tuple[str, Optional[float]]]:
    """What `node` saves for its backward: (tensor name, None) for a graph tensor (sized by the
    caller from its base), or (private key, bytes) for a tensor the op makes on the side (a dropout
    mask, norm statistics, attention log-sum-exp). See the module docstring for the rules;
    `attention_kernel` (the software's, `SoftwareSpec`) and `device_type` pick the attention
    kernel (`attention_is_fused`; unfused software saves the scores), `rg` (`requires_grad`)
    which operands of a product need a gradient."""
    if getattr(node, "function", None) is not None:
        # an op of a custom autograd Function's forward: autograd saves nothing of its ops (the
        # forward runs without it); the Function saves what it asks (`ctx.save_for_backward`,
        # tensors kept on ctx), listed on the call's first op (`capture.functions`)
        return [(t, None) for t in getattr(node, "function_saves", ()) if t in by_name]
    op = node.op
    if is_view(node) or op in SAVE_NOTHING or op == "broadcast_tensors":
        # broadcast_tensors returns expanded views; its backward sums to the input shapes
        return []
    ins = _tensor_inputs(node, by_name)
    out = node.outputs[0] if node.outputs else None
    if op in MATRIX_OPS and op not in FUSED_ATTENTION:
        if op in ("addmm", "baddbmm"):
            ins = [i for i in ins if i != (node.inputs[0] if node.inputs else None)]
        return [(i, None) for i in ins]
    if op in FUSED_ATTENTION and attention_kernel == "unfused":
        return _unfused_attention_saves(node, by_name, dtype)
    if op in FUSED_ATTENTION and not attention_is_fused(node, device_type, by_name=by_name):
        return _math_attention_saves(node, by_name, dtype)
    if op in FUSED_ATTENTION:
        extra = []
        if out is not None:
            rows = math.prod(int(d) for d in out.shape[:-1])
            extra = [(node.name + ":lse", 4.0 * rows)]
        # an attention mask given as a tensor is saved too (CPU's flash kernel, measured: a
        # [2, 1, 16, 16] mask among its saved tensors; CUDA's memory-efficient kernel saves it
        # as its bias)
        mask = node.inputs[3:4] if len(node.inputs) > 3 and node.inputs[3] in ins else []
        return [(i, None) for i in ins[:3] + mask] + [(node.name, None)] + extra
    if op in SAVE_OUTPUT:
        return [(node.name, None)]
    if op in SAVE_INPUT:
        return [(i, None) for i in ins[:1]]
    if op in SAVE_INPUT_AND_OUTPUT:
        return [(i, None) for i in ins[:1]] + [(node.name, None)]
    if op == "rms_norm" and device_type == "cpu" and out is not None and out.shape:
        # CPU runs rms_norm as its composite (no fused kernel): the input upcast to fp32 (a copy
        # unless fp32, `CPU_FP32_INPUT`), the fp32 rstd per row and the fp32 normalised input the
        # weight's product reads, all saved (a bf16 [4, 16, 32] input, seen through saved-tensor
        # hooks: ToCopy, Rsqrt, Mul)
        rows = math.prod(int(d) for d in out.shape[:-1])
        return [(i, None) for i in ins[:1]] + [(node.name + ":stats", 4.0 * rows),
                                               (node.name + ":normed", 4.0 * out.numel)]
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
        # by a tensor (activation or parameter): each operand's gradient needs the other (a
        # quotient's divisor also its own); autograd saves only what a gradient it computes needs
        # (`rg`: which tensors require one; unknown: all); by a scalar: nothing
        if len(node.inputs) < 2:
            return []
        if rg is None:
            return [(i, None) for i in ins]
        a, b = node.inputs[0], node.inputs[1]
        need = {b} if rg.get(a, True) else set()
        if rg.get(b, True):
            need |= {a, b} if op in ("div", "true_divide", "div_") else {a}
        return [(i, None) for i in ins if i in need]
    if op in ("embedding", "index_select", "gather", "index") or op in INDEX_WRITES:
        return [(i, None) for i in ins if by_name[i].outputs and "int" in by_name[i].outputs[0].dtype]
    if op in INDEX_SOURCE_WRITES:
        return [(i, None) for i in ins if i != node.inputs[0]]
    if op in LOSSES:
        if is_fused_loss(node) and node.inputs and by_name[node.inputs[0]].outputs:
            # a fused kernel (`cost_models.fused_loss`): the logits as given and one fp32
            # log-sum-exp per row
            lg = by_name[node.inputs[0]].outputs[0]
            rows = lg.numel // max(int(lg.shape[-1]), 1) if lg.shape else 1
            return [(i, None) for i in ins] + [(node.name + ":lse", 4.0 * rows)]
        return [(i, None) for i in ins]
    if op in ("masked_fill", "where"):
        return [(i, None) for i in ins if by_name[i].outputs and by_name[i].outputs[0].dtype == "bool"]
    return [(i, None) for i in ins]


def _floating(node) -> bool:
    return bool(node.outputs) and node.outputs[0].dtype in ("float32", "float64", "float16", "bfloat16")


CASTS = frozenset({"to", "_to_copy", "type_as"})
# ops writing a source into a tensor at indices: their backward gathers the gradient at the
# indices for the source and passes it on for the tensor written into, so they save neither the
# tensor nor (scatter, scatter_add, index_put) the source: the index alone; index_add and
# index_copy keep the source too (torch 2.13, seen through saved-tensor hooks on CPU: a
# mixture-of-experts combine `out.index_add(0, token, y)` keeps the experts' outputs `y`, not `out`)
INDEX_WRITES = frozenset({"scatter", "scatter_", "scatter_add", "scatter_add_", "index_put", "index_put_"})
INDEX_SOURCE_WRITES = frozenset({"index_add", "index_add_", "index_copy", "index_copy_"})


def tensor_bases(nodes: list, by_name: dict, device_type: Optional[str] = None,
                 dtype: Optional[str] = None, attention_kernel: AttentionKernel = "fused",
                 copies: Optional[tuple[frozenset, frozenset]] = None) -> dict[str, str]:
    """Each tensor name -> the name of the tensor owning its storage (through views but the
    reshapes that copy, and a `.contiguous()` that copies nothing, as the kernels of
    `device_type` lay tensors out: `cost_models.layouts`; under fp32 training (`dtype`) a cast
    to the dtype the tensor has: `Tensor.to` returns the tensor itself, as RMSNorm's
    `x.to(torch.float32)` does on fp32 activations). `copies`: `layout_copies`' answer for these
    nodes where the caller has it."""
    copying, aliasing = copies if copies is not None else layout_copies(nodes, by_name, device_type, attention_kernel)
    base: dict[str, str] = {}
    for n in nodes:
        if n.kind == "call" and is_view(n) and n.inputs and n.name not in copying:
            src = n.inputs[0]
            prod = by_name.get(src)
            if n.target == "getitem" and prod is not None and prod.kind == "call" and prod.op == "broadcast_tensors":
                # output i of broadcast_tensors is an expand view of its input i
                idx = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else 0
                ins = prod.inputs
                b = ins[idx] if idx < len(ins) else src
                base[n.name] = base.get(b, b)
            elif n.target == "getitem" and prod is not None and prod.kind == "call" and prod.op not in VIEW_OPS:
                base[n.name] = n.name          # an output of a multi-output op, not a view
            else:
                base[n.name] = base.get(src, src)
        elif n.kind == "call" and n.name in aliasing:
            base[n.name] = base.get(n.inputs[0], n.inputs[0])
        elif (dtype == "fp32" and n.kind == "call" and n.op in CASTS and n.inputs and n.outputs
              and n.inputs[0] in by_name and by_name[n.inputs[0]].outputs
              and by_name[n.inputs[0]].outputs[0].dtype == n.outputs[0].dtype):
            base[n.name] = base.get(n.inputs[0], n.inputs[0])
        else:
            base[n.name] = n.name
    return base


def _swaps_1_2(node) -> bool:
    """A 4-D `transpose(1, 2)` (any spelling of the two dims)."""
    if node is None or node.kind != "call" or node.op != "transpose" or len(node.args) < 3:
        return False
    dims = node.args[1:3]
    return all(isinstance(d, int) for d in dims) and {d % 4 for d in dims} == {1, 2}


def _common_module(paths: Iterable[str]) -> str:
    """The innermost module holding every one of `paths` (module FQNs; "" the root)."""
    common: Optional[list[str]] = None
    for p in paths:
        parts = p.split(".") if p else []
        if common is None:
            common = parts
            continue
        k = 0
        while k < min(len(common), len(parts)) and common[k] == parts[k]:
            k += 1
        common = common[:k]
    return ".".join(common or [])


def checkpointed_module(block: list, rec: str) -> Optional[str]:
    """The module a repeated block's recomputation runs in, found from the block's ops (`block`,
    each with its `module_path`), not from names: "full" the module holding all of them (the
    block's own, which the runtime checkpoints whole), "selective" the one holding its attention
    core's ops (`attention_core`: `blocks.3.attn`, `model.layers.3.self_attn`; the block's when
    the core runs in the block's own forward or it has none), where a stage run module by module
    recomputes the core (`runtime.selective`); "attention" that same module, checkpointed whole,
    None when the block has no core. None: nothing to recompute. The planner writes it into the
    plan (`StagePlan.recompute_modules`)."""
    if rec not in ("full", "selective", "attention") or not block:
        return None
    whole = _common_module(n.module_path or "" for n in block)
    if rec == "full":
        return whole or None
    core = attention_core(block)
    if rec == "attention" and not core:
        return None
    inner = _common_module(n.module_path or "" for n in block if n.name in core) if core else whole
    if whole and inner != whole and not inner.startswith(whole + "."):
        inner = whole
    return inner or None


def selective_ops(block: list) -> list[str]:
    """The ops selective recomputation re-runs in one layer (`block`: its ops in program order):
    its attention core (`attention_core`: the score matmul, scale and mask, softmax, dropout on
    the probabilities and the matmul with V, or one fused attention op) and the ops the program
    runs between the core's first op and its last (views, the mask's slicing), one contiguous
    run that the runtime checkpoints as one region. Empty when the layer has no core."""
    core = attention_core(block)
    idx = [i for i, n in enumerate(block) if n.name in core]
    if not idx:
        return []
    return [n.name for n in block[idx[0]:idx[-1] + 1]]


# what marks a module as a normalization for "norm_act" (`norm_act_regions`): a fused norm op,
# or the reciprocal square root of an RMSNorm spelled out (Hugging Face's)
NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "group_norm", "rsqrt"})
# an activation a routed expert's output-discarding recomputation starts at, and the
# element-wise ops it runs on through (a gated unit's product, a cast) until an op of another
# kind reads what it made (the output projection's grouped GEMM); the runtime's rule alike
# (`runtime.discard`)
ACTIVATION_OPS = frozenset({"silu", "gelu", "relu", "sigmoid", "tanh", "mish", "elu", "leaky_relu", "hardswish"})
ACT_CONTINUE_OPS = frozenset({"mul", "to", "_to_copy", "add", "type_as"})


def norm_kernel_modules(calls: list, by_name: dict) -> dict[str, list[tuple[str, Optional[float]]]]:
    """What each op of a norm module written as several ops saves when the module runs as one
    norm kernel (`SoftwareSpec.norm_saves` "input"): op -> (tensor, side bytes) items as
    `saved_tensors` gives them. A norm module: a module instance whose class names an RMSNorm or
    LayerNorm (`cost_models.fusion.NORM_MODULE_NAMES`) holding a `NORM_OPS` op, no matrix op and
    more than one op (a single `layer_norm` / `rms_norm` op saves as such a kernel already). Its
    first op saves the module's input (its first tensor input) and one fp32 statistic per row
    (the inverse RMS, or for a LayerNorm the mean and inverse deviation: two), the others
    nothing: Transformer Engine's RMSNorm (transformer_engine/pytorch/ops/basic/rmsnorm.py at
    c6a9e26, `op_forward`: `ctx.save_for_backward(x, rstdevs)`; its LayerNorm saves x, means and
    rstdevs), what Megatron-Core's TE layer spec runs for every norm module (TENorm; the input
    norm inside TELayerNormColumnParallelLinear, layernorm_linear.py: inputmat, ln_out, mu,
    rsigma, the normalised output being the projections' input, saved by them here too)."""
    from cost_models.compute import MATRIX_OPS
    from cost_models.fusion import NORM_MODULE_NAMES

    mods: dict[str, list] = {}
    for n in calls:
        path = n.module_path or ""
        if path and any(k in (n.module_type or "").lower() for k in NORM_MODULE_NAMES):
            mods.setdefault(path, []).append(n)
    out: dict[str, list[tuple[str, Optional[float]]]] = {}
    for ns in mods.values():
        if len(ns) < 2 or not any(n.op in NORM_OPS for n in ns) or any(n.op in MATRIX_OPS for n in ns):
            continue
        first = ns[0]
        src = next((i for i in first.inputs if i in by_name and by_name[i].outputs and _floating(by_name[i])), None)
        if src is None:
            continue
        o = by_name[src].outputs[0]
        rows = o.numel // max(int(o.shape[-1]), 1) if o.shape else 1
        stats = 2 if "layernorm" in (first.module_type or "").lower() else 1
        out[first.name] = [(src, None), (f"{first.name}:norm_stats", float(rows * 4 * stats))]
        for n in ns[1:]:
            out[n.name] = []
    return out


@dataclass(frozen=True)
class DiscardRegion:
    """One region "norm_act" recomputes (`norm_act_regions`): a norm module's ops ("norm", its
    `module`) or an expert activation's ("act", `module` the experts module holding it)."""

    kind: Literal["norm", "act"]
    module: str
    ops: tuple[str, ...]


def norm_act_regions(block: list) -> list[DiscardRegion]:
    """The runs of ops "norm_act" recomputes in one repeated block (`block`: its ops in program
    order, each with its `module_path`), as Megatron-Core's `--recompute-granularity selective
    --recompute-modules layernorm moe_act` does (megatron/core/transformer/transformer_layer.py,
    `TransformerLayer._forward_attention` / `_forward_pre_mlp_layernorm`: the input and pre-MLP
    layer norms under `tensor_parallel.CheckpointWithoutOutput`; moe/experts.py,
    `TEGroupedMLP.forward`: the activation of the grouped experts; random.py,
    `CheckpointWithoutOutput`: the function runs without saving, keeps its inputs, and its
    output is freed once the next module's forward saved it, `discard_output_and_register_
    recompute`, re-made by a hook on that module's output gradient): each norm module of the
    block (a direct child holding a `NORM_OPS` op and no matrix op; a norm inside attention,
    Qwen3's q/k norms, is not one: Megatron's "layernorm" is those two), all its ops; and in a
    module holding grouped GEMMs (the routed experts), each activation (`ACTIVATION_OPS`) of a
    GEMM's output (through views) with the element-wise ops after it (`ACT_CONTINUE_OPS`)
    that read what it made, up to the op of another kind reading it (the output projection).
    The regions in program order, each's ops in program order."""
    whole = _common_module(n.module_path or "" for n in block)
    by_name = {n.name: n for n in block}
    children: dict[str, list] = {}
    for n in block:
        p = n.module_path or ""
        if whole and p.startswith(whole + "."):
            children.setdefault(whole + "." + p[len(whole) + 1:].split(".")[0], []).append(n)
    starts: dict[int, DiscardRegion] = {}
    for mod, ns in children.items():
        if any(n.op in NORM_OPS for n in ns) and not any(n.op in MATRIX_OPS for n in ns):
            starts[block.index(ns[0])] = DiscardRegion("norm", mod, tuple(n.name for n in ns))
    gemm_mods = {n.module_path or "" for n in block if n.op == "grouped_mm"} - {""}

    def from_gemm(name: str) -> bool:
        x = by_name.get(name)
        while x is not None and is_view(x) and x.inputs:
            x = by_name.get(x.inputs[0])
        return x is not None and x.op == "grouped_mm"

    def scope(n: Any) -> Optional[str]:
        p = n.module_path or ""
        return next((m for m in gemm_mods if p == m or p.startswith(m + ".")), None)

    for i, n in enumerate(block):
        mod = scope(n) if n.op in ACTIVATION_OPS and n.inputs and from_gemm(n.inputs[0]) else None
        if mod is None or any(n.name in r.ops for r in starts.values()):
            continue
        run, made = [n.name], {n.name}
        for x in block[i + 1:]:
            if scope(x) != mod or not any(a in made for a in x.inputs):
                continue
            if x.op not in ACT_CONTINUE_OPS:
                break
            run.append(x.name)
            made.add(x.name)
        starts[i] = DiscardRegion("act", mod, tuple(run))
    return [starts[k] for k in sorted(starts)]


def norm_act_region_of(calls: list) -> dict[str, Optional[str]]:
    """Each op -> the "norm_act" region it runs in (`norm_act_regions` of its layer's ops; the
    region named "<layer>#<index>"), None outside every one."""
    by_layer: dict[str, list] = {}
    for n in calls:
        if n.layer is not None:
            by_layer.setdefault(n.layer, []).append(n)
    out: dict[str, Optional[str]] = {n.name: None for n in calls}
    for layer, ns in by_layer.items():
        for k, reg in enumerate(norm_act_regions(ns)):
            for x in reg.ops:
                out[x] = f"{layer}#{k}"
    return out


def checkpoint_region_of(calls: list, rec: str, selective_region: str) -> dict[str, Optional[str]]:
    """Each op -> the checkpointed region it runs in (None: not recomputed): the layer ("full"),
    under `selective_region="ops"` each layer's `selective_ops` (what the runtime runs under
    torch's selective checkpoint), under "module" the ops inside the layer's
    `checkpointed_module` (a stage run module by module whose attention core spans several
    calls checkpoints that module whole), as "attention" does on every stage. Ops whose `layer`
    is None are outside every repeated block."""
    if rec == "full":
        return {n.name: n.layer for n in calls}
    if rec == "attention":
        selective_region = "module"
    elif rec != "selective" or selective_region not in ("ops", "module"):
        return {n.name: None for n in calls}
    by_layer: dict[str, list] = {}
    for n in calls:
        if n.layer is not None:
            by_layer.setdefault(n.layer, []).append(n)
    if selective_region == "ops":
        redo = {x: layer for layer, ns in by_layer.items() for x in selective_ops(ns)}
        return {n.name: redo.get(n.name) for n in calls}
    module = {layer: checkpointed_module(ns, rec) for layer, ns in by_layer.items()}
    out: dict[str, Optional[str]] = {}
    for n in calls:
        m = module.get(n.layer) if n.layer is not None else None
        p = n.module_path or ""
        out[n.name] = n.layer if m is not None and (p == m or p.startswith(m + ".")) else None
    return out


class _PolicyFree:
    """`activation_memory`'s parts that do not depend on the recomputation policy (the gradients'
    moments; the forward's per-op moments without recomputation): inside `one_graph_policies`,
    kept for the last graph asked with the same shard, read_shard and parameter objects (held
    here, so the identities cannot be reused) and settings; outside it, made anew every call.
    None until made."""

    last: Optional["_PolicyFree"] = None
    active = 0

    def __init__(self, objs: tuple, settings: tuple) -> None:
        self.objs, self.settings = objs, settings
        self.moments: Optional[dict] = None
        self.fwd_at: Optional[dict] = None

    @classmethod
    def of(cls, graph, shard, read_shard, param_elems, settings: tuple) -> "_PolicyFree":
        objs = (graph, shard, read_shard, param_elems)
        if not cls.active:
            return cls(objs, settings)
        last = cls.last
        if last is None or last.settings != settings or any(a is not b for a, b in zip(last.objs, objs)):
            last = cls.last = cls(objs, settings)
        return last


@contextmanager
def one_graph_policies() -> Iterator[None]:
    """Within it, `activation_memory` calls on one graph object (the same shard, read_shard and
    param_elems objects, neither changed in between) share what does not depend on the
    recomputation policy: for a caller asking every policy of one layer in turn
    (`inter_op.stage_cost.fill_activations`)."""
    _PolicyFree.active += 1
    try:
        yield
    finally:
        _PolicyFree.active -= 1
        if not _PolicyFree.active:
            _PolicyFree.last = None


def activation_memory(graph, dtype: str = "bf16", recompute: Recompute | bool = "none", *,
                      layers: Optional[Iterable[Optional[str]]] = None, shard: Shard = 1.0,
                      selective_region: Literal["core", "ops", "module"] = "core",
                      device_type: Optional[str] = None, count_inputs: bool = True,
                      dtensor: bool = False,
                      read_shard: Optional[Callable[[Any, str], Optional[tuple[float, str]]]] = None,
                      param_elems: Optional[dict[str, float]] = None,
                      given_grad: Optional[str] = None,
                      attention_kernel: AttentionKernel = "fused",
                      modules: Sequence[str] = (),
                      autocast: bool = True,
                      norm_saves: str = "eager",
                      expert_params: frozenset = frozenset(),
                      ) -> ActivationMemory:
    """Activation bytes of one micro-batch of `graph` (at a concrete batch, `graph.at_batch(b)`),
    optionally restricted to `layers` (FQNs; None names the ops outside every layer), with
    floating-point tensors at `dtype` and each tensor's bytes divided by `shard` (a number, or a
    function of the node producing it, e.g. tensor parallelism for the tensors it splits).
    `selective_region`, `device_type` and `count_inputs`: see the module docstring; `dtensor`:
    the ops run on DTensors (a tensor-parallel stage), which give a loss on a split input a
    fresh 0-dim output (`LOSSES_KEEP_UNREDUCED` applies where it reads its input whole).
    `read_shard(op, input)`: where an op reads an input redistributed to another layout than
    its producer gives (an executed per-op solution), that copy's divisor and a name for its
    layout; the copy, not the producer's tensor, is what the op saves (the gathered logits of
    a loss read whole, say); an optional third item, the
    divisor of what a gather along a dim other than the first holds beside the copy while it
    concatenates (its buffer and its copy of the shard; None: nothing); an optional fourth,
    whether the copy is held until the last reader of the input (a junction: one
    redistribution its readers share); an optional fifth, whether the redistribution runs
    inside the op's dispatch, below autograd (DTensor propagation: `dispatch_read`): the op
    then saves the input as it arrived, not the copy, and holds the copy (and the gather's
    buffer) only while its forward runs, and again while its backward runs (it redistributes
    the saved input anew: `_gradient_moments`' `regather`); an optional sixth, the divisor of
    what the gradient's way back into the producer's layout holds beside the gathered result
    (the executor's redistribution, an autograd node of its own, `execute._Reshard`: its
    backward runs after the op's, with what the op saved freed, and a gather along a dim other
    than the first copies the shard's gradient and gathers it into a buffer; None: nothing).
    None: the producer's tensor.
    `param_elems`: elements per device of the parameters (by node name): an op's backward
    makes their gradients beside
    its input's (a new tensor in every micro-batch: AccumulateGrad adds it in after the first,
    or it becomes `.grad`); `given_grad`: a
    tensor whose gradient comes from outside (a pipeline chunk's output: the receive buffer),
    for `backward_over_given`. `attention_kernel`: the software's (`SoftwareSpec`); "unfused"
    saves the attention scores (`saved_tensors`). `modules`: the layer's modules in order, by
    which the first backward's moments are told apart (`first_moments`, `unit_position`).
    `autocast`: a mixed-precision run under torch.autocast (`SoftwareSpec.mixed_precision`
    "autocast", `device_type`'s fp32 list applies); False: the model cast to `dtype` ("half":
    only its own upcasts and the loss fp32). `norm_saves` (`SoftwareSpec.norm_saves`): "eager",
    each op of a norm module saves what eager autograd saves; "input", a norm module written as
    several ops (`norm_kernel_modules`) saves what one norm kernel does, its input and an fp32
    statistic a row (none under "norm_act", which runs the norm without saving)."""
    rec = "full" if recompute is True else ("none" if recompute is False else recompute)
    if rec not in RECOMPUTES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTES)}, got {recompute!r}")
    if selective_region not in ("core", "ops", "module"):
        raise ValueError(f"selective_region must be core, ops or module, got {selective_region!r}")
    if device_type not in (None, "cuda", "cpu"):
        raise ValueError(f"device_type must be cuda, cpu or None, got {device_type!r}")
    if graph.batch_size is None and any(o.is_batched for n in graph.nodes for o in n.outputs):
        raise ValueError("the graph has symbolic batch dimensions; call graph.at_batch(b) first")
    nodes = list(graph.nodes)
    by_name = {n.name: n for n in nodes}
    # the layouts depend on the graph, device and kernel alone: once per graph, not per policy
    # (`fill_activations` asks for every recomputation policy of one layer's graph); and on the
    # attentions reading their query as the executor's copy (`read_shard`), in standard strides
    # whatever the graph's: on CPU their output follows (`layouts.executor_layout_copies`),
    # CUDA's kernels write theirs alike whatever the query's
    queries = frozenset(
        n.name for n in nodes if read_shard is not None and device_type == "cpu" and n.kind == "call"
        and n.op in FUSED_ATTENTION
        and n.inputs and n.inputs[0] in by_name and by_name[n.inputs[0]].outputs
        and (r := read_shard(n, n.inputs[0])) is not None and not (len(r) > 4 and r[4]))
    base = tensor_bases(nodes, by_name, device_type, dtype, attention_kernel,
                        copies=executor_layout_copies(graph, device_type, attention_kernel, queries))
    rg = requires_grad(nodes)
    calls = [n for n in nodes if n.kind == "call"]
    core = attention_core(calls) if rec == "selective" and selective_region == "core" else set()
    region = checkpoint_region_of(calls, rec, selective_region)
    # "norm_act": the regions whose outputs are discarded and re-made (`norm_act_regions`)
    discard = norm_act_region_of(calls) if rec == "norm_act" else {}
    keep = None if layers is None else set(layers)
    mixed = dtype != "fp32"
    cuda_fp32 = CUDA_FP32_OUTPUT_OPS if device_type == "cuda" and mixed and autocast else frozenset()
    # of those, the ops autocast casts the inputs of (a copy, saved where the op saves its input)
    cuda_fp32_in = CUDA_FP32_OPS if device_type == "cuda" and mixed and autocast else frozenset()

    upcasts = mixed_fp32(calls, by_name, base, device_type, dtype, autocast)

    def runs_fp32(key: str) -> bool:
        # a tensor the mixed-precision run holds in fp32: made by an op autocast runs in fp32 (not
        # a loss: its scalar) or an upcast that stays fp32; also where a layer reads it from the
        # layer before (a post-norm block's input: its subgraph's input keeps the producing op)
        src = by_name.get(key)
        return (src is not None and src.kind in ("call", "input") and _floating(src)
                and ((src.op in cuda_fp32 and src.op not in LOSSES) or key in upcasts))

    # a view an op takes of an input redistributed views the copy (`read_shard`): its storage,
    # what anything saving the view keeps, is the copy, named "<input>@<layout>"
    copies: dict[str, tuple[float, str]] = {}      # copy -> (bytes at `dtype`, the view making it)

    def size(name: str, at: Optional[str] = None) -> float:
        if base[name] in copies:
            nb = copies[base[name]][0]
            return nb * bytes_scale("float32", at) / bytes_scale("float32", dtype) if at else nb
        b = by_name[base[name]]
        if not b.outputs:
            return 0.0
        o = b.outputs[0]
        f = shard(b) if callable(shard) else shard
        if at is None and b.name in upcasts:
            at = "fp32"
        return o.nbytes * bytes_scale(o.dtype, at or dtype) / max(float(f), 1.0)

    def read(n, name: str, at: Optional[str] = None) -> Optional[tuple[float, str, float, bool]]:
        # (bytes, layout tag, gather buffer bytes, held until the last reader of `name`) of the
        # copy op n reads `name` as, when it is redistributed
        rs = read_shard(n, name) if read_shard is not None and name != n.name else None
        if rs is None or not by_name[name].outputs:
            return None
        o = by_name[name].outputs[0]
        item = o.nbytes * bytes_scale(o.dtype, at or dtype)
        buf = item / max(float(rs[2]), 1.0) if len(rs) > 2 and rs[2] else 0.0
        return item / max(float(rs[0]), 1.0), rs[1], buf, bool(len(rs) > 3 and rs[3]), bool(len(rs) > 4 and rs[4])

    if read_shard is not None:
        was = dict(base)
        for n in calls:
            src = n.inputs[0] if n.inputs else None
            if src is None or src not in by_name:
                continue
            viewed, maker, prod = src, n, by_name[src]
            if n.target == "getitem" and prod.kind == "call" and prod.op == "broadcast_tensors":
                # output i of broadcast_tensors is an expand view of its input i (`tensor_bases`),
                # which the op reads, and so views, as the executor redistributed it (mlp-tiny
                # tp2's column-parallel last linear: its Shard(1) output gathered for the loss)
                idx = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else 0
                viewed = prod.inputs[idx] if idx < len(prod.inputs) else src
                maker = prod
                r = read(prod, viewed) if viewed in by_name else None
            else:
                r = read(n, src) if is_view(n) else None
            if r is not None and not r[4]:
                key = f"{viewed}@{r[1]}"
                if key not in copies:
                    copies[key] = (r[0], maker.name)
                    base[key], by_name[key], region[key] = key, by_name[viewed], region.get(maker.name)
                base[n.name] = key
            elif base[n.name] != n.name and base[n.name] == was.get(viewed, viewed):
                base[n.name] = base[viewed]            # a view of a view of the copy

    def side(nbytes: float, owner) -> float:
        # masks are 1 byte/element; norm statistics and log-sum-exp fp32 (CPU's layer norm under
        # mixed precision: the input's dtype)
        if device_type == "cpu" and owner.op in DROPOUTS:
            # CPU's dropout keeps its scaled noise, a tensor like its input (`empty_like(x)
            # .bernoulli_(1 - p).div_(1 - p)`, seen through a dispatch mode), not a bool mask
            return size(owner.name)
        f = shard(owner) if callable(shard) else shard
        if device_type == "cpu" and mixed and owner.op in NORMS and owner.op not in CPU_FP32_INPUT:
            nbytes = nbytes * bytes_scale("float32", dtype)
        return nbytes / max(float(f), 1.0)

    def batch(key: str) -> bool:
        # the model's own inputs: the step's batch, held whole whatever is saved
        n = by_name[key]
        return not count_inputs and n.kind == "input" and n.target == "placeholder"

    # what every op saves: key -> (bytes, layer of its first saver, saver's region)
    saves: list[tuple[str, float, Any]] = []     # (key, bytes, saver node)
    kernel_norms = norm_kernel_modules(calls, by_name) if norm_saves == "input" else {}
    for n in calls:
        items = saved_tensors(n, by_name, dtype, device_type, rg, attention_kernel)
        if n.name in kernel_norms:
            items = kernel_norms[n.name]
            if items and discard.get(n.name) is not None:
                items = items[:1]           # "norm_act" runs the norm without saving: its input kept
        for name, extra in items:
            if extra is None:
                key = base.get(name, name)
                if key not in by_name or by_name[key].kind not in ("call", "input"):
                    continue
                if batch(key) and not (mixed and n.op in MATRIX_OPS and _floating(by_name[key])):
                    # a float input a matmul reads under autocast is saved as its 2-byte copy
                    continue
                if rec == "selective" and n.name in core and key in core:
                    continue
                at = None
                if n.op in LOSSES and mixed and _floating(by_name[key]) and not is_fused_loss(n) \
                        and not is_half_loss(n):
                    at = "fp32"
                elif device_type == "cpu" and mixed and n.op in CPU_FP32_INPUT and _floating(by_name[key]):
                    at, key = "fp32", key + ":fp32"     # the op's own fp32 copy of its input
                elif n.op in cuda_fp32 and _floating(by_name[key]) and (key == n.name or n.op in cuda_fp32_in):
                    # autocast's fp32 copy of the input (or the op's own fp32 output; an input
                    # already fp32 by type promotion is not copied; an op given an fp32 dtype
                    # saves its input as it is)
                    at = "fp32"
                    if key != n.name and key not in upcasts:
                        key = key + ":fp32"
                elif mixed and n.op in MATRIX_OPS and runs_fp32(key):
                    # autocast casts an fp32 activation to the 2-byte dtype for each matmul that
                    # reads it (it caches casts of parameters only): q, k and v projections of a
                    # norm's fp32 output save three copies (BERT-large on an H100: 128 MiB a layer)
                    at = dtype
                    key = f"{key}:lowp@{n.name}"
                b = size(base.get(name, name), at)
                copy = read(n, name, at)
                if copy is not None and not copy[4]:
                    # the executor's copy; one made inside the op's dispatch (below autograd)
                    # leaves the op saving the input as it arrived
                    b, key = copy[0], _copy_key(name, copy, n.name)
            else:
                key = name
                if rec == "selective" and n.name in core:
                    continue
                b = side(extra, n)
            saves.append((key, b, n))
    nbytes_of: dict[str, float] = {}
    owner_layer: dict[str, Optional[str]] = {}
    owner_node: dict[str, str] = {}      # the first op saving it: autograd frees it after that op's backward
    region_peak: dict[Optional[str], float] = {}
    region_grads: dict[Optional[str], float] = {}   # of region_peak, the op's gradients
    # of a region holding a fused attention op, its worst moments before that op's backward
    # ("post": ops after it in the forward, and its own forward), at it ("at") and after it
    # ("pre"): (value as region_peak, its gradients, of those the given one)
    region_att: dict[Optional[str], dict[str, tuple[float, float, float]]] = {}
    region_given: dict[Optional[str], float] = {}   # of region_grads, the given one's (`given_share`)
    # each region's moments as (bytes as region_peak, their activation gradients, the forward
    # index after which the region's ops have made their parameter gradients by then): the
    # first backward's moment adds those (`first`)
    region_moments: dict[Optional[str], list[tuple[float, float, float]]] = {}

    def loss_read(n, i: str) -> tuple[int, float]:
        # (gradients live at once, fp32 bytes of the logits as the loss reads them): a loss on
        # class-sharded logits runs vocabulary-parallel (torch's loss_parallel); a fused kernel
        # writes the gradient into the logits' storage (`cost_models.fused_loss`): none beside
        if is_fused_loss(n):
            return 0, size(i)
        if is_half_loss(n):
            # the eager loss on the 2-byte logits (`cost_models.fused_loss`, HALF_OVERLOAD): its
            # gradients at the training dtype
            b = by_name[base.get(i, i)]
            split = callable(shard) and float(shard(b)) > 1 and base.get(i, i) not in copies
            return (VOCAB_PARALLEL_LOSS_LIVE if split else _loss_live(n)), size(i)
        copy = read(n, i, "fp32")
        if copy is not None:
            split = copy[0] < by_name[i].outputs[0].numel * 4      # the copy is a shard
            return (VOCAB_PARALLEL_LOSS_LIVE if split else _loss_live(n)), copy[0]
        b = by_name[base.get(i, i)]
        split = callable(shard) and float(shard(b)) > 1 and base.get(i, i) not in copies
        return (VOCAB_PARALLEL_LOSS_LIVE if split else _loss_live(n)), size(i, "fp32")

    def new_grads(n) -> float:
        # the gradients op n's backward makes for the parameters it reads (`param_elems`),
        # directly or through a view: the op reading the view makes the gradient, the view's
        # backward hands it on (a transpose's is a view of it), so a view makes none (the
        # experts' `w.transpose(1, 2)` before a grouped GEMM: once, not twice)
        if not param_elems or is_view(n):
            return 0.0
        ps = {base.get(i, i) for i in n.inputs} & param_elems.keys()
        return sum(param_elems[q] for q in ps) * 4.0 * bytes_scale("float32", dtype)

    def new_expert_grads(n) -> float:
        # of `new_grads(n)`, the routed experts' weights' (`expert_params`, node names)
        if not expert_params or not param_elems or is_view(n):
            return 0.0
        ps = {base.get(i, i) for i in n.inputs} & param_elems.keys() & expert_params
        return sum(param_elems[q] for q in ps) * 4.0 * bytes_scale("float32", dtype)

    def gathers_grad(n, i: str) -> Any:
        # whether op n reads input i redistributed into a split layout (`read_shard`'s divisor
        # above 1): the redistribution's backward gathers (or exchanges) the gradient into the
        # producer's layout, a new tensor; into a whole layout (a partial sum reduced, a
        # replicated tensor read) it hands the gradient on as it is. Inside the op's dispatch
        # (DTensor propagation) the op's own backward makes it: True. The executor's
        # redistribution is an autograd node of its own (`execute._Reshard`), whose backward
        # runs after the op's: (the copy's gradient, what the gather holds beside its result,
        # `read_shard`'s sixth item), each a fraction of the gradient in the producer's layout
        rs = read_shard(n, i) if read_shard is not None and i != n.name and i in by_name else None
        if rs is None or float(rs[0]) <= 1:
            return None
        if (len(rs) > 4 and rs[4]) or (len(rs) > 3 and rs[3]):
            return True      # below autograd, or a junction's value its readers share: as its readers'
        f = max(float(shard(by_name[base.get(i, i)]) if callable(shard) else shard), 1.0)
        return f / float(rs[0]), (f / float(rs[5]) if len(rs) > 5 and rs[5] else 0.0)

    def regather(n) -> float:
        # what op n's backward redistributes anew of the inputs its dispatch redistributed in
        # the forward (DTensor propagation, `read_shard`'s fifth item): the copy and the
        # gather's buffer, made before the gradients that read them
        tot = 0.0
        for i in dict.fromkeys(_tensor_inputs(n, by_name)):
            r = read(n, i)
            if r is not None and r[4]:
                tot += r[0] + r[2]
        return tot

    # what follows from the graph and its layouts alone, not the policy, is made once for the
    # policies `fill_activations` asks of one layer in turn (`_PolicyFree`)
    free = _PolicyFree.of(graph, shard, read_shard, param_elems, (dtype, device_type, attention_kernel, autocast,
                                                                  given_grad, count_inputs, dtensor, norm_saves))
    if free.moments is None:
        free.moments = _gradient_moments(calls, by_name, base, rg, copies, upcasts, shard, dtype, new_grads,
                                         loss_read, given_grad, gathers_grad,
                                         regather if read_shard is not None else None)
    moments = free.moments

    def grads(n) -> float:
        # the gradients alive while op n's backward runs (`_gradient_moments`)
        return moments.get(n.name, (0.0, 0.0, 0.0))[0]

    def after_grads(n) -> float:
        # those alive while the executor's redistributions of its inputs run their backward,
        # after op n's (0: none)
        m = moments.get(n.name)
        return m[3] if m is not None and len(m) > 3 else 0.0

    # "norm_act" (`runtime.discard`): a tensor a region made, saved by an op after it (or by a
    # later op of the region), is freed and re-made in the backward: not held, it comes back at
    # the backward of its last saver (the region re-run then) until its first saver's frees it;
    # an op saving its own output keeps it (saved before the runtime knows it), as an op's
    # copies made inside its call (":fp32", ":lowp@"); the region keeps its inputs from outside
    # (every tensor its ops read, for the re-run) until its first op's backward
    discarded: dict[str, tuple[float, str, str, Optional[str]]] = {}   # key -> (bytes, first saver, region, layer)
    remade_at: dict[str, float] = {}        # op -> bytes its backward re-makes first
    if discard:
        order = {n.name: i for i, n in enumerate(calls)}
        first_of: dict[str, Any] = {}
        for n in calls:
            if discard.get(n.name) is not None:
                first_of.setdefault(discard[n.name], n)
        by_saver: dict[str, list[tuple[str, float, Any]]] = {}
        for item in saves:
            by_saver.setdefault(item[2].name, []).append(item)
        with_inputs: list[tuple[str, float, Any]] = []
        for n in calls:
            r = discard.get(n.name)
            if r is not None and first_of[r] is n:
                for m in calls:
                    if discard.get(m.name) != r:
                        continue
                    for i in _tensor_inputs(m, by_name):
                        k = base.get(i, i)
                        if (k in by_name and by_name[k].kind in ("call", "input") and discard.get(k) != r
                                and _floating(by_name[k]) and not batch(k)):
                            with_inputs.append((k, size(i), n))
            with_inputs.extend(by_saver.get(n.name, ()))
        saves = with_inputs
        last_saver: dict[str, Any] = {}
        own = {key for key, _, n in saves if key == n.name}      # saved by the op making it: kept
        for key, b, n in saves:
            r = discard.get(key) if (":" not in key and "@" not in key and key not in own) else None
            if r is None:
                continue
            if key not in discarded:
                discarded[key] = (b, n.name, r, n.layer)
            if r not in last_saver or order[n.name] > order[last_saver[r].name]:
                last_saver[r] = n
        for r, n in last_saver.items():
            remade_at[n.name] = remade_at.get(n.name, 0.0) + sum(v[0] for v in discarded.values() if v[2] == r)
    if rec in ("none", "norm_act") or (rec == "selective" and selective_region == "core"):
        for key, b, n in saves:
            if key not in owner_layer and key not in discarded:
                owner_layer[key], nbytes_of[key], owner_node[key] = n.layer, b, n.name
        region_bytes: dict[Optional[str], float] = {}
    else:
        # a checkpointed region keeps its inputs; what its ops save is re-made in its backward
        region_bytes = {}
        seen_in: dict[Optional[str], set] = {}
        saved_by: dict[str, list[tuple[str, float]]] = {}
        for key, b, n in saves:
            saved_by.setdefault(n.name, []).append((key, b))
        # the region's forward re-run in its backward: what the ops up to n re-saved, what the
        # forward holds at n besides (tensors made and still to be read, redistributed copies:
        # as a forward without recomputation holds them) and the gradient that started the
        # backward of the region (alive before its last op's backward makes any)
        plain_owner: dict[str, str] = {}
        plain_bytes: dict[str, float] = {}
        for key, b, n in saves:
            if key not in plain_owner:
                plain_owner[key], plain_bytes[key] = n.name, b
        if free.fwd_at is None:
            # the same for every policy taking this branch (what the ops save depends on the
            # policy only for "selective" on the attention core, the branch above)
            _, free.fwd_at = _forward_over(calls, by_name, base, plain_owner, plain_bytes, size, read, batch, 0.0,
                                           mixed, cuda_fp32, {k: v[1] for k, v in copies.items()}, per_op=True)
        fwd_at = free.fwd_at
        entry: dict[Optional[str], float] = {}
        entry_given: dict[Optional[str], float] = {}
        # the re-run starts when the region's backward first unpacks a saved tensor (torch's
        # non-reentrant checkpoint): the backward of the region's last op that saves one. Ops
        # after it that save nothing (a residual add handing the stream on, the executor's
        # redistributions of its inputs, `execute._Reshard`) run their backward before, and
        # the gradients they make (a gather back into the producer's layout) are alive through
        # the re-run forward
        for n in reversed(calls):
            r = region[n.name]
            if r is not None and r not in entry and n.name in moments and saved_by.get(n.name):
                entry[r] = moments[n.name][2]
                entry_given[r] = min(moments[n.name][1], moments[n.name][2])
        for n in reversed(calls):
            r = region[n.name]
            if r is not None and r not in entry and n.name in moments:
                entry[r] = moments[n.name][2]
                entry_given[r] = min(moments[n.name][1], moments[n.name][2])
        # the region's moments by where they fall against its first fused attention op (forward
        # order), for context parallelism (`attention_regions`)
        att_at: dict[Optional[str], int] = {}
        for i, n in enumerate(calls):
            if region[n.name] is not None and n.op in FUSED_ATTENTION:
                att_at.setdefault(region[n.name], i)

        def bucket(r, i: int, val: float, g: float, given: float, fwd: bool = False) -> None:
            if r not in att_at:
                return
            k = "pre" if i < att_at[r] else ("at" if i == att_at[r] and not fwd else "post")
            old = region_att.setdefault(r, {}).get(k)
            if old is None or val > old[0]:
                region_att[r][k] = (val, g, given)

        for i, n in enumerate(calls):
            r = region[n.name]
            prior = region_bytes.get(r, 0.0)      # what the ops before n re-saved
            if r is not None:
                fwd = region_bytes.get(r, 0.0) + fwd_at.get(n.name, 0.0) + entry.get(r, 0.0)
                # the attention's own forward moment counts with the ops after it: its
                # gathered K and V are made (`bucket`'s fwd)
                bucket(r, i, fwd, entry.get(r, 0.0), entry_given.get(r, 0.0), fwd=True)
                region_moments.setdefault(r, []).append((fwd, entry.get(r, 0.0), math.inf))
                if fwd > region_peak.get(r, 0.0) or r not in region_peak:
                    region_peak[r], region_grads[r] = fwd, entry.get(r, 0.0)
                    region_given[r] = entry_given.get(r, 0.0)
            for key, b in saved_by.get(n.name, ()):
                if r is None:
                    if key not in owner_layer:
                        owner_layer[key], nbytes_of[key], owner_node[key] = n.layer, b, n.name
                    continue
                src = key.split(":")[0]
                inside = key.endswith(":fp32") or ":lowp@" in key or (src in by_name and by_name[src].kind == "call"
                                                   and region.get(src) == r)
                if (inside or src not in by_name) and key not in seen_in.setdefault(r, set()):
                    seen_in[r].add(key)
                    region_bytes[r] = region_bytes.get(r, 0.0) + b
            # the region's backward: op n's backward runs with what the ops up to n re-saved
            # still live (autograd frees a node's saved tensors after its backward) and its
            # output's and input's gradients beside them
            if r is not None:
                here = region_bytes.get(r, 0.0) + grads(n)
                bucket(r, i, here, grads(n), moments.get(n.name, (0.0, 0.0, 0.0))[1])
                # op n's own parameter gradients are among its gradients (`new_grads`)
                region_moments.setdefault(r, []).append((here, grads(n), i))
                if here > region_peak.get(r, 0.0) or r not in region_peak:
                    region_peak[r], region_grads[r] = here, grads(n)
                    region_given[r] = moments.get(n.name, (0.0, 0.0, 0.0))[1]
                # the redistributions of its inputs, after its backward freed what it re-saved
                here = prior + after_grads(n)
                if after_grads(n) > 0:
                    bucket(r, i, here, after_grads(n), moments[n.name][4])
                    region_moments.setdefault(r, []).append((here, after_grads(n), i - 1))
                if after_grads(n) > 0 and here > region_peak[r]:
                    region_peak[r], region_grads[r] = here, after_grads(n)
                    region_given[r] = moments[n.name][4]
        for n in calls:
            r = region[n.name]
            if r is None:
                continue
            for i in n.inputs:
                p = by_name.get(i)
                if p is None or p.kind not in ("call", "input"):
                    continue
                b = base.get(i, i)
                if region.get(b) == r or region.get(i) == r or batch(b):
                    continue
                if b in owner_layer:
                    continue
                owner_layer[b], nbytes_of[b], owner_node[b] = n.layer, size(i), n.name
    def split_on_ranks(n, i: str) -> bool:
        # whether op n reads input i split over the tp ranks (as its producer leaves it, or as
        # a redistribution gives it)
        r = read(n, i)
        if r is not None:
            return r[0] < size(i) * (1 - 1e-9)
        b = base.get(i, i)
        if b in copies:
            # a view of the executor's copy (a redistribution an earlier op read it as): split
            # where that copy is
            o = by_name[b].outputs[0]
            return copies[b][0] < o.nbytes * bytes_scale(o.dtype, dtype) * (1 - 1e-9)
        f = shard(by_name[b]) if callable(shard) else shard
        return float(f) > 1

    if device_type == "cpu":
        # a reduced loss whose 0-dim output keeps the unreduced fp32 loss as its storage: alive
        # as long as the loss is, through the backward (no op's backward frees it). On DTensors
        # too where the loss reads its input whole (the local kernel's output is the loss); a
        # loss on a split input gives a partial one, reduced into a fresh scalar
        for n in calls:
            fl = [i for i in _tensor_inputs(n, by_name)[:1] if _floating(by_name[base.get(i, i)])]
            if dtensor and fl and split_on_ranks(n, fl[0]):
                continue
            if n.op in LOSSES_KEEP_UNREDUCED and fl and n.outputs and n.outputs[0].numel == 1:
                key = n.name + ":unreduced"
                owner_layer[key], nbytes_of[key], owner_node[key] = n.layer, size(fl[0], "fp32"), ""
    out = ActivationMemory()
    for n in calls:
        if keep is not None and n.layer not in keep:
            continue
        if not is_view(n) and n.outputs and _floating(n):
            out.backward_bytes = max(out.backward_bytes, BACKWARD_LIVE * size(n.name))
        if n.op in LOSSES:
            for i in _tensor_inputs(n, by_name)[:1]:
                if _floating(by_name[base.get(i, i)]):
                    live, nb = loss_read(n, i)
                    out.loss_grad_bytes = max(out.loss_grad_bytes, live * nb)
    for k, l in owner_layer.items():
        if keep is not None and l not in keep:
            continue
        out.per_layer[l] = out.per_layer.get(l, 0.0) + nbytes_of[k]
        out.saved_bytes += nbytes_of[k]
        out.saved[k] = nbytes_of[k]
        if not owner_node.get(k):
            out.kept_bytes += nbytes_of[k]
    out.bases = base
    # the backward, op by op in reverse: what is still saved (tensors whose first saver has not
    # run its backward) plus the op's gradients, or, entering a recomputed region, its re-made
    # tensors and gradients (`region_peak`); the worst moment above everything saved
    owned: dict[str, float] = {}
    for k, nm in owner_node.items():
        if keep is None or owner_layer[k] in keep:
            owned[nm] = owned.get(nm, 0.0) + nbytes_of[k]
    for b, nm, _, l in discarded.values():
        if keep is None or l in keep:
            owned[nm] = owned.get(nm, 0.0) + b
    def given_share(n) -> float:
        # what grads(n) counts of gradients that are the given one
        return moments.get(n.name, (0.0, 0.0, 0.0))[1]

    live = out.saved_bytes
    entered: set = set()
    born = 0.0          # parameter gradients the ops whose backward ran made
    born_e = 0.0        # of them, the routed experts' (`expert_params`)
    position = unit_position(calls, modules)
    born_at: dict[float, float] = {}      # of those, by the position of the op that made them

    def first(n, acts: float, act_grads: float, param_grads: float, expert_grads: float = 0.0) -> None:
        # a moment of the first backward, by parts: the worst at op n's position; of its
        # parameter gradients, the routed experts' (`expert_egrads`)
        at = position[n.name]
        old = out.first_moments.get(at)
        if old is None or acts + act_grads + param_grads > sum(old):
            out.first_moments[at] = (acts, act_grads, param_grads)
            out.first_born[at] = {p: b for p, b in born_at.items() if p != at and b > 0}
            out.first_egrads[at] = expert_grads
        old = out.acc_moments.get(at)
        if old is None or acts + act_grads > old[0] + old[1]:
            out.acc_moments[at] = (acts, act_grads, param_grads)
            out.acc_born[at] = {p: b for p, b in born_at.items() if p != at and b > 0}
            out.acc_egrads[at] = expert_grads

    # the plain backward's moments by where they fall against the layer's first fused attention
    # op (`attention_moments`)
    att_first = next((i for i, n in enumerate(calls) if n.op in FUSED_ATTENTION
                      and (keep is None or n.layer in keep)), None)
    index = {n.name: i for i, n in enumerate(calls)}
    region_calls: dict[Optional[str], list] = {}
    for c in calls:
        if region.get(c.name) is not None:
            region_calls.setdefault(region[c.name], []).append(c)

    def plain(n, m: float, g: float, g_in: float) -> None:
        if att_first is None:
            return
        i = index[n.name]
        k = "loss" if n.op in LOSSES else "pre" if i < att_first else "at" if i == att_first else "post"
        old = out.attention_moments.get(k)
        if old is None:
            out.attention_moments[k] = [m, g, m - g_in, g - g_in]
            return
        if m > old[0]:
            old[0], old[1] = m, g
        if m - g_in > old[2]:
            old[2], old[3] = m - g_in, g - g_in

    for n in reversed(calls):
        if keep is not None and n.layer not in keep:
            continue
        r = region.get(n.name) if region_bytes else None
        if r is not None:
            if r not in entered:
                entered.add(r)
                m = live + region_peak[r] - out.saved_bytes
                # the first backward: the parameter gradients the region's ops made before
                # each of its moments count with it (a recomputed layer's MLP weights' at its
                # norm's backward)
                for val, g, after_i in region_moments.get(r, ()):
                    made_in = sum(new_grads(c) for c in region_calls.get(r, ()) if index[c.name] > after_i)
                    made_e = sum(new_expert_grads(c) for c in region_calls.get(r, ()) if index[c.name] > after_i)
                    first(n, live + val - out.saved_bytes - g, g, born + made_in, born_e + made_e)
                if r in region_att:
                    out.attention_regions.append({
                        "position": position[n.name], "param_grads": born,
                        **{k: [live + v[0] - out.saved_bytes, v[1], v[2]] for k, v in region_att[r].items()}})
                out.backward_over_body = max(out.backward_over_body, m)
                if m > out.backward_over_bytes:
                    out.backward_over_bytes, out.backward_over_recompute = m, True
                    out.backward_over_grads = region_grads[r]
                # the gradient that started the region's backward can be the given one (a
                # pipeline chunk's receive buffer, counted elsewhere), as in a plain op's moment
                g_in = region_given.get(r, 0.0)
                if m - g_in > out.backward_over_given:
                    out.backward_over_given, out.backward_over_given_recompute = m - g_in, True
                    out.backward_over_given_grads = region_grads[r] - g_in
        else:
            # a "norm_act" region re-made for this op's backward (`remade_at`)
            live += remade_at.get(n.name, 0.0)
            m = live + grads(n) - out.saved_bytes
            # the weight gradients the op makes are its backward's outputs while it runs
            # (AccumulateGrad makes them `.grad` after it): counted with its other gradients
            first(n, live - out.saved_bytes, grads(n), born, born_e)
            plain(n, m, grads(n), given_share(n))
            if n.op in LOSSES:
                out.backward_over_loss = max(out.backward_over_loss or 0.0, m)
            else:
                out.backward_over_body = max(out.backward_over_body, m)
            if m > out.backward_over_bytes:
                out.backward_over_bytes, out.backward_over_recompute = m, False
                out.backward_over_grads = grads(n)
            if m - given_share(n) > out.backward_over_given:
                out.backward_over_given, out.backward_over_given_recompute = m - given_share(n), False
                out.backward_over_given_grads = grads(n) - given_share(n)
        made = new_grads(n)
        born += made
        born_e += new_expert_grads(n)
        if made:
            born_at[position[n.name]] = born_at.get(position[n.name], 0.0) + made
        live -= owned.get(n.name, 0.0)
        if r is None and after_grads(n) > 0:
            # the executor's redistributions of op n's inputs run their backward after its
            # own, which freed what it saved (`_gradient_moments`' fourth item)
            g_after = after_grads(n)
            m = live + g_after - out.saved_bytes
            first(n, live - out.saved_bytes, g_after, born, born_e)
            plain(n, m, g_after, moments[n.name][4])
            out.backward_over_body = max(out.backward_over_body, m)
            if m > out.backward_over_bytes:
                out.backward_over_bytes, out.backward_over_recompute = m, False
                out.backward_over_grads = g_after
            g_in = moments[n.name][4]
            if m - g_in > out.backward_over_given:
                out.backward_over_given, out.backward_over_given_recompute = m - g_in, False
                out.backward_over_given_grads = g_after - g_in
    if keep is None:
        fo = [_forward_over(calls, by_name, base, owner_node, nbytes_of, size, read, batch, out.saved_bytes,
                            mixed, cuda_fp32, {k: v[1] for k, v in copies.items()}, handed=h, split_at=att_first,
                            where=True)
              for h in ((None, given_grad) if given_grad is not None else (None,))]
        worst_op = fo[0][-1]
        if att_first is not None:
            out.forward_attention = {k: [v, fo[-1][1].get(k, v)] for k, v in fo[0][1].items()}
        fo = [f[0] for f in fo]
        out.forward_over_bytes, out.forward_over_given = fo[0], fo[-1]
        # where the forward's worst moment lies among the layer's modules (`unit_position`): the
        # ZeRO-3 unit it holds gathered (none outside them: a loss), nothing prefetched
        out.forward_over_at = position.get(worst_op, 0.0) if worst_op is not None else None
    layer_of_region = {region[n.name]: n.layer for n in calls if region[n.name] is not None}
    # region_peak: what a region re-made at the end plus the last op's gradients at least
    cand = [region_peak[r] for r in region_bytes if keep is None or layer_of_region.get(r) in keep]
    out.working_bytes = max(cand, default=0.0)
    return out


def unit_position(calls: list, modules: Sequence[str]) -> dict[str, float]:
    """Where each op of a layer lies among the layer's `modules` (its FSDP units under ZeRO-3,
    in forward order): the index of the module holding it, or, for an op outside all of them
    (a loss, a top-level op), the index of the last module before it plus one half (-0.5 before
    the first). The first backward's moments are kept per position (`first_moments`): the
    search charges each with the unit its op's module is and the one FSDP prefetches for the
    backward next (`inter_op.search`). Without `modules` every op is at 0."""
    if not modules:
        return {n.name: 0.0 for n in calls}
    out: dict[str, float] = {}
    last = -1
    for n in calls:
        path = n.module_path or ""
        at = next((i for i, m in enumerate(modules) if not m or path == m or path.startswith(m + ".")), None)
        if at is None:
            out[n.name] = last + 0.5
        else:
            out[n.name], last = float(at), at
    return out


# views whose backward makes the input's gradient as a new tensor from the pieces' (torch's
# split / unbind backward: a cat or stack of the pieces' gradients)
_MULTI_OUTPUT_VIEWS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "unsafe_split"})


def _reading_upcast_inputs(calls: list, by_name: dict, base: dict, upcasts: frozenset) -> list:
    """`calls` with each read of an upcast from outside the upcast's module read as the cast's
    input: a fp32 capture made `x.to(torch.float32)` and `x` one tensor (a `to` to its own
    dtype returns it), so the residual add after Hugging Face's RMSNorm reads the cast in the
    graph, while the mixed-precision program reads the 2-byte residual stream there (as
    `_promoted_fp32` reads it). For the backward's gradients: the add hands its gradient to
    the stream itself, and the norm's own readers make the cast's fp32 gradient, a tensor of
    its own until the cast's backward adds it in (taken as the stream's, it was added in at
    once: Phi-3's RMSNorm backward 128 KiB under torch at tp 2, full recomputation)."""
    if not upcasts:
        return calls
    out = []
    for n in calls:
        ins = list(n.inputs)
        for k, i in enumerate(ins):
            b = by_name.get(base.get(i, i))
            if b is None or b.op not in ("to", "_to_copy") or b.name not in upcasts or not b.inputs:
                continue
            mod, rm = b.module_path or "", n.module_path or ""
            if mod and not (rm == mod or rm.startswith(mod + ".")):
                ins[k] = b.inputs[0]
        out.append(n if ins == list(n.inputs) else dataclasses.replace(n, inputs=ins))
    return out


def _backward_temporaries(n, by_name: dict, rg: dict, gsize: Callable[[str], float]) -> float:
    """Bytes an op's backward formula holds beside the gradients it makes (torch's
    tools/autograd/derivatives.yaml and FunctionsManual.cpp; C++ temporaries live to the end of
    the expression): `pow` by a scalar, `grad * (exponent * self.pow(exponent - 1))`, two of its
    input's size (`pow_backward`); `mul` with an operand broadcast to the output that needs a
    gradient (a norm's per-row statistic or its weight), `(grad * other).sum_to_size(...)`:
    one of its output's size (`mul_tensor_backward`, then the reduction; measured on CPU,
    torch 2.13: a [8, 16, 64] fp32 `x.pow(2)` backward peaks 2 x 32 KiB above its gradients,
    `a * a.sum(-1, keepdim=True)` 32 KiB)."""
    ins = _tensor_inputs(n, by_name)
    if n.op == "pow" and len(ins) == 1 and len(n.args) > 1 and isinstance(n.args[1], (int, float)):
        return 0.0 if n.args[1] == 0 or not rg.get(ins[0], False) else 2 * gsize(ins[0])
    if n.op in ("mul", "mul_") and n.outputs and len(n.inputs) > 1:
        numel = n.outputs[0].numel
        for i in n.inputs[:2]:
            src = by_name.get(i)
            if (src is not None and src.outputs and rg.get(i, False) and _floating(src)
                    and src.outputs[0].numel < numel):
                return gsize(n.name)
    return 0.0


def _gradient_moments(calls: list, by_name: dict, base: dict, rg: dict, copies: dict, upcasts: frozenset,
                      shard: Any, dtype: str, new_grads: Callable, loss_read: Callable,
                      given_grad: Optional[str],
                      redistributed: Optional[Callable[[Any, str], bool]] = None,
                      regather: Optional[Callable[[Any], float]] = None,
                      ) -> dict[str, tuple[float, float, float]]:
    """The backward's gradients, by liveness: for each op, the bytes of gradients alive while its
    backward runs, and of those the given one's (`given_grad`'s, made outside: a pipeline
    chunk's receive buffer), as {op: (bytes, given bytes, bytes alive before it makes any)}.

    Walking the ops in reverse as autograd runs them: a tensor's gradient is made by the
    backward of its last reader (in forward order) and lives until its producer's backward has
    run; each later reader's backward makes a gradient of it that is added in (held while it
    is added); a tensor no op here reads (the subgraph's output) has its gradient from the
    start. While an op's backward runs, what is alive is every such gradient, the op's output's,
    those it makes for its inputs and for the parameters it reads (`new_grads`). Views make no
    gradient of their own: a reshape's or a getitem's is its input's, the same storage; a
    residual sum hands its output's to both inputs as it is; a slice's or an expand's backward
    makes one of its input's size, a split's one (the cat of its pieces') too. A loss's backward
    holds `loss_read`'s fp32 gradients, then hands its input's on at the training dtype. Where
    an op reads an input redistributed into a split layout (`redistributed(op, input)`: the
    executor's copy, sharded), the input's gradient is a new tensor in its producer's layout,
    which the redistribution's backward makes (a Megatron-SP row-parallel projection's output
    read as a sequence shard by the residual add: the add hands its gradient on, the
    all-gather of the redistribution's backward makes the projection's whole one), not the
    reader's as it is. `regather(op)`: what an op's backward redistributes anew before it makes
    its gradients (an input its dispatch redistributed below autograd, DTensor propagation:
    it saved the input as it arrived), beside the gradients alive before it makes any: the
    op's moment is the larger of that and its gradients'. Where `redistributed` gives a tuple
    (the executor's redistribution, `execute._Reshard`, an autograd node of its own: (its
    copy's gradient, the gather's buffers), fractions of the input's gradient in its
    producer's layout), op n's backward makes the copy's gradient (a sum hands its own on),
    and the redistribution's backward, after op n's, holds it, the gathered gradient and the
    gather's buffers: the fourth item of op n's entry, with the given gradient's share of it
    fifth (0: no such moment)."""
    calls = _reading_upcast_inputs(calls, by_name, base, upcasts)
    by_name = {**by_name, **{n.name: n for n in calls}}

    def gsize(name: str) -> float:
        node = by_name.get(name)
        if node is None or not node.outputs or not _floating(node):
            return 0.0
        o = node.outputs[0]
        b = base.get(name, name)
        at = "fp32" if b in upcasts else dtype
        if b in copies:
            src = by_name[b].outputs[0] if by_name[b].outputs else None
            full = src.nbytes * bytes_scale(src.dtype, at) if src is not None else 0.0
            return o.nbytes * bytes_scale(o.dtype, at) * (copies[b][0] / full if full else 1.0)
        f = shard(by_name[b]) if callable(shard) else shard
        return o.nbytes * bytes_scale(o.dtype, at) / max(float(f), 1.0)

    def grad_in(n) -> list[str]:
        # the inputs op n's backward makes a gradient for (parameters apart: `new_grads`; a
        # view of one too, the experts' `w.transpose(1, 2)`: its gradient is the parameter's)
        return list(dict.fromkeys(i for i in _tensor_inputs(n, by_name)
                                  if rg.get(i, False) and _floating(by_name[i])
                                  and getattr(by_name.get(base.get(i, i)), "kind", None) != "param"))

    read_with_grad: set = set()
    for n in calls:
        if rg.get(n.name, False):
            read_with_grad.update(grad_in(n))
    owner: dict[str, list[str]] = {}      # tensor -> storages holding its gradient
    stor: dict[str, float] = {}
    refs: dict[str, int] = {}
    total = 0.0

    def hold(t: str, st: str, nb: float) -> None:
        nonlocal total
        if st not in stor:
            stor[st], refs[st] = nb, 0
            total += nb
        refs[st] += 1
        owner.setdefault(t, []).append(st)

    def drop(t: str) -> None:
        nonlocal total
        for st in owner.pop(t, []):
            refs[st] -= 1
            if refs[st] == 0:
                total -= stor.pop(st)
                del refs[st]

    def alias(src: str, t: str) -> float:
        # src's gradient is t's storage(s); a gradient src already has is added to: held meanwhile
        if src in owner:
            return gsize(src)
        for st in owner.get(t, []):
            hold(src, st, stor[st])
        return 0.0

    def crossing(n, i: str) -> Any:
        # whether op n reads input i redistributed: its gradient is then made anew (a tuple:
        # by the redistribution's own backward, after op n's: `redistributed`)
        return redistributed(n, i) if redistributed is not None else None

    out: dict[str, tuple[float, ...]] = {}
    given_st = f"g:{given_grad}"
    # custom autograd Functions (`capture.functions`): a call's backward is one step, the
    # Function's, at its first op: its other ops make no gradients, theirs pass to it
    fn_first: dict[str, Any] = {}
    fn_ops: dict[str, list] = {}
    for n in calls:
        key = getattr(n, "function", None)
        if key is not None:
            fn_first.setdefault(key, n)
            fn_ops.setdefault(key, []).append(n)
    for n in reversed(calls):
        key = getattr(n, "function", None)
        if key is not None and fn_first[key] is not n:
            for st in owner.pop(n.name, []):
                owner.setdefault(fn_first[key].name, []).append(st)
            out[n.name] = (total, stor.get(given_st, 0.0), total)
            continue
        if key is not None and owner.get(n.name):
            # the call's first op: its backward holds the gradients of the call's outputs (passed
            # to it above), makes its arguments' (the most it holds at once measured on meta:
            # `OpNode.function_work`, in its first argument's size) and its parameters'
            inside = {m.name for m in fn_ops[key]}
            args = list(dict.fromkeys(i for m in fn_ops[key] for i in _tensor_inputs(m, by_name) if i not in inside))
            ins = [i for i in args if rg.get(i, False) and _floating(by_name[i])
                   and getattr(by_name.get(base.get(i, i)), "kind", None) != "param"]
            made = sum(gsize(i) for i in ins)
            work = getattr(n, "function_work", 0.0) * (gsize(args[0]) if args and _floating(by_name[args[0]]) else 0.0)
            at = total + max(made, work) + sum(new_grads(m) for m in fn_ops[key])
            given_at, before = stor.get(given_st, 0.0), total
            drop(n.name)
            out[n.name] = (at, given_at, before, 0.0, 0.0)
            for i in ins:
                if i not in owner:
                    hold(i, f"g:{i}", gsize(i))
            continue
        if not rg.get(n.name, False) or not n.outputs or not _floating(n):
            drop(n.name)
            continue
        pb = by_name.get(base.get(n.name, n.name))
        if getattr(pb, "kind", None) == "param" and pb.outputs and n.outputs[0].numel == pb.outputs[0].numel:
            # a view of a whole parameter (the experts' `w.transpose(1, 2)`): its gradient is the
            # parameter's, which its reader's backward made (`new_grads`) and AccumulateGrad
            # then makes `.grad`, one tensor; the view's backward hands it on as a view. Not a
            # gradient of its own beside it (the grouped GEMM's weight gradient was counted
            # twice at the transpose's moment: moe-tiny's experts, 16 KiB a block). A view of
            # part of one (an expert's `w[e]`) is not: its backward makes a whole-size tensor
            out[n.name] = (total, stor.get(given_st, 0.0), total)
            drop(n.name)
            continue
        if n.name not in owner:
            if n.name in read_with_grad and n.op not in LOSSES:
                continue                 # its readers' backward hands it no gradient
            if n.op not in LOSSES:
                hold(n.name, f"g:{n.name}", gsize(n.name))
        ins = grad_in(n)
        extra = 0.0
        born: list[tuple[str, float]] = []
        # the executor's redistributions of inputs into split layouts (`crossing`'s tuple):
        # their backward runs after op n's, with the copies' gradients op n made (`pending`)
        # and, per input, the gradient it makes in the producer's layout and the gather's
        # buffers beside it
        pending, after = 0.0, []
        passed = False           # a sum handed its output's gradient to such a redistribution
        if n.op in LOSSES:
            fl = [i for i in ins[:1]]
            if fl:
                live, nb = loss_read(n, fl[0])
                extra = live * nb
                born = [(fl[0], gsize(fl[0]))]
        elif is_view(n) and ins:
            src = ins[0]
            cx = crossing(n, src)
            if isinstance(cx, tuple):
                extra = pending = gsize(src) * cx[0]
                after.append((src, gsize(src), gsize(src) * cx[1]))
            elif not cx and (n.target == "getitem" or n.op in ("alias", "detach") or (
                    n.op not in _MULTI_OUTPUT_VIEWS and gsize(n.name) == gsize(src))):
                extra = alias(src, n.name)
            else:
                extra = gsize(src)
                born = [(src, extra)] if src not in owner else []
        elif _pass_through_sum(n, by_name):
            for i in ins:
                cx = crossing(n, i)
                if isinstance(cx, tuple):
                    passed = True
                    after.append((i, gsize(i), gsize(i) * cx[1]))
                elif cx:
                    nb = gsize(i)
                    extra += nb
                    if i not in owner:
                        born.append((i, nb))
                else:
                    extra += alias(i, n.name)
        else:
            # an op computing in fp32 by type promotion (`_promoted_fp32`) makes a 2-byte input's
            # gradient in fp32 first; autograd casts it to the input's dtype, both alive at once
            wide = dtype != "fp32" and base.get(n.name, n.name) in upcasts
            for i in ins:
                nb = gsize(i)
                cx = crossing(n, i)
                if isinstance(cx, tuple):
                    extra += nb * cx[0]
                    pending += nb * cx[0]
                    after.append((i, nb, nb * cx[1]))
                    continue
                extra += nb
                if wide and base.get(i, i) not in upcasts:
                    extra += nb / bytes_scale("float32", dtype)
                if i not in owner:
                    born.append((i, nb))
            extra += new_grads(n)
            extra += _backward_temporaries(n, by_name, rg, gsize)
        at = total + extra
        if regather is not None:
            at = max(at, total + regather(n))
        mine = {st: stor[st] for st in owner.get(n.name, [])}
        given_at, before = stor.get(given_st, 0.0), total
        drop(n.name)
        after_at = after_given = 0.0
        if after:
            # the redistributions' backward (each a gather into the producer's layout, the
            # gathered gradient new; with several, their results held as each ends): the
            # parameter gradients op n made are `.grad` by then (AccumulateGrad runs first)
            if passed:
                pending += sum(b for st, b in mine.items() if st not in stor)
            after_at = total + pending + sum(r for _, r, _ in after) + max(b for _, _, b in after)
            after_given = stor.get(given_st, 0.0) + (mine.get(given_st, 0.0) if passed and given_st not in stor
                                                     else 0.0)
        out[n.name] = (at, given_at, before, after_at, after_given)
        for i, nb in born:
            if i not in owner:
                hold(i, f"g:{i}", nb)
        for i, nb, _ in after:
            if i not in owner:
                hold(i, f"g:{i}", nb)
    return out


def _pass_through_sum(node, by_name: dict) -> bool:
    """A sum of same-shape tensors (a residual add): its backward hands its output's gradient
    to each input as it is, no new tensor."""
    if node.op not in ("add", "add_") or not node.outputs:
        return False
    ins = _tensor_inputs(node, by_name)
    shape = tuple(node.outputs[0].shape)
    return len(ins) == 2 and all(by_name[i].outputs and tuple(by_name[i].outputs[0].shape) == shape for i in ins)


def _loss_live(node) -> int:
    """Input-sized fp32 gradients a loss's backward holds at once: an elementwise loss reduced to
    a scalar makes its input's gradient alone (its output's is the scalar), a cross-entropy the
    gradient of its log-probabilities and of its input (`BACKWARD_LIVE`)."""
    reduced = bool(node.outputs) and node.outputs[0].numel == 1
    return 1 if node.op in LOSSES_SAVING_INPUT and reduced else BACKWARD_LIVE


def mixed_fp32(calls: list, by_name: dict, base: dict, device_type: Optional[str], dtype: str,
               autocast: bool = True) -> frozenset:
    """The tensors (storages: names of `base`'s values) a `dtype` run on `device_type` holds in
    fp32 though the training dtype is narrower: upcasts that stay fp32 and the ops between an
    upcast and its cast back (`_upcasts`), the outputs of CUDA autocast's fp32 ops
    (`CUDA_FP32_OUTPUT_OPS`, the losses apart; only under `autocast`: a model cast to `dtype`
    runs them at it) and what type promotion makes fp32 from them (`_promoted_fp32`). Empty in
    an fp32 run. The memory model sizes tensors by it, the time model the bytes an op moves
    (`graph_fp32_tensors`)."""
    if dtype == "fp32":
        return frozenset()
    cuda_fp32 = CUDA_FP32_OUTPUT_OPS if device_type == "cuda" and autocast else frozenset()
    params = frozenset(n.name for n in by_name.values() if n.kind == "param")
    # casts read by ops that then run in fp32 (a loss; a softmax on `x.float()`), and what
    # promotion makes fp32 from them first: a cast reading one of those is no upcast region's
    # opening (`_upcast_regions`' `wide`: the router's fp32 weights cast to the experts' dtype)
    first = _upcasts(calls, base, LOSSES | cuda_fp32 | SOFTMAXES, params, regions=False)
    wide = _promoted_fp32(calls, by_name, base, first, cuda_fp32)
    return _promoted_fp32(calls, by_name, base, _upcasts(calls, base, LOSSES | cuda_fp32 | SOFTMAXES, params,
                                                         wide=wide), cuda_fp32)


def graph_fp32_tensors(graph, device_type: Optional[str], dtype: str,
                       attention_kernel: AttentionKernel = "fused", autocast: bool = True) -> frozenset:
    """The names of `graph`'s floating-point tensors (views included: they read their storage)
    that a `dtype` run on `device_type` holds in fp32 (`mixed_fp32`; `autocast`: the software's
    mixed precision, `SoftwareSpec.autocast`), once per graph, device type, dtype, attention
    kernel and precision (`cost_models.compute.node_time` asks per op)."""
    memo = graph.__dict__.setdefault("_fp32_tensors", {})
    key = (device_type, dtype, attention_kernel, autocast)
    if key not in memo:
        if dtype == "fp32":
            memo[key] = frozenset()
        else:
            nodes = list(graph.nodes)
            by_name = {n.name: n for n in nodes}
            base = tensor_bases(nodes, by_name, device_type, dtype, attention_kernel,
                                copies=graph_layout_copies(graph, device_type, attention_kernel))
            wide = mixed_fp32([n for n in nodes if n.kind == "call"], by_name, base, device_type, dtype, autocast)
            memo[key] = frozenset(n.name for n in nodes if base.get(n.name, n.name) in wide and _floating(n))
    return memo[key]


# softmaxes: a cast every reader of which is one is an upcast (`x.float().softmax(-1)`, a MoE
# router's: numerics code casts up before a softmax, not to the training dtype)
SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})


def _upcasts(calls: list, base: dict, fp32_readers: frozenset, params: frozenset = frozenset(),
             regions: bool = True, wide: frozenset = frozenset()) -> frozenset:
    """Casts to float32 that stay fp32 in a mixed-precision run: those whose every reader
    (through views) runs in fp32 anyway (`x.float()` before a loss or a softmax), and with
    `regions` those opening an upcast region (`_upcast_regions`; `wide`: tensors held in fp32
    already, whose casts open none). A capture is fp32, so `to(float32)` is all it shows of
    both an upcast and a cast back to an input's dtype; only these cases are told apart."""
    casts = {n.name for n in calls if n.op in ("to", "_to_copy") and base.get(n.name, n.name) == n.name
             and ("float32" in n.args[1:] or n.kwargs.get("dtype") == "float32")}
    readers: dict[str, set] = {}
    for n in calls:
        if is_view(n):
            continue
        for i in n.inputs:
            b = base.get(i, i)
            if b in casts:
                readers.setdefault(b, set()).add(n.op)
    out = {c for c, ops in readers.items() if ops <= fp32_readers}
    if not regions:
        return frozenset(out)
    by_name = {n.name: n for n in calls}
    opening = {c for c in casts if not (by_name[c].inputs and base.get(by_name[c].inputs[0], by_name[c].inputs[0])
                                        in wide)}
    return frozenset(out | _upcast_regions(calls, base, casts, params, opening))


def _promoted_fp32(calls: list, by_name: dict, base: dict, fp32: frozenset, fp32_ops: frozenset) -> frozenset:
    """`fp32` (tensors a mixed-precision run holds in fp32) with what type promotion makes fp32
    from them: an op outside autocast's lists computes in its inputs' promoted dtype, so an
    element-wise op reading an fp32 tensor with dimensions (a 0-dim one does not promote a
    dimensioned operand) gives fp32, as does every op of `fp32_ops` (autocast's fp32 list, the
    losses apart: their scalar). Hugging Face GPT-2's `gelu_new` is the case: under CUDA's
    autocast `pow` runs in fp32, so `x + 0.044715 * pow(x, 3)`, its tanh and the products after
    it are fp32 tensors up to the next matmul (its 2-byte copy for autocast), twice the bytes
    the training dtype gives (seen through saved-tensor hooks on `runtime.cuda_program`).
    Matrix ops and attention (autocast's lower-precision list), casts (a capture is fp32, so a
    cast not in `fp32` is the cast back to the training dtype) and losses end it; parameters,
    buffers and the model's inputs start none."""
    out = set(fp32)
    stop = MATRIX_OPS | FUSED_ATTENTION | CASTS | LOSSES

    def fp32_operand(i: str, reader) -> bool:
        src = by_name.get(i)
        b = by_name.get(base.get(i, i))
        if b is not None and b.op in ("to", "_to_copy") and b.name in fp32 and b.inputs:
            mod, rm = b.module_path or "", reader.module_path or ""
            if mod and not (rm == mod or rm.startswith(mod + ".")):
                # an upcast read outside its module: the fp32 capture made the cast and its
                # input one tensor (a `to` to its own dtype returns it), and the program read
                # the input there (the residual stream beside Hugging Face's RMSNorm)
                return fp32_operand(b.inputs[0], reader)
        return (src is not None and base.get(i, i) in out and _floating(src) and bool(src.outputs)
                and len(src.outputs[0].shape) > 0)

    for n in calls:
        if n.name in out or not _floating(n):
            continue
        if is_view(n):
            # a reshape that copies keeps its input's dtype; a view shares its base's storage
            if base.get(n.name, n.name) == n.name and n.inputs and base.get(n.inputs[0], n.inputs[0]) in out:
                out.add(n.name)
            continue
        if n.op in fp32_ops and n.op not in LOSSES:
            out.add(n.name)
        elif n.op not in stop and any(fp32_operand(i, n) for i in n.inputs):
            out.add(n.name)
    return frozenset(out)


# the most ops an upcast region may span (`_upcast_regions`): a norm's or a rotary table's
UPCAST_REGION_MAX = 24


def _upcast_regions(calls: list, base: dict, casts: set, params: frozenset = frozenset(),
                    opening: Optional[set] = None) -> set:
    """Ops that run in fp32 between an upcast and its cast back, in a mixed-precision run:
    model code that computes a norm or a rotary table in fp32 (`x.to(torch.float32)` ...
    `.to(input_dtype)`, Hugging Face's RMSNorm) captures as two `to(float32)`; the first of two
    on a path inside one module is the upcast. From each cast, its readers in its module (the
    cast's value may also be read outside, where a fp32 capture made the two one tensor: the
    residual stream) up to the next casts: when that region ends in a cast within
    `UPCAST_REGION_MAX` ops and reads into no loss, the cast and the region's ops are fp32, the
    closing casts the training dtype (and open no region of their own). A region holding a
    matrix op with a parameter operand (`params`: their names; through views) is none: that
    cast is to the weight's dtype (`x.to(w.dtype)` before an expert's grouped GEMM), the
    training dtype in the run, and numerics code upcasts no GEMM with a weight. `opening`: the
    casts that may open a region (None: all); a cast of a tensor already fp32 opens none (it
    is the cast down: `w.to(y.dtype)` of a router's fp32 weights)."""
    readers: dict[str, list] = {}
    for n in calls:
        for i in n.inputs:
            readers.setdefault(base.get(i, i), []).append(n)
    by_module = {n.name: n.module_path for n in calls}
    out: set = set()
    closers: set = set()         # casts back: they open no region
    for c in (n.name for n in calls if n.name in casts):
        if c in closers or (opening is not None and c not in opening):
            continue
        mod = by_module.get(c) or ""
        if not mod:
            continue
        region, closing, todo, ok = {c}, set(), [c], True
        while todo and ok:
            t = todo.pop()
            for r in readers.get(t, ()):
                rm = r.module_path or ""
                if r.name in region or not (rm == mod or rm.startswith(mod + ".")):
                    continue
                if r.name in casts or _casts_back(r, region, c, base):
                    closing.add(r.name)
                    continue
                if r.op in LOSSES or len(region) >= UPCAST_REGION_MAX or (
                        r.op in MATRIX_OPS and any(base.get(i, i) in params for i in r.inputs)):
                    ok = False
                    break
                region.add(r.name)
                todo.append(base.get(r.name, r.name))
        if ok and closing:
            out |= region
            closers |= closing
    return out


def _casts_back(node, region: set, opening: str, base: dict) -> bool:
    """Whether `node` casts a tensor of an upcast region back to the training dtype by another
    tensor's dtype: `y.type_as(x)` whose `x` is outside the region (a tensor of the training
    dtype) or is the region's opening cast, which an fp32 capture records in place of the `x`
    it upcast (Gemma's RMSNorm: `self._norm(x.float()) * (1 + w.float())).type_as(x)`)."""
    if node.op != "type_as" or len(node.inputs) < 2:
        return False
    ref = base.get(node.inputs[1], node.inputs[1])
    return ref == opening or ref not in region


def _copy_key(name: str, r: tuple, reader: str) -> str:
    """The storage op `reader` reads tensor `name` as, redistributed (`r`: `activation_memory`'s
    `read` result, (bytes, layout tag, gather buffer, held)): a junction's value, held for every
    reader, is one tensor; any other redistribution is made for its reader alone (the executor
    reshards per reader from the junction's value, `intra_op.execute._feed`: GQA's row-parallel
    k and v projections reading one replicated norm output slice it once each)."""
    return f"{name}@{r[1]}" if r[3] else f"{name}@{r[1]}@{reader}"


def _forward_over(calls: list, by_name: dict, base: dict, owner_node: dict, nbytes_of: dict,
                  size: Callable, read: Callable, batch: Callable, saved_total: float, mixed: bool,
                  fp32_ops: frozenset, copies: dict[str, str], per_op: bool = False,
                  handed: Optional[str] = None, split_at: Optional[int] = None, where: bool = False) -> Any:
    """The forward's worst moment above everything saved (`ActivationMemory.forward_over_bytes`),
    op by op in order: what the ops up to this one saved, every tensor made and not yet saved
    whose last reader is still to run (a storage's readers through any view; a tensor no op of
    the graph reads, what a layer hands on, at the op making it: the next layer's walk holds it
    from its start, a pipeline stage's send buffers beyond), and what this op reads
    redistributed (the copy, when it does not save it, and the buffer of a gather that is not
    along the first dim, `read_shard`'s third item, at the moment of the gather: the executor
    frees it once concatenated); a loss makes its per-element fp32 result
    (cross-entropy's log-softmax, which it saves in place of its input) beside its input, a
    fused one (`cost_models.fused_loss`) only its per-row results.
    `per_op`: also {op: what the forward holds at that op beyond what the ops before it saved,
    the most of just before it runs and just after} (a recomputed region's re-run forward).
    `handed`: a tensor the caller counts itself (the output a pipeline chunk keeps), left out
    where no op of the layer reads it (then it is held from the op making it alone).
    `split_at`: the index of an op (a fused attention) in `calls`: also the worst moments
    before it ("pre"), at it ("at") and after it ("post"), above everything saved, unfloored
    (`ActivationMemory.forward_attention`). `where` (not with `per_op`): also the name of the op
    the worst moment falls at, last (None where nothing lies above the saved tensors)."""
    T = len(calls)
    if T == 0:
        return (0.0, {}) if per_op or split_at is not None else (0.0, None) if where else 0.0
    idx = {n.name: t for t, n in enumerate(calls)}
    saved_at = np.zeros(T + 1)
    saver: dict[str, int] = {}
    for k, nm in owner_node.items():
        t = idx.get(nm, idx.get(k.split(":")[0], 0))
        saved_at[t] += nbytes_of[k]
        saver[k] = t
    last: dict[str, int] = {}
    for t, n in enumerate(calls):
        for i in n.inputs:
            if i in by_name:
                b = base.get(i, i)
                last[b] = max(last.get(b, -1), t)
    live = np.zeros(T + 1)          # difference array of the unsaved tensors' lifetimes
    made = np.zeros(T + 1)          # of those, the outputs of each op
    for name, nd in by_name.items():
        if base.get(name, name) != name or not _floating(nd):
            continue
        if name in copies:                  # a redistributed copy, made by the view taking it
            start, at = idx[copies[name]], None
        elif nd.kind == "call":
            start = idx[name]
            at = "fp32" if mixed and (nd.op in LOSSES or nd.op in fp32_ops) else None
        elif nd.kind == "input" and not batch(name):
            start, at = 0, None
        else:
            continue
        if handed is not None and name == base.get(handed, handed) and name not in last:
            continue
        end = last.get(name, start)
        if name in saver:
            end = min(end, saver[name] - 1)
        if end >= start:
            b = size(name, at)
            live[start] += b
            live[end + 1] -= b
            if nd.kind == "call":
                made[start] += b
    extra = np.zeros(T)
    gather = np.zeros(T)
    held_from: dict[str, tuple[int, float, str]] = {}   # a junction's copy: (first reader, bytes, input)
    for t, n in enumerate(calls):
        loss = n.op in LOSSES
        for k, i in enumerate(n.inputs):
            if i not in by_name:
                continue
            r = read(n, i, "fp32" if loss and mixed and not is_half_loss(n) else None)
            if r is not None and r[3]:
                held_from.setdefault(f"{i}@{r[1]}", (t, r[0], i))
            if (loss and k == 0 and _floating(by_name[base.get(i, i)]) and f"{n.name}:unreduced" not in owner_node
                    and not is_fused_loss(n)):
                # its per-element fp32 result (cross-entropy's log-softmax) beside its input;
                # where that result is the storage the reduced loss keeps (CPU's mse_loss,
                # `LOSSES_KEEP_UNREDUCED`), it is counted among the saved tensors already; a
                # fused kernel (`cost_models.fused_loss`) makes none: its forward writes one fp32
                # loss and one log-sum-exp per row (flash-attn csrc/xentropy/xentropy_kernel.cu,
                # host_softmax_xentropy: `losses`, `max_log_sum_exp`, each `empty_like(labels)`)
                extra[t] += r[0] if r is not None else size(i, None if is_half_loss(n) else "fp32")
            if r is None:
                continue
            if saver.get(_copy_key(i, r, n.name), T) > t and f"{i}@{r[1]}" not in copies and not r[3]:
                extra[t] += r[0]
            if r[2]:
                gather[t] += r[0] + r[2]
    for key, (start, b, i) in held_from.items():
        end = min(last.get(base.get(i, i), start), saver.get(key, T) - 1)
        if end >= start:
            live[start] += b
            live[end + 1] -= b
    held = np.cumsum(live[:T])
    saved = np.cumsum(saved_at[:T])
    moments = saved + held + extra
    # before the op: its inputs gathered, its outputs not yet made, its own saves not yet made
    before = saved - saved_at[:T] + held - made[:T] + gather
    over = float(max(moments.max() - saved_total, before.max() - saved_total, 0.0))
    worst_op = calls[int(np.argmax(np.maximum(moments, before)))].name if over > 0 else None
    if split_at is not None:
        each = np.maximum(moments, before) - saved_total
        parts = {"pre": each[:split_at], "at": each[split_at:split_at + 1], "post": each[split_at + 1:]}
        out = over, {k: float(v.max()) for k, v in parts.items() if v.size}
        return out + (worst_op,) if where else out
    if where:
        return over, worst_op
    if not per_op:
        return over
    prev = saved - saved_at[:T]
    return over, {n.name: float(max(moments[t] - prev[t], before[t] - prev[t])) for t, n in enumerate(calls)}


# autograd runs an op's backward with the gradient of its output live and makes the gradient of
# its input beside it; the largest such pair bounds what a layer's backward adds at once
BACKWARD_LIVE = 2
# a cross-entropy on vocabulary-sharded logits (torch's `loss_parallel`, what the runtime runs):
# its backward (`_nll_loss_and_log_softmax_backward` in torch/distributed/tensor/parallel/loss.py,
# torch 2.13) holds zeros_like(x), exp(x) and their sum at once, each the size of the local
# fp32 logits, before multiplying by the output gradient
VOCAB_PARALLEL_LOSS_LIVE = 3


# -- schedules and peak ---------------------------------------------------------------------------

def inflight_microbatches(schedule: ScheduleName | str, num_stages: int, stage: int, num_microbatches: int,
                          virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage `stage` (0-based) holds at once, in units of one
    micro-batch through all of the stage's layers, its chunks taken as equal.

    Read from the order torch.distributed.pipelining runs (`cost_models.schedules`), not from a
    closed form: GPipe m; 1F1B min(p - stage, m) (and GPipe's m where m < p, which the runtime
    runs then); interleaved 1F1B ((p - r - 1)·2 + (v - 1)·p + 1)/v capped at m for Megatron's
    m % p == 0 (Korthikanti et al. 2022, §4.2.3: p + (p - 1)/v for r = 0)."""
    from cost_models.schedules import held_profile, schedule_kind

    schedule_kind(schedule)               # a ValueError naming the choices for an unknown one
    v = max(int(virtual_stages), 1)
    prof = held_profile(schedule, num_stages, stage, num_microbatches, v)
    return float(np.max(prof.sum(axis=1))) / v


# -- what the runtime holds, phase by phase -------------------------------------------------------

PHASES = ("forward_backward", "grad_sync", "optimizer_step")
Phase = Literal["forward_backward", "grad_sync", "optimizer_step"]


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes one device holds at the peak of one phase of a training step, by category
    (`weights`: parameters as the model holds them; `gradients`; `optimizer`: Adam moments and
    fp32 masters; `buffers`: the runtime's transient buffers: flat communication buffers,
    gathered ZeRO-3 layers; `activations`: saved activations and recomputation's working set)."""

    phase: str
    weights: Any
    gradients: Any
    optimizer: Any
    buffers: Any
    activations: Any = 0.0

    @property
    def total(self) -> Any:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.activations


# AdamW's temporaries per parameter tensor it steps (torch's single-tensor AdamW, what the
# runtime's `default_optimizer` runs off CUDA): `exp_avg_sq.sqrt()` and its quotient by the bias
# correction are live together, two fp32 tensors the size of the tensor stepped
ADAMW_TEMPORARIES = 2

# Device types on which the runtime's `default_optimizer` runs torch's fused AdamW kernel, which
# updates in place and makes no temporaries (measured on an H100: 0 bytes beyond its inputs,
# benchmarks/results/h100-2026-11-25/optimizer.txt); elsewhere it steps one tensor at a time.
FUSED_OPTIMIZER_DEVICES = frozenset({"cuda"})


def fused_optimizer(device_type: Optional[str]) -> bool:
    """Whether the runtime's optimizer on `device_type` is the fused kernel (no temporaries)."""
    return (device_type or "cuda") in FUSED_OPTIMIZER_DEVICES


def adamw_temporary_elems(sizes: Iterable[float]) -> float:
    """Elements of the fp32 temporaries torch's single-tensor AdamW holds at its worst when it
    steps tensors of `sizes` elements in that order: the quotient `denom` of one tensor's
    update is a local of the loop over the parameters (torch/optim/adam.py,
    `_single_tensor_adam`), so it lives on while the next tensor's `sqrt()` and quotient are
    made: max over i of 2·s_i + s_(i-1) (`ADAMW_TEMPORARIES` of the tensor stepped, one of the
    one before)."""
    best, prev = 0.0, 0.0
    for s in sizes:
        best = max(best, ADAMW_TEMPORARIES * s + prev)
        prev = s
    return best


def holder_order(fqns: Iterable[str]) -> list[str]:
    """The order in which a pipeline chunk run op by op as solved holds (and the optimizer steps)
    parameters `fqns`: `intra_op.pipeline_chunks.ProgramChunk` inserts them, sorted by name,
    into a module tree of their paths (`_holder`), whose `named_parameters()` yields each
    module's own parameters before its submodules', the submodules in insertion order. That is
    not the model's order: a GPT's last stage steps `blocks.1.mlp.proj.weight`, then
    `embed.tok.weight` (its tied head), where the model holds `head.ln` between them."""
    tree: dict = {}
    for f in sorted(dict.fromkeys(fqns)):
        *path, name = f.split(".")
        node = tree
        for part in path:
            node = node.setdefault(("m", part), {})
        node[("p", name)] = f
    out: list[str] = []

    def walk(node: dict) -> None:
        out.extend(v for (kind, _), v in node.items() if kind == "p")
        for (kind, _), v in node.items():
            if kind == "m":
                walk(v)
    walk(tree)
    return out


# The collective library the runtime uses on a device type (`runtime.worker.init_distributed`:
# NCCL on GPU, gloo on CPU), and whether its reduce-scatter into a tensor works on a copy of its
# input: gloo's does (torch 2.13, torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
# `reduce_scatter_tensor_coalesced`: the input is cloned, the clone all-reduced, this rank's
# chunk copied out), NCCL's reduces in place into the output.
COLLECTIVE_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
REDUCE_SCATTER_COPIES_INPUT = {"gloo": True, "nccl": False}


def reduce_scatter_copies_input(device_type: Optional[str]) -> bool:
    """Whether a reduce-scatter on `device_type` (its runtime backend) holds a copy of its input."""
    return REDUCE_SCATTER_COPIES_INPUT.get(COLLECTIVE_BACKEND.get(device_type or "cuda", "nccl"), False)


def mixed_precision(policy: str) -> bool:
    """Whether `policy` (a `PRECISION_POLICIES` key) trains 2-byte weights beside fp32 masters
    the optimizer steps (not fp32 training, not an optimizer stepping the 2-byte weights)."""
    return PRECISION_POLICIES[policy][0] < 4 and not policy.endswith("_param")


def runtime_phases(num_params: Any, policy: str = "bf16", zero_stage: int = 0, dp: int = 1, *,
                   num_microbatches: int = 1, gathered_params: Any = 0.0,
                   optimizer_temps: Any = 0.0, prefetch_params: Any = 0.0,
                   rs_copies_input: bool = False, fused_optimizer: bool = False,
                   reduce_every_microbatch: bool = False,
                   zero_optimizer: str = "flat") -> list[PhaseMemory]:
    """Model-state bytes per device in each phase of a step, as `autopar.runtime` keeps them
    (activations left at 0: the caller adds them to "forward_backward"). `num_params` are the
    device's parameter elements (after tensor and pipeline parallelism; numbers or numpy
    arrays); `gathered_params` the elements ZeRO-3 holds as unsharded parameters at once (the
    root unit's and the layer running), `prefetch_params` those in flat all-gather outputs
    (FSDP2's next unit, prefetched; counted as buffers); `optimizer_temps` the elements of
    the fp32 temporaries AdamW holds at its worst stepping the device's parameter tensors one
    by one (`adamw_temporary_elems`; ZeRO-1/2 step one flat shard of num_params / D), none when
    `fused_optimizer` (the runtime's AdamW on CUDA, `fused_optimizer()`). Per parameter, with w, g, o the
    policy's bytes (bf16: 2, 2, 12) and D = dp:

    - ZeRO 0: w + g + o through the step; the gradient sync copies the gradients into one flat
      buffer (+g); under mixed precision the optimizer step holds fp32 gradients (4) in place
      of the 2-byte ones (`precision.MasterWeights`), 2 + 4 + 12 = 18.
    - ZeRO 1 and 2: the runtime accumulates full gradients in the backward and reduce-scatters
      them once per step (no bucketed reduce-scatter during the backward), so both hold
      w + g + o/D in the backward; the sync allocates a flat buffer while every gradient is
      alive (+g beside g), moves the gradients into it (freeing each as it is copied) and
      reduce-scatters it (+g + g/D; +g more where the backend's
      reduce-scatter copies its input, `rs_copies_input`: gloo); the sharded step holds an fp32
      gradient shard (4/D); the all-gather of the updated weights fills a full flat buffer
      (+w + w/D). With fp32 training the flat fp32 shard the optimizer steps is a copy of the
      weights: o/D + 4/D.
    - ZeRO 3 (FSDP2, mixed precision as `fsdp_policy`): fp32 weight shards, which are also
      the masters (counted with the optimizer state: o/D in all, as the fp32 flat shard of
      ZeRO-1/2), fp32 gradient shards (4/D); the weights as the model sees them are the
      gathered 2-byte layers (`gathered_params`); with several micro-batches FSDP accumulates
      unsharded 2-byte gradients until the last one reduce-scatters: g in place of 4/D (a
      unit's reduce-scatter, making its shard, frees its accumulated gradient, and 4/D <= g
      for D >= 2: the most is at the last backward's start, every gradient accumulated);
      with `reduce_every_microbatch` (`Plan.zero3_grad_sync` "microbatch") each micro-batch's
      backward reduce-scatters every unit as it ends and adds the result into the fp32 shard:
      4/D whatever the micro-batches, as with one.

    `zero_optimizer` "zero_redundancy" (`SoftwareSpec.zero_optimizer`: torch's
    ZeroRedundancyOptimizer under DDP, ZeRO 1 only): DDP all-reduces the gradients in its buckets,
    which are the gradients themselves (`gradient_as_bucket_view`), and each rank's optimizer
    steps its partition's parameter tensors in place and broadcasts them: w + g + o/D in every
    phase, no flat buffer, no fp32 shard copied from fp32 weights (torch/distributed/optim/
    zero_redundancy_optimizer.py: the local optimizer is built over `_partition_parameters()
    [rank]`, the parameters themselves); the step holds AdamW's temporaries over the shard
    (`ADAMW_TEMPORARIES` fp32 copies of it: the flash-attn configs name torch.optim.AdamW, not
    its fused kernel).
    """
    if policy not in PRECISION_POLICIES:
        raise ValueError(f"unknown precision policy {policy!r}; one of {', '.join(PRECISION_POLICIES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    w, g, o = PRECISION_POLICIES[policy]
    own = policy.endswith("_param")     # no fp32 master: the step reads the 2-byte gradients
    mixed = mixed_precision(policy)
    D = max(int(dp), 1)
    P = num_params
    z = zero_stage if D > 1 else 0
    temp = 0.0 if fused_optimizer else 4.0 * optimizer_temps
    flat_temps = 0.0 if fused_optimizer else ADAMW_TEMPORARIES
    if z == 0:
        fb = PhaseMemory("forward_backward", w * P, g * P, o * P, 0.0 * P)
        out = [fb]
        if D > 1:
            out.append(PhaseMemory("grad_sync", w * P, g * P, o * P, g * P))
        out.append(PhaseMemory("optimizer_step", w * P, (4.0 if mixed else g) * P, o * P, temp + 0.0 * P))
        return out
    if z == 1 and zero_optimizer == "zero_redundancy":
        opt = o * P / D
        return [PhaseMemory("forward_backward", w * P, g * P, opt, 0.0 * P),
                PhaseMemory("optimizer_step", w * P, g * P, opt, ADAMW_TEMPORARIES * 4.0 * P / D)]
    if z in (1, 2):
        opt = (o if mixed else o + 4.0) * P / D
        return [PhaseMemory("forward_backward", w * P, g * P, opt, 0.0 * P),
                # the flat buffer is allocated while every gradient is alive (`zero._zero12_step`)
                PhaseMemory("grad_sync", w * P, g * P, opt, g * P),
                PhaseMemory("grad_sync", w * P, 0.0 * P, opt, g * P * (2 if rs_copies_input else 1) + g * P / D),
                PhaseMemory("optimizer_step", w * P, 4.0 * P / D, opt, flat_temps * 4.0 * P / D),
                PhaseMemory("grad_sync", w * P, 0.0 * P, opt, w * P + w * P / D)]
    # ZeRO 3
    grads = g * P if num_microbatches > 1 and not reduce_every_microbatch else 4.0 * P / D
    opt = (o if mixed else o + 4.0) * P / D
    if own:     # FSDP's 2-byte shards are the weights the optimizer steps, its moments beside them
        return [PhaseMemory("forward_backward", w * gathered_params + w * P / D, grads, o * P / D,
                            w * prefetch_params + 0.0 * P),
                PhaseMemory("optimizer_step", w * P / D, g * P / D, o * P / D, temp / D)]
    if not mixed:   # FSDP's fp32 shards are the weights (and the masters): weights, not optimizer
        opt = o * P / D
        return [PhaseMemory("forward_backward", w * gathered_params + 4.0 * P / D, grads, opt,
                            w * prefetch_params + 0.0 * P),
                PhaseMemory("optimizer_step", 4.0 * P / D, 4.0 * P / D, opt, temp / D)]
    return [PhaseMemory("forward_backward", w * gathered_params, grads, opt,
                        w * prefetch_params + 0.0 * P),
            PhaseMemory("optimizer_step", 0.0 * P, 4.0 * P / D, opt, temp / D)]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one device: the phase of the step where it is reached and its parts."""

    model_states: ModelStates
    activations: float       # saved activations of the micro-batches in flight
    working: float           # transient: a recomputed layer, the runtime's buffers
    capacity: float
    phase: str = "forward_backward"

    @property
    def peak(self) -> float:
        return self.model_states.total + self.activations + self.working

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity


# What a plan may fill of a device (issue 14: was a flat 92%, an estimate). Hardware terms, per
# device (`DeviceSpec`): what the driver keeps of the device's memory (`driver_reserved_bytes`) and
# the NCCL channels its node's topology gets (`collective_channels`). Software terms, per stack
# (`SoftwareSpec`, each sourced in software_profiles/autopar.yaml): the CUDA context with its loaded
# kernels, the math libraries' workspaces, NCCL's buffers per channel, and the caching allocator's
# fragmentation (an estimate). `SoftwareSpec.usable_fraction` overrides them all with a flat share.


@dataclass(frozen=True)
class UsableMemory:
    """The bytes a plan may fill of a device, term by term (`usable_memory_terms`)."""

    capacity: float          # DeviceSpec.memory_bytes
    addressable: float       # what CUDA reports: capacity less DeviceSpec.driver_reserved_bytes
    context: float           # the CUDA context and its kernels (CUDA devices)
    workspace: float         # cuBLAS/cuBLASLt workspaces (CUDA devices)
    collective: float        # NCCL's buffers: channels x bytes a channel, one communicator
    fragmentation: float     # the allocator's share held by no tensor at the peak
    usable: float
    override: Optional[float] = None   # SoftwareSpec.usable_fraction, when set

    def summary(self) -> str:
        """One line: the terms in GiB."""
        g = 2 ** 30
        if self.override is not None:
            return f"{self.usable / g:.2f} GiB usable: {self.override:g} of {self.capacity / g:.2f} GiB (override)"
        return (f"{self.usable / g:.2f} GiB usable of {self.capacity / g:.2f} GiB: the device reports "
                f"{self.addressable / g:.2f}, less context {self.context / g:.2f}, library workspaces "
                f"{self.workspace / g:.2f}, NCCL buffers {self.collective / g:.2f}, fragmentation "
                f"{self.fragmentation / g:.2f}")


def _default_software():
    from autopar.schema.software import resolve_software

    return resolve_software(None)


def usable_memory_terms(device: DeviceSpec, software=None) -> UsableMemory:
    """What a plan may fill of `device` under `software` (a SoftwareSpec; None: the default
    preset), term by term: the memory CUDA reports for the device, less (CUDA devices) one
    process's CUDA context and library workspaces and one communicator's NCCL buffers
    (`device.collective_channels` x `software.collective_buffer_bytes_per_channel`), the rest
    times 1 - `software.allocator_fragmentation`. `software.usable_fraction`, when set, is the
    share of `device.memory_bytes` instead."""
    sw = software if software is not None else _default_software()
    cap = float(device.memory_bytes)
    if sw.usable_fraction is not None:
        u = cap * sw.usable_fraction
        return UsableMemory(cap, cap, 0.0, 0.0, 0.0, 0.0, u, override=sw.usable_fraction)
    addr = max(cap - float(device.driver_reserved_bytes), 0.0)
    cuda = device.device_type == "cuda"
    ctx = sw.cuda_context_bytes if cuda else 0.0
    ws = sw.library_workspace_bytes if cuda else 0.0
    coll = (device.collective_channels or 0) * sw.collective_buffer_bytes_per_channel if cuda else 0.0
    pool = max(addr - ctx - ws - coll, 0.0)
    frag = pool * sw.allocator_fragmentation
    return UsableMemory(cap, addr, ctx, ws, coll, frag, pool - frag)


def usable_memory(device: DeviceSpec, software=None) -> float:
    """Bytes of `device` memory a plan may fill under `software` (`usable_memory_terms`)."""
    return usable_memory_terms(device, software).usable


def peak_memory(num_params: float, activation_bytes: float, device: DeviceSpec, *,
                schedule: ScheduleName | str = "1f1b", num_stages: int = 1, stage: int = 0,
                num_microbatches: int = 1, virtual_stages: int = 1, policy: str = "bf16",
                zero_stage: int = 0, dp: int = 1, working_bytes: float = 0.0,
                gathered_params: float = 0.0, software=None) -> MemoryBreakdown:
    """Peak bytes per device of a pipeline stage: the largest phase of `runtime_phases` for its
    `num_params` parameters (per device, after tensor parallelism), with `activation_bytes` of
    one micro-batch of the stage times the micro-batches in flight plus `working_bytes` held in
    the forward/backward phase; against `usable_memory(device, software)`."""
    n = inflight_microbatches(schedule, num_stages, stage, num_microbatches, virtual_stages)
    phases = runtime_phases(num_params, policy, zero_stage, dp, num_microbatches=num_microbatches,
                            gathered_params=gathered_params, fused_optimizer=fused_optimizer(device.device_type))
    acts = activation_bytes * n
    best = max(phases, key=lambda ph: ph.total + (acts + working_bytes if ph.phase == "forward_backward" else 0))
    on = best.phase == "forward_backward"
    return MemoryBreakdown(ModelStates(best.weights, best.gradients, best.optimizer),
                           acts if on else 0.0, (working_bytes if on else 0.0) + best.buffers,
                           usable_memory(device, software), phase=best.phase)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                            recompute: Literal["none", "selective", "full"] = "none",
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
