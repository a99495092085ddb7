"""`autopar plan --compare`: the chosen plan beside the baselines a person would try by hand —
pure data parallelism, ZeRO-3, and the best Megatron-style (t, p, d) grid point — all planned
and predicted under the same cost model, with the speed-up of the chosen plan over each."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from autopar.schema import ClusterSpec, Constraints, Plan, PlanError
from autopar.schema.plan import format_table


@dataclass
class Baseline:
    name: str
    plan: Optional[Plan]
    reason: str = ""          # why there is no plan (does not fit, constraint fails)

    @property
    def time(self) -> Optional[float]:
        return self.plan.predicted.iteration_time_s if self.plan else None


def megatron_grid(cluster: ClusterSpec, num_layers: int) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) points a person would try: tp a power of two inside a node, pp a power of two
    up to the layer count, dp the rest."""
    n = cluster.num_devices
    out = []
    tp = 1
    while tp <= cluster.devices_per_node and n % tp == 0:
        pp = 1
        while pp <= max(1, num_layers) and (n // tp) % pp == 0:
            out.append((tp, pp, n // (tp * pp)))
            pp *= 2
        tp *= 2
    return out


def baselines(chosen: Plan, plan_fn: Callable[[Constraints], Plan], cluster: ClusterSpec) -> list[Baseline]:
    """Plan each baseline with `plan_fn(constraints)`; failures are kept with their reason."""
    def attempt(name: str, cons: Constraints) -> Baseline:
        try:
            return Baseline(name, plan_fn(cons))
        except PlanError as e:
            return Baseline(name, None, str(e))

    out = [attempt("data parallel", Constraints(dp=cluster.num_devices, tp=1, pp=1, zero_stage=0)),
           attempt("ZeRO-3", Constraints(dp=cluster.num_devices, tp=1, pp=1, zero_stage=3))]
    best: Optional[Baseline] = None
    tried = 0
    for tp, pp, dp in megatron_grid(cluster, chosen.model.num_layers):
        b = attempt(f"Megatron t={tp} p={pp} d={dp}", Constraints(tp=tp, pp=pp, dp=dp))
        tried += 1
        if b.plan and (best is None or b.time < best.time):
            best = b
    out.append(best or Baseline("Megatron (t, p, d) grid", None, f"none of {tried} grid points fits"))
    return out


def compare_baselines(chosen: Plan, model: Any, cluster: ClusterSpec, *, as_json: bool = False,
                      plan_fn: Optional[Callable[[Constraints], Plan]] = None, graph: Any = None) -> str:
    """A table (or JSON) of the chosen plan and the baselines with speed-ups, the baselines planned
    for the chosen plan's software. `graph`: the model's OpGraph when the caller has it
    (otherwise captured here, once for all baselines)."""
    if plan_fn is None:
        from autopar.capture import capture
        from autopar.planner import ProviderCache, resolve_model
        from autopar.planner import plan as plan_with_graph

        bundle = resolve_model(model, None, None)
        if graph is None:
            graph = capture(bundle.model, bundle.example_inputs, name=bundle.name)
        # the baselines are plans of one graph on one cluster: their per-layer costs (intra-op
        # solutions) shared, as a sweep shares them; each plan equals one made from scratch
        # (`ProviderCache`). The quickstart notebook's baselines of gpt3-1.3b on 2 DGX A100: 26 -> 11 CPU s,
        # the same plans (field by field but the search statistics, session 36)
        providers = ProviderCache()

        def plan_fn(cons: Constraints) -> Plan:
            return plan_with_graph(bundle, cluster, global_batch_size=chosen.global_batch_size,
                                   dtype=chosen.dtype, constraints=cons, graph=graph, software=chosen.software,
                                   providers=providers)
    rows = [Baseline("autopar (chosen)", chosen)] + baselines(chosen, plan_fn, cluster)
    t0 = chosen.predicted.iteration_time_s
    if as_json:
        return json.dumps([{"name": b.name, "iteration_time_s": b.time,
                            "dp": b.plan.dp if b.plan else None, "tp": b.plan.tp if b.plan else None,
                            "pp": b.plan.pp if b.plan else None,
                            "zero_stage": b.plan.zero_stage if b.plan else None,
                            "speedup_of_chosen": (b.time / t0) if b.time else None,
                            "reason": b.reason or None} for b in rows], indent=2)
    table = []
    for b in rows:
        if b.plan:
            p = b.plan
            table.append([b.name, f"{p.dp}/{p.tp}/{p.pp}", str(p.zero_stage),
                          f"{p.microbatch_size}x{p.num_microbatches}",
                          f"{b.time:.4g}", f"{p.predicted.tflops_per_device:.4g}",
                          f"{p.predicted.peak_memory_bytes / 2**30:.1f}", f"{b.time / t0:.2f}x"])
        else:
            table.append([b.name, "-", "-", "-", "-", "-", "-", f"no plan: {b.reason[:70]}"])
    return ("\nbaselines under the same cost model (speed-up = baseline time / chosen time):\n" +
            format_table(["plan", "dp/tp/pp", "zero", "micro-batch", "s/iter", "TFLOP/s/dev", "GiB", "speed-up"],
                         table))
