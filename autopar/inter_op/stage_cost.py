"""Per-layer costs on a tensor-parallel mesh, and the stage-cost tables the DP reads.

A `LayerCost` is one layer at one micro-batch size on one tensor-parallel degree: compute,
tensor-parallel collectives, activations kept per recomputation policy, parameter elements per
device and the placements of its parameters on the tp axis. Providers make them:

- `AnalyticProvider` (the fast path, and the cross-check of the ILP): Megatron-LM's tensor
  parallelism derived from the graph. A `linear` whose input is replicated is column-parallel
  (weight S(0), output sharded, an all-reduce of its input's gradient in the backward); one whose
  input is sharded is row-parallel (weight S(1), an all-reduce of its output in the forward);
  Hugging Face's Conv1D (`addmm`, weight (in, out)) and a matmul by a parameter or its
  transpose (a tied head `x @ wte.weight.t()`) are linears too (`linear_like`);
  the largest embedding table is vocab-parallel (S(0), forward all-reduce); attention on sharded
  q/k/v splits its heads; a cross-entropy over vocab-sharded logits costs Megatron's three small
  all-reduces. Sharded ops cost flops/tp, replicated ones (layer norms, residual adds) full.
  An element-wise op of a column-parallel linear's split features that also reads a replicated
  tensor needing a gradient pays for it as the executor runs it: a tensor broadcast along the
  features (a gate of shape (.., 1)) has its partial gradient all-reduced in the backward; one as
  large as the features (a residual stream) stays whole and the split operand is gathered
  first; a norm over split features gathers them (`_replicated_reads`).
  A layer must hand a replicated activation to the next one (an all-gather otherwise).
- `IlpProvider`: the intra-op ILP (`autopar.intra_op.solve_graph`) on the layer's ops over a
  1-D tp mesh; see that class.

Identical layers (same signature) share one computation; results are cached per
(signature, micro-batch, tp).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

from autopar.capture.graph import OpGraph, OpNode
from autopar.inter_op.layers import Layer, op_name_mapping
from autopar.schema import ClusterSpec, LinkSpec
from autopar.schema.constraints import RECOMPUTES
from autopar.schema.placement import is_shard
from autopar.schema.software import SoftwareSpec, resolve_software
from cost_models.communication import collective_time
from cost_models.compute import DTYPE_SIZE, fusion_of, op_list_time
from cost_models.fusion import POINTWISE_OPS
from cost_models.layouts import graph_layout_copies, share_layout_walk
from cost_models.memory import activation_memory, graph_fp32_tensors, one_graph_policies, requires_grad

LOSS_OPS = frozenset({"cross_entropy_loss", "nll_loss", "log_softmax", "_log_softmax"})
# norms over the last dim: run on features split over tp, they need them whole (`_replicated_reads`)
FEATURE_NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"})


@dataclass
class LayerCost:
    """One layer, one micro-batch (per data-parallel replica), one tp degree; per device."""

    fwd_s: float = 0.0                        # forward compute
    bwd_s: float = 0.0                        # backward compute
    fwd_comm_s: float = 0.0                   # tp collectives in the forward
    bwd_comm_s: float = 0.0                   # tp collectives in the backward
    rc_extra_s: dict[str, float] = field(default_factory=dict)    # extra forward by policy
    rc_comm_s: dict[str, float] = field(default_factory=dict)     # its collectives' part
    act_bytes: dict[str, float] = field(default_factory=dict)     # kept per micro-batch by policy
    # its worst moment above what it saved, by policy: of its backward (`ActivationMemory.
    # backward_over_bytes`: activation gradients, the loss's fp32 input gradient, or a recomputed
    # region's re-made tensors) or of its forward (`forward_over_bytes`: tensors made and still
    # to be read, gather buffers), and whether that moment's extra is activations (a
    # recomputation or the forward's tensors) rather than gradient buffers
    bwd_over: dict[str, float] = field(default_factory=dict)
    bwd_over_rc: dict[str, bool] = field(default_factory=dict)
    # of `bwd_over`, the gradients its op holds: at a recomputation's moment the rest are re-made
    # activations, at a plain backward op's the rest (at most 0) the activations autograd freed
    # before it; 0 for the forward's moment; absent: not known (the whole extra is gradients).
    # A tracker counts the two apart
    bwd_over_grads: dict[str, float] = field(default_factory=dict)
    # the loss's moment among them (`backward_over_loss`; absent: no loss) and the worst of the
    # others (`backward_over_body`), by policy
    bwd_over_loss: dict[str, float] = field(default_factory=dict)
    bwd_over_body: dict[str, float] = field(default_factory=dict)
    # `bwd_over` where the layer ends a pipeline chunk: its output's gradient is the receive
    # buffer (`ActivationMemory.backward_over_given`), by policy
    bwd_over_given: dict[str, float] = field(default_factory=dict)
    # of `bwd_over_given`, whether that moment's extra is activations (the forward's tensors
    # or a recomputation, as `bwd_over_rc`): the forward's moment can be the worst there while
    # the backward's is the worst with the output's gradient counted, by policy
    bwd_over_given_rc: dict[str, bool] = field(default_factory=dict)
    # of `bwd_over_given`, the gradients its op holds beside the given one (as `bwd_over_grads`;
    # 0 for the forward's moment), by policy
    bwd_over_given_grads: dict[str, float] = field(default_factory=dict)
    # the backward's worst moment alone without the given gradient (`ActivationMemory.
    # backward_over_given`: `bwd_over_given` may be the forward's moment), what the first
    # backward of a chunk ending in the layer holds above its saved activations, by policy
    bwd_given_backward: dict[str, float] = field(default_factory=dict)
    # the first backward's worst moments by parts [activations, activation gradients, parameter
    # gradients] (the parameter gradients its ops made so far alive), one per position among
    # the layer's modules (`ActivationMemory.first_moments`), the positions in `bwd_first_at`
    # (`cost_models.memory.unit_position`; `MAIN_UNIT`: the forward's worst moment where it lies
    # above, held with the layer's largest unit), by policy
    bwd_first: dict[str, list] = field(default_factory=dict)
    bwd_first_at: dict[str, list] = field(default_factory=dict)
    # where the forward's worst moment (`MAIN_UNIT` among `bwd_first_at` and `bwd_acc_at`) lies
    # among the layer's modules (`ActivationMemory.forward_over_at`): the one ZeRO-3 unit the
    # forward holds gathered there (none outside the modules), by policy; absent: not known
    fwd_over_at: dict[str, float] = field(default_factory=dict)
    # of each moment's parameter gradients, those made by the layer's other modules, by their
    # position (a str key: `ActivationMemory.first_born`), by policy
    bwd_first_born: dict[str, list] = field(default_factory=dict)
    # the same moments of a later micro-batch's backward, gradients accumulated (per position
    # the worst by activations and activation gradients: `ActivationMemory.acc_moments`), their
    # positions and their born gradients as `bwd_first_at` and `bwd_first_born`, by policy
    bwd_acc: dict[str, list] = field(default_factory=dict)
    bwd_acc_at: dict[str, list] = field(default_factory=dict)
    bwd_acc_born: dict[str, list] = field(default_factory=dict)
    # of each moment's parameter gradients (`bwd_first`, `bwd_acc`), the routed experts'
    # weights' (`ActivationMemory.first_egrads`), by policy
    bwd_first_egrads: dict[str, list] = field(default_factory=dict)
    bwd_acc_egrads: dict[str, list] = field(default_factory=dict)
    # the recomputed regions holding a fused attention op, their moments by where they fall
    # against its backward (`ActivationMemory.attention_regions`), by policy: what context
    # parallelism adds to each kind (`context_parallel.layer_cost`)
    rc_attention: dict[str, list] = field(default_factory=dict)
    # the same for the backward's moments outside recomputed regions
    # (`ActivationMemory.attention_moments`) and the forward's ("forward_pre", "forward_at",
    # "forward_post": `ActivationMemory.forward_attention`), by policy
    attention_moments: dict[str, dict] = field(default_factory=dict)
    # of the tensor it hands to the next layer, and of the one it receives, the bytes its own ops
    # save (counted in act_bytes), by policy: the same tensor counted by two layers
    out_saved: dict[str, float] = field(default_factory=dict)
    in_saved: dict[str, float] = field(default_factory=dict)
    # of act_bytes, what no op's backward frees (`ActivationMemory.kept_bytes`: a CPU mse_loss's
    # unreduced storage), held by the earlier layers' backward moments too, by policy
    kept_saved: dict[str, float] = field(default_factory=dict)
    param_elems: dict[str, float] = field(default_factory=dict)   # FQN -> elements per device
    out_bytes: float = 0.0                    # activation handed to the next layer
    # every tensor crossing the cut after this layer (made at or before it, read after it: its
    # output, and a mask or position ids made once and read by every later layer), what a
    # pipeline boundary there sends forward (`cross_bytes`, `cross_tensors`) and the gradients
    # it sends back (`cross_grad_bytes`, `cross_grads`: the tensors that need one)
    cross_bytes: float = 0.0
    cross_grad_bytes: float = 0.0
    cross_tensors: int = 0
    cross_grads: int = 0
    coll_fwd: Counter = field(default_factory=Counter)
    coll_bwd: Counter = field(default_factory=Counter)
    coll_rc: Counter = field(default_factory=Counter)             # recomputed forward (full)
    coll_step: Counter = field(default_factory=Counter)           # once per step (tp-axis grad sync)
    iter_s: float = 0.0                       # once per step: gradient sync on the tp axis (ILP)
    placements: dict[str, str] = field(default_factory=dict)      # FQN -> tp-axis placement
    issues: list[str] = field(default_factory=list)               # why this tp cannot hold

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: every field, Counters as dicts."""
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Counter) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayerCost":
        """The inverse of `to_dict`."""
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                raise KeyError(f.name)
            v = data[f.name]
            kw[f.name] = Counter(v) if f.name.startswith("coll_") else v
        return cls(**kw)

    @property
    def base_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.fwd_comm_s + self.bwd_comm_s

    def time(self, recompute: str) -> float:
        return self.base_s + self.rc_extra_s.get(recompute, 0.0)


