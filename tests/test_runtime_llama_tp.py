"""Tensor parallelism on Llama-family models, as a user runs it: `autopar.plan(..., tp=2)` then
`autopar.runtime.run(plan, ref)` on gloo processes, for the zoo Llama (GQA, RoPE, RMSNorm,
SwiGLU, untied vocabulary-parallel embedding and head) and a Hugging Face Llama built from a
tiny config. Each run must give the one-process losses within 1e-4, run its weights sharded as
Megatron does (q/k/v/gate/up column-parallel, o/down row-parallel) and issue exactly the
collectives the plan predicts. Plans of the analytic (Megatron) rules run op by op like the
ILP's (issue 20, one executor): the planner solves their activations' layouts with the weights
pinned where the rules place them (`inter_op.pinned_layouts`), and their collectives are that
solution's, and Megatron's (the rules' vocabulary-parallel embedding and loss held so:
`AnalyticProvider.vocab_parallel_ops`; the ILP alone gathered the table and the logits here,
9 all-reduces and 2 all-gathers against the 13 all-reduces the rules priced):

* forward: an all-reduce of the vocabulary-parallel embedding's output and one after each
  row-parallel projection (o_proj, down_proj): 1 + 2 per block;
* backward: an all-reduce of the gradient entering each block's two column-parallel groups
  (q/k/v, gate/up) and the vocabulary-parallel head's: 2 per block + 1;
* Megatron's vocabulary-parallel cross-entropy on the sharded logits (`runtime.vocab_loss`):
  3 all-reduces of one value per row, the logits never gathered;
* with dp, one flat gradient all-reduce per step.

The module's plans run in two launches (the 2-process plans in one, the 4-process in another)."""

from __future__ import annotations

import pytest

from tests.test_runtime import close

pytestmark = pytest.mark.slow
STEPS = 2       # as tests/test_runtime.py's: the second step is the one the checks need
GBS = 8
ZOO = "llama-tiny"   # 2 blocks, 4 heads, 2 KV heads (GQA), hidden 32, vocab 128, seq 16
HF = ("hf:llama?hidden_size=32&intermediate_size=64&num_hidden_layers=2&num_attention_heads=4"
      "&num_key_value_heads=2&vocab_size=128&seq_len=16")

HF_GPT2 = ("hf:gpt2?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&vocab_size=128&seq_len=16"
           "&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0")   # no dropout: the losses equal one process

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def make_plan(ref: str, devices: int, gbs: int = GBS, **pins):
    """The planner's plan for `ref` on `devices` CPU processes with the knobs in `pins`, with
    the analytic (Megatron) per-layer rules: these tests are about running Megatron's layout,
    vocabulary-parallel embedding included (the ILP may keep a table this small whole)."""
    from autopar import ClusterSpec, Constraints
    from tests.captured import planned  # each model captured once, its per-layer costs shared

    cluster = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": devices})
    return planned(ref, cluster, global_batch_size=gbs, dtype="fp32", intra_op="analytic",
                constraints=Constraints(num_microbatches=1, recompute="none", **pins))


_REF: dict[tuple[str, int], list[float]] = {}


def one_process_losses(ref: str, gbs: int = GBS) -> list[float]:
    """Losses of the one-process plan, run in this process (same seed, same global batches;
    memory untracked)."""
    from tests.captured import reference_losses

    if (ref, gbs) not in _REF:
        _REF[ref, gbs] = reference_losses(make_plan(ref, 1, gbs), ref, STEPS)
    return _REF[ref, gbs]


def _ilp_plan(ref: str, devices: int, gbs: int, tp: int):
    """The default (ILP) planner's plan for `ref` on `devices` CPU processes at tp `tp`."""
    from autopar import ClusterSpec, Constraints
    from tests.captured import planned

    cluster = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": devices})
    return planned(ref, cluster, global_batch_size=gbs, dtype="fp32", intra_op="ilp",
                constraints=Constraints(num_microbatches=1, recompute="none", tp=tp, dp=1, pp=1))


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Every plan of this module's tests (made as each test made it), run `STEPS` steps in two
    jobs (`tests/plans.py`, memory untracked): the 2-process plans in one launch, the 4-process
    ones in another. {name: (plan, rows)}."""
    from tests.launch import run_plans

    two = {"zoo_tp2": make_plan(ZOO, 2, tp=2, dp=1, pp=1), "ilp_zoo_tp2": _ilp_plan(ZOO, 2, GBS, 2)}
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        two["hf_tp2"] = make_plan(HF, 2, tp=2, dp=1, pp=1)
        two["hf_gpt2_tp2"] = make_plan(HF_GPT2, 2, tp=2, dp=1, pp=1)
    four = {"zoo_dp2_tp2": make_plan(ZOO, 4, tp=2, dp=2, pp=1), "ilp_small_tp4": _ilp_plan("llama-small", 4, 16, 4)}
    out = {}
    for plans, n in ((two, 2), (four, 4)):
        rows = run_plans(tmp_path_factory.mktemp(f"llama_tp_{n}"), plans, n, steps=STEPS)
        out.update({name: (p, rows[name]) for name, p in plans.items()})
    return out


def assert_megatron_placements(plan) -> None:
    """Every q/k/v/gate/up weight is sharded by rows (column-parallel) and every o/down weight
    by columns (row-parallel) on the tp axis; nothing else decides what these tests run."""
    st = plan.stages[0]
    tp = st.mesh_axis_names.index("tp")
    seen = {n: 0 for n in COLUMN + ROW}
    for fqn, pl in st.placements.items():
        leaf = fqn.rsplit(".", 2)[-2] if fqn.endswith(".weight") else ""
        if leaf in seen:
            assert pl[tp] == ("S(0)" if leaf in COLUMN else "S(1)"), (fqn, pl)
            seen[leaf] += 1
    assert all(seen.values()), seen


def megatron_collectives(blocks: int, dp: int = 1) -> dict[str, int]:
    """Megatron's collectives a step (module docstring) for `blocks` blocks, one micro-batch."""
    return {"all_reduce": (1 + 2 * blocks) + (2 * blocks + 1) + 3 + (1 if dp > 1 else 0)}


