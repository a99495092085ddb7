"""`autopar.plan`: from a model and a cluster to a Plan.

capture (OpGraph) -> layers (`inter_op.layers`) -> per-layer costs on tensor-parallel meshes
(`inter_op.stage_cost`: analytic Megatron rules, or the intra-op ILP) -> the joint search
(`inter_op.search`: Alpa's stage DP inside a loop over dp/tp/pp, micro-batching, schedule,
recomputation and ZeRO) -> a Plan with per-stage devices, meshes, layers, placements and the
predicted time, memory and collectives.

FLOP/s per device count the recomputed forward (Megatron's convention: the 96-factor formula for
full recomputation counts 4 passes over the transformer layers, 3 over the logits).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn

from autopar.capture import OpGraph, capture
from autopar.capture.cache import cache_directory
from autopar.capture.experts import tp_split
from autopar.inter_op import context_parallel
from autopar.inter_op.experts import ExpertCosting
from autopar.inter_op.layers import Layer, build_layers
from autopar.inter_op.pinned_layouts import (
    NO_EXPORT,
    PINNED_NOTE,
    analytic_pins,
    fx_captured,
    pinned_gap,
    pinned_provider,
    tp_unexecutable,
)
from autopar.inter_op.search import Candidate, Search, SearchResult, is_scalar, op_by_op
from autopar.inter_op.stage_cost import AnalyticProvider
from autopar.inter_op.stage_layouts import chunk_layouts
from autopar.models import ModelBundle, build_model
from autopar.schema import ClusterSpec, Constraints, ModelInfo, Plan, PlanError, Prediction, StagePlan, StagePrediction
from autopar.schema.constraints import SPLIT_SLOTS
from autopar.schema.experts import ExpertBlockPlan, ExpertParallelism
from autopar.schema.layouts import StageLayouts
from autopar.schema.mesh_axes import stage_mesh
from autopar.schema.plan import TRAINING_DTYPES, PhasePrediction
from autopar.schema.software import SoftwareSpec, software_for_cluster
from cost_models.memory import usable_memory
from cost_models.schedules import moments_directory


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


def make_provider(kind: str, graph: OpGraph, layers: list[Layer], cluster: ClusterSpec, dtype: str,
                  cache_dir: Optional[Path] = None, software: Optional[SoftwareSpec] = None,
                  sequence_parallel: bool = False):
    """The per-layer cost provider: "analytic" (Megatron rules read off the graph), "ilp" (the
    intra-op ILP per layer signature x micro-batch x tp, its tp axis kept model-parallel as the
    runtime runs it: no batch or token splits there), or "auto": the ILP where OR-Tools is
    installed and the capture has a symbolic batch, the analytic rules otherwise. `cache_dir`:
    the ILP's per-layer solutions kept there (`inter_op.ilp_cache`). `software`: what the
    training software does (`SoftwareSpec`; None: the default, what `autopar run` executes).
    `sequence_parallel`: Megatron-SP on the tp axis, which only the ILP solves (PlanError
    otherwise)."""
    if sequence_parallel:
        if kind == "analytic":
            raise PlanError("sequence_parallel needs the intra-op ILP (intra_op='ilp' or 'auto'), not the "
                            "analytic rules")
        try:
            from autopar.inter_op.ilp_provider import IlpProvider
        except ImportError:
            raise PlanError("sequence_parallel needs the intra-op ILP, which needs OR-Tools "
                            "(pip install ortools)") from None
        if not graph.is_symbolic:
            raise PlanError("sequence_parallel needs a capture with a symbolic batch (torch.export), "
                            "to tell the token dims from the batch")
        return IlpProvider(graph, layers, cluster, dtype, cache_dir=cache_dir, sequence_parallel=True,
                           software=software)
    if kind == "analytic":
        return AnalyticProvider(graph, layers, cluster, dtype, software)
    if kind in ("ilp", "auto"):
        try:
            from autopar.inter_op.ilp_provider import IlpProvider
        except ImportError:
            if kind == "ilp":
                raise PlanError("the intra-op ILP is not available in this installation") from None
            return AnalyticProvider(graph, layers, cluster, dtype, software)
        if kind == "auto" and not graph.is_symbolic:
            # without a symbolic batch (the fx fallback) the ILP cannot tell the batch dims, so
            # it could not keep the tp axis model-parallel as the runtime runs it
            return AnalyticProvider(graph, layers, cluster, dtype, software)
        return IlpProvider(graph, layers, cluster, dtype, cache_dir=cache_dir, software=software)
    raise PlanError(f"unknown intra-op provider {kind!r}; one of auto, ilp, analytic")


class ProviderCache:
    """Per-layer cost providers (and the layers they cost) shared by several plans of one
    model: `autopar.sweep` plans it on many sizes of one cluster type. A provider's per-layer
    costs (analytic rules or intra-op ILP solutions, keyed by layer signature, micro-batch and
    tp) depend on the device, the node's size and link, the dtype and the software, not on the node count:
    the tp axis stays inside a node (`Search.meshes`), so its mesh is the first tp ranks of
    node 0 on any number of nodes. The key holds exactly those, so a plan made through the cache
    equals one made without it (the graph by identity: the cache holds it, through its provider)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[list[Layer], Any]] = {}

    @staticmethod
    def key(kind: str, graph: OpGraph, spec: ClusterSpec, dtype: str, cache_dir: Optional[Path] = None,
            software: Optional[SoftwareSpec] = None, sequence_parallel: bool = False,
            account: tuple[str, ...] = ()) -> tuple:
        # the whole profile but its node count (measured collective tables included), the
        # software, where the provider keeps its solutions on disk, and the layer slots
        return (kind, dtype, id(graph), spec.model_copy(update={"num_nodes": 1}).model_dump_json(),
                software.model_dump_json() if software is not None else None,
                str(cache_dir) if cache_dir is not None else None, bool(sequence_parallel), tuple(account))

    def get(self, kind: str, graph: OpGraph, model: nn.Module, spec: ClusterSpec, dtype: str,
            cache_dir: Optional[Path] = None, software: Optional[SoftwareSpec] = None,
            sequence_parallel: bool = False, layers: Optional[list[Layer]] = None,
            account: tuple[str, ...] = (), strict: bool = False) -> tuple[list[Layer], Any]:
        """(layers, provider) for planning `graph` on `spec` with `software`: made once per key
        (`layers`: those to cost, when the caller has them already; `account`: the layer slots
        of `split_slots`)."""
        k = self.key(kind, graph, spec, dtype, cache_dir, software, sequence_parallel, account) + (strict,)
        if k not in self._entries:
            layers = layers if layers is not None else build_layers(graph, model, account=account, strict=strict)
            self._entries[k] = (layers, make_provider(kind, graph, layers, spec, dtype, cache_dir, software,
                                                      sequence_parallel))
        return self._entries[k]

    def __len__(self) -> int:
        return len(self._entries)


