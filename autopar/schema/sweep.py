"""The sweep file (`autopar sweep -o sweep.json`): one record per (cluster type, node count),
each keeping its plan, so that `autopar show sweep.json --point dgx-h100:8` and
`autopar run sweep.json --point dgx-h100:8 --model ...` work on any point.

Versioned like plan files (`format_version`; a newer file is refused with a message). Imports
only the rest of `autopar.schema`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from autopar.schema.errors import PlanError
from autopar.schema.plan import (
    Plan,
    TrainingDtype,
    format_count,
    format_table,
    parse_json,
    validate_versioned,
    write_atomic,
)

# 2: its plans record their software (plan format 7), which an autopar reading 1 would refuse
# field by field; files of 1 load (their plans migrate, `Plan._software_from_device`)
SWEEP_FORMAT_VERSION = 2
SWEEP_KIND = "autopar-sweep"
# the fields `autopar sweep --json` prints per point (the plan stays in the file)
RECORD_FIELDS = ("cluster", "nodes", "devices", "device", "global_batch_size", "layout",
                 "iteration_time_s", "tokens_per_s", "mfu", "tflops_per_device", "peak_memory_bytes",
                 "steps", "time_to_train_s", "gpu_hours", "price_per_gpu_hour", "cost", "pareto",
                 "chosen", "search_time_s", "reason")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SweepPoint(_Model):
    """One cluster type at one node count: its best plan's figures, or why none fits."""

    cluster: str = Field(description="the cluster profile's name (a bundled name or the file's `name`)")
    nodes: int = Field(ge=1)
    devices: int = Field(ge=1)
    device: str = Field(description="the device's name in the profile")
    global_batch_size: int = Field(ge=1)
    layout: Optional[str] = Field(default=None, description="dp/tp/pp, micro-batching, schedule, "
                                  "recomputation, ZeRO of the best plan")
    iteration_time_s: Optional[float] = Field(default=None, ge=0)
    tokens_per_s: Optional[float] = Field(default=None, ge=0)
    mfu: Optional[float] = Field(default=None, ge=0, description="model FLOPs (no recomputation) per "
                                 "second over the devices' peak at the plan's dtype")
    tflops_per_device: Optional[float] = Field(default=None, ge=0, description="as the plan counts it "
                                               "(recomputed forward included)")
    peak_memory_bytes: Optional[float] = Field(default=None, ge=0)
    steps: Optional[int] = Field(default=None, ge=0, description="iterations to train the token budget")
    time_to_train_s: Optional[float] = Field(default=None, ge=0)
    gpu_hours: Optional[float] = Field(default=None, ge=0)
    price_per_gpu_hour: Optional[float] = Field(default=None, ge=0)
    cost: Optional[float] = Field(default=None, ge=0, description="gpu_hours x price_per_gpu_hour")
    pareto: bool = Field(default=False, description="on the time-vs-cost frontier: no other point "
                         "is at least as fast and as cheap, and better in one")
    chosen: bool = Field(default=False, description="the cheapest point meeting the deadline")
    search_time_s: float = Field(default=0.0, ge=0)
    reason: Optional[str] = Field(default=None, description="why no plan fits (the planner's error)")
    plan: Optional[Plan] = None

    @property
    def key(self) -> str:
        """`CLUSTER:NODES`, what `--point` takes."""
        return f"{self.cluster}:{self.nodes}"

    @property
    def feasible(self) -> bool:
        return self.plan is not None or self.iteration_time_s is not None

    def record(self) -> dict[str, Any]:
        """The point as `autopar sweep --json` prints it (no plan)."""
        return {k: getattr(self, k) for k in RECORD_FIELDS}


