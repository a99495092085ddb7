"""Runtime tests: executed plans give the one-process losses, and run the collectives they
predict. Multi-process jobs use gloo on CPU with gpt-tiny; several layouts share one launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from autopar.schema.errors import PlanError
from tests.plans import GPT6_REF, make_plan

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow
# the second step is the first after a pipeline's warm-up and on weights the first update
# changed: what the losses and collectives checks need (more steps repeat them)
STEPS = 2

_REF: dict = {}


def reference_losses(ref: str = "gpt-tiny", steps: int = STEPS, dtype: str = "fp32") -> list[float]:
    """Losses of a one-process run (in this process) with the same seed, global batch and
    precision (memory untracked)."""
    from tests.captured import reference_losses as losses

    key = (ref, steps, dtype)
    if key not in _REF:
        plan = make_plan("single", ref=ref).model_copy(update={"dtype": dtype})
        _REF[key] = losses(plan, ref, steps)
    return _REF[key]


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def launch_layouts(layouts: list[str], tmp_path: Path, nproc: int = 4, steps: int = STEPS) -> dict:
    """One torchrun job (elastic launcher) running every layout in turn (tests/plans.py),
    `steps` steps each."""
    from tests.launch import layouts_job

    return layouts_job(layouts, tmp_path / "layouts.json", nproc, steps)


# ---------------------------------------------------------------------------------------------
def test_dp2_api_equals_one_process(tmp_path):
    """Issue #2: a 2-process data-parallel plan through the API gives the one-process losses."""
    from autopar.runtime import run

    metrics = tmp_path / "m.jsonl"
    rows = run(make_plan("dp2"), "gpt-tiny", steps=STEPS, metrics_path=str(metrics), quiet=True)
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert close([r["loss"] for r in steps], reference_losses(), 1e-5)
    for r in steps:
        assert r["time_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["collectives"] == {"all_reduce": 1}
    summary = rows[-1]
    assert summary["summary"] and summary["collectives_match"] is True
    assert summary["predicted_time_s"] == 0.05 and summary["measured_time_s"] > 0
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert len(lines) == STEPS + 1 and lines[-1]["summary"]


def _cli_run(exe: str, plan: Path, tmp_path: Path) -> list[dict]:
    metrics = tmp_path / "m.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([exe, "run", str(plan), "--model", "gpt-tiny", "--steps", str(STEPS), "--metrics",
                        str(metrics), "-q"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in metrics.read_text().splitlines()]


