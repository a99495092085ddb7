"""`autopar sweep --plot` / `autopar show sweep.json --plot`: time to train against cost (or
GPU-hours), one series per cluster type with each point labelled by its node count, the
Pareto frontier drawn through its points and the deadline's choice circled (matplotlib, the
`plot` extra)."""

from __future__ import annotations

from pathlib import Path

from autopar.plot import figure_path, require_matplotlib, save_figure
from autopar.schema.plan import format_count
from autopar.schema.sweep import SweepResult

MARKERS = "osD^vP*X"


def plot_sweep(res: SweepResult, path: str | Path) -> Path:
    """Draw `res` to `path` (.png or .svg), written atomically."""
    path, fmt = figure_path(path)
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    money = res.cost_axis == "cost"
    y_of = (lambda p: p.cost) if money else (lambda p: p.gpu_hours)
    ok = [p for p in res.points if p.time_to_train_s is not None]
    fig, ax = plt.subplots(figsize=(9, 6), constrained_layout=True)
    # the time axis in days, or hours for short runs
    unit, per = ("days", 86400.0) if max((p.time_to_train_s for p in ok), default=0) >= 2 * 86400 else ("hours", 3600.0)
    days = lambda p: p.time_to_train_s / per  # noqa: E731
    for i, name in enumerate(dict.fromkeys(p.cluster for p in res.points)):
        pts = [p for p in ok if p.cluster == name]
        if not pts:
            continue
        line, = ax.plot([days(p) for p in pts], [y_of(p) for p in pts], marker=MARKERS[i % len(MARKERS)],
                        linestyle=":", label=f"{name} ({pts[0].device})")
        for p in pts:
            ax.annotate(f"{p.nodes}", (days(p), y_of(p)), textcoords="offset points", xytext=(5, 4),
                        fontsize=8, color=line.get_color())
    front = sorted((p for p in ok if p.pareto), key=lambda p: p.time_to_train_s)
    if front:
        ax.step([days(p) for p in front], [y_of(p) for p in front], where="post", color="black",
                linewidth=1.2, alpha=0.7, marker="o", markersize=11, markerfacecolor="none",
                label="Pareto frontier (time vs " + ("cost" if money else "GPU-hours") + ")")
    chosen = [p for p in ok if p.chosen]
    if chosen:
        ax.scatter([days(chosen[0])], [y_of(chosen[0])], s=260, facecolors="none", edgecolors="red",
                   linewidths=2, label=f"cheapest within the deadline: {chosen[0].key}", zorder=5)
    if res.deadline_s is not None:
        ax.axvline(res.deadline_s / per, color="red", linestyle="--", linewidth=1, label="deadline")
    if ok:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(f"time to train ({unit}, log)")
    ax.set_ylabel("cost (price per GPU-hour x GPU-hours, log)" if money else "GPU-hours (log)")
    ax.set_title(f"{res.model}: {format_count(res.tokens)} tokens, batch {res.global_batch_size} x "
                 f"{res.seq_len} tokens, {res.dtype} (point labels: nodes)")
    ax.grid(True, which="both", alpha=0.3)
    missing: dict[str, list[str]] = {}
    for p in res.points:
        if p.time_to_train_s is None:
            missing.setdefault(p.cluster, []).append(str(p.nodes))
    if missing:          # a legend entry without a handle: the sizes that do not vanish silently
        ax.plot([], [], " ", label="no plan fits:\n" + "\n".join(
            f"  {c} at {', '.join(ns)} node{'s' if ns != ['1'] else ''}" for c, ns in missing.items()))
    ax.legend(fontsize=8)
    return save_figure(fig, path, fmt, plt, dpi=100)
