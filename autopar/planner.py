"""`autopar.plan`: from a model and a cluster to a Plan.

First version: data-parallel plans only (every device a replica; micro-batch size searched),
costed with the shared cost models. The inter-op DP and the intra-op ILP replace the search.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn

from autopar.capture import OpGraph, capture
from autopar.models import ModelBundle, build_model
from autopar.schema import (ClusterSpec, Constraints, ModelInfo, Plan, PlanError, Prediction,
                            StagePlan, StagePrediction)
from cost_models.communication import collective_time
from cost_models.compute import backward_factor, op_time

BYTES_PER_PARAM = {"bf16": 16, "fp16": 16, "fp32": 16}   # weights + grads + AdamW states
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def resolve_model(model: Any, example_inputs: Optional[Sequence[Any]], name: Optional[str]) -> ModelBundle:
    """A ModelBundle from a reference string, a bundle, or a module with example inputs."""
    if isinstance(model, ModelBundle):
        return model
    if isinstance(model, str):
        b = build_model(model)
        if example_inputs is not None:
            b.example_inputs = tuple(example_inputs)
        return b
    if isinstance(model, nn.Module):
        if example_inputs is None:
            raise PlanError("example_inputs are needed when passing a module: a tuple of tensors "
                            "whose dim 0 is the batch")
        return ModelBundle(name or type(model).__name__, model, tuple(example_inputs))
    raise PlanError(f"model must be an nn.Module or a model reference string, got {type(model).__name__}")


def resolve_cluster(cluster: ClusterSpec | str) -> ClusterSpec:
    return ClusterSpec.load(cluster) if isinstance(cluster, str) else cluster


def plan(model: Any, cluster: ClusterSpec | str, example_inputs: Optional[Sequence[Any]] = None, *,
         global_batch_size: int, dtype: str = "bf16", constraints: Optional[Constraints] = None,
         loss_fn: Optional[Callable[[Any], Any]] = None, progress: bool = False,
         name: Optional[str] = None) -> Plan:
    t0 = time.perf_counter()
    if dtype not in ACT_BYTES:
        raise PlanError(f"dtype {dtype!r} is not supported; use bf16, fp16 or fp32")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise PlanError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    cons = constraints or Constraints()
    bundle = resolve_model(model, example_inputs, name)
    spec = resolve_cluster(cluster)
    graph = capture(bundle.model, bundle.example_inputs, loss_fn=loss_fn, name=bundle.name)
    n = spec.num_devices
    for field, val in (("tp", cons.tp), ("pp", cons.pp)):
        if val not in (None, 1):
            raise PlanError(f"constraint {field}={val} cannot hold: this planner version emits "
                            f"data-parallel plans only (tp=1, pp=1)", constraint=field)
    if cons.dp not in (None, n):
        raise PlanError(f"constraint dp={cons.dp} cannot hold: dp x tp x pp must equal the "
                        f"{n} devices of the cluster", constraint="dp")
    if global_batch_size % n:
        raise PlanError(f"global batch {global_batch_size} does not divide over {n} data-parallel "
                        f"replicas; use a multiple of {n}", constraint="global_batch_size")
    local = global_batch_size // n
    sizes = [m for m in range(1, local + 1) if local % m == 0]
    if cons.microbatch_size is not None:
        sizes = [m for m in sizes if m == cons.microbatch_size]
    if cons.num_microbatches is not None:
        sizes = [m for m in sizes if local // m == cons.num_microbatches]
    if not sizes:
        raise PlanError(f"no micro-batch size satisfies microbatch_size={cons.microbatch_size}, "
                        f"num_microbatches={cons.num_microbatches} with {local} samples per replica",
                        constraint="microbatch_size")
    best = None
    least_mem = float("inf")
    for mb in sizes:
        cand = _dp_candidate(graph, spec, mb, local // mb, dtype)
        least_mem = min(least_mem, cand["peak"])
        if cand["peak"] <= spec.device.memory_bytes and (best is None or cand["time"] < best["time"]):
            best = cand
    if best is None:
        raise PlanError(f"no data-parallel plan fits: the least memory any needs is "
                        f"{least_mem / 2**30:.2f} GiB per device, the device has "
                        f"{spec.device.memory_bytes / 2**30:.2f} GiB", min_memory_bytes=least_mem)
    return _assemble(bundle, graph, spec, best, global_batch_size, dtype, time.perf_counter() - t0)


def _dp_candidate(graph: OpGraph, spec: ClusterSpec, mb: int, m: int, dtype: str) -> dict:
    g = graph.at_batch(mb)
    dev = spec.device
    fwd = sum(op_time(n.op, n.flops, n.bytes_moved * ACT_BYTES[dtype] / 4, dev, dtype) for n in g.calls)
    bwd = sum(backward_factor(n.op) * op_time(n.op, n.flops, n.bytes_moved * ACT_BYTES[dtype] / 4, dev, dtype)
              for n in g.calls)
    n = spec.num_devices
    grad_bytes = g.num_params * ACT_BYTES[dtype]
    link = spec.inter_node if spec.num_nodes > 1 and spec.inter_node else spec.intra_node
    sync = collective_time("all_reduce", grad_bytes, n, link.latency, 1 / link.bandwidth)
    opt = g.num_params * BYTES_PER_PARAM[dtype] / (dev.memory_bandwidth * dev.memory_efficiency)
    states = g.num_params * BYTES_PER_PARAM[dtype]
    acts = sum(o.numel for x in g.calls if x.flops > 0 for o in x.outputs) * ACT_BYTES[dtype]
    compute = m * (fwd + bwd) + opt
    return {"mb": mb, "m": m, "time": compute + sync, "compute": compute, "comm": sync,
            "peak": states + acts, "states": states, "acts": acts, "params": g.num_params,
            "flops_per_sample": 3 * g.forward_flops / mb}


def _assemble(bundle: ModelBundle, graph: OpGraph, spec: ClusterSpec, c: dict, gbs: int, dtype: str,
              search_s: float) -> Plan:
    n = spec.num_devices
    layers = graph.top_modules or graph.layers or [""]
    psz = c["params"] * ACT_BYTES[dtype]
    stage = StagePlan(
        index=0, devices=list(range(n)), mesh_shape=(n, 1), mesh_axis_names=("dp", "tp"), layers=layers,
        recompute="none", placements={fqn: ("R", "R") for fqn in graph.params},
        predicted=StagePrediction(compute_s=c["compute"], communication_s=c["comm"], bubble_s=0.0,
                                  weights_bytes=psz, gradients_bytes=psz,
                                  optimizer_bytes=c["states"] - 2 * psz, activations_bytes=c["acts"],
                                  peak_memory_bytes=c["peak"]))
    tokens = _tokens_per_sample(bundle)
    flops = c["flops_per_sample"] * gbs
    pred = Prediction(iteration_time_s=c["time"], samples_per_s=gbs / c["time"],
                      tokens_per_s=gbs * tokens / c["time"],
                      tflops_per_device=flops / c["time"] / n / 1e12, peak_memory_bytes=c["peak"],
                      collectives={"all_reduce": len(graph.params)} if n > 1 else {},
                      compute_s=c["compute"], communication_s=c["comm"], bubble_s=0.0)
    from autopar import __version__

    info = ModelInfo(name=bundle.name, num_params=graph.num_params, fingerprint=graph.fingerprint(),
                     num_layers=max(1, len(graph.layers)), flops_per_sample=c["flops_per_sample"],
                     tokens_per_sample=tokens)
    return Plan(autopar_version=__version__, model=info, cluster=spec, dtype=dtype,
                global_batch_size=gbs, microbatch_size=c["mb"], num_microbatches=c["m"],
                schedule="1f1b", virtual_stages=1, zero_stage=0, stages=[stage], predicted=pred,
                search={"search_time_s": round(search_s, 3), "candidates": 1})


def _tokens_per_sample(bundle: ModelBundle) -> int:
    x = bundle.example_inputs[0] if bundle.example_inputs else None
    if x is not None and hasattr(x, "dtype") and not x.dtype.is_floating_point and x.dim() >= 2:
        return int(x.shape[1])
    return 1