def linear_like(g: OpGraph, n: OpNode) -> Optional[tuple[str, str, int, int, str, str]]:
    """(input, weight fqn, output features, input features, the weight's column-parallel
    placement, its row-parallel one) of a linear layer the analytic rules shard, or None:
    `linear` (weight (out, in): column S(0), row S(1)), Hugging Face's Conv1D, captured as
    `addmm(bias, x, weight)` with the weight held (in, out) (GPT-2's projections: column S(1),
    row S(0)), and a matmul by a parameter or its transpose (`_matmul_weight`). A bias splits
    with the output features in the column-parallel case."""
    if n.op in ("matmul", "mm") and not n.params:
        return _matmul_weight(g, n)
    weights = [p for p in n.params if len(g.params[p].shape) == 2] if n.params else []
    if not weights or not n.inputs:
        return None
    if n.op == "linear":
        o_f, i_f = g.params[weights[0]].shape
        return n.inputs[0], weights[0], o_f, i_f, "S(0)", "S(1)"
    if n.op == "addmm" and len(n.inputs) == 3 and n.inputs[2] in g._index:
        wn = g.node(n.inputs[2])
        if wn.kind == "param" and wn.fqn in weights:
            i_f, o_f = g.params[wn.fqn].shape
            return n.inputs[1], wn.fqn, o_f, i_f, "S(1)", "S(0)"
    return None


