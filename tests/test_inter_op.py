"""The inter-op DP against brute force, and the layers of a model."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn as nn

from autopar.capture import capture
from autopar.inter_op.dp import brute_force, stage_dp
from autopar.inter_op.layers import build_layers
from autopar.models import build_model


def _random_instance(rng, L, sizes, S, inf_frac=0.2):
    M = len(sizes)
    cost = np.full((L, L + 1, M, S + 1), np.inf)
    for k in range(L):
        for j in range(k + 1, L + 1):
            for m, u in enumerate(sizes):
                base = rng.uniform(0.5, 2.0) * (j - k) / u ** rng.uniform(0.3, 1.0)
                for s in range(1, S + 1):
                    # memory grows with the stages after this one: infeasible past a random bound
                    if rng.random() < inf_frac * s / S:
                        continue
                    cost[k, j, m, s] = round(base + 0.05 * s * rng.random(), 3)
    return cost


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 7))            # up to 6 layers
    N = int(rng.choice([1, 2, 4, 8]))      # up to 8 devices
    sizes = [u for u in (1, 2, 4, 8) if u <= N]
    B = int(rng.choice([1, 2, 4, 16]))
    cost = _random_instance(rng, L, sizes, min(L, N))
    dp = stage_dp(cost, sizes, N, B)
    bf = brute_force(cost, sizes, N, B)
    if bf is None:
        assert dp is None
        return
    assert dp is not None
    assert dp.total == pytest.approx(bf.total, rel=1e-9)
    # the DP's stages are a valid slicing with the cost it claims
    assert dp.stages[0][0] == 0 and dp.stages[-1][1] == L
    assert sum(sizes[m] for _, _, m in dp.stages) == N
    s = len(dp.stages)
    ts = [cost[k, j, m, s - i] for i, (k, j, m) in enumerate(dp.stages)]
    assert sum(ts) + (B - 1) * max(ts) == pytest.approx(dp.total, rel=1e-9)


def _sweep_every_value(cost, sizes, N, B, num_stages=None):
    """The DP's t_max sweep as it was before it skipped to the values where the least sum drops
    (a run at every distinct stage cost from the first feasible one): the oracle of
    `test_dp_sweep_skips_nothing_that_matters`. (total, sum, t_max, stages)."""
    from autopar.inter_op.dp import _run_general, _run_uniform, first_feasible

    L, _, M, S1 = cost.shape
    S = min(S1 - 1, num_stages) if num_stages is not None else S1 - 1
    uniform = M == 1 and num_stages is not None and sizes[0] * num_stages == N

    def run(t):
        if uniform:
            return _run_uniform(cost, num_stages, t)
        return _run_general(np.where(cost <= t, cost, np.inf), list(sizes), N, S, num_stages)

    vals = np.unique(cost[np.isfinite(cost)])
    if vals.size == 0 or run(np.inf) is None:
        return None
    lb = run(np.inf)[0]
    best = None
    for t in vals[first_feasible(vals, lambda t: run(t) is not None):]:
        if best is not None and lb + (B - 1) * t >= best[0] * (1 - 1e-12):
            break
        r = run(t)
        if r is None:
            continue
        tmax = max(cost[k, j, m, s] for (k, j, m, s) in r[1])
        total = r[0] + (B - 1) * tmax
        if best is None or total < best[0] * (1 - 1e-12):
            best = (total, r[0], tmax, [(k, j, m) for k, j, m, _ in r[1]])
    return best


@pytest.mark.parametrize("seed", range(40))
def test_dp_sweep_skips_nothing_that_matters(seed):
    """`stage_dp` runs its DP only where the least sum of stage times drops as t_max grows
    (bisection); it returns exactly what the sweep over every distinct stage cost returned:
    total, sum, max and the same stages (so the same plans), on random sub-mesh and pinned
    instances with coarse costs (many ties) and fine ones, B from 1 to 64."""
    rng = np.random.default_rng(500 + seed)
    L = int(rng.integers(1, 12))
    if seed % 4 == 3:
        p = int(rng.integers(1, L + 1))
        cost, sizes, N, ns = _random_instance(rng, L, [1], p, inf_frac=0.3), [1], p, p
    else:
        N = int(rng.choice([2, 4, 8]))
        sizes = [u for u in (1, 2, 4, 8) if u <= N]
        cost, ns = _random_instance(rng, L, sizes, min(L, N)), None
    if seed % 2:
        cost = np.round(cost, 1)           # coarse: many equal stage costs and sums
    B = int(rng.choice([1, 2, 8, 64]))
    dp = stage_dp(cost, sizes, N, B, num_stages=ns)
    ref = _sweep_every_value(cost, sizes, N, B, ns)
    assert (dp is None) == (ref is None)
    if ref is not None:
        assert (dp.total, dp.sum_t, dp.t_max, dp.stages) == ref


@pytest.mark.parametrize("seed", range(16))
def test_dp_pinned_stage_count(seed):
    """A pinned stage count on one sub-mesh (the search's uniform pipelines, whose DP works on
    the band of ranges each stage can take): up to one layer per stage."""
    rng = np.random.default_rng(100 + seed)
    L = int(rng.integers(1, 8))
    p = int(rng.integers(1, L + 1))
    cost = _random_instance(rng, L, [1], p, inf_frac=0.3)
    dp = stage_dp(cost, [1], p, 8, num_stages=p)
    bf = brute_force(cost, [1], p, 8, num_stages=p)
    assert (dp is None) == (bf is None)
    if bf is not None:
        assert dp.total == pytest.approx(bf.total, rel=1e-9)
        assert len(dp.stages) == p


def test_gpt_layers_join_embedding_and_head():
    b = build_model("gpt-tiny")
    g = capture(b.model, b.example_inputs, name="gpt-tiny")
    layers = build_layers(g, b.model)
    assert [l.name for l in layers] == ["blocks.0", "blocks.1"]
    assert layers[0].modules == ["embed", "blocks.0"]
    assert layers[-1].modules == ["blocks.1", "head"]
    assert sum(len(l.nodes) for l in layers) == len(g.calls)
    assert "embed.tok.weight" in layers[0].params and "embed.tok.weight" in layers[-1].params


def test_embedding_and_loss_as_layer_slots_of_their_own():
    """`Constraints.account_in_split` (Megatron's --account-for-embedding/loss-in-pipeline-split):
    the ops before the first block and after the last are layers of their own; the planner
    takes both where the pinned chunks exceed the blocks and cuts a chunk of the embedding
    alone; more chunks than slots, a slot the model lacks: PlanErrors naming the field."""
    from autopar.planner import plan
    from autopar.schema import ClusterSpec, Constraints, PlanError

    b = build_model("gpt-tiny")
    g = capture(b.model, b.example_inputs, name="gpt-tiny")
    layers = build_layers(g, b.model, account=("embedding", "loss"))
    assert [lay.modules for lay in layers] == [["embed"], ["blocks.0"], ["blocks.1"], ["head"]]
    assert sum(len(lay.nodes) for lay in layers) == len(g.calls)
    assert [lay.name for lay in build_layers(g, b.model, account=("loss",))] == ["blocks.0", "blocks.1", "head"]
    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4, "num_nodes": 1})

    def make(**pins):
        return plan("gpt-tiny", cl, global_batch_size=8, dtype="fp32", intra_op="analytic",
                    constraints=Constraints(**pins))

    p = make(pp=2, virtual_stages=2, schedule="interleaved_1f1b", num_microbatches=2)
    assert [s.layers for s in p.stages] == [["embed"], ["blocks.0"], ["blocks.1"], ["head"]]
    assert "account_in_split" in p.search
    # each chunk reports its own layers' share of its device group's time: the embedding's part
    # of the group's bubble is below that of blocks.1, the group's other chunk
    assert p.stages[0].predicted.bubble_s < p.stages[2].predicted.bubble_s
    assert "account_in_split" not in make(pp=2).search     # free of the slots where the blocks suffice
    with pytest.raises(PlanError, match=r"6 chunks need as many layers; the model has 4 layer slots"):
        make(pp=2, virtual_stages=3, schedule="interleaved_1f1b")
    with pytest.raises(PlanError, match=r"account_in_split=\(\"embedding\", \"loss\"\)\) gives each"):
        make(pp=2, virtual_stages=2, schedule="interleaved_1f1b", account_in_split=())
    m = _Plain()
    with pytest.raises(PlanError, match="no repeated blocks"):
        build_layers(capture(m, (torch.randn(4, 64),)), m, account=("embedding",))


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64))
        self.d = nn.Linear(64, 10)

    def forward(self, x):
        return self.d(self.c(torch.relu(self.b(torch.relu(self.a(x)))))).sum()


def test_flop_balanced_clustering_without_blocks():
    m = _Plain()
    g = capture(m, (torch.randn(4, 64),))
    assert not g.layers
    layers = build_layers(g, m, max_layers=3)
    assert len(layers) == 3
    assert sum(len(l.nodes) for l in layers) == len(g.calls)
    mods = [x for l in layers for x in l.modules]
    assert mods == ["a", "b", "c.0", "c.1", "c.2", "c.3", "d"]
    # FLOP balance: no layer above (1 + delta) x the mean unless it is a single unit
    total = sum(l.flops for l in layers)
    assert max(l.flops for l in layers) <= 1.5 * total / 3 or any(len(l.modules) == 1 for l in layers)


def test_pack_stages_whole_nodes_and_aligned_slices():
    from autopar.inter_op.search import pack_stages

    out = pack_stages([2, 8, 4, 2], 16, 8)
    assert sorted(d for s in out for d in s) == list(range(16))
    for s in out:
        assert len({d // 8 for d in s}) == 1 or len(s) % 8 == 0
        assert s[0] % min(len(s), 8) == 0


def test_hetero_submesh_search_gives_valid_stages():
    """Alpa's free sub-mesh choice inside the joint search (stages may differ in tp)."""
    from autopar.inter_op.search import Search
    from autopar.schema import ClusterSpec, Constraints

    b = build_model("gpt-small")
    g = capture(b.model, b.example_inputs, name="gpt-small")
    layers = build_layers(g, b.model)
    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=1)
    s = Search(g, layers, cl, 16, "bf16", Constraints())
    het = s._hetero_candidates(s.meshes())
    assert het
    ok = [c for _, c in het if s.evaluate(c, None)]
    assert ok
    for c in ok:
        devs = [d for st in c.stages for d in st.devices]
        assert sorted(devs) == list(range(8))          # the sub-meshes cover the node exactly
        assert c.stages[0].chunks[0][0] == 0 and c.stages[-1].chunks[-1][1] == len(layers)
        assert all(len(st.devices) == c.dp * st.tp for st in c.stages)


