"""The per-layer intra-op solutions kept on disk (`autopar.inter_op.ilp_cache`): a later plan of
the same model reads them back and plans the same; a changed profile or model does not hit
them; an unreadable entry is solved again with a warning."""

from __future__ import annotations

import json
import warnings

import pytest

from autopar.capture import capture
from autopar.capture.cache import CacheWarning
from autopar.inter_op.search import Search
from autopar.planner import build_layers, make_provider, plan, resolve_model
from autopar.schema import ClusterSpec, Constraints


def _cpu(n: int = 2) -> ClusterSpec:
    return ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


def _search(graph, layers, cluster, cache_dir):
    prov = make_provider("ilp", graph, layers, cluster, "fp32", cache_dir)
    res = Search(graph, layers, cluster, 8, "fp32", Constraints(dp=1, tp=2, pp=1), prov, False).run()
    return prov, res


@pytest.fixture(scope="module")
def tiny():
    b = resolve_model("gpt-tiny", None, None)
    g = capture(b.model, b.example_inputs, name=b.name)
    return b, g, build_layers(g, b.model)


def test_a_later_plan_reads_the_solutions_back_and_plans_the_same(tiny, tmp_path):
    b, g, layers = tiny
    first, res1 = _search(g, layers, _cpu(), tmp_path)
    assert first.solves > 0 and first.cache.hits == 0
    entries = list((tmp_path / "ilp").glob("*.json"))
    assert len(entries) == first.solves
    again, res2 = _search(g, layers, _cpu(), tmp_path)
    assert again.solves == 0 and again.cache.hits == first.solves
    assert res2.best.iteration_s == res1.best.iteration_s
    p1 = plan(b, _cpu(), global_batch_size=8, dtype="fp32", graph=g, cache=tmp_path,
              constraints=Constraints(dp=1, tp=2, pp=1))
    p2 = plan(b, _cpu(), global_batch_size=8, dtype="fp32", graph=g, constraints=Constraints(dp=1, tp=2, pp=1))
    drop = lambda p: {k: v for k, v in json.loads(p.to_json()).items() if k != "search"}  # noqa: E731
    assert drop(p1) == drop(p2)          # from the cache and solved afresh: the same plan


def test_another_profile_or_model_does_not_hit(tiny, tmp_path):
    b, g, layers = tiny
    _search(g, layers, _cpu(), tmp_path)
    faster = _cpu().model_copy(update={"intra_node": _cpu().intra_node.model_copy(
        update={"bandwidth": _cpu().intra_node.bandwidth * 3})})
    prov, _ = _search(g, layers, faster, tmp_path)
    assert prov.cache.hits == 0 and prov.solves > 0
    b2 = resolve_model("tests.user_models:nanogpt", None, None)     # the same GPT written otherwise
    g2 = capture(b2.model, b2.example_inputs, name=b2.name)
    prov2, _ = _search(g2, build_layers(g2, b2.model), _cpu(), tmp_path)
    assert prov2.cache.hits == 0 and prov2.solves > 0


def test_an_unreadable_entry_is_solved_again_with_a_warning(tiny, tmp_path):
    b, g, layers = tiny
    first, _ = _search(g, layers, _cpu(), tmp_path)
    victim = sorted((tmp_path / "ilp").glob("*.json"))[0]
    victim.write_text("{truncated")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        again, _ = _search(g, layers, _cpu(), tmp_path)
    assert again.solves == 1 and again.cache.hits == first.solves - 1
    assert any(issubclass(w.category, CacheWarning) and str(victim) in str(w.message) for w in got)
    json.loads(victim.read_text())       # rewritten whole


def test_layer_costs_are_read_back_and_keyed_by_what_they_read(tiny, tmp_path):
    """The whole layer costs (activation memory by policy included) kept beside the solutions
    (`ilp_cache.CostCache`): a later search reads every one back, plans the same and still has
    the layers' solutions for the plan's layouts; another software (attention kernel) or dtype
    misses them."""
    b, g, layers = tiny
    first, res1 = _search(g, layers, _cpu(), tmp_path)
    assert first.cost_cache.hits == 0 and list((tmp_path / "layer_costs").glob("*.json"))
    again, res2 = _search(g, layers, _cpu(), tmp_path)
    assert again.cost_cache.hits > 0 and again.solves == 0
    assert res2.best.iteration_s == res1.best.iteration_s
    assert [s.peak_bytes for s in res2.best.stages] == [s.peak_bytes for s in res1.best.stages]
    assert set(again.solutions) == set(first.solutions)
    unfused = make_provider("ilp", g, layers, _cpu(), "fp32", tmp_path, software="megatron-lm-2021")
    Search(g, layers, _cpu(), 8, "fp32", Constraints(dp=1, tp=2, pp=1), unfused, False).run()
    assert unfused.cost_cache.hits == 0
