"""Pipeline sends as a software choice (`SoftwareSpec.pipeline_send_overlap`, issue 14) and the link
each pipeline hop crosses (`_Tables.hop_inter`)."""

import pytest

import autopar
from autopar.schema import ClusterSpec, Constraints
from autopar.schema.software import SoftwareSpec, resolve_software
from cost_models.schedules import executed_schedule


def test_the_field_is_typed_normalised_and_omitted_at_its_default():
    sw = resolve_software(None)
    # autopar's runtime: torch's ScheduleGPipe defers its send waits, 1F1B and the lock-step
    # interleaved runner wait them before the next op
    assert sw.pipeline_send_overlap == ["gpipe"]
    assert SoftwareSpec.load("megatron-lm-2021").pipeline_send_overlap == []
    assert SoftwareSpec.load("nemo-megatron-core-2024").pipeline_send_overlap == ["interleaved_1f1b"]
    one = SoftwareSpec(name="x", pipeline_send_overlap=["interleaved_1f1b", "gpipe", "gpipe"])
    assert one.pipeline_send_overlap == ["gpipe", "interleaved_1f1b"]      # registry order, once each
    with pytest.raises(Exception, match="pipeline_send_overlap"):
        SoftwareSpec(name="x", pipeline_send_overlap=["zero_bubble"])
    # written only where it is not the default: plan files of the default software are unchanged
    assert "pipeline_send_overlap" not in sw.model_dump()
    assert SoftwareSpec.load("megatron-lm-2021").model_dump()["pipeline_send_overlap"] == []
    assert "pipeline sends waited" in SoftwareSpec.load("megatron-lm-2021").summary()
    # the schedule a plan runs as decides: 1F1B with fewer micro-batches than stages runs GPipe,
    # interleaving with one chunk a group runs 1F1B (Megatron-Core: no overlap without interleaving)
    assert executed_schedule("1f1b", 4, 2).name == "gpipe"
    assert executed_schedule("interleaved_1f1b", 4, 8, 1).name == "1f1b"
    assert executed_schedule("interleaved_1f1b", 4, 8, 2).name == "interleaved_1f1b"


def _tables(cluster, dp, tp, split=False):
    from autopar.inter_op.search import _Tables
    from autopar.inter_op.stage_cost import LayerCost

    mk = lambda f, b, x, g: LayerCost(fwd_s=f, bwd_s=b, fwd_comm_s=f / 10, bwd_comm_s=b / 10,  # noqa: E731
                                      cross_bytes=x, cross_grad_bytes=g, cross_tensors=2, cross_grads=1,
                                      out_bytes=x, act_bytes={"none": 0.0}, param_elems={})
    # layer 0 is quick and sends a lot (a transfer longer than its forward), layer 1 the reverse
    costs = [mk(1e-5, 2e-5, 8e6, 4e6), mk(1e-3, 2e-3, 8e6, 4e6), mk(1e-3, 2e-3, 0.0, 0.0)]
    return _Tables(costs, cluster, "bf16", dp, tp, 0, [], send_split=split)


def test_exposed_sends_follow_the_rule():
    """Waited: a stage pays its forward send (its last layer's crossing tensors) and its gradient
    send (the crossing tensors that need one) in full; beside the compute, max(0, send - window),
    the window the range's forward or backward time with its tp collectives."""
    from autopar.inter_op.stage_cost import coll_time

    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=2)
    tb = _tables(cl, 1, 8)
    inter = cl.inter_node
    fwd_send = coll_time("send_recv", 8e6, 2, inter)            # after layer 0
    grad_send = coll_time("send_recv", 4e6, 2, inter)           # the one tensor with a gradient
    f0, b0 = 1.1e-5, 2.2e-5                                     # layer 0's windows (compute + tp)
    b1 = 2.2e-3
    waited = tb.stage_p2p(None, True, True)
    assert waited[0, 1] == pytest.approx(fwd_send)              # [0, 1) sends forward only
    assert waited[1, 2] == pytest.approx(fwd_send + grad_send)
    same, opp = tb.stage_p2p("same", True, True), tb.stage_p2p("opposite", True, True)
    assert same[0, 1] == pytest.approx(max(0.0, fwd_send - f0))  # GPipe: beside the next forward
    assert opp[0, 1] == pytest.approx(max(0.0, fwd_send - b0))   # 1F1B order: beside the backward
    assert 0 < same[0, 1] < waited[0, 1]
    # layer 1's compute hides both of its transfers
    assert same[1, 2] == opp[1, 2] == 0.0
    assert opp[0, 2] == pytest.approx(max(0.0, fwd_send - b0 - b1))
    # on one node the same transfers take the node's link
    one = _tables(ClusterSpec.load("dgx-a100-80g", num_nodes=1), 1, 8)
    assert one.stage_p2p(None, False, False)[0, 1] == pytest.approx(coll_time("send_recv", 8e6, 2, cl.intra_node))
    assert not one.hop_inter(0, 2)


