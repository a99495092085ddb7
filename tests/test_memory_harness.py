"""Issue 18, "memory predictions that hold": plans from `autopar.plan` run on the real runtime
(gloo, 2 processes, gpt-tiny) with their second step under torch's MemTracker
(`autopar.runtime.memory_tracking`); every rank's tracked peak must be within `TOLERANCE` of the
plan's prediction for the stage it belongs to. Plus checks of the harness itself (that it sees
the model states the runtime is known to hold) and of `autopar run`'s summary.

One launch runs every case (`benchmarks/memory_accuracy.py`, which prints the full table)."""

from __future__ import annotations

import pytest

from autopar.runtime.memory_tracking import DETAIL_CATEGORIES
from benchmarks.memory_accuracy import category_within, compare, make_plans, measure, phase_categories
from cost_models.schedules import RECV_GRADS, RECV_INPUTS, held_moments

pytestmark = pytest.mark.slow

TOLERANCE = 0.05   # |predicted - tracked| / tracked, per rank (the figure)

GBS = 32
CASES = {
    "dp2_zero0": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "recompute": "none"},
    "dp2_zero2": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "recompute": "none"},
    "dp2_zero3": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "recompute": "none"},
    "dp2_selective": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "recompute": "selective"},
    "dp2_full": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "recompute": "full"},
    "pp2_1f1b": {"dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b", "num_microbatches": 4, "recompute": "none"},
    "tp2": {"dp": 1, "tp": 2, "pp": 1, "recompute": "none"},
    "tp2_full": {"dp": 1, "tp": 2, "pp": 1, "recompute": "full"},
    "pp2_1f1b_full": {"dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b", "num_microbatches": 4, "recompute": "full"},
    # Hugging Face GPT-2 (tiny config): its tanh GELU's backward, the unsharded gradients FSDP
    # holds until a unit's reduce-scatter, the tied embedding's gradient summed in autograd's
    # buffer: the peak is in the last block's backward (the first backward's moments with the
    # parameter gradients made so far, `_Tables.first_backward`)
    "hf_gpt2_zero3": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "recompute": "none"},
    # Hugging Face Llama (tiny config): rotary tables made once and read by every layer (no
    # gradient), RMSNorm in fp32 beside a residual stream in bf16; under ZeRO-3 the head's and
    # the final norm's backward holds their own small units and the last block's prefetched,
    # the block's its own and the one before (the first backward's moments by module,
    # `_Tables.first_backward`): was +6.2%, every category now within 1 KiB
    "hf_llama_zero3": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "recompute": "none"},
    # the zoo MLP under ZeRO-3 with 2 micro-batches: FSDP accumulates unsharded gradients in
    # `.grad` over the first and reduce-scatters each unit's in the last one's backward
    "mlp_zero3_accum": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3},
    # the same, reduce-scattering every micro-batch's gradients (`Plan.zero3_grad_sync`): the
    # fp32 shards accumulated in place of the unsharded gradients
    "mlp_zero3_each": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "num_microbatches": 4,
                       "zero3_grad_sync": "microbatch"},
    # the zoo MLP tensor-parallel, run op by op (its layers meet at their boundaries,
    # `IlpProvider._boundaries`): the last layer's row-parallel matmul reads the ReLU's whole
    # output as a slice, whose gradient the executor gathers back after the matmul's backward
    # (the shard it saved freed, the gather's copy and buffer beside the result): the peak
    "mlp_tp2": {"dp": 1, "tp": 2, "pp": 1},
    # the zoo MoE at ep 2 under ZeRO-1 (one copy of each expert): the dense gradients' flat
    # buffer over dp while the experts' stay alive, then the experts' own flat (their shard),
    # AdamW stepping the two flat shards in turn (`_Tables._expert_zero12_sync`)
    "moe_ep2_zero1": {"dp": 2, "tp": 1, "pp": 1, "ep": 2, "zero_stage": 1, "recompute": "none"},
    # the same with "norm_act" (issue 17, `runtime.discard`): the norms' and the experts' SiLU
    # product's outputs freed once saved, re-made in the backward (session 35: within 0.3% on
    # both ranks, activations tracked/predicted 555.6/555.2 and 552.5/555.2 KiB, 32 KiB under
    # "none"'s)
    "moe_ep2_norm_act": {"dp": 2, "tp": 1, "pp": 1, "ep": 2, "zero_stage": 1, "recompute": "norm_act"},
    # the zoo MoE at dp 4 x ep 2 under ZeRO-3 (each experts module an FSDP unit over its 2
    # copies, nested in its layer's), 2 micro-batches each reduce-scattered: the peak is the
    # second micro-batch's loss (forward or backward, within 1%), nothing gathered: was -5.3%
    # (activations 183/144, the runtime holding the rank's whole fp32 expert slices beside their
    # shards: 48 KiB "other"), +9.5% once that was freed (the bound's units at the loss)
    "moe_ep2_zero3_each": {"dp": 4, "tp": 1, "pp": 1, "ep": 2, "zero_stage": 3, "num_microbatches": 2,
                           "zero3_grad_sync": "microbatch", "recompute": "none"},
    # ZeRO-3 with one copy of each expert (ep = dp): FSDP leaves the experts alone, so each rank
    # holds its experts' 2-byte weights whole beside the dense units' shards: was -2.5%, weights
    # 24/0 KiB (HF Mixtral's dp8 x ep8 ZeRO-3 plan verified -8.4% at full scale, session 35)
    "moe_ep2_zero3_one_copy": {"dp": 2, "tp": 1, "pp": 1, "ep": 2, "zero_stage": 3, "recompute": "none"},
    # context parallelism: the attention saves the gathered K and V (put in sequence order), new
    # tensors, while the rank's own K and V stay alive inside the fused qkv projection's output
    # the query is a view of (`context_parallel.kept_kv_bytes`): was -4.2%, activations 845/781 KiB
    "cp2": {"dp": 1, "tp": 1, "pp": 1, "cp": 2, "recompute": "none"},
    # cp with full recomputation, fp32: the tracked peak is in block 0's recomputed backward, at
    # its MLP's, with the re-gathered K and V and the concatenated attention output alive (the
    # re-run attention saved them); they were missing at that moment, the full-length K and V
    # gradients added instead to the layer's worst moment (they live at the attention's
    # backward alone): was -13.2%, activations 680/520 KiB (`context_parallel.
    # _recomputed_attention`, `ActivationMemory.attention_regions`)
    "cp2_full_fp32": {"dp": 1, "tp": 1, "pp": 1, "cp": 2, "recompute": "full"},
    # pp2 x cp2, 1F1B, fp32, 4 processes: stage 0's peak is a backward moment of its MLP, where
    # the full-length K and V gradients (and the causal calls' copies) of the attention's
    # backward were counted, as activations: was +4.6%, activations 364/404 KiB
    # (`context_parallel._saved_attention`, `ActivationMemory.attention_moments`)
    "pp2_cp2_fp32": {"dp": 1, "tp": 1, "pp": 2, "cp": 2, "schedule": "1f1b", "num_microbatches": 4,
                     "recompute": "none"},
    # Hugging Face Falcon (tests/user_models.py, written by others): multi-query attention hands
    # sdpa one K/V head for the query's 4, which no fused kernel takes: torch's math path
    # saves fp32 copies of q and of K and V broadcast to the query's heads and the
    # probabilities (`memory.attention_is_fused`); its `x @ w.T` projections and in-place
    # residual add save no weight and nothing: was -6.4%, activations 5259/4736 KiB
    "falcon_tp2": {"dp": 1, "tp": 2, "pp": 1, "recompute": "none"},
    # Hugging Face Phi-3 with full recomputation: the peak is a recomputed layer's RMSNorm
    # backward in fp32 (pow's two temporaries, the broadcast product's, the norm's own fp32
    # gradient beside the bf16 residual stream's, the layer's MLP weight gradients made
    # before it): was -5.1%, gradients 32/8 and activations 971/1294 KiB
    "phi3_tp2_full": {"dp": 1, "tp": 2, "pp": 1, "recompute": "full"},
    # Hugging Face BLOOM: its GELU is a custom autograd Function (`GeLUFunction`) that saves its
    # input alone and recomputes the tanh formula in its backward; the capture records the
    # formula's ops (`capture.functions`), whose saves were counted: was +56.0% (bf16) and
    # +71.5% (fp32) under ZeRO-3, activations 2345/5322 and 4178/10323 KiB. Under tp the
    # executor runs the Function too (it ran the formula's ops, autograd through them)
    "bloom_zero3": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "recompute": "none"},
    "bloom_zero3_fp32": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "recompute": "none"},
    "bloom_tp2_fp32": {"dp": 1, "tp": 2, "pp": 1, "recompute": "none"},
}
# cases in another dtype than bf16, and on 4 processes
DTYPES = {"cp2_full_fp32": "fp32", "pp2_cp2_fp32": "fp32", "bloom_zero3_fp32": "fp32", "bloom_tp2_fp32": "fp32"}
NPROC = {"pp2_cp2_fp32": 4, "moe_ep2_zero3_each": 4}
# cases on another model than gpt-tiny: (model reference, global batch)
MODELS = {"hf_gpt2_zero3": ("hf:gpt2?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&seq_len=16"
                            "&vocab_size=128", 8),
          "hf_llama_zero3": ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2"
                             "&num_hidden_layers=2&num_attention_heads=4&seq_len=16&vocab_size=128", 8),
          "falcon_tp2": ("tests.hf_architectures:falcon", GBS), "phi3_tp2_full": ("tests.hf_architectures:phi3", GBS),
          "bloom_zero3": ("tests.hf_architectures:bloom", GBS),
          "bloom_zero3_fp32": ("tests.hf_architectures:bloom", GBS),
          "bloom_tp2_fp32": ("tests.hf_architectures:bloom", GBS),
          "mlp_zero3_accum": ("mlp-tiny", 256),
          "mlp_zero3_each": ("mlp-tiny", 256), "mlp_tp2": ("mlp-tiny", 256), "moe_ep2_zero1": ("moe-tiny", 16),
          "moe_ep2_norm_act": ("moe-tiny", 16),
          "moe_ep2_zero3_each": ("moe-tiny", 16), "moe_ep2_zero3_one_copy": ("moe-tiny", 16)}