def test_stage_tp_pins_each_stages_degree_in_order():
    """`Constraints(stage_tp=...)`: the stages get those tp degrees in model order (the DP picks
    only the layer split), dp the devices left over; a pin that cannot hold is a PlanError
    naming `stage_tp` and why."""
    import pytest

    from autopar.planner import plan
    from autopar.schema import ClusterSpec, Constraints, PlanError

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4, "num_nodes": 1})
    for pin in ((1, 2, 1), (2, 1, 1), (1, 1, 2)):
        p = plan("mlp-tiny", cl, global_batch_size=8, dtype="fp32", constraints=Constraints(stage_tp=pin),
                 intra_op="analytic")
        assert tuple(s.axis_size("tp") for s in sorted(p.stages, key=lambda s: s.index)) == pin
        assert p.dp == 1 and p.pp == 3
    for pin, extra, why in [((1, 2), {}, "do not divide the cluster's 4"),
                            ((1, 1, 2), {"tp": 2}, "tp=2 contradicts it"),
                            ((1, 3), {}, "neither a power-of-two slice"),
                            ((1, 1, 2), {"schedule": "interleaved_1f1b"}, "interleaved")]:
        with pytest.raises(PlanError, match=why) as e:
            plan("mlp-tiny", cl, global_batch_size=8, dtype="fp32", intra_op="analytic",
                 constraints=Constraints(stage_tp=pin, **extra))
        assert e.value.constraint == "stage_tp"


