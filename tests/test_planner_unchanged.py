"""Issue 19: the faster capture (repeated blocks stitched, the capture cache) and search give
the plans the planner gave before them, field for field.

`EXPECTED` was recorded with the code of commit 1da767c (before issue 19's changes) by
`python tests/test_planner_unchanged.py`: a digest of the whole plan JSON but its `search`
record (timings) and version, and the fields a reader checks first. A change meant to change
plans (a new cost or memory term) re-records it the same way and says so in its commit.
Re-recorded since: plan format 5 (`StagePlan.recompute_modules`) and 6 (`StagePrediction.
phases`, each phase's peak; then ZeRO-1/2's gradient-sync moments in it) changed the digests
only; layouts, times, memory and collectives are those of 1da767c, but for HF GPT-2's peak
memory: the backward's gradients taken by liveness (`cost_models.memory._gradient_moments`,
its tanh GELU's input read three times) put it 0.5% higher. Plan format 7 (software apart from
hardware, `Plan.software`): the A100 cases plan with the software the dgx-a100-80g profile
described then (`megatron-lm-2021`: unfused attention, the sync after the backward), so
layouts, times and collectives are still 1da767c's; their peak memory grew, since unfused
attention now also saves its scores in the memory model (it priced their time but not their
memory before). Plan format 7 also added `Plan.sequence_parallel`
(digests only; these cases pin it off: the search weighs it since issue 13, which changes
plans by design, and this test is about issue 19's machinery).
Re-recorded when the A100 GEMM-efficiency curve became a measured A100 one (issue 14,
benchmarks/a100_gemm_curve.py): the A100 cases' times moved (0.465 -> 0.466 s, HF GPT-2 and
Llama by 0.1%) and GPT-3 1.3B's interleaving went from v=8 to v=6 (88 sends instead of 120),
by the curve alone; gpt-small (the CPU profile) is unchanged. Session 16: the first backward's
moments hold the parameter gradients made so far (`_Tables.first_backward`): HF GPT-2's peak
1.0% higher (a pipeline stage's last block's backward with its head's gradients), the rest as
before; AdamW's temporaries as the loop keeps them (`adamw_temporary_elems`): gpt-small's
optimizer-step phase (digest only); a norm computed in fp32 between an upcast and its cast back
(`memory._upcast_regions`, Hugging Face's RMSNorm): HF Llama's peak 6.6% higher, same layout.
HF GPT-2's plan has stages of different tp degrees (tp 2, 1, 1); since they run op by op as
solved (issue 20), its tp stage is costed as the executor runs it (the solution's cost:
0.4% faster) and its collectives are its solution's instead of a DTensor dry run's (the layout
and the peak memory are unchanged). Re-recorded when the runtime's pipeline receive buffers
became just in time (made when the schedule posts the receive, dropped after the micro-batch's
backward, `runtime.pipeline_p2p.JustInTimeStage`) and the memory model counts those alive from
the schedule's order instead of m x (input + output gradient) per chunk: GPT-3 1.3B's peak 4.5%
lower (24.65 -> 23.54 GB: 4 micro-batches x 6 chunks of buffers down to those in flight), HF
GPT-2's digest only (its stages' phases: no receive buffer in the sync and optimizer phases);
layouts, times and collectives unchanged. Plan format 9 (`StagePlan.recompute_ops`, selective
recomputation of the attention core's ops): digests only (these cases recompute nothing).
`DeviceSpec.gemm_alignment` (measured on an H100; every plan's device carries the field, null
on these A100 and CPU profiles): digests only. The runtime's AdamW fused on CUDA (no
temporaries, `cost_models.memory.fused_optimizer`): the GPU cases' optimizer-step phases, digests
only (none peaks there). Plan format 10 (recompute "attention", the module
holding each attention core checkpointed whole, searched beside the core alone): digests only
(the plan JSON, its format_version apart, byte-identical to the one before; these cases
recompute nothing).
Session 19: Hugging Face models are captured with their attention masks built as in eager mode
(`models.hf.eager_attention_masks`: no materialised causal mask, SDPA `is_causal=True`, and
grouped-query attention inside SDPA instead of repeated keys and values), the program their
eager forward and autopar's runtime run: HF GPT-2's tiny plan drops the [b, 1, s, s] mask that
crossed every pipeline boundary (dp2 tp2 pp3 -> dp4 pp2 v1, 1.55 -> 1.42 ms, peak 3.26 -> 1.85
MB), HF Llama 1.5% faster with the same layout. Reshapes that copy counted by the strides the
kernels give (`cost_models.layouts`): GPT-3 1.3B under the megatron-lm-2021 software (unfused
attention, whose output's transpose + reshape copies) 0.14% higher peak, same layout.
Plan format 11 (the "cp" mesh axis kind, context parallelism): digests only (with
format_version set back to 10, each plan's digest is the one recorded before; context
parallelism is searched only from 16384-token sequences or where nothing fits without it).
Re-recorded when the time model charged the reshapes that copy (`cost_models.compute.
reshape_copy_time`, from the same layout walk as the memory model): GPT-3 1.3B under
megatron-lm-2021, whose unfused attention output's transpose + reshape copies, costs 0.9% more
per layer (forward and backward); with v=4 that is 0.4719 -> 0.4744 s, and with v=6 the greedy
`balanced_chunks` now cuts the layers otherwise (0.4656 -> 0.4807 s), so the search takes v=4
(88 -> 56 sends, peak 23.57 -> 23.98 GB). gpt-small, HF GPT-2 and HF Llama are unchanged (no
reshape of theirs copies; HF's `.contiguous()` after attention copies under unfused attention).
Fused attention's published A100 rates (issue 14: `DeviceSpec.attention_flops` of dgx-a100-80g from
the FlashAttention-2 paper's Figure 4, `AttentionPoint.head_dim`, `SoftwareSpec.attention_flops`):
digests only (every plan carries the new fields; the A100 cases plan with megatron-lm-2021's
unfused attention, which the rates do not touch, and gpt-small's CPU profile has none).
Session 21: the memory model follows type promotion under CUDA's autocast (`cost_models.memory.
_promoted_fp32`: an element-wise op reading an fp32 tensor gives fp32) and an op of autocast's
fp32 list reading a tensor already fp32 makes no copy of it: HF GPT-2's peak 1.85 -> 2.17 MB
(`gelu_new`'s `pow` runs in fp32, so its tanh and products are fp32 tensors), HF Llama's 1.72 ->
1.51 MB (its RMSNorm's `pow` of the fp32 upcast was counted with a second fp32 copy); both
checked against what torch saves running CUDA's program (test_memory_model,
`test_hugging_face_classes_as_cuda_runs_them`: were -18% and +22%, now within 0.4%). Same
layouts, times and collectives.
Re-recorded when autopar's Hugging Face causal LMs took next-token targets from the batch and
their positions as `position_ids` from `token_positions` (so that context parallelism runs
them: each rank's chunks carry their own targets and positions, `models.hf._positional_class`):
the loss no longer pads, slices and copies the labels inside the model (GPT-2's graph also
loses one add of its own position computation): HF GPT-2 1.42 -> 1.40 ms, HF Llama 2.532 ->
2.520 ms, same layouts, peak memory and collectives (the same loss on the same batches).
Session 22: a layer's subgraph takes the tensors it reads from earlier layers that need no
gradient as constants (`AnalyticProvider._subgraph` with the whole model's `requires_grad`:
HF Llama's rotary tables, made once, had every later layer's rotary products save q and k),
and the residual stream beside Hugging Face's fp32 RMSNorm stays in the training dtype
(`memory._promoted_fp32`: the fp32 capture made the norm's upcast and its input one tensor):
HF Llama's peak 1.51 -> 1.44 MB, same layout, times and collectives; the rest unchanged.
Then a `.to(device)` (`aten.to.dtype_layout` with the tensor's own dtype: `Tensor.to` returns the
tensor, `capture.flops.identity_move`) priced as a view, not a copy: HF GPT-2 1.397 -> 1.381 ms
(its position embeddings' and labels' moves), HF Llama 2.520 -> 2.516 ms and 0.5 KB less at its
peak; same layouts and collectives.
Issue 18 (categories that hold): a pipeline chunk's output gradient, the receive buffer, is
left out of its last layer's activation gradients in the first backward (it was taken out of
the saved activations) and out of a recomputed region's gradients; the last layer's forward
moment is activations where it is the worst (`LayerCost.bwd_over_given_rc`): HF GPT-2's digest
only (its stages' phases split their bytes by category otherwise); layouts, times, peaks and
collectives unchanged.
Session 25 (issues 14, 18): the time model moves the tensors a mixed-precision run holds in fp32
at 4 bytes an element (`cost_models.compute.fp32_extra_bytes`, by the memory model's rule
`memory.mixed_fp32`: autocast's fp32 ops' outputs, upcast regions, type promotion), where it
moved every floating tensor at 2; and the software says how its run is mixed-precision
(`SoftwareSpec.mixed_precision`): megatron-lm-2021, which three cases plan with, casts the model
to bf16 ("half": its fused layer norm and softmax write bf16; only the model's own upcasts and
the loss are fp32), so autocast's fp32 list no longer applies to it, in memory or time. GPT-3
1.3B 0.47442 -> 0.47466 s (the loss's fp32 logits), peak 23.98 -> 21.80 GB (the layer norms'
outputs and saved inputs at 2 bytes), same layout (v=4); HF GPT-2 peak 2.17 -> 1.69 MB, time
1.3815 ms as before to 4 digits (`gelu_new`'s `pow` no longer an fp32 op: its tanh region is bf16,
which session 21's autocast rule had made fp32); HF Llama 2.516 -> 2.526 ms (RMSNorm's explicit
fp32 region and fp32 rotary tables, the same in either precision), same peak; gpt-small (autopar's autocast, on
CPU) 15.096 -> 15.122 ms (its loss's fp32 upcast of the logits). Layouts and collectives
unchanged; the digests also carry the presets' new `mixed_precision` sources.
Session 26 (issue 20): a view of an fp32 tensor moves nothing (`fp32_extra_bytes` had charged
views and aliases the 2 extra bytes of every element they "read"): HF Llama 2.526 -> 2.518 ms
(its RMSNorm region's and rotary tables' views); the other cases unchanged. Then an eager
cross-entropy moves what its kernels move (the log-probabilities written and read again, fp32 in a
mixed-precision run: `flops.node_cost`, `compute.backward_bytes_factor`), where it was priced as
one read of the logits each way: GPT-3 1.3B 0.47466 -> 0.47515 s, gpt-small 15.122 -> 15.157 ms,
HF GPT-2 and Llama +0.0001 ms; layouts, peaks and collectives unchanged.
Session 26 (issue 18): a layer ending a pipeline chunk weighs its forward's moment without the
output it hands on, which the stage already counts as kept per micro-batch in flight
(`ActivationMemory.forward_over_given`): GPT-3 1.3B's peak 21.796 -> 21.779 GB (0.08%); layouts,
times and collectives unchanged, the other cases' digests too.
Session 27 (issue 14, every constant sourced, docs/constants.md): the DGX A100 profiles' intra-node
link carries the published nccl-tests all-reduce table of an 8x A100 NVLink3 node (`LinkSpec.
measured`) and its latency is the one that table's 32 KiB row gives, 3.1 us (was 3.0, an
estimate); every profile's sources changed (digests). The 0.1 us alone (checked with the table
removed) moves GPT-3 1.3B's interleaving from v=4 to v=6 (56 -> 88 sends): the greedy
`balanced_chunks` cuts v=6's layers otherwise at the new latency, 0.4751 -> 0.4687 s, peak 21.78 ->
22.34 GB (a search artefact: a slower link gives a faster plan); HF GPT-2 1.3816 -> 1.3826 ms and
HF Llama 2.5176 -> 2.5233 ms (their all-reduces' latency); same layouts otherwise; gpt-small (CPU
profile) unchanged.
Session 28 (issue 14): the intra-op ILP times a tp axis inside a node from the profile's
measured nccl-tests all-reduce table (`LogicalMesh.links`), as the analytic provider already did;
the A100's mid-size all-reduces run at 138-177 GB/s there, not 230: GPT-3 1.3B tp2 pp2 goes from
v=6 to v=4 (0.469 -> 0.489 s, 88 -> 56 sends), HF Llama 0.06% slower with the same layout
(digest), HF GPT-2 unchanged (its tp stage's collectives are all-gathers and reduce-scatters,
which keep the formula); gpt-small (CPU profile, no table) unchanged. The same session's
boundary change (layers solved apart meet at their boundaries, `IlpProvider._boundaries`)
changed none of them.
Plan format 12 (`Plan.experts.expert_tp`, expert tensor parallelism): digests only (with
format_version set back to 11, each plan's digest is the one recorded before; these models
have no experts).
Session 32 (issue 14): the dgx-a100-80g profile carries the published A100 speed of attention run
unfused (`DeviceSpec.unfused_attention_flops`, Dao 2023 Figure 4 (a)/(b) "Pytorch" bars) and
`compute.attention_time` prices megatron-lm-2021's attention core from it (1.4-1.7x the
roofline's time at s = 2k): GPT-3 1.3B (16 heads of 128, s = 2048) 0.489 -> 0.553 s, and the
search now takes v=6 (56 -> 88 sends, peak 21.78 -> 21.31 GB): a slower layer makes the smaller
bubble worth its sends. Every plan carries the new field (digests); HF GPT-2 and HF Llama (toy
shapes: the roofline with its per-kernel costs bounds their core, above the table's per-score
time) and gpt-small (CPU profile, no table) keep their times, layouts, peaks and collectives.
Plan format 13 (`Plan.experts.folded`, MoE parallel folding): digests only (with
format_version set back to 12, gpt-small's digest is the one recorded before; the same layouts,
times, peaks and collectives for all four; these models have no experts).
Plan format 14 (`Plan.zero3_grad_sync`, ZeRO-3's gradients reduce-scattered every micro-batch):
digests only (every plan carries the field, "step" in all four; the same layouts, times, peaks
and collectives).
Session 33, after format 14 (`Junction.readers`: a junction of a tensor that other layers make or read is its
layer's own, keyed 'op#output@layer'): digests only, for the two plans with tp stages (their
residual streams' junctions keyed by the reading block); the same layouts, times, peaks and
collectives.
Issue 17 (uneven pipeline chunks): an interleaved plan's chunk reports its own layers' share of
its device group's compute, communication and bubble (`planner._chunk_share`) instead of 1/v:
GPT-3 1.3B's digest only (with the share set back to 1/v, the digest recorded before); layout,
time, peak and collectives unchanged, the other cases too.
Plan format 15 (recompute "norm_act", `StagePlan.recompute_acts`, issue 17; searched beside the
other policies): digests only (with format_version set back to 14 and the new null field
dropped, each plan's digest is the one recorded before; none of the four takes "norm_act": the
same layouts, times, peaks and collectives). Merged with the uneven-chunk change: GPT-3 1.3B
digest 57f911cd (both changes; each alone was recorded as above).
Issue 14, session 35: the usable memory is term by term (`cost_models.memory.usable_memory_terms`:
CUDA's reported memory less context, workspaces, NCCL buffers and fragmentation, in place of a flat
92%): every plan records its new `usable_memory_bytes` (A100 80GB under megatron-lm-2021 73.60 ->
74.22 GiB; the CPU profile 0.92 -> 0.95 of its memory) and the devices' and software's new fields
(`driver_reserved_bytes`, first written as `addressable_memory_bytes`, `collective_channels`,
`attention_head_dims`): digests only (layouts,
times, memory and collectives unchanged; no case's memory bound binds, and the A100 case runs
megatron-lm-2021's unfused attention, which the head-dimension rule does not touch).
Merged with the two issue-17 changes above: digests re-recorded for all three together.
Session 36 (issue 14, the H100 step's eager work: autocast's casts, a split's backward cat and
re-layout copy, the bias-gradient sums, autograd's gradient sums, CUDA layer norm's backward
bytes): times only, the same layouts, peaks and collectives: GPT-3 1.3B tp2 pp2 (A100 profile)
0.5534 -> 0.5744 s; hf-gpt2 1.383 -> 1.600 ms; hf-llama 2.525 -> 2.842 ms; gpt-small (CPU
profile) 15.157 -> 15.315 ms (the split's cat and the gradient sums; its profile measured the
linear backward, bias sum in it).
Session 37 (issue 14, pipeline sends as software: `SoftwareSpec.pipeline_send_overlap` and
`pipeline_send_split`, each hop on the link it crosses): GPT-3 1.3B tp2 pp2 under megatron-lm-2021
0.574375 -> 0.574517 s (its scatter/gather: each of the 2 tp ranks sends half the boundary and the
receiver all-gathers it over NVLink: 0.14 ms a step more than whole sends there), same
layout, peak and collectives; every digest (the presets' new fields and sources in `Plan.software`);
the others' layouts, times, peaks and collectives unchanged.
"""

