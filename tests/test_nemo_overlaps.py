"""What Megatron-Core / NeMo runs fused or overlapped that autopar's own runtime pays in full
(issue 14, the NeMo GPT-3 175B H100 family): each a `SoftwareSpec` field priced where the cost
model charges the work, off in the default preset (`autopar run` does none of them)."""

import pytest

import autopar
from autopar.schema import ClusterSpec, Constraints, SoftwareSpec
from autopar.schema.software import resolve_software
from cost_models.compute import grad_accumulation_bytes, memory_time


def test_fused_gradient_accumulation_drops_the_accumulation_pass():
    """`gradient_accumulation_fusion`: the weight-gradient GEMM adds into the kept gradient, so
    the separate pass autograd runs in every backward after a step's first (3 gradient-sized
    accesses a parameter) is gone; the default (autopar run) keeps it."""
    assert resolve_software(None).gradient_accumulation_fusion is False
    assert SoftwareSpec.load("nemo-megatron-core-2024").gradient_accumulation_fusion is True
    assert SoftwareSpec.load("megatron-lm-2021").gradient_accumulation_fusion is False   # came in 2022
    cl = ClusterSpec.load("dgx-a100-80g")
    m = 8
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=0)
    base = SoftwareSpec.load("autopar")
    fused = base.model_copy(update={"name": "fused", "gradient_accumulation_fusion": True})
    plain = autopar.plan("gpt-small", cl, global_batch_size=8 * m, constraints=cons, software=base)
    fast = autopar.plan("gpt-small", cl, global_batch_size=8 * m, constraints=cons, software=fused)
    saved = plain.predicted.iteration_time_s - fast.predicted.iteration_time_s
    # m - 1 passes over every parameter's bf16 gradient (the tied embedding counted once)
    want = (m - 1) * memory_time(plain.model.num_params * grad_accumulation_bytes("bf16"), cl.device)
    assert saved == pytest.approx(want, rel=0.02)
    # one micro-batch accumulates nothing: the same time either way
    one = Constraints(dp=8, tp=1, pp=1, microbatch_size=8, recompute="none", zero_stage=0)
    assert (autopar.plan("gpt-small", cl, global_batch_size=64, constraints=one, software=base).predicted
            .iteration_time_s == pytest.approx(autopar.plan("gpt-small", cl, global_batch_size=64, constraints=one,
                                                            software=fused).predicted.iteration_time_s))
    # written only when set (plan digests of older software unchanged), and round-trips
    assert "gradient_accumulation_fusion" not in base.model_dump()
    dumped = fused.model_dump()
    assert dumped["gradient_accumulation_fusion"] is True
    assert SoftwareSpec.model_validate(dumped) == fused
    with pytest.raises(Exception, match="gradient_accumulation_fusion"):
        SoftwareSpec(name="x", gradient_accumulation_fusion="sometimes")