def test_cli_plan_then_run_dp2(tmp_path):
    """`autopar plan ... --devices-per-node 2 -o plan.json` (the planner's DP plan), then
    `autopar run plan.json --model gpt-tiny` (issue #2 through the CLI): losses equal one
    process within 1e-5 (2e-4 in bf16) and the planner's collectives ran."""
    exe = shutil.which("autopar")
    if exe is None:
        pytest.skip("autopar console script not installed")
    plan = tmp_path / "plan.json"
    r = subprocess.run([exe, "plan", "--model", "gpt-tiny", "--cluster", "cpu", "--devices-per-node", "2",
                        "--global-batch-size", "8", "-o", str(plan), "-q"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert r.returncode == 0, f"autopar plan failed: {r.stderr.strip()[-300:]}"
    rows = _cli_run(exe, plan, tmp_path)
    losses = [x["loss"] for x in rows if "step" in x]
    dtype = json.loads(plan.read_text())["dtype"]    # the planner's default precision (bf16)
    ref = reference_losses(dtype=dtype)
    # bf16 autocast: a 2-way split changes the order of bf16 sums (tests/test_runtime_precision.py)
    assert close(losses, ref, 1e-5 if dtype == "fp32" else 2e-4), (dtype, losses, ref)
    assert rows[-1]["summary"] and rows[-1]["collectives_match"] is True


_LAYOUTS = ["dp4", "tp4", "dp2xtp2", "pp2xdp2", "pp2xtp2", "pp4v2", "zero3dp4", "zero2dp4",
            "pp2xdp2z2", "pp2xdp2z3", "recompute_dp4", "selective_tp4", "zero3dp2xtp2", "pp2xtp2_vocab"]
_RECOMPUTE_CHECKS = ["recompute_check:pp2xtp2", "recompute_check:pp2xtp2_full"]


@pytest.fixture(scope="module")
def gpt_job(tmp_path_factory) -> tuple[dict, list[str]]:
    """The 4-process layouts of the two tests below and their checks, run in one job (one
    launch; a layout that fails fails its own test): (rows by layout, the recompute test's
    layouts)."""
    tmp = tmp_path_factory.mktemp("gpt_layouts")
    planned = {rc: _planned_recompute_pipeline(tmp, rc) for rc in ("full", "selective")}
    recompute = ["pp2xtp2_full", "pp2xtp2_selective"] + [f"plan:{p}" for p in planned.values()]
    uneven = [f"plan:{_planned_uneven_pipeline(tmp)}"]
    return launch_layouts(_LAYOUTS + ["build_api"] + recompute + _RECOMPUTE_CHECKS + uneven, tmp), recompute


def test_layouts_equal_one_process_and_count_collectives(gpt_job):
    """dp4, tp4, dp2xtp2, pp2xdp2 (1F1B), pp2xtp2 (GPipe), pp4 interleaved (v=2), ZeRO-3 dp4,
    ZeRO-2 dp4, pp2 x dp2 with ZeRO-2 and ZeRO-3, full and selective recompute, ZeRO-3 x tp2,
    pp2xtp2 with the tied embedding replicated on one stage and vocabulary-parallel on the other
    in one 4-process job: losses within 1e-4 of one process, collectives as planned. The tp
    layouts are the planner's (`tests/plans.py` `PLANNED`), run op by op as solved."""
    layouts = _LAYOUTS
    res = {k: v for k, v in gpt_job[0].items() if k in layouts + ["build_api"]}
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    # build() + step() from a user's loop
    assert close(res["build_api"]["losses"], reference_losses(), 1e-4), res["build_api"]
    for lay in layouts:
        rows = res[lay]
        steps = [r for r in rows if "step" in r]
        ref = reference_losses(GPT6_REF if lay == "pp4v2" else "gpt-tiny")
        got = [r["loss"] for r in steps]
        assert close(got, ref, 1e-4), (lay, got, ref)
        planned = make_plan(lay).predicted.collectives
        assert steps[-1]["collectives"] == planned, (lay, steps[-1]["collectives"], planned)
        assert rows[-1]["collectives_match"] is True, lay


def _planned_recompute_pipeline(tmp_path: Path, recompute: str) -> Path:
    """The planner's gpt-tiny plan pinned to tp 2 x pp 2 with `recompute` (Megatron layouts from
    the analytic per-layer costs), saved to a file for the layouts job."""
    from autopar.planner import plan as make
    from autopar.schema import ClusterSpec, Constraints

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4, "num_nodes": 1})
    p = make("gpt-tiny", cl, global_batch_size=8, dtype="fp32", intra_op="analytic",
             constraints=Constraints(dp=1, tp=2, pp=2, num_microbatches=2, recompute=recompute))
    assert p.pp == 2 and all(s.recompute == recompute and s.axis_size("tp") == 2 for s in p.stages)
    path = tmp_path / f"planned_{recompute}.json"
    p.save(path)
    return path