PSI = 30080          # gpt-tiny's parameters (the embedding tied to the output layer)


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp("plans"))
    specs = [{"name": k, "model": MODELS.get(k, ("gpt-tiny",))[0], "nproc": NPROC.get(k, 2),
              "gbs": MODELS.get(k, (0, GBS))[1], "dtype": DTYPES.get(k, "bf16"), "constraints": c}
             for k, c in CASES.items()]
    done, skipped = make_plans(specs, folder)
    assert not skipped, [(s["name"], s["reason"]) for s in skipped]
    return {s["name"]: s for s in done}


@pytest.fixture(scope="module")
def measured(planned) -> dict:
    specs = list(planned.values())
    mp = pytest.MonkeyPatch()
    mp.setenv("AUTOPAR_MEMORY_TOP", "4")     # the launched workers list their peak's largest tensors
    try:
        return {r["name"]: r for r in compare(specs, measure(specs))}
    finally:
        mp.undo()


def _table(rec: dict) -> str:
    return "\n".join(f"rank {r['rank']}: tracked {r['tracked']} ({r['tracked_phase']}) predicted "
                     f"{r['predicted']:.0f} ({r['predicted_phase']}); tracked {r['tracked_categories']} "
                     f"predicted {r['predicted_categories']}; detail {r['tracked_detail']}"
                     for r in rec["ranks"])


