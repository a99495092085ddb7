"""Plans whose per-layer costs come from the intra-op ILP (`intra_op="ilp"`) run exactly as
predicted: every step's counted collectives equal `plan.predicted.collectives`,
including the once-per-step moves of gradients to their parameters' layouts, and the losses
equal one process."""

import pytest

from autopar import ClusterSpec, Constraints
from autopar.planner import plan
from autopar.runtime import run

pytestmark = pytest.mark.slow


def test_ilp_planned_gpt_tp2_pp2_runs_as_predicted():
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    cons = Constraints(tp=2, pp=2, dp=1, num_microbatches=2, recompute="none", schedule="1f1b")
    p = plan("gpt-tiny", cl, global_batch_size=8, dtype="fp32", constraints=cons, intra_op="ilp")
    assert p.search["intra_op"] == "ilp"
    rows = run(p, "gpt-tiny", steps=3, seed=0, quiet=True)
    steps = [r for r in rows if "step" in r]
    # from the second step on (the first also exchanges the pipeline's shape metadata)
    assert all(r["collectives"] == p.predicted.collectives for r in steps[1:]), \
        ([r["collectives"] for r in steps], p.predicted.collectives)
    ref = [r["loss"] for r in run(_single(), "gpt-tiny", steps=3, seed=0, quiet=True) if "step" in r]
    assert [r["loss"] for r in steps] == pytest.approx(ref, rel=1e-4)


def _single():
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 1})
    return plan("gpt-tiny", cl, global_batch_size=8, dtype="fp32",
                constraints=Constraints(num_microbatches=2, recompute="none"))
