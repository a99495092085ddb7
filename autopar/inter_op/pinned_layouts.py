"""Per-op layouts for plans of the analytic per-layer rules (issue 20, "one executor").

The analytic provider (`stage_cost.AnalyticProvider`) costs a tp layer by Megatron's rules and
solves no op: it gives each parameter a placement (column-parallel "S(0)", row-parallel "S(1)",
a vocabulary-parallel embedding) and nothing about the activations. `autopar run` executes tp
stages only op by op as solved (`autopar.intra_op.execute`), so at plan assembly the chosen
candidate's layers are solved by the intra-op ILP with every parameter pinned to the placement
the analytic rules gave it (`solve_graph`'s `fixed_params`), and the ops the rules run
vocabulary-parallel held to Megatron's strategies (`fixed_ops`,
`AnalyticProvider.vocab_parallel_ops`: the largest embedding's rows split and its output
all-reduced; a cross-entropy on vocabulary-split logits by three all-reduces of one value per
row). The ILP picks the other activations' layouts the pinned weights imply (Megatron's, where
the rules are Megatron's), and the plan carries them as `StagePlan.op_layouts` like any ILP
plan. Without the op pins the ILP gathered the table and the logits where the cluster's
collective latency made that cheaper (llama-tiny tp2 on the CPU profile: 9 all-reduces and 2
all-gathers a step against Megatron's 13 all-reduces), running another layout than the one
the rules priced.

What the plan predicts: its iteration time and memory stay the analytic provider's (the search
chose the candidate on them); its collectives are the solution's, which is what the executor
issues (`planner.assemble`). `plan.search["op_layouts"]` says so.

Where this cannot be done the plan carries no layouts, `plan.search["tp_executor"]` says why,
and `autopar run` refuses it (`runtime.validate`) naming the fix:

* OR-Tools missing: the ILP cannot solve (install it: `pip install ortools`);
* a capture by the torch.fx fallback (`capture.fx_fallback`): torch.export failed on the model,
  and the executor runs the model's exported program (this holds for the ILP's plans too:
  `planner._op_layouts` refuses any tp plan of such a capture, `NO_EXPORT`);
* a capture without a symbolic batch: the ILP cannot tell the batch dims (`NO_BATCH`).
The search still plans such models on every tp degree: a plan is also a prediction, and the
analytic rules predict tp as Megatron runs it.
"""

from __future__ import annotations

from typing import Any, Optional

from autopar.capture.graph import OpGraph
from autopar.inter_op.layers import Layer
from autopar.inter_op.stage_cost import AnalyticProvider, LayerCost

PINNED_NOTE = ("solved at assembly by the intra-op ILP with the analytic rules' parameter placements pinned; "
               "iteration time and memory are the analytic rules' prediction, the collectives the solution's")
NO_EXPORT = ("not executed: the model was captured by the torch.fx fallback (torch.export failed), so "
             "there is no exported program for `autopar run` to execute op by op; make torch.export "
             "succeed on the model (see the capture's warning) and re-plan")
NO_BATCH = ("not executed: the capture has no symbolic batch dimension, which the intra-op ILP needs to tell "
            "the batch dims from the model's (to keep the tp axis model-parallel, as the executor runs it); "
            "give the model inputs with a leading batch dimension and re-plan")
NO_ORTOOLS = ("not executed: the plan's tp stages need per-op layouts, which the intra-op ILP solves, and "
              "OR-Tools is not installed; pip install ortools and re-plan")


def pinned_gap(priced: dict[str, int], ran: dict[str, int]) -> str:
    """What `plan.search["op_layouts_gap"]` says where the collectives the analytic rules priced
    (`priced`, per step) differ from those the pinned solution runs (`ran`): the predicted
    iteration time prices the first, `predicted.collectives` counts the second."""
    def fmt(c: dict[str, int]) -> str:
        return ", ".join(f"{v} {k}" for k, v in sorted(c.items()) if v) or "none"
    return (f"the analytic rules priced {fmt(priced)} a step, the solved layouts run {fmt(ran)}: the "
            f"predicted iteration time does not price the difference (an op the rules do not shard as "
            f"Megatron's layout; intra_op='ilp' prices what it runs)")