@pytest.mark.parametrize("software", ["autopar", "nemo-megatron-core-2024"])
def test_search_bounds_never_exceed_a_candidates_time(software):
    """The search evaluates candidates in order of a lower bound on their iteration time and
    stops at the first bound no better than the best plan found, so a bound above a
    candidate's evaluated time could lose the fastest plan. Every candidate of GPT-3 1.3B on
    two DGX A100 nodes (dp, tp, pp, micro-batch sizes, 1F1B and interleaved, ZeRO 0-3), with
    the gradient sync after the backward and overlapped with it: bound <= time."""
    from autopar.inter_op.search import Search
    from autopar.inter_op.stage_cost import AnalyticProvider
    from autopar.schema import ClusterSpec, Constraints

    b = build_model("gpt3-1.3b", device="meta")
    g = capture(b.model, b.example_inputs, name="gpt3-1.3b")
    layers = build_layers(g, b.model)
    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=2)
    s = Search(g, layers, cl, 64, "bf16", Constraints(), AnalyticProvider(g, layers, cl, "bf16", software))
    cands = [(lb, c) for lb, c in s.candidates() if not c.hetero_tps]
    kinds = {(c.zero, c.schedule) for _, c in cands}
    assert {z for z, _ in kinds} == {0, 1, 2, 3} and {k for _, k in kinds} >= {"1f1b", "interleaved_1f1b"}, kinds
    checked = 0
    for lb, c in cands:
        if s.evaluate(c, s.tables_for(c)):
            assert lb <= c.iteration_s * (1 + 1e-9), (c, lb, c.iteration_s)
            checked += 1
    assert checked > 50
    # an interleaved candidate's bound per recomputation policy (`Candidate.bounds`, which lets
    # the search skip a policy that cannot beat its best plan) is at most its time under it
    policies = checked = 0
    for _, c in cands:
        if not c.bounds:
            continue
        assert set(c.bounds) == set(s.recomputes())
        for r, bound in c.bounds.items():
            one = dataclasses.replace(c, bounds={})
            s.recomputes = lambda r=r: [r]
            if s.evaluate(one, s.tables_for(one)):
                assert {st.recompute for st in one.stages} == {r}
                assert bound <= one.iteration_s * (1 + 1e-9), (c, r, bound, one.iteration_s)
                checked += 1
            policies += 1
        del s.recomputes
    assert checked > 20


