"""Issue 20, one executor: every tp plan the planner makes runs op by op as solved.

Plans of the analytic per-layer rules carry per-op layouts solved with the rules' parameter
placements pinned (`inter_op.pinned_layouts`) and run through the executor like the ILP's;
where they cannot (OR-Tools missing, a torch.fx capture) the plan says why and `autopar run`
refuses it, naming the fix. ZeRO-3 units whose ops interleave are left to the root unit
(`planner.contiguous_units`), so that the executor runs each unit's ops as one call.

The multi-process checks (a user-written GPT's analytic dp 2 x tp 2 plan, and ZeRO-3 on a model
reusing a layer module, in one 4-process launch) are marked slow; the zoo's and Hugging Face's
analytic tp plans run in tests/test_runtime_llama_tp.py.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.inter_op.pinned_layouts import NO_EXPORT, NO_ORTOOLS
from autopar.planner import contiguous_units, plan
from autopar.runtime.validate import validate_plan
from autopar.schema import Constraints, PlanError

NANOGPT = "tests.user_models:nanogpt"


def _cpu(n: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


def _analytic(ref, n: int, **pins):
    return plan(ref, _cpu(n), global_batch_size=8, dtype="fp32", intra_op="analytic",
                constraints=Constraints(num_microbatches=1, recompute="none", **pins))


def test_analytic_plan_carries_layouts_with_its_placements():
    """An analytic tp plan carries every stage's per-op layouts, its weights laid out where the
    rules put them (the plan's `placements` on the tp axis), and predicts the solution's
    collectives; the plan says how the layouts were made."""
    p = _analytic("gpt-tiny", 2, dp=1, tp=2, pp=1)
    st = p.stages[0]
    assert st.op_layouts is not None and "tp_executor" not in p.search
    assert "analytic rules' parameter placements pinned" in p.search["op_layouts"]
    tp = st.mesh_axis_names.index("tp")
    solved = st.op_layouts.solution((2,)).param_placements
    assert {f: pl[0] for f, pl in solved.items()} == {f: st.placements[f][tp] for f in solved}
    assert any(pl[tp] == "S(1)" for pl in st.placements.values())        # row-parallel projections
    want = {k: v for k, v in st.op_layouts.collectives.get("forward", {}).items()}
    for k, v in st.op_layouts.collectives.get("backward", {}).items():
        want[k] = want.get(k, 0) + v
    assert p.predicted.collectives == want


def test_analytic_plan_runs_the_vocabulary_parallel_embedding_and_loss_it_prices():
    """The analytic rules price Megatron's vocabulary-parallel embedding (its output
    all-reduced) and cross-entropy (three all-reduces of one value per row, the logits never
    gathered); the pinned solve holds those ops so (`AnalyticProvider.vocab_parallel_ops`,
    `solve_graph`'s `fixed_ops`), where the ILP alone gathered the table and the logits on the
    CPU profile (9 all-reduces and 2 all-gathers a step). llama-tiny tp2 (2 blocks): Megatron's
    1 + 2 x 2 forward, 2 x 2 + 1 backward and 3 loss all-reduces. The run counts them:
    tests/test_runtime_llama_tp.py."""
    p = _analytic("llama-tiny", 2, dp=1, tp=2, pp=1)
    st = p.stages[0]
    choices = {n: c.strategy for n, c in st.op_layouts.solution((2,)).op_choices.items()
               if c.family in ("embedding", "loss")}
    assert choices == {"embedding": "v@0", "cross_entropy_loss": "c@0 (vocab-parallel)"}
    assert p.predicted.collectives == {"all_reduce": 5 + 5 + 3}


HF_GPT2 = "hf:gpt2?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&vocab_size=128&seq_len=16"
HF_LLAMA = ("hf:llama?hidden_size=32&intermediate_size=64&num_hidden_layers=2&num_attention_heads=4"
            "&num_key_value_heads=2&vocab_size=128&seq_len=16")


def test_hf_gpt2_conv1d_is_sharded_as_megatrons_linears():
    """Hugging Face GPT-2's projections are Conv1D (`addmm(bias, x, weight)`, the weight held
    (in, out)): the analytic rules shard them as Megatron's linears (c_attn and c_fc column-
    parallel, their weight's output dim 1 and bias split; c_proj row-parallel, weight dim 0).
    Before, the rules left the blocks replicated and the pinned solve ran 13 all-reduces and
    12 gradient all-gathers a step that the rules' time never priced."""
    pytest.importorskip("transformers")
    p = _analytic(HF_GPT2, 2, dp=1, tp=2, pp=1)
    st = p.stages[0]
    tp = st.mesh_axis_names.index("tp")
    for i in range(2):
        h = f"transformer.h.{i}."
        got = {f[len(h):]: pl[tp] for f, pl in st.placements.items() if f.startswith(h) and "ln_" not in f}
        assert got == {"attn.c_attn.weight": "S(1)", "attn.c_attn.bias": "S(0)",
                       "attn.c_proj.weight": "S(0)", "attn.c_proj.bias": "R",
                       "mlp.c_fc.weight": "S(1)", "mlp.c_fc.bias": "S(0)",
                       "mlp.c_proj.weight": "S(0)", "mlp.c_proj.bias": "R"}