# Known misses, each a strict xfail that fails once the model is right (then drop it here).
# None at present: the benchmark's table (`benchmarks/memory_accuracy.py`, 78 combinations, all
# within 5% in session 13) covers the cases not pinned here.
KNOWN_MISSES: dict[str, str] = {}


def _cases(misses: dict[str, str]) -> list:
    """Every case, those in `misses` as strict xfails with their reason."""
    return [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=misses[c])) if c in misses else c
            for c in CASES]


def _ranks(measured: dict, case: str) -> list[dict]:
    rec = measured[case]
    assert "error" not in rec, rec.get("error")
    return rec["ranks"]


@pytest.mark.parametrize("case", _cases(KNOWN_MISSES))
def test_predicted_peak_within_tolerance_of_tracked(measured, case):
    rec = measured[case]
    errs = [r["error"] for r in _ranks(measured, case)]
    assert all(e is not None for e in errs), _table(rec)
    for e in errs:
        assert abs(e) <= TOLERANCE, f"{case}: {100 * e:+.1f}% (tolerance {100 * TOLERANCE:.0f}%)\n{_table(rec)}"


def test_cp_peaks_with_recomputation_and_in_a_pipeline_are_torchs(measured):
    """The two context-parallel layouts the model missed most, each rank's predicted peak
    against torch's tracked one, within 1.5% (was -13.2% and +4.6%), and the activations at the
    peak within 2% (were 680/520 and 364/404 KiB)."""
    for case in ("cp2_full_fp32", "pp2_cp2_fp32"):
        rec = measured[case]
        for r in _ranks(measured, case):
            assert abs(r["error"]) <= 0.015, f"{case}: {100 * r['error']:+.1f}%\n{_table(rec)}"
            got, pred = r["tracked_categories"]["activations"], r["predicted_categories"]["activations"]
            assert abs(pred - got) <= 0.02 * got, f"{case} rank {r['rank']}: activations {got} / {pred:.0f}"


