"""Pipelines whose stages have different tensor-parallel degrees (Alpa's free sub-mesh per
stage; `autopar/runtime/pipeline_p2p.py`): executed plans give the one-process losses and run
the collectives they predict.

Every plan here is the planner's and carries every stage's op layouts: `autopar run` executes
tensor parallelism only op by op as solved (issue 20, one executor; `intra_op.pipeline_chunks`).
`hetero_plan`'s are the analytic rules' (Megatron's placements, the activations' layouts solved
with them pinned: `inter_op.pinned_layouts`) at pinned stage tp degrees;
`test_planned_hetero_pipelines_run_as_solved`'s the ILP's. Collectives: the plan's prediction
(the solutions'), beside pp's 2·M·(p − 1) send_recv (a receive counts once, however many ranks
a transfer reaches) and the tied embedding's gradient sync across the first and last stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.models.registry import build_model
from autopar.schema import Plan, StagePlan
from tests.captured import reference_losses as plan_losses
from tests.plans import GPT6_REF, planned

pytestmark = pytest.mark.slow
STEPS = 2       # as tests/test_runtime.py's: the second step is the one the checks need
M = 4
# layout: (devices, constraints): stage tp degrees pinned, M micro-batches (`hetero_plan`)
HETERO = {
    "tp1_tp2": (4, dict(stage_tp=(1, 1, 2), dp=1, schedule="1f1b")),
    "tp2_tp1": (4, dict(stage_tp=(2, 1, 1), dp=1, schedule="1f1b")),
    "tp1_tp2_tp1": (4, dict(stage_tp=(1, 2, 1), dp=1, schedule="gpipe")),
    "dp2_tp1_tp2": (8, dict(stage_tp=(1, 1, 2), dp=2, schedule="1f1b", zero_stage=0)),
    "dp2_tp1_tp2_z2": (8, dict(stage_tp=(1, 1, 2), dp=2, schedule="1f1b", zero_stage=2)),
    "dp2_tp1_tp2_z3": (8, dict(stage_tp=(1, 1, 2), dp=2, schedule="1f1b", zero_stage=3)),
}


def hetero_plan(layout: str) -> Plan:
    """The analytic rules' plan of gpt-tiny with 6 blocks (`GPT6_REF`: 3 stages need as many
    layers) at `HETERO[layout]`'s stage tp degrees (two stages alone then one on 2 ranks, the
    reverse, a tp-2 stage between two alone; 2 replicas of the first under ZeRO 0, 2, 3), `M`
    micro-batches, no recomputation: one file per layout that every process reads
    (`tests.plans.planned`)."""
    devices, cons = HETERO[layout]
    p = planned(f"hetero-{layout}", GPT6_REF, devices,
                dict(cons, num_microbatches=M, recompute="none"), "analytic")
    assert [s.axis_size("tp") for s in sorted(p.stages, key=lambda s: s.index)] == list(cons["stage_tp"])
    return p


# ---------------------------------------------------------------------------------------------
# the 4-process plans of the tests below, run in one 4-process job (the runtime tests' layouts
# job, `tests.launch.run_plans`: the programs every rank traces alike traced once, before the
# ranks fork); they ran in three launches of this module's own script before
PLANNED = {
    # test_planned_hetero_pipelines_run_as_solved: (model, constraints), the ILP's plans
    "gpt6_112": (GPT6_REF, dict(stage_tp=(1, 1, 2), num_microbatches=4, schedule="1f1b", recompute="none")),
    "gpt6_211": (GPT6_REF, dict(stage_tp=(2, 1, 1), num_microbatches=2, schedule="gpipe", recompute="full")),
    "mlp_free": ("mlp-tiny", dict(dp=1)),
}


@pytest.fixture(scope="module")
def launched4(tmp_path_factory) -> dict:
    """{name: (plan, rows)} for `HETERO`'s 4-process layouts and `PLANNED`'s plans, `STEPS`
    steps each, in one 4-process job."""
    from autopar.schema import ClusterSpec, Constraints
    from tests.captured import planned as make  # each model captured once, its per-layer costs shared
    from tests.launch import run_plans

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4, "num_nodes": 1})
    plans = {lay: hetero_plan(lay) for lay, (devices, _) in HETERO.items() if devices == 4}
    for name, (ref, cons) in PLANNED.items():
        plans[name] = make(ref, cl, global_batch_size=8, dtype="fp32", constraints=Constraints(**cons),
                           intra_op="ilp")
    rows = run_plans(tmp_path_factory.mktemp("hetero4"), plans, 4, steps=STEPS)
    return {name: (p, rows[name]) for name, p in plans.items()}


def launch(layouts: list[str], nproc: int, tmp_path: Path) -> dict:
    """`HETERO`'s `layouts` run `STEPS` steps in one `nproc`-process job: {layout: rows}."""
    from tests.launch import run_plans

    return run_plans(tmp_path, {lay: hetero_plan(lay) for lay in layouts}, nproc, steps=STEPS)


