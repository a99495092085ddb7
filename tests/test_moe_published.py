"""The published MoE runs of `benchmarks/moe_plans.py --published` (issue 17): each case's layout
is a valid pin, its model resolves to the checkpoint's public config, and a Hugging Face
Qwen3-MoE (the family those runs train) is captured with its experts recognised and planned at
the ep it is pinned to. Timings are the benchmark's, not asserted here."""

import importlib.util
import sys
from pathlib import Path

import pytest

from autopar import ClusterSpec, Constraints
from autopar.capture import capture
from autopar.capture.experts import find_expert_blocks
from autopar.models import build_model
from autopar.planner import plan


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_plans.py"
    spec = importlib.util.spec_from_file_location("moe_plans", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_plans"] = mod       # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_each_published_case_is_a_valid_pin_on_its_gpu_count():
    """dp x tp x pp of every pinned layout is the run's GPU count (8 per DGX node) and each pin
    is a valid `Constraints`; every case names its source and what was assumed, and the fields
    of its software preset it changes are `SoftwareSpec` fields with valid values."""
    from autopar.schema.software import SoftwareSpec

    for case in _bench().PUBLISHED:
        base = SoftwareSpec.load(case.software)
        changed = SoftwareSpec.model_validate({**base.model_dump(), **case.software_update})
        assert all(getattr(changed, k) == v for k, v in case.software_update.items()), case.name
        c = Constraints(**case.pins)
        assert c.dp * (c.tp or 1) * (c.pp or 1) == 8 * case.nodes, case.name
        assert case.source and case.assumed and case.flops_rule
        assert case.seconds is not None or case.tflops is not None


def test_published_norm_act_rows_pin_norm_act():
    """The zoo's rows run with recompute "norm, act" (`--recompute-modules moe_act layernorm`,
    Megatron-Core's output-discarding recomputation, issue 17) pin autopar's "norm_act", the
    same policy: rows 1 and 4."""
    rows = [c for c in _bench().PUBLISHED if "'norm, act'" in c.assumed]
    assert [c.source.rsplit("row ", 1)[-1][:1] for c in rows] == ["1", "4"]
    assert all(c.pins["recompute"] == "norm_act" for c in rows)


def test_published_expert_data_parallelism_is_megatrons_folded_edp():
    """Where a source gives EDP with ETP1 under TP > 1 (Megatron-Core's MoE parallel folding),
    the pin's expert_dp is it and ep x expert_dp = dp x tp: the expert mesh over the dense tp and
    dp ranks (autopar's folded experts), not dp / ep."""
    folded = [c for c in _bench().PUBLISHED if c.pins.get("expert_dp") is not None]
    assert len(folded) == 4
    for case in folded:
        p = case.pins
        assert p["tp"] > 1 and p["expert_tp"] == 1, case.name
        assert p["ep"] * p["expert_dp"] == p["dp"] * p["tp"], case.name
        assert f"EDP{p['expert_dp']}" in case.source, case.name


def test_qwen3_presets_have_the_checkpoints_parameter_counts():
    """Qwen/Qwen3-30B-A3B (30.5B parameters, model card) and Qwen3-235B-A22B (235B) as built
    from the presets, on the meta device."""
    pytest.importorskip("transformers")
    for ref, total in (("hf:qwen3-30b-a3b", 30.5e9), ("hf:Qwen/Qwen3-235B-A22B", 235e9)):
        b = build_model(ref, batch_size=1)
        n = sum(p.numel() for p in b.model.parameters())
        assert abs(n - total) / total < 0.01, (ref, n)


def test_hf_qwen3_moe_experts_found_and_planned_at_the_pinned_ep():
    """A tiny Qwen3-MoE: both layers' expert blocks found (top-8 of 16 experts), and a plan pinned
    to dp 4 x ep 4 on 4 ranks places 4 experts per rank."""
    pytest.importorskip("transformers")
    ref = ("hf:qwen3_moe?hidden_size=64&intermediate_size=128&moe_intermediate_size=32&head_dim=16"
           "&num_key_value_heads=2&num_experts=16&num_experts_per_tok=8&num_hidden_layers=2"
           "&num_attention_heads=4&vocab_size=128&seq_len=16")
    b = build_model(ref, batch_size=2)
    g = capture(b.model, b.example_inputs, name=ref)
    blocks = find_expert_blocks(g)
    assert [x.module for x in blocks] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {(x.num_experts, x.top_k, x.hidden) for x in blocks} == {(16, 8, 64)}
    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    p = plan(ref, cpu, global_batch_size=8, dtype="fp32", graph=g,
             constraints=Constraints(dp=4, tp=1, pp=1, ep=4, zero_stage=0, recompute="none", num_microbatches=1))
    assert p.experts.ep == 4 and p.dp == 4


def test_missing_time_host_starvation_rule():
    """`benchmarks/moe_missing_time.py`'s host rule (issue 14): launched from an empty queue at
    a host sync, the GPU idles only while the host is behind. GPU ops longer than the host's
    launch gap never wait past the first launch; ops shorter than it wait the difference each;
    a block queued at the sync (the dispatch's exchange) lets the host get ahead."""
    _bench()
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_missing_time.py"
    spec = importlib.util.spec_from_file_location("moe_missing_time", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    h = 10e-6
    assert mod.starved([50e-6] * 4, h) == pytest.approx(h)                  # the first launch only
    assert mod.starved([2e-6] * 5, h) == pytest.approx(5 * h - 4 * 2e-6)    # host-bound: n launches
    assert mod.starved([2e-6] * 5, h, first=100e-6) == pytest.approx(0.0)   # queued behind the exchange
    assert mod.HOST_OP_S == pytest.approx(2.177e-5, rel=1e-3)               # the H100 profile's figure
    # per-op host times: a loop of cheap launches behind one slow op catches up
    assert mod.starved([50e-6, 5e-6, 5e-6], [h, 1e-6, 1e-6]) == pytest.approx(h)


def test_missing_time_per_expert_gemm_candidate():
    """The per-expert GEMM candidate (issue 14): a grouped GEMM in the forward from the dispatch
    becomes `local` GEMMs of the model's time over the experts, the module's call at `HOST_OP_S`
    and the loop's calls at the per-GEMM host time; other ops keep `HOST_OP_S`. The sources'
    figures it prints are as published: TE 2.2 on an H100, bf16 (TE pull 2045), and the cuBLASLt
    call's host latency (raft pull 1736)."""
    _bench()
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_missing_time.py"
    spec = importlib.util.spec_from_file_location("moe_missing_time", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ops = [("add", "m.attn", 0.0), ("grouped_mm", "m.experts", 0.0), ("silu", "m.experts", 0.0),
           ("grouped_mm", "m.experts", 0.0)]
    rot = [1e-6, 9.0, 2e-6, 9.0]           # the grouped GEMMs' shares are replaced by the model's times
    gpu, host = mod.per_expert_launches(rot, ops, 0, 4, 10e-6, [80e-6, 40e-6])
    assert gpu == pytest.approx([1e-6] + [20e-6] * 4 + [2e-6] + [10e-6] * 4)
    assert host == pytest.approx([mod.HOST_OP_S] * 2 + [10e-6] * 3 + [mod.HOST_OP_S] * 2 + [10e-6] * 3)
    # GEMMs longer than the loop's host time: the GPU waits only for the launches before the first
    idle = mod.starved(gpu[1:5], host[1:5])
    assert idle == pytest.approx(mod.HOST_OP_S)
    assert mod.TE22_GROUPED[(16, 2048, 768, 2048)] == pytest.approx(398.81e12)
    assert mod.HOST_GEMM_S == pytest.approx(10e-6) and mod.GEMMS_PER_EXPERT == 2


def _megatron():
    _bench()      # puts benchmarks/ on sys.path (moe_plans imports its sibling)
    import megatron_flops
    return megatron_flops


def test_megatron_flops_mixtral_is_a_hand_count_of_its_gemms():
    """Megatron's formula (benchmarks/megatron_flops.py) for Mixtral 8x7B at s 4096, against the
    model's GEMMs counted one by one: per token and layer the q, k, v, o projections (GQA 32/8
    heads of 128), QK^T and PV over the whole sequence (the 2024 formula) or half of it (2025),
    two of eight SwiGLU experts (three h x 14336 GEMMs each), and once per token the logits
    (vocabulary 32000, a multiple of 128: no padding); forward and two backward GEMMs each."""
    pytest.importorskip("transformers")
    mf = _megatron()
    h, s, L, heads, groups, d, f, k, V = 4096, 4096, 32, 32, 8, 128, 14336, 2, 32000
    proj = 2 * h * heads * d * 2 + 2 * h * groups * d * 2           # q, o and k, v
    experts = k * 3 * 2 * h * f
    for half in (False, True):
        scores = 2 * 2 * s * heads * d / (2 if half else 1)         # QK^T and PV, per token
        hand = 3 * s * (L * (proj + scores + experts) + 2 * h * V)
        got = mf.megatron_flops_for_ref("hf:mixtral-8x7b?seq_len=4096", causal_half=half)
        assert got == pytest.approx(hand, rel=1e-12), half
    assert mf.padded_vocab(32000) == 32000 and mf.padded_vocab(50257, tp=2) == 50432


def test_megatron_causal_half_formula_gives_the_published_tflops_of_every_timed_row():
    """Every published row with both a step time and a TFLOP/s figure: AutoModel's 'Model TFLOPs'
    of its Qwen3 MoE 30B row (277 at 21.773 s: flops_utils.py qwen3_flops, causal attention halved,
    line 207) and the Megatron MoE model zoo's 'Per GPU TF' of the four Qwen3-235B rows (245, 276,
    200, 167 at 19.7, 17.6, 24.2, 29.0 s: 246.2, 275.6, 200.4, 167.3) are Megatron's 2025 formula
    over the step time, each within 1% (the times' three digits): an outside check of the
    implementation, and of each row's time against its TFLOP/s."""
    pytest.importorskip("transformers")
    mod = _bench()
    mf = _megatron()
    timed = [c for c in mod.PUBLISHED if c.seconds is not None and c.tflops is not None]
    assert len(timed) == 5
    for case in timed:
        per_sample = mf.megatron_flops_for_ref(case.model, causal_half=True)
        tflops = per_sample * case.global_batch / (8 * case.nodes) / case.seconds / 1e12
        assert tflops == pytest.approx(case.tflops, rel=0.01), case.name


def test_mixtral_published_tflops_turn_into_time_with_megatrons_2024_formula():
    """The Mixtral row's 468 TFLOP/s become a step time with the FLOPs Megatron counted when the
    figure was published (causal attention whole), not the plan's captured count; the rows that
    publish a time use it."""
    pytest.importorskip("transformers")
    mod = _bench()
    mf = _megatron()
    mixtral = [c for c in mod.PUBLISHED if c.name.startswith("Mixtral")]
    assert len(mixtral) == 1 and mixtral[0].seconds is None and mixtral[0].source_flops is not None
    case = mixtral[0]

    class _P:      # what published_seconds reads of a plan
        class cluster:
            num_nodes, devices_per_node = 8, 8

        class model:
            flops_per_sample = 1.0

    want = mf.megatron_flops_for_ref(case.model, causal_half=False) * 256 / (64 * 468e12)
    assert mod.published_seconds(case, _P) == pytest.approx(want)
    assert all(c.seconds is not None for c in mod.PUBLISHED if c is not case)


def test_zero_shards_expert_optimizer_state_over_their_copies_not_dp():
    """The optimizer step under ZeRO steps 1/dp of the dense weights and 1/copies of the expert
    weights (the ranks holding the same experts), as the memory model holds their states: with ep
    = dp 8 (AutoModel's Qwen3-30B-A3B: no expert data parallelism) each rank steps all its own
    experts; ZeRO-0 steps everything."""
    import numpy as np

    from autopar.inter_op.search import _Tables
    from autopar.inter_op.stage_cost import LayerCost
    from cost_models.compute import optimizer_step_time

    cluster = ClusterSpec.load("dgx-h100")
    costs = [LayerCost(act_bytes={"none": 1.0}, param_elems={"w": 100.0})]
    dense, experts = 1.6e9, 3.6e9
    for zero, ep, want in ((3, 8, dense / 8 + experts), (1, 4, dense / 8 + experts / 2), (0, 8, dense + experts)):
        tb = _Tables(costs, cluster, "bf16", 8, 1, zero, [])
        tb.set_experts(ep, np.array([1.0]))
        got = tb.opt(dense + experts, tensors=10, epel=experts)
        assert got == pytest.approx(optimizer_step_time(want, cluster.device, "bf16", param_tensors=10)), zero


_TINY_QWEN3 = ("hf:qwen3_moe?hidden_size=64&intermediate_size=128&moe_intermediate_size=32&head_dim=16"
               "&num_key_value_heads=2&num_experts=16&num_experts_per_tok=8&num_hidden_layers=2"
               "&num_attention_heads=4&vocab_size=128&seq_len=16")


def _qwen3_costing(**update):
    from autopar.inter_op.experts import ExpertCosting
    from autopar.inter_op.layers import build_layers
    from autopar.schema.software import SoftwareSpec

    b = build_model(_TINY_QWEN3, batch_size=2)
    g = capture(b.model, b.example_inputs, name=_TINY_QWEN3)
    sw = SoftwareSpec.load("nemo-megatron-core-2024").model_copy(update=update)
    return ExpertCosting(g, build_layers(g, b.model), software=sw)


def test_megatron_core_expert_saves_are_the_tensors_megatron_keeps():
    """Issue 14: under `expert_saves` "megatron_core" an expert block keeps, per token-expert pair,
    what Megatron-Core's TEGroupedMLP and TE's fused permutation save (`megatron_saved`): the
    permuted row (H), the gate/up projection's output (2F, the weighted SwiGLU's input), the fp32
    probability, the down projection's input (F, not under "norm_act": moe_act recomputation) and
    int64 row maps (DeepEP: E/ep local experts by the received rows; all-to-all: E x T and two
    chunk sorts of the pairs), bf16; in place of what Hugging Face's experts module saves, which
    also keeps the SiLU output and the down projection's output (the product by the routing
    weights keeps it), the latter two "norm_act" discarding only the SiLU's and its product."""
    pytest.importorskip("transformers")
    from autopar.inter_op.experts import random_ranks_per_token

    ec = _qwen3_costing(expert_saves="megatron_core", expert_dispatch="ranks")
    blk = ec.blocks[0]
    T, k, E, H, F, mb, ep = 16, 8, 16, 64, 32, 3, 4
    P = T * k
    assert (blk.tokens_per_sample, blk.top_k, blk.num_experts, blk.hidden) == (T, k, E, H)
    rowmap = 8 * (E // ep) * T * random_ranks_per_token(E, k, ep)
    kept = P * H * 2 + P * 2 * F * 2 + P * 4 + rowmap
    mine, one = ec.megatron_saved(blk, mb, "bf16", ep, "none")
    assert mine == pytest.approx((kept + P * F * 2) * mb)
    mine_na, one_na = ec.megatron_saved(blk, mb, "bf16", ep, "norm_act")
    assert mine_na == pytest.approx(kept * mb)
    # the module's own: "norm_act" drops the SiLU output and its product with `up` (P x F each)
    assert one - one_na == pytest.approx(2 * P * F * 2 * mb)
    # what the module keeps beyond Megatron under "none": the SiLU output, the down projection's
    # output, and its integer permutations / gathered bf16 weights in place of the row map and fp32 probs
    module, side = ec.module_saved(blk)
    assert side == 0.0
    ints = sum(o.nbytes for o in module if not o.dtype.startswith("float"))
    assert one == pytest.approx((P * H * 2 + P * 2 * F * 2 + 2 * P * F * 2 + P * H * 2 + P * 2 + ints) * mb)
    # the all-to-all dispatcher's maps: the source permute's E x T, the two chunk sorts' pairs
    a2a = _qwen3_costing(expert_saves="megatron_core", expert_dispatch="pairs")
    assert a2a.megatron_saved(a2a.blocks[0], mb, "bf16", ep, "none")[0] == pytest.approx(
        (kept - rowmap + 8 * E * T + 2 * 8 * P + P * F * 2) * mb)


def test_megatron_core_expert_saves_replace_the_exchanges_in_the_layer_cost():
    """In a layer's activation bytes with ep > 1 (`ExpertCosting.layer_costs`), "runtime" adds the
    exchange's `combine_saved` to what the one-process layer counts, whatever the policy;
    "megatron_core" puts Megatron's tensors in place of the module's, per policy; folded over tp 2
    the rank keeps half of Megatron's; "full" is left as counted."""
    pytest.importorskip("transformers")
    from autopar.inter_op.stage_cost import LayerCost

    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 8})
    mb, ep = 2, 4
    base = {"none": 1e6, "norm_act": 5e5, "full": 1e4}
    runtime = _qwen3_costing(expert_saves="runtime", expert_dispatch="ranks")
    megatron = _qwen3_costing(expert_saves="megatron_core", expert_dispatch="ranks")
    blocks = runtime.blocks
    for fold, tp in ((False, 1), (True, 2)):
        share = 1 / tp
        costs = [LayerCost(act_bytes=dict(base)) for _ in runtime.layers]
        got_r = runtime.layer_costs(costs, ep, mb, tp, cpu, "bf16", fold=fold)
        got_m = megatron.layer_costs([LayerCost(act_bytes=dict(base)) for _ in megatron.layers], ep, mb, tp, cpu,
                                     "bf16", fold=fold)
        for blk in blocks:
            li = next(j for j, bs in runtime.by_layer.items() if blk in bs)
            for r in ("none", "norm_act"):
                mine, one = megatron.megatron_saved(blk, mb, "bf16", ep, r)
                assert got_m[li].act_bytes[r] == pytest.approx(base[r] + mine * share - one)
                extra = runtime.combine_saved(blk, mb, "bf16") * share
                if fold:
                    extra -= runtime.block_saved(blk, mb, "bf16", r) * (1 - share)
                assert got_r[li].act_bytes[r] == pytest.approx(base[r] + extra)
                assert got_m[li].act_bytes[r] < got_r[li].act_bytes[r]
            assert got_m[li].act_bytes["full"] == got_r[li].act_bytes["full"] == base["full"]


def test_expert_saves_is_a_typed_choice_the_default_leaves_out():
    """`expert_saves` (and `norm_saves`) default to what `autopar run` executes, are left out of a dump
    at that default (plan files and cache keys as before), is named by the summary and by the
    CLI's note that a plan predicts other software, and a bad value names the field."""
    from autopar.schema.software import RUNTIME_CHOICES, SoftwareSpec, resolve_software

    sw = resolve_software(None)
    assert sw.expert_saves == "runtime" and "expert_saves" not in sw.model_dump()
    meg = sw.model_copy(update={"expert_saves": "megatron_core"})
    assert meg.model_dump()["expert_saves"] == "megatron_core" and "expert_saves" in RUNTIME_CHOICES
    assert "Megatron-Core's expert activations" in meg.summary()
    with pytest.raises(Exception, match="expert_saves"):
        SoftwareSpec(name="x", expert_saves="megatron")
    assert sw.norm_saves == "eager" and "norm_saves" not in sw.model_dump() and "norm_saves" in RUNTIME_CHOICES
    assert "norm modules saving their input" in sw.model_copy(update={"norm_saves": "input"}).summary()
    with pytest.raises(Exception, match="norm_saves"):
        SoftwareSpec(name="x", norm_saves="fused")
    bench = _bench()
    for c in bench.PUBLISHED:
        zoo = "Qwen3-235B" in c.name
        assert (c.software_update.get("expert_saves") == "megatron_core") == zoo
        assert (c.software_update.get("norm_saves") == "input") == zoo


def test_cli_note_names_megatron_expert_saves(capsys):
    from autopar.cli import _software_note
    from autopar.schema.software import resolve_software

    p = plan("gpt-tiny", "cpu", global_batch_size=8, dtype="fp32",
             software=resolve_software(None).model_copy(update={"expert_saves": "megatron_core"}))
    _software_note(p)
    assert "Megatron-Core's expert activations" in capsys.readouterr().err


def test_megatron_software_lowers_a_planned_moe_runs_activations():
    """Through `autopar.plan` (the search's expert costing and its layers' activation memory): a
    tiny Qwen3-MoE pinned to dp 4 x ep 4, "none" and "norm_act", needs less activation memory with
    `expert_saves` megatron_core and less again with `norm_saves` input; its time is unchanged."""
    pytest.importorskip("transformers")
    from autopar.schema.software import resolve_software

    b = build_model(_TINY_QWEN3, batch_size=2)
    g = capture(b.model, b.example_inputs, name=_TINY_QWEN3)
    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    sw = resolve_software(None)
    for rc in ("none", "norm_act"):
        got = []
        for update in ({}, {"expert_saves": "megatron_core"}, {"expert_saves": "megatron_core", "norm_saves": "input"}):
            p = plan(_TINY_QWEN3, cpu, global_batch_size=8, dtype="fp32", graph=g,
                     software=sw.model_copy(update=update),
                     constraints=Constraints(dp=4, tp=1, pp=1, ep=4, zero_stage=0, recompute=rc,
                                             num_microbatches=1))
            got.append((p.stages[0].predicted.activations_bytes, p.predicted.iteration_time_s))
        assert got[0][0] > got[1][0] > got[2][0], (rc, got)
        assert got[0][1] == got[1][1] == got[2][1]


def test_deepep_buffers_are_counted_from_deepeps_size_hints():
    """DeepEP's `Buffer` (Megatron's fused_a2a.py `get_buffer`, the normal kernels' configs and
    csrc/config.hpp's size hints, 20 SMs): at EP8 one NVLink buffer, 10 channels x 8 ranks x 256
    tokens x (hidden bytes, an 8-byte source meta, 128 int64 top-k indices, 128 fp32 weights, 128
    fp32 scales) + 10 x 8 x 5 ints, in 128-byte units; across nodes (EP32) an RDMA buffer too, rounded up to
    NVSHMEM's 512 MiB granule. A plan dispatching through DeepEP ("ranks" / "nodes") holds it in
    every phase; "pairs" (torch's all-to-all, what `autopar run` executes) holds none."""
    pytest.importorskip("transformers")
    from autopar.inter_op.experts import deepep_buffer_bytes
    from autopar.schema.software import resolve_software

    h = 4096 * 2

    def aligned(n):
        return -(-n // 128) * 128
    assert deepep_buffer_bytes(8, h) == aligned(10 * 8 * 256 * (h + 8 + 128 * 8 + 128 * 4 + 128 * 4) + 10 * 8 * 5 * 4)
    nvl32 = aligned(10 * 8 * 288 * (h + 8 + 128 * 8 + 128 * 4 + 128 * 4) + 10 * 8 * 11 * 4)
    assert deepep_buffer_bytes(32, h) == nvl32 + 2 ** 29       # the RDMA buffer's 110 MiB in one granule
    assert deepep_buffer_bytes(12, h) == 0.0                    # no DeepEP config: not run
    assert _qwen3_costing(expert_dispatch="pairs").comm_buffer_bytes(4, 1, "bf16") == 0.0
    b = build_model(_TINY_QWEN3, batch_size=2)
    g = capture(b.model, b.example_inputs, name=_TINY_QWEN3)
    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    got = []
    for dispatch in ("pairs", "ranks"):
        p = plan(_TINY_QWEN3, cpu, global_batch_size=8, dtype="fp32", graph=g,
                 software=resolve_software(None).model_copy(update={"expert_dispatch": dispatch}),
                 constraints=Constraints(dp=4, tp=1, pp=1, ep=4, zero_stage=0, recompute="none", num_microbatches=1))
        got.append(p.stages[0].predicted)
    assert got[1].buffers_bytes - got[0].buffers_bytes == pytest.approx(deepep_buffer_bytes(4, 64 * 4))
    assert got[1].activations_bytes == got[0].activations_bytes


def test_megatron_rows_take_fp32_gradients_and_their_preset_the_shard_saving_linears():
    """The Megatron-LM runs (the zoo's Qwen3-235B rows, the Mixtral row) train under --bf16, which
    keeps fp32 gradients (`grad_dtype` fp32); AutoModel's FSDP2 reduces in fp32 (its preset's
    `fp32_reduce`); the NeMo / Megatron-Core preset's TE linears save their sequence-parallel input
    shard (`sp_linear_saves` shard). Each preset reads back as it was written (round trip)."""
    from autopar.schema.software import RUNTIME_CHOICES, SoftwareSpec

    for c in _bench().PUBLISHED:
        megatron = "Qwen3-235B" in c.name or "Mixtral" in c.name
        assert (c.software_update.get("grad_dtype") == "fp32") == megatron, c.name
    for name, field, value in (("nemo-megatron-core-2024", "sp_linear_saves", "shard"),
                               ("nemo-automodel-2025", "grad_dtype", "fp32_reduce")):
        sw = SoftwareSpec.load(name)
        assert getattr(sw, field) == value and field in sw.sources and field in RUNTIME_CHOICES
        assert SoftwareSpec.model_validate(sw.model_dump()) == sw
        assert SoftwareSpec.model_validate_json(sw.model_dump_json()) == sw
    default = SoftwareSpec.load("autopar")
    assert default.grad_dtype == "param" and default.sp_linear_saves == "gathered"
    assert "sp_linear_saves" not in default.model_dump() and "grad_dtype" not in default.model_dump()


def test_megatron_fsdp_row_moves_what_megatron_fsdp_moves():
    """The zoo's FSDP row (run_235b.sh at 31c5686: --use-custom-fsdp --data-parallel-sharding-strategy
    optim_grads_params --no-gradient-accumulation-fusion) as Megatron-FSDP at 1e057005 runs it:
    gradients reduce-scattered in every micro-batch's backward (fully_sharded_data_parallel.py
    390-399: optim_grads_params ignores no_sync), pinned; from the fp32 main-grad bucket
    (grad_reduce_in_fp32 under --bf16), 4 bytes an element; each TransformerLayer unit all-gathered
    in bf16 twice a micro-batch (the forward, and the full-recompute forward, kept for the
    backward), 2 bytes an element; gradient accumulation fusion off, as optim_grads_params requires."""
    from autopar.inter_op.search import _zero3_gathers
    from autopar.schema.software import SoftwareSpec
    from cost_models.memory import PRECISION_POLICIES

    (row,) = [c for c in _bench().PUBLISHED if "FSDP" in c.name]
    assert row.pins["zero_stage"] == 3 and row.pins["zero3_grad_sync"] == "microbatch"
    assert row.pins["recompute"] == "full" and row.pins["pp"] == 1
    sw = SoftwareSpec.model_validate({**SoftwareSpec.load(row.software).model_dump(), **row.software_update})
    assert sw.zero3_overlap and not sw.gradient_accumulation_fusion and sw.grad_dtype == "fp32"
    w, g, _ = PRECISION_POLICIES[sw.state_policy("bf16")]
    assert (w, g) == (2, 4)
    assert _zero3_gathers(row.pins["pp"], row.pins["num_microbatches"]) == 2.0


def test_zero3_collectives_hide_behind_the_layer_waits_only_on_other_links():
    """`_zero3_links_apart`: the zoo's FSDP row (8 GPUs a node, tp 2, dp 128, ep 8 folded, the
    experts' copies 32 ranks 8 apart) has its tp and DeepEP exchange inside a node and both ZeRO-3
    groups across nodes: the compute stream's waits on the former cover the latter. AutoModel's
    one node (dp 8, ep 8: every group inside it) and an expert exchange across nodes do not."""
    from autopar.inter_op.search import _zero3_links_apart

    assert _zero3_links_apart(8, 2, 128, 1, 8, True, 32, 8)
    assert not _zero3_links_apart(8, 1, 8, 1, 8, False, 1, 8)          # one node: shared NVLink
    assert not _zero3_links_apart(8, 2, 128, 1, 32, True, 8, 32)       # ep 32: the exchange on the NICs
    assert not _zero3_links_apart(8, 2, 4, 1, 8, True, 1, 8)           # dp x tp 8: ZeRO-3 inside the node