class SweepResult(_Model):
    """A whole sweep: what was asked, every point, and the deadline's choice."""

    kind: Literal["autopar-sweep"] = SWEEP_KIND
    format_version: int = SWEEP_FORMAT_VERSION
    autopar_version: str = ""
    model: str
    dtype: TrainingDtype = "bf16"
    tokens: float = Field(gt=0, description="the token budget to train")
    seq_len: int = Field(ge=1, description="tokens per sample")
    global_batch_size: int = Field(ge=1)
    cost_axis: Literal["cost", "gpu_hours"] = Field(
        default="gpu_hours", description="what the frontier and the deadline minimise: the cost where "
        "every feasible point has a price, else GPU-hours")
    deadline_s: Optional[float] = Field(default=None, gt=0)
    chosen: Optional[str] = Field(default=None, description="the deadline's pick, CLUSTER:NODES")
    notes: list[str] = Field(default_factory=list, description="what the user should know about the "
                             "figures (a point without a price, no point meeting the deadline)")
    points: list[SweepPoint] = Field(default_factory=list)

    def records(self) -> list[dict[str, Any]]:
        """One dict per point, without plans (what `autopar sweep --json` prints)."""
        return [p.record() for p in self.points]

    def point(self, key: str) -> SweepPoint:
        """The point `CLUSTER:NODES` (e.g. `dgx-h100:8`), with a message naming the valid keys."""
        for p in self.points:
            if p.key == key:
                return p
        raise PlanError(f"no point {key!r} in the sweep; points: {', '.join(p.key for p in self.points)}")

    def plan(self, key: str) -> Plan:
        """The plan of point `key`; a PlanError saying why when that size had none."""
        p = self.point(key)
        if p.plan is None:
            raise PlanError(f"point {key} has no plan: {p.reason or 'it was written without plans'}")
        return p.plan

    # -- text ------------------------------------------------------------------------------
    def summary(self) -> str:
        """The table `autopar sweep` prints: a row per point, the frontier marked with `*`, the
        deadline's choice with `>`."""
        money = self.cost_axis == "cost"
        cols = ["", "cluster", "nodes", "GPUs", "layout", "step s", "tokens/s", "MFU", "time to train",
                "GPU-hours", *(["cost"] if money or any(p.cost is not None for p in self.points) else [])]
        rows = []
        for p in self.points:
            mark = (">" if p.chosen else "") + ("*" if p.pareto else "")
            if p.iteration_time_s is None:
                row = [mark, p.cluster, str(p.nodes), str(p.devices), f"- ({_short(p.reason)})",
                       "-", "-", "-", "-", "-"]
            else:
                row = [mark, p.cluster, str(p.nodes), str(p.devices), p.layout or "",
                       f"{p.iteration_time_s:.3g}", format_count(p.tokens_per_s or 0),
                       _percent(p.mfu or 0), format_duration(p.time_to_train_s or 0),
                       _amount(p.gpu_hours or 0)]
            if len(cols) > len(row):
                row.append("-" if p.cost is None else _amount(p.cost))
            rows.append(row)
        head = (f"autopar sweep: {self.model}, {format_count(self.tokens)} tokens, sequence {self.seq_len}, "
                f"global batch {self.global_batch_size} ({format_count(self.global_batch_size * self.seq_len)}"
                f" tokens/step), {self.dtype}")
        axis = "cost" if money else "GPU-hours"
        tail = [f"* on the time-vs-{axis} frontier (no other point is at least as fast and as cheap)"]
        if self.deadline_s is not None:
            tail.append(f"> cheapest point finishing within {format_duration(self.deadline_s)}: "
                        f"{self.chosen or 'none'}")
        tail += self.notes
        return "\n".join([head, format_table(cols, rows), *tail])

    # -- files -----------------------------------------------------------------------------
    def to_json(self, indent: Optional[int] = None) -> str:
        return self.model_dump_json(indent=indent)

    def save(self, path: str | Path) -> None:
        """Write atomically: the file is either the whole sweep or left untouched."""
        write_atomic(Path(path), self.to_json())

    @classmethod
    def from_json(cls, text: str, source: str = "sweep") -> "SweepResult":
        return cls.from_data(parse_json(text, source, "autopar sweep ... -o FILE"), source)

    @classmethod
    def from_data(cls, data: Any, source: str = "sweep") -> "SweepResult":
        if not isinstance(data, dict) or data.get("kind") != SWEEP_KIND:
            raise PlanError(f"{source} is not an autopar sweep file")
        return validate_versioned(cls, data, source, "sweep file", SWEEP_FORMAT_VERSION,
                                  "sweep again with this version")


def _short(reason: Optional[str], width: int = 64) -> str:
    """The reason's gist, for the table (the JSON and the file keep it whole)."""
    r = reason or "no plan"
    m = re.match(r"no plan fits in memory: the least memory any plan needs is ([\d.]+ \w+) per device", r)
    if m:
        return f"does not fit: needs {m.group(1)} per device"
    if r.startswith("no dp x tp x pp layout"):
        return "no layout: the batch does not divide, or too few layers"
    r = r.split(";")[0]
    return r if len(r) <= width else r[: width - 3] + "..."


def _amount(x: float) -> str:
    """12,345 for large figures, 3 significant digits for small ones."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.0005 else "<0.1%"


def format_duration(s: float) -> str:
    """Seconds as the unit a person plans in: 45 s, 12.5 min, 7.2 h, 31.4 d."""
    if s < 60:
        return f"{s:.3g} s"
    if s < 3600:
        return f"{s / 60:.3g} min"
    if s < 86400 * 2:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} d" if s < 1000 * 86400 else f"{s / 86400:,.0f} d"


def read_plan_or_sweep(path: str | Path) -> Plan | SweepResult:
    """A plan file or a sweep file, told apart by the sweep's `kind`; errors as `load_plan`'s."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise PlanError(f"file {p} does not exist; make one with `autopar plan ... -o {p}` "
                        f"or `autopar sweep ... -o {p}`") from None
    except OSError as e:
        raise PlanError(f"cannot read {p}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return Plan.from_json(text, source=f"plan file {p}")     # its message names the problem
    if isinstance(data, dict) and data.get("kind") == SWEEP_KIND:
        return SweepResult.from_data(data, source=f"sweep file {p}")
    return Plan.from_json(text, source=f"plan file {p}")


def load_plan_or_point(path: str | Path, point: Optional[str]) -> Plan:
    """The plan in a plan file, or point `point` (CLUSTER:NODES) of a sweep file: what
    `autopar show` and `autopar run` read."""
    obj = read_plan_or_sweep(path)
    if isinstance(obj, SweepResult):
        if point is None:
            raise PlanError(f"{path} is a sweep file; pick a point with --point CLUSTER:NODES "
                            f"(one of {', '.join(p.key for p in obj.points if p.plan is not None) or 'none'})")
        return obj.plan(point)
    if point is not None:
        raise PlanError(f"{path} is a plan file, not a sweep: --point applies to sweep files")
    return obj
