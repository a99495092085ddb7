"""MoE parallel folding (Megatron-Core, arXiv 2504.14960): the expert mesh (expert_dp, ep) over a
stage's dp x tp ranks, apart from the dense (dp, tp) mesh, so ep may exceed dp and the experts'
data parallelism spans the tp ranks (`Plan.experts.folded`). Costs by hand, the plan, its
collectives, the errors and what the runtime refuses; the 4-process training runs are in
`tests/test_moe.py::test_folded_experts_train_like_one_process` (its one 4-process job)."""

from __future__ import annotations

import json

import pytest

from autopar import ClusterSpec, Constraints, Plan, PlanError
from autopar.capture import capture
from autopar.inter_op.experts import EP_IMBALANCE, FOLD_BACKWARD, FOLD_FORWARD, ExpertCosting
from autopar.models import build_model
from autopar.planner import plan
from autopar.runtime.experts import check_executable
from cost_models.communication import axis_collective_time

_PLANS: dict = {}


def _cpu(n: int) -> ClusterSpec:
    return ClusterSpec.load("cpu").model_copy(update={"devices_per_node": n})


def _analytic(**pins) -> Plan:
    """moe-tiny on 4 CPU processes at tp 2 x dp 2, analytic (DTensor's path), pinned; made once."""
    cons = dict(dp=2, tp=2, pp=1, zero_stage=0, recompute="none", num_microbatches=2, expert_tp=1)
    cons.update(pins)
    key = tuple(sorted(cons.items()))
    if key not in _PLANS:
        _PLANS[key] = plan("moe-tiny", _cpu(4), global_batch_size=8, dtype="fp32", intra_op="analytic",
                           constraints=Constraints(**cons))
    return _PLANS[key].model_copy(deep=True)


def test_folded_costs_by_hand():
    """moe-tiny (8 experts, hidden 32, top-2, 16 tokens per sample) at micro-batch 2, tp 2, ep 2:
    folded, each tp rank sends half the pairs over ep consecutive ranks (not tp apart), the
    block's output (2 x 16 rows x 32 x 4 B) all-gathered over tp in the forward and its inputs'
    gradients (rows x (32 + 2)) in the backward, the experts' weights / ep either way, and what
    the block saves (its GEMMs' operands among it) halved."""
    from autopar.inter_op.layers import build_layers
    from autopar.inter_op.stage_cost import AnalyticProvider

    b = build_model("moe-tiny", batch_size=2)
    g = capture(b.model, b.example_inputs, name="moe-tiny")
    layers = build_layers(g, b.model)
    cl, mb, tp, ep = _cpu(4), 2, 2, 2
    costs = [AnalyticProvider(g, layers, cl, "fp32").cost(lay, mb, tp) for lay in layers]
    ec = ExpertCosting(g, layers)
    assert ec.fold_degrees(2, 2) == [2, 4] and ec.fold_degrees(2, 1) == [] and ec.fold_degrees(2, 2, 4) == [4]
    rep = ec.layer_costs(costs, ep, mb, tp, cl, "fp32")
    fold = ec.layer_costs(costs, ep, mb, tp, cl, "fp32", fold=True)
    rows = mb * 16
    pairs = rows * 2 * 32 * 4 * EP_IMBALANCE
    counts = axis_collective_time("all_to_all", 8.0 * 8, cl, [0, 1])
    a2a_rep = axis_collective_time("all_to_all", pairs, cl, [0, 2])       # dp ranks tp apart
    a2a_fold = axis_collective_time("all_to_all", pairs / 2, cl, [0, 1])  # consecutive ranks
    agf = axis_collective_time("all_gather", rows * 32 * 4, cl, [0, 1])
    agb = axis_collective_time("all_gather", rows * (32 + 2) * 4, cl, [0, 1])
    for i, blocks in ec.by_layer.items():
        blk = blocks[0]
        pre = blk.module
        w = f"{pre}.gate_up_proj"
        assert fold[i].param_elems[w] == rep[i].param_elems[w] == 8 * 32 * 32 / 2
        assert fold[i].fwd_comm_s - rep[i].fwd_comm_s == pytest.approx(
            2 * (a2a_fold - a2a_rep) + FOLD_FORWARD * agf, rel=1e-9)
        assert fold[i].bwd_comm_s - rep[i].bwd_comm_s == pytest.approx(
            2 * (a2a_fold - a2a_rep) + FOLD_BACKWARD * agb, rel=1e-9)
        assert rep[i].fwd_comm_s - costs[i].fwd_comm_s == pytest.approx(2 * a2a_rep + counts, rel=1e-9)
        assert fold[i].fwd_s < rep[i].fwd_s and fold[i].bwd_s < rep[i].bwd_s      # half the GEMM rows
        saved = ec.block_saved(blk, mb, "fp32")
        # at least the grouped GEMMs' row inputs (the rows gathered per pair, the activation)
        assert saved >= rows * 2 * (32 + 16) * 4
        assert rep[i].act_bytes["none"] - fold[i].act_bytes["none"] == pytest.approx(
            saved / 2 + ec.combine_saved(blk, mb, "fp32") / 2, rel=1e-9)
        # under norm_act the layer's count leaves the activation's outputs out already: folding
        # halves what the block keeps under that policy, not those outputs a second time
        kept = ec.block_saved(blk, mb, "fp32", "norm_act")
        assert kept < saved
        assert rep[i].act_bytes["norm_act"] - fold[i].act_bytes["norm_act"] == pytest.approx(
            kept / 2 + ec.combine_saved(blk, mb, "fp32") / 2, rel=1e-9)
    assert ec.expert_collectives(range(len(layers)), 2, "none", fold=True)["all_gather"] == 2 * 2 * 2
    assert ec.expert_collectives(range(len(layers)), 2, "full", fold=True)["all_gather"] == 2 * 2 * 3


