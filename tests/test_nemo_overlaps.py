"""What Megatron-Core / NeMo runs fused or overlapped that autopar's own runtime pays in full
(issue 14, the NeMo GPT-3 175B H100 family): each a `SoftwareSpec` field priced where the cost
model charges the work, off in the default preset (`autopar run` does none of them)."""

import pytest

import autopar
from autopar.schema import ClusterSpec, Constraints, SoftwareSpec
from autopar.schema.software import resolve_software
from cost_models.compute import grad_accumulation_bytes, memory_time


def test_fused_gradient_accumulation_drops_the_accumulation_pass():
    """`gradient_accumulation_fusion`: the weight-gradient GEMM adds into the kept gradient, so
    the separate pass autograd runs in every backward after a step's first (3 gradient-sized
    accesses a parameter) is gone; the default (autopar run) keeps it."""
    assert resolve_software(None).gradient_accumulation_fusion is False
    assert SoftwareSpec.load("nemo-megatron-core-2024").gradient_accumulation_fusion is True
    assert SoftwareSpec.load("megatron-lm-2021").gradient_accumulation_fusion is False   # came in 2022
    cl = ClusterSpec.load("dgx-a100-80g")
    m = 8
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=0)
    base = SoftwareSpec.load("autopar")
    fused = base.model_copy(update={"name": "fused", "gradient_accumulation_fusion": True})
    plain = autopar.plan("gpt-small", cl, global_batch_size=8 * m, constraints=cons, software=base)
    fast = autopar.plan("gpt-small", cl, global_batch_size=8 * m, constraints=cons, software=fused)
    saved = plain.predicted.iteration_time_s - fast.predicted.iteration_time_s
    # m - 1 passes over every parameter's bf16 gradient (the tied embedding counted once)
    want = (m - 1) * memory_time(plain.model.num_params * grad_accumulation_bytes("bf16"), cl.device)
    assert saved == pytest.approx(want, rel=0.02)
    # one micro-batch accumulates nothing: the same time either way
    one = Constraints(dp=8, tp=1, pp=1, microbatch_size=8, recompute="none", zero_stage=0)
    assert (autopar.plan("gpt-small", cl, global_batch_size=64, constraints=one, software=base).predicted
            .iteration_time_s == pytest.approx(autopar.plan("gpt-small", cl, global_batch_size=64, constraints=one,
                                                            software=fused).predicted.iteration_time_s))
    # written only when set (plan digests of older software unchanged), and round-trips
    assert "gradient_accumulation_fusion" not in base.model_dump()
    dumped = fused.model_dump()
    assert dumped["gradient_accumulation_fusion"] is True
    assert SoftwareSpec.model_validate(dumped) == fused
    with pytest.raises(Exception, match="gradient_accumulation_fusion"):
        SoftwareSpec(name="x", gradient_accumulation_fusion="sometimes")


def _ub(method, **kw):
    from autopar.schema.software import UbOverlap

    return UbOverlap(method=method, **kw)


def test_userbuffers_overlap_rules():
    """`cost_models.tp_overlap`: bulk max(GEMM, collective), the GEMM slowed by the SMs the
    collective holds; pipeline g + (n-1) max(g, c) + c over chunks; ring exchange (tp-1) max(g, s) + g."""
    from cost_models.tp_overlap import chunk_gemm_time, overlapped_time, sm_margin_factor

    dev = ClusterSpec.load("dgx-h100").device
    assert dev.sm_count == 132
    part = lambda f: 100e-6 * f  # noqa: E731  (a collective of 100 us, linear in its bytes)
    big = 1e13         # FLOPs where the GEMM curve is flat: a chunk runs at the whole's rate
    assert chunk_gemm_time(800e-6, big, 4, dev, "bf16") == pytest.approx(200e-6)
    assert chunk_gemm_time(800e-6, 4e10, 4, dev, "bf16") > 200e-6         # a small chunk runs slower
    # bulk, no margin: max of the two, the GEMM losing num_sm of 132 SMs while the collective runs
    g, t = overlapped_time(_ub("bulk", num_sm=8), 600e-6, big, 100e-6, 4, dev, "bf16", part, 30e-6)
    assert g == pytest.approx(600e-6 + 100e-6 * 8 / 132) and t == g
    g, t = overlapped_time(_ub("bulk", num_sm=8), 50e-6, big, 100e-6, 4, dev, "bf16", part, 30e-6)
    assert t == pytest.approx(100e-6)                                     # the collective exposed beyond it
    # pipeline with a margin: the GEMM on 132 - 24 SMs, the last chunk's reduce-scatter waited
    cfg = _ub("pipeline", num_sm=24, set_sm_margin=True, num_splits=4)
    assert sm_margin_factor(cfg, dev) == pytest.approx(132 / 108)
    g, t = overlapped_time(cfg, 800e-6, big, 100e-6, 4, dev, "bf16", part, 30e-6, reduce_scatter=True)
    gc = 200e-6 * 132 / 108
    assert g == pytest.approx(4 * gc) and t == pytest.approx(gc + 3 * gc + 25e-6)
    # ring exchange: tp shard steps, the transfers on the copy engines (no SMs taken)
    g, t = overlapped_time(_ub("ring_exchange", num_sm=1), 400e-6, big, 100e-6, 4, dev, "bf16", part, 30e-6)
    assert g == pytest.approx(400e-6) and t == pytest.approx(400e-6)
    g, t = overlapped_time(_ub("ring_exchange", num_sm=1), 40e-6, big, 100e-6, 4, dev, "bf16", part, 30e-6)
    assert t == pytest.approx(3 * 30e-6 + 10e-6)                          # transfer-bound
    # aggregate: one 1-shard exchange, then tp/2 steps of two shards
    g, t = overlapped_time(_ub("ring_exchange", num_sm=1, aggregate=True), 400e-6, big, 100e-6, 4, dev, "bf16",
                           part, 30e-6)
    assert t == pytest.approx(30e-6 + 400e-6)
    with pytest.raises(Exception, match="qkv_fprop cannot be overlapped by 'bulk'"):
        SoftwareSpec(name="x", tp_comm_overlap={"qkv_fprop": {"method": "bulk"}})