def test_models_written_by_others_peak_where_torch_does(measured):
    """Falcon's multi-query attention on torch's math path and Phi-3's recomputed fp32 RMSNorm
    backward (session 31): each rank's predicted peak within 1% of torch's tracked one (were
    -6.4% and -5.1%), every category at the peak within 2% or 2 KiB (activations were 5259/4736
    and 971/1294 KiB, Phi-3's gradients 32/8)."""
    for case in ("falcon_tp2", "phi3_tp2_full"):
        rec = measured[case]
        for r in _ranks(measured, case):
            assert abs(r["error"]) <= 0.01, f"{case}: {100 * r['error']:+.1f}%\n{_table(rec)}"
            for c, got in r["tracked_categories"].items():
                pred = (r["predicted_categories"] or {}).get(c, 0.0)
                assert abs(pred - got) <= max(0.02 * got, 2048), f"{case} rank {r['rank']}: {c} {got} / {pred:.0f}"


def test_expert_parallel_zero3_peaks_where_torch_does(measured):
    """moe-tiny dp4 x ep2, ZeRO-3 reduce-scattering each of 2 micro-batches: every rank's peak
    within 3% of the plan's (was -5.3%, then +9.5%) and activations within 3% (were 183/144
    KiB: the exchange's saved indices, 4 int64 per received row a block, were not counted,
    `ExpertCosting.row_index_saved`); the rank holds nothing the runtime does not know of (its
    whole fp32 expert slices, 48 KiB, were kept beside FSDP's shards); and the optimizer step's
    buffers are AdamW's temporaries of an expert shard over its 2 copies, not over dp."""
    rec = measured["moe_ep2_zero3_each"]
    for r in _ranks(measured, "moe_ep2_zero3_each"):
        assert abs(r["error"]) <= 0.03, f"{100 * r['error']:+.1f}%\n{_table(rec)}"
        got, pred = r["tracked_categories"]["activations"], r["predicted_categories"]["activations"]
        assert abs(pred - got) <= 0.03 * got, f"rank {r['rank']}: activations {got} / {pred:.0f}"
        assert r["tracked_detail"]["other"] < 1024, r["notes"]
        opt = r["tracked_phases"]["optimizer"]["buffers"]
        assert category_within(opt, r["predicted_phases"]["optimizer"]["buffers"], 0.05), opt


