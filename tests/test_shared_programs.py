"""The programs local ranks trace alike, traced once before they fork (`autopar.runtime.
shared_programs`, `processes.launch(prepare=...)`, which `autopar run` and the test suite's
layouts jobs use): what `trace_programs` keeps are the keys a rank of the plan looks up. Checked
in one process, each rank built as `autopar verify` builds it (`engine.ParallelModel` on a fake
process group): after `trace_programs`, building the plan's ranks traces nothing (no misses of
the kept programs) and finds them (hits). The layouts jobs count each plan's kept and traced
programs on rank 0 (`AUTOPAR_LAYOUT_TIMES`)."""

from __future__ import annotations

import pytest

from autopar import Constraints
from autopar.intra_op import execute
from autopar.models import build_model
from autopar.runtime import graph_stages
from autopar.runtime.shared_programs import trace_plan, trace_programs
from tests.captured import shared_plan
from tests.plans import make_plan


def _counts() -> tuple[int, int, int, int]:
    return (execute.META_PROGRAM_STATS["hits"], execute.META_PROGRAM_STATS["misses"],
            graph_stages.SPLIT_STATS["hits"], graph_stages.SPLIT_STATS["misses"])


@pytest.mark.parametrize("layout", ["pp2xdp2", "tp2", "pp2xtp2_vocab", "cp2xtp2"])
def test_the_programs_traced_before_the_fork_are_those_the_ranks_look_up(layout, monkeypatch):
    """A traced pipeline (its chunks), a solved stage (its op-by-op program), a solved pipeline
    (the program its chunks are cut from) and a context-parallel solved stage (its program at a
    rank's tokens, positions traced as an op): `trace_programs` traces each, then every rank
    kind of the plan builds and steps (`autopar verify`, in this process: the programs are
    this process's) without tracing any of them again. (What verify reports is not checked:
    kinds of several layouts built in one process may share DTensor's cached decisions, which
    is why verify builds them elsewhere; the runtime's ranks run one plan's layout.)"""
    from autopar.runtime import verify as verify_mod

    monkeypatch.setattr(verify_mod, "_isolated", lambda plan: (False, False))
    plan = (shared_plan("gpt-tiny", 4, constraints=Constraints(cp=2, dp=1, tp=2, pp=1, recompute="none",
                                                                   num_microbatches=1))
            if layout == "cp2xtp2" else make_plan(layout))
    execute._META_PROGRAMS.clear()
    graph_stages._SPLITS.clear()
    assert trace_programs(plan, build_model(plan.model.name, device="meta")) is None
    hits, misses, split_hits, split_misses = _counts()
    verify_mod.verify(plan, plan.model.name, check=False)
    after = _counts()
    assert (after[1], after[3]) == (misses, split_misses), (layout, after, (hits, misses, split_hits, split_misses))
    assert after[0] + after[2] > hits + split_hits


def test_a_plan_that_cannot_be_traced_is_left_to_the_ranks():
    """`autopar run`'s leader traces from the plan's JSON and the model reference; a plan its
    model does not fit says why, and the ranks then report it themselves."""
    plan = make_plan("pp2xdp2")
    bad = plan.model_copy(deep=True)
    bad.stages[1].layers = ["no.such.module"] + bad.stages[1].layers[1:]
    assert trace_plan(plan.to_json(), plan.model.name) is None
    assert "no.such.module" in trace_programs(bad, build_model(bad.model.name, device="meta"))