@pytest.mark.parametrize("ref,blocks", [(HF_GPT2, 2), (HF_LLAMA, 2), (NANOGPT, 4)])
def test_models_written_by_others_run_the_collectives_the_rules_price(ref, blocks):
    """The analytic tp2 plan of a model autopar's zoo did not write runs Megatron's layout, the
    collectives its time priced and no others: 1 + 2 per block forward (vocabulary-parallel
    embedding, row-parallel outputs), 2 per block + 1 backward (column-parallel inputs, the
    output layer's), 3 for the vocabulary-parallel loss. A rank stepped on a fake process group
    (`autopar verify`) counts what the plan predicts. nanoGPT's tied head `x @ wte.weight.t()`
    was priced replicated while the solve gathered the table for it (1 all-gather a step)."""
    if ref.startswith("hf:"):
        pytest.importorskip("transformers")
    from autopar.runtime.verify import verify

    p = _analytic(ref, 2, dp=1, tp=2, pp=1)
    assert p.predicted.collectives == {"all_reduce": (1 + 2 * blocks) + (2 * blocks + 1) + 3}
    assert "op_layouts_gap" not in p.search
    r = verify(p, ref, jobs=1)
    assert r.ok, r.failures
    assert r.collectives_measured == p.predicted.collectives
    # every gradient held in its parameter's layout, the vocabulary-parallel table's (S(0) over
    # tp) too: DTensor's backward hands that one back replicated, whole (`execute._reshard`)
    assert [rc.tracked_categories["gradients"] for rc in r.ranks] == \
        [rc.predicted_categories["gradients"] for rc in r.ranks]


def test_a_layout_the_rules_did_not_price_is_told(monkeypatch):
    """Where the pinned solution runs other collectives than the analytic rules priced (here the
    rules made blind to Conv1D, as they were: HF GPT-2's blocks priced replicated, the solve
    syncing their gradients by all-gathers), the plan says so beside its prediction."""
    pytest.importorskip("transformers")
    from autopar.inter_op import stage_cost

    real = stage_cost.linear_like
    monkeypatch.setattr(stage_cost, "linear_like", lambda g, n: None if n.op == "addmm" else real(g, n))
    p = _analytic(HF_GPT2, 2, dp=1, tp=2, pp=1)
    gap = p.search["op_layouts_gap"]
    # priced: the vocabulary-parallel embedding, the head's input gradient, the loss's three
    assert gap.startswith("the analytic rules priced 5 all_reduce a step, the solved layouts run "
                          "12 all_gather, 13 all_reduce: the predicted iteration time does not price")


