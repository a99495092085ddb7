"""What the Megatron MoE model zoo's Qwen3-235B rows ran that the cost model now prices (issue 14,
`benchmarks/moe_plans.py --published`; README, "Row 3, term by term"):

- folded experts run the experts module's routing ops (sort, gathers, activation, weighting, the
  sum back) on 1/tp of the block's tokens, as `runtime.experts.ExpertParallelExperts._folded`
  runs them: `ExpertCosting._fold_ops_delta`;
- ZeRO-3's collectives beside the compute (`zero3_overlap`) are covered by the recomputed
  forward too (`_Tables.exposed_zero`, `range_zero_mb` per recomputation policy);
- `pointwise_fusion` "norm" (Megatron-Core with Transformer Engine's norm kernels, no fused MoE
  permutation: the `nemo-megatron-core-2024` preset) fuses the norm modules and nothing else.
"""

import pytest

from autopar import ClusterSpec, Constraints
from autopar.capture import capture
from autopar.capture.experts import find_expert_blocks
from autopar.inter_op.experts import ExpertCosting
from autopar.models import build_model
from autopar.schema.software import SoftwareSpec
from cost_models.compute import fusion_of

H100 = ClusterSpec.load("dgx-h100").device


def _cpu(n: int) -> ClusterSpec:
    return ClusterSpec.load("cpu").model_copy(update={"devices_per_node": n})


def test_folded_block_routing_ops_are_priced_on_the_tp_share_of_the_tokens():
    """moe-tiny at micro-batch 2, tp 2, ep 2, folded: with the ILP provider's layer graphs to read,
    each expert block's forward and backward drop, beyond the GEMMs' share, by the experts
    module's other ops priced on half the tokens less their replicated price (each op as the
    layer's solve prices it); without a provider (a caller that has none) they stay as priced.
    Unfolded (ep over dp) the tokens are all the rank's: nothing changes."""
    from autopar.inter_op.ilp_provider import IlpProvider
    from autopar.inter_op.layers import build_layers
    from autopar.inter_op.stage_cost import AnalyticProvider
    from autopar.intra_op.ilp import op_compute_time, requires_grad_of

    b = build_model("moe-tiny", device="meta")
    g = capture(b.model, b.example_inputs, name="moe-tiny", cache=True)
    layers = build_layers(g, b.model)
    cl, mb, tp, ep = _cpu(4), 2, 2, 2
    prov = IlpProvider(g, layers, cl, "fp32")
    costs = [prov.cost(lay, mb, tp) for lay in layers]
    # the analytic rules may split some of the block's ops already: nothing is taken off theirs
    ana = ExpertCosting(g, layers)
    ana.provider = AnalyticProvider(g, layers, cl, "fp32")
    assert [c.fwd_s for c in ana.layer_costs(costs, ep, mb, tp, cl, "fp32", fold=True)] == \
        [c.fwd_s for c in ExpertCosting(g, layers).layer_costs(costs, ep, mb, tp, cl, "fp32", fold=True)]
    bare = ExpertCosting(g, layers).layer_costs(costs, ep, mb, tp, cl, "fp32", fold=True)
    ec = ExpertCosting(g, layers)
    ec.provider = prov
    fold = ec.layer_costs(costs, ep, mb, tp, cl, "fp32", fold=True)
    assert ec.layer_costs(costs, ep, mb, tp, cl, "fp32")[0].fwd_s == \
        ExpertCosting(g, layers).layer_costs(costs, ep, mb, tp, cl, "fp32")[0].fwd_s
    assert ec.by_layer
    for i, blocks in ec.by_layer.items():
        lay = layers[i]
        sub = prov.graph_at(mb, lay)
        rg = requires_grad_of(sub, prov._grad_inputs(lay))
        want_f = want_b = 0.0
        for blk in blocks:
            for name in lay.nodes:
                n = sub.node(name)
                path = n.module_path or ""
                inside = path == blk.module or path.startswith(blk.module + ".")
                if n.kind != "call" or name in blk.gemms or not inside:
                    continue
                if n.flops <= 0 and n.bytes_moved <= 0:
                    continue
                one = op_compute_time(n, rg, rg.get(name, False), cl.device, "fp32", 1, sub._index)
                half = op_compute_time(n, rg, rg.get(name, False), cl.device, "fp32", tp, sub._index)
                want_f += half[0] - one[0]
                want_b += half[1] - one[1]
        assert want_f < 0 and want_b < 0
        assert fold[i].fwd_s - bare[i].fwd_s == pytest.approx(want_f, rel=1e-9, abs=1e-15)
        assert fold[i].bwd_s - bare[i].bwd_s == pytest.approx(want_b, rel=1e-9, abs=1e-15)
        assert fold[i].rc_extra_s["full"] - bare[i].rc_extra_s["full"] == pytest.approx(want_f, rel=1e-9, abs=1e-15)