def _matmul_weight(g: OpGraph, n: OpNode) -> Optional[tuple[str, str, int, int, str, str]]:
    """`linear_like` of `x @ w.t()` (a tied output layer written as nanoGPT's `x @ wte.weight.t()`:
    the weight (out, in)) and `x @ w` (the weight (in, out))."""
    if len(n.inputs) != 2 or n.inputs[1] not in g._index:
        return None
    wn = g.node(n.inputs[1])
    if not wn.outputs or len(wn.outputs[0].shape) != 2:
        return None
    if wn.kind == "param" and wn.fqn in g.params:
        i_f, o_f = g.params[wn.fqn].shape
        return n.inputs[0], wn.fqn, o_f, i_f, "S(1)", "S(0)"
    if wn.op in ("t", "transpose", "permute") and wn.inputs and wn.inputs[0] in g._index:
        pn = g.node(wn.inputs[0])
        if pn.kind == "param" and pn.fqn in g.params and len(g.params[pn.fqn].shape) == 2:
            o_f, i_f = g.params[pn.fqn].shape
            return n.inputs[0], pn.fqn, o_f, i_f, "S(0)", "S(1)"
    return None


def autocast_device(cluster: ClusterSpec) -> str:
    """The device type autopar's runtime autocasts on for `cluster` (`DeviceSpec.device_type`):
    it decides which ops run in fp32 under mixed precision (`cost_models.memory`)."""
    return cluster.device.device_type


# `LayerCost.bwd_first_at`'s position of a moment held with the layer's largest ZeRO-3 unit
# (and the one before it prefetched), whatever op it falls in: the forward's worst
MAIN_UNIT = -1.0