def test_search_skips_a_recomputation_that_cannot_beat_its_best_plan_and_finds_the_same_plan(monkeypatch):
    """With the best plan so far as the bar, an interleaved candidate does not try the
    policies whose bound is past it (`Candidate.bounds`): the search picks the same plan, with
    the same time and stages, as when every policy of every candidate is tried, in fewer stage
    evaluations. GPT-3 6.7B on one DGX A100 (80 GB), global batch 512 (most of its interleaved
    candidates fit only with recomputation)."""
    from autopar.inter_op.search import Search
    from autopar.inter_op.stage_cost import AnalyticProvider
    from autopar.schema import ClusterSpec, Constraints

    b = build_model("gpt3-6.7b", device="meta")
    g = capture(b.model, b.example_inputs, name="gpt3-6.7b")
    layers = build_layers(g, b.model)
    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=1)

    def run(skip: bool):
        s = Search(g, layers, cl, 512, "bf16", Constraints(), AnalyticProvider(g, layers, cl, "bf16"))
        calls = [0]
        stage, evaluate = s._stage, s.evaluate

        def counted(*a, **k):
            calls[0] += 1
            return stage(*a, **k)
        monkeypatch.setattr(s, "_stage", counted)
        if not skip:
            monkeypatch.setattr(s, "evaluate", lambda cand, tb, bar=float("inf"): evaluate(cand, tb))
        best = s.run().best
        return best, calls[0], s.evaluated

    best, calls, evaluated = run(True)
    every, calls_every, evaluated_every = run(False)
    assert best.key() == every.key() and best.iteration_s == every.iteration_s
    assert [(st.chunks, st.recompute) for st in best.stages] == [(st.chunks, st.recompute) for st in every.stages]
    assert evaluated == evaluated_every
    assert calls < calls_every, (calls, calls_every)