def test_zero3_collectives_beside_the_compute_are_covered_by_the_recomputed_forward_too():
    """With `zero3_overlap` a micro-batch waits for the part of its ZeRO-3 collectives beyond its
    compute: its forward and backward, and under recomputation its recomputed forward as well
    (the collectives of the layers' own not counted). gpt-tiny, dp 4, ZeRO-3, on 4 CPU ranks."""
    from autopar.inter_op import search as search_mod
    from autopar.inter_op.layers import build_layers
    from autopar.inter_op.stage_cost import AnalyticProvider

    b = build_model("gpt-tiny", device="meta")
    g = capture(b.model, b.example_inputs, name="gpt-tiny", cache=True)
    layers = build_layers(g, b.model)
    cl = _cpu(4)
    s = search_mod.Search(g, layers, cl, 8, "fp32", Constraints(), AnalyticProvider(g, layers, cl, "fp32"))
    tb = s.tables_for(search_mod.Candidate(4, 1, 1, 1, 2, "1f1b", 1, 3))
    tb.zero3_overlap = True
    L = tb.L
    z = tb.zero_mb(float(tb.range_pel[0, L]), 0.0, float(tb.layer_units[L]), 0.0, 2.0)
    comp = float(tb.compute[L])
    rc = float(tb.rc_compute["full"][L])
    assert rc > 0 and float(tb.rc_compute["none"][L]) == 0.0
    assert float(tb.range_zero_mb(2.0, "none")[0, L]) == pytest.approx(max(float(z) - comp, 0.0), abs=1e-15)
    assert float(tb.range_zero_mb(2.0, "full")[0, L]) == pytest.approx(max(float(z) - comp - rc, 0.0), abs=1e-15)
    # with a window too small to cover them, the recomputed forward's share shows
    assert float(tb.exposed_zero(z, comp)) - float(tb.exposed_zero(z, comp + rc)) == pytest.approx(
        min(rc, max(float(z) - comp, 0.0)))


def test_norm_fusion_fuses_the_norm_modules_only():
    """`pointwise_fusion` "norm" groups exactly the norm modules "norm_moe" groups, and none of
    an experts module's routing ops; the Megatron-Core preset of the published H100 runs takes it
    (Transformer Engine's norm kernels, `transformer_engine: true`)."""
    pytest.importorskip("transformers")
    from autopar.planner import resolve_model

    spec = ("hf:qwen3_moe?hidden_size=64&intermediate_size=128&moe_intermediate_size=32&num_key_value_heads=2"
            "&num_experts=8&num_experts_per_tok=2&num_hidden_layers=2&num_attention_heads=4&head_dim=16"
            "&vocab_size=128&seq_len=16")
    bnd = resolve_model(spec, None, None)
    g4 = capture(bnd.model, bnd.example_inputs, name="qwen3-moe-tiny").at_batch(4)
    both = fusion_of(g4, H100, "fused", "norm_moe")
    norms = fusion_of(g4, H100, "fused", "norm")
    experts = [blk.module for blk in find_expert_blocks(g4)]
    inside = {n.name for n in g4.calls if any((n.module_path or "").startswith(m) for m in experts)}
    assert inside and not inside & set(norms.chain_of)
    assert set(norms.chain_of) == set(both.chain_of) - inside
    for name in norms.chain_of:
        assert norms.chain_of[name].members == both.chain_of[name].members
    sw = SoftwareSpec.load("nemo-megatron-core-2024")
    assert sw.pointwise_fusion == "norm" and "transformer_engine" in sw.sources["pointwise_fusion"]
    assert "norms fused" in sw.summary()


def test_forced_balance_routing_charges_no_imbalance_and_random_ranks():
    """`expert_routing` "forced_balance" (Megatron-Core's --moe-router-force-load-balancing: random
    router logits) charges no imbalance, where the model's router carries `EP_IMBALANCE`, and
    sends a token to the ranks experts drawn at random reach (`random_ranks_per_token`), where the
    fake gate's rule reaches fewer; the summary names it and a bad value names the field."""
    from autopar.inter_op.experts import EP_IMBALANCE, random_ranks_per_token
    from autopar.inter_op.layers import build_layers

    b = build_model("moe-tiny", batch_size=2)
    g = capture(b.model, b.example_inputs, name="moe-tiny")
    layers = build_layers(g, b.model)
    base = SoftwareSpec.load("nemo-megatron-core-2024")
    forced = base.model_copy(update={"expert_dispatch": "ranks", "expert_routing": "forced_balance"})
    router = base.model_copy(update={"expert_dispatch": "ranks"})
    ef, er = ExpertCosting(g, layers, software=forced), ExpertCosting(g, layers, software=router)
    assert ef.imbalance == 1.0 and er.imbalance == EP_IMBALANCE > 1.0
    blk = ef.blocks[0]
    assert ef.ranks_per_token(blk, 4) == er.ranks_per_token(blk, 4) == random_ranks_per_token(
        blk.num_experts, blk.top_k, 4)
    assert ef.dispatch_bytes(blk, 2, "bf16", 4) == pytest.approx(er.dispatch_bytes(blk, 2, "bf16", 4) / EP_IMBALANCE)
    assert "forced balanced routing" in forced.summary()
    with pytest.raises(Exception, match="expert_routing"):
        SoftwareSpec(name="x", expert_routing="forced")
