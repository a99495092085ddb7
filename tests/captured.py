"""Plans of small models made the way a sweep makes them (`autopar.planner.ProviderCache`): each
model reference built and captured once for the whole test session, its per-layer costs
(intra-op ILP solutions) shared by every plan on a cluster of the same device and node size.
A plan made here equals one made from scratch (the planner's promise, `tests/test_sweep.py`;
compared field by field for every layout of `test_runtime_user_models` and
`test_runtime_selective` when this was written); the runtime tests that plan dozens of pinned
layouts of the same few models spend their time running them, not re-capturing them. The
one-process losses the layouts are compared with are kept too."""

from __future__ import annotations

from typing import Any

import autopar
from autopar.capture import OpGraph, capture
from autopar.models import ModelBundle, build_model
from autopar.planner import ProviderCache, plan
from autopar.runtime import run
from autopar.schema import Plan

_CAPTURED: dict[str, tuple[ModelBundle, OpGraph]] = {}
_PROVIDERS = ProviderCache()
_LOSSES: dict[tuple[str, int], list[float]] = {}


def cpu_cluster(n: int) -> autopar.ClusterSpec:
    """The bundled "cpu" profile with `n` processes on its one node."""
    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


def captured(ref: str) -> tuple[ModelBundle, OpGraph]:
    """(the model on meta, its OpGraph) for `ref`, made on first use."""
    if ref not in _CAPTURED:
        b = build_model(ref)
        _CAPTURED[ref] = (b, capture(b.model, b.example_inputs, name=b.name))
    return _CAPTURED[ref]


def shared_plan(ref: str, devices: int, *, global_batch_size: int = 8, dtype: str = "fp32",
                **kwargs: Any) -> Plan:
    """`autopar.plan(ref, cpu_cluster(devices), ...)` from the session's capture of `ref` and its
    shared per-layer costs; `kwargs` go to `plan` (constraints=, intra_op=)."""
    bundle, graph = captured(ref)
    return plan(bundle, cpu_cluster(devices), global_batch_size=global_batch_size, dtype=dtype, graph=graph,
                providers=_PROVIDERS, **kwargs)


def one_process_losses(ref: str, steps: int) -> list[float]:
    """The losses of `steps` fp32 steps of `ref` on one process (the planner's plan for one CPU
    process, global batch 8, seed 0): what every layout of the model must reproduce."""
    if (ref, steps) not in _LOSSES:
        p = shared_plan(ref, 1)
        _LOSSES[ref, steps] = [r["loss"] for r in run(p, ref, steps=steps, seed=0, quiet=True) if "step" in r]
    return _LOSSES[ref, steps]