def run_and_check(plan, ref: str, rows: list[dict]) -> list[dict]:
    """`plan`'s rows from its run on its processes: losses equal one process, collectives equal
    the plan's."""
    assert isinstance(rows, list), rows
    steps = [r for r in rows if "step" in r]
    got = [r["loss"] for r in steps]
    want = one_process_losses(ref, plan.global_batch_size)
    assert close(got, want, 1e-4), (got, want)
    for r in steps:
        assert r["collectives"] == plan.predicted.collectives, (r["step"], r["collectives"],
                                                                plan.predicted.collectives)
    assert rows[-1]["summary"] and rows[-1]["collectives_match"] is True
    return rows


@pytest.mark.parametrize("ref", [ZOO, HF], ids=["zoo", "hf"])
def test_llama_tp2_analytic_plan_runs_as_solved(ref, launched):
    """tp=2 (4 heads, 2 KV heads: one KV head and its two query heads per rank)."""
    if ref.startswith("hf:"):
        pytest.importorskip("transformers")
    plan, rows = launched["hf_tp2" if ref.startswith("hf:") else "zoo_tp2"]
    assert_megatron_placements(plan)
    assert plan.stages[0].op_layouts is not None and "pinned" in plan.search["op_layouts"]
    # the collectives the rules priced, counted in the run
    assert plan.predicted.collectives == megatron_collectives(2)
    run_and_check(plan, ref, rows)


def test_llama_dp2_tp2_equals_one_process(launched):
    """dp2 x tp2 on 4 processes: the tp collectives of each replica plus the dp gradient sync."""
    plan, rows = launched["zoo_dp2_tp2"]
    assert plan.stages[0].mesh_shape == (2, 2)
    assert_megatron_placements(plan)
    assert plan.predicted.collectives == megatron_collectives(2, dp=2)
    run_and_check(plan, ZOO, rows)


def test_ilp_planned_llama_tp2_runs_as_predicted(launched):
    """The default planner on a small cluster costs layers with the intra-op ILP: its tp=2 plan
    (weight GEMMs split Megatron-style, the small embedding table kept whole) runs with the
    one-process losses and exactly the collectives it predicts."""
    p, rows = launched["ilp_zoo_tp2"]
    assert p.search["intra_op"] == "ilp"
    assert_megatron_placements(p)
    run_and_check(p, ZOO, rows)


def test_ilp_planned_llama_tp4_over_2_kv_heads_splits_query_heads(launched):
    """llama-small (4 query heads, 2 KV heads) at tp 4, the ILP's plan at micro-batch 16 (where
    its costs favour it: `test_plan_layouts.py::test_gqa_over_more_devices_than_kv_heads_
    splits_query_heads_without_gathering`): each attention splits its query heads over the 4
    ranks and reads K and V replicated, each rank slicing the KV head its query head reads
    (`rules.attention`, `execute._local_attention`), no collective around it forward, dK and
    dV reduced backward. Runs with the one-process losses and exactly the planned collectives."""
    p, rows = launched["ilp_small_tp4"]
    st = p.stages[0]
    att = [c for c in st.op_layouts.solution(st.mesh_shape).op_choices.values() if c.family == "attention"]
    assert len(att) == 4 and all(c.strategy == "hq@0" for c in att), [c.strategy for c in att]
    run_and_check(p, "llama-small", rows)


def test_hf_gpt2_tp2_analytic_plan_runs_megatrons_collectives(launched):
    """Hugging Face GPT-2 (Conv1D projections, a fused c_attn held chunk-interleaved) at
    analytic tp 2 trains with the one-process losses and Megatron's all-reduces, the
    collectives its time priced (before: 12 gradient all-gathers a step more, unpriced)."""
    pytest.importorskip("transformers")
    plan, rows = launched["hf_gpt2_tp2"]
    assert plan.predicted.collectives == megatron_collectives(2)
    assert "op_layouts_gap" not in plan.search
    run_and_check(plan, HF_GPT2, rows)