def test_expert_weights_held_whole_under_zero3_with_one_copy(measured):
    """moe-tiny dp2 x ep2 under ZeRO-3: one copy of each expert, which FSDP leaves alone; the
    rank's 2-byte expert weights, held whole through the step, are in the plan's weights at the
    peak (within 2% or 2 KiB; were 24 / 0 KiB) and the peak within 2%."""
    rec = measured["moe_ep2_zero3_one_copy"]
    for r in _ranks(measured, "moe_ep2_zero3_one_copy"):
        assert abs(r["error"]) <= 0.02, f"{100 * r['error']:+.1f}%\n{_table(rec)}"
        got, pred = r["tracked_categories"]["weights"], (r["predicted_categories"] or {}).get("weights", 0.0)
        assert abs(pred - got) <= max(0.02 * got, 2048), f"rank {r['rank']}: weights {got} / {pred:.0f}"


def test_custom_autograd_function_peaks_where_torch_does(measured):
    """BLOOM's custom GELU Function counted as what it saves (its input) and what its backward
    holds (measured on meta), on the eager path (ZeRO-3) and the executor's (tp 2): fp32 peaks
    within 1% of torch's tracked ones (ZeRO-3 was +71.5%), activations within 2%."""
    for case in ("bloom_zero3_fp32", "bloom_tp2_fp32"):
        rec = measured[case]
        for r in _ranks(measured, case):
            assert abs(r["error"]) <= 0.01, f"{case}: {100 * r['error']:+.1f}%\n{_table(rec)}"
            got, pred = r["tracked_categories"]["activations"], r["predicted_categories"]["activations"]
            assert abs(pred - got) <= 0.02 * got, f"{case} rank {r['rank']}: activations {got} / {pred:.0f}"


# Per category (weights, gradients, optimizer, activations, buffers) at the peak, within 5% or
# 2 KiB (the tracker's and the plan's categories split a few small tensors differently: FSDP's
# unsharded parameter storages vs its flat all-gather output). Known misses, strict: none.
CATEGORY_MISSES: dict[str, str] = {
    "pp2_cp2_fp32": "stage 0's buffers at the peak 58/50 KiB (its MLP's backward temporaries; the "
                    "total within 1.2%), as before session 31's cp fixes",
    "mlp_zero3_each": "weights 0/8, gradients 24/16 KiB (the total within 2.8%): the run peaks as a unit's "
                      "backward ends (its weights resharded, its whole gradient alive beside every fp32 "
                      "shard while it is reduce-scattered), the plan at the first backward's moment with a "
                      "unit gathered"}
# (pp2_1f1b_full was one until the recomputed block's backward counted its output's gradient,
# the receive buffer, once, and the tracker labelled the block's re-made residual sums as the
# recomputation's activations: `memory_tracking.recomputing`; mlp_zero3_accum until a later
# micro-batch's backward under ZeRO-3 was taken moment by moment with each op's units, the
# units reduce-scattered and the reduce-scatter input FSDP keeps: `_Tables.first_backward`'s
# `accumulated`)


@pytest.mark.parametrize("case", _cases(CATEGORY_MISSES))
def test_predicted_categories_within_tolerance_of_tracked(measured, case):
    rec = measured[case]
    for r in _ranks(measured, case):
        for cat, pred in r["predicted_categories"].items():
            got = r["tracked_categories"][cat]
            assert category_within(got, pred, TOLERANCE), \
                f"{case} rank {r['rank']} {cat}: tracked {got} predicted {pred:.0f}\n{_table(rec)}"


