r"""The intra-operator ILP (Alpa §4): one sharding strategy per op of a stage, for training.

Formulation
-----------
Let V be the *groups* of the problem and S_v the strategies of group v. A group is an op, a
parameter, a graph input (or a tensor entering a sub-graph), or a *junction* (below); ops that
only follow one operand are merged into it, and identical layers share one copy of their
groups. E is the set of edges between groups (a tensor produced in u, consumed in v).

    variables   x_{v,i} ∈ {0,1}                 v ∈ V, i ∈ S_v    (strategy i chosen for v)
                e_{uv,ab} ∈ {0,1}                 (u,v) ∈ E, a ∈ A_uv, b ∈ B_uv
    minimise    Σ_v Σ_i c_{v,i} x_{v,i}  +  Σ_{(u,v)} Σ_{a,b} R_{uv,ab} e_{uv,ab}
    subject to  Σ_i x_{v,i} = 1                                    ∀ v           (one_hot)
                Σ_b e_{uv,ab} = Σ_{i ∈ a} x_{u,i}                  ∀ (u,v), a    (edge_rows)
                Σ_a e_{uv,ab} = Σ_{j ∈ b} x_{v,j}                  ∀ (u,v), b    (edge_cols)
                Σ_v Σ_i m_{v,i} x_{v,i} ≤ M                                      (memory)

* c_{v,i} (`node_cost`): the op's forward + backward compute (`cost_models.compute.node_time`,
  the inter-op cost model's per-op price, on its share of the work, only when the mesh has a
  device; without one compute is free and a matmul-family op must split its work over every
  mesh axis of size > 1, Alpa's convention) plus the collectives inside the op (vocab-parallel
  cross-entropy), times the number of identical copies; plus every edge internal to the group
  (a merged follower's resharding).
* A_uv / B_uv group the producer's strategies by the layout they give the tensor and the
  consumer's by the layout they need and the axes along which they leave its gradient partial,
  so an edge needs |A|·|B| variables, not |S_u|·|S_v|; an edge with one class on a side is
  linear and folded into c; edges with the same (u, v, classes) are summed (identical layers).
* R_{uv,ab} (`edge_cost`): the training cost of the resharding. Forward: `transition(a -> b)`
  (all-reduce of a partial, all-gather, all-to-all, reduce-scatter; slices are free). Backward:
  the gradient's way back from b (partial along the consumer's partial axes) to a: a backward
  all-reduce (Megatron's f), a reduce-scatter after a forward all-gather. For a parameter this
  is its gradient synchronisation (phase grad_sync: all-reduce, or reduce-scatter when it is
  stored sharded along the data axis, ZeRO-3/FSDP, which then also pays its all-gather again
  in the backward pass when the backward reads it: a weight, a norm's scale and shift, not a
  bias added to a matmul or an embedding table; `BACKWARD_SKIPS`). Gradient synchronisation
  is bucketed: the ILP charges its bandwidth, the solution adds one latency per 25 MiB bucket.
* Junctions: a tensor read by several consumers gets a group of its own whose strategies are a
  layout (any its producer gives or a consumer wants) and a set of axes along which the summed
  gradient stays partial. Consumers then share one gather, and their partial gradients are
  summed before one reduction (one backward all-reduce for Llama's q, k and v projections).
* m_{v,i} (`memory`): the bytes per device of what the backward pass holds at the end of the
  forward pass: the op's outputs that some consumer saves (`cost_models.memory.saved_tensors`,
  the rules of the inter-op memory model; views alias their base) and its side tensors (norm
  statistics, dropout masks), a graph input, and a parameter with its gradient and Adam state
  (`STATE_FACTOR` times its weights), times the number of copies.
* Merging (Alpa §4.2): an op whose rule follows its operand (element-wise, views, softmax) is
  merged into the group of its only producer, or of its only full-size operand (a residual add
  keeps its own choice); it takes, for each of the group's strategies, its cheapest strategy
  given that layout, unless that strategy reads a partial sum the layout is not (its
  reduction falls to the ops after it, unseen here): such an op keeps its own choice.
* Model axes (optional, `model_axes` with `batch_dims`/`token_dims`): the runtime executes
  such an axis as tensor parallelism, every rank holding the whole micro-batch and sequence, so
  strategies it would not run are removed before solving:
  - splitting a batch or token dim there (data parallelism, Megatron-SP's sequence slices,
    Ulysses' all-to-alls);
  - splitting an activation while every parameter the op reads stays whole there (token or
    sequence parallelism over replicated weights), or a weight GEMM not splitting its weight;
  - splitting the output of an op that reads only constants (a rotary table is computed whole);
  (a cross-entropy on vocabulary-split logits stays: the runtime runs it vocabulary-parallel,
  `runtime.vocab_loss`, as the loss rule prices it);
  and a partial sum wanted sharded there is all-reduced, then sliced (`_transition`), as the
  runtime reduces a row-parallel output at once, instead of reduce-scattered. With
  `sequence_parallel` (Megatron-SP) the token dims (not the batch) may be split there by ops
  between the weight GEMMs (norms, element-wise ops over replicated weights), a partial sum is
  reduce-scattered into them and any slicing is allowed (the executor runs what is solved).
* Solvers: CBC through pywraplp by default (the LP relaxation of this formulation is nearly
  tight; CBC closes it in tenths of a second on a GPT-3 layer), HiGHS and SCIP likewise, or
  CP-SAT (integer-scaled costs). A negligible tie-break prefers split work and sharded inputs.

The solution is read back per op of the whole graph (every copy of a shared layer takes its
representative's choice), with costs recomputed in floats; `gap` is the solver's
(objective - bound) / objective (0 when proven optimal).
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

from autopar.capture.graph import OpGraph, OpNode, TensorMeta
from autopar.intra_op import rules as rules_mod
from autopar.intra_op.placement import PARTIAL, REPLICATE, Spec, all_specs, local_numel, transition
from autopar.intra_op.solution import Collective, OpChoice, ShardingSolution
from autopar.intra_op.strategy import OpContext, Strategy, output_index
from autopar.schema.cluster import LinkSpec
from autopar.schema.errors import PlanError
from autopar.schema.mesh import LogicalMesh
from autopar.schema.placement import is_shard, shard_dim
from cost_models.communication import collective_time, measured_time
from cost_models.compute import FUSED_ATTENTION, MATRIX_OPS, fusion_of, node_time, priced
from cost_models.fusion import FusedChains
from cost_models.layouts import graph_layout_copies
from cost_models.memory import CUDA_FP32_OPS, graph_fp32_tensors

FLOAT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# bytes per device a parameter costs, relative to its weights' bytes: weights, gradients and
# Adam's state. fp32: w + g + m + v = 4x; bf16/fp16 mixed precision: 2 + 2 + 12 = 16 B per
# parameter = 8x the 2-byte weights (ZeRO paper).
STATE_FACTOR = {"fp32": 4.0, "tf32": 4.0, "bf16": 8.0, "fp16": 8.0, "fp8": 16.0}
TIE_BREAK_S_PER_FLOP = 1e-21   # without a device: prefer splitting work when costs tie
HEAVY_OPS = MATRIX_OPS
OUTPUT = "__output__"
BUCKET_BYTES = 25 * 2**20      # gradient bucket (DDP's default 25 MiB)
MIN_SHARED_LAYER_OPS = 4       # layers smaller than this are solved per copy
UNRUNNABLE_S = 1e3             # edge penalty: a layout the runtime would not produce (model axes)
# op -> inputs its backward pass does not read (autograd keeps no copy): a parameter gathered
# for them (ZeRO-3) is not gathered again for the backward pass. Other ops read every input.
BACKWARD_SKIPS = {"linear": (2,), "addmm": (0,), "baddbmm": (0,), "embedding": (0,),
                  "add": (0, 1), "sub": (0, 1), "rsub": (0, 1)}


def bucket_rate(kind: str, n: int, link: LinkSpec) -> float:
    """Seconds per byte of a gradient bucketed for `kind` over `n` devices on a link with a
    measured table: the table's time for one full bucket (`BUCKET_BYTES`, its latency
    included) over the bucket's bytes. DDP reduces gradients smaller than a bucket together, so
    such a gradient takes its share of one, not a collective of its own size."""
    t = measured_time(kind, BUCKET_BYTES, n, link)
    return (t or 0.0) / BUCKET_BYTES


def requires_grad_of(graph: OpGraph, grad_inputs: Iterable[str] = ()) -> dict[str, bool]:
    """Whether each node's output needs a gradient in a (layer's) graph: a parameter as its
    `requires_grad` says, a floating call when one of its inputs needs one, an input or
    boundary tensor when it is one of `grad_inputs` (made with a gradient by an earlier layer)."""
    grad_inputs = frozenset(grad_inputs)
    rg: dict[str, bool] = {}
    for n in graph.nodes:
        if n.kind == "param":
            info = graph.params.get(n.fqn or "")
            rg[n.name] = info.requires_grad if info else True
        elif n.kind == "call":
            is_float = bool(n.outputs) and n.outputs[0].dtype.startswith(("float", "bfloat", "complex"))
            rg[n.name] = is_float and any(rg.get(i, False) for i in n.inputs)
        else:
            rg[n.name] = n.name in grad_inputs
    return rg


def op_compute_time(n: OpNode, rg: dict[str, bool], requires_grad: bool, device, dtype: str, work_div: float,
                    index: dict, attention_kernel: str = "fused",
                    copies: Optional[tuple[frozenset, frozenset]] = None,
                    fusion: Optional[FusedChains] = None, fp32: Optional[frozenset] = None) -> tuple[float, float]:
    """(forward, backward) compute seconds of op `n` with its work split `work_div` ways, as the
    ILP prices a strategy: the inter-op cost model's per-op prices (`node_time`: GEMM curve,
    measured backward and fused attention rates, bytes at the training dtype), so the ILP and
    the analytic provider differ only in the layouts they choose; no backward where the output
    needs no gradient (`requires_grad`), and a matrix op's backward one GEMM per operand that
    needs one (`rg`: dX = dY W, dW = dY^T X). The search's lower bound reads it too
    (`layer_compute_floor`). `copies`: the graph's reshapes that copy and `contiguous` calls
    that copy nothing on `device` (`cost_models.layouts.graph_layout_copies`; see `node_time`);
    `fusion`: the element-wise chains fusing software runs as one kernel each (`node_time`);
    `fp32`: the tensors the run holds in fp32 (`cost_models.memory.graph_fp32_tensors`)."""
    f, b = node_time(n, device, dtype, work_div, index, attention_kernel, copies, fusion, fp32)
    if not requires_grad:
        return f, 0.0
    if n.op in HEAVY_OPS and n.op not in FUSED_ATTENTION:
        k = sum(1 for i in n.inputs[:2] if rg.get(i, False))
        return f, b * max(1, k) / 2.0
    return f, b


def layer_compute_floor(graph: OpGraph, nodes: Iterable[str], grad_inputs: Iterable[str], device, dtype: str,
                        tp: int, attention_kernel: str = "fused", pointwise_fusion: str = "eager",
                        autocast: bool = True) -> float:
    """A lower bound on the compute seconds (forward + backward) of ops `nodes` of `graph` (a
    layer's subgraph at a concrete batch) on a 1-D mesh of `tp` devices, whatever layout a
    solve picks: each op at the cheaper of its work whole and split tp ways (on one mesh axis
    a strategy splits it 1 or tp ways, `Strategy.work_div`), priced as `op_compute_time`.
    A solution's forward + backward is this plus its collectives; the analytic provider's,
    which charges every op's whole backward, is at least it too. Ops with no work are left
    out (the analytic provider skips them). `pointwise_fusion`: the software's
    (`SoftwareSpec.pointwise_fusion`; "fused": element-wise chains as one kernel each);
    `autocast`: its mixed precision (`SoftwareSpec.autocast`)."""
    rg = requires_grad_of(graph, grad_inputs)
    copies = graph_layout_copies(graph, device.device_type, attention_kernel)
    fusion = fusion_of(graph, device, attention_kernel, pointwise_fusion)
    fp32 = graph_fp32_tensors(graph, device.device_type, dtype, attention_kernel, autocast)
    total = 0.0
    for name in nodes:
        n = graph.node(name)
        if n.kind != "call" or not n.outputs or not priced(n, copies):
            continue
        total += min(sum(op_compute_time(n, rg, rg.get(name, False), device, dtype, w, graph._index,
                                         attention_kernel, copies, fusion, fp32)) for w in {1, max(int(tp), 1)})
    return total


def by_phase(phase: str, t: float) -> tuple[float, float, float]:
    """`t` seconds as (forward, backward, grad_sync) by the collective's phase."""
    if phase == "forward":
        return t, 0.0, 0.0
    if phase == "backward":
        return 0.0, t, 0.0
    return 0.0, 0.0, t


@dataclass
class PNode:
    """A node of the problem: a representative op, parameter, input or boundary tensor."""

    name: str
    kind: str                               # call | param | input | boundary | output
    node: Optional[OpNode]
    strategies: list[Strategy]
    family: str = ""
    count: int = 1
    requires_grad: bool = False
    group: int = -1


@dataclass
class Group:
    root: str
    members: list[str]
    choice: list[dict[str, int]]            # per group strategy: member -> its strategy index

    @property
    def size(self) -> int:
        return len(self.choice)


@dataclass
class EdgeTerm:
    u: int
    v: int
    cls_u: tuple[int, ...]                  # class of each strategy of group u
    cls_v: tuple[int, ...]
    cost: list[list[float]] = field(default_factory=list)


class IntraOpProblem:
    """The ILP's data: groups, their strategies' costs, edges. `evaluate(assign)` prices any
    assignment (one strategy index per group), so brute force can check the solver."""

    def __init__(self, graph: OpGraph, mesh: LogicalMesh, *, nodes: Optional[Iterable[str]] = None,
                 memory_budget_bytes: Optional[float] = None, dtype: str = "fp32",
                 merge: bool = True, share_layers: bool = True, interleaved_splits: bool = True,
                 cyclic_boundary: bool = False, batch_dims: Optional[dict[str, tuple[int, ...]]] = None,
                 token_dims: Optional[dict[str, tuple[int, ...]]] = None,
                 model_axes: tuple[int, ...] = (), fixed_params: Optional[dict[str, tuple[str, ...]]] = None,
                 grad_inputs: Optional[Iterable[str]] = None, sequence_parallel: bool = False,
                 attention_kernel: str = "fused", pointwise_fusion: str = "eager", autocast: bool = True,
                 fixed_inputs: Optional[dict[str, tuple[str, ...]]] = None,
                 fixed_outputs: Optional[dict[str, tuple[str, ...]]] = None,
                 leaving: Optional[Iterable[str]] = None, fixed_ops: Optional[dict[str, str]] = None) -> None:
        if graph.batch_size is None and graph.is_symbolic:
            raise ValueError("solve a graph at a concrete batch: call graph.at_batch(b) first")
        t0 = time.perf_counter()
        self.graph = graph
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.dtype = dtype
        self.attention_kernel = attention_kernel      # the software's (`SoftwareSpec`)
        self.pointwise_fusion = pointwise_fusion      # the software's: element-wise chains fused or not
        self.autocast = autocast                      # the software's mixed precision (`SoftwareSpec.autocast`)
        # ops whose backward reads an fp32 copy of a 2-byte input, not the input (`backward_reads`)
        self.cast_reads = CUDA_FP32_OPS if (autocast and FLOAT_BYTES.get(dtype, 4) == 2 and mesh.device is not None
                                            and mesh.device.device_type == "cuda") else frozenset()
        # the reshapes that copy on the mesh's device (`compute_time`, on first use)
        self.reshape_copies: Optional[tuple[frozenset, frozenset]] = None
        self.float_bytes = FLOAT_BYTES.get(dtype, 4)
        self.state_factor = STATE_FACTOR.get(dtype, 4.0)
        self.budget = memory_budget_bytes
        self.interleaved_splits = interleaved_splits
        self.cyclic_boundary = cyclic_boundary
        self.fixed_params = dict(fixed_params or {})
        # layer boundaries (`_boundaries`)
        self.fixed_inputs = {k: tuple(v) for k, v in (fixed_inputs or {}).items()}
        self.fixed_outputs = {k: tuple(v) for k, v in (fixed_outputs or {}).items()}
        self.leaving = frozenset(leaving or ())
        self.fixed_ops = dict(fixed_ops or {})      # op -> the name of the strategy it must take
        self.grad_inputs = frozenset(grad_inputs or ())
        # dims no model axis may split: the batch and the tokens
        self.data_dims: dict[str, tuple[int, ...]] = {
            k: tuple(sorted(set((batch_dims or {}).get(k, ())) | set((token_dims or {}).get(k, ()))))
            for k in set(batch_dims or {}) | set(token_dims or {})}
        self.model_axes = tuple(a for a in model_axes if self.mesh_shape[a] > 1) if self.data_dims else ()
        # Megatron-SP on the model axes: the tokens (not the batch) may be split between the
        # weight GEMMs (norms, dropout, residual adds on sequence slices), a row-parallel
        # output reduce-scattered into them and gathered before the next column-parallel GEMM
        self.sequence_parallel = bool(sequence_parallel) and bool(self.model_axes)
        if self.sequence_parallel:
            self.data_dims = {k: tuple(d for d in v if d in set((batch_dims or {}).get(k, ())))
                              for k, v in self.data_dims.items()}
            self._token_dims = {k: tuple(d for d in v if d not in set((batch_dims or {}).get(k, ())))
                                for k, v in (token_dims or {}).items()}
        self.axis_cost = tuple(b * (m - 1) / m if m > 1 else 0.0 for b, m in zip(mesh.beta, mesh.shape))
        self.warnings: list[str] = []
        self._edge_cache: dict = {}
        self._reads_cache: dict[str, bool] = {}
        self._kinds_cache: dict[str, list[str]] = {}
        self._param_axes_cache: dict[tuple[str, int], tuple[Strategy, tuple[int, ...]]] = {}
        self._select(nodes)
        self._requires_grad()
        self._sequence_boundary(nodes is not None)
        self._saved_for_backward()
        self._share_layers(share_layers)
        self._junctions()
        self._build_nodes()
        self._build_groups(merge)
        self._build_costs()
        self.build_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ which nodes
    def _select(self, nodes: Optional[Iterable[str]]) -> None:
        g = self.graph
        self.known = {n.name for n in g.nodes}
        if nodes is None:
            calls = [n.name for n in g.nodes if n.kind == "call"]
        else:
            calls = [n for n in nodes if g.node(n).kind == "call"]
        calls = [c for c in calls if g.node(c).outputs]             # asserts etc. have none
        self.calls = calls
        call_set = set(calls)
        producers: list[str] = []
        seen = set()
        for c in calls:
            for i in g.node(c).inputs:
                if i not in self.known or not g.node(i).outputs:
                    continue
                if i not in call_set and i not in seen:
                    seen.add(i)
                    producers.append(i)
        self.outer = producers                    # params, inputs, boundary tensors
        returned = {i for n in g.nodes if n.kind == "output" for i in n.inputs}
        outs = [c for c in calls if c in returned]
        self.output_refs = outs                   # tensors the graph returns (the loss)
        self.in_set = call_set | set(producers)
        self.cycle: Optional[tuple[str, str]] = None
        if self.cyclic_boundary and nodes is not None:
            # one layer of a stack: its output is the next copy's input, so the tensor entering
            # it arrives in the layout it leaves in (a reshard otherwise), as in steady state
            isfloat = lambda x: g.node(x).outputs[0].dtype.startswith(("float", "bfloat"))  # noqa: E731
            entering = [p for p in producers if g.node(p).kind == "call" and isfloat(p)]
            cons = g.consumers()
            leaving = [c for c in calls if isfloat(c) and any(
                x not in call_set and g.node(x).kind == "call" for x in cons.get(c, []))]
            if len(entering) == 1 and len(leaving) == 1 and \
                    g.node(entering[0]).outputs[0].shape == g.node(leaving[0]).outputs[0].shape:
                self.cycle = (leaving[0], entering[0])

    def _sequence_boundary(self, one_layer: bool) -> None:
        """Megatron-SP's convention between layers (`sequence_parallel`, solving one layer): the
        tensors a layer hands on with a gradient (the residual stream) cross every layer
        boundary split along their token dim on the model axes, so that separately solved
        layers meet in one layout: such a tensor entering the layer arrives so (`sp_fixed`, its
        only layout), and an op handing one on to a later layer produces it so (a row-parallel
        output reduce-scattered into it; the embedding's sum likewise)."""
        self.sp_fixed: dict[str, Spec] = {}
        if not (self.sequence_parallel and one_layer):
            return
        g = self.graph
        call_set = set(self.calls)
        cons = g.consumers()
        tp = math.prod(self.mesh_shape[a] for a in self.model_axes)
        # made by an earlier layer: a call, or an input of a layer's subgraph standing for one
        entering = [p for p in self.outer if g.node(p).kind == "call" or p in self.grad_inputs]
        # read by a later layer's op; in a layer's own subgraph (`stage_cost.graph_at`), where
        # those ops are absent, read by no op at all and not returned
        returned = set(self.output_refs)
        leaving = [c for c in self.calls if c not in returned and (
            any(x not in call_set and g.node(x).kind == "call" for x in cons.get(c, []))
            or not any(g.node(x).kind == "call" for x in cons.get(c, [])))]
        for t in entering + leaving:
            n = g.node(t)
            dims = self._token_dims.get(t, ())
            if not self.rg.get(t, False) or not n.outputs or not dims:
                continue
            shape = tuple(int(x) for x in n.outputs[0].shape)
            d = dims[0]
            if shape[d] % tp:
                continue
            self.sp_fixed[t] = tuple(f"S({d})" if a in self.model_axes else REPLICATE
                                     for a in range(len(self.mesh_shape)))

    def _requires_grad(self) -> None:
        self.rg = requires_grad_of(self.graph, self.grad_inputs)

    def _saved_for_backward(self) -> None:
        """Which tensors the backward pass holds (`cost_models.memory.saved_tensors`, the rules
        the inter-op memory model uses): an op's output costs memory only if some consumer
        saves it (through views, their base); side tensors (norm statistics, dropout masks,
        attention log-sum-exp) are charged to the op that makes them."""
        from cost_models.memory import saved_tensors, tensor_bases

        g = self.graph
        by_name = {n.name: n for n in g.nodes}
        base = tensor_bases(list(g.nodes), by_name, attention_kernel=self.attention_kernel)
        self.saved: set[str] = set()
        self.side_bytes: dict[str, float] = defaultdict(float)
        dt = self.dtype if self.dtype in ("bf16", "fp16", "fp32") else "fp32"
        for n in g.nodes:
            if n.kind != "call" or not n.outputs:
                continue
            try:
                items = saved_tensors(n, by_name, dt, attention_kernel=self.attention_kernel)
            except Exception:  # noqa: BLE001 - an odd op: keep its inputs, conservatively
                items = [(i, None) for i in n.inputs if i in by_name]
            for name, nbytes in items:
                if nbytes is None:
                    self.saved.add(base.get(name, name))
                else:
                    self.side_bytes[n.name] += nbytes

    # ------------------------------------------------------------------ identical layers
    def _share_layers(self, share: bool) -> None:
        g = self.graph
        rep = {n: n for n in self.in_set}
        if share:
            call_set = set(self.calls)
            first: dict[str, str] = {}
            for layer in g.layers:
                lnodes = [n for n in g.layer_nodes(layer) if n.outputs]
                if len(lnodes) < MIN_SHARED_LAYER_OPS or not all(n.name in call_set for n in lnodes):
                    continue
                sig = g.layer_signature(layer)
                if sig not in first:
                    first[sig] = layer
                    continue
                r_nodes = [n for n in g.layer_nodes(first[sig]) if n.outputs]
                if len(r_nodes) != len(lnodes):
                    continue
                trial: dict[str, str] = {}
                ok = True
                for a, b in zip(lnodes, r_nodes):
                    if a.target != b.target or len(a.inputs) != len(b.inputs):
                        ok = False
                        break
                    trial[a.name] = b.name
                    for ia, ib in zip(a.inputs, b.inputs):
                        if ia not in self.known or ib not in self.known:
                            continue
                        na, nb = g.node(ia), g.node(ib)
                        if na.kind in ("param", "buffer", "constant"):
                            if nb.kind != na.kind or trial.get(ia, ib) != ib or rep.get(ia, ia) != ia \
                                    or na.outputs[0].shape != nb.outputs[0].shape:
                                ok = False
                            trial[ia] = ib
                if ok:
                    rep.update(trial)
        self.rep = rep
        copies: dict[str, list[str]] = defaultdict(list)
        for n in self.in_set:
            copies[rep[n]].append(n)
        self.copies = copies

    # ------------------------------------------------------------------ junctions
    def _junctions(self) -> None:
        """A tensor read by several consumers gets a *junction*: one layout shared by its
        consumers (a gather paid once, not per consumer) and one place where their gradients
        are summed, optionally kept partial (one reduction for all, as Megatron's f does for
        q, k, v). Edges: producer -> junction -> each consumer."""
        g = self.graph
        uses: dict[tuple[str, int], int] = defaultdict(int)
        edges: list[tuple[str, int, str, int]] = []
        for c in self.calls:
            n = g.node(c)
            for k, i in enumerate(n.inputs):
                if i in self.in_set:
                    edges.append((i, output_index(n, k), c, k))
        for k, c in enumerate(self.output_refs):
            edges.append((c, 0, OUTPUT, k))
        if self.cycle is not None:
            edges.append((self.cycle[0], 0, self.cycle[1], 0))
        for p, o, _c, _k in edges:
            uses[(p, o)] += 1
        self.junction: dict[tuple[str, int], str] = {}
        for (p, o), cnt in uses.items():
            if cnt >= 2:
                self.junction[(p, o)] = f"{p}#{o}"
        self.actual_edges: list[tuple[str, int, str, int]] = []
        for p, o, c, k in edges:
            j = self.junction.get((p, o))
            self.actual_edges.append((j, o, c, k) if j else (p, o, c, k))
        for (p, o), j in self.junction.items():
            self.actual_edges.append((p, o, j, 0))
            rj = self.junction.get((self.rep[p], o), j)
            self.rep[j] = rj
            self.copies[rj].append(j)
            self.rg[j] = self.rg.get(p, False)

    def _junction_strategies(self, producer: OpNode, o: int, jname: str) -> list[Strategy]:
        """Layouts worth holding a shared tensor in: any its producer gives or a consumer
        wants; gradients kept partial along axes where some consumer leaves them partial."""
        nout = len(producer.outputs)
        specs: dict[Spec, None] = {}
        gp_axes: set[int] = set()
        pp = self.pnodes.get(producer.name)
        if pp is not None:
            for st in pp.strategies:
                specs[st.out_specs[o] if o < len(st.out_specs) else st.out_specs[0]] = None
        for p, _oo, c, k in self.actual_edges:
            if p == jname and self.rep.get(c, c) in self.pnodes:
                for st in self.pnodes[self.rep.get(c, c)].strategies:
                    specs[st.in_specs[k]] = None
                    gp_axes.update(st.grad_partial[k])
        specs[(REPLICATE,) * len(self.mesh_shape)] = None
        out = []
        for sp in specs:
            free = [a for a in sorted(gp_axes) if sp[a] == REPLICATE and self.mesh_shape[a] > 1]
            subsets = [()]
            if self.rg.get(producer.name, False):
                subsets = [c for r in range(len(free) + 1) for c in itertools.combinations(free, r)]
            for sub in subsets:
                name = " ".join(sp) + ("" if not sub else " grad " + " ".join(f"P@{a}" for a in sub))
                out.append(Strategy(name, [sp], [sp] * nout, [tuple(sub)]))
        return out

    # ------------------------------------------------------------------ strategies
    def _ctx(self, n: OpNode) -> OpContext:
        g = self.graph
        metas = []
        for k, i in enumerate(n.inputs):
            if i not in self.known:                       # a sub-graph (higher-order op) argument
                metas.append(TensorMeta((), "float32"))
                continue
            p = g.node(i)
            idx = output_index(n, k)
            metas.append(p.outputs[idx] if idx < len(p.outputs)
                         else (p.outputs[0] if p.outputs else TensorMeta((), "float32")))
        return OpContext(n, metas, self.mesh_shape, g, self.float_bytes, self.interleaved_splits)

    def itemsize(self, meta: TensorMeta) -> int:
        return self.float_bytes if meta.dtype.startswith(("float", "bfloat", "complex")) else meta.itemsize

    def _constant_ops(self) -> set[str]:
        """Calls that read no model input, activation or parameter, only constants and buffers
        (a rotary table from `arange`): the runtime computes them as plain, whole tensors."""
        g = self.graph
        live: set[str] = set()
        out: set[str] = set()
        for n in g.nodes:
            if n.kind in ("input", "param"):
                live.add(n.name)
            elif n.kind == "call":
                if any(i in live for i in n.inputs):
                    live.add(n.name)
                else:
                    out.add(n.name)
        return out

    def _build_nodes(self) -> None:
        g = self.graph
        self.constant_ops = self._constant_ops() if self.model_axes else set()
        self.pnodes: dict[str, PNode] = {}
        heavy_need = math.prod(m for m in self.mesh_shape if m > 1)
        jof: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for (p, o), j in self.junction.items():
            jof[p].append((j, o))
        order: list[tuple[str, int]] = []
        for name in list(self.outer) + list(self.calls):
            order.append((name, -1))
            order += [(j, o) for j, o in jof.get(name, [])]
        for name, o in order:
            if self.rep[name] != name:
                continue
            cnt = len(self.copies[name])
            if o >= 0:
                prod = g.node(name.rsplit("#", 1)[0])
                self.pnodes[name] = PNode(name, "junction", prod, [], "junction", cnt,
                                          self.rg.get(name, False))
                continue
            n = g.node(name)
            if name in self.outer:
                kind = {"param": "param", "input": "input"}.get(n.kind, "boundary" if n.kind == "call" else n.kind)
                shape = tuple(int(d) for d in n.outputs[0].shape) if n.outputs else ()
                specs = [sp for sp in all_specs(shape, self.mesh_shape) if not self._splits_batch(name, sp)
                         and (kind == "param" or self._model_whole([sp]))]
                pin = None
                if kind == "param" and self.fixed_params:
                    # a pin on any copy of a shared layer's parameter holds for all copies
                    fq = [g.node(c).fqn or c for c in self.copies[name]]
                    pins = {tuple(self.fixed_params[f]) for f in fq if f in self.fixed_params}
                    if len(pins) > 1:
                        raise PlanError(f"parameters {fq} of identical layers are pinned to different "
                                        f"placements {sorted(pins)}; pin them alike")
                    pin = pins.pop() if pins else None
                if name in self.sp_fixed:
                    specs = [self.sp_fixed[name]]       # sequence-sliced, as the layer before leaves it
                if name in self.fixed_inputs:
                    specs = [self.fixed_inputs[name]]   # as the layer that makes it leaves it
                if pin is not None:
                    if tuple(pin) not in specs:
                        raise PlanError(f"parameter {n.fqn or name} {shape} cannot be placed {tuple(pin)} on mesh "
                                        f"{self.mesh_shape}; one of {sorted(specs)}")
                    specs = [tuple(pin)]
                if self.cycle is not None and name == self.cycle[1]:
                    sts = [Strategy(" ".join(s), [s], [s], [()]) for s in specs]
                else:
                    sts = [Strategy(" ".join(s), [], [s]) for s in specs]
                self.pnodes[name] = PNode(name, kind, n, sts, kind, cnt, self.rg.get(name, False))
                continue
            ctx = self._ctx(n)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                sts, fam = rules_mod.strategies(ctx)
            for x in w:
                warnings.warn(x.message, stacklevel=4)
            if fam == "fallback":
                self.warnings.append(f"no sharding rule for op {n.op!r} ({name}); it runs replicated")
            if self.model_axes:
                sts = [st for st in sts if not self._strategy_splits_batch(n, st)] or sts
                if name in self.constant_ops:
                    sts = [st for st in sts if self._model_whole(st.out_specs)] or sts
            if self.mesh.device is None and n.op in HEAVY_OPS:
                full = [s for s in sts if s.work_div == heavy_need]
                sts = full or sts
            if name in self.sp_fixed:
                sts = [st for st in sts if st.out_specs and st.out_specs[0] == self.sp_fixed[name]] or sts
            sts = self._boundary_strategies(name, sts)
            if name in self.fixed_ops:
                want = [st for st in sts if st.name == self.fixed_ops[name]]
                if not want:
                    raise PlanError(f"op {name} ({n.op}) cannot take strategy {self.fixed_ops[name]!r} here; "
                                    f"one of {[st.name for st in sts]}")
                sts = want
            self.pnodes[name] = PNode(name, "call", n, sts, fam, cnt, self.rg.get(name, False))
        for name, pn in self.pnodes.items():
            if pn.kind == "junction":
                pn.strategies = self._junction_strategies(pn.node, int(name.rsplit("#", 1)[1]), name)
        self.pnodes[OUTPUT] = PNode(OUTPUT, "output", None, [Strategy(
            "output", [(REPLICATE,) * len(self.mesh_shape)] * len(self.output_refs), [],
            [()] * len(self.output_refs))], "output", 1)

    def _boundary_strategies(self, name: str, sts: list[Strategy]) -> list[Strategy]:
        """The strategies of op `name` that hand its output on across the layer's end as the
        layer boundaries require (`solve_graph`'s `fixed_outputs` and `leaving`): the pinned
        layout for the output the next copy of a stack receives; for any other tensor a later
        layer reads, no partial sum on a model axis (the executor would hand on unreduced
        summands, which the next layer's solution would have to reduce: the reduction stays
        with the op that makes it)."""
        if name in self.fixed_outputs:
            want = self.fixed_outputs[name]
            return [st for st in sts if st.out_specs and st.out_specs[0] == want] or sts
        if name in self.leaving and self.model_axes:
            return [st for st in sts if st.out_specs and not any(
                a < len(st.out_specs[0]) and st.out_specs[0][a] == PARTIAL for a in self.model_axes)] or sts
        return sts

    def _splits_batch(self, tensor: str, spec: Spec) -> bool:
        """Whether `spec` shards one of `tensor`'s batch or token dims along a model axis
        (`model_axes`: axes the runtime runs as tensor parallelism, where every rank sees the
        whole micro-batch and sequence)."""
        dims = self.data_dims.get(tensor, ())
        if not dims:
            return False
        for a in self.model_axes:
            d = shard_dim(spec[a]) if a < len(spec) else None
            if d is not None:
                if d in dims or (d < 0 and d + len(self._shape_of(tensor)) in dims):
                    return True
        return False

    def _shape_of(self, tensor: str) -> tuple:
        n = self.graph.node(tensor) if tensor in self.known else None
        return tuple(n.outputs[0].shape) if n is not None and n.outputs else ()

    def _input_kinds(self, n: OpNode) -> list[str]:
        """The node kind ("param", "call", ...) of each input of `n` ("" outside the graph)."""
        hit = self._kinds_cache.get(n.name)
        if hit is None:
            hit = self._kinds_cache[n.name] = [self.graph.node(i).kind if i in self.known else "" for i in n.inputs]
        return hit

    def _model_whole(self, specs) -> bool:
        """Whether every layout in `specs` is replicated on every model axis."""
        return all(sp[a] == REPLICATE for sp in specs for a in self.model_axes)

    def _strategy_splits_batch(self, n: OpNode, st: Strategy) -> bool:
        """Whether strategy `st` of op `n` is not model parallelism on a model axis: it splits a
        batch dim there, or it keeps every parameter it reads whole on that axis while splitting
        an activation (tokens or sequence over replicated weights: data or sequence
        parallelism), or it is a matrix op with weights that it does not split there (the axis
        would only repeat its work: tensor parallelism splits every weight GEMM, as Megatron's
        layers do; an op with no such strategy keeps its others)."""
        if any(self._splits_batch(n.name, sp) for sp in st.out_specs[:1]):
            return True
        if any(self._splits_batch(i, sp) for i, sp in zip(n.inputs, st.in_specs)):
            return True
        kinds = self._input_kinds(n)
        if "param" not in kinds:
            return False
        for a in self.model_axes:
            params = [sp[a] for k, sp in zip(kinds, st.in_specs) if k == "param" and a < len(sp)]
            acts = [sp[a] for k, sp in zip(kinds, st.in_specs) if k != "param" and a < len(sp)]
            if params and all(x == REPLICATE for x in params) and (
                    n.op in HEAVY_OPS or (any(map(is_shard, acts)) and not self._sequence_sliced(n, st, a))):
                return True
        return False

    def _sequence_sliced(self, n: OpNode, st: Strategy, axis: int) -> bool:
        """Whether `st` splits op `n`'s activations on `axis` only along their token dims
        (Megatron-SP's norms and element-wise ops; `sequence_parallel`)."""
        if not self.sequence_parallel:
            return False
        kinds = self._input_kinds(n)
        for i, k, sp in zip(n.inputs, kinds, st.in_specs):
            d = shard_dim(sp[axis]) if k != "param" and axis < len(sp) else None
            if d is None:
                continue
            if d < 0:
                d += len(self._shape_of(i))
            if d not in self._token_dims.get(i, ()):
                return False
        return True

    # ------------------------------------------------------------------ groups (merging)
    def _build_groups(self, merge: bool) -> None:
        self.groups: list[Group] = []
        for name, pn in self.pnodes.items():
            if merge and pn.kind == "call":
                main = self._main_operand(pn)
                if main is not None and self._merge(pn, self.pnodes[main[0]], main[1]):
                    continue
            pn.group = len(self.groups)
            self.groups.append(Group(name, [name], [{name: i} for i in range(len(pn.strategies))]))

    def _src(self, n: OpNode, k: int) -> str:
        """The problem node feeding input k of `n`: its producer, or the producer's junction."""
        i = n.inputs[k]
        return self.junction.get((i, output_index(n, k)), i)

    def _main_operand(self, f: PNode) -> Optional[tuple[str, list[int]]]:
        """The operand a follower op is merged into (Alpa §4.2): its only producer, or for an
        element-wise op with several, its only full-size operand. The producer must sit in the
        same layer (or neither be shared). Returns (producer's problem node, inputs it feeds)."""
        rule = rules_mod.rule_for(f.node.op)
        if rule is None or not rule.follow or not f.node.inputs:
            return None
        srcs = [self.rep.get(self._src(f.node, k), "?") for k in range(len(f.node.inputs))]
        out_shape = f.node.outputs[0].shape
        if len(set(srcs)) == 1:
            cands = srcs[:1]
        else:
            # only when the other operands are smaller (a scale, a bias, a rotary table): two
            # full-size operands (a residual add) keep their own choice, which costs ~1-4% less
            full = [k for k in range(len(srcs)) if self._ctx_meta(f.node, k) is not None
                    and self._ctx_meta(f.node, k).shape == out_shape]
            cands = [srcs[full[0]]] if len({srcs[k] for k in full}) == 1 and full else []
        for p in cands:
            pp = self.pnodes.get(p)
            if pp is not None and pp.kind in ("call", "junction") and pp.group >= 0 \
                    and (pp.node.layer == f.node.layer or (pp.count == 1 and f.count == 1)):
                return p, [k for k in range(len(srcs)) if srcs[k] == p]
        return None

    def _ctx_meta(self, n: OpNode, k: int) -> Optional[TensorMeta]:
        i = n.inputs[k]
        if i not in self.known:
            return None
        p = self.graph.node(i)
        o = output_index(n, k)
        return p.outputs[o] if o < len(p.outputs) else None

    def _merge(self, f: PNode, p: PNode, ks: list[int]) -> bool:
        grp = self.groups[p.group]
        oidx = output_index(f.node, ks[0])
        choice = []
        for ch in grp.choice:
            pst = p.strategies[ch[p.name]]
            sp = pst.out_specs[oidx]
            sgp = self._src_gp(p, pst)
            best, bkey = None, None
            for j, st in enumerate(f.strategies):
                c = self.node_cost(f, st)[0]
                for k in ks:
                    c += self.edge_cost(p.name, oidx, sp, f.name, k, st, sgp)[0]
                key = (round(c, 15), st.in_specs[ks[0]] != sp, j)
                if bkey is None or key < bkey:
                    best, bkey = j, key
            if PARTIAL in f.strategies[best].in_specs[ks[0]] and PARTIAL not in sp:
                # the follower's cheapest read makes a partial sum of a whole or split tensor
                # (free here) and hands it on: its reduction, an all-reduce of the whole
                # tensor, is paid where it ends, which this choice does not see. A split
                # K or V of 2 KV heads over 4 devices (column-parallel projections) was viewed
                # as a partial sum and all-reduced where an all-gather (half the bytes, half
                # the latency) would do: not merged, the ILP weighs both
                return False
            new = dict(ch)
            new[f.name] = best
            choice.append(new)
        grp.members.append(f.name)
        grp.choice = choice
        f.group = p.group
        return True

    # ------------------------------------------------------------------ costs
    def coll_time(self, kind: str, axes: tuple[int, ...], nbytes: float, phase: str = "forward") -> float:
        """Seconds of a collective: on one axis whose link carries measured timings, the
        table's (`cost_models.communication.measured_time`); over several axes, one ring over all
        their devices at the slowest axis' alpha and beta. Gradient synchronisation is bucketed (DDP/FSDP fuse the
        gradients of many parameters into one collective), so a gradient pays bandwidth only;
        the solution adds one latency per bucket (`BUCKET_BYTES`)."""
        if len(axes) == 1:
            n, alpha, beta = self.mesh_shape[axes[0]], self.mesh.alpha[axes[0]], self.mesh.beta[axes[0]]
            link = self.measured_link(kind, axes)
            if link is not None and phase == "grad_sync" and 0 < nbytes < BUCKET_BYTES:
                # a gradient smaller than a bucket (`BUCKET_BYTES`) travels in one with others: its
                # share of the table's time for a full one, latency included (`solution` adds no
                # alpha on such an axis and prices the last, partly filled bucket at its own size);
                # a larger one is a bucket of its own (DDP), timed below at its size
                return nbytes * bucket_rate(kind, n, link)
            if link is not None:
                # the axis' link measured (`LogicalMesh.links`): its table, latency included
                t = measured_time(kind, nbytes, n, link)
                return t if t is not None else 0.0
        else:
            n = math.prod(self.mesh_shape[a] for a in axes)
            alpha, beta = max(self.mesh.alpha[a] for a in axes), max(self.mesh.beta[a] for a in axes)
        if phase == "grad_sync":
            alpha = 0.0
        return collective_time(kind, nbytes, n, alpha, beta)

    def measured_link(self, kind: str, axes: tuple[int, ...]) -> Optional[LinkSpec]:
        """The link whose measured table times `kind` on `axes` (one axis whose link carries
        rows of that kind, `LogicalMesh.links`), else None: the alpha-beta formula."""
        if len(axes) != 1 or self.mesh.links is None or self.mesh_shape[axes[0]] <= 1:
            return None
        link = self.mesh.links[axes[0]]
        return link if link is not None and any(m.kind == kind for m in link.measured) else None

    def compute_time(self, pn: PNode, st: Strategy) -> tuple[float, float]:
        """(forward, backward) compute seconds of one copy of op `pn` under `st`."""
        if self.mesh.device is None or pn.node is None:
            return 0.0, 0.0
        if self.reshape_copies is None:
            self.reshape_copies = graph_layout_copies(self.graph, self.mesh.device.device_type, self.attention_kernel)
        return op_compute_time(pn.node, self.rg, pn.requires_grad, self.mesh.device, self.dtype, st.work_div,
                               self.graph._index, self.attention_kernel, self.reshape_copies,
                               fusion_of(self.graph, self.mesh.device, self.attention_kernel, self.pointwise_fusion),
                               graph_fp32_tensors(self.graph, self.mesh.device.device_type, self.dtype,
                                                  self.attention_kernel, self.autocast))

    def node_cost(self, pn: PNode, st: Strategy) -> tuple[float, float, float, float]:
        """(total, forward, backward, grad_sync) seconds of one copy, excluding resharding."""
        if pn.kind != "call":
            return 0.0, 0.0, 0.0, 0.0
        fwd, bwd = self.compute_time(pn, st)
        sync = 0.0
        for kind, axes, nbytes, phase in st.comms:
            df, db, ds = by_phase(phase, self.coll_time(kind, axes, nbytes, phase))
            fwd, bwd, sync = fwd + df, bwd + db, sync + ds
        return fwd + bwd + sync, fwd, bwd, sync

    def tie_break(self, pn: PNode, st: Strategy) -> float:
        """A negligible cost that settles ties: ops split their work, inputs and parameters
        are held in their smallest layout (so a batch split shows in the input's placement
        rather than as a free local slice after it)."""
        if pn.node is None:
            return 0.0
        if pn.kind in ("input", "boundary", "param"):
            return TIE_BREAK_S_PER_FLOP * self.memory_bytes_of(pn, st)
        if self.mesh.device is not None or pn.kind != "call":
            return 0.0
        return TIE_BREAK_S_PER_FLOP * (pn.node.flops + pn.node.bytes_moved) / st.work_div

    def memory_bytes_of(self, pn: PNode, st: Strategy) -> float:
        meta = pn.node.outputs[0]
        return local_numel(tuple(int(d) for d in meta.shape), st.out_specs[0], self.mesh_shape) * self.itemsize(meta)

    def memory(self, pn: PNode, st: Strategy) -> float:
        if pn.kind == "output" or pn.node is None:
            return 0.0
        n = pn.node
        if pn.kind == "param":
            shape = tuple(int(d) for d in n.outputs[0].shape)
            return (local_numel(shape, st.out_specs[0], self.mesh_shape) * self.itemsize(n.outputs[0])
                    * self.state_factor)
        if pn.kind in ("boundary", "junction"):
            return 0.0
        if pn.kind == "call":
            tot = self.side_bytes.get(n.name, 0.0) / st.work_div
            if n.name in self.saved:
                for o, s in zip(n.outputs, st.out_specs):
                    tot += local_numel(tuple(int(d) for d in o.shape), s, self.mesh_shape) * self.itemsize(o)
            return tot
        tot = 0.0
        for o, s in zip(n.outputs, st.out_specs):
            tot += local_numel(tuple(int(d) for d in o.shape), s, self.mesh_shape) * self.itemsize(o)
        return tot

    @staticmethod
    def _src_gp(pn: PNode, st: Strategy) -> tuple[int, ...]:
        """Axes along which a junction keeps its consumers' summed gradient partial."""
        return st.grad_partial[0] if pn.kind == "junction" else ()

    def edge_collectives(self, prod: str, oidx: int, src: Spec, cons: str, k: int,
                         st: Strategy, src_gp: tuple[int, ...] = ()) -> list[tuple[str, int, float, str, str]]:
        """Collectives (kind, axis, bytes, phase, reason) of feeding output `oidx` of `prod`
        (laid out `src`) to input `k` of `cons` under strategy `st`."""
        u = st.in_specs[k]
        partial = st.grad_partial[k] if k < len(st.grad_partial) else ()
        pn = self.pnodes[prod]
        meta = pn.node.outputs[oidx] if pn.node is not None and oidx < len(pn.node.outputs) else pn.node.outputs[0]
        is_param = pn.kind == "param" or (pn.kind == "junction" and pn.node.kind == "param")
        reads = is_param and self.backward_reads(cons, k)
        key = (prod, oidx, src, u, partial, src_gp, reads)
        hit = self._edge_cache.get(key)
        if hit is not None:
            return hit
        shape = tuple(int(d) for d in meta.shape)
        isz = self.itemsize(meta)
        out = [(kind, a, b, "forward", "reshard") for kind, a, b in self._transition(shape, isz, src, u)]
        if self.rg.get(pn.name, False):
            # the gradient of a summand of a partial tensor is the whole (replicated) gradient
            gspec = tuple(PARTIAL if a in partial else REPLICATE if p == PARTIAL else p for a, p in enumerate(u))
            target = tuple(PARTIAL if a in src_gp else REPLICATE if p == PARTIAL else p for a, p in enumerate(src))
            for kind, a, b in self._transition(shape, isz, gspec, target):
                out.append((kind, a, b, "grad_sync" if is_param else "backward", "grad"))
            if is_param and reads:
                for kind, a, b, ph, _ in list(out):
                    if kind == "all_gather" and ph == "forward":
                        out.append(("all_gather", a, b, "backward", "re-gather sharded param"))
        self._edge_cache[key] = out
        return out

    def _transition(self, shape: tuple, isz: int, src: Spec, dst: Spec) -> tuple:
        """`placement.transition`, except that a partial sum on a model axis that is wanted
        sharded is all-reduced whole first (then sliced for free): the executor reduces a
        row-parallel output at once, as Megatron without sequence parallelism, never by a reduce-scatter
        into slices of the activation (Megatron-SP), which the runtime does not run."""
        ms, ac = self.mesh_shape, self.axis_cost
        fix = [] if self.sequence_parallel else [a for a in self.model_axes if src[a] == PARTIAL and is_shard(dst[a])]
        if not fix:
            return transition(shape, isz, src, dst, ms, ac)
        mid = tuple(REPLICATE if a in fix else p for a, p in enumerate(src))
        return tuple(transition(shape, isz, src, mid, ms, ac)) + tuple(transition(shape, isz, mid, dst, ms, ac))

    def backward_reads(self, cons: str, k: int) -> bool:
        """Whether the backward pass reads input `k` of problem node `cons` as it arrived
        (`BACKWARD_SKIPS`); for a junction, whether it does for any of the junction's consumers.
        An op of CUDA autocast's fp32 list in a 2-byte run (a layer norm) saves the fp32 copy
        autocast makes of its input, not the input: a parameter gathered for it is not gathered
        again for the backward (the executor re-gathers what lives in the gathered storage,
        `execute._Regather`; HF GPT-2 tp2 on dgx-a100-80g, its 50 norm weights and biases stored
        sharded over tp: 50 all-gathers a micro-batch fewer than the plan said, counted by
        `autopar verify`)."""
        pn = self.pnodes.get(cons)
        if pn is None or pn.kind == "output":
            return False
        if pn.kind != "junction":
            return pn.node is None or (k not in BACKWARD_SKIPS.get(pn.node.op, ())
                                       and pn.node.op not in self.cast_reads)
        hit = self._reads_cache.get(cons)
        if hit is None:
            hit = self._reads_cache[cons] = any(self.backward_reads(self.rep.get(c, c), kk)
                                                for p, _, c, kk in self.actual_edges if p == cons)
        return hit

    def _split_param_axes(self, cons: str, st: Strategy) -> tuple[int, ...]:
        """Model axes along which strategy `st` of problem node `cons` reads a split parameter
        (cached: every edge cost into `cons` asks, per strategy pair)."""
        hit = self._param_axes_cache.get((cons, id(st)))
        if hit is not None and hit[0] is st:
            return hit[1]
        pn = self.pnodes.get(cons)
        if not self.model_axes or pn is None or pn.kind != "call":
            return ()
        kinds = self._input_kinds(pn.node)
        axes = tuple(a for a in self.model_axes
                     if any(kd == "param" and is_shard(sp[a]) for kd, sp in zip(kinds, st.in_specs)))
        self._param_axes_cache[(cons, id(st))] = (st, axes)
        return axes

    def _unrunnable(self, prod: str, src: Spec, cons: str, k: int, st: Strategy) -> bool:
        """Whether the edge slices a whole or partial activation on a model axis for an op that
        reads no parameter split there. DTensor never does that (an op on replicated operands
        gives a replicated result; only a sharded parameter makes it slice its other operand),
        so the runtime would not run the layout (a residual add on hidden slices, say)."""
        if not self.model_axes or self.sequence_parallel:
            return False        # the executor slices whatever the plan says (DTensor would not)
        pn = self.pnodes[prod]
        if pn.kind == "param" or (pn.node is not None and pn.node.kind == "param"):
            return False
        u = st.in_specs[k]
        bad = [a for a in self.model_axes if src[a] in (REPLICATE, PARTIAL) and is_shard(u[a])]
        return bool(bad) and not set(bad) <= set(self._split_param_axes(cons, st))

    def edge_cost(self, prod: str, oidx: int, src: Spec, cons: str, k: int,
                  st: Strategy, src_gp: tuple[int, ...] = ()) -> tuple[float, float, float, float]:
        """The edge's training time (total, forward, backward, gradient sync); the total also
        carries `UNRUNNABLE_S` for a layout the runtime would not run (`_unrunnable`)."""
        fwd = bwd = sync = 0.0
        for kind, a, b, ph, _ in self.edge_collectives(prod, oidx, src, cons, k, st, src_gp):
            df, db, ds = by_phase(ph, self.coll_time(kind, (a,), b, ph))
            fwd, bwd, sync = fwd + df, bwd + db, sync + ds
        pen = UNRUNNABLE_S if self._unrunnable(prod, src, cons, k, st) else 0.0
        return fwd + bwd + sync + pen, fwd, bwd, sync

    def _out_spec(self, grp: Group, gi: int, member: str, oidx: int) -> tuple[Spec, tuple[int, ...]]:
        pn = self.pnodes[member]
        st = pn.strategies[grp.choice[gi][member]]
        return st.out_specs[oidx], self._src_gp(pn, st)

    def _edges(self):
        """(rep producer, out index, rep consumer, input index) -> multiplicity, every edge."""
        mult: dict[tuple, int] = defaultdict(int)
        for p, o, c, k in self.actual_edges:
            mult[(self.rep[p], o, self.rep.get(c, c), k)] += 1
        return mult

    def _build_costs(self) -> None:
        G = self.groups
        self.lin = [[0.0] * grp.size for grp in G]
        self.tie = [[0.0] * grp.size for grp in G]
        self.mem = [[0.0] * grp.size for grp in G]
        for gi, grp in enumerate(G):
            for m in grp.members:
                pn = self.pnodes[m]
                for s, ch in enumerate(grp.choice):
                    st = pn.strategies[ch[m]]
                    self.lin[gi][s] += pn.count * self.node_cost(pn, st)[0]
                    self.tie[gi][s] += pn.count * self.tie_break(pn, st)
                    self.mem[gi][s] += pn.count * self.memory(pn, st)
        terms: dict[tuple, EdgeTerm] = {}
        self.edge_list = self._edges()
        for (p, oidx, c, k), cnt in self.edge_list.items():
            pp, pc = self.pnodes[p], self.pnodes[c]
            gu, gv = pp.group, pc.group
            Gu, Gv = G[gu], G[gv]
            if gu == gv:
                for s in range(Gu.size):
                    st = pc.strategies[Gv.choice[s][c]]
                    src, sgp = self._out_spec(Gu, s, p, oidx)
                    self.lin[gu][s] += cnt * self.edge_cost(p, oidx, src, c, k, st, sgp)[0]
                continue
            srcs = [self._out_spec(Gu, s, p, oidx) for s in range(Gu.size)]
            need = [(pc.strategies[Gv.choice[s][c]].in_specs[k],
                     pc.strategies[Gv.choice[s][c]].grad_partial[k],
                     self._split_param_axes(c, pc.strategies[Gv.choice[s][c]])) for s in range(Gv.size)]
            cu, ru = _classes(srcs)
            cv, rv = _classes(need)
            cost = [[0.0] * len(rv) for _ in ru]
            for a in range(len(ru)):
                for b in range(len(rv)):
                    st = pc.strategies[Gv.choice[cv.index(b)][c]]
                    src, sgp = srcs[cu.index(a)]
                    cost[a][b] = cnt * self.edge_cost(p, oidx, src, c, k, st, sgp)[0]
            if len(ru) == 1:
                for s in range(Gv.size):
                    self.lin[gv][s] += cost[0][cv[s]]
                continue
            if len(rv) == 1:
                for s in range(Gu.size):
                    self.lin[gu][s] += cost[cu[s]][0]
                continue
            key = (gu, gv, tuple(cu), tuple(cv))
            t = terms.get(key)
            if t is None:
                t = terms[key] = EdgeTerm(gu, gv, tuple(cu), tuple(cv),
                                          [[0.0] * len(rv) for _ in ru])
            for a in range(len(ru)):
                for b in range(len(rv)):
                    t.cost[a][b] += cost[a][b]
        self.terms = [t for t in terms.values() if any(x > 0 for row in t.cost for x in row)]

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, assign: list[int]) -> float:
        """The ILP objective of one strategy per group (seconds, without tie-breaks)."""
        tot = sum(self.lin[g][s] for g, s in enumerate(assign))
        for t in self.terms:
            tot += t.cost[t.cls_u[assign[t.u]]][t.cls_v[assign[t.v]]]
        return tot

    def memory_of(self, assign: list[int]) -> float:
        return sum(self.mem[g][s] for g, s in enumerate(assign))

    # ------------------------------------------------------------------ solve
    def _model(self):
        """The ILP in solver-neutral form, one method per part of the formulation: variables
        and objective (`_strategy_vars`, `_edge_vars`), then the constraint families
        (`_one_hot_rows`, `_edge_rows`, `_memory_row`). Equality rows are ({var: coef}, rhs)."""
        cost: list[float] = []
        names: list[str] = []
        xidx, const = self._strategy_vars(cost, names)
        evars = self._edge_vars(cost, names)
        rows = self._one_hot_rows(xidx) + self._edge_rows(xidx, evars)
        return cost, names, xidx, rows, self._memory_row(xidx), const

    def _strategy_vars(self, cost: list[float], names: list[str]) -> tuple[list[list[Optional[int]]], float]:
        """x_{v,i} with objective c_{v,i}; a group with one strategy is a constant."""
        xidx: list[list[Optional[int]]] = []
        const = 0.0
        for gi, grp in enumerate(self.groups):
            if grp.size == 1:
                xidx.append([None])
                const += self.lin[gi][0] + self.tie[gi][0]
                continue
            ids = []
            for s_ in range(grp.size):
                ids.append(len(cost))
                cost.append(self.lin[gi][s_] + self.tie[gi][s_])
                names.append(f"x{gi}_{s_}")
            xidx.append(ids)
        return xidx, const

    def _edge_vars(self, cost: list[float], names: list[str]) -> list[list[list[int]]]:
        """e_{uv,ab} with objective R_{uv,ab}, per edge term."""
        out = []
        for ti, t in enumerate(self.terms):
            e = []
            for a, row in enumerate(t.cost):
                e.append([])
                for b, c in enumerate(row):
                    e[a].append(len(cost))
                    cost.append(c)
                    names.append(f"e{ti}_{a}_{b}")
            out.append(e)
        return out

    @staticmethod
    def _one_hot_rows(xidx) -> list[tuple[dict[int, float], float]]:
        """one_hot: Σ_i x_{v,i} = 1."""
        return [({i: 1.0 for i in ids}, 1.0) for ids in xidx if ids[0] is not None]

    def _edge_rows(self, xidx, evars) -> list[tuple[dict[int, float], float]]:
        """edge_rows / edge_cols: Σ_b e_ab = Σ_{i∈a} x_{u,i};  Σ_a e_ab = Σ_{j∈b} x_{v,j}."""
        G = self.groups
        rows = []
        for t, e in zip(self.terms, evars):
            na, nb = len(t.cost), len(t.cost[0])
            for a in range(na):
                row = {e[a][b]: 1.0 for b in range(nb)}
                for s_ in range(G[t.u].size):
                    if t.cls_u[s_] == a:
                        row[xidx[t.u][s_]] = -1.0
                rows.append((row, 0.0))
            for b in range(nb):
                row = {e[a][b]: 1.0 for a in range(na)}
                for s_ in range(G[t.v].size):
                    if t.cls_v[s_] == b:
                        row[xidx[t.v][s_]] = -1.0
                rows.append((row, 0.0))
        return rows

    def _memory_row(self, xidx) -> Optional[tuple[dict[int, float], float]]:
        """memory: Σ m_{v,i} x_{v,i} ≤ M (None without a budget)."""
        if self.budget is None:
            return None
        G = self.groups
        fixed = sum(self.mem[gi][0] for gi, grp in enumerate(G) if grp.size == 1)
        coefs = {}
        for gi, grp in enumerate(G):
            if grp.size > 1:
                for s_ in range(grp.size):
                    if self.mem[gi][s_]:
                        coefs[xidx[gi][s_]] = self.mem[gi][s_]
        return coefs, self.budget - fixed

    def solve(self, time_limit_s: float = 10.0, workers: int = 2, backend: str = "cp-sat") -> tuple[list[int], dict]:
        """Solve with CP-SAT (`backend="cp-sat"`, integer-scaled costs) or a MIP solver through
        pywraplp (`"highs"`, `"scip"`, `"cbc"`). Returns (strategy per group, info)."""
        cost, names, xidx, rows, mem_row, const = self._model()
        nvars, ncons = len(cost), len(rows) + (mem_row is not None)
        t0 = time.perf_counter()
        if backend == "cp-sat":
            vals, status, obj, bound = self._solve_cpsat(cost, rows, mem_row, time_limit_s, workers)
        else:
            vals, status, obj, bound = self._solve_mip(backend, cost, rows, mem_row, time_limit_s)
        dt = time.perf_counter() - t0
        info = {"status": status, "solve_time_s": dt, "num_variables": nvars, "num_constraints": ncons,
                "backend": backend}
        if vals is None:
            return [], info
        assign = []
        for ids in xidx:
            if ids[0] is None:
                assign.append(0)
            else:
                assign.append(max(range(len(ids)), key=lambda s_: vals[ids[s_]]))
        assign = self._shard_inputs(assign)
        obj += const
        bound += const
        info["gap"] = 0.0 if status == "OPTIMAL" or obj <= 0 else max(0.0, (obj - bound) / obj)
        return assign, info

    def _shard_inputs(self, assign: list[int]) -> list[int]:
        """An input held replicated but read by every consumer in one sharded layout (a free
        local slice) is given that layout instead: same cost, less memory, and the placement
        says what the runtime must feed."""
        assign = list(assign)
        base = self.evaluate(assign)
        for gi, grp in enumerate(self.groups):
            pn = self.pnodes[grp.root]
            if pn.kind != "input" or grp.size == 1:
                continue
            wanted = set()
            for p, _o, c, k in self.actual_edges:
                if self.rep.get(p, p) != grp.root:
                    continue
                rc = self.rep.get(c, c)
                cg = self.pnodes[rc].group
                st = self.pnodes[rc].strategies[self.groups[cg].choice[assign[cg]][rc]]
                wanted.add(st.in_specs[k])
            if len(wanted) != 1:
                continue
            (u,) = wanted
            cur = pn.strategies[grp.choice[assign[gi]][grp.root]].out_specs[0]
            if u == cur or PARTIAL in u:
                continue
            cur_st = pn.strategies[grp.choice[assign[gi]][grp.root]]
            for s_ in range(grp.size):
                st = pn.strategies[grp.choice[s_][grp.root]]
                if st.out_specs[0] == u:
                    if self.memory_bytes_of(pn, st) >= self.memory_bytes_of(pn, cur_st):
                        break
                    trial = list(assign)
                    trial[gi] = s_
                    new = self.evaluate(trial)
                    if new <= base * (1 + 1e-9) + 1e-15:
                        assign, base = trial, new
                    break
        return assign

    def _solve_cpsat(self, cost, rows, mem_row, time_limit_s, workers):
        from ortools.sat.python import cp_model

        m = cp_model.CpModel()
        bound = sum(abs(c) for c in cost) or 1.0
        scale = 1e12 / bound
        xs = [m.NewBoolVar(f"v{i}") for i in range(len(cost))]
        for row, rhs in rows:
            if rhs == 1.0 and all(v == 1.0 for v in row.values()):
                m.AddExactlyOne([xs[i] for i in row])
            else:
                m.Add(sum(int(c) * xs[i] for i, c in row.items()) == int(rhs))
        if mem_row is not None:
            coefs, rhs = mem_row
            m.Add(sum(int(math.ceil(c)) * xs[i] for i, c in coefs.items()) <= int(math.floor(rhs)))
        m.Minimize(sum(int(round(c * scale)) * xs[i] for i, c in enumerate(cost) if round(c * scale)))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit_s)
        solver.parameters.num_workers = workers
        st = solver.Solve(m)
        name = solver.StatusName(st)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, name, 0.0, 0.0
        vals = [solver.Value(x) for x in xs]
        return vals, name, solver.ObjectiveValue() / scale, solver.BestObjectiveBound() / scale

    def _solve_mip(self, backend, cost, rows, mem_row, time_limit_s):
        from ortools.linear_solver import pywraplp

        solver = pywraplp.Solver.CreateSolver(backend.upper())
        if solver is None:
            raise ValueError(f"MIP backend {backend!r} is not available in this OR-Tools build")
        scale = 1e6 / (sum(abs(c) for c in cost) or 1.0)
        xs = [solver.BoolVar(f"v{i}") for i in range(len(cost))]
        for row, rhs in rows:
            ct = solver.Constraint(rhs, rhs)
            for i, c in row.items():
                ct.SetCoefficient(xs[i], c)
        if mem_row is not None:
            coefs, rhs = mem_row
            ct = solver.Constraint(-solver.infinity(), rhs / 2**20)
            for i, c in coefs.items():
                ct.SetCoefficient(xs[i], c / 2**20)
        obj = solver.Objective()
        for i, c in enumerate(cost):
            if c:
                obj.SetCoefficient(xs[i], c * scale)
        obj.SetMinimization()
        solver.SetTimeLimit(int(time_limit_s * 1000))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, 1e-6)
        st = solver.Solve(params)
        names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
                 pywraplp.Solver.INFEASIBLE: "INFEASIBLE", pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED"}
        name = names.get(st, str(st))
        if st not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return None, name, 0.0, 0.0
        vals = [x.solution_value() for x in xs]
        o = obj.Value() / scale
        try:
            b = obj.BestBound() / scale
        except Exception:  # noqa: BLE001
            b = o
        return vals, name, o, b

    # ------------------------------------------------------------------ read back
    def solution(self, assign: list[int], info: dict) -> ShardingSolution:
        g = self.graph
        G = self.groups
        chosen: dict[str, Strategy] = {}
        for gi, grp in enumerate(G):
            for mname in grp.members:
                chosen[mname] = self.pnodes[mname].strategies[grp.choice[assign[gi]][mname]]

        def strat(name: str) -> Strategy:
            return chosen[self.rep[name]]

        colls: list[Collective] = []
        fwd = bwd = sync = 0.0
        op_choices: dict[str, OpChoice] = {}
        comm_of: dict[str, float] = defaultdict(float)
        layouts: dict[str, tuple[int, int]] = {}

        def add(kind, axes, nbytes, phase, op, reason, tensor=""):
            nonlocal fwd, bwd, sync
            t = self.coll_time(kind, axes, nbytes, phase)
            df, db, ds = by_phase(phase, t)
            fwd, bwd, sync = fwd + df, bwd + db, sync + ds
            comm_of[op] += t
            if t > 0 or nbytes > 0:
                colls.append(Collective(kind, tuple(axes), float(nbytes), phase, op, t, reason, tensor))

        compute: dict[str, float] = {}
        forward: dict[str, float] = {}
        for c in self.calls:
            pn = self.pnodes[self.rep[c]]
            st = strat(c)
            f, b = self.compute_time(pn, st)
            fwd += f
            bwd += b
            compute[c] = f + b
            forward[c] = f
            for kind, axes, nbytes, phase in st.comms:
                add(kind, axes, nbytes, phase, c, pn.family)
        consumers = [(c, g.node(c)) for c in self.calls]
        out_st = self.pnodes[OUTPUT].strategies[0]

        def label(x: str) -> str:
            base = x.rsplit("#", 1)[0] if "#" in x else x
            nd = g.node(base)
            return nd.fqn if nd.kind == "param" and nd.fqn else base

        for p, o, c, k in self.actual_edges:
            pn = self.pnodes[self.rep[p]]
            pst = strat(p)
            src, sgp = pst.out_specs[o], self._src_gp(pn, pst)
            if c == OUTPUT:
                st, rc, at = out_st, OUTPUT, "output"
            else:
                st, rc = strat(c), self.rep[c]
                at = c if "#" not in c else p          # producer -> junction: charged to the producer
            for kind, a, b, ph, why in self.edge_collectives(self.rep[p], o, src, rc, k, st, sgp):
                add(kind, (a,), b, ph, at, f"{why} of {label(p)}", p.rsplit("#", 1)[0] if "#" in p else p)
        for c, n in consumers:
            st = strat(c)
            op_choices[c] = OpChoice(st.name, list(st.out_specs), compute[c], comm_of.get(c, 0.0),
                                     list(st.in_specs), self.pnodes[self.rep[c]].family, forward[c])
            if st.note.startswith("interleaved"):
                _, dim, chunks = st.note.split(":")
                self._record_interleave(n.inputs[0], int(dim), int(chunks), layouts)
        params: dict[str, tuple[str, ...]] = {}
        inputs: dict[str, tuple[str, ...]] = {}
        pbytes = abytes = 0.0
        for o in self.outer:
            n = g.node(o)
            sp = strat(o).out_specs[0]
            if n.kind == "param":
                params[n.fqn] = sp
                pbytes += (local_numel(tuple(int(d) for d in n.outputs[0].shape), sp, self.mesh_shape)
                           * self.itemsize(n.outputs[0]))
            elif n.kind == "input":
                inputs[o] = sp
            elif n.kind == "call":
                inputs[o] = sp
        for c in self.calls:
            pn = self.pnodes[self.rep[c]]
            abytes += self.memory(pn, strat(c))
        # the layout each tensor is consumed in: its junction's, or its single consumer's
        acts: dict[str, tuple[str, ...]] = {}
        for p, o, c, k in self.actual_edges:
            if o != 0 or "#" in p or p not in self.in_set or g.node(p).kind != "call":
                continue
            if c == OUTPUT:
                acts[p] = self.pnodes[OUTPUT].strategies[0].in_specs[k]
            elif "#" in c:
                acts[p] = strat(c).in_specs[0]
            else:
                acts.setdefault(p, strat(c).in_specs[k])
        mods: dict[str, tuple[str, ...]] = {}
        for c in self.calls:
            n = g.node(c)
            if n.module_path and c in acts:
                mods[n.module_path] = acts[c]              # the last op of a module wins
        junctions = {j: (strat(j).in_specs[0], tuple(strat(j).grad_partial[0]))
                     for j in self.junction.values()}
        # tied names of a parameter share its placement
        for fq, sp in list(params.items()):
            info_p = g.params.get(fq)
            for t in (info_p.tied if info_p else []):
                params.setdefault(t, sp)
        # one latency per gradient bucket (per kind and mesh axis)
        buckets: dict[tuple, float] = defaultdict(float)
        for c in colls:
            if c.phase == "grad_sync":
                if self.measured_link(c.kind, c.mesh_axes) is not None and c.bytes >= BUCKET_BYTES:
                    continue          # a bucket of its own, timed by the table (latency included)
                buckets[(c.kind, c.mesh_axes)] += c.bytes
        for (kind, axes), nbytes in buckets.items():
            n = math.prod(self.mesh_shape[a] for a in axes)
            link = self.measured_link(kind, axes)
            if link is not None:
                # the table's times hold the latency: the gradients that share buckets were priced
                # at a full bucket's rate (`coll_time`); the last, partly filled, takes its own time
                tail = nbytes - BUCKET_BYTES * math.floor(nbytes / BUCKET_BYTES)
                if tail > 0:
                    sync += max(0.0, measured_time(kind, tail, n, link) - tail * bucket_rate(kind, n, link))
                continue
            alpha = max(self.mesh.alpha[a] for a in axes)
            steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1)
            sync += steps * alpha * max(1, math.ceil(nbytes / BUCKET_BYTES))
        obj = fwd + bwd + sync
        return ShardingSolution(
            param_placements=params, input_placements=inputs, collectives=colls, objective=obj,
            op_choices=op_choices, forward_s=fwd, backward_s=bwd, grad_sync_s=sync,
            param_bytes_per_device=pbytes, activation_bytes_per_device=abytes,
            solve_time_s=info.get("solve_time_s", 0.0), gap=info.get("gap", 0.0),
            num_variables=info.get("num_variables", 0), num_constraints=info.get("num_constraints", 0),
            mesh_shape=self.mesh_shape, status=info.get("status", ""), param_layouts=layouts,
            # what the budget bounds (`_memory_row`): with the model's inputs, which `abytes` lacks
            memory_bytes_per_device=self.memory_of(assign), build_time_s=self.build_time_s,
            num_groups=len(self.groups), warnings=list(dict.fromkeys(self.warnings)),
            activation_placements=acts, module_output_placements=mods, junctions=junctions,
            model_axes=() if self.sequence_parallel else self.model_axes)

    def _record_interleave(self, tensor: str, dim: int, chunks: int, layouts: dict) -> None:
        """The projection producing `tensor` (split chunk-interleaved along its last dim) reads
        weights whose output features must be laid out interleaved (`rules.view.fused_weight`)."""
        from autopar.intra_op.rules.view import fused_weight

        for fqn, d in fused_weight(self.graph, tensor) or ():
            layouts[fqn] = (d, chunks)


def _classes(items: list) -> tuple[list[int], list]:
    """Class index of each item, and the distinct items in first-seen order."""
    idx: dict = {}
    reps: list = []
    cls = []
    for it in items:
        if it not in idx:
            idx[it] = len(reps)
            reps.append(it)
        cls.append(idx[it])
    return cls, reps