def test_fixed_op_strategy_the_op_cannot_take_is_an_error():
    """`solve_graph`'s `fixed_ops` names a strategy the op does not have: PlanError naming the
    op and the strategies it has."""
    from autopar.capture import capture
    from autopar.intra_op import solve_graph
    from autopar.models.registry import build_model
    from cost_models.communication import logical_mesh

    b = build_model("llama-tiny", device="meta")
    g = capture(b.model, b.example_inputs, name=b.name).at_batch(2)
    mesh = logical_mesh(_cpu(2), [0, 1], (2,))
    with pytest.raises(PlanError, match=r"op embedding \(embedding\) cannot take strategy 'x@0'.*v@0"):
        solve_graph(g, mesh, fixed_ops={"embedding": "x@0"}, time_limit_s=5)


def test_fx_captured_tp_plan_is_refused():
    """A model only the torch.fx fallback captures has no exported program to execute: its tp
    plan records why, and the runtime refuses it before any process starts."""
    from autopar.capture.export import _WithLoss, default_loss
    from autopar.capture.fx_fallback import capture_fx
    from autopar.models.registry import build_model

    b = build_model("gpt-tiny")
    g = capture_fx(_WithLoss(b.model, default_loss), b.example_inputs, "gpt-tiny")
    p = plan("gpt-tiny", _cpu(2), global_batch_size=8, dtype="fp32", graph=g,
             constraints=Constraints(num_microbatches=1, dp=1, tp=2, pp=1))
    assert p.search["tp_executor"] == NO_EXPORT
    assert all(s.op_layouts is None for s in p.stages)
    with pytest.raises(PlanError, match=r"stage 0 is tensor-parallel \(tp 2\).*torch\.fx fallback"):
        validate_plan(p, build_model("gpt-tiny", device="meta").model)


def test_free_search_of_an_fx_capture_keeps_tp_at_one():
    """Left free, the search does not return a tp plan `autopar run` would refuse: a torch.fx
    capture's plan keeps tp at 1 and says why."""
    from autopar.capture.export import _WithLoss, default_loss
    from autopar.capture.fx_fallback import capture_fx
    from autopar.models.registry import build_model

    b = build_model("gpt-tiny")
    g = capture_fx(_WithLoss(b.model, default_loss), b.example_inputs, "gpt-tiny")
    p = plan("gpt-tiny", _cpu(4), global_batch_size=8, dtype="fp32", graph=g)
    assert p.tp == 1 and "tp_executor" not in p.search
    assert p.search["tp_free"].endswith(NO_EXPORT)


def test_tp_plan_without_ortools_is_refused(monkeypatch):
    """Without OR-Tools nothing solves the per-op layouts: the plan says so, and the runtime
    refuses it with the fix (install OR-Tools, re-plan)."""
    from autopar.models.registry import build_model

    monkeypatch.setitem(sys.modules, "autopar.inter_op.ilp_provider", None)   # its import fails
    p = _analytic("gpt-tiny", 2, dp=1, tp=2, pp=1)
    assert p.search["tp_executor"] == NO_ORTOOLS
    with pytest.raises(PlanError, match=r"tensor-parallel.*pip install ortools and re-plan"):
        validate_plan(p, build_model("gpt-tiny", device="meta").model)


def test_tp_plan_written_by_hand_is_refused():
    """A tp plan naming parameter placements alone (no per-op layouts, no planner record) is
    refused before any process starts: placements do not say how each op runs."""
    from autopar.models.registry import build_model

    p = _analytic("gpt-tiny", 2, dp=1, tp=2, pp=1)
    bare = p.model_copy(update={"stages": [s.model_copy(update={"op_layouts": None}) for s in p.stages],
                                "search": {}})
    with pytest.raises(PlanError, match=r"stage 0 is tensor-parallel \(tp 2\).*re-plan with `autopar plan`"):
        validate_plan(bare, build_model("gpt-tiny", device="meta").model)