def plan(model: Any, cluster: ClusterSpec | str, example_inputs: Optional[Sequence[Any]] = None, *,
         global_batch_size: int, dtype: str = "bf16", constraints: Optional[Constraints] = None,
         loss_fn: Optional[Callable[[Any], Any]] = None, progress: bool = False,
         name: Optional[str] = None, intra_op: str = "auto", graph: Optional[OpGraph] = None,
         cache: Any = None, providers: Optional[ProviderCache] = None,
         software: SoftwareSpec | str | None = None) -> Plan:
    """The fastest plan that fits (see the module docstring), for `software`: what the training
    software does on the cluster (`SoftwareSpec`, a bundled preset's name or a YAML/JSON file;
    None: `autopar`, what `autopar run` executes), recorded in the plan. `graph` skips the capture when
    the caller already has the model's OpGraph; `cache` (True, a directory or a
    `capture.cache.CaptureCache`) reads and writes captures there, and the search's schedule
    walks (`cost_models.schedules.moments_directory`); `providers` shares the per-layer costs
    (intra-op solutions) with other plans of the same graph on clusters of the same device
    and node (`ProviderCache`: a sweep over node counts)."""
    if dtype not in TRAINING_DTYPES:
        raise PlanError(f"dtype {dtype!r} is not supported; use bf16, fp16 or fp32")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise PlanError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    cons = constraints or Constraints()
    bundle = resolve_model(model, example_inputs, name)
    spec = resolve_cluster(cluster)
    sw = software_for_cluster(software, spec)
    spec = sw.on_cluster(spec)     # the software's own attention kernel rates on this device, if any
    if graph is None:
        graph = capture(bundle.model, bundle.example_inputs, loss_fn=loss_fn, name=bundle.name, cache=cache)
    graph = sw.on_graph(graph)     # the software's fused kernels (a fused cross-entropy), if any
    no_tp = tp_unexecutable(graph) if cons.tp is None else ""
    if no_tp:
        # no tp plan of this capture can run (`autopar run` executes tp only op by op as
        # solved): a free search keeps tp at 1; a pinned tp still plans, and says why it is refused
        cons = cons.model_copy(update={"tp": 1})
    t1 = time.perf_counter()
    cache_dir = cache_directory(cache)
    account, why_slots = split_slots(cons, graph)
    if providers is not None:
        layers, provider = providers.get(intra_op, graph, bundle.model, spec, dtype, cache_dir, sw,
                                         bool(cons.sequence_parallel), account=account,
                                         strict=cons.account_in_split is not None)
    else:
        layers = build_layers(graph, bundle.model, account=account, strict=cons.account_in_split is not None)
        provider = make_provider(intra_op, graph, layers, spec, dtype, cache_dir, sw, bool(cons.sequence_parallel))
    moments_directory(cache_dir)     # the schedule walks kept beside the captures
    sp_provider = None
    if cons.sequence_parallel is None and getattr(provider, "sequence_parallel", None) is False:
        # an ILP provider without SP: the search weighs Megatron-SP too, wherever tp > 1 (the
        # same layers, costed with it); the analytic rules have no SP
        sp_provider = (providers.get(intra_op, graph, bundle.model, spec, dtype, cache_dir, sw, True, layers,
                                     account)[1]
                       if providers is not None else
                       make_provider(intra_op, graph, layers, spec, dtype, cache_dir, sw, sequence_parallel=True))
    res = Search(graph, layers, spec, global_batch_size, dtype, cons, provider, progress,
                 sp_provider=sp_provider).run()
    p = assemble(bundle, graph, spec, res, global_batch_size, dtype, time.perf_counter() - t1)
    if why_slots:
        p.search["account_in_split"] = why_slots
    if no_tp:
        p.search["tp_free"] = "kept at 1 by the search: every tp plan would be " + no_tp
    if (sw.tp_comm_overlap and p.sequence_parallel and spec.device.sm_count is None
            and any(c.num_sm > 0 and (c.set_sm_margin or c.method == "bulk") for c in sw.tp_comm_overlap.values())):
        p.search["tp_comm_overlap"] = (f"the SMs {sw.name}'s tp overlaps take from the GEMMs are not priced: "
                                       f"{spec.device.name} has no sm_count in its profile")
    return p