# Each phase's own peak (forward/backward, gradient sync, optimizer step: `StagePrediction.phases`
# against `MemoryReport.phases`), every category. Known misses, strict:
PHASE_MISSES: dict[str, str] = {k: CATEGORY_MISSES[k] for k in ("pp2_cp2_fp32", "mlp_zero3_each")}
PHASE_MISSES["moe_ep2_zero3_one_copy"] = (
    "the optimizer step's buffers 42 / 34 KiB (session 35): 8 KiB more than AdamW's temporaries of the "
    "largest tensor stepped while the experts' fp32 master gradients are alive; not traced (the step's "
    "peak is 40% of the forward/backward's, which holds)")


# Every phase of every plan is compared by category. Two were left out, each for gloo's timing:
# the ZeRO plans' optimizer-step buffers (gloo's reduce-scatter works on a clone of its input
# that its worker thread dropped some time after the wait, one flat gradient, dp2 ZeRO-1, still
# held through the update in about one run in three; FSDP2's flat all-gather output lived on
# while that thread was late) and the tensor-parallel plans' optimizer phase (a buffer of
# DTensor's backward collectives released at a varying time moved the phase's peak to another
# moment of the masters' fp32 gradients: 2 suite runs in about 12). The runtime now ends each
# collective's hold on its operands with the call (`runtime.tied_grads.gloo_copies_released`,
# `gloo_quiesced`, `GlooFunctionalSync`), the same moment in every run.


@pytest.mark.parametrize("case", _cases(PHASE_MISSES))
def test_every_phase_predicted_by_category(measured, case):
    for r in _ranks(measured, case):
        rows = phase_categories(r)
        # no gradient sync phase without data parallelism in the plan
        assert {ph for ph, *_ in rows} >= {"forward_backward", "optimizer"}, rows
        for ph, cat, got, pred in rows:
            assert category_within(got, pred, TOLERANCE), \
                f"{case} rank {r['rank']} {ph} {cat}: tracked {got} predicted {pred:.0f}"


def test_harness_sees_the_model_states_the_runtime_holds(measured):
    """bf16 + AdamW: 2-byte parameters, 4-byte masters, two 4-byte moments (+ a step counter per
    tensor); ZeRO-1/2 master and moments are the dp shard; ZeRO-3 FSDP's fp32 shard is the
    master and the bf16 weights exist only gathered; tp holds local shards; a pipeline holds
    torch.pipelining's receive buffers."""
    d0 = measured["dp2_zero0"]["ranks"][0]["tracked_detail"]
    assert d0["params"] == 2 * PSI and d0["master"] == 4 * PSI
    assert 8 * PSI <= d0["optimizer_state"] <= 8 * PSI + 64 * 8
    assert d0["activations"] > 0
    d2 = measured["dp2_zero2"]["ranks"][0]["tracked_detail"]
    assert d2["params"] == 2 * PSI and d2["master"] == 4 * PSI // 2
    assert 8 * PSI // 2 <= d2["optimizer_state"] <= 8 * PSI // 2 + 64
    d3 = measured["dp2_zero3"]["ranks"][0]
    assert d3["tracked_detail"]["params"] == 0
    assert d3["tracked_detail"]["master"] >= 4 * PSI // 2            # fp32 shards (padded per tensor)
    assert d3["tracked_detail"]["master"] <= 4 * PSI // 2 + 4 * 64
    tp = measured["tp2"]["ranks"]
    assert tp[0]["tracked_detail"]["params"] == tp[1]["tracked_detail"]["params"] < 2 * PSI
    for r in measured["pp2_1f1b"]["ranks"]:
        # receive buffers of one micro-batch's boundary activation (or its gradient), [8, 16, 32]
        # in bf16, made when the schedule posts the receive and dropped after the micro-batch's
        # backward (`JustInTimeStage`): as many as the schedule's order has alive at the peak,
        # a backward's start (rank 0: its output's gradient; rank 1: its one input in flight),
        # not torch's M = 4 of each per stage
        pre, post = held_moments("1f1b", 2, r["rank"], 4)
        alive = max(int(mo[RECV_INPUTS].sum() + mo[RECV_GRADS].sum()) for mo in [*pre, *post])
        assert alive == 1
        assert r["tracked_detail"]["pipeline_buffers"] == alive * 8 * 16 * 32 * 2
    for rec in measured.values():
        for r in rec["ranks"]:
            assert set(r["phases"]) == {"forward_backward", "grad_sync", "optimizer"}
            assert r["tracked"] == max(r["phases"].values())
            # what the peak holds, largest first, each storage with the op that made it
            top = r["peak_tensors"]
            assert len(top) == 4 and [t["bytes"] for t in top] == sorted((t["bytes"] for t in top), reverse=True)
            assert sum(t["bytes"] for t in top) <= r["tracked"]
            assert all(t["label"] in DETAIL_CATEGORIES and t["op"] for t in top)
    # gpt-tiny's largest activations are the head's logits-sized tensors, made in the forward
    top = measured["dp2_zero0"]["ranks"][0]["peak_tensors"]
    assert top[0]["pass"] == "forward" and top[0]["op"].startswith("aten.") and top[0]["shape"][-1] == 128