def test_tp_collectives_hide_behind_their_gemms_with_userbuffers():
    """`tp_comm_overlap` on a sequence-parallel plan: the blocks' all-gathers and reduce-scatters
    priced beside their GEMMs (less exposed communication), the GEMMs' slowdown as compute; the
    same collectives run. Empty (autopar run): nothing changes."""
    nemo = SoftwareSpec.load("nemo-megatron-core-2024")
    assert nemo.tp_comm_overlap["proj_fprop"].method == "pipeline" and resolve_software(None).tp_comm_overlap == {}
    off = nemo.model_copy(update={"name": "off", "tp_comm_overlap": {}})
    cl = ClusterSpec.load("dgx-h100")
    cons = Constraints(dp=2, tp=4, pp=1, microbatch_size=1, recompute="none", zero_stage=1, sequence_parallel=True)
    plans = {sw.name: autopar.plan("gpt3-1.3b", cl, global_batch_size=4, constraints=cons, software=sw)
             for sw in (nemo, off)}
    on, waited = plans[nemo.name].predicted, plans["off"].predicted
    assert on.collectives == waited.collectives                  # the same collectives, beside the GEMMs
    assert on.communication_s < waited.communication_s
    assert on.compute_s > waited.compute_s                       # chunked GEMMs, SMs given to the comm kernels
    # written only when set, and round-trips
    assert "tp_comm_overlap" not in resolve_software(None).model_dump()
    assert SoftwareSpec.model_validate(nemo.model_dump()) == nemo


def test_param_gather_beside_the_next_forward():
    """`param_sync_overlap`: ZeRO-1's all-gather of the updated weights waited only beyond the
    forward it runs beside (one chunk: its first micro-batch's; interleaved: chunk 0's share
    waited, each later chunk's beyond the previous chunk's warm-up forwards)."""
    from autopar.inter_op.search import _exposed_param_gather

    assert _exposed_param_gather(10.0, [1.0], [4.0], 8) == pytest.approx(6.0)
    assert _exposed_param_gather(10.0, [1.0], [40.0], 8) == 0.0
    # 3 chunks, 2 ahead: chunk 0's 5 waited; chunk 1's 3 beside 2 x 1 of chunk 0 (1 waited); chunk 2's 2 hidden
    assert _exposed_param_gather(10.0, [0.5, 0.3, 0.2], [1.0, 1.0, 1.0], 2) == pytest.approx(5.0 + 1.0)
    assert SoftwareSpec.load("nemo-megatron-core-2024").param_sync_overlap is True
    assert resolve_software(None).param_sync_overlap is False
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, recompute="none", zero_stage=1)
    base = SoftwareSpec.load("autopar")
    over = base.model_copy(update={"name": "over", "param_sync_overlap": True})
    after = autopar.plan("gpt-small", cl, global_batch_size=8, constraints=cons, software=base)
    beside = autopar.plan("gpt-small", cl, global_batch_size=8, constraints=cons, software=over)
    assert beside.predicted.iteration_time_s < after.predicted.iteration_time_s
    assert beside.predicted.collectives == after.predicted.collectives       # the same gather, hidden
    # ZeRO 0 gathers nothing: no change
    z0 = cons.model_copy(update={"zero_stage": 0})
    assert (autopar.plan("gpt-small", cl, global_batch_size=8, constraints=z0, software=over).predicted.iteration_time_s
            == pytest.approx(autopar.plan("gpt-small", cl, global_batch_size=8, constraints=z0,
                                          software=base).predicted.iteration_time_s))
    assert "param_sync_overlap" not in base.model_dump() and over.model_dump()["param_sync_overlap"] is True
    assert SoftwareSpec.model_validate(over.model_dump()) == over