import hashlib
import json
import sys

import pytest

from autopar.planner import plan, resolve_model
from autopar.schema import ClusterSpec, Constraints

HF_GPT2 = "hf:gpt2?hidden_size=64&num_hidden_layers=6&num_attention_heads=4&vocab_size=128&seq_len=16"
HF_LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=6"
            "&num_attention_heads=4&vocab_size=128&seq_len=16")

A100 = "megatron-lm-2021"      # the software dgx-a100-80g's device described before plan format 7

CASES = {   # name: (model, cluster, nodes, global batch, pinned constraints, software)
    "gpt3-1.3b-tp2-pp2": ("gpt3-1.3b", "dgx-a100-80g", 1, 32, {"tp": 2, "pp": 2}, A100),
    "gpt-small": ("gpt-small", "cpu", 1, 8, {}, "autopar"),
    "hf-gpt2": (HF_GPT2, "dgx-a100-80g", 1, 16, {}, A100),
    "hf-llama": (HF_LLAMA, "dgx-a100-80g", 1, 16, {"tp": 2}, A100),
}

EXPECTED = {
    "gpt3-1.3b-tp2-pp2": {"digest": "364f5553cdbdaad6", "layout": (2, 2, 2, 4, 4, "interleaved_1f1b", 6, 1),
        "iteration_time_s": 0.5745166488021283, "peak_memory_bytes": 21309384704.0,
        "collectives": {"all_reduce": 405, "reduce_scatter": 2, "all_gather": 2, "send_recv": 88}},
    "gpt-small": {"digest": "2274e74b6a59db8d", "layout": (2, 1, 1, 4, 1, "1f1b", 1, 0),
        "iteration_time_s": 0.015315429976945856, "peak_memory_bytes": 20557824.0,
        "collectives": {"all_reduce": 1}},
    "hf-gpt2": {"digest": "c7519ab58fcfc88e", "layout": (4, 1, 2, 4, 1, "1f1b", 1, 1),
        "iteration_time_s": 0.0015999184694133104, "peak_memory_bytes": 1688512.0,
        "collectives": {"reduce_scatter": 2, "all_gather": 2, "send_recv": 2, "all_reduce": 1}},
    "hf-llama": {"digest": "e9b191d013fe6bf2", "layout": (4, 2, 1, 4, 1, "1f1b", 1, 1),
        "iteration_time_s": 0.002841571128965226, "peak_memory_bytes": 1444160.0,
        "collectives": {"all_reduce": 25, "all_gather": 2, "reduce_scatter": 1}},
}