def _chunk_share(st: Any, chunk: tuple[int, int]) -> float:
    """The share of device group `st`'s per-micro-batch time (a `StageResult`) that its chunk
    `chunk` (a layer range) takes: the chunk's layers' time, recomputation and boundary transfers
    (`StageResult.t_mb`'s per-chunk terms) over its chunks' sum; equal shares where those are
    all 0."""
    if len(st.chunks) == 1:
        return 1.0
    tb, r = st.tables, st.recompute
    p2p = dict(zip(st.chunks, st.chunk_p2p))

    def t(c: tuple[int, int]) -> float:
        k, j = c
        return max(0.0, float(tb.base[j] - tb.base[k] + tb.rc[r][j] - tb.rc[r][k] + p2p.get(c, 0.0)))

    total = sum(t(c) for c in st.chunks)
    return t(chunk) / total if total > 0 else 1.0 / len(st.chunks)


def split_slots(cons: Constraints, graph: OpGraph) -> tuple[tuple[str, ...], str]:
    """The layer slots of `Constraints.account_in_split` the search cuts chunks over, and, where
    the planner chose them, why (for `plan.search`): as pinned; else both ("embedding",
    "loss") where the pinned pp x virtual_stages chunks exceed the model's repeated blocks
    (each joined to the first or last block would leave fewer layers than chunks: Megatron's
    Qwen3-235B PP32 VPP3 over 94 blocks + 2 = 96), else none (a free search keeps them
    joined: trying both would double the search)."""
    if cons.account_in_split is not None:
        return tuple(cons.account_in_split), ""
    pp = cons.pp or (len(cons.stage_tp) if cons.stage_tp else None)
    chunks = (pp or 1) * (cons.virtual_stages or 1)
    if pp and graph.layers and chunks > len(graph.layers):
        return SPLIT_SLOTS, (f"the embedding and the loss each a layer slot of its own (where the model has a "
                             f"module for it): pp x virtual_stages = {chunks} chunks over "
                             f"{len(graph.layers)} repeated blocks")
    return (), ""


# -- the Plan ----------------------------------------------------------------------------------

def _recompute_modules(layers: list[Layer], k: int, j: int, recompute: str) -> Optional[list[str]]:
    """The modules the runtime checkpoints for layers [k, j) under `recompute`
    (`Layer.recompute_modules`, found from the captured ops); None without recomputation."""
    if recompute == "none":
        return None
    if recompute == "norm_act":
        return [r.module for i in range(k, j) for r in layers[i].discard_regions if r.kind == "norm"]
    return [layers[i].recompute_modules[recompute] for i in range(k, j) if recompute in layers[i].recompute_modules]


def _recompute_acts(layers: list[Layer], k: int, j: int, recompute: str) -> Optional[list[str]]:
    """Under "norm_act" the experts modules of layers [k, j) whose activations it recomputes
    (`Layer.discard_regions`), each once; None under the other policies."""
    if recompute != "norm_act":
        return None
    return list(dict.fromkeys(r.module for i in range(k, j) for r in layers[i].discard_regions if r.kind == "act"))


def _recompute_ops(layers: list[Layer], k: int, j: int, recompute: str) -> Optional[list[str]]:
    """The capture's ops selective recomputation re-runs in layers [k, j) (`Layer.selective_ops`:
    each attention core's run of ops); None under any other policy."""
    if recompute != "selective":
        return None
    return [n for i in range(k, j) for n in layers[i].selective_ops]


def _module_cut_ops(ops: Optional[list[str]], module_cut: bool, pos: int, tp: int,
                    fallback: list[tuple[int, int]]) -> Optional[list[str]]:
    """A stage's `recompute_ops` as the runtime can run them: a stage run module by module
    recomputes an attention core alone only where it is one call (`runtime.selective`); else
    None (its `recompute_modules` checkpointed whole) and (`pos`, its tp degree `tp`) joins
    `fallback`."""
    from autopar.runtime.selective import runs_as_one_call

    if ops and module_cut and not runs_as_one_call(ops):
        fallback.append((pos, tp))
        return None
    return ops


def _selective_fallback(stages: list[tuple[int, int]]) -> str:
    """The plan's note on stages whose selective recomputation checkpoints whole modules
    ((index, tp degree) each): costed so without tp (`Layer.selective_region`); a tp stage was
    costed as run op by op, which its layouts could not be stitched for."""
    idx = [str(i) for i, _ in stages]
    off = [str(i) for i, tp in stages if tp > 1]
    return (f"stage{'s' if len(idx) > 1 else ''} {', '.join(idx)}: run module by module, with attention cores "
            f"of several calls, which a module's forward cannot cut out: the modules holding them are "
            f"checkpointed whole" + (f" (stage{'s' if len(off) > 1 else ''} {', '.join(off)} costed as the cores "
                                     f"alone: more memory and less time predicted than the run's)" if off
                                     else " (and costed so)"))


def _stage_modules(layers: list[Layer], k: int, j: int) -> list[str]:
    out: list[str] = []
    for l in layers[k:j]:
        for m in l.modules:
            if m and m not in out:
                out.append(m)
    return out or [layers[k].name or "model"]


def _placements(graph: OpGraph, layers: list[Layer], costs, k: int, j: int, modules: list[str],
                zero3: bool) -> dict[str, tuple[str, str]]:
    """{parameter: (dp placement, tp placement)} of the stage of layers k..j. ZeRO-3 shards
    every parameter on the dp axis ("S(0)") but the 0-D ones (`is_scalar`: nothing to split;
    FSDP leaves them out, `runtime.zero`), which stay replicated ("R")."""
    def dp_pl(fqn: str) -> str:
        return "S(0)" if zero3 and not is_scalar(graph, fqn) else "R"

    out: dict[str, tuple[str, str]] = {}
    for i in range(k, j):
        for fqn, pl in costs[i].placements.items():
            out.setdefault(fqn, (dp_pl(fqn), pl))
    # tied aliases and parameters under the stage's modules that no op reads
    under = lambda f: any(f == m or f.startswith(m + ".") for m in modules)  # noqa: E731
    for fqn, info in graph.params.items():
        if fqn in out:
            for alias in info.tied:
                if under(alias):
                    out.setdefault(alias, out[fqn])
        elif under(fqn) and not any(fqn in p.params for p in layers):
            out[fqn] = (dp_pl(fqn), "R")
    return out


