"""Plans carry the solved per-op layouts of a tp stage (`StagePlan.op_layouts`, issue 20 "one
executor"): what they hold, that they survive the JSON round trip, that the plan's predicted
collectives are theirs, and that a stage the runtime cannot yet execute op by op says why. The
runs themselves (losses equal to one process, counted collectives equal to these) are in
`tests/test_runtime_user_models.py`."""

from __future__ import annotations

from collections import Counter

import autopar
from autopar import Constraints
from autopar.planner import plan
from autopar.schema import Plan


def _cpu(n: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


def test_a_tp_plan_carries_every_op_layout_and_predicts_their_collectives():
    p = plan("gpt-tiny", _cpu(2), global_batch_size=8, dtype="fp32",
             constraints=Constraints(dp=1, tp=2, pp=1, recompute="none"))
    lay = p.stages[0].op_layouts
    assert lay is not None and "tp_executor" not in p.search
    # every op of the capture, each layer once; the two blocks' ops are distinct names
    from autopar.capture import capture
    from autopar.planner import resolve_model

    b = resolve_model("gpt-tiny", None, None)
    g = capture(b.model, b.example_inputs, name=b.name)
    ops = [o for layer in lay.layers for o in layer.ops]
    assert len(ops) == len(set(ops)) == len(g.calls)
    # the Megatron placements of the zoo GPT, solved
    assert lay.params["blocks.1.attn.qkv.weight"] == ("S(0)",)
    assert lay.params["blocks.1.attn.proj.weight"] == ("S(1)",)
    # the predicted collectives are the layouts' per micro-batch, times the micro-batches
    m = p.num_microbatches
    want: Counter = Counter()
    for phase in ("forward", "backward", "grad_sync"):
        want.update({k: m * v for k, v in lay.collectives.get(phase, {}).items()})
    assert p.predicted.collectives == dict(want)
    # the JSON round trip keeps them; the ShardingSolution the executor runs has every op
    q = Plan.from_json(p.to_json())
    assert q.stages[0].op_layouts == lay
    sol = q.stages[0].op_layouts.solution((2,))
    assert set(sol.op_choices) == set(ops) and sol.mesh_shape == (2,)
    assert "executed op by op as solved" in q.summary()


def test_copies_of_a_layer_share_one_list_of_layouts():
    """gpt-small's 4 blocks: the middle ones are copies, stored once (the file stays small)."""
    p = plan("gpt-small", _cpu(2), global_batch_size=8, dtype="fp32",
             constraints=Constraints(dp=1, tp=2, pp=1, recompute="none"))
    lay = p.stages[0].op_layouts
    sigs = [layer.signature for layer in lay.layers]
    assert len(lay.layers) == 4 and len(set(sigs)) < len(sigs)


def test_zero3_with_tp_carries_its_layouts_and_units():
    """dp 2 x tp 2 with ZeRO-3: the stage runs op by op as solved, its FSDP units around runs of
    the program's ops (`runtime.zero.ZeroSharding._shard_solved`); the predicted collectives
    are the solution's per micro-batch and the units' gathers and reduce-scatters."""
    from autopar.planner import _zero3_counts

    p = plan("gpt-tiny", _cpu(4), global_batch_size=8, dtype="fp32",
             constraints=Constraints(dp=2, tp=2, pp=1, zero_stage=3, num_microbatches=2))
    st = p.stages[0]
    assert st.op_layouts is not None and "tp_executor" not in p.search, p.search
    assert st.fsdp_units == ["blocks.0", "blocks.1"]
    m = p.num_microbatches
    want: Counter = Counter()
    for phase in ("forward", "backward", "grad_sync"):
        want.update({k: m * v for k, v in st.op_layouts.collectives.get(phase, {}).items()})
    want.update(_zero3_counts(st.fsdp_units, True, m, False))
    assert p.predicted.collectives == dict(want)


def test_zero3_in_a_tp_pipeline_carries_its_layouts_and_units():
    """pp 2 x dp 2 x tp 2 with ZeRO-3: every chunk runs as solved, each the FSDP root of its
    units; the ZeRO-3 counts are a pipeline's (torch.pipelining drives each chunk's root)."""
    from autopar.planner import _zero3_counts

    p = plan("gpt-tiny", _cpu(8), global_batch_size=8, dtype="fp32",
             constraints=Constraints(dp=2, tp=2, pp=2, zero_stage=3, num_microbatches=2))
    assert all(s.op_layouts is not None for s in p.stages) and "tp_executor" not in p.search, p.search
    assert [s.fsdp_units for s in p.stages] == [["blocks.0"], ["blocks.1"]]
    z = Counter()
    for s in p.stages:
        z.update(_zero3_counts(s.fsdp_units, True, p.num_microbatches, True))
    assert p.predicted.collectives["reduce_scatter"] == z["reduce_scatter"]


def test_stages_of_different_tp_carry_layouts_solved_for_their_own_mesh():
    """Stages of different tp degrees (mlp-tiny, dp pinned to 1: the search picks tp 2, 1, 1)
    carry every op's layout, each stage's solved on its own mesh (the 1-device stages'
    replicated), and hand their tensors over replicated: the tp-2 stage's column-parallel
    output is gathered before it leaves (one forward all-gather per micro-batch in its
    collectives), the next stage receives it "R". The predicted collectives are theirs. With
    the analytic per-layer rules the same plan carries layouts too, solved with the rules'
    placements pinned."""
    p = plan("mlp-tiny", _cpu(4), global_batch_size=8, dtype="fp32", constraints=Constraints(dp=1))
    stages = sorted(p.stages, key=lambda s: s.index)
    tps = [s.axis_size("tp") for s in stages]
    assert len(set(tps)) > 1 and max(tps) == 2, tps
    assert all(s.op_layouts is not None for s in stages) and "tp_executor" not in p.search
    for s, tp in zip(stages, tps):
        lay = s.op_layouts
        pls = {pl for ops in lay.signatures for ol in ops for pl in [*ol.inputs, *ol.outputs]}
        if tp == 1:
            assert pls <= {("R",)}, pls
        else:
            assert any(pl != ("R",) for pl in pls)          # its ops split over its 2 devices
    for a, b in zip(stages, stages[1:]):
        if a.axis_size("tp") != b.axis_size("tp"):
            assert b.op_layouts.receives and set(b.op_layouts.receives.values()) == {("R",)}
    wide = stages[tps.index(2)]
    if wide.index < len(stages) - 1:
        assert wide.op_layouts.collectives["forward"].get("all_gather", 0) >= 1    # the handover
    m = p.num_microbatches
    want: Counter = Counter()
    for s in stages:
        for phase in ("forward", "backward", "grad_sync", "recompute"):
            want.update({k: m * v for k, v in s.op_layouts.collectives.get(phase, {}).items()})
    want["send_recv"] += 2 * m * (len(stages) - 1)
    assert p.predicted.collectives == dict(want)
    an = plan("mlp-tiny", _cpu(4), global_batch_size=8, dtype="fp32", constraints=Constraints(dp=1),
              intra_op="analytic")
    # solved with the rules' placements pinned (issue 20: one executor)
    assert all(s.op_layouts is not None for s in an.stages) and "tp_executor" not in an.search
    assert "placements pinned" in an.search["op_layouts"]


def test_a_hetero_boundary_the_readers_did_not_assume_replicated_is_refused():
    """`chunk_layouts`: a tensor crossing between stages of different tp arrives replicated.
    A transformer's residual stream leaves each layer replicated, so a 1-device stage before
    a tp stage hands it on as its reader's solution assumed. An MLP's layer solved at tp 2
    leaves its activation split over its features and the next layer's solution receives it
    so (`IlpProvider._boundaries`); after a 1-device stage it arrives whole, a re-layout that
    solution did not cost, so the stages get no layouts, with the reason, unless that layer is
    solved again receiving it whole (`IlpProvider.entry_solutions`, what the planner and the
    search pass)."""
    from autopar.capture import capture
    from autopar.inter_op.ilp_provider import IlpProvider
    from autopar.inter_op.layers import build_layers
    from autopar.inter_op.stage_layouts import chunk_layouts
    from autopar.planner import resolve_model

    def chunks(model: str, tps: list[int]):
        b = resolve_model(model, None, None)
        g = capture(b.model, b.example_inputs, name=b.name)
        layers = build_layers(g, b.model)
        prov = IlpProvider(g, layers, _cpu(4), "fp32")
        for lay in layers:
            prov.cost(lay, 8, 2)
        prov.solve_replicated(8, layers)
        assert len(layers) == len(tps)
        spans = [(i, i + 1, tp, "none") for i, tp in enumerate(tps)]
        return g, layers, prov, chunk_layouts(g, layers, prov.solutions, spans, 8)

    _, _, _, (lays, why) = chunks("gpt-small", [1, 2, 2, 1])
    assert lays is not None, why
    assert set(lays[1].receives.values()) == {("R",)}
    g, layers, prov, (lays, why) = chunks("mlp-tiny", [1, 2, 1])
    sol, _ = prov.solutions[(layers[1].signature, 8, 2)]
    entering = next(n for n in sol.input_placements if g.node(n).kind == "call")
    assert sol.input_placements[entering] != ("R",)
    assert lays is None and entering in why and f"assumed {sol.input_placements[entering]}" in why, why
    # the planner and the search solve that layer again receiving it whole (`entry_solutions`)
    spans = [(0, 1, 1, "none"), (1, 2, 2, "none"), (2, 3, 1, "none")]
    entries = prov.entry_solutions(spans, 8)
    assert set(entries) == {1} and entries[1][0].input_placements[entering] == ("R",)
    lays, why = chunk_layouts(g, layers, prov.solutions, spans, 8, entries)
    assert lays is not None, why
    assert lays[1].receives == {entering: ("R",)} and len(lays[1].signatures) == 1


def test_every_pipeline_chunk_carries_its_layouts_and_what_it_receives():
    """A pipelined tp plan: each chunk's ops as solved, and the tensors a chunk receives (made
    by an earlier chunk, read by it or a later one) in the layout their producer's solution
    leaves them, which the readers' solutions assumed. The predicted collectives are the
    chunks' per micro-batch times the micro-batches, plus one send per crossing tensor and
    gradient and the sum of the tied table's gradient over its two stages."""
    from autopar.capture import capture
    from autopar.inter_op.stage_layouts import produced_layouts
    from autopar.planner import resolve_model

    p = plan("gpt-tiny", _cpu(4), global_batch_size=8, dtype="fp32",
             constraints=Constraints(dp=1, tp=2, pp=2, schedule="1f1b", num_microbatches=2))
    first, second = (s.op_layouts for s in sorted(p.stages, key=lambda s: s.index))
    assert first is not None and second is not None and "tp_executor" not in p.search
    assert first.receives == {}
    b = resolve_model("gpt-tiny", None, None)
    g = capture(b.model, b.example_inputs, name=b.name)
    made = {o for layer in first.layers for o in layer.ops}
    read = {a for layer in second.layers for o in layer.ops for a in g.node(o).inputs}
    assert set(second.receives) == made & read and second.receives      # the residual stream
    made_as = produced_layouts(first)
    assert all(second.receives[n] == made_as[n] for n in second.receives)
    m = p.num_microbatches
    want: Counter = Counter()
    for lay in (first, second):
        for phase in ("forward", "backward", "grad_sync", "recompute"):
            want.update({k: m * v for k, v in lay.collectives.get(phase, {}).items()})
    want["send_recv"] += 2 * m            # the hidden states forward, their gradient back
    want["all_reduce"] += 1               # the tied table's gradient, summed over its two stages
    assert p.predicted.collectives == dict(want)
    q = Plan.from_json(p.to_json())
    assert [s.op_layouts for s in q.stages] == [s.op_layouts for s in p.stages]


def test_gradients_of_tensors_entering_a_layer_are_costed():
    """The per-layer ILP sees the tensor entering its layer as an input. Its gradient is still
    computed (it needs one in the whole graph), so slicing it for an op costs an all-gather of
    the gradient in the backward pass: with `grad_inputs` the ILP counts it."""
    from autopar.capture import capture
    from autopar.inter_op.ilp_provider import IlpProvider
    from autopar.inter_op.layers import build_layers
    from autopar.intra_op.ilp import IntraOpProblem
    from autopar.intra_op.placement import REPLICATE
    from autopar.planner import resolve_model
    from cost_models.communication import logical_mesh

    b = resolve_model("gpt-tiny", None, None)
    g = capture(b.model, b.example_inputs, name=b.name)
    layers = build_layers(g, b.model)
    cl = _cpu(2)
    prov = IlpProvider(g, layers, cl, "fp32")
    lay = layers[1]
    entering = prov._grad_inputs(lay)
    assert entering                                   # the residual stream from block 0
    sub = prov.graph_at(8, lay)
    mesh = logical_mesh(cl, [0, 1], (2,))
    found = {}
    for grads in (set(), entering):
        prob = IntraOpProblem(sub, mesh, nodes=list(lay.nodes), grad_inputs=grads)
        x = next(iter(entering))
        cons = next(n for n in lay.nodes if x in sub.node(n).inputs)
        pn = prob.pnodes[prob.rep.get(cons, cons)]
        k = sub.node(cons).inputs.index(x)
        st = next(s for s in pn.strategies if s.in_specs[k][0].startswith("S("))
        colls = prob.edge_collectives(x, 0, (REPLICATE,), pn.name, k, st)
        found[bool(grads)] = [(kind, ph) for kind, _, _, ph, _ in colls]
    assert ("all_gather", "backward") in found[True]
    assert not any(ph == "backward" for _, ph in found[False])


def test_the_runtime_refuses_layouts_it_cannot_execute():
    """A plan whose op_layouts the runtime would not run as solved (here a pipeline where one
    chunk has them and the other not: a chunk hands the next its tensors in solved layouts) is
    refused with the fix, not run another way in silence."""
    import pytest

    from autopar.planner import resolve_model
    from autopar.runtime.engine import validate_plan
    from autopar.schema import PlanError

    tp = plan("gpt-tiny", _cpu(2), global_batch_size=8, dtype="fp32",
              constraints=Constraints(dp=1, tp=2, pp=1, recompute="none"))
    pp = plan("gpt-tiny", _cpu(4), global_batch_size=8, dtype="fp32",
              constraints=Constraints(dp=1, tp=2, pp=2, schedule="1f1b", num_microbatches=2))
    model = resolve_model("gpt-tiny", None, None).model
    validate_plan(tp, model)                                         # runs as solved
    validate_plan(pp, model)
    bad = pp.model_copy(deep=True)
    bad.stages[1].op_layouts = None
    with pytest.raises(PlanError, match="op_layouts.*re-plan"):
        validate_plan(bad, model)
    # stages of different tp: what crosses between them arrives replicated, or the plan is refused
    het = plan("mlp-tiny", _cpu(4), global_batch_size=8, dtype="fp32", constraints=Constraints(stage_tp=(1, 2, 1)))
    mlp = resolve_model("mlp-tiny", None, None).model
    validate_plan(het, mlp)
    bad = het.model_copy(deep=True)
    recv = bad.stages[1].op_layouts.receives
    recv[next(iter(recv))] = ("S(1)",)
    with pytest.raises(PlanError, match="tensors cross replicated"):
        validate_plan(bad, mlp)


def test_selective_recomputation_checkpoints_each_attention_core():
    """recompute="selective" executed as solved: each block's checkpointed ops are its attention
    core (gpt-tiny's fused sdpa, alone: not the projections around it), what the plan states
    (`StagePlan.recompute_ops`) and the memory model drops. The core issues no collective: nothing
    to re-run."""
    from autopar.capture import capture
    from autopar.planner import resolve_model

    p = plan("gpt-tiny", _cpu(2), global_batch_size=8, dtype="fp32",
             constraints=Constraints(dp=1, tp=2, pp=1, recompute="selective"))
    lay = p.stages[0].op_layouts
    assert lay is not None and p.stages[0].recompute == "selective"
    b = resolve_model("gpt-tiny", None, None)
    g = capture(b.model, b.example_inputs, name=b.name)
    regions = lay.recompute_regions()
    assert len(regions) == 2                                   # the two blocks
    for i, ops in enumerate(regions):
        assert [(g.node(o).op, g.node(o).module_path) for o in ops] == [("scaled_dot_product_attention",
                                                                         f"blocks.{i}.attn")]
    assert p.stages[0].recompute_ops == [o for r in regions for o in r]
    assert "selective: ops scaled_dot_product_attention (2)" in p.summary()
    assert "recompute" not in lay.collectives


def test_selective_recomputation_of_an_unfused_core():
    """An attention core of several ops (nanoGPT's eager path: scores, scale, the causal mask's
    masked_fill, softmax, product with V): run op by op (tp) the plan recomputes
    that run of ops alone; run module by module (no tp), where a forward cannot be cut inside,
    the module holding it is checkpointed whole, the plan says so and costs it so (less memory
    held than recomputing the core alone, more time)."""
    ref = "tests.user_models:eager_gpt"
    tp = plan(ref, _cpu(2), global_batch_size=8, dtype="fp32",
              constraints=Constraints(dp=1, tp=2, pp=1, recompute="selective"))
    ops = tp.stages[0].recompute_ops
    assert tp.stages[0].op_layouts is not None and "selective_fallback" not in tp.search
    regions = tp.stages[0].op_layouts.recompute_regions()
    assert regions[0] == ["matmul", "mul", "masked_fill", "softmax", "matmul_1"]
    assert [o for r in regions for o in r] == ops
    one = _cpu(1)
    dp = plan(ref, one, global_batch_size=8, dtype="fp32", constraints=Constraints(recompute="selective"))
    none = plan(ref, one, global_batch_size=8, dtype="fp32", constraints=Constraints(recompute="none"))
    st = dp.stages[0]
    assert st.recompute_ops is None and st.recompute_modules == ["h.0.attn", "h.1.attn"]
    assert "stage 0: run module by module" in dp.search["selective_fallback"]
    assert "selective: modules h.*.attn (2) checkpointed whole" in dp.summary()
    assert dp.predicted.compute_s > none.predicted.compute_s
    assert st.predicted.activations_bytes < none.stages[0].predicted.activations_bytes


def test_the_program_is_cut_where_the_plan_cuts_it():
    """The runtime cuts the exported program at each chunk's first op (`pipeline_chunks._Spans`):
    what a chunk receives is what the plan says it receives (`StageLayouts.receives`), shape
    arithmetic crossing the boundary is not sent, and chunks listed out of the program's order
    are refused with a PlanError rather than run wrong."""
    import pytest
    import torch

    from autopar.capture.export import export_program
    from autopar.intra_op.execute import _meta_copy, _to_meta
    from autopar.intra_op.pipeline_chunks import _Spans
    from autopar.planner import resolve_model
    from autopar.schema import PlanError

    p = plan("gpt-tiny", _cpu(4), global_batch_size=8, dtype="fp32",
             constraints=Constraints(dp=1, tp=2, pp=2, schedule="1f1b", num_microbatches=2))
    stages = sorted(p.stages, key=lambda s: s.index)
    ops = [[o for lay in s.op_layouts.layers for o in lay.ops] for s in stages]
    b = resolve_model("gpt-tiny", None, None)
    ex = tuple(torch.zeros((p.microbatch_size,) + tuple(x.shape[1:]), dtype=x.dtype) for x in b.example_inputs)
    program, _, _ = export_program(_meta_copy(b.model), _to_meta(ex))
    gm = program.graph_module
    values = {n: (torch.empty(0) if n.op != "placeholder" and not str(n.target).startswith("aten.sym_size")
                  else 4) for n in gm.graph.nodes}
    spans = _Spans(gm, ops, values)
    assert [spans.names[n] for n in spans.receives[1]] == list(stages[1].op_layouts.receives)
    assert all(not isinstance(v, torch.Tensor) for v in spans.constants[1].values())
    with pytest.raises(PlanError, match="order"):
        _Spans(gm, ops[::-1], values)


def _attention_feeds(p: Plan, ref: str) -> dict[str, tuple[str, list]]:
    """Per attention op of stage 0: (its strategy, the collectives `placement.transition` runs
    to bring each of q, k, v from the layout its producer's solution leaves to the one the
    attention reads)."""
    from autopar.capture import capture
    from autopar.intra_op.placement import transition
    from autopar.planner import resolve_model

    b = resolve_model(ref, None, None)
    g = capture(b.model, b.example_inputs, name=b.name).at_batch(p.microbatch_size)
    st = p.stages[0]
    sol = st.op_layouts.solution(st.mesh_shape)
    out = {}
    for name, ch in sol.op_choices.items():
        if ch.family != "attention":
            continue
        steps = []
        for k, src in enumerate(g.node(name).inputs[:3]):
            meta = g.node(src).outputs[0]
            have = sol.op_choices[src].output_placements[0]
            steps += [c[0] for c in transition(tuple(int(d) for d in meta.shape), 4, tuple(have),
                                               tuple(ch.input_placements[k]), tuple(st.mesh_shape))]
        out[name] = (ch.strategy, steps)
    return out


def test_gqa_over_more_devices_than_kv_heads_splits_query_heads_without_gathering():
    """llama-small (4 query heads, 2 KV heads) at tp 4: the attention splits its query heads
    over the 4 ranks and reads K and V replicated, each rank slicing the KV head its query head
    reads (`rules.attention`, Megatron's layout when tp exceeds the KV heads), so nothing is
    gathered to feed it: q arrives split as the column-parallel q_proj leaves it, K and V come
    replicated (all-reduces of the row-parallel k/v projections' partial sums), the output
    leaves split for the row-parallel o_proj. The dK/dV reductions are the backward's.

    This is the plan of the CPU profile at micro-batch 16, the layout
    `test_runtime_llama_tp.py` runs. At this toy size the ILP's costs are latency-bound: at
    micro-batch 8 on A100s it prices replicated attention (an all-gather of q forward and of
    dO backward) below the two backward all-reduces of dK and dV (0.432 against 0.450 ms per
    layer, measured before K and V were all-gathered: `ilp._merge`) and keeps it; from
    micro-batch 16 on the CPU profile, 256 on A100s, or a Llama-3-8B layer with 2 KV heads at
    tp 8 (micro-batch 1), the query-head split wins."""
    p = plan("llama-small", _cpu(4), global_batch_size=16, dtype="fp32", intra_op="ilp",
             constraints=Constraints(dp=1, tp=4, pp=1, num_microbatches=1, recompute="none"))
    feeds = _attention_feeds(p, "llama-small")
    assert len(feeds) == 4
    for name, (strategy, steps) in feeds.items():
        assert strategy == "hq@0", (name, strategy)
        assert "all_gather" not in steps and "all_to_all" not in steps, (name, steps)
    ch = next(c for c in p.stages[0].op_layouts.solution((4,)).op_choices.values() if c.family == "attention")
    assert ch.input_placements == [("S(1)",), ("R",), ("R",)] and ch.output_placements == [("S(1)",)]


def test_no_op_makes_a_partial_sum_of_a_whole_or_split_tensor_to_hand_on():
    """llama-small at tp 4, micro-batch 8 on A100s (the attention replicated, above): K and V,
    2 KV heads over 4 devices, are made by column-parallel projections and all-gathered for
    the attention. The ILP's merge of followers (Alpa §4.2) took for each producer layout the
    follower's cheapest read, and a split K read as a partial sum is free there: K and V were
    viewed as partial sums and all-reduced (twice an all-gather's bytes and latency) where the
    reduction fell, which the merge did not see; equal in time to row-parallel projections'
    partial sums, 1.804 ms a step against 1.730 now. A follower whose cheapest read makes a
    partial sum keeps its own choice (`ilp._merge`)."""
    from autopar.capture import capture
    from autopar.planner import resolve_model

    cluster = autopar.ClusterSpec.load("dgx-a100-80g", num_nodes=1).model_copy(update={"devices_per_node": 4})
    p = plan("llama-small", cluster, global_batch_size=8, cache=False,
             constraints=Constraints(dp=1, tp=4, pp=1, microbatch_size=8, recompute="none", zero_stage=0,
                                     sequence_parallel=False))
    b = resolve_model("llama-small", None, None)
    g = capture(b.model, b.example_inputs, name=b.name)
    st = p.stages[0]
    sol = st.op_layouts.solution(st.mesh_shape)
    gathered = 0
    for name, ch in sol.op_choices.items():
        for src, want in zip(g.node(name).inputs, ch.input_placements):
            have = sol.op_choices[src].output_placements[0] if src in sol.op_choices else None
            if have is None:
                continue
            assert "P" not in want or "P" in have, (name, src, have, want)
            if g.node(name).op == "view" and have == ("S(2)",) and want == ("R",):
                gathered += 1           # K or V of one layer
    assert gathered == 2 * 4