def _planned_uneven_pipeline(tmp_path: Path) -> Path:
    """The planner's gpt-tiny plan pinned to dp 2 x pp 2 with 2 interleaved chunks a rank: 4
    chunks over 2 blocks, so the embedding and the loss take a layer slot each
    (`Constraints.account_in_split`, Megatron's --account-for-embedding/loss-in-pipeline-split):
    rank group 0 holds the embedding alone and blocks.1, group 1 blocks.0 and the head + loss."""
    from autopar.planner import plan as make
    from autopar.schema import ClusterSpec, Constraints

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4, "num_nodes": 1})
    p = make("gpt-tiny", cl, global_batch_size=8, dtype="fp32", intra_op="analytic",
             constraints=Constraints(dp=2, tp=1, pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                                     num_microbatches=2))
    assert [s.layers for s in p.stages] == [["embed"], ["blocks.0"], ["blocks.1"], ["head"]], p.stages
    assert "account_in_split" in p.search
    path = tmp_path / "planned_uneven.json"
    p.save(path)
    return path


def test_uneven_interleaved_chunks(gpt_job):
    """The planner's dp2 x pp2 x v2 plan whose first chunk holds only the embedding and last
    only the head and loss (`_planned_uneven_pipeline`): losses within 1e-4 of one process, the
    collectives it predicts."""
    [lay] = [k for k in gpt_job[0] if k.startswith("plan:") and k.endswith("planned_uneven.json")]
    rows = gpt_job[0][lay]
    assert isinstance(rows, list), rows
    from autopar.schema.plan import load_plan

    steps = [r for r in rows if "step" in r]
    assert close([r["loss"] for r in steps], reference_losses(), 1e-4), steps
    planned = load_plan(lay[5:]).predicted.collectives
    assert steps[-1]["collectives"] == planned, (steps[-1]["collectives"], planned)
    assert rows[-1]["collectives_match"] is True


def test_recompute_in_a_pipeline(gpt_job):
    """pp2 x tp2 with full and selective recomputation, run op by op as solved: the losses of
    one process within 1e-4, the collectives the plans predict (a checkpointed region's forward
    collectives re-run whole in the backward: `op_layouts.collectives["recompute"]`); and
    recomputation really recomputes: each local block's attention runs twice per micro-batch,
    and the bytes autograd keeps for the backward drop."""
    layouts, checks = gpt_job[1], _RECOMPUTE_CHECKS
    res = {k: v for k, v in gpt_job[0].items() if k in layouts + checks}
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    from autopar.schema.plan import load_plan

    for lay in layouts:
        steps = [r for r in res[lay] if "step" in r]
        assert close([r["loss"] for r in steps], reference_losses(), 1e-4), (lay, steps)
        plan = load_plan(lay[5:]) if lay.startswith("plan:") else make_plan(lay)
        assert steps[-1]["collectives"] == plan.predicted.collectives, (lay, steps[-1]["collectives"],
                                                                         plan.predicted.collectives)
    plain, full = res[checks[0]], res[checks[1]]
    M = plain["microbatches"]
    assert plain["calls"] == [M] * 4 and full["calls"] == [2 * M] * 4, (plain, full)
    assert all(f < p for f, p in zip(full["saved_bytes"], plain["saved_bytes"])), (plain, full)


def test_planned_zero3_tp_pipeline_runs_as_predicted(tmp_path):
    """The planner's gpt-tiny pp2 x dp2 x tp2 ZeRO-3 plan (8 processes): the losses of one
    process within 1e-4 and the predicted collectives. torch.pipelining drives FSDP (gradient
    sync and resharding after the last micro-batch) only when the stage's module is the FSDP
    root, with tp the SPMD wrapper: per stage U·(M + 1) all-gathers and U reduce-scatters, not
    a reduce-scatter per unit and micro-batch."""
    from autopar.planner import plan as make
    from autopar.schema import ClusterSpec, Constraints

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 8, "num_nodes": 1})
    p = make("gpt-tiny", cl, global_batch_size=8, dtype="fp32", intra_op="analytic",
             constraints=Constraints(pp=2, dp=2, tp=2, zero_stage=3, num_microbatches=2))
    assert p.pp == 2 and all(s.mesh_shape == (2, 2) for s in p.stages) and p.zero_stage == 3
    path = tmp_path / "zero3.json"
    p.save(path)
    rows = launch_layouts([f"plan:{path}"], tmp_path, nproc=8)[f"plan:{path}"]
    assert isinstance(rows, list), rows
    steps = [r for r in rows if "step" in r]
    assert close([r["loss"] for r in steps], reference_losses(), 1e-4), steps
    counted, planned = steps[-1]["collectives"], p.predicted.collectives
    assert counted == planned, (counted, planned)
    assert counted["reduce_scatter"] == 2 * 2   # U = 2 units in each of the 2 stages