def fx_captured(graph: OpGraph) -> bool:
    """Whether `graph` comes from the torch.fx fallback (torch.export failed on the model, so
    the executor, which exports it, cannot run it either)."""
    return (graph.capture_method or "").startswith("torch.fx")


def tp_unexecutable(graph: OpGraph) -> str:
    """Why no tp plan of `graph` can get per-op layouts, whatever the search chooses (`NO_EXPORT`,
    `NO_BATCH`, `NO_ORTOOLS`), or "": known before the search, so that a free search keeps tp at
    1 rather than return a plan `autopar run` refuses (`planner.plan`)."""
    if fx_captured(graph):
        return NO_EXPORT
    if not graph.is_symbolic:
        return NO_BATCH
    try:
        import ortools  # noqa: F401
    except ImportError:
        return NO_ORTOOLS
    return ""


def pinned_provider(graph: OpGraph, layers: list[Layer], analytic: AnalyticProvider,
                    pins: dict[int, dict[str, str]]) -> tuple[Optional[Any], str]:
    """(an ILP provider solving `layers` with each parameter pinned per tp degree as `pins`
    says ({tp: {fqn: placement}}), "") or (None, why not: `NO_BATCH`, `NO_ORTOOLS`)."""
    if not graph.is_symbolic:
        return None, NO_BATCH
    try:
        from autopar.inter_op.ilp_provider import IlpProvider
    except ImportError:
        return None, NO_ORTOOLS

    class PinnedIlpProvider(IlpProvider):
        """The ILP provider with every parameter pinned (`_pins`), solving for the layouts
        alone: its costs are the analytic ones (the plan's prediction), its `solutions` the
        per-op layouts."""

        name = "analytic+pinned-ilp"

        def _pins(self, layer: Layer, mb: int, tp: int) -> dict[str, tuple[str]]:
            at = pins.get(tp, {})
            return {f: (at[f],) for f in set(layer.params) if f in at}

        def _fixed_ops(self, layer: Layer, mb: int, tp: int) -> dict[str, str]:
            # the ops the analytic rules run vocabulary-parallel, and price so, run so (and the
            # expert blocks' ops replicated, `IlpProvider._expert_ops`)
            out = super()._fixed_ops(layer, mb, tp)
            for n, kind in self.vocab_parallel_ops(layer, mb, tp).items():
                if kind == "embedding":
                    out[n] = "v@0"
                elif self.graph.node(n).op == "cross_entropy_loss":
                    out[n] = "c@0 (vocab-parallel)"
            return out

        def _analyze_layer(self, layer: Layer, mb: int, tp: int) -> LayerCost:
            base = AnalyticProvider._analyze(self, layer, mb, tp)
            if tp > 1:
                # solved here (not caught): a pin the ILP cannot hold is the planner's error
                self.solutions[(layer.signature, mb, tp)] = (self._solve(layer, mb, tp), layer)
            return base

    try:
        prov = PinnedIlpProvider(graph, layers, analytic.cluster, analytic.dtype, software=analytic.software)
    except ImportError:
        return None, NO_ORTOOLS
    return prov, ""


def analytic_pins(layers: list[Layer], spans: list[tuple[int, int, int]], costs_of) -> dict[int, dict[str, str]]:
    """{tp: {fqn: the analytic placement}} of the parameters of `spans` ((first layer, end
    layer, tp), tp > 1), read off each span's per-layer costs (`costs_of(span index)[i]`), the
    first layer naming a parameter deciding it (as `planner._placements` records it)."""
    out: dict[int, dict[str, str]] = {}
    for x, (k, j, tp) in enumerate(spans):
        if tp <= 1:
            continue
        costs = costs_of(x)
        at = out.setdefault(tp, {})
        for i in range(k, j):
            for f, pl in costs[i].placements.items():
                at.setdefault(f, pl)
    return out
