"""Schedule simulation against the bubble formulas, and the plot a user opens."""

import subprocess
import sys

import pytest

from autopar.timeline import simulate


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12)])
def test_simulated_bubble_matches_formula(schedule, v, p, m):
    if m % p and v > 1:
        pytest.skip("interleaving needs micro-batches in groups of p")
    ev = simulate(schedule, [1.0] * (p * v), [2.0] * (p * v), m, v)
    total = max(e.end for e in ev)
    ideal = 3.0 * m * v
    assert (total - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    assert len(ev) == 2 * m * p * v


@pytest.mark.parametrize("p, v, m, emb, loss", [(32, 3, 512, 0.1, 2.3), (32, 3, 64, 0.1, 2.3), (8, 3, 64, 1.1, 1.35),
                                                (4, 2, 8, 0.2, 1.5), (8, 4, 32, 0.1, 3.0)])
def test_interleaved_time_with_uneven_chunks(p, v, m, emb, loss):
    """The search's interleaved pipeline time (`inter_op.search.interleaved_time`) with uneven
    chunks, the first one holding the embedding alone and the last the loss alone (a layer's
    time 1, `emb` and `loss` theirs; the first case is Megatron's Qwen3-235B PP32 VPP3 with the
    loss chunk at about its output layer's FLOPs over a layer's active ones, an upper end: the
    plan prices it at 1.2 layers), against the event simulation of Megatron's order: within 2%."""
    from autopar.inter_op.search import interleaved_time

    chunk = [1.0] * (p * v)
    chunk[0], chunk[-1] = emb, loss
    ev = simulate("interleaved_1f1b", [c / 3 for c in chunk], [2 * c / 3 for c in chunk], m, v)
    simulated = max(e.end for e in ev)
    groups = [sum(chunk[c * p + d] for c in range(v)) for d in range(p)]
    assert interleaved_time(groups, m, v) == pytest.approx(simulated, rel=0.02)


def test_1f1b_keeps_at_most_p_microbatches_in_flight():
    p, m = 4, 8
    ev = sorted(simulate("1f1b", [1.0] * p, [2.0] * p, m), key=lambda e: e.start)
    for stage in range(p):
        live = peak = 0
        for e in (x for x in ev if x.stage == stage):
            live += 1 if e.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(p - stage, m)


def test_show_plot_png_and_svg(tmp_path):
    plan = tmp_path / "plan.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "autopar", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    r = run("plan", "--model", "gpt-tiny", "--cluster", "cpu", "-b", "8", "-o", str(plan), "-q")
    assert r.returncode == 0, r.stderr
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    assert run("show", str(plan), "--plot", str(png)).returncode == 0
    assert run("show", str(plan), "--plot", str(svg)).returncode == 0
    import matplotlib.image as mpimg

    img = mpimg.imread(png)
    assert img.shape[0] > 400 and img.shape[1] > 600
    assert len({tuple(px) for px in img.reshape(-1, img.shape[-1])[::97]}) > 10   # not blank
    text = svg.read_text()
    for label in ("pipeline timeline", "memory per stage", "stages on nodes", "stage 0"):
        assert label in text
    bad = run("show", str(plan), "--plot", str(tmp_path / "t.bmp"))
    assert bad.returncode == 1 and ".png or .svg" in bad.stderr and not (tmp_path / "t.bmp").exists()


def test_plot_title_names_sequence_parallelism_and_recomputation(tmp_path):
    """The figure says how the plan trades memory for time, as `autopar show` does."""
    from autopar import ClusterSpec, Constraints
    from autopar.models.registry import build_model
    from autopar.planner import plan as make_plan
    from autopar.plot import plot_plan

    p = make_plan(build_model("gpt-tiny"), ClusterSpec.load("cpu"), global_batch_size=8,
                  constraints=Constraints(recompute="full"))
    text = plot_plan(p, tmp_path / "f.svg").read_text()
    assert "recompute full" in text
    sp = p.model_copy(update={"sequence_parallel": True})
    assert "(sequence parallel)" in plot_plan(sp, tmp_path / "g.svg").read_text()
    none = p.model_copy(update={"stages": [s.model_copy(update={"recompute": "none"}) for s in p.stages]})
    assert "recompute" not in plot_plan(none, tmp_path / "h.svg").read_text()
