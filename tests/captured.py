"""Plans of small models made the way a sweep makes them (`autopar.planner.ProviderCache`): each
model reference built and captured once for the whole test session, its per-layer costs
(intra-op ILP solutions) shared by every plan on a cluster of the same device and node size.
A plan made here equals one made from scratch (the planner's promise, `tests/test_sweep.py`;
compared field by field for every layout of `test_runtime_user_models` and
`test_runtime_selective` when this was written); the runtime tests that plan dozens of pinned
layouts of the same few models spend their time running them, not re-capturing them. The
one-process losses the layouts are compared with are kept too.

Under pytest (`tests/conftest.py` names the session's capture cache, AUTOPAR_CACHE_DIR, a
temporary directory both xdist workers share) the captures and the ILP's per-layer solutions
also go through autopar's disk caches (`capture.cache`, `inter_op.ilp_cache`), as `autopar plan`
keeps them: a model another test file captured and solved already is read back, not captured
and solved again (the caches' promise, a plan equal to one made without them, is
`tests/test_capture_cache.py`'s and `tests/test_ilp_cache.py`'s). Without AUTOPAR_CACHE_DIR
(a test module run as a script) nothing is cached on disk."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

import autopar
from autopar.capture import OpGraph, capture
from autopar.models import ModelBundle, build_model
from autopar.planner import ProviderCache, plan
from autopar.runtime import run
from autopar.schema import Plan

_CAPTURED: dict[str, tuple[ModelBundle, OpGraph]] = {}
_PROVIDERS = ProviderCache()
_LOSSES: dict[tuple[str, int], list[float]] = {}


def _cache() -> Any:
    """The session's capture cache directory (AUTOPAR_CACHE_DIR), or None: not the user's."""
    return os.environ.get("AUTOPAR_CACHE_DIR") or None


def cpu_cluster(n: int) -> autopar.ClusterSpec:
    """The bundled "cpu" profile with `n` processes on its one node."""
    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


def captured(ref: str) -> tuple[ModelBundle, OpGraph]:
    """(the model on meta, its OpGraph) for `ref`, made on first use."""
    if ref not in _CAPTURED:
        b = build_model(ref)
        _CAPTURED[ref] = (b, capture(b.model, b.example_inputs, name=b.name, cache=_cache()))
    return _CAPTURED[ref]


def shared_plan(ref: str, devices: int, *, global_batch_size: int = 8, dtype: str = "fp32",
                **kwargs: Any) -> Plan:
    """`autopar.plan(ref, cpu_cluster(devices), ...)` from the session's capture of `ref` and its
    shared per-layer costs; `kwargs` go to `plan` (constraints=, intra_op=)."""
    bundle, graph = captured(ref)
    return plan(bundle, cpu_cluster(devices), global_batch_size=global_batch_size, dtype=dtype, graph=graph,
                providers=_PROVIDERS, **{"cache": _cache(), **kwargs})


def planned(ref: str, cluster: autopar.ClusterSpec, **kwargs: Any) -> Plan:
    """`autopar.plan(ref, cluster, **kwargs)` from the session's capture of `ref` and its shared
    per-layer costs (`shared_plan` on any cluster: the same plan)."""
    bundle, graph = captured(ref)
    return plan(bundle, cluster, graph=graph, providers=_PROVIDERS, **{"cache": _cache(), **kwargs})


def one_process_losses(ref: str, steps: int) -> list[float]:
    """The losses of `steps` fp32 steps of `ref` on one process (the planner's plan for one CPU
    process, global batch 8, seed 0): what every layout of the model must reproduce."""
    if (ref, steps) not in _LOSSES:
        _LOSSES[ref, steps] = reference_losses(shared_plan(ref, 1), ref, steps)
    return _LOSSES[ref, steps]


@contextmanager
def untracked() -> Iterator[None]:
    """AUTOPAR_TRACK_MEMORY=0 inside: `autopar.runtime.run` in this process (one process) or in
    the processes it launches tracks no memory by category (a tracked step runs several times
    slower: a Python dispatch per op; `runtime.worker.memory_tracking_mode`). For the reference
    runs whose losses alone are compared; memory is the memory tests'."""
    old = os.environ.get("AUTOPAR_TRACK_MEMORY")
    os.environ["AUTOPAR_TRACK_MEMORY"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("AUTOPAR_TRACK_MEMORY", None)
        else:
            os.environ["AUTOPAR_TRACK_MEMORY"] = old


def reference_losses(p: Plan, ref: Any, steps: int, **kwargs: Any) -> list[float]:
    """The losses of `run(p, ref, steps=steps, seed=0, quiet=True, **kwargs)`, memory untracked."""
    with untracked():
        rows = run(p, ref, steps=steps, seed=0, quiet=True, **kwargs)
    return [r["loss"] for r in rows if "step" in r]