def test_plan_for_another_model_is_refused():
    from autopar.runtime import run

    plan = make_plan("dp2", ref="gpt-small")
    with pytest.raises(PlanError, match=r"plan was made for gpt-small .*not gpt-tiny .*re-plan with --model gpt-tiny"):
        run(plan, "gpt-tiny", steps=1)


def test_plans_the_runtime_cannot_execute_are_refused_before_launch():
    from autopar.runtime import run
    from tests.plans import StagePlan, _plan

    def two(l0, l1):
        return _plan("gpt-tiny", [StagePlan(index=0, devices=[0], mesh_shape=(1,), mesh_axis_names=("dp",), layers=l0),
                                  StagePlan(index=1, devices=[1], mesh_shape=(1,), mesh_axis_names=("dp",), layers=l1)],
                     gbs=8, mb=2, m=4, nodes_devices=2)

    with pytest.raises(PlanError, match="leave parameters out: head.ln.bias"):
        run(two(["embed", "blocks.0"], ["blocks.1"]), "gpt-tiny", steps=1)
    with pytest.raises(PlanError, match="layer 'blocks.7'"):
        run(two(["embed", "blocks.7"], ["blocks.1", "head"]), "gpt-tiny", steps=1)


def test_world_size_mismatch_is_refused():
    from autopar.runtime import run

    with pytest.raises(PlanError, match="needs 2 processes"):
        run(make_plan("dp2"), "gpt-tiny", steps=1, nproc=3)


