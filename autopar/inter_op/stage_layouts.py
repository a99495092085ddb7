"""One stage's per-op layouts from the per-layer ILP solutions (issue 20, "one executor").

The ILP provider solves one layer per (signature, micro-batch, tp) on a 1-D tp mesh. A stage is
a run of layers, most of them copies of one solved layer. `stage_layouts` stitches the solutions
of a stage's layers into the plan's `StageLayouts`: one list of op layouts per distinct layer,
and per layer its ops under the names of the capture (which the executor,
`autopar.intra_op.execute`, matches against the program it exports of the same model). A copy
takes its representative's choices op by op (same signature: the same ops in the same order),
its parameters renamed, its junctions mapped through the same correspondence.

Between two layers each solution assumed the tensor entering its layer arrives in some layout
(the one the previous copy leaves it in, for a stack of identical layers). Where the producing
layer leaves it in another, the executor would redistribute it with collectives no solution
counted; such a stage gets no layouts (the reason says which tensor), the plan records it
(`plan.search["tp_executor"]`) and `autopar run` refuses it (issue 20: one executor). A tensor
read by layers that do not follow its maker (an encoder's output read by every decoder block)
arrives as its maker leaves it too (`IlpProvider._boundaries` fixes it for every reading
layer). Each reading layer's solution has its own junction for such a tensor (its own
redistribution, its readers' gradients reduced once per layer), and the executor keeps them
apart (`Junction.readers`, `_layer_readers`), so the collectives that run are the sum of the
layers' solutions', and a junction's value is held as long as its layer's solution counts it.

`chunk_layouts` stitches the chunks of a pipeline, in model order. Chunks of different tp degrees
(Alpa's free sub-mesh per stage) hand their tensors over replicated: see its docstring.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from autopar.capture.graph import OpGraph
from autopar.inter_op.layers import Layer, op_name_mapping
from autopar.schema.constraints import RECOMPUTES
from autopar.schema.layouts import Junction, LayerOps, OpLayout, StageLayouts

__all__ = ["stage_layouts", "chunk_layouts", "produced_layouts", "crossing"]


def _recomputed(graph: OpGraph, lay: Layer, recompute: str) -> list[int]:
    """Indices into `lay.nodes` of the ops `recompute` checkpoints (see `stage_layouts`). Run
    op by op, a stage recomputes the attention core's ops alone whatever its tp degree (the
    module fallback of `Layer.selective_region` is a module-cut stage's)."""
    redo = set(lay.selective_ops if recompute == "selective" else lay.recomputed_ops(recompute, 1))
    return [x for x, n in enumerate(_tensor_ops(graph, lay.nodes)) if n in redo]


def _tensor_ops(graph: OpGraph, nodes: list[str]) -> list[str]:
    """The ops of `nodes` that make a tensor: those the ILP lays out (`ilp._select`). Arithmetic
    on sizes (`sym_float`, a Python `add` of two numbers: Hugging Face's load-balancing loss
    counts its rows so) has no layout; the executor runs it as the program does."""
    return [n for n in nodes if graph.node(n).outputs]


def _layers_touching(graph: OpGraph, layers: list[Layer]) -> dict[str, set[int]]:
    """{tensor: the indices into `layers` of the layers making or reading it}."""
    out: dict[str, set[int]] = {}
    for x, lay in enumerate(layers):
        for n in lay.nodes:
            out.setdefault(n, set()).add(x)
            for i in graph.node(n).inputs:
                out.setdefault(i, set()).add(x)
    return out


def _layer_readers(graph: OpGraph, touching: dict[str, set[int]], name: str, lay: Layer) -> Optional[list[str]]:
    """The ops of `lay` reading tensor `name`, where other layers make or read it too (an
    encoder's output read by every decoder block's cross-attention, a bias one block makes and
    the next reads; `touching`: `_layers_touching`), else None. Each layer's solution then has
    its own junction for the tensor (its own redistribution, its readers' gradients summed and
    reduced once per layer, its value held until its last reader in the layer: what the
    solution counts), which the executor keeps apart from the other layers'
    (`ShardingSolution.junction_readers`); a layer whose solution has no junction for it reads
    it as it arrives."""
    if len(touching.get(name, ())) < 2:
        return None
    return [n for n in _tensor_ops(graph, lay.nodes) if name in graph.node(n).inputs]