def record(p) -> dict:
    """The fields `EXPECTED` holds of plan `p`."""
    d = json.loads(p.to_json())
    d.pop("search", None)
    d.pop("autopar_version", None)
    return {"digest": hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16],
            "layout": (p.dp, p.tp, p.pp, p.microbatch_size, p.num_microbatches, p.schedule, p.virtual_stages,
                       p.zero_stage),
            "iteration_time_s": p.predicted.iteration_time_s, "peak_memory_bytes": p.predicted.peak_memory_bytes,
            "collectives": p.predicted.collectives}


def make(name: str, cache=None):
    ref, cluster, nodes, gbs, pins, software = CASES[name]
    return plan(resolve_model(ref, None, None), ClusterSpec.load(cluster, num_nodes=nodes), global_batch_size=gbs,
                constraints=Constraints(sequence_parallel=False, **pins), cache=cache, software=software)


@pytest.mark.parametrize("name", list(CASES))
def test_plan_equals_the_one_before_issue_19(name, tmp_path):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    got = record(make(name, cache=tmp_path))
    want = EXPECTED[name]
    assert {k: v for k, v in got.items() if k != "digest"} == {k: v for k, v in want.items() if k != "digest"}
    assert got["digest"] == want["digest"], "same layout and figures, but another field of the plan changed"


if __name__ == "__main__":      # re-record EXPECTED
    for n in CASES:
        print(f"    {n!r}: {record(make(n))!r},", file=sys.stdout, flush=True)