class _Twice(nn.Module):
    """A module called again after another's ops: `a`'s run of ops holds `b`'s."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(x))).square().mean()


def test_interleaving_zero3_units_go_to_the_root():
    """`contiguous_units`: of units whose runs of ops overlap, the first is kept and the other
    left to the root unit (the executor runs each unit's ops as one call)."""
    from autopar.capture import capture

    g = capture(_Twice(), (torch.randn(4, 8),))
    assert contiguous_units(g, ["a", "b"]) == (["a"], ["b"])
    assert contiguous_units(g, ["b"]) == (["b"], [])





REUSED = "tests.user_models:reused_lm"
GATED = "tests.user_models:gated_lm"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The analytic plans of the slow tests below, run 2 steps in one 4-process job:
    {name: (plan, rows)}."""
    from tests.launch import run_plans

    plans = {"nanogpt_dp2xtp2": _analytic(NANOGPT, 4, dp=2, tp=2, pp=1),
             "reused_zero3": _analytic(REUSED, 4, dp=2, tp=2, pp=1, zero_stage=3),
             "gated_dp2xtp2": _analytic(GATED, 4, dp=2, tp=2, pp=1)}
    rows = run_plans(tmp_path_factory.mktemp("one_executor"), plans, 4, steps=2)
    return {name: (p, rows[name]) for name, p in plans.items()}


def _check(p, rows, ref: str) -> None:
    """The one-process losses within 1e-4, every step's collectives the plan's."""
    from tests.captured import one_process_losses
    from tests.test_runtime import close

    assert isinstance(rows, list), rows
    steps = [r for r in rows if "step" in r]
    want = one_process_losses(ref, 2)
    assert close([r["loss"] for r in steps], want, 1e-4), (steps, want)
    assert all(r["collectives"] == p.predicted.collectives for r in steps), (steps, p.predicted.collectives)
    assert rows[-1]["collectives_match"] is True


@pytest.mark.slow
def test_user_model_analytic_tp_plan_runs_as_solved(launched):
    """A user-written GPT (nanoGPT-style: fused qkv split into [q; k; v] blocks, a head computed
    as `x @ wte.weight.t()`) planned by the analytic rules at dp 2 x tp 2 runs op by op on 4
    gloo processes: the one-process losses within 1e-4, exactly the planned collectives."""
    p, rows = launched["nanogpt_dp2xtp2"]
    assert all(s.op_layouts is not None for s in p.stages), p.search
    _check(p, rows, NANOGPT)


@pytest.mark.slow
def test_interleaving_units_plan_runs_as_solved(launched):
    """A layer module called again after another's ops (`tests.user_models:reused_lm`), dp 2 x
    tp 2 under ZeRO-3: the interleaving unit goes to the root (the plan says so), and the plan
    runs op by op with the one-process losses and exactly its collectives (it ran by DTensor
    propagation before issue 20's one executor)."""
    p, rows = launched["reused_zero3"]
    assert p.stages[0].op_layouts is not None and p.stages[0].fsdp_units == ["emb", "layers.0", "layers.2", "out"]
    assert p.search["zero3_units"].startswith("layers.1 left to the ZeRO-3 root unit")
    _check(p, rows, REUSED)


@pytest.mark.slow
def test_replicated_tensors_read_by_sharded_ops_are_priced_as_run(launched):
    """`GatedLM` at dp 2 x tp 2 by the analytic rules: each layer's lone column-parallel linear
    feeds sharded element-wise ops that read a replicated gate (shape (.., 1), needing a
    gradient) and end in a residual add. The rules price what the solved layouts run (they
    priced 6 all-reduces and 3 all-gathers, the layouts ran 10 and 5: `op_layouts_gap`): per
    layer the linear's input gradient and the gate's partial gradient all-reduced, the sharded
    branch gathered before the residual add (the residual stream kept whole); the vocabulary-
    parallel embedding, the head's input gradient and the loss's three. The run issues exactly
    those, with the one-process losses."""
    p, rows = launched["gated_dp2xtp2"]
    assert "op_layouts_gap" not in p.search, p.search["op_layouts_gap"]
    layers = 4
    solved = p.stages[0].op_layouts.collectives      # tp's, one micro-batch (the plan's m = 1)
    tp = Counter(solved.get("forward", {})) + Counter(solved.get("backward", {}))
    assert tp == {"all_reduce": 1 + 2 * layers + 1 + 3, "all_gather": layers}, solved
    _check(p, rows, GATED)