def test_checkpoint_restart_and_reshard(tmp_path):
    """Rank 1 dies before step 3; torchrun restarts the group, it resumes from the last
    checkpoint, and the final parameters equal an uninterrupted run's. A tp2 plan then resumes
    the dp2 checkpoint of step 4 (DCP resharding) and ends at the same parameters; so does a
    ZeRO-2 plan, whose saved optimizer state matches the dp2 run's."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from autopar.runtime import run

    steps = 6
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    ra = run(make_plan("dp2"), "gpt-tiny", steps=steps, checkpoint_dir=str(a), checkpoint_every=2, quiet=True)
    rb = run(make_plan("dp2"), "gpt-tiny", steps=steps, checkpoint_dir=str(b), checkpoint_every=2, quiet=True,
             max_restarts=1, env={"AUTOPAR_FAULT": "1:3"})
    la = [r["loss"] for r in ra if "step" in r]
    lb = [r["loss"] for r in rb if "step" in r]
    assert len(lb) == steps and close(lb, la, 1e-6)
    (c).mkdir()
    shutil.copytree(a / "step_00000004", c / "step_00000004")
    (c / ".tmp-step_00000006").mkdir()  # an interrupted save: ignored
    rc = run(make_plan("tp2"), "gpt-tiny", steps=steps, checkpoint_dir=str(c), quiet=True)
    assert [r["step"] for r in rc if "step" in r] == [4, 5]
    d = tmp_path / "d"  # ZeRO-2 (flat optimizer shards) resumes the dp2 checkpoint too
    d.mkdir()
    shutil.copytree(a / "step_00000004", d / "step_00000004")
    rd = run(make_plan("zero2dp2"), "gpt-tiny", steps=steps, checkpoint_dir=str(d), quiet=True)
    assert [r["step"] for r in rd if "step" in r] == [4, 5]

    def final(d: Path) -> dict:
        out = d / "final.pt"
        dcp_to_torch_save(str(d / f"step_{steps:08d}"), str(out))
        return torch.load(out, weights_only=False)

    fa, fb, fc, fd = final(a), final(b), final(c), final(d)
    keys = [k for k in fa if k.startswith("model.")]
    assert keys and int(fa["step"]) == int(fb["step"]) == int(fc["step"]) == int(fd["step"]) == steps
    for k in keys:
        assert torch.equal(fa[k], fb[k]), k
        # other layouts sum in another order, and Adam scales a near-zero gradient's rounding
        # up to a step of its own: measured 1.0e-6 on one qkv bias element (largest 5e-3)
        assert torch.allclose(fa[k], fc[k], rtol=1e-4, atol=1e-5), (k, (fa[k] - fc[k]).abs().max())
        assert torch.allclose(fa[k], fd[k], rtol=1e-4, atol=1e-5), (k, (fa[k] - fd[k]).abs().max())
    # the optimizer state is stored per parameter whatever the layout (ZeRO-2 gathers its shards)
    okeys = [k for k in fa if k.startswith("optim.")]
    assert okeys and set(okeys) == {k for k in fd if k.startswith("optim.")}
    for k in okeys:
        assert torch.allclose(fa[k], fd[k], rtol=1e-4, atol=1e-8), k


def test_a_layout_failing_on_one_rank_fails_alone(tmp_path):
    """The layouts job (`tests.launch.layouts_job`): a layout failing on one rank is reported
    with that rank's error, and the layouts after it still run (in a new job)."""
    rows = launch_layouts(["fail_on_rank:1", "dp2"], tmp_path, nproc=2)
    assert "this rank fails, as asked" in rows["fail_on_rank:1"]["error"], rows["fail_on_rank:1"]
    assert close([r["loss"] for r in rows["dp2"] if "step" in r], reference_losses(), 1e-5), rows["dp2"]


def test_collectives_counted_in_the_first_two_steps_by_default(monkeypatch):
    """`autopar run` counts collectives (a dispatch mode over every op) in the first two steps
    unless AUTOPAR_COUNT_COLLECTIVES says otherwise; the measured median step leaves counted
    steps out, the comparison takes the last counted step's count."""
    from autopar.runtime.worker import collective_counting_mode, summarize

    monkeypatch.delenv("AUTOPAR_COUNT_COLLECTIVES", raising=False)
    assert collective_counting_mode() == "step"
    for v, want in (("all", "all"), ("0", "off"), ("1", "step")):
        monkeypatch.setenv("AUTOPAR_COUNT_COLLECTIVES", v)
        assert collective_counting_mode() == want
    monkeypatch.setenv("AUTOPAR_COUNT_COLLECTIVES", "sometimes")
    with pytest.raises(ValueError, match="AUTOPAR_COUNT_COLLECTIVES='sometimes'"):
        collective_counting_mode()
    plan = make_plan("dp2")
    rows = [{"step": 0, "loss": 1.0, "time_s": 9.0, "peak_memory_bytes": 1, "collectives": {"all_reduce": 2}},
            {"step": 1, "loss": 1.0, "time_s": 5.0, "peak_memory_bytes": 1, "collectives": {"all_reduce": 1}},
            {"step": 2, "loss": 1.0, "time_s": 1.0, "peak_memory_bytes": 1},
            {"step": 3, "loss": 1.0, "time_s": 3.0, "peak_memory_bytes": 1}]
    s = summarize(plan, rows)
    assert s["measured_time_s"] == 2.0          # steps 2 and 3: the uncounted ones
    assert s["measured_collectives"] == {"all_reduce": 1} and s["collectives_match"] is True
    # with every step counted, the median is over the steps after the first, as before
    s = summarize(plan, [dict(r, collectives={"all_reduce": 1}) for r in rows])
    assert s["measured_time_s"] == 3.0 and s["collectives_match"] is True