def test_fsdp_accumulated_unsharded_gradients_count_as_gradients(measured):
    """FSDP2's unsharded gradients (`.grad` of its unsharded parameters, accumulated over the
    micro-batches until a unit's reduce-scatter) are labelled gradients, as the plan counts them
    (`cost_models.memory.runtime_phases`, ZeRO 3), not backward temporaries: at mlp-tiny's peak
    (the second micro-batch's backward) the first two layers' accumulated bf16 gradients (4 + 8
    KiB) beside the last layer's fp32 shard (4 KiB); the tracker had 4 KiB (the shard alone)."""
    for r in _ranks(measured, "mlp_zero3_accum"):
        got, pred = r["tracked_categories"]["gradients"], r["predicted_categories"]["gradients"]
        assert got > 8 * 1024 and category_within(got, pred, TOLERANCE), (got, pred)
        fb = r["tracked_phases"]["forward_backward"]["gradients"]
        assert category_within(fb, r["predicted_phases"]["forward_backward"]["gradients"], TOLERANCE)


def test_run_summary_reports_tracked_memory_beside_the_prediction(planned):
    """`autopar.runtime.run` on CPU (the pipeline: its ranks differ): rows carry the tracked
    peak, the summary the fullest rank's categories, the fullest stage's predicted ones and each
    rank against its stage."""
    from autopar.runtime import run

    rows = run(planned["pp2_1f1b"]["path"], "gpt-tiny", steps=3, quiet=True)
    steps, summary = rows[:-1], rows[-1]
    assert [r["memory_tracked"] for r in steps] == [True, True, False]
    assert steps[2]["peak_memory_bytes"] == steps[1]["peak_memory_bytes"] > 0
    assert summary["memory_source"] == "tracked"
    fullest = max(r["tracked_peak_bytes"] for r in summary["memory_per_rank"])
    assert summary["measured_peak_memory_bytes"] >= fullest == steps[1]["peak_memory_bytes"]
    mm = summary["measured_memory"]
    assert sum(mm["categories"].values()) == mm["peak_bytes"] == fullest
    pm = summary["predicted_memory"]
    assert pm["peak_bytes"] == summary["predicted_peak_memory_bytes"]
    assert {"weights", "gradients", "optimizer", "activations", "buffers", "peak_phase"} <= set(pm)
    per = {r["rank"]: r for r in summary["memory_per_rank"]}
    assert per[0]["predicted"]["stage"] == 0 and per[1]["predicted"]["stage"] == 1