def _with_cp(placements: dict[str, tuple[str, str]], cp: int) -> dict[str, tuple[str, ...]]:
    """`placements` (dp, tp) with the cp axis's between them where cp > 1 (`schema.mesh_axes.
    stage_mesh`): as on the dp axis (every cp rank holds the parameters, or under ZeRO-3 its
    shard of them over dp x cp)."""
    if cp <= 1:
        return placements
    return {f: (pl[0], pl[0], pl[1]) for f, pl in placements.items()}


def _extra_flops(graph1: OpGraph, layer: Layer, recompute: str, tp: int) -> float:
    """Forward FLOPs re-run per sample by `recompute` in `layer` on a stage of tp degree `tp`
    (graph at batch 1; `Layer.recomputed_ops`)."""
    return sum(graph1.node(n).flops for n in layer.recomputed_ops(recompute, tp))


def assemble(bundle: ModelBundle, graph: OpGraph, spec: ClusterSpec, res: SearchResult, gbs: int,
             dtype: str, search_s: float) -> Plan:
    """The Plan of the search's best candidate. Every tp chunk carries its solved per-op
    layouts (`_op_layouts`), so `predicted.collectives` is what the executor issues: the
    solution's; a tp plan `autopar run` refuses (`plan.search["tp_executor"]`) counts the
    provider's per-layer collectives."""
    t_assemble = time.perf_counter()
    c: Candidate = res.best
    layers = res.layers
    tb = c.costs
    p, v, m = c.pp, c.v, c.m
    g1 = graph.at_batch(1) if graph.batch_size is None else graph
    fwd1 = g1.forward_flops / (graph.batch_size or 1)
    # stages: device group d holds chunks d, d + p, ... ; listed in model order
    chunks = []   # (model position, group, virtual chunk, (k, j))
    for d, st in enumerate(c.stages):
        for vc, (k, j) in enumerate(st.chunks):
            chunks.append((k, d, vc, (k, j)))
    chunks.sort()
    # the chunks the runtime executes op by op as solved (their collectives are the solution's),
    # per chunk position
    layouts, why_not = _op_layouts(graph, c, layers, chunks, res.provider)
    if getattr(res.provider, "sequence_parallel", False) and c.tp > 1 and why_not:
        raise PlanError(f"sequence parallelism runs only where the executor runs the solved layouts, and "
                        f"here it cannot: {why_not}; drop sequence_parallel or the constraint that forces this")
    units_left: list[str] = []     # ZeRO-3 units left to the root (`contiguous_units`)
    rc_fallback: list[tuple[int, int]] = []
    stage_plans = []
    zunits: dict[tuple[int, int], tuple[list[str], bool]] = {}    # ZeRO-3 units per chunk (k, j)
    coll: Counter = Counter()
    # an analytic plan's layouts solved with its placements pinned: the collectives its time
    # priced against those the solution runs (recomputation's aside), told apart in
    # `plan.search["op_layouts_gap"]` where they differ
    pinned = bool(layouts) and getattr(res.provider, "solutions", None) is None
    priced: Counter = Counter()
    ran: Counter = Counter()
    extra = 0.0
    for pos, (_, d, vc, (k, j)) in enumerate(chunks):
        st = c.stages[d]
        mods = _stage_modules(layers, k, j)
        devices = st.devices
        costs = st.tables.costs
        first_chunk = vc == 0
        # the chunk's part of its device group's time: its own layers' (an embedding-only chunk
        # beside a chunk of blocks is a sliver of the group's compute, `_chunk_share`)
        share = _chunk_share(st, (k, j))
        pred = StagePrediction(
            compute_s=m * st.compute_mb * share + (st.opt_s if first_chunk else 0.0),
            communication_s=m * st.comm_mb * share + (st.sync_s if first_chunk else 0.0),
            bubble_s=max(0.0, c.iteration_s - m * st.t_mb - st.sync_s - st.opt_s) * share,
            weights_bytes=st.weights_bytes, gradients_bytes=st.gradients_bytes,
            optimizer_bytes=st.optimizer_bytes, activations_bytes=st.activations_bytes,
            buffers_bytes=st.buffers_bytes, peak_phase=st.peak_phase, peak_memory_bytes=st.peak_bytes,
            phases={name: PhasePrediction(
                weights_bytes=float(ph.weights), gradients_bytes=float(ph.gradients),
                optimizer_bytes=float(ph.optimizer), activations_bytes=float(ph.activations),
                buffers_bytes=float(ph.buffers), peak_memory_bytes=float(ph.total))
                for name, ph in st.phase_peaks().items()})
        units = None
        if c.zero == 3 and c.replicas > 1:
            units, root = zero3_units(graph, mods, len(chunks) > 1, {f for lay in layers[k:j] for f in lay.params})
            if layouts:
                # run op by op, each unit's ops are one call: interleaving units go to the root
                units, left = contiguous_units(graph, units)
                root = root or bool(left)
                units_left.extend(left)
            zunits[(k, j)] = (units, root)
        mesh_shape, mesh_axes = stage_mesh(c.dp, c.cp, st.tp)
        stage_plans.append(StagePlan(
            index=pos, devices=devices, mesh_shape=mesh_shape, mesh_axis_names=mesh_axes,
            layers=mods, recompute=st.recompute, fsdp_units=units,
            recompute_modules=_recompute_modules(layers, k, j, st.recompute),
            recompute_acts=_recompute_acts(layers, k, j, st.recompute),
            recompute_ops=_module_cut_ops(_recompute_ops(layers, k, j, st.recompute), layouts.get(pos) is None,
                                          pos, st.tp, rc_fallback),
            placements=_with_cp(_placements(graph, layers, costs, k, j, mods, c.zero == 3 and c.replicas > 1), c.cp),
            virtual_chunk=vc, op_layouts=layouts.get(pos), predicted=pred))
        if c.cp > 1:
            # the attention's K/V exchange over the cp axis, per micro-batch
            coll.update({kk: m * vv for kk, vv in context_parallel.collectives(graph, layers, k, j,
                                                                               st.recompute).items()})
        lay = layouts.get(pos)
        if lay is not None:
            # the executor runs each micro-batch's forward and backward as solved (a parameter
            # read in another layout than stored syncs its gradient in every backward)
            for phase in ("forward", "backward", "grad_sync", "recompute"):
                coll.update({kk: m * vv for kk, vv in lay.collectives.get(phase, {}).items()})
            if pinned:
                for phase in ("forward", "backward", "grad_sync"):
                    ran.update({kk: m * vv for kk, vv in lay.collectives.get(phase, {}).items()})
                for i in range(k, j):
                    priced.update({kk: m * vv for kk, vv in costs[i].coll_fwd.items()})
                    priced.update({kk: m * vv for kk, vv in costs[i].coll_bwd.items()})
            extra += sum(_extra_flops(g1, layers[i], st.recompute, st.tp) for i in range(k, j))
            continue
        # no tp, or a tp stage `autopar run` refuses (`plan.search["tp_executor"]`): the
        # provider's per-layer counts
        for i in range(k, j):
            lc = costs[i]
            coll.update({kk: m * vv for kk, vv in lc.coll_fwd.items()})
            coll.update({kk: m * vv for kk, vv in lc.coll_bwd.items()})
            if st.recompute == "full":
                coll.update({kk: m * vv for kk, vv in lc.coll_rc.items()})
            extra += _extra_flops(g1, layers[i], st.recompute, st.tp)
        step_kinds = {kk for i in range(k, j) for kk in costs[i].coll_step}
        coll.update({kk: 1 for kk in step_kinds})
    # expert parallelism: the token exchange's all-to-alls, and the expert gradients' own sync
    # over the dp / ep ranks holding the same experts (`runtime.experts`)
    experts = res.experts if c.ep > 1 else None
    if experts is not None:
        for _, d, _, (k, j) in chunks:
            coll.update(experts.expert_collectives(range(k, j), m, c.stages[d].recompute, c.etp, c.fold))
        # the ranks holding the same experts: the stage's dp x cp ranks (each a replica of the
        # tokens' sync group, `runtime.experts.expert_meshes`) over ep; folded, its dp x tp ranks
        copies = c.expert_copies
        if copies > 1 and c.zero == 3:
            # ZeRO-3: each experts module an FSDP unit over the ranks holding the same experts
            # (`runtime.experts.ExpertGroups.fully_shard`), gathered and reduced as a layer unit
            for *_, (k, j) in chunks:
                blocks = [b.module for i in range(k, j) for b in experts.by_layer.get(i, [])]
                if blocks:
                    coll.update(_zero3_counts(blocks, False, m, len(chunks) > 1, c.rs_each))
        elif copies > 1:
            for st in c.stages:
                if any(i in experts.by_layer for k, j in st.chunks for i in range(k, j)):
                    coll.update({"all_reduce": 1} if c.zero == 0 else {"reduce_scatter": 1, "all_gather": 1})
    # dp (and cp) gradient sync, once per stage (device group), as the runtime issues it
    if c.replicas > 1:
        for d, st in enumerate(c.stages):
            if c.zero == 0:
                coll["all_reduce"] += 1
            elif c.zero in (1, 2):
                coll["reduce_scatter"] += 1
                coll["all_gather"] += 1
            else:
                for k, j in st.chunks:
                    coll.update(_zero3_counts(*zunits[(k, j)], m, len(chunks) > 1, c.rs_each))
                # the 0-D parameters FSDP leaves out, replicated: one flat all-reduce of the
                # device group's (`runtime.engine.ParallelModel.sync_and_update`)
                if any(is_scalar(graph, f) for pos, ch in enumerate(chunks) if ch[1] == d
                       for f in stage_plans[pos].placements):
                    coll["all_reduce"] += 1
    # a pipeline boundary sends every tensor crossing it forward and the gradients of those
    # that need one back, per micro-batch (one point-to-point op each, as torch.pipelining issues them)
    for pos in range(len(chunks) - 1):
        k, d = chunks[pos][3][1] - 1, chunks[pos][1]
        cost = c.stages[d].tables.costs[k]
        coll["send_recv"] += m * (max(cost.cross_tensors, 1) + max(cost.cross_grads, 1))
    if p > 1:
        # tied parameters' gradient sync (`runtime.tied_groups`): one flat all-reduce per set of
        # stages holding some of them (an embedding read by stages 0, 1 and 2 and a weight read
        # by stages 0 and 2: two)
        holders = {frozenset(_owner(c, x) for x in us) for _, _, us in tb.shared}
        coll["all_reduce"] += sum(len(h) > 1 for h in holders)
    coll = Counter({kk: int(vv) for kk, vv in coll.items() if vv})
    tokens = _tokens_per_sample(bundle)
    flops_step = gbs * (3 * fwd1 + extra)
    crit = max(c.stages, key=lambda s: s.t_mb)
    compute = m * crit.compute_mb + crit.opt_s
    comm = m * crit.comm_mb + crit.sync_s
    peak = max(s.peak_bytes for s in c.stages)
    pred = Prediction(iteration_time_s=c.iteration_s, samples_per_s=gbs / c.iteration_s,
                      tokens_per_s=gbs * tokens / c.iteration_s,
                      tflops_per_device=flops_step / c.iteration_s / spec.num_devices / 1e12,
                      peak_memory_bytes=peak, usable_memory_bytes=usable_memory(
                          spec.device, getattr(res.provider, "software", None) or software_for_cluster(None, spec)),
                      collectives=dict(coll), compute_s=compute,
                      communication_s=comm, bubble_s=max(0.0, c.iteration_s - compute - comm))
    from autopar import __version__

    info = ModelInfo(name=bundle.name, num_params=graph.num_params, fingerprint=graph.fingerprint(),
                     num_layers=max(1, len(layers)), flops_per_sample=3 * fwd1, tokens_per_sample=tokens)
    ep_why = _ep_executor(c, all(sp.op_layouts is not None for sp in stage_plans)) if c.ep > 1 else ""
    if c.fold:
        fold_why = fold_unexecuted(c.pp, c.cp, c.zero, all(sp.op_layouts is not None for sp in stage_plans))
        if fold_why:
            ep_why = "; ".join(w for w in (ep_why, f"experts folded over dp x tp (ep={c.ep}, expert_dp="
                                           f"{c.expert_copies}) planned, not yet executed by `autopar run` with "
                                           f"{', '.join(fold_why)} (it runs folded experts op by op as solved, "
                                           f"without cp)") if w)
    if c.etp > 1:
        etp_why = etp_unexecuted(c.pp, c.cp, c.zero, all(sp.op_layouts is not None for sp in stage_plans))
        if etp_why:
            ep_why = "; ".join(w for w in (ep_why, f"expert tensor parallelism (expert_tp={c.etp}) planned, not "
                                           f"yet executed by `autopar run` with {', '.join(etp_why)} (it runs "
                                           f"op by op as solved in one stage, without cp)")
                               if w)
    return Plan(autopar_version=__version__, model=info, cluster=spec,
                software=getattr(res.provider, "software", None) or software_for_cluster(None, spec), dtype=dtype,
                global_batch_size=gbs, microbatch_size=c.mb, num_microbatches=m,
                schedule=c.schedule, virtual_stages=v, zero_stage=c.zero, stages=stage_plans,
                zero3_grad_sync="microbatch" if c.rs_each else "step",
                experts=_expert_plan(experts, c, dtype, spec) if experts is not None else None,
                sequence_parallel=bool(getattr(res.provider, "sequence_parallel", False)) and c.tp > 1,
                predicted=pred,
                search={"search_time_s": round(search_s, 3),
                        "assemble_time_s": round(time.perf_counter() - t_assemble, 3),
                        "capture_time_s": round(graph.capture_time_s, 3),
                        "capture": graph.capture_method,
                        "candidates": res.considered, "evaluated": res.evaluated,
                        "intra_op": getattr(res.provider, "name", "analytic"),
                        "layers": len(layers),
                        **({"selective_fallback": _selective_fallback(rc_fallback)} if rc_fallback else {}),
                        **({"tp_executor": why_not} if why_not else {}),
                        **({"zero3_units": _units_left_note(units_left)} if units_left else {}),
                        **({"op_layouts": PINNED_NOTE} if pinned else {}),
                        **({"op_layouts_gap": pinned_gap(priced, ran)} if pinned and +priced != +ran else {}),
                        **({"ep_executor": ep_why} if ep_why else {}),
                        **({"cp_executor": _cp_executor(c, graph)} if _cp_executor(c, graph) else {}),
                        **({"skipped": _skipped(res.skipped)} if res.skipped else {})})


