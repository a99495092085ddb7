"""Issue 14: the cost model's errors against published training runs, pinned.

`benchmarks/cost_model_accuracy.py` prints the prediction of every published case it knows; nothing
failed when a change made those predictions worse. This test plans a representative subset of each
of the benchmark's case families, with the benchmark's own case definitions and planning function
(`CASES`, `TABLE1`, `H100_CASES`, `FLASH_CASES`, `plan_case`, `analytic`; nothing copied), and
asserts each prediction's error is within `TOLERANCE` of the error recorded in `PINNED`, and each
family's mean |error| within the target the benchmark states where the family meets it today.

Subset (running every case takes about 4 minutes here; this takes under a minute):
- `pinned`: all five of design.md's calibration cases (Megatron-LM 2021 / Korthikanti 2022 on
  DGX A100, software megatron-lm-2021), through `autopar.plan`;
- `analytic`: the cost models alone on the four 2021 cases (`--analytic`);
- `table1`: two rows of Narayanan et al. 2021 Table 1 not among the pinned cases (7.5B, 18.4B, the
  two that the model predicted pessimistic under micro-batch 1; 1.7B and 39.1B are the pinned cases);
- `h100`: one of the five NeMo GPT-3 175B H100 runs (512 GPUs; the five differ only in data-parallel
  width and are within 1.2 points of each other);
- `flash`: the FlashAttention-2 paper's 2k runs, FLASHATTENTION-2 and FLASHATTENTION columns (looked
  at while the model changed), and two FlashAttention-1 runs of flash-attn's training/README.md (held
  out: GPT3-125M, GPT3-1.3B) and, since session 34, the FA2 paper's GPT3-2.7B 8k run (held out; the
  planner picks its micro-batch, its config's cannot fit: `Case.microbatch_free`), since session 35
  its FA1 twin, FA1 GPT3-760M and FA1 GPT2-1.6B; the other runs (1.3B 8k, FA1 GPT3-355M, GPT2-355M and
  760M) are not pinned (the 1.3B 8k rows do not fit autopar's
  usable memory: misses, README).

`PINNED` was recorded in session 22 by `python tests/test_calibration.py` (prints the table to
paste). A change meant to move a prediction (a sourced cost term, a new measurement) re-records
it the same way, says so in its commit and re-runs the README's tables; a change that moves one
by more than `TOLERANCE` without meaning to fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cost_model_accuracy import (  # noqa: E402
    CASES,
    FLASH_CASES,
    H100_CASES,
    TABLE1,
    analytic,
    load_cluster,
    plan_case,
)

# |error now - error pinned| allowed for each case, in fractions of the published time: wide enough
# for float noise and small unrelated modelling changes, narrow enough that a change worsening a
# published case by a few percent fails
TOLERANCE = 0.03

# (family, case name) -> predicted / published - 1, recorded in session 22; re-recorded in session
# 25 (issues 14, 18) when the time model moved the tensors a mixed-precision run holds in fp32 at 4
# bytes an element (`cost_models.compute.fp32_extra_bytes`, the memory model's rule
# `memory.mixed_fp32`), where it moved them at 2, and the software's mixed precision became its own
# choice (`SoftwareSpec.mixed_precision`): Megatron-LM 2021 and NeMo cast the model to bf16 and run
# fused norm / softmax kernels that write bf16 ("half": only the loss's logits are fp32), the
# flash-attn stacks run under torch.autocast (its fp32 list: layer norms, softmax). Megatron and
# NeMo cases moved under 0.3 points (the loss reading fp32 logits). Beyond the 3-point tolerance,
# before -> after: flash FA1 GPT3-125M -8.08% -> -3.20% (its fp32 tensors are the layer norms'
# outputs under autocast, large beside a 125M model's GEMMs; flash-attn's fused dropout-add-LayerNorm
# writes the 2-byte dtype, which no field describes: the preset's source says so). Within it: the
# other flash cases +0.8 to +1.3 points. Nothing refit.
# Re-recorded in session 26 (issue 14): an eager cross-entropy moves what its kernels move (the
# log-probabilities written and read again, fp32 in a mixed-precision run: `autopar.capture.flops.
# node_cost`, `cost_models.compute.backward_bytes_factor`), where it was priced as one read of the
# logits each way, and the flash-attn presets run their fused cross-entropy (`SoftwareSpec.
# loss_kernel` "fused", sourced: apex's xentropy with inplace_backward, `cost_models.fused_loss`).
# Megatron / NeMo / Table 1 cases +0.1 to +0.4 points (the eager loss's time); beyond the
# tolerance: flash FA1 GPT3-125M -3.20% -> -9.85% (its loss, 50k classes beside a 125M model, was
# priced as the eager upcast and fp32 cross-entropy, about 16 bytes an element more than the fused
# kernel moves); the other flash cases -0.5 to -0.9 points. Nothing refit.
# Re-recorded in session 27 (issue 14, every constant sourced, docs/constants.md): the DGX A100
# profiles' intra-node link carries the published nccl-tests all-reduce table of an 8x A100 NVLink3
# node by message size (`LinkSpec.measured`; S. Bekman's ml-engineering, network/README.md) and the
# latency its 32 KiB row gives (3.0 -> 3.1 us). Beyond the tolerance: analytic 39.1B -5.92% ->
# +0.44% and 22B -6.58% -> -2.46% (their tensor-parallel all-reduces, 33.5 and 101 MB, run at 138
# and ~175 GB/s bus bandwidth in that table, not the 230 GB/s of the alpha-beta formula; the
# analytic cross-check prices collectives with `axis_collective_time`, measured tables first), 175B
# -3.81% -> -0.02% within it. The planner-priced families move by under 0.2 points (their tensor-
# parallel collectives are the ILP's alpha-beta, which reads no measured table). Nothing refit: the
# table is the published run's, every row of it.
# Re-recorded in session 28 (issue 14): the intra-op ILP times a tp axis inside a node from the same
# measured table (`LogicalMesh.links`, `IntraOpProblem.coll_time`), as the analytic cross-check
# already did (all-gathers and reduce-scatters, which the table does not hold, keep the formula).
# Beyond the tolerance: pinned 39.1B -5.41% -> +0.73%, 22B -6.04% -> -1.98%, 175B -4.26% -> -0.69%
# (the planner now agrees with the analytic cross-check within 0.7 points); 22B SP+sel. -13.74% ->
# -13.01% within it;
# Table 1's 7.5B +2.12% -> +9.57% and 18.4B +3.39% -> +13.29% (both p = 1, dp 32 over nodes, the
# two this subset holds because they were the pessimistic ones; the whole Table 1 moved from 4.8%
# to 4.6% mean, README), so the table1 family's mean bound no longer holds for this subset and it
# keeps per-case pins only. Nothing refit.
# Re-recorded in session 31 (issue 14): the Narayanan et al. 2021 rows (Table 1 and the pinned
# 1.7B and 39.1B) run with the micro-batch size, DDP implementation and interleaving of the authors'
# script for the paper (Megatron-LM examples/sc21/run_table_1.sh), which until then were assumed
# (micro-batch 1 or 4, DDP local); DDP torch (the rows without pipelining) is the preset
# megatron-lm-2021-torch-ddp (the gradient all-reduce during the last micro-batch's backward).
# Table 1's 7.5B +9.57% -> -10.79% and 18.4B +13.29% -> -7.16% (micro-batch 16 / 8: 16x / 8x fewer
# tensor-parallel all-reduces, 256 / 192 MiB each, where the measured table's bus bandwidth is 194 /
# 187 GB/s, not 106 / 124 at 16 / 24 MiB; the 0.15 / 0.37 s gradient all-reduce hidden by the
# backward); pinned 1.7B -12.24% -> -14.90% (micro-batch 4 -> 16), 39.1B +0.73% -> -2.17% (1 -> 4);
# analytic 1.7B -14.30% -> -16.96%, 39.1B +0.44% -> -2.58%. And the intra-op ILP prices a gradient
# synced on an axis with a measured table at its share of a full bucket's measured time, the latency
# once (it was the table's time for its own size, 43.8 us at least, plus a latency per bucket):
# 22B SP+sel. -13.01% -> -13.73% (its layer norms' 12 KiB gradients all-reduced over tp). Nothing
# refit: the configuration is the published runs', the prices the profile's table.
# Re-recorded in session 32 (issue 14): the DGX A100 80GB profile carries the published A100 speed
# of attention run unfused (`DeviceSpec.unfused_attention_flops`: Dao 2023, Figure 4 (a) and (b),
# the "Pytorch" bars, baddbmm / softmax / bmm forward + backward by head dimension and length), and
# `cost_models.compute.attention_time` prices Megatron-LM 2021's attention core from it where the
# roofline priced its GEMMs and softmax 1.4-1.7x faster than the A100 ran them. Beyond the
# tolerance: pinned 1.7B -14.90% -> -1.70%, 39.1B -2.17% -> +1.69%, 22B -2.00% -> +3.34%, 22B
# SP+sel. -13.73% -> -6.99% (175B -0.69% -> +2.14% within it); Table 1's 7.5B -10.79% -> -3.70%
# and 18.4B -7.16% -> -2.56%. The analytic cross-check prices its spelled-out core (two matmuls and
# a softmax) the same way (`benchmarks.cost_model_accuracy._measured_core`): 1.7B -16.96% ->
# -3.75%, 39.1B -2.58% -> +1.28%, 22B -2.46% -> +2.87%, 175B -0.02% -> +2.80%. H100 and flash
# families (fused attention) unchanged. Nothing refit: every rate is a printed bar of the figure.
# Re-recorded in session 33 (issue 14): the flash-attn presets keep fp32 parameters under autocast
# (`SoftwareSpec.param_dtype` "fp32": PyTorch Lightning's precision bf16 over a model it never casts;
# flash_attn/ops/fused_dense.py casts each weight per forward), so every micro-batch pays the
# weights' casts and their gradients' casts back (12 bytes a parameter, `cost_models.compute.
# param_cast_bytes`) and accumulates gradients in fp32 (12 bytes a parameter where it was 6), and
# the sync moves fp32 gradients. Beyond the tolerance: flash FA2 2.7B 2k -9.69% -> -5.64% and FA1
# (T1) 2.7B 2k -6.76% -> -3.02% (16 micro-batches of 2.7B parameters: about 0.46 s); within it: FA2
# 1.3B 2k -12.68% -> -10.69%, FA1 (T1) 1.3B 2k -3.99% -> -2.07%, FA1 GPT3-125M -9.85% -> -9.41%,
# FA1 GPT3-1.3B -2.64% -> -0.69%. The other families unchanged (their software keeps 2-byte
# parameters). Nothing refit: bytes counted from the kernels' source, priced at the profile's HBM rate.
# Session 34 (issue 14): no pinned error moved (`SoftwareSpec.zero_optimizer` changes memory only);
# added flash FA2 2.7B 8k, which now plans (micro-batch 1 of the planner's choosing) at -3.04%.
# Session 35 (issue 14): fused attention runs at the compiled kernel's head dimension (`DeviceSpec.
# attention_head_dims`: FlashAttention-2 rounds to a multiple of 32, FlashAttention-1 runs d <= 128
# on its 128-wide kernel) and the 2.7B 8k rows take 20 heads of 128 (training/README.md; 32 of 80
# before): flash FA2 2.7B 8k -3.04% -> -5.39%; pins added for the rule's cases, FA1 (T1) 2.7B 8k
# (-2.34%; +23.4% at 32 heads of 80 under the rule) and FA1 GPT3-760M (16 heads of 96: -9.5% ->
# -2.20%), and for FA1 GPT2-1.6B, whose published time now counts the README's FLOPs (3/4 of
# Megatron's formula, LM head included: `Case.head_scaled`; -16.1% -> -15.13%). Usable memory by
# sourced terms (`cost_models.memory.usable_memory_terms`) moved no pinned error.
# Session 36 (issue 14, the H100 step's eager work): the time model prices the kernels it left out,
# each counted from the kernels' source and seen in the H100 profile: autocast's casts (the copies the
# memory model counts; eager autocast software only: the flash-attn presets, whose dropout-add-LayerNorm
# kernel casts nothing, are priced on the slow side by it), a split's backward cat and the copy behind
# a transpose, a linear layer's bias-gradient sum, autograd's sums of a tensor's gradients where
# several ops read it, CUDA layer norm's two backward kernels (2.5x its forward's bytes);
# dgx-h100's memory_efficiency 0.88 -> 0.90 and layer norm rate, measured on the project's H100.
# Every case moves up (slower): pinned 1.7B -1.70% -> +0.05%, 39.1B +1.69% -> +3.54%, 22B +3.34% ->
# +5.54%, 175B +2.14% -> +3.65%, 22B SP+sel. -6.99% -> -5.93%; analytic 1.7B -3.75% -> -2.37%, 39.1B
# +1.28% -> +3.87%, 22B +2.87% -> +5.94%, 175B +2.80% -> +4.87%; table1 7.5B -3.70% -> -1.67%, 18.4B
# -2.56% -> -0.40%; h100 175B NeMo 512 -1.61% -> -0.32%; flash FA2 1.3B 2k -10.69% -> -3.18%, FA2
# 2.7B 2k -5.64% -> +1.13%, FA1 (T1) 1.3B 2k -2.07% -> +5.16%, FA1 (T1) 2.7B 2k -3.02% -> +3.22%, FA1
# GPT3-125M -9.41% -> +1.26%, FA1 GPT3-1.3B -0.69% -> +6.65%, FA2 2.7B 8k -5.39% -> +0.17%, FA1 (T1)
# 2.7B 8k -2.34% -> +1.98%, FA1 GPT3-760M -2.20% -> +5.67%, FA1 GPT2-1.6B -15.13% -> -6.33%. Means:
# pinned 3.17% -> 3.74%, analytic 2.68% -> 4.26%, table1 3.13% -> 1.04%. Nothing refit.
# Session 37 (issue 14, the GPT-2 rows): fp16 dynamic loss scaling (`SoftwareSpec.loss_scaling`
# "dynamic", the flash-attn presets: Lightning's precision 16 runs torch's GradScaler, whose unscale_
# reads and writes every fp32 gradient once a step, 8 bytes a parameter): FA1 GPT2-1.6B -10.56% ->
# -10.38% (held out; seen before the change). The bf16 rows and the other families unchanged.
# Session 37 (issue 14, pipeline sends as software): `pipeline_send_overlap` (Megatron-Core overlaps the
# interleaved schedule's sends, `overlap_p2p_comm`; Megatron-LM 2021 and autopar's 1F1B wait them),
# `pipeline_send_split` (Megatron-LM 2021's scatter/gather: each tp rank sends 1/tp, the receiver
# all-gathers over tp), each hop on the link it crosses (stages of a whole node crossed InfiniBand,
# priced on NVLink before). pinned 39.1B +3.54% -> +3.15%, 175B +3.65% -> +4.12%; h100 175B NeMo 512
# -0.32% -> -5.38% (its sends, 0.41 s a step, now hidden behind the chunks' compute as Megatron-Core
# runs them: what else that recipe's step pays is not priced). The h100 family no longer meets 5%:
# per-case pin only since then, as flash. Nothing refit.
# Session 38 (issue 14, the H100 cases' source): the 8.309-8.49 s table is dgxc-benchmarking v25.02
# (8f5cbb3), which ran NeMo 24.12 with gpt3_175b_hydra.yaml's 6 virtual stages (not 24.05 / 12, as the
# cases said): h100 175B NeMo 512 -5.38% -> -4.57% (the smaller interleaving's longer bubble).
# Session 38 (issue 14, what NeMo fuses): `gradient_accumulation_fusion` (the recipe's hydra line 77; TE's
# fuse_wgrad_accumulation under Megatron-Core core_v0.10.0): the weight-gradient GEMM adds into main_grad,
# so the separate 6-byte-a-parameter pass every later micro-batch (0.69 s of the 175B step: 5.5e9
# parameters a GPU, 63 of 64 micro-batches) is no longer charged. h100 175B NeMo 512 -4.57% -> -13.04%:
# the pass was standing in for time the recipe pays elsewhere. Other families unchanged (2021 Megatron-LM
# had no such fusion: it came in 83b1e42f30, 2022-02-16). Nothing refit.
# Then `tp_comm_overlap` (the recipe's ub_tp_comm_overlap with its cfg, hydra lines 119, 176-220: TE's
# userbuffers, `cost_models.tp_overlap`): per layer and micro-batch the 8 tp collectives the step charged
# whole (111 us each) beside their GEMMs, -782 us of exposed communication, +272 us of GEMM time (the
# pipeline reduce-scatters' GEMMs on 108 and 112 of 132 SMs, an estimate: +70 and +153 us; chunked GEMMs;
# the SMs of the bulk kernels), and TE's re-gather of the norms' outputs for the weight gradient, hidden.
# h100 175B NeMo 512 -13.04% -> -17.73%. Other families unchanged (no other case's software overlaps).
# Then `param_sync_overlap` (hydra line 142, overlap_param_sync: apex DistributedFusedAdam under Megatron-
# Core's interleaved schedule, which launches each chunk's weight gather one chunk ahead): a stage waits
# for its first chunk's share of the ZeRO-1 all-gather, not the whole. h100 175B NeMo 512 -17.73% ->
# -18.79%. Nothing refit: the three sourced terms moved the family from 4.7% to 18.8% mean, all
# optimistic; what the recipe pays that the model leaves out is not priced (README).
# Session 38 (issue 14, the H100 step's missing time): dgx-h100's GEMM curve above OpenXLA's sm_90 table
# is the project's own H100 measurement (benchmarks/results/h100-2026-11-25/gemm_alignment.txt: medians
# 0.733 at 2.75e11 and 0.722 from 2.15e12) in place of an estimate from Bekman's best-shape MAMF (0.775
# at 1e12): the layer's GEMMs 4-5% slower. h100 175B NeMo 512 -18.79% -> -15.90%; no other family uses
# that profile (the MoE rows do: README).
PINNED: dict[tuple[str, str], float] = {
    ("pinned", "1.7B"): +0.0005,
    ("pinned", "39.1B"): +0.0315,
    ("pinned", "22B"): +0.0554,
    ("pinned", "175B"): +0.0412,
    ("pinned", "22B SP+sel."): -0.0593,
    ("analytic", "1.7B"): -0.0237,
    ("analytic", "39.1B"): +0.0387,
    ("analytic", "22B"): +0.0594,
    ("analytic", "175B"): +0.0487,
    ("table1", "7.5B"): -0.0167,
    ("table1", "18.4B"): -0.0040,
    ("h100", "175B NeMo 512"): -0.1590,
    ("flash", "FA2 1.3B 2k"): -0.0679,
    ("flash", "FA2 2.7B 2k"): -0.0215,
    ("flash", "FA1 (T1) 1.3B 2k"): +0.0169,
    ("flash", "FA1 (T1) 2.7B 2k"): +0.0019,
    ("flash", "FA1 GPT3-125M"): -0.0387,
    ("flash", "FA1 GPT3-1.3B"): +0.0313,
    ("flash", "FA2 2.7B 8k"): -0.0253,
    ("flash", "FA1 (T1) 2.7B 8k"): -0.0012,
    ("flash", "FA1 GPT3-760M"): +0.0192,
    ("flash", "FA1 GPT2-1.6B"): -0.1038,
}

# family -> the bound on its mean |error| over the pinned subset, where the family meets the
# benchmark's target today (`_errors_summary`: mean <= 10%; issue 14's: mean <= 5%); the flash
# family does not (its six pinned cases: 5.3% in session 33), so it has per-case pins only;
# table1's two rows, 11.4% under micro-batch 1 (session 28), are 9.0% as the authors' script ran
# them (session 31); with the unfused attention core's measured A100 speed (session 32) pinned,
# analytic and table1 meet issue 14's 5% (3.2%, 2.7% and 3.1%); h100 (its one pinned case) does not
# since its pipeline sends are hidden as Megatron-Core runs them (session 37: -0.3% -> -5.4%)
MEAN_BOUND = {"pinned": 0.05, "analytic": 0.05, "table1": 0.05}

FAMILIES = {"pinned": CASES, "analytic": CASES, "table1": TABLE1, "h100": H100_CASES, "flash": FLASH_CASES}

_errors: dict[tuple[str, str], float] = {}


def _case(family: str, name: str):
    (case,) = [c for c in FAMILIES[family] if c.name == name]
    return case


def _error(family: str, name: str) -> float:
    """predicted / published - 1 of one case, as the benchmark computes it (cached per session)."""
    key = (family, name)
    if key not in _errors:
        case = _case(family, name)
        cluster = load_cluster(case)
        if family == "analytic":
            pred = analytic(case, cluster)["total"]
        else:
            pred = plan_case(case, cluster).predicted.iteration_time_s
        _errors[key] = pred / case.published_time() - 1
    return _errors[key]


def _describe(family: str, name: str) -> str:
    case = _case(family, name)
    published = (f"{case.published_s} s per iteration" if case.published_s is not None
                 else f"{case.published_tokens_per_s:.0f} tokens/s" if case.published_tokens_per_s is not None
                 else f"{case.published_tflops} TFLOP/s per GPU")
    return (f"{family} case {name!r} (published {published} = {case.published_time():.3f} s; {case.source}; "
            f"software {case.software}, hardware {case.hardware})")


@pytest.mark.parametrize("family,name", list(PINNED), ids=[f"{f}:{n}" for f, n in PINNED])
def test_case_error_pinned(family: str, name: str) -> None:
    err, pinned = _error(family, name), PINNED[(family, name)]
    assert abs(err - pinned) <= TOLERANCE, (
        f"{_describe(family, name)}: predicted error {err:+.1%}, pinned {pinned:+.1%} +- {TOLERANCE:.0%}. "
        "If the change is meant to move this prediction, re-record with `python tests/test_calibration.py` "
        "and re-run the README's accuracy tables")


@pytest.mark.parametrize("family", list(MEAN_BOUND))
def test_family_mean_within_target(family: str) -> None:
    names = [n for f, n in PINNED if f == family]
    errs = {n: _error(family, n) for n in names}
    mean = sum(abs(e) for e in errs.values()) / len(errs)
    assert mean <= MEAN_BOUND[family], (
        f"{family}: mean |error| {mean:.1%} over {', '.join(f'{n} {e:+.1%}' for n, e in errs.items())} "
        f"exceeds the target {MEAN_BOUND[family]:.0%} it met when pinned")


def test_pinned_names_exist() -> None:
    """Every pinned case is one of the benchmark's, with its source named (a renamed case would
    otherwise go unchecked)."""
    for family, name in PINNED:
        assert [c.name for c in FAMILIES[family]].count(name) == 1, (family, name)
        assert _case(family, name).source, (family, name)



def test_table1_rows_run_the_authors_configuration_and_price_their_tp_all_reduces_from_the_table() -> None:
    """Session 31: Table 1's 7.5B and 18.4B were +9.6% / +13.3% because every row assumed micro-batch
    1 and DDP local: 16 tensor-parallel all-reduces of 16 MiB where the run made one of 256 MiB, at
    the measured table's worst bus bandwidth. The rows now carry the authors' script's configuration
    (Megatron-LM examples/sc21/run_table_1.sh), and the plan's collectives and their price are the
    hand count: 6 all-reduces a layer and micro-batch (2 forward, 2 recomputed, 2 backward), 4 for
    the embedding and head, 1 gradient all-reduce; each the 8-GPU table's 256 MiB row (2420.6 us)
    scaled to 4 GPUs by the alpha-beta ratio (230 GB/s, 3.1 us: 1769.3 / 2085.9 us)."""
    from cost_models.communication import measured_time

    sc21 = {c.name: (c.microbatch, c.v, c.software) for c in TABLE1}
    assert sc21["7.5B"] == (16, 1, "megatron-lm-2021-torch-ddp")
    assert sc21["18.4B"] == (8, 1, "megatron-lm-2021-torch-ddp")
    assert sc21["39.1B"] == (4, 1, "megatron-lm-2021") and sc21["76.1B"] == (2, 3, "megatron-lm-2021")
    case = _case("table1", "7.5B")
    cluster = load_cluster(case)
    plan = plan_case(case, cluster)
    m, layers = case.num_microbatches, case.layers
    assert plan.predicted.collectives["all_reduce"] == m * (6 * layers + 4) + 1 == 221
    act = 2048 * 4096 * 2 * case.microbatch
    formula4 = 2 * 3 * 3.1e-6 + 2 * 3 / 4 * act / 230e9
    formula8 = 2 * 7 * 3.1e-6 + 2 * 7 / 8 * act / 230e9
    assert measured_time("all_reduce", act, 4, cluster.intra_node) == pytest.approx(
        2.4206e-3 * formula4 / formula8, rel=1e-9)
    assert measured_time("all_reduce", act, 4, cluster.intra_node) == pytest.approx(2.0532e-3, rel=1e-4)

if __name__ == "__main__":
    # re-record: print PINNED with today's errors
    for family, name in PINNED:
        print(f'    ("{family}", "{name}"): {_error(family, name):+.4f},')
