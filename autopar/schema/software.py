"""What the software does, apart from the hardware it runs on (design.md, "Hardware apart from
software").

A hardware profile (`autopar.schema.cluster`) describes devices and links. A `SoftwareSpec`
describes choices of the training software that change what the same hardware does with the
same plan, and that the cost model honours:

- `attention_kernel`: "fused" (FlashAttention-style, what torch's scaled_dot_product_attention
  runs: the s x s scores are never stored, the backward recomputes them) or "unfused" (QK^T and
  PV as batched GEMMs around a softmax that reads and writes the scores, which the backward keeps:
  Megatron-LM 2021). Time: `cost_models.compute.attention_time`; memory:
  `cost_models.memory.saved_tensors`.
- `attention_flops`: the measured rates of the software's own fused attention kernel on named
  devices (device name -> dtype -> points, as `DeviceSpec.attention_flops`), where it runs a
  kernel other than the one a hardware profile measured (FlashAttention-1 where the profile holds
  FlashAttention-2's): on a device named there they replace the profile's rates
  (`SoftwareSpec.on_cluster`). Time: `cost_models.compute.attention_rates`.
- `pointwise_fusion`: "eager" (every element-wise op its own kernel that reads its inputs from
  memory and writes its output: eager PyTorch, what `autopar run` executes) or "fused" (a
  maximal chain of element-wise ops between other ops runs as one kernel that reads the chain's
  inputs once and writes what leaves it once: torch.compile's Inductor, Megatron's fused
  bias-GELU kernels) or "norm_moe" (only the modules the software's libraries fuse: each
  RMSNorm / LayerNorm module one kernel (Transformer Engine's RMSNorm), and an expert block's
  gathers into expert order, activation, weighting and sum back as fused kernels moving the
  group's boundary (Megatron-Core's fused permutation and weighted SwiGLU); every other
  element-wise op eager) or "norm" (each norm module one kernel, every other element-wise op
  eager: Megatron-Core with Transformer Engine's norm kernels and no fused MoE permutation).
  Time: `cost_models.fusion` (through `cost_models.compute.node_time`).
  Memory stays eager's: what eager autograd saves (an upper bound under Inductor, whose
  partitioner recomputes element-wise ops in the backward instead of saving them); what a fused
  norm kernel saves is `norm_saves`, a fused expert block's `expert_saves`.
- `mixed_precision`: how a bf16/fp16 run keeps its tensors. "autocast" (torch.autocast around a
  model whose parameters are the 2-byte dtype, what `autopar run` executes, also PyTorch
  Lightning's and nanoGPT's): the ops on autocast's fp32 list (CUDA: layer norm, softmax, exp,
  pow, ...) read an fp32 copy of their input and write fp32 outputs, and what type promotion makes
  fp32 from them stays fp32 up to the next matrix op. "half" (the whole model cast to the 2-byte
  dtype, Megatron-LM's Float16Module with its fused layer-norm and scale-mask-softmax kernels,
  which compute in fp32 inside and write the 2-byte dtype): every op writes the training dtype,
  except what the model's code upcasts itself (`x.float()`) and the loss (fp32 in both). Memory:
  `cost_models.memory.activation_memory`; time: `cost_models.memory.graph_fp32_tensors` (the
  bytes an op moves, `cost_models.compute.node_time`).
- `loss_kernel`: "eager" (the cross-entropy as the model writes it: its fp32 upcast of the
  logits, `log_softmax` saving its fp32 output, fp32 gradients of the logits' size in the
  backward; what `autopar run` executes) or "fused" (one kernel reading the 2-byte logits,
  saving them and a log-sum-exp per row, writing their gradient in place: apex's xentropy as the
  flash-attn training stack runs it, flash-attn's Triton cross-entropy) or "half" (the eager
  cross-entropy on the 2-byte logits, not upcast: `log_softmax` writing and saving 2-byte
  log-probabilities, the backward's gradients 2-byte; NeMo AutoModel's `MaskedCrossEntropy` with
  `fp32_upcast: false`). Time and memory: `cost_models.fused_loss` (the captured graph rewritten
  as the software runs it).
- `param_dtype`: the dtype a mixed-precision run keeps its parameters in. "training" (the
  2-byte training dtype, fp32 masters in the optimizer: what `autopar run` executes, also
  Megatron-LM) or "fp32" (the parameters stay fp32 under autocast: PyTorch Lightning's
  `precision: bf16` / `16`, torch AMP's recipe). fp32 parameters cost every micro-batch a cast of
  each weight to the 2-byte dtype in the forward and of its gradient back to fp32 in the backward
  (`cost_models.compute.param_cast_bytes`), which the matrix ops save for the backward (2 bytes a
  parameter per micro-batch in flight, `param_cast_saved_bytes`); gradients are accumulated,
  all-reduced and (ZeRO) gathered at 4 bytes, and the optimizer steps the fp32 parameters
  themselves (model states 4 + 4 + 8 bytes a parameter: `state_policy`). Time:
  `autopar.inter_op.search` (`_Tables.accum`, the sync); memory: `_Tables.phases`, the
  activations.
- `zero_optimizer`: how a ZeRO-1 run shards its optimizer. "flat" (what `autopar run` executes:
  the gradients reduce-scattered out of one flat buffer, each rank stepping one flat fp32 shard,
  with fp32 parameters a copy of them, and all-gathering the weights) or "zero_redundancy"
  (torch's ZeroRedundancyOptimizer under DDP, the flash-attn training stack: DDP all-reduces the
  gradients in its buckets, which are the gradients, and each rank's optimizer steps its
  partition's parameter tensors in place and broadcasts them: only the optimizer's moments are
  sharded, no flat buffer, no fp32 copy). Memory: `cost_models.memory.runtime_phases`.
- `loss_scaling`: what an fp16 run does with its loss. "none" (what `autopar run` executes: no
  scaling) or "dynamic" (dynamic loss scaling, torch's `GradScaler` under PyTorch Lightning's
  `precision: 16`, Megatron-LM's `DynamicGradScaler` under `--fp16`): once a step, before the
  optimizer, every gradient the optimizer steps is unscaled and checked for inf/NaN in one pass
  (`torch._amp_foreach_non_finite_check_and_unscale_`), which reads and writes each fp32 gradient
  (8 bytes an element: `cost_models.compute.loss_scaling_bytes`); a bf16 or fp32 run scales
  nothing whatever the field says. Time: `autopar.inter_op.search` (`_Tables.opt`, the step's
  tail).
- `grad_sync_overlap`: whether the data-parallel gradient sync of a stage runs during the backward
  of its last micro-batch (bucketed all-reduce as PyTorch DDP or Megatron-Core's
  --overlap-grad-reduce do it) instead of after it. Time: `autopar.inter_op.search` (the
  per-iteration tail).
- `gradient_accumulation_fusion`: whether the weight-gradient GEMM of each linear adds its result
  into the gradient kept across micro-batches (cuBLAS with beta = 1 into Megatron's `main_grad`:
  Transformer Engine's `fuse_wgrad_accumulation`, Megatron-Core's `--no-gradient-accumulation-
  fusion` off, NeMo's `gradient_accumulation_fusion: true`) instead of writing a fresh gradient
  that a separate pass adds into the kept one (autograd's `.grad` accumulation, what `autopar run`
  executes: `grad_accumulation_bytes` a parameter every micro-batch after the first). Time:
  `autopar.inter_op.search` (`_Tables.accum`; the GEMM's own read of the kept gradient is not
  charged: a transformer's weight-gradient GEMMs are compute-bound). ZeRO-3 reducing every
  micro-batch still adds each reduce-scattered shard into the kept one.
- `tp_comm_overlap`: the tensor-parallel collectives of Megatron-SP's linears run beside the GEMMs
  that read or make them (Transformer Engine's userbuffers, `ub_tp_comm_overlap` with its
  `ub_tp_comm_overlap_cfg`), per GEMM of a transformer layer's attention and MLP blocks (`UbGemm`:
  qkv / proj, fc1 / fc2, as TE names them) with its method and SMs (`UbOverlap`); empty: every tp
  collective waited (what `autopar run` executes). Priced on the ILP's solution with sequence
  parallelism: a layer's k-th forward all-gather into column-parallel linears followed by a
  reduce-scatter out of a row-parallel one is its k-th block (qkv / proj first, fc1 / fc2 after);
  a gathered tensor read by no such pair (the LM head's, an expert block's) stays waited. Time:
  `autopar.inter_op.tp_overlap`, `cost_models.tp_overlap`.
- `param_sync_overlap`: whether ZeRO-1/2's all-gather of the updated weights runs beside the next
  step's forward (apex's DistributedFusedAdam `overlap_param_sync`, as NeMo's distributed_fused_adam
  runs it; Megatron-Core's `--overlap-param-gather`) instead of after the optimizer step: with one
  chunk a stage waits for what exceeds its first micro-batch's forward (apex gathers bucket by
  bucket as the forward reaches them), under the interleaved schedule for its first chunk's share
  and what of each later chunk's exceeds the previous chunk's warm-up forwards (Megatron-Core
  launches a chunk's gather one chunk ahead): an estimate of those chains. Time:
  `autopar.inter_op.search` (the per-iteration tail, `_exposed_param_gather`).
- `pipeline_send_overlap`: the pipeline schedules (as the runtime executes them: 1F1B with fewer
  micro-batches than stages runs as GPipe, interleaving with one chunk as 1F1B) whose point-to-
  point sends run beside the compute instead of being waited before the next op. Waited (the
  schedules not listed): a stage pays each boundary's transfer in full per micro-batch (Megatron-LM
  2021's `_communicate`: `batch_isend_irecv`, every request waited, then `torch.cuda.synchronize()`;
  torch 2.13's `Schedule1F1B`, whose steady state fuses a send with the next op's receive and
  waits both before that op; its lock-step interleaved runner, which waits each time step's sends
  and receives in that step). Beside the compute: a transfer is paid only beyond the compute it
  runs beside, max(0, transfer - window) per direction and micro-batch, the window the stage's
  (chunk's) own forward or backward time, recomputation left out: for "gpipe" a forward send
  beside the next micro-batch's forward and a gradient send beside the next backward (torch's
  `ScheduleGPipe` waits its sends only after all forwards, then all backwards; a receive is
  waited just before the op that reads it, by then in flight one op long); for "1f1b" and
  "interleaved_1f1b" a forward send beside the backward that follows it and a gradient send
  beside the next forward (Megatron-Core's `--overlap-p2p-communication`, on by default and
  interleaved only: `forward_backward_pipelining_with_interleaving` posts `send_forward_recv_
  forward` after a chunk's forward and waits its handles before the next forward, after the
  backward ran). Time: `autopar.inter_op.search` (`_Tables.stage_p2p`).
- `pipeline_send_split`: whether each tp rank of a stage sends only its 1/tp of a boundary's
  tensors, which the receiving stage all-gathers over its tp ranks (Megatron-LM 2021's
  scatter/gather optimization, Narayanan et al. 2021 §4.1: `--no-scatter-gather-tensors-in-
  pipeline` off by default, `split_tensor_into_1d_equal_chunks` before the transfer,
  `gather_split_1d_tensor` after it), instead of every rank sending the whole replicated tensor
  (what `autopar run` executes, `runtime.pipeline_p2p`). Not applied under Megatron-SP, whose
  residual stream already crosses split. Time: `autopar.inter_op.search` (`_Tables.stage_p2p`).
- `zero3_overlap`: whether ZeRO-3's per-unit all-gathers and reduce-scatters run on their own
  streams beside the compute (the next unit's gather prefetched while a unit computes, a unit's
  gradients reduce-scattered while the next one's backward runs: PyTorch FSDP2 on NCCL,
  Megatron-FSDP with --overlap-param-gather and --overlap-grad-reduce) instead of between the
  units' kernels. Time: `autopar.inter_op.search` (`_Tables.exposed_zero`: a micro-batch pays
  the part of its ZeRO-3 collectives beyond its forward and backward compute, and beyond its
  layers' own collective waits where those stay inside a node and ZeRO-3's groups span nodes:
  `_zero3_links_apart`).
- `optimizer_states`: what the optimizer keeps beside 2-byte parameters. "fp32" (fp32 master
  weights and fp32 moments, 12 bytes a parameter: what `autopar run` executes, Megatron-LM) or
  "param" (no master: the optimizer steps the parameters themselves, its moments in their
  dtype, 4 bytes a parameter under Adam; torch.optim.Adam on a model cast to bf16, NeMo
  AutoModel). Memory: `cost_models.memory.PRECISION_POLICIES` (`state_policy`); time: the
  optimizer step's bytes.
- `expert_dispatch`: how expert parallelism's all-to-all carries the tokens. "pairs" (what
  `autopar run` executes, `autopar.runtime.experts`: one row per token-expert pair, a token sent
  once for each of its top-k experts, the combine returning as many rows) or "ranks" (DeepEP's
  normal kernels: a token sent once to each rank holding any of its experts,
  `get_dispatch_layout`'s `is_token_in_rank`, and its rows on that rank summed before the combine
  returns one: one flat exchange over the ep group) or "nodes" (DeepEP's normal kernels across
  nodes, `internode.cu`: a token crosses the network once to each node holding any of its experts,
  to the rank of its own local index there, and that rank forwards it over NVLink to each rank of
  the node holding any, the two stages running at once in one kernel; the combine the reverse,
  the rows summed in the node before the network; an ep group inside one node as "ranks"). Time:
  `autopar.inter_op.experts` (the exchange's bytes and links); memory: DeepEP's buffers under
  "ranks" / "nodes" (`ExpertCosting.comm_buffer_bytes`, a buffer in every phase).
- `expert_routing`: which experts the tokens go to, as the costs assume it. "router" (the model's
  own router, what `autopar run` executes: the most-loaded rank takes `EP_IMBALANCE` times the
  mean pairs, an estimate, and a token's experts fall at random over the ranks) or
  "fake_balanced" (NeMo AutoModel's `FakeBalancedGate`, a benchmark setting: token t goes to
  experts (k t + j) mod E, j < k: every expert the same pairs, no imbalance, and the ranks a
  token reaches follow from that rule) or "forced_balance" (Megatron-Core's
  --moe-router-force-load-balancing, a benchmark setting: the router's logits replaced by random
  ones, `apply_random_logits` in megatron/core/transformer/moe/router.py: a token's experts drawn
  at random, every expert the same pairs in expectation, so no imbalance is charged, and the
  ranks a token reaches as for experts at random). Time: `autopar.inter_op.experts`.
- `expert_saves`: what a routed expert block keeps for its backward under expert parallelism.
  "runtime" (what `autopar run` executes, `autopar.runtime.experts`: the model's own experts module
  run on the received rows, the rows sent back multiplied by their top-k weights and summed into
  the tokens by the exchange, which keeps them: `ExpertCosting.combine_saved`) or "megatron_core"
  (Megatron-Core's TEGroupedMLP with `--moe-permute-fusion`, since github.com/NVIDIA/Megatron-LM
  2659630721, 2025-04-09, "Memory efficient token permutation": the routing probabilities applied
  inside the (weighted) SwiGLU, `weighted_bias_swiglu_impl`, so nothing keeps the output
  projection's output; Transformer Engine's fused `moe_permute` / `moe_unpermute` without probs
  and the chunk sorts saving only their int64 row maps; the block keeps the permuted rows (the
  first grouped GEMM's input), the input projections' outputs (the SwiGLU's input), the fp32
  probabilities and the output projection's input: `ExpertCosting.megatron_saved`). Memory:
  `autopar.inter_op.experts` (a layer's activation bytes with ep > 1).
- `norm_saves`: what a norm module written as several ops (Hugging Face's RMSNorm: an fp32
  upcast, pow, mean, rsqrt, products) keeps for its backward. "eager" (what `autopar run`
  executes: what autograd saves of each op, the fp32 copy of the input and the normalised output
  among them) or "input" (the module one norm kernel saving its input and an fp32 statistic a
  row: Transformer Engine's RMSNorm, `save_for_backward(x, rstdevs)`, as Megatron-Core's TE layer
  spec runs every norm, the q/k norms included). Memory: `cost_models.memory.norm_kernel_modules`.
- `grad_dtype`: the dtype a mixed-precision run accumulates and reduces its gradients in.
  "param" (the parameters' training dtype: what `autopar run` executes) or "fp32" (every gradient
  accumulated, reduced and stepped in fp32: Megatron-Core's DDP and distributed optimizer keep one
  fp32 `main_grad` buffer under --bf16, `grad_reduce_in_fp32`, whatever the ZeRO stage; model
  states 2 + 4 + 12 bytes a parameter, the sync moving 4) or "fp32_reduce" (PyTorch FSDP2's
  `MixedPrecisionPolicy(reduce_dtype=float32)`, ZeRO-3 only: the FSDP units' gradients, kept
  unsharded over several micro-batches, accumulate in fp32 and are reduce-scattered in fp32, the
  shard cast back to the parameters' dtype; experts outside that policy keep theirs: NeMo
  AutoModel). Memory: `cost_models.memory.PRECISION_POLICIES` ("fp32": `state_policy`),
  `autopar.inter_op.search._Tables.phases` ("fp32_reduce"); time: the sync's and the
  accumulation's bytes.
- `sp_linear_saves`: what a linear layer reading a sequence-parallel input all-gathered over tp
  keeps for its weight gradient (Megatron-SP). "gathered" (what `autopar run` executes: the
  executor's all-gathered copy, saved) or "shard" (the input shard as it arrived, all-gathered
  again in the backward: Megatron-Core's and Transformer Engine's column-parallel linears).
  Memory: `autopar.inter_op.ilp_provider._read_shard` (the gather below autograd); time: the
  backward's gather is not priced (Transformer Engine runs it beside the input-gradient GEMM).

Every field changes a prediction; a choice the cost model cannot honour has no field here.
Named presets live in `software_profiles/` (YAML, each field with its source); the default,
`autopar`, is what `autopar run` executes. A plan records the software it was made for
(`Plan.software`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from autopar.schema.cluster import AttentionPoint
from autopar.schema.constraints import Schedule
from autopar.schema.errors import PlanError
from autopar.schema.files import read_mapping

AttentionKernel = Literal["fused", "unfused"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)
PointwiseFusion = Literal["eager", "fused", "norm_moe", "norm"]
POINTWISE_FUSIONS: tuple[str, ...] = get_args(PointwiseFusion)
MixedPrecision = Literal["autocast", "half"]
MIXED_PRECISIONS: tuple[str, ...] = get_args(MixedPrecision)
LossKernel = Literal["eager", "fused", "half"]
LOSS_KERNELS: tuple[str, ...] = get_args(LossKernel)
ParamDtype = Literal["training", "fp32"]
PARAM_DTYPES: tuple[str, ...] = get_args(ParamDtype)
LossScaling = Literal["none", "dynamic"]
LOSS_SCALINGS: tuple[str, ...] = get_args(LossScaling)
ZeroOptimizer = Literal["flat", "zero_redundancy"]
ZERO_OPTIMIZERS: tuple[str, ...] = get_args(ZeroOptimizer)
OptimizerStates = Literal["fp32", "param"]
OPTIMIZER_STATES: tuple[str, ...] = get_args(OptimizerStates)
ExpertDispatch = Literal["pairs", "ranks", "nodes"]
EXPERT_DISPATCHES: tuple[str, ...] = get_args(ExpertDispatch)
ExpertRouting = Literal["router", "fake_balanced", "forced_balance"]
EXPERT_ROUTINGS: tuple[str, ...] = get_args(ExpertRouting)
ExpertSaves = Literal["runtime", "megatron_core"]
EXPERT_SAVES: tuple[str, ...] = get_args(ExpertSaves)
NormSaves = Literal["eager", "input"]
NORM_SAVES: tuple[str, ...] = get_args(NormSaves)
# the GEMMs of a transformer layer's tensor-parallel blocks Transformer Engine's userbuffers overlap
# (`initialize_ub`'s names): qkv / proj the attention block's column- and row-parallel linears, fc1 / fc2
# the MLP's; fprop the forward GEMM, dgrad / wgrad the backward's input- and weight-gradient GEMMs
UbGemm = Literal["qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad",
                 "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad"]
UB_GEMMS: tuple[str, ...] = get_args(UbGemm)
UbMethod = Literal["bulk", "ring_exchange", "pipeline"]
UB_METHODS: tuple[str, ...] = get_args(UbMethod)
# the methods each GEMM's collective can be overlapped by, as `cost_models.tp_overlap` prices them:
# a forward all-gather or a row-parallel dgrad's all-gather by the ring exchange (TE refuses
# "pipeline" for an all-gather), a row-parallel forward's reduce-scatter by either split method, the
# column-parallel backward's collectives in bulk (TE's other dgrad reduce-scatter variant not modelled)
UB_ALLOWED: dict[str, tuple[str, ...]] = {
    **{g: ("ring_exchange",) for g in ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad")},
    **{g: ("pipeline", "ring_exchange") for g in ("proj_fprop", "fc2_fprop")},
    **{g: ("bulk",) for g in ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad")}}


class UbOverlap(BaseModel):
    """How one GEMM's tensor-parallel collective is overlapped with it (one entry of Transformer
    Engine's `ub_cfgs`, `initialize_ub`; the defaults are its `get_default_config`'s)."""

    model_config = ConfigDict(extra="forbid")

    method: UbMethod = Field(description="bulk: the whole collective beside the GEMM; pipeline: the GEMM in "
                             "num_splits chunks, each chunk's reduce-scatter beside the next; ring_exchange: "
                             "point-to-point shard exchanges on the copy engines beside per-shard GEMMs")
    num_sm: int = Field(default=16, ge=0, description="SMs the communication kernel runs on (bulk, pipeline)")
    set_sm_margin: bool = Field(default=False, description="the GEMM runs on the device's other SMs only")
    num_splits: int = Field(default=4, ge=1, description="a pipeline overlap's GEMM chunks")
    aggregate: bool = Field(default=False, description="a ring exchange moves two shards a step")


GradDtype = Literal["param", "fp32", "fp32_reduce"]
GRAD_DTYPES: tuple[str, ...] = get_args(GradDtype)
SpLinearSaves = Literal["gathered", "shard"]
SP_LINEAR_SAVES: tuple[str, ...] = get_args(SpLinearSaves)

# the choices `autopar run` executes as the default preset has them: a plan whose software differs in
# any of them predicts another software's run (the CLI says so, `cli._software_note`)
RUNTIME_CHOICES: tuple[str, ...] = ("attention_kernel", "pointwise_fusion", "mixed_precision", "loss_kernel",
                                    "param_dtype", "zero_optimizer", "grad_sync_overlap", "zero3_overlap",
                                    "optimizer_states", "expert_dispatch", "expert_routing", "expert_saves",
                                    "norm_saves", "grad_dtype", "sp_linear_saves", "loss_scaling",
                                    "pipeline_send_overlap", "pipeline_send_split", "gradient_accumulation_fusion",
                                    "tp_comm_overlap", "param_sync_overlap")

# the choices a dump leaves out at their defaults (`SoftwareSpec._omit_eager_fusion`): each added
# after plans were first written, so a plan of the default software reads and digests as before
OMITTED_AT_DEFAULT: tuple[str, ...] = ("pointwise_fusion", "mixed_precision", "loss_kernel", "param_dtype",
                                       "zero_optimizer", "zero3_overlap", "loss_scaling", "pipeline_send_overlap",
                                       "pipeline_send_split", "attention_head_dims", "expert_dispatch",
                                       "expert_routing", "expert_saves", "norm_saves", "grad_dtype",
                                       "sp_linear_saves", "optimizer_states", "gradient_accumulation_fusion",
                                       "tp_comm_overlap", "param_sync_overlap")

# the memory a plan may not fill, per software stack (`cost_models.memory.usable_memory`); omitted
# from a dump at their defaults
MEMORY_TERM_FIELDS: tuple[str, ...] = ("cuda_context_bytes", "library_workspace_bytes",
                                       "collective_buffer_bytes_per_channel", "allocator_fragmentation",
                                       "usable_fraction")

# where the memory terms' defaults come from (every preset takes them; `usable_memory_terms`)
MEMORY_TERM_SOURCES: dict[str, str] = {
    "cuda_context_bytes": (
        "SoftwareSpec's default (the autopar stack): 0.76 GiB, what the device had in use beyond the caching "
        "allocator's reserve in each of the 5 cases autopar ran on one H100 80GB (torch 2.11+cu130, one process, "
        "no NCCL): 52.31 - 51.55, 60.00 - 59.24, 71.93 - 71.17, 52.72 - 51.96, 76.75 - 75.99 GiB "
        "(benchmarks/results/h100-2026-11-25/profiles/*.txt, first lines); transferred to other devices (the "
        "context's per-thread local memory scales with the SM count: an estimate there). The flash-attn "
        "presets (torch 1.13) set their own"),
    "library_workspace_bytes": (
        "SoftwareSpec's default, every preset: 32 MiB, the cuBLAS workspace cuBLAS recommends for Hopper (4 "
        "MiB before; cuBLAS docs, cublasSetWorkspace), one handle: the larger, counted on every GPU (torch "
        "takes it from its caching allocator: beside the plan's tensors)"),
    "collective_buffer_bytes_per_channel": (
        "SoftwareSpec's default, every preset: NCCL's default FIFOs per channel and connection, SIMPLE 4 MiB "
        "(DEFAULT_BUFFSIZE), LL128 4,915,200 B and LL 524,288 B (DEFAULT_LL128_BUFFSIZE, DEFAULT_LL_BUFFSIZE, "
        "src/init.cc), 9,633,792 B, allocated in 2 MiB granules: 10 MiB (the 10485760-byte buffers of NCCL's "
        "ALLOC log, github.com/NVIDIA/nccl issue 1685); one ring connection a channel on one communicator "
        "(sjeaugey, nccl issue 864: ring uses two connections whatever the scale, memory linear in channels); "
        "a layout's further process groups (tp, pp) are not counted"),
    "allocator_fragmentation": (
        "SoftwareSpec's default, every preset: 0.05, the median share of the caching allocator's reserve that "
        "no tensor held at the peak in the 5 cases autopar ran on one H100 80GB (max reserved against max "
        "allocated: 1.21 of 51.55, 2.95 of 59.24, 4.12 of 71.17, 1.25 of 51.96, 5.94 of 75.99 GiB: 2.3% to "
        "7.8%, the most at the fullest plans; benchmarks/results/h100-2026-11-25/profiles/*.txt). Measured "
        "for autopar's runtime on that device; for other stacks and devices an estimate. Sensitivity: "
        "README, 'usable memory'"),
}

# the preset that describes what `autopar run` executes: the default of `autopar.plan`
DEFAULT_SOFTWARE = "autopar"


class SoftwareSpec(BaseModel):
    """The training software a plan's predictions assume (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="a bundled preset's name, or the file's")
    description: str = ""
    attention_kernel: AttentionKernel = Field(
        default="fused", description="fused: FlashAttention-style, scores never stored (torch SDPA); "
        "unfused: QK^T and PV batched GEMMs around a softmax over stored scores (Megatron-LM 2021)")
    pointwise_fusion: PointwiseFusion = Field(
        default="eager", description="eager: every element-wise op its own kernel (eager PyTorch, what autopar "
        "run executes); fused: a chain of element-wise ops between other ops runs as one kernel reading the "
        "chain's inputs once and writing what leaves it once (torch.compile / Inductor, Megatron's fused "
        "bias-GELU); norm_moe: only norm modules and an expert block's routing and activation ops fused, as "
        "Transformer Engine and Megatron-Core's MoE kernels run them; norm: only norm modules fused (Transformer "
        "Engine's norm kernels); time only: the activation memory stays "
        "eager autograd's (an upper bound under Inductor, which recomputes element-wise ops in the backward)")
    mixed_precision: MixedPrecision = Field(
        default="autocast", description="autocast: torch.autocast over 2-byte parameters (what autopar run "
        "executes): autocast's fp32 ops (CUDA: layer norm, softmax, ...) write fp32 tensors; half: the model "
        "cast to the 2-byte dtype (Megatron-LM's Float16Module, fused norm and softmax kernels writing it): only "
        "the model's own upcasts and the loss are fp32")
    loss_kernel: LossKernel = Field(
        default="eager", description="eager: the cross-entropy as the model writes it (fp32 upcast, log_softmax "
        "saving fp32, fp32 gradients; what autopar run executes); fused: one kernel reading the 2-byte logits, "
        "saving them and a log-sum-exp per row, writing their gradient in place (apex xentropy, flash-attn); "
        "half: the eager cross-entropy on the 2-byte logits, no upcast, its tensors 2-byte (NeMo AutoModel's "
        "MaskedCrossEntropy fp32_upcast false)")
    param_dtype: ParamDtype = Field(
        default="training", description="training: a mixed-precision run keeps its parameters in the 2-byte "
        "training dtype, fp32 masters in the optimizer (what autopar run executes, Megatron-LM); fp32: the "
        "parameters stay fp32 under autocast (PyTorch Lightning's precision bf16/16): every micro-batch casts "
        "each weight to the 2-byte dtype (saved for the backward) and its gradient back, gradients accumulate "
        "and sync at 4 bytes, the optimizer steps the fp32 parameters (needs mixed_precision autocast)")
    zero_optimizer: ZeroOptimizer = Field(
        default="flat", description="flat: ZeRO-1 reduce-scatters the gradients out of one flat buffer and "
        "steps one flat fp32 shard (with fp32 parameters a copy of them; what autopar run executes); "
        "zero_redundancy: torch's ZeroRedundancyOptimizer under DDP, each rank stepping its partition's "
        "parameter tensors in place (only the moments sharded, no flat buffer or copy)")
    loss_scaling: LossScaling = Field(
        default="none", description="none: an fp16 run scales no loss (what autopar run executes); dynamic: "
        "dynamic loss scaling (torch GradScaler under PyTorch Lightning's precision 16, Megatron-LM's --fp16): "
        "once a step every gradient the optimizer steps is unscaled and checked for inf/NaN, one pass reading "
        "and writing each fp32 gradient; bf16 and fp32 runs scale nothing")
    grad_sync_overlap: bool = Field(
        default=False, description="the data-parallel gradient sync runs during the last micro-batch's "
        "backward (bucketed, as PyTorch DDP or Megatron-Core --overlap-grad-reduce) instead of after it")
    gradient_accumulation_fusion: bool = Field(
        default=False, description="the weight-gradient GEMMs add into the gradients kept across micro-batches "
        "(Transformer Engine's fuse_wgrad_accumulation under Megatron-Core / NeMo gradient_accumulation_fusion): "
        "no separate accumulation pass per micro-batch; false: autograd writes each micro-batch's gradient and "
        "adds it into .grad (what autopar run executes)")
    param_sync_overlap: bool = Field(
        default=False, description="ZeRO-1/2's all-gather of the updated weights runs beside the next step's "
        "forward, bucket by bucket as the forward reaches them (apex DistributedFusedAdam overlap_param_sync, "
        "Megatron-Core --overlap-param-gather); false: after the optimizer step (what autopar run executes)")
    tp_comm_overlap: dict[UbGemm, UbOverlap] = Field(
        default_factory=dict, description="the tensor-parallel collectives of sequence-parallel linears "
        "overlapped with their GEMMs (Transformer Engine userbuffers, ub_tp_comm_overlap), per GEMM: "
        "qkv/proj the attention block's, fc1/fc2 the MLP's, fprop/dgrad/wgrad; empty: every tp "
        "collective waited (what autopar run executes)")
    pipeline_send_overlap: list[Schedule] = Field(
        default_factory=lambda: ["gpipe"], description="the pipeline schedules (as run: 1F1B with fewer "
        "micro-batches than stages runs as GPipe) whose point-to-point sends run beside the compute, paid only "
        "beyond it (gpipe: torch's ScheduleGPipe waits its sends at the end of each phase, what autopar run "
        "executes; interleaved_1f1b: Megatron-Core's --overlap-p2p-communication); the others' sends are waited "
        "before the next op and paid in full (torch's Schedule1F1B and interleaved runner, Megatron-LM 2021)")
    pipeline_send_split: bool = Field(
        default=False, description="each tp rank of a stage sends 1/tp of a pipeline boundary's tensors, the "
        "receiving stage all-gathers them over its tp ranks (Megatron-LM 2021's scatter/gather); false: every "
        "rank sends the whole replicated tensor (what autopar run executes)")
    zero3_overlap: bool = Field(
        default=False, description="ZeRO-3's per-unit all-gathers and reduce-scatters run on their own streams "
        "beside the compute (prefetched gathers, asynchronous reduce-scatters: FSDP2 on NCCL, Megatron-FSDP with "
        "--overlap-param-gather / --overlap-grad-reduce): a micro-batch pays what exceeds its compute")
    # what a plan may not fill of a device, per process of this stack (`cost_models.memory.
    # usable_memory_terms`; the device's own terms are DeviceSpec's): sources in MEMORY_TERM_SOURCES
    cuda_context_bytes: float = Field(
        default=816043786.0, ge=0, description="device memory each process's CUDA context and loaded "
        "kernels take outside the caching allocator (CUDA devices only)")
    library_workspace_bytes: float = Field(
        default=33554432.0, ge=0, description="the math libraries' workspaces outside the tensors a plan "
        "counts (cuBLAS/cuBLASLt, CUDA devices only)")
    collective_buffer_bytes_per_channel: float = Field(
        default=10485760.0, ge=0, description="device memory one NCCL channel's buffers take for a "
        "communicator (its protocols' FIFOs as allocated); times the device's collective_channels")
    allocator_fragmentation: float = Field(
        default=0.05, ge=0, lt=1, description="share of the memory the caching allocator holds that no "
        "tensor uses at the peak (fragmentation): a plan may fill the rest")
    usable_fraction: Optional[float] = Field(
        default=None, gt=0, le=1, description="when set, a plan may fill this share of the device's "
        "memory_bytes instead of what the terms above leave (an override, for sensitivity)")
    optimizer_states: OptimizerStates = Field(
        default="fp32", description="fp32: fp32 master weights and moments beside 2-byte parameters (what autopar "
        "run executes); param: no master, the optimizer steps the 2-byte parameters, its moments in their dtype "
        "(torch.optim.Adam on a model cast to bf16: NeMo AutoModel)")
    expert_dispatch: ExpertDispatch = Field(
        default="pairs", description="pairs: expert parallelism's all-to-all sends one row per token-expert pair "
        "and the combine returns as many (what autopar run executes); ranks: a token sent once to each rank "
        "holding any of its experts, its rows summed there before the combine returns one, one flat exchange; "
        "nodes: DeepEP's normal kernels across nodes, a token sent over the network once to each node holding any "
        "of its experts and forwarded there over NVLink to each rank holding any, the two stages at once (inside "
        "one node as ranks)")
    expert_routing: ExpertRouting = Field(
        default="router", description="router: the model's router (what autopar run executes; the most-loaded "
        "rank takes EP_IMBALANCE x the mean pairs, an estimate, a token's experts at random over the ranks); "
        "fake_balanced: NeMo AutoModel's FakeBalancedGate benchmark setting, token t to experts (k t + j) mod E: "
        "every expert the same pairs; forced_balance: Megatron-Core's --moe-router-force-load-balancing benchmark "
        "setting, random router logits: no imbalance, a token's experts at random over the ranks")
    expert_saves: ExpertSaves = Field(
        default="runtime", description="runtime: a routed expert block under expert parallelism keeps what "
        "autopar run's exchange keeps (the model's experts module on the received rows, the rows sent back "
        "weighted and summed by the exchange); megatron_core: what Megatron-Core's TEGroupedMLP with the fused "
        "permutation keeps (probabilities applied in the weighted SwiGLU, no output-projection output kept, "
        "int64 row maps in place of the permutations)")
    norm_saves: NormSaves = Field(
        default="eager", description="eager: each op of a norm module written as several ops saves what "
        "autograd saves (HF RMSNorm: the fp32 copy of its input, the normalised output; what autopar run "
        "executes); input: the module saves its input and an fp32 statistic a row, as one norm kernel does "
        "(Transformer Engine's RMSNorm)")
    grad_dtype: GradDtype = Field(
        default="param", description="param: a mixed-precision run accumulates and reduces its gradients in "
        "the parameters' dtype (what autopar run executes); fp32: every gradient in fp32 through the step "
        "(Megatron-Core's fp32 main_grad buffer under --bf16); fp32_reduce: FSDP2's reduce_dtype float32 "
        "(ZeRO-3): the FSDP units' unsharded gradients accumulated and reduce-scattered in fp32, the shard in "
        "the parameters' dtype (NeMo AutoModel)")
    sp_linear_saves: SpLinearSaves = Field(
        default="gathered", description="gathered: a linear reading a sequence-parallel input all-gathered "
        "over tp saves the gathered copy (what autopar run executes); shard: it saves the shard as it arrived "
        "and all-gathers it again in the backward (Megatron-Core / Transformer Engine)")
    attention_flops: dict[str, dict[str, list[AttentionPoint]]] = Field(
        default_factory=dict, description="the software's fused attention kernel measured on named devices "
        "(DeviceSpec.name -> dtype -> points, as DeviceSpec.attention_flops); on a device named here they "
        "replace the hardware profile's rates, which describe another kernel")
    attention_head_dims: list[int] = Field(
        default_factory=list, description="the head dimensions this software's own fused attention kernel "
        "(attention_flops) is compiled for; with its rates they replace the device's "
        "(DeviceSpec.attention_head_dims)")
    sources: dict[str, str] = Field(default_factory=dict, description="field name -> where it comes from")

    @model_validator(mode="after")
    def _fp32_params_need_autocast(self) -> "SoftwareSpec":
        """fp32 parameters are autocast's recipe: a model cast to its 2-byte dtype ("half") has none."""
        if self.param_dtype == "fp32" and self.mixed_precision != "autocast":
            raise ValueError("param_dtype 'fp32' needs mixed_precision 'autocast' (a model cast to its 2-byte "
                             "dtype keeps no fp32 parameters); set param_dtype: training or mixed_precision: "
                             "autocast")
        return self

    @field_validator("tp_comm_overlap")
    @classmethod
    def _ub_methods_modelled(cls, v: dict[str, UbOverlap]) -> dict[str, UbOverlap]:
        """Each GEMM's collective overlapped by a method TE runs for it and the cost model prices."""
        for gemm, cfg in v.items():
            if cfg.method not in UB_ALLOWED[gemm]:
                raise ValueError(f"tp_comm_overlap: {gemm} cannot be overlapped by {cfg.method!r}; use "
                                 f"{' or '.join(UB_ALLOWED[gemm])}")
        return v

    @model_validator(mode="after")
    def _fp32_grads_need_fp32_states(self) -> "SoftwareSpec":
        """fp32 gradients through the step are an fp32 optimizer's (torch's Adam steps a parameter
        with a gradient of its own dtype: no master, no fp32 gradient)."""
        if self.grad_dtype == "fp32" and self.optimizer_states == "param":
            raise ValueError("grad_dtype 'fp32' needs optimizer_states 'fp32' (an optimizer stepping the 2-byte "
                             "parameters takes gradients of their dtype); set grad_dtype: param or fp32_reduce")
        return self

    @field_validator("pipeline_send_overlap")
    @classmethod
    def _schedules_once(cls, v: list[str]) -> list[str]:
        """Each schedule named once, in the registry's order (a dump and a cache key do not
        depend on how the file listed them)."""
        from cost_models.schedules import SCHEDULES

        return [s for s in SCHEDULES if s in set(v)]

    def sends_overlap(self, schedule: str) -> bool:
        """Whether the pipeline sends of `schedule` (the one the runtime executes: `cost_models.
        schedules.executed_schedule`) run beside the compute (`pipeline_send_overlap`)."""
        return schedule in self.pipeline_send_overlap

    @model_serializer(mode="wrap")
    def _omit_eager_fusion(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The dump without the fields of `OMITTED_AT_DEFAULT` and the memory terms
        (`MEMORY_TERM_FIELDS`) where they hold their defaults: the choices every plan made before
        the fields existed, so a plan file (and its digest, `tests/test_planner_unchanged.py`) and a
        cache key for such software are what they were; the other choices are written."""
        out = handler(self)
        if isinstance(out, dict):
            fields = type(self).model_fields
            for key in (*OMITTED_AT_DEFAULT, *MEMORY_TERM_FIELDS):
                if key in out and out[key] == fields[key].get_default(call_default_factory=True):
                    out.pop(key)
        return out

    @property
    def autocast(self) -> bool:
        """Whether a mixed-precision run of this software runs under torch.autocast (the cost
        model's `autocast` argument; see `mixed_precision`)."""
        return self.mixed_precision == "autocast"

    def state_policy(self, dtype: str) -> str:
        """The precision policy of a `dtype` run's model states, gradient accumulation and sync
        (`cost_models.memory.PRECISION_POLICIES`): "fp32" where the parameters stay fp32
        (`param_dtype`: 4-byte weights and gradients, Adam's two moments, no master copy), else
        `dtype` itself, or `dtype`'s "_param" policy (no master, 2-byte moments) where the optimizer
        keeps no fp32 states (`optimizer_states` "param"), or its "_fp32grad" policy (fp32
        gradients beside 2-byte weights) under `grad_dtype` "fp32"."""
        if self.param_dtype == "fp32":
            return "fp32"
        if self.grad_dtype == "fp32" and dtype in ("bf16", "fp16"):
            return f"{dtype}_fp32grad"
        return f"{dtype}_param" if self.optimizer_states == "param" and dtype in ("bf16", "fp16") else dtype

    def param_cast_bytes(self, dtype: str) -> float:
        """Bytes per parameter element one micro-batch moves casting fp32 parameters for a
        `dtype` run (`cost_models.compute.param_cast_bytes`); 0 with parameters in `dtype`."""
        from cost_models.compute import param_cast_bytes
        return param_cast_bytes(self.param_dtype, dtype)

    def loss_scaling_bytes(self, dtype: str) -> float:
        """Bytes per gradient element one optimizer step moves unscaling the gradients of a
        `dtype` run and checking them for inf/NaN (`cost_models.compute.loss_scaling_bytes`); 0
        without dynamic loss scaling or outside fp16."""
        from cost_models.compute import loss_scaling_bytes
        return loss_scaling_bytes(self.loss_scaling, dtype)

    def param_cast_saved_bytes(self, dtype: str) -> float:
        """Bytes per parameter element a micro-batch's forward saves for its backward as the
        weights' 2-byte casts (`cost_models.memory.param_cast_saved_bytes`); 0 with parameters
        in `dtype`."""
        from cost_models.memory import param_cast_saved_bytes
        return param_cast_saved_bytes(self.param_dtype, dtype)

    def on_graph(self, graph: Any) -> Any:
        """`graph` (an OpGraph) as this software runs it: its cross-entropy losses one fused kernel
        each under `loss_kernel` "fused", run on the 2-byte logits under "half"
        (`cost_models.fused_loss.fuse_losses`), else `graph`."""
        if self.loss_kernel == "eager":
            return graph
        from cost_models.fused_loss import HALF_OVERLOAD, fuse_losses
        return fuse_losses(graph) if self.loss_kernel == "fused" else fuse_losses(graph, HALF_OVERLOAD)

    def on_cluster(self, cluster: Any) -> Any:
        """`cluster` (a ClusterSpec) with its device's fused-attention rates replaced by this
        software's own for that device (`attention_flops`), or `cluster` itself when it has none."""
        rates = self.attention_flops.get(cluster.device.name)
        if not rates:
            return cluster
        device = cluster.device.model_copy(update={"attention_flops": rates,
                                                   "attention_head_dims": list(self.attention_head_dims) or None})
        return cluster.model_copy(update={"device": device})

    def summary(self) -> str:
        """One line: the name and every choice (what `autopar show` prints)."""
        sync = "overlaps the backward" if self.grad_sync_overlap else "after the backward"
        own = f", its own attention rates on {', '.join(sorted(self.attention_flops))}" if self.attention_flops else ""
        fusion = {"fused": ", element-wise chains fused",
                  "norm_moe": ", norms and the experts' routing fused",
                  "norm": ", norms fused"}.get(self.pointwise_fusion, "")
        half = ", model cast to its 2-byte dtype (no autocast)" if not self.autocast else ""
        loss = {"fused": ", fused cross-entropy",
                "half": ", cross-entropy on the 2-byte logits"}.get(self.loss_kernel, "")
        fp32 = ", fp32 parameters under autocast" if self.param_dtype == "fp32" else ""
        zro = ", torch ZeroRedundancyOptimizer" if self.zero_optimizer == "zero_redundancy" else ""
        zro += ", fp16 dynamic loss scaling" if self.loss_scaling == "dynamic" else ""
        zero3 = ", ZeRO-3 collectives beside the compute" if self.zero3_overlap else ""
        if self.pipeline_send_overlap != type(self).model_fields["pipeline_send_overlap"].default_factory():
            zero3 += (f", pipeline sends beside the compute under {'/'.join(self.pipeline_send_overlap)}"
                      if self.pipeline_send_overlap else ", pipeline sends waited")
        zero3 += ", pipeline sends split over tp and all-gathered" if self.pipeline_send_split else ""
        zero3 += ", no fp32 master (2-byte optimizer moments)" if self.optimizer_states == "param" else ""
        zero3 += ", gradient accumulation fused into the weight-gradient GEMMs" if self.gradient_accumulation_fusion \
            else ""
        zero3 += ", weights' all-gather beside the next forward" if self.param_sync_overlap else ""
        zero3 += (f", tp collectives beside their GEMMs ({len(self.tp_comm_overlap)} userbuffers overlaps)"
                  if self.tp_comm_overlap else "")
        moe = {"ranks": ", a token sent once per expert rank (DeepEP)",
               "nodes": ", a token sent once per expert node over the network, once per expert rank inside it "
                        "(DeepEP)"}.get(self.expert_dispatch, "") + \
            {"fake_balanced": ", fake balanced routing",
             "forced_balance": ", forced balanced routing (random logits)"}.get(self.expert_routing, "") + \
            {"megatron_core": ", Megatron-Core's expert activations (fused permutation, weighted SwiGLU)"}.get(
                self.expert_saves, "") + \
            (", norm modules saving their input (one kernel)" if self.norm_saves == "input" else "") + \
            {"fp32": ", fp32 gradients (main_grad buffer)",
             "fp32_reduce": ", FSDP gradients accumulated and reduced in fp32"}.get(self.grad_dtype, "") + \
            (", sequence-parallel linears saving their input shard" if self.sp_linear_saves == "shard" else "")
        flat = f", plans fill {self.usable_fraction:g} of device memory (override)" if self.usable_fraction else ""
        return (f"software: {self.name} (attention {self.attention_kernel}{own}{fusion}{half}{loss}{fp32}{zro}, "
                f"dp gradient sync {sync}{zero3}{moe}{flat})")

    @classmethod
    def load(cls, name_or_path: str | Path) -> "SoftwareSpec":
        """A bundled preset by name (`bundled_software()`) or a YAML/JSON file."""
        path = _resolve(str(name_or_path))
        data = read_mapping(path, "software",
                            "name, attention_kernel, pointwise_fusion, mixed_precision, param_dtype, zero_optimizer, "
                            "loss_scaling, grad_sync_overlap, pipeline_send_overlap, pipeline_send_split, "
                            "zero3_overlap, gradient_accumulation_fusion, tp_comm_overlap, param_sync_overlap, "
                            "allocator_fragmentation, usable_fraction, "
                            "optimizer_states, expert_dispatch, expert_routing, expert_saves, norm_saves, "
                            "grad_dtype, sp_linear_saves")
        data.setdefault("name", path.stem)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            from autopar.schema.cluster import validation_message

            raise PlanError(f"invalid software file {path}: {validation_message(e)}") from None


def bundled_software_dir() -> Path:
    import software_profiles  # data package shipped beside autopar

    return Path(software_profiles.__file__).parent


def bundled_software() -> list[str]:
    """Names of the bundled software presets."""
    return sorted(p.stem for p in bundled_software_dir().glob("*.yaml"))


def resolve_software(software: "SoftwareSpec | str | None") -> SoftwareSpec:
    """A SoftwareSpec from a preset name, a file path, a spec, or None (the default preset)."""
    if software is None:
        return SoftwareSpec.load(DEFAULT_SOFTWARE)
    if isinstance(software, SoftwareSpec):
        return software
    if isinstance(software, (str, Path)):
        return SoftwareSpec.load(software)
    raise PlanError(f"software must be a preset name ({', '.join(bundled_software())}), a YAML/JSON file "
                    f"or a SoftwareSpec, got {type(software).__name__}")


def software_for_cluster(software: "SoftwareSpec | str | None", cluster: Any) -> SoftwareSpec:
    """The software to plan `cluster` (a ClusterSpec) with: `software` when given
    (`resolve_software`); else the default preset, except that a cluster file written before
    software was apart from hardware (its device still sets `attention_kernel`, warned when it
    loaded: `DeviceSpec.legacy_attention_kernel`) keeps the attention kernel it set."""
    if software is not None:
        return resolve_software(software)
    sw = resolve_software(None)
    legacy = getattr(cluster.device, "legacy_attention_kernel", None)
    if legacy is None or legacy == sw.attention_kernel:
        return sw
    return sw.model_copy(update={
        "name": f"{sw.name}, attention {legacy}",
        "description": f"{sw.description}; attention_kernel={legacy} from the cluster file's device "
                       f"(deprecated there: choose the software instead)",
        "attention_kernel": legacy,
        "sources": {**sw.sources, "attention_kernel": "the cluster file's device.attention_kernel (deprecated)"}})


def preset_for_attention_kernel(kernel: str) -> SoftwareSpec:
    """The preset whose choices are those autopar assumed before software was apart from
    hardware, when a device's `attention_kernel` was `kernel`: no overlap of the gradient sync,
    and that kernel ("fused": `autopar`, "unfused": `megatron-lm-2021`). Migrates old plan files."""
    return SoftwareSpec.load(DEFAULT_SOFTWARE if kernel == "fused" else "megatron-lm-2021")


def _resolve(name: str) -> Path:
    """A bundled preset's file by name, else the file `name` (a name is looked up first: a
    directory called `autopar` beside the user must not shadow the default)."""
    p = Path(name)
    cand = bundled_software_dir() / f"{name}.yaml"
    if p.suffix.lower() not in (".yaml", ".yml", ".json") and "/" not in name and cand.exists():
        return cand
    if p.is_file():
        return p
    if p.suffix.lower() in (".yaml", ".yml", ".json") or "/" in name:
        raise PlanError(f"software file {name} does not exist; give a bundled preset "
                        f"({', '.join(bundled_software())}) or a YAML/JSON path")
    raise PlanError(f"unknown software {name!r}; bundled: {', '.join(bundled_software())} "
                    f"(or give a YAML/JSON file path)")