def _expert_plan(experts: ExpertCosting, c: Candidate, dtype: str, cluster: ClusterSpec) -> ExpertParallelism:
    """`Plan.experts` of a candidate with expert parallelism."""
    blocks = [b for bs in experts.by_layer.values() for b in bs]
    return ExpertParallelism(ep=c.ep, expert_dp=c.expert_copies if c.fold else c.dp // c.ep,
                             imbalance=experts.imbalance, expert_tp=c.etp, folded=c.fold,
                             exchange=experts.exchange_kind(c.ep, c.tp, c.fold, cluster),
                             dispatch_bytes=(experts.dispatch_bytes(blocks[0], c.mb, dtype, c.ep)
                                             / (c.tp if c.fold else 1)),
                             blocks=[ExpertBlockPlan(module=b.module, num_experts=b.num_experts, top_k=b.top_k,
                                                     weights=list(b.weights),
                                                     tp_split=list(tp_split(experts.graph, b)) if c.etp > 1 else [])
                                     for b in blocks])


def etp_unexecuted(pp: int, cp: int, zero: int, solved: bool) -> list[str]:
    """What of a layout with expert tensor parallelism the runtime does not execute (empty where
    it does: `runtime.experts.check_executable`'s conditions, which the search cannot import):
    it runs op by op as solved (each expert block's ops as the rank's exchange and its tp slice
    of the experts), in one stage, without cp, under any ZeRO stage (`zero`: kept for the
    callers, every stage runs)."""
    return [w for w, bad in (("DTensor's path (no solved op layouts)", not solved),
                             ("pipeline stages", pp > 1), ("context parallelism", cp > 1)) if bad]