def test_hops_cross_nodes_where_the_stages_are_placed():
    """Stages in pipeline order (pp outermost, as `pack_stages` and Megatron's tp-cp-ep-dp-pp order
    place them): stages of a whole node hop over the network at every boundary; slices of a node
    at the node's edge only; an interleaved pipeline's wrap from the last group to the first
    crosses when the pipeline spans nodes."""
    from autopar.inter_op.search import pack_stages

    # equal stages are placed in pipeline order, stage i on ranks i x u .. (i + 1) x u - 1
    assert pack_stages([8] * 4, 32, 8) == [list(range(8 * i, 8 * i + 8)) for i in range(4)]
    assert pack_stages([4] * 8, 32, 8) == [list(range(4 * i, 4 * i + 4)) for i in range(8)]
    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=4)
    whole = _tables(cl, 1, 8)                       # 8 GPUs a stage: one node each
    assert whole.whole_node_hops and all(whole.hop_inter(i, 4) for i in range(4))
    half = _tables(cl, 1, 4)                        # 4 GPUs a stage: two a node
    assert not half.whole_node_hops
    assert [half.hop_inter(i, 8) for i in range(8)] == [False, True] * 4   # 0->1 inside, 1->2 across, ..., 7->0
    assert [half.hop_inter(i, 2) for i in range(2)] == [False, False]       # a 2-stage pipeline on one node
    # a stage's own hops: position 1 of 8 sends forward across (1->2), its gradients back inside (1->0)
    assert half.position_p2p(None, 1, 8)[1, 2] == pytest.approx(
        half.stage_p2p(None, True, False)[1, 2])


def test_a_plan_pays_its_sends_by_the_software_and_on_the_link_they_cross():
    """GPT-small pinned to two stages of one node each (tp 8) on two DGX A100 nodes: every hop
    crosses InfiniBand. GPipe under autopar's runtime (sends beside the compute, hidden by a
    forward far longer than them) against the same software with the sends waited: the stages'
    communication differ by exactly m x (alpha + S / B) on the inter-node link, S the hidden state
    of a micro-batch (bf16); under 1F1B both wait."""
    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=2)
    base = SoftwareSpec.load("autopar")
    waited = base.model_copy(update={"name": "waited", "pipeline_send_overlap": []})
    mb, m, seq, hidden = 2, 4, 64, 128
    plans = {}
    for sched in ("gpipe", "1f1b"):
        cons = Constraints(dp=1, tp=8, pp=2, microbatch_size=mb, num_microbatches=m, schedule=sched,
                           recompute="none", zero_stage=0)
        for sw in (base, waited):
            plans[sched, sw.name] = autopar.plan("gpt-small", cl, global_batch_size=mb * m, constraints=cons,
                                                 software=sw)
    send = cl.inter_node.latency + mb * seq * hidden * 2 / cl.inter_node.bandwidth
    for i in range(2):      # stage 0 sends the activation forward, stage 1 its gradient back
        diff = (plans["gpipe", "waited"].stages[i].predicted.communication_s
                - plans["gpipe", "autopar"].stages[i].predicted.communication_s)
        assert diff == pytest.approx(m * send, rel=1e-9)
        assert (plans["1f1b", "waited"].stages[i].predicted.communication_s
                == plans["1f1b", "autopar"].stages[i].predicted.communication_s)
    assert plans["gpipe", "autopar"].predicted.collectives == plans["gpipe", "waited"].predicted.collectives


def test_megatron_2021_scatter_gather_splits_the_send_over_tp():
    """`pipeline_send_split` (Megatron-LM 2021's scatter/gather, on by default there): each of a
    stage's 8 tp ranks sends 1/8 of the tensor over its own link and the receiving stage
    all-gathers it over its tp ranks (waited), at its start for the activation and at its end for
    the gradient."""
    from autopar.inter_op.stage_cost import axis_link, coll_time

    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=2)
    assert SoftwareSpec.load("megatron-lm-2021").pipeline_send_split
    assert not resolve_software(None).pipeline_send_split       # autopar's ranks send the whole tensor
    tb = _tables(cl, 1, 8, split=True)
    inter, tpl = cl.inter_node, axis_link(cl, 8)
    sends = coll_time("send_recv", 8e6 / 8, 2, inter) + coll_time("send_recv", 4e6 / 8, 2, inter)
    gathers = coll_time("all_gather", 8e6, 8, tpl) + coll_time("all_gather", 4e6, 8, tpl)
    assert tb.stage_p2p(None, True, True)[1, 2] == pytest.approx(sends + gathers)
    # the gathers stay waited when the sends run beside the compute
    assert tb.stage_p2p("same", True, True)[1, 2] == pytest.approx(gathers)
    # one tp rank: nothing to split
    assert _tables(cl, 1, 1, split=True).stage_p2p(None, True, True)[0, 1] == pytest.approx(
        coll_time("send_recv", 8e6, 2, inter))