@pytest.mark.parametrize("intra_op", ["analytic", "ilp+sp"])
def test_search_costs_groups_as_reached_and_evaluates_what_the_whole_enumeration_would(intra_op, monkeypatch):
    """The search costs a (mesh, micro-batch, SP) group's layers only when its floor bound comes
    up (`Search._ordered`): each layer's floor (`time_floor`: every op at its cheapest compute,
    the ILP's own pricing) is at most its cost, as solved and as the executor runs it, and the
    group's floor bound at most each of its candidates' bounds; the search then evaluates the
    same candidates in the same order, counts the same candidates and picks the same plan as
    with every group costed up front (`candidates()`), while costing fewer groups. GPT-3 1.3B
    on one DGX A100, global batch 64: tp 1-8, micro-batches 1-64, with and without SP."""
    from autopar.inter_op.ilp_provider import IlpProvider
    from autopar.inter_op.search import Search
    from autopar.inter_op.stage_cost import AnalyticProvider
    from autopar.schema import ClusterSpec, Constraints

    b = build_model("gpt3-1.3b", device="meta")
    g = capture(b.model, b.example_inputs, name="gpt3-1.3b")
    layers = build_layers(g, b.model)
    cl = ClusterSpec.load("dgx-a100-80g", num_nodes=1)

    def search() -> Search:
        if intra_op == "analytic":
            return Search(g, layers, cl, 64, "bf16", Constraints(), AnalyticProvider(g, layers, cl, "bf16"))
        return Search(g, layers, cl, 64, "bf16", Constraints(), IlpProvider(g, layers, cl, "bf16", time_limit_s=30),
                      sp_provider=IlpProvider(g, layers, cl, "bf16", time_limit_s=30, sequence_parallel=True))

    def run(s: Search) -> tuple[list, object]:
        seen = []
        evaluate = s.evaluate

        def record(cand, tb, bar=float("inf")):
            seen.append((cand.dp, cand.tp, cand.pp, cand.mb, cand.schedule, cand.v, cand.zero, cand.sp))
            return evaluate(cand, tb, bar)
        monkeypatch.setattr(s, "evaluate", record)
        return seen, s.run()

    lazy = search()
    order, res = run(lazy)
    eager = search()
    monkeypatch.setattr(eager, "_ordered", lambda cps=(1,): iter(eager.candidates(cps)))
    order_all, res_all = run(eager)
    assert order == order_all and len(order) > 5
    assert lazy.considered == eager.considered and lazy.evaluated == eager.evaluated
    assert (res.best.key(), res.best.iteration_s, [st.peak_bytes for st in res.best.stages]) == \
        (res_all.best.key(), res_all.best.iteration_s, [st.peak_bytes for st in res_all.best.stages])
    costed = {k[:2] for k in lazy._costs_cache}
    assert costed < {k[:2] for k in eager._costs_cache}, "every group was costed"

    # the floors under the costs, and each group's floor bound under its candidates' bounds
    checked = 0
    for (mb, tp, sp), costs in eager._costs_cache.items():
        prov = eager.sp_provider if sp else eager.provider
        for layer, c in zip(layers, costs):
            f = eager.provider.time_floor(layer, mb, tp)
            assert f <= c.base_s * (1 + 1e-12), (layer.name, mb, tp)
            assert prov.time_floor(layer, mb, tp) == f
            checked += 1
    assert checked > 100
    for lb, c in eager.candidates():
        if not c.hetero_tps:
            floor = eager._floor_bound(c.tp, c.pp, c.mb, c.m, eager.schedules(c.pp, c.m))
            assert floor <= lb, (c, floor, lb)


