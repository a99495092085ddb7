"""`autopar show --plot`: the pipeline timeline per device, memory per stage against capacity,
and how stages map onto nodes, in one figure (PNG or SVG; matplotlib, the `plot` extra)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from autopar.schema import Plan, PlanError
from autopar.timeline import plan_timeline

MEMORY_PARTS = (("weights_bytes", "weights"), ("gradients_bytes", "gradients"),
                ("optimizer_bytes", "optimizer state"), ("activations_bytes", "activations"))


def figure_path(path: str | Path) -> tuple[Path, str]:
    """`path` and its format (png or svg), checked before anything is drawn."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise PlanError(f"--plot needs a .png or .svg file name, got {path.name!r}")
    if not path.resolve().parent.is_dir():
        raise PlanError(f"cannot write {path}: directory {path.parent} does not exist")
    return path, fmt


def require_matplotlib() -> None:
    """Fail with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlanError("plotting needs matplotlib: pip install 'autopar[plot]'") from None


def plot_plan(plan: Plan, path: str | Path) -> Path:
    """Draw `plan` to `path` (.png or .svg), written atomically."""
    path, fmt = figure_path(path)
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig = plt.figure(figsize=(13, 8.5), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.2, 1])
    _timeline(fig.add_subplot(grid[0, :]), plan, plt, Patch)
    _memory(fig.add_subplot(grid[1, 0]), plan)
    _nodes(fig.add_subplot(grid[1, 1]), plan, plt)
    fig.suptitle(f"{plan.model.name} on {plan.cluster.num_devices} x {plan.cluster.device.name}: "
                 f"dp={plan.dp}{f' cp={plan.cp}' if plan.cp > 1 else ''} tp={plan.tp}"
                 f"{' (sequence parallel)' if plan.sequence_parallel else ''} pp={plan.pp}, {plan.schedule}, "
                 f"{_recompute(plan)}{plan.predicted.iteration_time_s:.3g} s/iteration (predicted)")
    return save_figure(fig, path, fmt, plt, dpi=110)


def _recompute(plan: Plan) -> str:
    """The stages' recomputation for the title: one policy, or each stage's; empty for none."""
    kinds = [st.recompute for st in plan.stages]
    if set(kinds) == {"none"}:
        return ""
    if len(set(kinds)) == 1:
        return f"recompute {kinds[0]}, "
    return "recompute " + "/".join(kinds) + " by stage, "


def save_figure(fig, path: Path, fmt: str, plt, dpi: int = 100) -> Path:
    """Write `fig` to `path` atomically (a temporary file renamed into place: the file is the
    whole figure or untouched) and close it."""
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=f".{fmt}")
    os.close(fd)
    try:
        fig.savefig(tmp, format=fmt, dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _timeline(ax, plan: Plan, plt, Patch) -> None:
    events = plan_timeline(plan)
    m = plan.num_microbatches
    cmap = plt.get_cmap("tab20")
    groups = sorted({e.device_group for e in events})
    for e in events:
        color = cmap((e.microbatch % 10) * 2 + (1 if e.kind == "F" else 0))
        ax.barh(e.device_group, e.end - e.start, left=e.start, height=0.8, color=color,
                edgecolor="black", linewidth=0.3)
        if m <= 16 and (e.end - e.start) > 0:
            ax.text((e.start + e.end) / 2, e.device_group, f"{e.kind}{e.microbatch}", ha="center",
                    va="center", fontsize=6)
    end = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events) / len(groups)
    ax.set_yticks(groups)
    stages = {tuple(s.devices): s for s in plan.stages}
    labels = []
    for devs in dict.fromkeys(tuple(s.devices) for s in sorted(plan.stages, key=lambda s: s.index)):
        labels.append(f"stage {stages[devs].index}: ranks {devs[0]}-{devs[-1]}" if len(devs) > 1
                      else f"stage {stages[devs].index}: rank {devs[0]}")
    ax.set_yticklabels(labels[: len(groups)])
    ax.invert_yaxis()
    ax.set_xlabel("time within one iteration (s, simulated from per-stage predictions)")
    ax.set_title(f"pipeline timeline: forward (light) and backward (dark) per micro-batch; "
                 f"white = bubble ({(end - busy) / end:.0%} idle)")
    ax.legend(handles=[Patch(color=cmap(1), label="forward"), Patch(color=cmap(0), label="backward")],
              loc="lower right", fontsize=7)


def _memory(ax, plan: Plan) -> None:
    gib = 2**30
    stages = sorted(plan.stages, key=lambda s: (s.index, s.virtual_chunk))
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for field, label in MEMORY_PARTS:
        vals = [(getattr(s.predicted, field) if s.predicted else 0.0) / gib for s in stages]
        ax.bar(xs, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = plan.cluster.device.memory_bytes / gib
    ax.axhline(cap, color="red", linestyle="--", label=f"device memory {cap:.0f} GiB")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"s{s.index}" + (f".{s.virtual_chunk}" if plan.virtual_stages > 1 else "")
                        for s in stages], fontsize=7)
    ax.set_ylabel("GiB per device")
    ax.set_title("memory per stage (predicted peak)")
    ax.legend(fontsize=7)


def _nodes(ax, plan: Plan, plt) -> None:
    import numpy as np

    c = plan.cluster
    grid = np.full((c.num_nodes, c.devices_per_node), -1.0)
    for s in plan.stages:
        for d in s.devices:
            grid[d // c.devices_per_node, d % c.devices_per_node] = s.index
    masked = np.ma.masked_less(grid, 0)
    ax.imshow(masked, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(c.num_nodes) if c.num_nodes <= 32 else [0, c.num_nodes - 1])
    ax.set_xticks(range(c.devices_per_node))
    ax.set_xlabel("device within node")
    ax.set_ylabel("node")
    ax.set_title("stages on nodes (colour = stage index)")
    if c.num_nodes * c.devices_per_node <= 64:
        for (r, k), v in np.ndenumerate(grid):
            if v >= 0:
                ax.text(k, r, f"{int(v)}", ha="center", va="center", color="white", fontsize=7)
