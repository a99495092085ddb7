"""Issue 16, `autopar sweep`: every point is the plan `autopar plan` gives for that cluster and
size (the per-layer costs shared across sizes change nothing), sizes no plan fits say why, the
JSON records, the file of plans, the frontier and the deadline, and one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.capacity import choose, pareto_front, parse_count, parse_duration, parse_nodes, parse_prices, select
from autopar.capture import capture
from autopar.planner import plan, resolve_model
from autopar.schema import ClusterSpec, PlanError
from autopar.schema.sweep import SweepPoint, SweepResult, load_plan_or_point

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
ENV.pop("AUTOPAR_DEBUG", None)


def autopar_cli(*args):
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True,
                          env=ENV, timeout=300)


def _same_plan(a, b) -> bool:
    """Field for field but the search record (timings)."""
    x, y = json.loads(a.to_json()), json.loads(b.to_json())
    x.pop("search"), y.pop("search")
    return x == y


def _small_h100() -> ClusterSpec:
    """A DGX H100 whose devices hold 4.2 GiB (2.5 usable: the driver's share and a process's
    context, workspaces and NCCL buffers, 1.6 GiB, do not shrink with it): GPT-3 1.3B fits on 2
    nodes, not on 1."""
    h = ClusterSpec.load("dgx-h100")
    return h.model_copy(update={"name": "h100-3g",
                                "device": h.device.model_copy(update={"memory_bytes": 4.2 * 2**30})})


@pytest.fixture(scope="module")
def gpt13():
    """GPT-3 1.3B over a DGX H100 and a small-memory copy of it, 1 and 2 nodes (the intra-op
    ILP solves tp 2..8 once per cluster type, read again at 2 nodes)."""
    lines: list[str] = []
    res = autopar.sweep("gpt3-1.3b", ["dgx-h100", _small_h100()], [1, 2], tokens=1e9,
                        global_batch_size=16, progress=lines.append)
    return res, lines


def test_every_point_is_autopar_plan(gpt13):
    res, lines = gpt13
    assert [p.key for p in res.points] == ["dgx-h100:1", "dgx-h100:2", "h100-3g:1", "h100-3g:2"]
    bundle = resolve_model("gpt3-1.3b", None, None)
    # a capture of its own (not the sweep's), planned from scratch at every point
    graph = capture(bundle.model, bundle.example_inputs, name=bundle.name)
    specs = {"dgx-h100": ClusterSpec.load("dgx-h100"), "h100-3g": _small_h100()}
    for p in res.points:
        spec = specs[p.cluster].model_copy(update={"num_nodes": p.nodes})
        try:
            alone = plan(bundle, spec, global_batch_size=16, graph=graph)
        except PlanError as e:
            assert p.plan is None and p.reason == str(e), p.key
            continue
        assert p.plan is not None and _same_plan(p.plan, alone), p.key
        assert p.iteration_time_s == alone.predicted.iteration_time_s
    # the figures follow from the plan
    p = res.point("dgx-h100:2")
    assert p.steps == -(-10**9 // (16 * 2048))
    assert p.time_to_train_s == pytest.approx(p.steps * p.iteration_time_s)
    assert p.gpu_hours == pytest.approx(p.time_to_train_s * 16 / 3600)
    assert p.tokens_per_s == pytest.approx(16 * 2048 / p.iteration_time_s)
    peak = ClusterSpec.load("dgx-h100").device.peak("bf16")
    assert p.mfu == pytest.approx(p.plan.model.flops_per_sample * 16 / p.iteration_time_s / (16 * peak))
    assert p.cost is None and res.cost_axis == "gpu_hours"
    # progress: a line per point
    assert sum(line.startswith("[") for line in lines) == 4


def test_sizes_no_plan_fits_say_why(gpt13):
    res, _ = gpt13
    small1 = res.point("h100-3g:1")
    assert small1.iteration_time_s is None and small1.time_to_train_s is None and small1.gpu_hours is None
    assert "no plan fits in memory" in small1.reason and "GiB" in small1.reason
    assert "does not fit" in res.summary()
    assert res.point("h100-3g:2").plan is not None          # twice the devices: it fits
    # a batch that cannot spread over the devices, and a one-node profile asked for more nodes
    tiny = autopar.sweep("gpt-tiny", ["cpu", "dgx-a100-80g"], [1, 2, 4], tokens=1e6, global_batch_size=1)
    why = {p.key: p.reason for p in tiny.points}
    assert why["dgx-a100-80g:1"] is None and why["cpu:1"] is None
    assert "dp must divide the global batch" in why["dgx-a100-80g:4"]
    assert "inter_node" in why["cpu:2"]
    bundle = resolve_model("gpt-tiny", None, None)
    for p in tiny.points:
        if p.plan is not None:
            alone = plan(bundle, ClusterSpec.load(p.cluster, num_nodes=p.nodes), global_batch_size=1)
            assert _same_plan(p.plan, alone), p.key


def test_file_keeps_every_plan(gpt13, tmp_path):
    res, _ = gpt13
    path = tmp_path / "sweep.json"
    res.save(path)
    back = SweepResult.from_json(path.read_text())
    assert back.records() == res.records()
    got = load_plan_or_point(path, "dgx-h100:2")
    assert _same_plan(got, res.point("dgx-h100:2").plan)
    with pytest.raises(PlanError, match="has no plan: no plan fits in memory"):
        load_plan_or_point(path, "h100-3g:1")
    with pytest.raises(PlanError, match="is a sweep file; pick a point with --point"):
        load_plan_or_point(path, None)
    with pytest.raises(PlanError, match="no point 'dgx-h100:3'"):
        load_plan_or_point(path, "dgx-h100:3")
    bad = tmp_path / "cut.json"
    bad.write_text(path.read_text()[:1000])
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan_or_point(bad, "dgx-h100:2")


def test_cli_json_file_show(tmp_path):
    out = tmp_path / "sweep.json"
    r = autopar_cli("sweep", "--model", "gpt-tiny", "--clusters", "dgx-a100-80g,dgx-h100", "--nodes", "1..4",
                    "--tokens", "1e9", "-b", "1", "--price", "dgx-h100=3,dgx-a100-80g=1.5", "--deadline", "1d",
                    "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)
    assert [(x["cluster"], x["nodes"]) for x in recs] == [
        ("dgx-a100-80g", 1), ("dgx-a100-80g", 2), ("dgx-a100-80g", 4),
        ("dgx-h100", 1), ("dgx-h100", 2), ("dgx-h100", 4)]
    for x in recs:
        for k in ("cluster", "nodes", "iteration_time_s", "time_to_train_s", "gpu_hours", "reason"):
            assert k in x
        assert (x["iteration_time_s"] is None) == (x["reason"] is not None) == (x["gpu_hours"] is None)
    fits = [x for x in recs if x["reason"] is None]
    assert fits and all(x["cost"] == pytest.approx(x["gpu_hours"] * x["price_per_gpu_hour"]) for x in fits)
    assert any(x["reason"] for x in recs)                    # batch 1 on 32 devices: no layout
    assert sum(x["chosen"] for x in recs) == 1 and any(x["pareto"] for x in recs)
    assert "[1/6] dgx-a100-80g x 1 node" in r.stderr        # progress on stderr
    s = autopar_cli("show", str(out))
    assert s.returncode == 0 and "autopar sweep: gpt-tiny" in s.stdout and "frontier" in s.stdout
    key = next(f"{x['cluster']}:{x['nodes']}" for x in recs if x["chosen"])
    s = autopar_cli("show", str(out), "--point", key)
    assert s.returncode == 0 and s.stdout.startswith("autopar plan for gpt-tiny"), s.stderr


@pytest.mark.parametrize("args, message", [
    (["--clusters", "dgx-z9"], "unknown cluster 'dgx-z9'"),
    (["--clusters", "cpu", "--nodes", "0..x"], "--nodes: '0..x' is not a node count"),
    (["--clusters", "cpu", "--deadline", "30"], "--deadline '30': give a positive duration with a unit"),
    (["--clusters", "cpu", "--price", "dgx-h100=2"], "--price names dgx-h100, not a swept cluster"),
    (["--clusters", "cpu", "--tokens-per-step", "64", "-b", "4"], "not both"),
])
def test_cli_bad_input_is_one_line(args, message, tmp_path):
    out = tmp_path / "s.json"
    base = ["sweep", "--model", "gpt-tiny", "--tokens", "1e6", "-o", str(out)]
    r = autopar_cli(*base, *args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error:") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def _pt(cluster, nodes, t, cost, price=1.0):
    return SweepPoint(cluster=cluster, nodes=nodes, devices=8 * nodes, device="x", global_batch_size=8,
                      iteration_time_s=1.0, time_to_train_s=t, gpu_hours=cost / price,
                      price_per_gpu_hour=price, cost=cost)


def test_frontier_and_deadline_on_hand_made_points():
    a1, a2, a4 = _pt("a", 1, 100, 10), _pt("a", 2, 60, 12), _pt("a", 4, 40, 16)
    b1, b2 = _pt("b", 1, 70, 9), _pt("b", 2, 60, 12)        # b2 ties a2: both on the frontier
    c = _pt("c", 1, 120, 20)                                  # dominated by a1 and b1
    none = SweepPoint(cluster="c", nodes=2, devices=16, device="x", global_batch_size=8, reason="does not fit")
    pts = [a1, a2, a4, b1, b2, c, none]
    cost = lambda p: p.cost  # noqa: E731
    ok = [p for p in pts if p.time_to_train_s is not None]
    assert [p.key for p in pareto_front(ok, cost)] == ["a:4", "a:2", "b:2", "b:1"]
    assert choose(ok, 65, cost) is a2                         # cheapest in time; a tie goes to the first
    assert choose(ok, 80, cost) is b1
    assert choose(ok, 39, cost) is None
    res = select(SweepResult(model="m", tokens=1e9, seq_len=8, global_batch_size=8, deadline_s=50, points=pts))
    assert res.cost_axis == "cost" and res.chosen == "a:4"
    assert [p.key for p in res.points if p.pareto] == ["a:2", "a:4", "b:1", "b:2"]
    assert not none.pareto and not c.pareto
    res.deadline_s = 10
    select(res)
    assert res.chosen is None and any("no point finishes within" in n for n in res.notes)
    # a point without a price: GPU-hours decide, and the notes say so
    a1.cost, a1.price_per_gpu_hour = None, None
    res = select(SweepResult(model="m", tokens=1e9, seq_len=8, global_batch_size=8, points=[a1, b1]))
    assert res.cost_axis == "gpu_hours" and any("no price for a" in n for n in res.notes)
    assert "frontier" in res.summary()


def test_parsing():
    assert parse_nodes("1..64") == [1, 2, 4, 8, 16, 32, 64]
    assert parse_nodes("3..20,12,1") == [1, 4, 8, 12, 16]
    assert parse_duration("30d") == 30 * 86400 and parse_duration("1.5h") == 5400 and parse_duration("2w") == 14 * 86400
    assert parse_count("1e12", "--tokens") == 1e12 and parse_count("300B", "--tokens") == 3e11
    assert parse_prices("dgx-h100=2.5, dgx-a100-80g=1.8") == {"dgx-h100": 2.5, "dgx-a100-80g": 1.8}
    for bad in ("5..3", "x", ""):
        with pytest.raises(PlanError):
            parse_nodes(bad)
    with pytest.raises(PlanError):
        parse_prices("dgx-h100")


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from autopar.sweep_plot import plot_sweep

    pts = [_pt("a", 1, 100 * 86400, 10), _pt("a", 2, 60 * 86400, 12), _pt("b", 1, 70 * 86400, 9)]
    res = select(SweepResult(model="m", tokens=1e12, seq_len=8, global_batch_size=8, deadline_s=80 * 86400,
                             points=pts))
    out = plot_sweep(res, tmp_path / "s.png")
    assert out.stat().st_size > 10_000