def test_folded_plan_says_where_experts_are_and_counts_its_collectives():
    """Pinned expert_dp = dp x tp / ep folds the experts (ep 2 x expert_dp 2 over tp 2 x dp 2),
    expert_dp = dp / ep replicates them over tp as before; an ep above dp (4) can only fold.
    The folded plan halves the dispatch (each tp rank half the tokens), adds 2 all-gathers per
    block and micro-batch, syncs the experts' gradients over their 2 copies, `autopar show`
    says so, the file round-trips and a format-12 plan reads as not folded. The analytic plan
    runs op by op (its layouts solved with the rules' placements pinned): nothing refused."""
    fold = _analytic(ep=2, expert_dp=2)
    rep = _analytic(ep=2, expert_dp=1)
    wide = _analytic(ep=4)
    assert fold.experts.folded and (fold.experts.ep, fold.experts.expert_dp) == (2, 2)
    assert not rep.experts.folded and (rep.experts.ep, rep.experts.expert_dp) == (2, 1)
    assert wide.experts.folded and (wide.experts.ep, wide.experts.expert_dp) == (4, 1)
    assert fold.experts.dispatch_bytes == pytest.approx(rep.experts.dispatch_bytes / 2)
    blocks, m = len(fold.experts.blocks), fold.num_microbatches
    cf, cr = fold.predicted.collectives, rep.predicted.collectives
    assert cf["all_gather"] - cr.get("all_gather", 0) == blocks * m * (FOLD_FORWARD + FOLD_BACKWARD)
    assert cf["all_to_all"] == cr["all_to_all"]
    assert cf["all_reduce"] - cr["all_reduce"] == 1            # the experts' own sync over their copies
    assert "folded" in fold.summary() and "dp x tp" in fold.summary()
    assert Plan.from_json(fold.to_json()) == fold
    old = json.loads(rep.to_json())
    old["format_version"] = 12
    old["experts"].pop("folded")
    assert Plan.from_json(json.dumps(old)).experts.folded is False
    # the analytic plan carries per-op layouts (solved with the rules' placements pinned:
    # `inter_op.pinned_layouts`), so the executor runs its folding op by op as an ILP plan's
    assert all(s.op_layouts is not None for s in fold.stages) and "ep_executor" not in fold.search
    check_executable(fold)
    bad = json.loads(fold.to_json())
    bad["experts"]["expert_dp"] = 3
    with pytest.raises(PlanError, match="folded"):
        Plan.from_json(json.dumps(bad))


