"""Mixture-of-experts layouts that need 8 processes (issue 17; the 4-process ones are
`tests/test_moe.py`'s): expert parallelism with context parallelism in pipeline stages and with
tensor parallelism (HF Mixtral), with tensor parallelism in pipeline stages, and expert tensor
parallelism with expert data parallelism (moe-tiny). Every plan of the module runs in one
8-process job (`launched8`, the runtime tests' layouts job: `tests/plans.py`; a layout that
fails fails its own test), where each had its own launch: the workers start once and what they
keep between plans of one model is worked out once."""

from __future__ import annotations

import pytest

from autopar import Constraints
from tests.captured import planned as plan  # each model captured once, its per-layer costs shared
from tests.captured import reference_losses
from tests.test_moe import _MIXTRAL, _cpu, _etp, _one

pytestmark = pytest.mark.slow

_SGD = "tests.plans:large_step_sgd"


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _mixtral_ep_cp() -> dict:
    """HF Mixtral at ep 2 x dp 2 x cp 2, in 2 pipeline stages and with tp 2 (op by op as solved)."""
    common = dict(ep=2, dp=2, cp=2, zero_stage=0, recompute="none")
    return {"mixtral_ep_cp_pp": plan(_MIXTRAL, _cpu(8), global_batch_size=4, dtype="fp32", intra_op="analytic",
                                     constraints=Constraints(tp=1, pp=2, num_microbatches=2, schedule="1f1b",
                                                             **common)),
            "mixtral_ep_cp_tp": plan(_MIXTRAL, _cpu(8), global_batch_size=4, dtype="fp32",
                                     constraints=Constraints(tp=2, pp=1, num_microbatches=1, **common))}


def _ep_tp_pp() -> object:
    return plan("moe-tiny", _cpu(8), global_batch_size=8, dtype="fp32",
                constraints=Constraints(ep=2, dp=2, tp=2, pp=2, zero_stage=1, recompute="none", num_microbatches=2,
                                        schedule="1f1b"))


@pytest.fixture(scope="module")
def launched8(tmp_path_factory) -> dict:
    """Every 8-process plan of the tests below, run 2 steps in one 8-process job (memory
    untracked): {name: (plan, its step rows, or the job's error for it)}."""
    from tests.launch import run_plans

    plans = {"ep_tp_pp_sgd": _ep_tp_pp(),
             **{f"etp_edp2_zero{z}": _etp(z, dp=4, num_microbatches=1) for z in (1, 2, 3)}}
    if _has_transformers():
        plans.update(_mixtral_ep_cp())
    rows = run_plans(tmp_path_factory.mktemp("moe8_plans"), plans, 8, steps=2,
                     options={"ep_tp_pp_sgd": {"optimizer": _SGD}})
    return {name: (p, [r for r in rows[name] if "step" in r] if isinstance(rows[name], list) else rows[name])
            for name, p in plans.items()}


def _ran(launched8: dict, name: str) -> tuple:
    p, steps = launched8[name]
    assert isinstance(steps, list), (name, steps)
    return p, steps


def test_hf_mixtral_ep_cp_with_pp_or_tp_trains_like_one_process(launched8):
    """Expert and context parallelism in pipeline stages and with tensor parallelism: HF Mixtral
    at ep 2 x dp 2 x cp 2 x pp 2 and, op by op as the ILP solved it, at ep 2 x dp 2 x cp 2 x tp 2
    (8 gloo processes; ep must divide dp, so no smaller layout has ep, cp and pp or tp).
    Each stage's ep groups are consecutive ranks of its dp x cp ones (per tp coordinate with
    tp). In the pipeline each chunk, traced at a rank's tokens, runs its experts as the model's
    code behind the exchange (`runtime.experts.eager_experts`); with tp the expert blocks' ops
    run as the exchange (`program_calls`) beside the cp attention (`ProgramContext`). The
    one-process losses within 1e-4, the plan's collectives on every step."""
    pytest.importorskip("transformers")
    assert launched8["mixtral_ep_cp_tp"][0].stages[0].op_layouts is not None
    for name in ("mixtral_ep_cp_pp", "mixtral_ep_cp_tp"):
        p, steps = _ran(launched8, name)
        assert p.ep == p.cp == 2 and "cp_executor" not in p.search and "ep_executor" not in p.search, p.search
        one = plan(_MIXTRAL, _cpu(1), global_batch_size=4, dtype="fp32",
                   constraints=Constraints(num_microbatches=p.num_microbatches, recompute="none"))
        assert [r["loss"] for r in steps] == pytest.approx(reference_losses(one, _MIXTRAL, 2), rel=1e-4), name
        assert all(r["collectives"] == p.predicted.collectives for r in steps), \
            (name, [r["collectives"] for r in steps], p.predicted.collectives)


def test_ep_with_tp_trains_in_pipeline_stages_like_one_process(launched8):
    """8 gloo processes, ep 2 x dp 2 x tp 2 x pp 2 (1F1B, ZeRO-1), each stage run op by op as
    the ILP solved it: each pipeline chunk's expert block runs as the rank's token exchange;
    losses equal one process within 1e-4 under SGD with a large step (an expert weight left out
    of the first step's update would move the second step's loss), and from the second step
    (the first also exchanges the pipeline's shape metadata) every step's collectives the
    plan's. Two steps (8 processes on the suite's 2 cores): the second is the one both checks
    need."""
    from tests.plans import large_step_sgd

    p, steps = _ran(launched8, "ep_tp_pp_sgd")
    assert all(s.op_layouts is not None for s in p.stages) and "ep_executor" not in p.search
    want = reference_losses(_one(), "moe-tiny", 2, optimizer_factory=large_step_sgd)
    assert [r["loss"] for r in steps] == pytest.approx(want, rel=1e-4)
    assert p.predicted.collectives["all_to_all"] == 20
    assert all(r["collectives"] == p.predicted.collectives for r in steps[1:]), \
        ([r["collectives"] for r in steps], p.predicted.collectives)


def test_expert_tp_with_expert_data_parallelism_trains_like_one_process(launched8):
    """8 gloo processes, ep 2 x dp 4 x tp 2 with expert_tp=2 (each expert's tp halves held by 2
    ranks: expert data parallelism 2), ZeRO 1, 2 and 3 (the experts' flat shard, or their FSDP
    units, over the ranks holding the same slices); `autopar verify` of the ZeRO-3 plan counts
    the same collectives: losses equal one process within 1e-4 and
    every step's collectives the plan's."""
    import autopar

    report = autopar.verify(launched8["etp_edp2_zero3"][0], "moe-tiny")
    assert report.ok and report.collectives_match is True, report.failures
    one = plan("moe-tiny", _cpu(1), global_batch_size=8, dtype="fp32",
               constraints=Constraints(num_microbatches=1, recompute="none"))
    want = reference_losses(one, "moe-tiny", 2)
    for name in ("etp_edp2_zero1", "etp_edp2_zero2", "etp_edp2_zero3"):
        p, steps = _ran(launched8, name)
        assert p.experts.expert_tp == 2 and p.experts.expert_dp == 2 and "ep_executor" not in p.search
        assert [r["loss"] for r in steps] == pytest.approx(want, rel=1e-4), name
        assert all(r["collectives"] == p.predicted.collectives for r in steps), \
            (name, [r["collectives"] for r in steps], p.predicted.collectives)