def test_only_complete_tp_blocks_are_overlapped():
    """The pairing (`autopar.inter_op.tp_overlap`): a layer's all-gather into linears followed by a
    reduce-scatter out of a linear is a block (qkv/proj first, fc1/fc2 after); the LM head's gather,
    which no reduce-scatter follows, stays waited, so the last layer (block + head) gets the same
    fc1 overlap as a middle one."""
    from autopar.inter_op.tp_overlap import tp_overlap_deltas
    from autopar.planner import ProviderCache
    from autopar.planner import plan as make_plan

    nemo = SoftwareSpec.load("nemo-megatron-core-2024")
    cl = ClusterSpec.load("dgx-h100")
    cons = Constraints(dp=2, tp=4, pp=1, microbatch_size=1, recompute="none", zero_stage=1, sequence_parallel=True)
    pc = ProviderCache()
    make_plan("gpt3-1.3b", cl, global_batch_size=4, constraints=cons, software=nemo, providers=pc)
    (prov,) = [p for _, p in pc._entries.values() if getattr(p, "sequence_parallel", False)]
    sols = {lay.index: (sol, lay) for (_, mb, tp), (sol, lay) in prov.solutions.items() if tp == 4 and mb == 1}
    last, mid = max(sols), sorted(sols)[len(sols) // 2]
    gathers = {i: sum(x.kind == "all_gather" and x.phase == "forward" for x in sols[i][0].collectives)
               for i in (mid, last)}
    assert gathers[last] == gathers[mid] + 1          # the head's
    only_fc1 = nemo.model_copy(update={"tp_comm_overlap": {"fc1_fprop": nemo.tp_comm_overlap["fc1_fprop"]}})
    d = {}
    for i in (mid, last):
        sol, lay = sols[i]
        d[i] = tp_overlap_deltas(sol, prov.graph_at(1, lay), list(lay.nodes), 4, only_fc1, cl, "bf16")
    assert d[mid]["fwd_comm_s"] < 0 and d[mid]["bwd_comm_s"] == 0.0
    assert d[last] == pytest.approx(d[mid])
    # the head's gather is still charged whole: the last layer keeps more forward communication
    none = nemo.model_copy(update={"tp_comm_overlap": {}})
    assert tp_overlap_deltas(*sols[mid][:1], prov.graph_at(1, sols[mid][1]), list(sols[mid][1].nodes), 4, none, cl,
                             "bf16") == {"fwd_s": 0.0, "fwd_comm_s": 0.0, "bwd_s": 0.0, "bwd_comm_s": 0.0}


def test_overlap_on_a_device_without_sm_count_says_so():
    """A device profile without `sm_count` (dgx-a100-80g): the overlaps are priced without the SMs
    they take from the GEMMs, and the plan says so."""
    nemo = SoftwareSpec.load("nemo-megatron-core-2024")
    cl = ClusterSpec.load("dgx-a100-80g")
    assert cl.device.sm_count is None and "sm_count" not in cl.device.model_dump()
    cons = Constraints(dp=2, tp=4, pp=1, microbatch_size=1, recompute="none", zero_stage=1, sequence_parallel=True)
    p = autopar.plan("gpt3-1.3b", cl, global_batch_size=4, constraints=cons, software=nemo)
    assert "no sm_count" in p.search["tp_comm_overlap"]


def test_h100_missing_time_prices_the_layer_as_the_planner_does():
    """`benchmarks/h100_missing_time.py` (issue 14, the NeMo 175B step's missing time): its layer
    micro-batch is the planner's op pricing on a rank's quarter of each op: the four GEMMs at
    dgx-h100's measured curve (0.72-0.77 of peak above 1e11 FLOPs), the ~8 ms a layer micro-batch
    the README's table starts from; its sized terms are their sources' constants."""
    import importlib.util
    import sys
    from pathlib import Path

    from cost_models.compute import MATRIX_OPS

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("h100_missing_time", bench / "h100_missing_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cl = ClusterSpec.load("dgx-h100")
    rows = mod.layer_breakdown(cl, tp=4)
    gemms = [(fl, f) for op, _, fl, f, _ in rows if op in MATRIX_OPS and op != "scaled_dot_product_attention"]
    assert len(gemms) == 4
    peak = cl.device.peak("bf16")
    for fl, f in gemms:
        assert 0.72 * peak < fl / f < 0.77 * peak
    total = sum(f + b for *_, f, b in rows)
    assert 7e-3 < total < 1e-2
    assert mod.OVERLAP_SLOWDOWN == (0.189, 0.400) and mod.LN_SM_MARGIN == 8