def produced_layouts(lay: StageLayouts) -> dict[str, tuple[str, ...]]:
    """{op name: the layout its (first) output leaves in} of a stage's ops."""
    out: dict[str, tuple[str, ...]] = {}
    for lo in lay.layers:
        for name, ol in zip(lo.ops, lay.signatures[lo.signature]):
            if ol.outputs:
                out[name] = tuple(ol.outputs[0])
    return out


def crossing(graph: OpGraph, layers: list[Layer], k: int) -> list[str]:
    """The tensors a pipeline chunk starting at layer `k` receives: made by the ops of layers
    before it and read by an op of it or of a later layer, in graph order."""
    if k == 0:
        return []
    before = [n for lay in layers[:k] for n in lay.nodes]
    read = {a for lay in layers[k:] for n in lay.nodes for a in graph.node(n).inputs}
    return [n for n in before if n in read]


def stage_layouts(graph: OpGraph, layers: list[Layer], solutions: dict, k: int, j: int, mb: int,
                  tp: int, recompute: str = "none", earlier: Optional[dict[str, tuple[str, ...]]] = None,
                  entries: Optional[dict[int, tuple]] = None) -> tuple[Optional[StageLayouts], str]:
    """The layouts of layers [k, j) at micro-batch `mb` on a tp mesh of `tp` (`solutions`: the
    ILP provider's {(signature, mb, tp): (solution, layer solved)}), or (None, why not). With
    `recompute="full"` each layer's block ops (`Layer.block_nodes`) form a checkpointed region,
    with "selective" its attention core's run of ops (`Layer.selective_ops`, what
    `cost_models.memory` counts with `selective_region="ops"`, the plan's
    `StagePlan.recompute_ops`, run under torch's selective checkpoint), with "attention" the
    ops of the module holding that core (`Layer.attention_ops`, one contiguous run); their forward
    collectives re-run in the backward (phase "recompute"); with "norm_act" its regions
    (`Layer.discard_regions`, `LayerOps.discarded`), their outputs discarded once saved and
    re-made, their forward collectives re-run alike. `earlier`: for a pipeline chunk after the first, the layouts
    the ops of the chunks before it leave their outputs in (`produced_layouts`): a tensor this
    chunk receives must arrive as its readers' solutions assumed, and `receives` records them.
    `entries`: {layer index: (solution, layer)} taking the place of a layer's shared solution
    (`IlpProvider.entry_solutions`: the first layer of a chunk after one of another tp degree,
    solved receiving its tensors replicated); such a layer's op layouts are a signature apart."""
    if recompute not in RECOMPUTES:
        return None, f"recompute={recompute} is not executed op by op"
    sigs: dict[str, int] = {}
    sig_lists: list[list[OpLayout]] = []
    lay_ops: list[LayerOps] = []
    params: dict[str, tuple[str, ...]] = {}
    interleaved: dict[str, tuple[int, int]] = {}
    inputs: dict[str, tuple[str, ...]] = {}
    junctions: dict[str, Junction] = {}
    produced: dict[str, tuple[str, ...]] = {}     # op -> layout of its first output
    entering: dict[str, tuple[str, str]] = {}      # tensor from an earlier layer -> (layout, layer)
    counts: dict[str, Counter] = {"forward": Counter(), "backward": Counter(), "grad_sync": Counter(),
                                  "recompute": Counter()}
    axes: tuple[int, ...] = ()
    touching = _layers_touching(graph, layers)
    for i in range(k, j):
        lay = layers[i]
        got = (entries or {}).get(i) or solutions.get((lay.signature, mb, tp))
        if got is None:
            return None, f"layer {lay.name or i} has no intra-op solution at tp={tp}"
        sol, rep = got
        sig = f"{lay.signature}@{i}" if i in (entries or {}) else lay.signature
        axes = tuple(sol.model_axes)
        names = op_name_mapping(graph, rep, lay)
        rep_ops = _tensor_ops(graph, rep.nodes)
        if sig not in sigs:
            if any(n not in sol.op_choices for n in rep_ops):
                return None, f"layer {rep.name or i}: the solution has no layout for some of its ops"
            sigs[sig] = len(sig_lists)
            sig_lists.append([OpLayout(strategy=ch.strategy, family=ch.family,
                                       inputs=[tuple(x) for x in ch.input_placements],
                                       outputs=[tuple(x) for x in ch.output_placements])
                              for ch in (sol.op_choices[n] for n in rep_ops)])
        redo = _recomputed(graph, lay, recompute)
        ops = _tensor_ops(graph, lay.nodes)
        if recompute == "norm_act":
            # each region discarded and re-made on its own (`execute._DiscardState`), not checkpointed
            at = {n: x for x, n in enumerate(ops)}
            lay_ops.append(LayerOps(name=lay.name or str(i), signature=sigs[sig], ops=ops, discarded=[
                [at[n] for n in r.ops if n in at] for r in lay.discard_regions]))
        else:
            lay_ops.append(LayerOps(name=lay.name or str(i), signature=sigs[sig], ops=ops, recomputed=redo))
        for n in rep_ops:
            outs = sol.op_choices[n].output_placements
            if outs:
                produced[names[n]] = tuple(outs[0])
        for f, pl in sol.param_placements.items():
            f2 = rep.rename_param(f, lay)
            if params.setdefault(f2, tuple(pl)) != tuple(pl):
                return None, f"parameter {f2} is read in two layouts ({params[f2]} and {tuple(pl)})"
        for f, dc in sol.param_layouts.items():
            interleaved[rep.rename_param(f, lay)] = tuple(dc)
        mine = set(lay.nodes)
        for key, (layout, partial) in sol.junctions.items():
            prod, _, idx = key.rpartition("#")
            prod = names.get(prod, prod)
            readers = _layer_readers(graph, touching, prod, lay) if graph.node(prod).kind == "call" else None
            if readers is None:
                junctions[f"{prod}#{idx}"] = Junction(layout=tuple(layout), partial_axes=tuple(partial))
            else:
                junctions[f"{prod}#{idx}@{lay.name or i}"] = Junction(layout=tuple(layout), partial_axes=tuple(partial),
                                                                    readers=readers)
        for name, pl in sol.input_placements.items():
            n2 = names.get(name, name)
            kind = graph.node(n2).kind
            if kind == "input":
                inputs.setdefault(n2, tuple(pl))
            elif kind == "call" and n2 not in mine:
                entering.setdefault(n2, (tuple(pl), lay.name))
        block = {rep_ops[x] for x in redo}
        # a tensor made outside the recomputed region and redistributed through its junction
        # for readers inside it: the region keeps its own junction values (`execute`'s
        # checkpointed region), so its re-run redistributes again (Megatron-SP's all-gather of
        # a norm's sequence shard before a recomputed attention module)
        read_inside = {i for n in block for i in graph.node(n).inputs}
        for c in sol.collectives:
            counts[c.phase][c.kind] += max(1, len(c.mesh_axes))
            junction_in = c.op not in block and c.op in read_inside and c.reason.endswith(f" of {c.op}")
            # "norm_act" re-runs its regions' ops alone (`execute._DiscardState`), not their
            # readers: a region output's redistribution for a reader outside it (Megatron-SP's
            # all-gather of a norm's sequence shard for the projections) is not re-run
            not_rerun = (recompute == "norm_act" and c.op in block and c.reason.endswith(f" of {c.op}")
                         and c.op not in read_inside)
            if c.phase == "forward" and (c.op in block or junction_in) and not not_rerun:
                counts["recompute"][c.kind] += max(1, len(c.mesh_axes))
    earlier = earlier or {}
    for name, (want, where) in entering.items():
        have = produced.get(name, earlier.get(name))
        if have is not None and have != want:
            return None, (f"{name} leaves its layer laid out {have}, but {where}'s solution assumed "
                          f"{want}: the redistribution between them is in no solution")
    receives: dict[str, tuple[str, ...]] = {}
    for name in crossing(graph, layers, k):
        if name not in earlier:
            return None, f"{name} crosses into layer {layers[k].name or k} with no solved layout"
        receives[name] = earlier[name]
    return StageLayouts(model_axes=axes, signatures=sig_lists, layers=lay_ops, inputs=inputs, params=params,
                        junctions=junctions, receives=receives, param_layouts=interleaved,
                        collectives={ph: dict(c) for ph, c in counts.items() if c}), ""