def fold_unexecuted(pp: int, cp: int, zero: int, solved: bool) -> list[str]:
    """What of a layout with the experts folded over dp x tp the runtime does not execute (empty
    where it does: `runtime.experts.check_executable`'s conditions): it runs op by op as solved
    (each expert block's ops as the rank's share of the tokens, its exchange over the folded ep
    group and the all-gather over tp), without cp, in one stage or pipeline stages, under any ZeRO
    stage (`pp`, `zero`: kept for the callers)."""
    return [w for w, bad in (("DTensor's path (no solved op layouts)", not solved),
                             ("context parallelism", cp > 1)) if bad]


def _ep_executor(c: Candidate, solved: bool) -> str:
    """Why `autopar run` does not execute a candidate's expert parallelism ("" where it does:
    `runtime.experts.check_executable`'s conditions, which the plan schema cannot import):
    with tp, its stages run op by op as solved (each expert block's ops as the rank's token
    exchange, `runtime.experts.program_calls`, nested in its layer's FSDP unit under ZeRO-3; in
    pipeline chunks too, without cp), the experts replicated over tp. `solved`: whether the plan
    carries the stages' op layouts (a tp plan without them is refused as a whole:
    `plan.search["tp_executor"]`)."""
    if c.tp == 1 or not solved:
        return ""
    why = [w for w, bad in (("tensor and context parallelism in pipeline stages", c.cp > 1 and c.pp > 1),) if bad]
    return (f"planned, not yet executed by `autopar run` with {', '.join(why)} (it runs expert parallelism with "
            f"tensor parallelism op by op as solved, with cp in one stage)") if why else ""


