"""autopar: automatic parallelism planning and execution for PyTorch.

    cluster = autopar.ClusterSpec.load("dgx-a100-80g", num_nodes=4)
    plan = autopar.plan(model, cluster, example_inputs=(tokens, targets), global_batch_size=512)
    print(plan.summary()); plan.save("plan.json")

Two levels, as in Alpa: an ILP shards every op of a stage over a logical mesh (`auto_shard`),
a dynamic program slices the model into pipeline stages over sub-meshes (`plan`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from autopar.capture import OpGraph, capture
from autopar.schema import (
    ClusterSpec,
    Constraints,
    DeviceSpec,
    LinkSpec,
    LogicalMesh,
    Plan,
    PlanError,
    Prediction,
    SoftwareSpec,
    StagePlan,
    load_plan,
)
from autopar.schema.cluster import bundled_clusters
from autopar.schema.software import bundled_software
from autopar.schema.sweep import SweepPoint, SweepResult

__version__ = "0.1.0"

__all__ = ["ClusterSpec", "Constraints", "DeviceSpec", "LinkSpec", "LogicalMesh", "Plan",
           "PlanError", "Prediction", "StagePlan", "load_plan", "plan", "verify", "auto_shard", "capture",
           "OpGraph", "bundled_clusters", "SoftwareSpec", "bundled_software", "sweep", "SweepResult", "SweepPoint",
           "__version__"]


def plan(model: Any, cluster: ClusterSpec | str, example_inputs: Sequence[Any] | None = None, *,
         global_batch_size: int, dtype: str = "bf16", constraints: Optional[Constraints] = None,
         loss_fn: Optional[Callable[[Any], Any]] = None, progress: bool = False,
         name: Optional[str] = None, cache: Any = None, software: SoftwareSpec | str | None = None) -> Plan:
    """The fastest plan for training `model` on `cluster` that fits in memory.

    `model` is an nn.Module (on any device, meta included) or a model reference (zoo name,
    MODULE:FACTORY, hf:NAME); dim 0 of every example input is the batch. Raises PlanError when no
    plan fits or a constraint cannot hold. `cache=True` keeps the model's capture in the capture
    cache (`autopar.capture.cache`; the CLI's default) and reads it from there next time.
    `software`: what the training software does on the cluster's hardware (attention kernel,
    overlap of the gradient sync): a bundled preset's name (`bundled_software()`), a YAML/JSON
    file or a `SoftwareSpec`; None: "autopar", what `autopar run` executes. The plan records it
    (`plan.software`).
    """
    from autopar.planner import plan as _plan

    return _plan(model, cluster, example_inputs, global_batch_size=global_batch_size, dtype=dtype,
                 constraints=constraints, loss_fn=loss_fn, progress=progress, name=name, cache=cache,
                 software=software)


def verify(plan: Any, model: Any, *, device_memory_bytes: Optional[float] = None,
           ranks: Optional[Sequence[int]] = None, top: int = 0, jobs: Optional[int] = None,
           progress: bool = False) -> Any:
    """Build every distinct kind of rank of `plan` (a Plan or a plan file) at its full world size
    on a fake process group and fake tensors, exactly as `autopar run` builds it, and run one
    training step: returns a `VerifyReport` (shards against the placements, collectives against
    the plan's, tracked peak memory against the prediction and the device; `report.failures`).
    `model`: a model reference, a ModelBundle or a factory (`autopar.runtime.verify.verify`)."""
    from autopar.runtime.verify import verify as _verify

    return _verify(plan, model, device_memory_bytes=device_memory_bytes, ranks=ranks, top=top, jobs=jobs,
                   progress=progress)


def auto_shard(model: Any, example_inputs: Sequence[Any], *, mesh: LogicalMesh,
               memory_budget_bytes: Optional[float] = None,
               loss_fn: Optional[Callable[[Any], Any]] = None, dtype: str = "fp32") -> Any:
    """Intra-op only: shard every op of `model` over one logical mesh (Alpa §4 ILP).
    Returns a ShardingSolution (param_placements, collectives, objective, per-op choices)."""
    from autopar.intra_op import auto_shard as _auto_shard

    return _auto_shard(model, example_inputs, mesh=mesh, memory_budget_bytes=memory_budget_bytes,
                       loss_fn=loss_fn, dtype=dtype)


def sweep(model: Any, clusters: Sequence[Any], nodes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), *,
          tokens: float, **kw: Any) -> SweepResult:
    """Capacity planning: the best plan of `model` on every cluster type of `clusters` at every
    node count of `nodes`, with the time and GPU-hours (and, given `prices`, the cost) to train
    `tokens` tokens; `.points` holds one record per size (its plan, or the `reason` none fits),
    `.records()` them as `autopar sweep --json` prints them. Keywords: see
    `autopar.capacity.sweep` (seq_len, global_batch_size or tokens_per_step, prices, deadline_s,
    dtype, example_inputs, cache, progress)."""
    from autopar.capacity import sweep as _sweep

    return _sweep(model, clusters, nodes, tokens=tokens, **kw)