def fill_activations(c: LayerCost, sub, dtype: str, shard, device_type: str | None = None, *,
                     out_name: str | None = None, in_name: str | None = None, dtensor: bool = False,
                     read_shard=None, attention_kernel: str = "fused", selective_region: str = "ops",
                     modules: list[str] | tuple = (), autocast: bool = True, norm_saves: str = "eager") -> None:
    """A layer's activation memory per recomputation policy (graph liveness,
    `cost_models.memory.activation_memory` of its ops `sub`, tensors divided by `shard(node)`,
    under `device_type`'s autocast; the model's inputs left to the stage's batch buffer), its
    backward's worst moment above that (the recomputed region, for "selective" the attention
    core's run of ops the runtime recomputes, `cost_models.memory.selective_ops`) and what its
    loss reads, into `c`; with `out_name` (the tensor the layer hands on) and `in_name` (the one
    it receives), how much of each its ops save (`out_saved`, `in_saved`: one tensor saved on
    both sides of a boundary is one);
    `dtensor`: the layer runs tensor-parallel, on DTensors; `read_shard`: see
    `cost_models.memory.activation_memory` (an executed per-op solution); `attention_kernel`:
    the software's (`SoftwareSpec`: unfused attention saves its scores); `selective_region`:
    what "selective" recomputes (`Layer.selective_region`); `modules`: the layer's, in order
    (`Layer.modules`: the first backward's moments by position, `bwd_first`); `autocast`: the
    software's mixed precision (`SoftwareSpec.autocast`; False: the model cast to `dtype`);
    `norm_saves`: what its norm modules save (`SoftwareSpec.norm_saves`)."""
    params = {n.name: c.param_elems[n.fqn] for n in sub.nodes
              if n.kind == "param" and getattr(n, "fqn", None) in c.param_elems}
    # the routed experts' weights (`capture.experts`): their gradients told apart at each moment
    from autopar.capture.experts import find_expert_blocks

    eweights = {w for b in find_expert_blocks(sub) for w in b.weights}
    experts = frozenset(n for n in params if getattr(sub.node(n), "fqn", None) in eweights) if eweights else frozenset()
    with one_graph_policies():      # the policies share what does not depend on them
        ams = {rc: activation_memory(sub, dtype, rc, shard=shard, selective_region=selective_region,
                                     device_type=device_type, count_inputs=False, dtensor=dtensor,
                                     read_shard=read_shard, param_elems=params, given_grad=out_name,
                                     attention_kernel=attention_kernel, modules=modules, autocast=autocast,
                                     norm_saves=norm_saves, expert_params=experts)
               for rc in RECOMPUTES}
    for rc, am in ams.items():
        c.act_bytes[rc] = am.saved_bytes
        # the forward's worst moment where it lies above the backward's (tensors the forward
        # makes, counted as activations like a recomputation's)
        fwd = am.forward_over_bytes > am.backward_over_bytes
        c.bwd_over[rc] = am.forward_over_bytes if fwd else am.backward_over_bytes
        c.bwd_over_rc[rc] = fwd or am.backward_over_recompute
        # of that moment, the gradients alive (a backward's: the rest are re-made activations, or
        # the activations autograd freed so far, a negative; the forward's: none)
        c.bwd_over_grads[rc] = 0.0 if fwd else am.backward_over_grads
        c.bwd_over_body[rc] = max(am.backward_over_body, am.forward_over_bytes)
        if am.backward_over_loss is not None:
            c.bwd_over_loss[rc] = am.backward_over_loss
        # where the layer ends a chunk its output is the stage's (kept per micro-batch in
        # flight): its forward's moment without it (`forward_over_given`)
        c.bwd_over_given[rc] = max(am.forward_over_given, am.backward_over_given)
        fwd_given = am.forward_over_given > am.backward_over_given
        c.bwd_over_given_rc[rc] = fwd_given or am.backward_over_given_recompute
        c.bwd_over_given_grads[rc] = 0.0 if fwd_given else am.backward_over_given_grads
        c.bwd_given_backward[rc] = am.backward_over_given
        at = sorted(am.first_moments)
        moments = [list(am.first_moments[x]) for x in at]
        born = [{str(p): b for p, b in am.first_born.get(x, {}).items()} for x in at]
        acc_at = sorted(am.acc_moments)
        acc = [list(am.acc_moments[x]) for x in acc_at]
        acc_born = [{str(p): b for p, b in am.acc_born.get(x, {}).items()} for x in acc_at]
        # (where its position is known, always: under ZeRO-3 it holds other units than the
        # backward's moments, `_Tables.first_backward`, and can be the worst with them)
        known = am.forward_over_at is not None
        if known or am.forward_over_bytes > max((sum(m) for m in moments), default=0.0):
            at, moments, born = at + [MAIN_UNIT], moments + [[am.forward_over_bytes, 0.0, 0.0]], born + [{}]
        if known or am.forward_over_bytes > max((m[0] + m[1] for m in acc), default=0.0):
            acc_at, acc, acc_born = acc_at + [MAIN_UNIT], acc + [[am.forward_over_bytes, 0.0, 0.0]], acc_born + [{}]
        if am.forward_over_at is not None:
            c.fwd_over_at[rc] = am.forward_over_at
        c.bwd_first[rc], c.bwd_first_at[rc], c.bwd_first_born[rc] = moments, at, born
        c.bwd_acc[rc], c.bwd_acc_at[rc], c.bwd_acc_born[rc] = acc, acc_at, acc_born
        c.bwd_first_egrads[rc] = [am.first_egrads.get(x, 0.0) for x in at]
        c.bwd_acc_egrads[rc] = [am.acc_egrads.get(x, 0.0) for x in acc_at]
        if am.attention_regions:
            c.rc_attention[rc] = am.attention_regions
        if am.attention_moments:
            c.attention_moments[rc] = {**am.attention_moments,
                                       **{f"forward_{k}": v for k, v in am.forward_attention.items()}}
        c.out_saved[rc] = am.saved_of(out_name)
        c.in_saved[rc] = am.saved_of(in_name)
        c.kept_saved[rc] = am.kept_bytes


def axis_link(cluster: ClusterSpec, group: int, stride: int = 1) -> LinkSpec:
    """The slowest link a group of `group` ranks `stride` apart crosses."""
    if cluster.num_nodes > 1 and cluster.inter_node is not None and group * stride > cluster.devices_per_node:
        return cluster.inter_node
    return cluster.intra_node


def coll_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    return collective_time(kind, nbytes, n, link.latency, 1.0 / link.bandwidth)


def float_bytes(o, dtype: str) -> float:
    """Bytes of tensor meta `o` in a `dtype` run: floating tensors at that dtype's size."""
    if o.dtype.startswith("float") or o.dtype.startswith("bfloat"):
        return o.numel * DTYPE_SIZE[dtype]
    return float(o.nbytes)