def _cp_executor(c: Candidate, graph: OpGraph) -> str:
    """Why `autopar run` does not execute a candidate's context parallelism ("" where it does:
    `inter_op.context_parallel.unexecuted_parts`); only a pinned cp is planned so."""
    from autopar.inter_op.context_parallel import unexecuted_parts

    why = unexecuted_parts(c.ep, c.tp, c.pp, graph.reads_positions is False) if c.cp > 1 else []
    return f"planned, not yet executed by `autopar run` with {', '.join(why)}" if why else ""


def _skipped(skipped: dict[str, str]) -> str:
    """The search's candidates left out as the runtime cannot run them (`SearchResult.skipped`),
    one line per reason naming where."""
    by: dict[str, list[str]] = {}
    for where, why in skipped.items():
        by.setdefault(why, []).append(where)
    return "; ".join(f"{why} ({', '.join(wheres)})" for why, wheres in by.items())


def _op_layouts(graph: OpGraph, c: Candidate, layers: list[Layer], chunks: list, provider: Any
                ) -> tuple[dict[int, StageLayouts], str]:
    """{chunk position: its solved per-op layouts} for every chunk of a candidate with a tp
    stage, and, where there are none, why (`plan.search["tp_executor"]`, which `autopar run`
    names as it refuses the plan). `autopar run` executes tensor parallelism only op by op as
    solved (`autopar.intra_op.execute`; issue 20, one executor): pipelined or not, its stages
    of one tp degree or of several (Alpa's sub-mesh choice: a 1-device stage's layouts are the
    replicated solution; tensors cross between tp degrees replicated, `stage_layouts.
    chunk_layouts`), with ZeRO-3 (each FSDP unit's ops one call of an FSDP forward method of
    its module; units whose ops interleave are left to the root, `contiguous_units`), with
    context parallelism (the program of a cp rank's tokens, its attention the cp attention:
    `runtime.context_parallel.ProgramContext`; the exchange counted beside the solution's
    collectives in `assemble`) and any recomputation. Plans of the analytic rules are solved
    here with the rules' parameter placements pinned (`inter_op.pinned_layouts`). All chunks
    or none: a pipeline chunk hands the next one its tensors in their solved layouts. None
    where the ILP cannot run (OR-Tools missing, a torch.fx capture) or the layers' solutions
    do not meet at a boundary."""
    tp_chunks = [pos for pos, ch in enumerate(chunks) if c.stages[ch[1]].tp > 1]
    if not tp_chunks:
        return {}, ""
    if fx_captured(graph):
        return {}, NO_EXPORT
    if getattr(provider, "solutions", None) is None:
        # the analytic rules: the ILP solves the chosen layers with their placements pinned
        # (`inter_op.pinned_layouts`), or the plan records why `autopar run` refuses it
        spans = [(k, j, c.stages[d].tp) for _, d, _, (k, j) in chunks]
        pins = analytic_pins(layers, spans, lambda x: c.stages[chunks[x][1]].tables.costs)
        provider, why = pinned_provider(graph, layers, provider, pins)
        if provider is None:
            return {}, why
        try:
            for k, j, tp in spans:
                for i in range(k, j):
                    if tp > 1:
                        provider.cost(layers[i], c.mb, tp)
        except PlanError as e:
            return {}, (f"not executed: the intra-op ILP found no per-op layouts holding the analytic rules' "
                        f"parameter placements ({e}); re-plan with intra_op='ilp'")
    solutions = provider.solutions
    if not op_by_op(c):
        raise PlanError("internal: a candidate with a tp stage that the search does not execute op by op")
    spans = [(k, j, c.stages[d].tp, c.stages[d].recompute) for _, d, _, (k, j) in chunks]
    provider.solve_replicated(c.mb, [layers[i] for k, j, tp, _ in spans if tp == 1 for i in range(k, j)])
    entries = provider.entry_solutions(spans, c.mb) if hasattr(provider, "entry_solutions") else None
    lays, why = chunk_layouts(graph, layers, solutions, spans, c.mb, entries)
    if lays is None:
        return {}, f"not executed: {why}; re-plan with other constraints (another tp degree or pipeline cut)"
    return dict(enumerate(lays)), ""