def test_bottleneck_bound_is_the_linear_partition_optimum():
    """`search._bottleneck`: the least largest part over every split into at most p parts
    (brute force), from below and within 1e-6."""
    import itertools

    from autopar.inter_op.search import _bottleneck

    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.integers(1, 8))
        t = rng.uniform(0.0, 1.0, n) * (rng.random(n) < 0.9)
        p = int(rng.integers(1, n + 2))
        best = min(max(sum(t[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                   for k in range(min(p, n)) for cuts in itertools.combinations(range(1, n), k))
        got = _bottleneck(t, p)
        assert got <= best and got >= best * (1 - 1e-6) - 1e-12, (t, p, got, best)


def _policy_search(scale: float, recompute=None):
    """A one-stage search over four identical synthetic layers whose activations per
    recomputation policy are `scale` times (none 1.2, selective 1.19, attention 0.5, full 0.1)
    of the device's usable memory, each policy's re-run forward costing more (0, 0.1, 0.4, 1 of
    the layer's forward)."""
    from autopar.capture.graph import OpGraph
    from autopar.inter_op.layers import Layer
    from autopar.inter_op.search import Search
    from autopar.inter_op.stage_cost import LayerCost
    from autopar.schema import ClusterSpec, Constraints
    from cost_models.memory import usable_memory

    cluster = ClusterSpec.load("dgx-a100-80g", num_nodes=1)
    per = scale * usable_memory(cluster.device) / 4
    act = {"none": 1.2 * per, "selective": 1.19 * per, "attention": 0.5 * per, "full": 0.1 * per}
    extra = {"none": 0.0, "selective": 1e-4, "attention": 4e-4, "full": 1e-3}

    class Provider:
        def cost(self, layer, mb, tp):
            return LayerCost(fwd_s=1e-3, bwd_s=2e-3, act_bytes=dict(act), rc_extra_s=dict(extra),
                             param_elems={f"l{layer.index}.w": 1e3})

    layers = [Layer(i, f"blocks.{i}", [f"blocks.{i}"], [], [f"l{i}.w"], signature="0") for i in range(4)]
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=1, zero_stage=0, recompute=recompute)
    return Search(OpGraph(name="synthetic", nodes=[], params={}), layers, cluster, 8, "bf16", cons,
                  provider=Provider()).run().best


def test_search_picks_attention_recompute_where_it_is_the_fastest_that_fits():
    """Issue 13: the attention module's checkpoint is searched beside the core alone: where
    neither "none" nor "selective" fits and it does, the stage takes it (faster than "full");
    where "none" fits, "none"; where it does not fit either, "full". Pinned, it is what runs."""
    assert [st.recompute for st in _policy_search(1.0).stages] == ["attention"]
    assert [st.recompute for st in _policy_search(0.5).stages] == ["none"]
    assert [st.recompute for st in _policy_search(2.5).stages] == ["full"]
    assert [st.recompute for st in _policy_search(0.5, "attention").stages] == ["attention"]


def test_the_first_layer_after_a_tp_change_is_priced_by_the_solution_it_runs(monkeypatch):
    """Between stages of different tp degrees tensors cross replicated, so the first layer of
    the later stage runs its entry solution (`IlpProvider.entry_solutions`), not the one the
    DP's tables priced (its inputs arriving as its tp-2 predecessor leaves them). `mlp` (layers
    of distinct widths) with stages of tp 1, 2, 1: the prediction moves by exactly the entry
    solution's forward + backward less the ordinary one's, in the stage's micro-batch time."""
    from autopar.inter_op import search as search_mod
    from autopar.planner import plan
    from autopar.schema import ClusterSpec, Constraints

    cl = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4, "num_nodes": 1})
    cons = Constraints(stage_tp=(1, 2, 1), num_microbatches=4, schedule="1f1b", recompute="none")
    seen = []
    real = search_mod.Search._entry_prices

    def spy(self, cand, stages):
        before = [st.t_mb for st in stages]
        real(self, cand, stages)
        spans = [(k, j, st.tp, st.recompute) for st in stages for k, j in st.chunks]
        deltas = {}
        for k, (entry, layer) in self.provider.entry_solutions(spans, cand.mb).items():
            ordinary = self.provider.solutions[(layer.signature, cand.mb, 2)][0]
            deltas[k] = entry.forward_s + entry.backward_s - ordinary.forward_s - ordinary.backward_s
        seen.append((before, [st.t_mb for st in stages], [st.chunks[0][0] for st in stages], deltas))

    monkeypatch.setattr(search_mod.Search, "_entry_prices", spy)
    p = plan("mlp", cl, global_batch_size=8, dtype="fp32", constraints=cons, intra_op="ilp")
    assert [s.axis_size("tp") for s in sorted(p.stages, key=lambda s: s.index)] == [1, 2, 1]
    priced = [x for x in seen if x[3]]
    assert priced, "the tp-2 stage's first layer has an entry solution"
    for before, after, firsts, deltas in priced:
        for b, a, k in zip(before, after, firsts):
            assert a == pytest.approx(b + deltas.get(k, 0.0), rel=1e-9, abs=1e-12)
    assert any(abs(d) > 0 for x in priced for d in x[3].values())

    monkeypatch.setattr(search_mod.Search, "_entry_prices", lambda self, cand, stages: None)
    unpriced = plan("mlp", cl, global_batch_size=8, dtype="fp32", constraints=cons, intra_op="ilp")
    assert p.predicted.iteration_time_s != unpriced.predicted.iteration_time_s