def test_folded_constraint_errors_name_the_field():
    with pytest.raises(PlanError, match=r"ep=8 must divide dp=2 .*dp x tp=4"):
        _analytic(ep=8)
    with pytest.raises(PlanError, match=r"expert_dp=3 x ep=2 must equal dp=2 .* or dp x tp"):
        _analytic(ep=2, expert_dp=3)
    with pytest.raises(PlanError, match="expert_dp=2: the model has no routed experts"):
        plan("gpt-tiny", _cpu(4), global_batch_size=8, dtype="fp32", intra_op="analytic",
             constraints=Constraints(expert_dp=2))


def test_verify_checks_folded_plans():
    """`autopar verify` builds and steps every rank of a folded plan (ep 4 over tp 2 x dp 2, and
    ep 2 x expert_dp 2 under ZeRO-1 and ZeRO-3, whose ep groups are the tp pairs) on its fake
    process group: the collectives the plan's, the tp layouts' apart from folding's all-gathers and
    exchange, and under ZeRO-3 each rank's shard of its experts over their folded copies."""
    import autopar

    for pins in (dict(ep=4), dict(ep=2, expert_dp=2, zero_stage=1), dict(ep=2, expert_dp=2, zero_stage=3)):
        cons = dict(dp=2, tp=2, pp=1, zero_stage=0, recompute="none", num_microbatches=2, expert_tp=1)
        cons.update(pins)
        p = plan("moe-tiny", _cpu(4), global_batch_size=8, dtype="fp32", constraints=Constraints(**cons))
        assert p.experts.folded and p.stages[0].op_layouts is not None
        report = autopar.verify(p, "moe-tiny")
        assert report.ok and report.collectives_match is True, (pins, report.failures)


# Hugging Face Mixtral at its own width (hidden 4096, 32 heads, 8 KV heads), few small experts and
# a small vocabulary: wide enough that on H100s Megatron-SP pays and the ILP would lay the
# block's elementwise ops on hidden slices if left free
_MIXTRAL_WIDE = ("hf:mixtral?hidden_size=4096&intermediate_size=1024&num_key_value_heads=8&num_local_experts=4"
                 "&num_hidden_layers=2&num_attention_heads=32&vocab_size=1024&seq_len=4096")


def test_verify_counts_folded_hf_mixtral_under_sp_in_a_pipeline_as_planned():
    """HF Mixtral folded (ep 2 over tp 2, dp 1) with sequence parallelism in 2 pipeline stages on
    H100s, verified on its fake process group: each stage's forward/backward collectives and the
    step's equal the plan's. The executor runs an expert block's ops as one call reading its inputs
    replicated over tp, so the ILP keeps them replicated (`IlpProvider._expert_ops`): left free
    under SP it ran the routing-weight product on hidden slices and counted an all-reduce of the
    top-k weights' partial gradient per block and micro-batch that no rank issues (Mixtral 8x7B on
    16 H100: 8192 planned, 6144 run); and each stage's check counts the folded all-gathers and
    all-to-alls of its own blocks, not every block of the model."""
    pytest.importorskip("transformers")
    import autopar

    cl = ClusterSpec.load("dgx-h100").model_copy(update={"devices_per_node": 4})
    p = plan(_MIXTRAL_WIDE, cl, global_batch_size=2, constraints=Constraints(
        dp=1, tp=2, pp=2, ep=2, expert_tp=1, zero_stage=1, recompute="none", num_microbatches=2,
        schedule="1f1b", sequence_parallel=True))
    assert p.experts.folded and p.sequence_parallel and all(s.op_layouts is not None for s in p.stages)
    report = autopar.verify(p, _MIXTRAL_WIDE)
    assert report.collectives_match is True, report.failures
    assert report.ok and all(rc.tp_measured == rc.tp_predicted for rc in report.ranks), report.failures