def _replicated(layout: tuple[str, ...]) -> tuple[str, ...]:
    return ("R",) * len(layout)


def _handover(graph: OpGraph, layers: list[Layer], lay: StageLayouts, j: int, tp: int,
              earlier: dict[str, tuple[str, ...]]) -> str:
    """Make chunk `lay` (ending at layer `j`, on a tp mesh of `tp`) hand every tensor crossing
    into the next chunk, on a mesh of another tp degree, over replicated: each one its ops leave
    sharded (partial) is gathered (all-reduced) on its mesh first, one forward collective per
    tensor and micro-batch, added to `lay.collectives` (the gradient comes back whole: its
    backward slices, no collective). A tensor it only passes on goes as it came, so it must be
    replicated already. Returns why not, or ""."""
    produced = produced_layouts(lay)
    fwd = lay.collectives.setdefault("forward", {})
    for name in crossing(graph, layers, j):
        if name not in produced:
            have = earlier.get(name)
            if tp > 1 and have is not None and have != _replicated(have):
                return (f"{name} passes through layer {layers[j - 1].name or j - 1} laid out {have} into a stage "
                        f"of another tensor-parallel degree, which receives it replicated")
            continue
        if tp == 1:
            continue
        for pl in produced[name]:
            if pl == "P":
                fwd["all_reduce"] = fwd.get("all_reduce", 0) + 1
            elif pl != "R":
                fwd["all_gather"] = fwd.get("all_gather", 0) + 1
    return ""