class AnalyticProvider:
    """Megatron-style tensor parallelism read off the graph (see the module docstring)."""

    name = "analytic"

    def __init__(self, graph: OpGraph, layers: list[Layer], cluster: ClusterSpec, dtype: str,
                 software: SoftwareSpec | str | None = None) -> None:
        """`software`: what the training software does on `cluster` (`SoftwareSpec`, a preset
        name; None: the default, what `autopar run` executes)."""
        self.graph = graph
        self.layers = layers
        self.cluster = cluster
        self.dtype = dtype
        self.software = resolve_software(software)
        self._cache: dict[tuple, LayerCost] = {}
        self._floors: dict[tuple, float] = {}
        self._graphs: dict[int, OpGraph] = {}
        self._consumers = graph.consumers()
        self._outputs: dict[int, str | None] = {}
        self._layer_of = {n: l.index for l in layers for n in l.nodes}
        self._crossing: dict[tuple[int, int], tuple[float, float, int, int]] = {}
        self._cross_nodes: Optional[list[list[str]]] = None
        # (signature, micro-batch, tp) -> (the layer analysed, {op: "embedding" | "loss"}): the
        # ops these rules run vocabulary-parallel (`vocab_parallel_ops`)
        self._vocab: dict[tuple, tuple[Layer, dict[str, str]]] = {}
        self._rg: Optional[dict[str, bool]] = None

    @property
    def requires_grad(self) -> dict[str, bool]:
        """Whether each node's output needs a gradient in the whole graph (computed once)."""
        if self._rg is None:
            self._rg = requires_grad(self.graph.nodes)
        return self._rg

    def graph_at(self, mb: int, layer: Layer) -> OpGraph:
        """The layer's ops and the tensors they read, at concrete batch `mb` (only these are
        re-shaped, so a 96-layer model costs one block per micro-batch size)."""
        key = (layer.index, mb)
        if key not in self._graphs:
            mine = set(layer.nodes)
            names = set(mine)
            for n in layer.nodes:
                names.update(self.graph.node(n).inputs)
            nodes = []
            for n in self.graph.nodes:
                if n.name in mine:
                    nodes.append(n)
                elif n.name in names:
                    nodes.append(replace(n, kind="input" if n.kind == "call" else n.kind, inputs=[]))
                elif n.kind == "output" and any(i in mine for i in n.inputs):
                    # what the layer returns (the loss): the ILP makes it replicated, as the
                    # executor does (a loss left a partial sum is all-reduced)
                    nodes.append(replace(n, inputs=[i for i in n.inputs if i in mine]))
            sub = OpGraph(self.graph.name, nodes, self.graph.params)
            self._graphs[key] = sub.at_batch(mb) if self.graph.batch_size is None else sub
        return self._graphs[key]

    def _grad_inputs(self, layer: Layer) -> set[str]:
        """Tensors entering `layer` from earlier layers whose gradient the backward computes."""
        mine, rg = set(layer.nodes), self.requires_grad
        return {i for n in layer.nodes for i in self.graph.node(n).inputs
                if i not in mine and self.graph.node(i).kind == "call" and rg.get(i, False)}

    def time_floor(self, layer: Layer, mb: int, tp: int) -> float:
        """A lower bound on `cost(layer, mb, tp).base_s` (and on its executor variant's) that
        needs no solve: each op's compute at the cheaper of whole and split tp ways, no
        collective (`intra_op.ilp.layer_compute_floor`). The search orders candidates by it
        before it costs their layers (`Search._run`). Per (signature, micro-batch, tp)."""
        from autopar.intra_op.ilp import layer_compute_floor

        key = (layer.signature, mb, tp)
        if key not in self._floors:
            self._floors[key] = layer_compute_floor(
                self.graph_at(mb, layer), layer.nodes, self._grad_inputs(layer), self.cluster.device, self.dtype,
                tp, self.software.attention_kernel, self.software.pointwise_fusion, self.software.autocast)
        return self._floors[key]

    def output_node(self, layer: Layer) -> str | None:
        """The tensor `layer` hands to the next layer: its last op read outside it."""
        if layer.index not in self._outputs:
            mine = set(layer.nodes)
            outs = [n for n in layer.nodes if any(u not in mine for u in self._consumers.get(n, []))]
            self._outputs[layer.index] = outs[-1] if outs else None
        return self._outputs[layer.index]

    def boundary_names(self, layer: Layer) -> dict[str, str | None]:
        """`out_name` and `in_name` of `fill_activations` for `layer`."""
        prev = self.layers[layer.index - 1] if 0 < layer.index <= len(self.layers) else None
        return {"out_name": self.output_node(layer), "in_name": self.output_node(prev) if prev else None}

    def crossing(self, index: int, mb: int) -> tuple[float, float, int, int]:
        """(bytes, gradient bytes, tensors, gradients) crossing the cut after layer `index` at
        micro-batch `mb`: every tensor an op of layers <= index makes and an op of a later layer
        reads (`LayerCost.cross_bytes`); floating ones at the training dtype."""
        key = (index, mb)
        if key not in self._crossing:
            if self._cross_nodes is None:
                self._cross_nodes = [[] for _ in self.layers]
                for name, a in self._layer_of.items():
                    last = max((self._layer_of.get(u, -1) for u in self._consumers.get(name, [])), default=-1)
                    for b in range(a, last):
                        self._cross_nodes[b].append(name)
            total = grad = 0.0
            grads = 0
            names = self._cross_nodes[index] if 0 <= index < len(self._cross_nodes) else []
            for name in names:
                o = self.graph.node(name).outputs[:1]
                nb = sum(float_bytes(x.at(mb) if self.graph.batch_size is None else x, self.dtype) for x in o)
                total += nb
                if self.requires_grad.get(name, False):
                    grad += nb
                    grads += 1
            self._crossing[key] = (total, grad, len(names), grads)
        return self._crossing[key]

    def cost(self, layer: Layer, mb: int, tp: int) -> LayerCost:
        key = (layer.signature, mb, tp)
        rep = self._cache.get(key)
        if rep is None:
            rep = self._analyze(layer, mb, tp)
            cross = self.crossing_at(layer.index, mb, tp)
            rep.cross_bytes, rep.cross_grad_bytes, rep.cross_tensors, rep.cross_grads = cross
            rep._layer = layer  # type: ignore[attr-defined]
            self._cache[key] = rep
        src: Layer = rep._layer  # type: ignore[attr-defined]
        if src.index == layer.index:
            return rep
        return self._renamed(rep, src, layer, mb, tp)

    def vocab_parallel_ops(self, layer: Layer, mb: int, tp: int) -> dict[str, str]:
        """{op of `layer`: "embedding" or "loss"}: the ops these rules run vocabulary-parallel
        at (mb, tp), Megatron's way (the largest embedding table's rows split, its output
        all-reduced; a loss on vocabulary-split logits reduced by three all-reduces of one
        value per row, the logits never gathered). The plan's executor runs them so
        (`inter_op.pinned_layouts`), as these rules price them."""
        if tp == 1:
            return {}
        key = (layer.signature, mb, tp)
        if key not in self._vocab:
            AnalyticProvider._analyze(self, layer, mb, tp)
        rep, ops = self._vocab[key]
        if rep is layer:
            return dict(ops)
        names = op_name_mapping(self.graph, rep, layer)
        return {names.get(n, n): kind for n, kind in ops.items()}

    def crossing_at(self, index: int, mb: int, tp: int) -> tuple[float, float, int, int]:
        """`crossing` as a rank of a `tp`-way stage holds it (here: whole on every rank)."""
        return self.crossing(index, mb)

    def _renamed(self, rep: LayerCost, src: Layer, layer: Layer, mb: int, tp: int) -> LayerCost:
        """`rep` (the cost of `src`) as the cost of `layer`, a copy of it."""
        out = LayerCost(**{k: getattr(rep, k) for k in rep.__dataclass_fields__})
        out.param_elems = {src.rename_param(f, layer): v for f, v in rep.param_elems.items()}
        out.placements = {src.rename_param(f, layer): v for f, v in rep.placements.items()}
        out.cross_bytes, out.cross_grad_bytes, out.cross_tensors, out.cross_grads = \
            self.crossing_at(layer.index, mb, tp)
        return out

    # -- the rules ---------------------------------------------------------------------------
    @staticmethod
    def _subgraph(g: OpGraph, layer: Layer, nodes: list[OpNode], rg: dict[str, bool] | None = None) -> OpGraph:
        """The layer's ops, with the tensors it reads from outside as inputs; ops of the block
        carry the layer's name (what full recomputation re-runs), the others None. `rg`: which
        tensors need a gradient in the whole model (`requires_grad`; None: as `g` shows them,
        where `graph_at` made every tensor from another layer an input that needs one: the
        rotary tables a later layer reads would then be saved by the products that read them)."""
        mine = {n.name for n in nodes}
        ext: list[OpNode] = []
        seen: set[str] = set()
        rg = requires_grad(g.nodes) if rg is None else rg
        for n in nodes:
            for i in n.inputs:
                if i not in mine and i not in seen and i in g._index:
                    seen.add(i)
                    src = g.node(i)
                    # an activation needing no gradient (rotary tables, masks) is a constant here
                    kind = src.kind
                    if kind == "call" or (kind == "input" and src.target != "placeholder"):
                        kind = "input" if rg.get(i, False) else "constant"
                    ext.append(replace(src, kind=kind, layer=None, inputs=[]))
        body = [replace(n, layer=layer.name if n.name in layer.block_nodes else None) for n in nodes]
        sub = OpGraph(g.name, ext + body, g.params, batch_size=g.batch_size or 1)
        share_layout_walk(sub, g)      # its ops' layouts are `g`'s
        return sub

    @staticmethod
    def _feature_split(g: OpGraph, n: OpNode, ins: list[str], features: set[str]) -> bool:
        """Whether `n` is an element-wise op whose sharded inputs are all split along the
        output's last dim as a column-parallel linear splits its output features (`features`:
        those outputs, and element-wise ops of them). Elsewhere the rules' "sharded" says
        nothing of which dim (heads, an expert router's scores), and an op keeps "sharded in,
        sharded out"."""
        if (n.op not in POINTWISE_OPS and n.op not in FEATURE_NORMS) or not n.outputs or not n.outputs[0].shape:
            return False
        split = [i for i, lay in zip(n.inputs, ins) if lay == "S"]
        last = n.outputs[0].shape[-1]
        return bool(split) and all(i in features and g.node(i).outputs and g.node(i).outputs[0].shape
                                   and g.node(i).outputs[0].shape[-1] == last for i in split)

    def _replicated_reads(self, g: OpGraph, n: OpNode, ins: list[str], tp: int, link: LinkSpec,
                          summed: set[str], cf: Counter, cb: Counter) -> tuple[str, float, float]:
        """(`n`'s output layout, forward and backward collective seconds) for an op the rules
        would run sharded (an input "S") that also reads a replicated tensor needing a gradient
        (what the executor runs, and Megatron's layout would give):

        * broadcast along the split features (a gate of shape (.., 1), a scalar weight): the op
          stays sharded and the tensor's gradient on each rank is a partial sum over its share of
          the features, all-reduced in the backward (once per tensor and layer: its readers'
          gradients are summed first), as Megatron all-reduces a replicated weight's gradient
          where the activations it scales are split;
        * as large as the features (a residual stream added to a sharded branch): slicing it would
          leave its gradient split, to be gathered in the backward besides the gradient its other
          readers give whole; Megatron keeps such a tensor whole and gathers the sharded operand
          instead (a column-parallel linear with no row-parallel partner gathers its output), so
          the sharded inputs are all-gathered in the forward and the op runs replicated.

        A norm over the split features (BERT's head: a column-parallel dense, GELU, then a
        LayerNorm) needs them whole: they are gathered, its weight and bias read whole.

        For an element-wise op or a norm of a column-parallel linear's split features
        (`_feature_split`)."""
        shape = n.outputs[0].shape
        rg = self.requires_grad
        broadcast, whole = [], []
        for i, lay in zip(n.inputs, ins):
            if lay != "R" or i not in g._index or not g.node(i).outputs or not rg.get(i, False):
                continue
            ishape = g.node(i).outputs[0].shape
            if shape and shape[-1] != 1 and (not ishape or ishape[-1] == 1):
                broadcast.append(i)
            else:
                whole.append(i)
        dtype = self.dtype
        if whole or n.op in FEATURE_NORMS:
            f_s = 0.0
            for i, lay in zip(n.inputs, ins):
                if lay == "S":
                    f_s += coll_time("all_gather", sum(float_bytes(o, dtype) for o in g.node(i).outputs[:1]), tp, link)
                    cf["all_gather"] += 1
            return "R", f_s, 0.0
        b_s = 0.0
        for i in broadcast:
            if i not in summed:
                summed.add(i)
                b_s += coll_time("all_reduce", sum(float_bytes(o, dtype) for o in g.node(i).outputs[:1]), tp, link)
                cb["all_reduce"] += 1
        return "S", 0.0, b_s

    def _analyze(self, layer: Layer, mb: int, tp: int) -> LayerCost:
        g = self.graph_at(mb, layer)
        dev, dtype = self.cluster.device, self.dtype
        link = axis_link(self.cluster, tp)
        c = LayerCost()
        mine = set(layer.nodes)
        state: dict[str, str] = {}
        nodes = [g.node(n) for n in layer.nodes]
        emb = [n for n in nodes if n.op == "embedding" and n.params]
        big_emb = max(emb, key=lambda n: math.prod(g.params[n.params[0]].shape)).name if emb else None
        grad_ar_done: set[str] = set()
        vocab: dict[str, str] = {}
        self._vocab[(layer.signature, mb, tp)] = (layer, vocab)
        times: dict[str, tuple[float, float, float, float]] = {}   # fwd, bwd, fwd comm, bwd comm
        coll_f: dict[str, Counter] = {}
        sharded_nodes: set[str] = set()
        # of those, the ops each rank computes a partial sum of, whole-sized, all-reduced after
        # (a row-parallel linear, the vocab-parallel embedding): flops / tp, not bytes / tp
        partial_nodes: set[str] = set()
        # outputs split along their last dim as a column-parallel linear splits its output features,
        # and element-wise ops of them (`_replicated_reads`)
        features: set[str] = set()

        def ar(nbytes: float) -> float:
            return coll_time("all_reduce", nbytes, tp, link)

        # the reshapes that copy and the `.contiguous()` calls that copy nothing on this device
        # (`cost_models.layouts`; the memory model reads the same walk through `_subgraph`)
        copies = graph_layout_copies(g, dev.device_type, self.software.attention_kernel)
        # the element-wise chains the software runs as one kernel each (None: eager, one per op)
        fusion = fusion_of(g, dev, self.software.attention_kernel, self.software.pointwise_fusion)
        # the tensors the run holds in fp32 (an upcast norm's, autocast's fp32 ops' outputs):
        # their bytes at 4 bytes an element (`node_time`), as the memory model sizes them
        fp32 = graph_fp32_tensors(g, dev.device_type, dtype, self.software.attention_kernel, self.software.autocast)
        # and what it reads from other layers that the whole model's rule holds in fp32 (a
        # post-norm block's norm output, read by the next block's projections: their casts, the
        # sums of its gradients), which the layer's part alone takes for inputs at `dtype`
        whole = graph_fp32_tensors(self.graph, dev.device_type, dtype, self.software.attention_kernel,
                                   self.software.autocast)
        fp32 = fp32 | frozenset(i for n in nodes for i in n.inputs if i not in mine and i in whole)

        for n in nodes:
            ins = [state.get(i, "R") for i in n.inputs]
            x = ins[0] if ins else "R"
            op = n.op
            fc = bc = 0.0
            cf = Counter()
            cb = Counter()
            sharded = False
            out = "S" if "S" in ins else "R"
            lin = linear_like(g, n) if tp > 1 else None
            if lin is not None:
                src, w, o_f, i_f, col_w, row_w = lin
                x = state.get(src, "R")
                if x == "R":
                    if o_f % tp:
                        c.issues.append(f"tp={tp} does not divide the {o_f} output features of {n.module_path or w}")
                        out = "R"
                        for p in n.params:
                            c.placements.setdefault(p, "R")
                    else:
                        c.placements[w] = col_w
                        for p in n.params:      # the bias too: split with the output features
                            if p != w:
                                c.placements[p] = "S(0)"
                        sharded, out = True, "S"
                        features.add(n.name)
                        if src not in grad_ar_done:
                            grad_ar_done.add(src)
                            nb = sum(float_bytes(o, dtype) for o in g.node(src).outputs[:1]) if src in g._index else 0
                            bc += ar(nb)
                            cb["all_reduce"] += 1
                else:
                    if i_f % tp:
                        c.issues.append(f"tp={tp} does not divide the {i_f} input features of {n.module_path or w}")
                    c.placements[w] = row_w
                    for p in n.params:
                        c.placements.setdefault(p, "R")
                    sharded, out = True, "R"
                    partial_nodes.add(n.name)
                    fc += ar(sum(float_bytes(o, dtype) for o in n.outputs))
                    cf["all_reduce"] += 1
            elif tp > 1 and op == "embedding" and n.params and n.name == big_emb:
                rows = g.params[n.params[0]].shape[0]
                if rows % tp:
                    c.issues.append(f"tp={tp} does not divide the {rows} rows of embedding {n.params[0]}")
                    c.placements[n.params[0]] = "R"
                else:
                    c.placements[n.params[0]] = "S(0)"
                    sharded = True
                    vocab[n.name] = "embedding"
                    partial_nodes.add(n.name)
                    fc += ar(sum(float_bytes(o, dtype) for o in n.outputs))
                    cf["all_reduce"] += 1
                out = "R"
            elif (tp > 1 and op in ("view", "reshape", "_unsafe_view") and x == "S" and n.outputs and n.inputs
                  and n.inputs[0] in g._index and g.node(n.inputs[0]).outputs):
                # features split into heads, (.., H * D) -> (.., H, D): each rank takes H / tp
                # whole heads, so tp must divide H (2 key/value heads cannot go to 4 ranks)
                src, dst = g.node(n.inputs[0]).outputs[0].shape, n.outputs[0].shape
                if (len(dst) == len(src) + 1 and len(src) >= 1 and dst[-1] != src[-1]
                        and isinstance(dst[-2], int) and dst[-2] % tp):
                    c.issues.append(f"tp={tp} does not divide the {dst[-2]} heads that {n.module_path or n.name} "
                                    f"splits its features into")
                sharded = True
            elif tp > 1 and op in ("scaled_dot_product_attention",) and x == "S":
                heads = n.outputs[0].shape[1] if n.outputs and len(n.outputs[0].shape) == 4 else 1
                if heads % tp:
                    c.issues.append(f"tp={tp} does not divide the {heads} attention heads of {n.module_path}")
                sharded = True
            elif tp > 1 and op in LOSS_OPS and x == "S":
                rows = n.outputs[0].numel if n.outputs and n.outputs[0].shape else 1
                nb = g.node(n.inputs[0]).outputs[0].numel / max(1, g.node(n.inputs[0]).outputs[0].shape[-1]) * 4 \
                    if n.inputs and n.inputs[0] in g._index and g.node(n.inputs[0]).outputs else rows * 4
                fc += 3 * ar(nb)
                cf["all_reduce"] += 3
                sharded, out = True, "R"
                vocab[n.name] = "loss"
            else:
                if out == "S" and tp > 1 and self._feature_split(g, n, ins, features):
                    features.add(n.name)
                    out, f_s, b_s = self._replicated_reads(g, n, ins, tp, link, grad_ar_done, cf, cb)
                    fc += f_s
                    bc += b_s
                sharded = out == "S"
                for p in n.params:
                    c.placements.setdefault(p, "R")
            state[n.name] = out
            if sharded:
                sharded_nodes.add(n.name)
            ct = op_list_time([n], dev, dtype, shard=tp if sharded else 1, index=g._index,
                              attention_kernel=self.software.attention_kernel, copies=copies, fusion=fusion,
                              fp32=fp32)
            times[n.name] = (ct.forward_s, ct.backward_s, fc, bc)
            coll_f[n.name] = cf
            c.coll_bwd.update(cb)
        # the layer hands replicated activations to the next one
        outs = [n for n in nodes if any(u not in mine for u in self._consumers.get(n.name, []))]
        for n in outs:
            if state.get(n.name) == "S" and n.outputs:
                nb = sum(float_bytes(o, dtype) for o in n.outputs)
                f, b, fc, bc = times[n.name]
                times[n.name] = (f, b, fc + coll_time("all_gather", nb, tp, link), bc)
                coll_f[n.name]["all_gather"] += 1
        c.out_bytes = sum(float_bytes(o, dtype) for n in outs[-1:] for o in n.outputs[:1]) if outs else 0.0
        block = layer.block_nodes
        region = layer.selective_region(tp)
        c.fwd_s = sum(t[0] for t in times.values())
        c.bwd_s = sum(t[1] for t in times.values())
        c.fwd_comm_s = sum(t[2] for t in times.values())
        c.bwd_comm_s = sum(t[3] for t in times.values())
        for cf in coll_f.values():
            c.coll_fwd.update(cf)
        # the forward each policy re-runs (`Layer.recomputed_ops`), its collectives included
        redo = {rc: layer.recomputed_ops(rc, tp) for rc in RECOMPUTES if rc != "none"}
        c.rc_extra_s = {"none": 0.0, **{rc: sum(times[k][0] + times[k][2] for k in ops) for rc, ops in redo.items()}}
        c.rc_comm_s = {rc: sum(times[k][2] for k in ops) for rc, ops in redo.items()}
        for k in block:
            c.coll_rc.update(coll_f[k])
        # activations kept for the backward: graph liveness (cost_models.memory) on the layer's ops
        for n in nodes:
            for p in n.params:
                pl = c.placements.get(p, "R")
                c.placements.setdefault(p, pl)
                c.param_elems[p] = math.prod(g.params[p].shape) / (tp if is_shard(pl) else 1)
        sub = self._subgraph(g, layer, nodes, self.requires_grad)
        # a partial sum's local result is as large as the whole output (RowwiseParallel's and
        # the vocab-parallel embedding's before their all-reduce; gpt-tiny pp2 x dp2 x tp2
        # ZeRO-3 by these rules: each block's output projections counted at 1 / tp, stage 0
        # 2 KiB under its tracked peak at the second micro-batch's forward)
        shard = lambda node: tp if node.name in sharded_nodes and node.name not in partial_nodes else 1  # noqa: E731
        fill_activations(c, sub, dtype, shard, autocast_device(self.cluster), dtensor=tp > 1,
                         attention_kernel=self.software.attention_kernel, selective_region=region,
                         modules=layer.modules, autocast=self.software.autocast,
                         norm_saves=self.software.norm_saves, **self.boundary_names(layer))
        return c
