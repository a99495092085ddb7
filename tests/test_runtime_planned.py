"""Plans whose per-layer costs come from the intra-op ILP (`intra_op="ilp"`) run exactly as
predicted: every step's counted collectives equal `plan.predicted.collectives`,
including the once-per-step moves of gradients to their parameters' layouts, and the losses
equal one process."""

import pytest

from autopar import ClusterSpec, Constraints
from autopar.runtime import run
from tests.captured import one_process_losses, planned, reference_losses, shared_plan, untracked

pytestmark = pytest.mark.slow
# steps each layout runs (and its one-process reference): the second is the first after the
# pipeline's warm-up and on weights the first update changed (the optimizer's state made),
# what the collectives and losses checks need; more steps repeat the same checks
STEPS = 2

_GPT_SP = {"tp": 2, "pp": 2, "num_microbatches": 2, "schedule": "1f1b"}     # the gpt-tiny case below


def _formula_links(cl: ClusterSpec) -> ClusterSpec:
    """`cl` with its node's link timed by the alpha-beta formula alone, its measured tables left
    out: on this CPU profile gloo's measured all-reduce is cheaper than a reduce-scatter and an
    all-gather, so the ILP (timing a tp axis from the tables since session 29) keeps Megatron-SP
    plans' norms and residual adds replicated inside a block; by the formula it puts them on
    sequence slices, as it does on the GPU profiles, which is the layout these tests run."""
    link = cl.intra_node.model_copy(update={"measured": []})
    return cl.model_copy(update={"intra_node": link})


@pytest.fixture(scope="module")
def gpt_job(tmp_path_factory) -> dict:
    """The 4-process plans of gpt-tiny the ILP makes in this module's tests (tp 2 x pp 2; its
    sequence-parallel variant; dp 2 x tp 2 under ZeRO-3 with full recomputation in fp32,
    selective in bf16 and sequence parallelism), each made as its test made it, run `STEPS` steps in
    one 4-process job (`tests/plans.py`; as `autopar.runtime.run` runs a plan, memory
    untracked): {name: (plan, rows)}."""
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    plans = {"tp2_pp2": planned("gpt-tiny", cl, global_batch_size=8, dtype="fp32", intra_op="ilp",
                                constraints=Constraints(tp=2, pp=2, dp=1, num_microbatches=2, recompute="none",
                                                        schedule="1f1b")),
             "sp": planned("gpt-tiny", _formula_links(cl), global_batch_size=8, dtype="fp32", intra_op="ilp",
                           constraints=Constraints(sequence_parallel=True, recompute="none", **_GPT_SP))}
    for name, dtype, rc, sp in (("full_fp32", "fp32", "full", False), ("selective_bf16", "bf16", "selective", False),
                                ("sp_fp32", "fp32", "none", True)):
        cons = Constraints(dp=2, tp=2, pp=1, zero_stage=3, num_microbatches=2, recompute=rc, sequence_parallel=sp)
        plans[name] = planned("gpt-tiny", cl, global_batch_size=8, dtype=dtype, constraints=cons, intra_op="ilp")
    rows = _run_in_one_job(tmp_path_factory.mktemp("gpt_plans"), plans, 4)
    return {name: (p, rows[name]) for name, p in plans.items()}


def test_ilp_planned_gpt_tp2_pp2_runs_as_predicted(gpt_job):
    p, rows = gpt_job["tp2_pp2"]
    assert p.search["intra_op"] == "ilp"
    assert isinstance(rows, list), rows
    steps = [r for r in rows if "step" in r]
    # from the first step on: torch.pipelining's warm-up vote runs at setup (`pipeline._vote_now`)
    assert all(r["collectives"] == p.predicted.collectives for r in steps), \
        ([r["collectives"] for r in steps], p.predicted.collectives)
    ref = _single_losses("fp32")
    assert [r["loss"] for r in steps] == pytest.approx(ref, rel=1e-4)


def _single(dtype: str = "fp32", ref: str = "gpt-tiny"):
    """The planner's plan of `ref` for one CPU process (2 micro-batches), from the session's
    capture of `ref` and its shared per-layer costs (`tests.captured.shared_plan`)."""
    return shared_plan(ref, 1, global_batch_size=8, dtype=dtype,
                       constraints=Constraints(num_microbatches=2, recompute="none"))


_SINGLE: dict = {}


def _single_losses(dtype: str) -> list[float]:
    """`STEPS` steps of `_single(dtype)` (gpt-tiny, 2 micro-batches) on one process, once in the module."""
    if dtype not in _SINGLE:
        _SINGLE[dtype] = reference_losses(_single(dtype), "gpt-tiny", STEPS)
    return _SINGLE[dtype]


_LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=2"
          "&num_attention_heads=4&seq_len=16&vocab_size=128")