def chunk_layouts(graph: OpGraph, layers: list[Layer], solutions: dict, spans: list[tuple[int, int, int, str]],
                  mb: int, entries: Optional[dict[int, tuple]] = None) -> tuple[Optional[list[StageLayouts]], str]:
    """`stage_layouts` of every pipeline chunk `spans` ((first layer, end layer, tp, recompute),
    in model order), each given what the chunks before it leave their tensors in, or (None, why
    not). Where two neighbours differ in tp degree (Alpa's sub-mesh choice: stages of 1 and 2
    devices) a layout of one mesh means nothing on the other, so the tensors cross replicated:
    the sender gathers them (`_handover`, counted in its forward collectives), every rank of
    the receiver gets them whole (`runtime.pipeline_p2p`'s fan-out) and its `receives` say
    "R", so its readers' solutions must have assumed them replicated (the check of
    `stage_layouts`: a reader wanting one sharded would need a re-layout no solution costed).
    A chunk on a 1-device mesh holds every tensor whole: its solution is the replicated one.
    `entries`: see `stage_layouts`."""
    out: list[StageLayouts] = []
    earlier: dict[str, tuple[str, ...]] = {}
    for c, (k, j, tp, recompute) in enumerate(spans):
        if c > 0 and spans[c - 1][2] != tp:
            earlier = {n: _replicated(pl) for n, pl in earlier.items()}
        lay, why = stage_layouts(graph, layers, solutions, k, j, mb, tp, recompute, earlier, entries)
        if lay is None:
            return None, why
        if c + 1 < len(spans) and spans[c + 1][2] != tp:
            why = _handover(graph, layers, lay, j, tp, earlier)
            if why:
                return None, why
        earlier.update(produced_layouts(lay))
        out.append(lay)
    return out, ""
