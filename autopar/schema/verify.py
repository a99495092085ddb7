"""What `autopar verify` reports: every distinct kind of rank of a plan built and stepped at the
plan's full world size on a fake process group and fake tensors (`autopar.runtime.verify`).

Per rank kind: its parameter shards against the plan's placements, the collectives it issued
(by phase of the step), its tracked peak memory against the plan's prediction for its stage and
the device's capacity. For the whole plan: the collectives of one step combined over the stages'
representative ranks (the convention of `autopar.runtime.counting`) against
`plan.predicted.collectives`. `VerifyReport.failures` holds one line per problem; the CLI exits
non-zero when there is any.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from autopar.schema.plan import format_bytes, format_table


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardMismatch(_Model):
    """A parameter whose built local shard differs from the plan's placements (or that one side
    lacks: `expected` or `built` is None)."""

    name: str
    expected: Optional[list[int]] = None
    built: Optional[list[int]] = None


class RankCheck(_Model):
    """One kind of rank: the rank built (`rank`) stands for `ranks_of_kind` ranks whose shards,
    stages and schedule are the same."""

    rank: int
    stages: list[int] = Field(description="the plan stages (chunks) the rank runs")
    coordinate: dict[str, int] = Field(default_factory=dict, description="mesh coordinate per axis name")
    ranks_of_kind: int = Field(ge=1)
    representative: bool = Field(description="the rank at coordinate 0 of its device set: its "
                                 "collectives count in the plan's total")
    error: Optional[str] = Field(default=None, description="why the rank failed to build or step")
    params_checked: int = 0
    shard_mismatches: list[ShardMismatch] = Field(default_factory=list)
    collectives: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="phase -> kind -> count this rank issued in the step (receives "
        "as send_recv; sends not counted)")
    tp_predicted: Optional[dict[str, int]] = Field(
        default=None, description="the solved layouts' collectives of the rank's chunks over the step "
        "(op_layouts forward + backward + recompute, per micro-batch, times the micro-batches)")
    tp_measured: Optional[dict[str, int]] = Field(
        default=None, description="the collectives of the forward_backward phase on the tp group")
    tracked_peak_bytes: int = 0
    tracked_peak_phase: str = ""
    tracked_categories: dict[str, int] = Field(default_factory=dict)
    tracked_phases: dict[str, int] = Field(default_factory=dict, description="peak bytes per phase")
    predicted_peak_bytes: Optional[float] = None
    predicted_categories: dict[str, float] = Field(default_factory=dict)
    predicted_stage: Optional[int] = None
    memory_error: Optional[float] = Field(default=None, description="(predicted - tracked) / tracked")
    peak_tensors: list[dict] = Field(default_factory=list, description="the largest storages at the peak")
    microbatches_stepped: int = Field(default=0, description="micro-batches each verified step ran: fewer than "
                                      "the plan's when a shorter step passes through the same schedule states "
                                      "(`autopar.runtime.short_step`); memory and collectives are the plan's")
    notes: list[str] = Field(default_factory=list)
    time_s: float = 0.0
    cpu_s: float = Field(default=0.0, description="CPU seconds of the process building and stepping the kind "
                         "(its wall time less what other processes took from it)")


class VerifyReport(_Model):
    """The result of `autopar.verify(plan, model)`."""

    model: str
    world_size: int
    device: str
    capacity_bytes: float = Field(description="device memory the tracked peaks are checked against")
    usable_bytes: float = Field(default=0, description="the plan's usable memory per device (capacity less "
                                "the headroom the planner keeps); 0 when unknown")
    microbatches: int = Field(default=0, description="the plan's micro-batches per step")
    ranks: list[RankCheck] = Field(default_factory=list)
    collectives_measured: Optional[dict[str, int]] = None
    collectives_predicted: dict[str, int] = Field(default_factory=dict)
    collectives_match: Optional[bool] = Field(default=None, description="None when not every device set's "
                                              "representative rank was verified")
    failures: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    time_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """A table of the rank kinds, then the collectives and the failures (what the CLI prints)."""
        cols = ["rank", "stages", "coordinate", "ranks", "shards", "tracked peak", "phase", "predicted",
                "error", "time s"]
        rows = []
        for r in self.ranks:
            coord = ",".join(f"{k}{v}" for k, v in r.coordinate.items())
            shards = "FAILED" if r.error else (
                "ok" if not r.shard_mismatches else f"{len(r.shard_mismatches)} differ")
            rows.append([str(r.rank), ",".join(map(str, r.stages)), coord, str(r.ranks_of_kind),
                         f"{shards} ({r.params_checked})",
                         format_bytes(r.tracked_peak_bytes) if not r.error else "-",
                         r.tracked_peak_phase or "-",
                         format_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes is not None else "-",
                         f"{r.memory_error:+.1%}" if r.memory_error is not None else "-", f"{r.time_s:.1f}"])
        head = (f"autopar verify: {self.model} on {self.world_size} ranks of {self.device} "
                f"({format_bytes(self.capacity_bytes)}), {len(self.ranks)} rank kinds built at full scale "
                f"on a fake process group in {self.time_s:.1f} s")
        stepped = sorted({r.microbatches_stepped for r in self.ranks if r.microbatches_stepped})
        if stepped and stepped != [self.microbatches]:
            head += (f"; each step ran {'/'.join(map(str, stepped))} of the plan's {self.microbatches} micro-batches "
                     f"(the same schedule states, so the same peak; the batch and the forward/backward "
                     f"collectives scaled to {self.microbatches}; --all-microbatches runs them all)")
        lines = [head, format_table(cols, rows)]
        if self.collectives_measured is not None:
            meas = ", ".join(f"{k}={v}" for k, v in sorted(self.collectives_measured.items())) or "none"
            pred = ", ".join(f"{k}={v}" for k, v in sorted(self.collectives_predicted.items())) or "none"
            lines.append(f"collectives per step: {meas} (plan: {pred}) "
                         f"{'match' if self.collectives_match else 'DIFFER'}")
        else:
            lines.append("collectives per step: not combined (not every stage's representative rank was built)")
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"FAIL: {f}" for f in self.failures]
        lines.append("ok" if self.ok else f"{len(self.failures)} failure{'s' if len(self.failures) > 1 else ''}")
        return "\n".join(lines)
