"""fp32 parameters under autocast (`SoftwareSpec.param_dtype` "fp32", issue 14): PyTorch
Lightning's `precision: bf16` / `16`, which the flash-attn training stack runs, keeps the model's
parameters fp32. Each micro-batch casts every weight to the 2-byte dtype in the forward (the
matrix ops save the casts for their backward) and each weight gradient back to fp32 in the
backward, accumulating it in fp32; the model states are 4 + 4 + 8 bytes a parameter (fp32
weights and gradients, Adam's two moments; no master copy). These tests check that a plan made
for such software prices exactly those terms beside the same plan with 2-byte parameters."""

import pytest
from pydantic import ValidationError

import autopar
from autopar.models import build_model
from autopar.schema import ClusterSpec, Constraints, PlanError, SoftwareSpec
from cost_models.compute import memory_time, param_cast_bytes
from cost_models.memory import param_cast_saved_bytes


def test_cast_bytes_per_parameter():
    # forward: read 4, write 2; backward: the 2-byte gradient read, its fp32 cast written
    assert param_cast_bytes("fp32", "bf16") == param_cast_bytes("fp32", "fp16") == 12.0
    # parameters in the training dtype, or an fp32 run: nothing is cast
    assert param_cast_bytes("training", "bf16") == param_cast_bytes("fp32", "fp32") == 0.0
    assert param_cast_saved_bytes("fp32", "bf16") == 2.0
    assert param_cast_saved_bytes("training", "bf16") == param_cast_saved_bytes("fp32", "fp32") == 0.0


def test_fp32_parameters_need_autocast(tmp_path):
    with pytest.raises(ValidationError, match="param_dtype 'fp32' needs mixed_precision 'autocast'"):
        SoftwareSpec(name="x", mixed_precision="half", param_dtype="fp32")
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\nmixed_precision: half\nparam_dtype: fp32\n")
    with pytest.raises(PlanError, match="param_dtype"):
        SoftwareSpec.load(f)


def test_presets_say_which_keep_fp32_parameters():
    """The flash-attn presets keep fp32 parameters (Lightning's mixed precision), the default and
    Megatron's do not; a preset keeping them in the training dtype writes no field (plan files and
    their digests as before the field existed)."""
    for name in ("flash-attn-2-2023", "flash-attn-1-2022"):
        sw = SoftwareSpec.load(name)
        assert sw.param_dtype == "fp32" and sw.state_policy("bf16") == "fp32"
        assert sw.model_dump()["param_dtype"] == "fp32" and "fp32 parameters under autocast" in sw.summary()
    for name in ("autopar", "megatron-lm-2021", "nemo-megatron-core-2024"):
        sw = SoftwareSpec.load(name)
        assert sw.param_dtype == "training" and sw.state_policy("bf16") == "bf16"
        assert "param_dtype" not in sw.model_dump()


@pytest.mark.parametrize("zero,states", [(0, 0.0), (1, 4.0)])
def test_a_plan_prices_the_casts_and_fp32_states(zero, states):
    """The same pinned plan with fp32 parameters: the compute part grows by every micro-batch's
    casts (12 bytes a parameter) and the fp32 accumulation (6 bytes more a parameter in m - 1 of
    m micro-batches); the peak by the casts the forward saves (2 bytes a parameter) and, under
    ZeRO-1 over 8 ranks, the fp32 weights and gradients (4 bytes more a parameter; ZeRO 0 holds
    16 bytes a parameter either way)."""
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=zero)
    base = SoftwareSpec.load("autopar")
    fp32 = base.model_copy(update={"name": "fp32-params", "param_dtype": "fp32"})
    low = autopar.plan("gpt-tiny", cl, global_batch_size=32, constraints=cons, software=base)
    high = autopar.plan("gpt-tiny", cl, global_batch_size=32, constraints=cons, software=fp32)
    P = sum(p.numel() for p in build_model("gpt-tiny").model.parameters())
    m = 32 // 8
    a, b = low.stages[0].predicted, high.stages[0].predicted
    extra = m * memory_time(P * 12, cl.device) + (m - 1) * memory_time(P * (12 - 6), cl.device)
    assert b.compute_s - a.compute_s == pytest.approx(extra, rel=1e-6)
    assert b.peak_phase == a.peak_phase == "forward_backward"
    assert b.activations_bytes - a.activations_bytes == pytest.approx(2 * P)
    assert high.predicted.peak_memory_bytes - low.predicted.peak_memory_bytes == pytest.approx((2 + states) * P)
    assert high.predicted.iteration_time_s > low.predicted.iteration_time_s