def check(rows: list[dict] | dict, plan: Plan, ref: list[float], name: str) -> None:
    from tests.test_runtime import close

    assert isinstance(rows, list), (name, rows)
    steps = [r for r in rows if "step" in r]
    got = [r["loss"] for r in steps]
    assert close(got, ref, 1e-4), (name, got, ref)
    assert steps[-1]["collectives"] == plan.predicted.collectives, (name, steps[-1]["collectives"],
                                                                    plan.predicted.collectives)
    assert rows[-1]["collectives_match"] is True, name


# ---------------------------------------------------------------------------------------------
def test_stages_of_different_tp_equal_one_process(launched4):
    """4 processes, 1F1B: tp 1 -> tp 1 -> tp 2 and tp 2 -> tp 1 -> tp 1: the losses of `STEPS` steps
    within 1e-4 of one process, the counted collectives as planned."""
    from tests.test_runtime import reference_losses

    for lay in ["tp1_tp2", "tp2_tp1"]:
        p, rows = launched4[lay]
        check(rows, p, reference_losses(GPT6_REF), lay)


def test_wide_stage_between_narrow_ones(launched4):
    """4 processes, GPipe: tp 1 -> tp 2 -> tp 1 (fan-out and fan-in in one pipeline; the tied
    embedding joins two tp-1 stages)."""
    from tests.test_runtime import reference_losses

    p, rows = launched4["tp1_tp2_tp1"]
    check(rows, p, reference_losses(GPT6_REF), "tp1_tp2_tp1")


def test_data_parallel_replicas_of_a_hetero_pipeline(tmp_path):
    """8 processes: two dp replicas of tp 1 -> tp 1 -> tp 2, with ZeRO 0, 2 and 3 (each replica its own
    point-to-point group; the tied gradient summed per replica, over both under ZeRO-3)."""
    from tests.test_runtime import reference_losses

    layouts = ["dp2_tp1_tp2", "dp2_tp1_tp2_z2", "dp2_tp1_tp2_z3"]
    res = launch(layouts, 8, tmp_path)
    for lay in layouts:
        check(res[lay], hetero_plan(lay), reference_losses(GPT6_REF), lay)


def test_planned_hetero_pipelines_run_as_solved(launched4):
    """Plans of the planner (intra-op ILP) with stages of different tp on 4 processes, each
    stage carrying its op layouts, run op by op as solved: the losses of `STEPS` steps within 1e-4
    of one process and every counted collective the plan's.

    * gpt-tiny with 6 blocks, `Constraints(stage_tp=(1, 1, 2))`, 1F1B over 4 micro-batches:
      the tied embedding on a 1-device stage and vocabulary-parallel in the tp-2 last stage
      (its gradient summed over both, whole); the residual stream handed to the tp-2 stage;
    * the same, `stage_tp=(2, 1, 1)`, GPipe, full recomputation: a tp-2 first stage hands its
      output to 1-device stages, the recomputed regions re-run their collectives;
    * mlp-tiny planned freely (dp pinned to 1): the search picks stages of tp 2, 1, 1 by
      itself; the tp-2 stage's column-parallel output is gathered before it leaves (the
      all-gather the plan counts)."""
    from tests.test_runtime import reference_losses

    plans, res = {n: launched4[n][0] for n in PLANNED}, {n: launched4[n][1] for n in PLANNED}
    for name, (_, cons) in PLANNED.items():
        p = plans[name]
        tps = [s.axis_size("tp") for s in sorted(p.stages, key=lambda s: s.index)]
        assert len(set(tps)) > 1 and all(s.op_layouts is not None for s in p.stages), (name, tps, p.search)
        if "stage_tp" in cons:
            assert tuple(tps) == cons["stage_tp"]
    one = plans["mlp_free"].model_copy(update={"stages": [StagePlan(
        index=0, devices=[0], mesh_shape=(1,), mesh_axis_names=("dp",),
        layers=[x for s in sorted(plans["mlp_free"].stages, key=lambda s: s.index) for x in s.layers])]})
    refs = {"gpt6_112": reference_losses(GPT6_REF, steps=STEPS), "gpt6_211": reference_losses(GPT6_REF, steps=STEPS),
            "mlp_free": plan_losses(one, "mlp-tiny", STEPS)}
    for name in PLANNED:
        check(res[name], plans[name], refs[name], name)
    assert plans["mlp_free"].predicted.collectives.get("all_gather", 0) >= 1