def zero3_units(graph: OpGraph, modules: list[str], pipelined: bool,
                read: Optional[set[str]] = None) -> tuple[list[str], bool]:
    """(the modules ZeRO-3 shards as their own FSDP units, in order; whether the root unit
    holds parameters) of a chunk holding `modules`, from the capture: a unit per module none of
    whose parameters is named by another module of the chunk or read by an op outside it (FSDP
    frees a unit's parameters after its forward), the root keeping the rest (tied parameters,
    a head computed as `x @ emb.weight.t()`). The plan records the units
    (`StagePlan.fsdp_units`) and the runtime wraps exactly them. Without
    pipelining the root is the whole model (parameters outside every module are its own); a
    pipeline chunk sees only its modules' names (a parameter tied to another chunk is one
    name there), and holds in its root a parameter its ops read (`read`, canonical names)
    outside its modules (a head computed as `x @ emb.weight.t()` in a traced chunk)."""
    under = lambda n, mod: n == mod or n.startswith(mod + ".")  # noqa: E731
    params = []
    for f, info in graph.params.items():
        names = [f, *info.tied]
        if pipelined:
            held = [n for n in names if any(under(n, mod) for mod in modules)]
            if held and len(names) > 1:
                # a tied parameter (the traced chunk may hold its stand-in under every name, a
                # Hugging Face `lm_head.weight` beside `wte.weight`): the root's, and so is the
                # module holding it (FSDP shards all of a unit's parameters)
                held = held + ["<root>"]
            elif not held and read is not None and f in read:
                held = [f"<root>.{f}"]            # read under no module of the chunk: the root's
            names = held
        if names:
            params.append(names)
    # without pipelining, a parameter an op outside its module reads (a head computed as
    # `x @ emb.weight.t()`) keeps its module out of the units: the runtime leaves it to the
    # root, gathered throughout (`ParallelModel._fully_shard`)
    outside = set() if pipelined else {f for f in graph.params if _read_outside(graph, f)}
    units = [mod for mod in modules
             if any(under(n, mod) for ns in params for n in ns)
             and all(all(under(n, mod) for n in ns) for ns in params if any(under(n, mod) for n in ns))
             and not any(under(a, mod) for f in outside for a in [f, *graph.params[f].tied])]
    root = any(not any(all(under(n, u) for n in ns) for u in units) for ns in params)
    return units, root


def contiguous_units(graph: OpGraph, units: list[str]) -> tuple[list[str], list[str]]:
    """(the ZeRO-3 `units` kept, those left to the root unit): the executor runs each unit's
    ops as one contiguous call (`intra_op.execute.ShardedProgram.run_units`), so of units whose
    runs of captured ops overlap (a module called again after another's ops, one module's ops
    inside another's run) the first in program order is kept and the others join the root,
    gathered through the step; their ops then run inside the kept unit's call, as the root's
    do. A unit with no captured op is kept (the runtime names it)."""
    under = lambda n, mod: n == mod or n.startswith(mod + ".")  # noqa: E731
    spans = []
    for u in units:
        at = [i for i, n in enumerate(graph.calls) if under(n.module_path or "", u)]
        if at:
            spans.append((at[0], at[-1], u))
    spans.sort()
    left, hi = [], -1
    for lo, h, u in spans:
        if lo <= hi:
            left.append(u)
        else:
            hi = h
    return [u for u in units if u not in left], left


def _units_left_note(left: list[str]) -> str:
    """`plan.search["zero3_units"]`: which modules `contiguous_units` left to the root."""
    return (f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''} left to the ZeRO-3 root unit (gathered "
            f"through the step): their ops interleave with another unit's in the captured program, and each "
            f"unit's ops run as one call; the predicted memory counts them sharded as units")


def _read_outside(graph: OpGraph, f: str) -> bool:
    """Whether an op outside every module holding parameter `f` (under any of its tied names)
    reads it."""
    owners = [a.rsplit(".", 1)[0] if "." in a else "" for a in [f, *graph.params[f].tied]]
    for n in graph.nodes:
        if n.params and f in n.params:
            p = n.module_path or ""
            if not any(o == "" or p == o or p.startswith(o + ".") for o in owners):
                return True
    return False


def _zero3_counts(units: list[str], root: bool, m: int, pipelined: bool, every_microbatch: bool = False) -> Counter:
    """ZeRO-3's collectives per step of a chunk with `m` micro-batches whose FSDP units and root
    are `units`, `root` (`zero3_units`), as the runtime issues them (`fully_shard`; U units
    with the root). Without
    pipelining: all_gather m·U in the forwards + m·(U − 1 if the root holds parameters, else U)
    in the backwards (the root is not resharded after its forward), reduce_scatter U (the last
    micro-batch syncs). In a pipeline, torch.pipelining drives the stage's FSDP root (gradient
    sync and resharding after the last backward only): all_gather (U − root)·(m + 1) + root,
    reduce_scatter U (measured: gpt-tiny pp2 x dp2, m = 1, 2, 4, 1F1B and GPipe, and with tp
    stages; a root holding parameters: a traced user GPT's tied head, pp2 x dp2, m = 2).
    `every_microbatch` (`Plan.zero3_grad_sync` "microbatch", no pipeline): reduce_scatter m·U."""
    n = len(units)
    U = n + int(root)
    if pipelined:
        # the root unit is gathered once and kept to the last backward (measured: a traced
        # chunk holding a tied head's weight outside its modules)
        return Counter({"all_gather": n * (m + 1) + int(root), "reduce_scatter": U})
    return Counter({"all_gather": m * U + m * (U - int(root)), "reduce_scatter": m * U if every_microbatch else U})


def _owner(c: Candidate, layer: int) -> int:
    for d, st in enumerate(c.stages):
        for k, j in st.chunks:
            if k <= layer < j:
                return d
    return -1


def _tokens_per_sample(bundle: ModelBundle) -> int:
    x = bundle.example_inputs[0] if bundle.example_inputs else None
    if x is not None and hasattr(x, "dtype") and not x.dtype.is_floating_point and x.dim() >= 2:
        return int(x.shape[1])
    return 1