def test_torch_zero_redundancy_optimizer_shards_only_the_moments():
    """The flash-attn stack's ZeRO-1 is torch's ZeroRedundancyOptimizer under DDP
    (`SoftwareSpec.zero_optimizer` "zero_redundancy"): each rank's AdamW steps its partition of
    the fp32 parameters themselves, so a plan holds 8 / dp bytes a parameter of optimizer state,
    not autopar's flat fp32 shard beside them (12 / dp); weights, gradients and activations are
    the same plan's. Default software and plan files keep the field out (digests unchanged)."""
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=1)
    flat = SoftwareSpec.load("autopar").model_copy(update={"name": "fp32-params", "param_dtype": "fp32"})
    torch_zero = flat.model_copy(update={"name": "fp32-zero-redundancy", "zero_optimizer": "zero_redundancy"})
    a = autopar.plan("gpt-tiny", cl, global_batch_size=32, constraints=cons, software=flat).stages[0].predicted
    b = autopar.plan("gpt-tiny", cl, global_batch_size=32, constraints=cons, software=torch_zero).stages[0].predicted
    P = sum(p.numel() for p in build_model("gpt-tiny").model.parameters())
    assert a.optimizer_bytes == pytest.approx(12 * P / 8) and b.optimizer_bytes == pytest.approx(8 * P / 8)
    assert (b.weights_bytes, b.gradients_bytes, b.activations_bytes) == (a.weights_bytes, a.gradients_bytes,
                                                                         a.activations_bytes)
    for name in ("flash-attn-2-2023", "flash-attn-1-2022"):
        assert SoftwareSpec.load(name).zero_optimizer == "zero_redundancy"
    assert "zero_optimizer" not in SoftwareSpec.load("autopar").model_dump()


def test_saved_casts_by_recomputation_and_tied_weights():
    """A layer's matrix ops save the casts of its own weights unless the layer is recomputed in
    full (its forward then saves nothing); a weight two layers read (the tied embedding and head)
    is cast once, by the last of them, and counted there."""
    from autopar.inter_op.search import _Tables
    from autopar.inter_op.stage_cost import LayerCost

    cluster = ClusterSpec.load("dgx-a100-80g")
    policies = ("none", "selective", "attention", "full")
    costs = [LayerCost(act_bytes={r: 10.0 for r in policies}, param_elems={"wte": 100.0}),
             LayerCost(act_bytes={r: 10.0 for r in policies}, param_elems={"w1": 50.0, "w2": 25.0}),
             LayerCost(act_bytes={r: 10.0 for r in policies}, param_elems={"wte": 100.0, "ln": 1.0})]
    plain = _Tables(costs, cluster, "bf16", 1, 1, 0, [])
    cast = _Tables(costs, cluster, "bf16", 1, 1, 0, [], policy="fp32", cast_bytes=12.0, cast_saved=2.0)
    for r in ("none", "selective", "attention"):
        assert list(cast.act[r] - plain.act[r]) == [0.0, 0.0, 2 * 75.0, 2 * (75.0 + 101.0)]
    assert list(cast.act["full"]) == list(plain.act["full"])
    assert cast.wgo == (4, 4, 8) and plain.wgo == (2, 2, 12)
    # every micro-batch's casts, plus the fp32 accumulation in m - 1 of m
    m, pel = 4, 1e9
    got = float(cast.accum(pel, m) - plain.accum(pel, m))
    assert got == pytest.approx(memory_time(pel * 12, cluster.device) + 0.75 * memory_time(pel * 6, cluster.device))


def test_a_plan_with_fp32_parameters_round_trips():
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=1)
    plan = autopar.plan("gpt-tiny", cl, global_batch_size=8, constraints=cons, software="flash-attn-2-2023")
    back = autopar.Plan.from_json(plan.to_json())
    assert back == plan and back.software.param_dtype == "fp32"