def test_planner_hetero_plan_runs(tmp_path):
    """The planner emits stages of different tp for mlp-tiny on a 4-device CPU node (dp pinned to
    1, the analytic per-layer costs): stages of tp 1, 2 and 1. It runs op by op as solved (its
    layouts solved with the rules' placements pinned), with the one-process losses and the
    collectives the plan predicts."""
    from autopar.planner import plan as make
    from autopar.runtime import run
    from autopar.schema import ClusterSpec, Constraints
    from tests.test_runtime import close

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4, "num_nodes": 1})
    plan = make("mlp-tiny", cl, global_batch_size=8, dtype="fp32", constraints=Constraints(dp=1), intra_op="analytic")
    assert len({s.axis_size("tp") for s in plan.stages}) > 1, [s.mesh_shape for s in plan.stages]
    rows = run(plan, "mlp-tiny", steps=STEPS, quiet=True)
    layers = [x for s in sorted(plan.stages, key=lambda s: s.index) for x in s.layers]
    one = plan.model_copy(update={"stages": [StagePlan(index=0, devices=[0], mesh_shape=(1,), mesh_axis_names=("dp",),
                                                       layers=layers)]})
    ref = plan_losses(one, "mlp-tiny", STEPS)
    steps = [r for r in rows if "step" in r]
    assert close([r["loss"] for r in steps], ref, 1e-4), (steps, ref)
    counted, planned = steps[-1]["collectives"], plan.predicted.collectives
    assert counted.get("send_recv") == planned.get("send_recv") == 2 * plan.num_microbatches * (plan.pp - 1)
    assert all(s.op_layouts is not None for s in plan.stages)
    assert counted == planned, (counted, planned)
    assert rows[-1]["collectives_match"] is True


def test_checkpoint_of_a_hetero_pipeline(tmp_path):
    """A hetero plan saves a checkpoint (the tied embedding once, by its first holder:
    `ParallelModel.checkpoint_skip`) holding every parameter and its optimizer state; a dp2 plan
    resumes from it with the one-process loss."""
    from torch.distributed.checkpoint import FileSystemReader

    from autopar.runtime import run
    from tests.plans import make_plan
    from tests.test_runtime import close, reference_losses

    a = tmp_path / "a"
    run(hetero_plan("tp1_tp2"), GPT6_REF, steps=2, checkpoint_dir=str(a), checkpoint_every=2, quiet=True)
    keys = set(FileSystemReader(str(a / "step_00000002")).read_metadata().state_dict_metadata)
    names = {n for n, _ in build_model(GPT6_REF, device="meta").model.named_parameters()}
    assert {k[len("model."):] for k in keys if k.startswith("model.")} == names, keys
    assert {f"optim.{n}.exp_avg" for n in names} <= keys, keys
    rows = run(make_plan("dp2", ref=GPT6_REF), GPT6_REF, steps=3, checkpoint_dir=str(a), quiet=True)
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [2]
    want = reference_losses(GPT6_REF, steps=3)
    assert close([steps[0]["loss"]], want[2:], 1e-4), (steps, want)


def test_every_send_has_one_receive():
    """`send_peers` is the inverse of `recv_peer`: each rank of a stage receives from exactly one
    rank of its neighbour, whatever the two stages' sizes; `replica_ranks` splits by dp."""
    from autopar.runtime.pipeline_p2p import recv_peer, replica_ranks, send_peers

    for a in range(1, 5):
        for b in range(1, 5):
            ranks = [list(range(a)), list(range(10, 10 + b))]
            for s, p in ((0, 1), (1, 0)):
                sent = sorted(r for c in range(len(ranks[s])) for r in send_peers(ranks, s, p, c))
                assert sent == ranks[p], (a, b, s)
                for k, r in enumerate(ranks[p]):
                    src = recv_peer(ranks, p, s, k)
                    assert r in send_peers(ranks, s, p, ranks[s].index(src)), (a, b, s, k)
    assert replica_ranks([4, 5, 6, 7], (2, 2), ("dp", "tp")) == [[4, 5], [6, 7]]
    assert replica_ranks([4, 5, 6, 7], (2, 2), ("tp", "dp")) == [[4, 6], [5, 7]]


def test_interleaving_needs_equal_stage_meshes():
    from autopar.models.registry import build_model as build
    from autopar.runtime.engine import validate_plan
    from autopar.schema.errors import PlanError
    from tests.plans import _layers, _plan

    def _stage(index: int, devices: list[int], layers: list[str]) -> StagePlan:
        return StagePlan(index=index, devices=devices, mesh_shape=(1, len(devices)), mesh_axis_names=("dp", "tp"),
                         layers=layers)

    L = _layers(2)
    st = [_stage(0, [0], L[:1]), _stage(1, [1, 2], L[1:2]), _stage(2, [0], L[2:3]), _stage(3, [1, 2], L[3:])]
    for i in (2, 3):
        st[i].virtual_chunk = 1
    plan = _plan("gpt-tiny", st, gbs=8, mb=2, m=4, schedule="interleaved_1f1b", v=2, nodes_devices=3)
    with pytest.raises(PlanError, match="interleaved pipelines need equal stage meshes"):
        validate_plan(plan, build("gpt-tiny", device="meta").model)