def _policies_search(act: dict, extra: dict, **pins):
    """`_policy_search`'s synthetic model with every policy priced (`act` per policy as a share of
    the device's usable memory over the four layers, `extra` each policy's re-run forward in s),
    pinned to `pins` on 8 devices."""
    from autopar.capture.graph import OpGraph
    from autopar.inter_op.layers import Layer
    from autopar.inter_op.search import Search
    from autopar.inter_op.stage_cost import LayerCost
    from autopar.schema import ClusterSpec, Constraints
    from cost_models.memory import usable_memory

    cluster = ClusterSpec.load("dgx-a100-80g", num_nodes=1)
    per = usable_memory(cluster.device) / 4

    class Provider:
        def cost(self, layer, mb, tp):
            return LayerCost(fwd_s=1e-3, bwd_s=2e-3, act_bytes={r: a * per for r, a in act.items()},
                             rc_extra_s=dict(extra), param_elems={f"l{layer.index}.w": 1e3})

    layers = [Layer(i, f"blocks.{i}", [f"blocks.{i}"], [], [f"l{i}.w"], signature="0") for i in range(4)]
    cons = Constraints(tp=1, microbatch_size=1, zero_stage=0, **pins)
    return Search(OpGraph(name="synthetic", nodes=[], params={}), layers, cluster, 8, "bf16", cons,
                  provider=Provider()).run().best


@pytest.mark.parametrize("pins", [dict(dp=8, pp=1, num_microbatches=1),
                                  dict(dp=4, pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                                       num_microbatches=2)])
def test_search_takes_norm_act_where_it_is_the_fastest_that_fits(pins):
    """Issue 17: "norm_act" (the norms' and expert activations' outputs discarded and re-made) is
    searched beside the other policies: taken where "none" does not fit and it is the fastest
    policy that does; where the attention core's re-run costs less and fits too, that one, in
    the interleaved schedule's search as well (it tries the policies by their re-run time, not
    in the registry's order, where "norm_act" comes before "selective"). Session 35 searched it
    only where pinned (HF Mixtral's memory did not hold); session 36 fixed that."""
    cheap = {"none": 0.0, "norm_act": 5e-5, "selective": 1e-4, "attention": 4e-4, "full": 1e-3}
    act = {"none": 1.2, "norm_act": 0.6, "selective": 1.19, "attention": 0.5, "full": 0.1}
    assert {st.recompute for st in _policies_search(act, cheap, **pins).stages} == {"norm_act"}
    dearer = {**cheap, "norm_act": 2e-4}
    act_sel = {**act, "selective": 0.9}
    assert {st.recompute for st in _policies_search(act_sel, dearer, **pins).stages} == {"selective"}
    assert {st.recompute for st in _policies_search(act_sel, dearer, recompute="norm_act", **pins).stages} == \
        {"norm_act"}


def test_norm_act_pinned_on_a_tp_stage_is_executed_op_by_op():
    """Issue 17: "norm_act" pinned with tp (Megatron-SP or not) is executed as solved: the stage
    carries its layouts, each block's norm a region of its own (`LayerOps.discarded`, the
    memory model's `norm_act_regions`), none checkpointed, and `autopar run`'s validation takes
    it; a plan without it writes no `discarded` (its file, and digest, as before)."""
    from autopar.models.registry import build_model
    from autopar.planner import plan
    from autopar.runtime.validate import validate_plan
    from autopar.schema import ClusterSpec, Constraints, Plan

    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 2})
    for sp in (False, True):
        p = plan("gpt-tiny", cpu, global_batch_size=8, dtype="fp32", intra_op="ilp",
                 constraints=Constraints(recompute="norm_act", tp=2, sequence_parallel=sp))
        st = p.stages[0]
        assert p.sequence_parallel == sp and st.recompute == "norm_act" and st.op_layouts is not None
        assert "tp_executor" not in p.search
        assert st.op_layouts.recompute_regions() == []
        assert st.op_layouts.discard_regions() == [["layer_norm"], ["layer_norm_1"], ["layer_norm_2"],
                                                    ["layer_norm_3"]]
        validate_plan(p, build_model("gpt-tiny", device="meta").model)
        assert Plan.model_validate_json(p.to_json()).stages[0].op_layouts == st.op_layouts
    plain = plan("gpt-tiny", cpu, global_batch_size=8, dtype="fp32", intra_op="ilp", constraints=Constraints(tp=2))
    assert plain.stages[0].op_layouts is not None and '"discarded"' not in plain.to_json()