@pytest.mark.parametrize("model,n,pins", [
    ("gpt-tiny", 4, _GPT_SP),
    (_LLAMA, 2, {"tp": 2}),
])
def test_sequence_parallel_plans_run_as_predicted(model, n, pins, request):
    """Megatron-SP (`Constraints(sequence_parallel=True)`, issue 13): the norms and residual
    adds run on sequence slices (the zoo GPT's LayerNorm, Llama's RMSNorm written out), the
    residual stream crosses layers and pipeline chunks split along its tokens, and the executor
    runs it as solved: counted collectives equal the plan's (reduce-scatters into the slices,
    all-gathers before the column-parallel GEMMs), losses equal one process."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": n})
    if model == "gpt-tiny":     # planned as below and run in the module's one gpt-tiny job
        p, rows = request.getfixturevalue("gpt_job")["sp"]
    else:
        p = planned(model, cl, global_batch_size=8, dtype="fp32", intra_op="ilp",
                    constraints=Constraints(sequence_parallel=True, recompute="none", **pins))
        with untracked():      # memory is the memory tests': losses and collectives are compared
            rows = run(p, model, steps=STEPS, seed=0, quiet=True)
    assert isinstance(rows, list), rows
    assert p.sequence_parallel and p.tp == 2 and "tp_executor" not in p.search
    assert p.predicted.collectives.get("reduce_scatter", 0) > 0
    for st in p.stages:
        lay = st.op_layouts
        assert lay is not None
        sig = lay.signatures[lay.layers[-1].signature]
        adds = [ol.outputs[0] for name, ol in zip(lay.layers[-1].ops, sig) if name.startswith("add")]
        assert ("S(1)",) in adds              # residual adds on sequence slices
    steps = [r for r in rows if "step" in r]
    assert all(r["collectives"] == p.predicted.collectives for r in steps[1:]), \
        ([r["collectives"] for r in steps], p.predicted.collectives)
    if model == "gpt-tiny" and p.num_microbatches == 2:
        want = _single_losses("fp32")      # the same one-process plan as below
    else:
        one = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 1})
        ref = planned(model, one, global_batch_size=8, dtype="fp32",
                      constraints=Constraints(num_microbatches=p.num_microbatches, recompute="none"))
        want = reference_losses(ref, model, STEPS)
    assert [r["loss"] for r in steps] == pytest.approx(want, rel=1e-4)


def test_ilp_planned_gpt_dp2_tp2_zero3_runs_as_solved(gpt_job):
    """dp 2 x tp 2 with ZeRO-3 runs op by op as solved (`StagePlan.op_layouts`; no
    `tp_executor` fallback in the plan): FSDP2 units on the dp axis over the executor's tp
    DTensors, each unit's ops one FSDP call. Full recomputation in fp32, selective in bf16
    (fp32 masters as FSDP's shards) and sequence parallelism, 2 micro-batches each, in one
    4-process job: the losses of one process within 1e-4, every step's collectives the plan's
    (the units' gathers and reduce-scatters, `planner._zero3_counts`, beside the solution's tp
    collectives)."""
    for name, dtype, rc in (("full_fp32", "fp32", "full"), ("selective_bf16", "bf16", "selective"),
                            ("sp_fp32", "fp32", "none")):
        p, rows = gpt_job[name]
        assert p.dtype == dtype and p.sequence_parallel == (name == "sp_fp32")
        assert p.stages[0].op_layouts is not None and "tp_executor" not in p.search, p.search
        assert p.stages[0].fsdp_units and p.stages[0].recompute == rc
        assert_ran_as_planned(name, rows, p, _single_losses(p.dtype))


def test_ilp_planned_zero3_tp_pipelines_run_as_solved(tmp_path):
    """pp 2 x dp 2 x tp 2 with ZeRO-3 (8 processes) runs as solved: each pipeline chunk
    (`intra_op.pipeline_chunks.ProgramChunk`) the FSDP root of its units, driven by
    torch.pipelining as the module path's roots are. The zoo GPT under 1F1B, nanoGPT (its
    matmul head reading the tied wte, a unit of the first chunk, in the root of the last) under
    GPipe, HF Llama interleaved (two chunks, two roots per rank): the losses of one process
    within 1e-4 and, after the first step (which carries torch.pipelining's warm-up), the
    plan's collectives."""

    pytest.importorskip("transformers")
    from tests.test_runtime_user_models import HF_LLAMA, NANOGPT

    cases = {"gpt": ("gpt-tiny", dict(schedule="1f1b")), "nanogpt": (NANOGPT, dict(schedule="gpipe")),
             "llama": (HF_LLAMA, dict(schedule="interleaved_1f1b", virtual_stages=2))}
    plans = {}
    for name, (ref, kw) in cases.items():
        cons = Constraints(dp=2, tp=2, pp=2, zero_stage=3, num_microbatches=2, **kw)
        p = shared_plan(ref, 8, constraints=cons, intra_op="ilp")
        assert all(s.op_layouts is not None and s.fsdp_units for s in p.stages), p.search
        assert "tp_executor" not in p.search, p.search
        plans[name] = p
    # two steps (8 processes on the suite's 2 cores): the second counts collectives after the
    # warm-up and runs on weights the first updated
    rows = _run_in_one_job(tmp_path, plans, 8, steps=2)
    for name, p in plans.items():
        assert_ran_as_planned(name, rows[name], p, one_process_losses(cases[name][0], 2), first=1)


def assert_ran_as_planned(name: str, got, p, ref: list, first: int = 0) -> None:
    """A plan's rows from `_run_in_one_job`: every step from `first` on counted the plan's
    collectives (a pipeline's first step also exchanges shape metadata), and the losses equal
    the one-process run's `ref` within 1e-4."""
    assert isinstance(got, list), (name, got)
    steps = [r for r in got if "step" in r]
    assert all(r["collectives"] == p.predicted.collectives for r in steps[first:]), \
        (name, [r["collectives"] for r in steps], p.predicted.collectives)
    assert [r["loss"] for r in steps] == pytest.approx(ref, rel=1e-4), name


def _run_in_one_job(tmp_path, plans: dict, nproc: int, steps: int = STEPS) -> dict:
    """Every plan of `plans` (name -> Plan) run `steps` steps in one launch of `nproc` processes
    (`tests/plans.py`): name -> its rows (or the launch's error for it)."""
    from tests.launch import run_plans

    return run_plans(tmp_path, plans, nproc, steps=steps)
