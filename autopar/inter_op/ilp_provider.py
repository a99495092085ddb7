"""Layer costs from the intra-op ILP (Alpa §4) instead of the analytic Megatron rules.

Per (layer signature, micro-batch, tp) the ILP (`autopar.intra_op.solve_graph`) shards the
layer's ops over a 1-D tp mesh of the first tp ranks of a node (`cost_models.logical_mesh`);
its forward/backward time (compute + collectives), its per-iteration gradient sync on the tp
axis (when it uses that axis for the batch), its parameter placements and its collectives give
the LayerCost. Activation memory stays the graph-liveness model of `cost_models.memory`, with
each op's output divided by the mesh axes its chosen output placement shards. The extra forward
of recomputation is the analytic provider's fraction of the forward applied to the ILP's
forward. Layers are solved apart and meet at their boundaries (`IlpProvider._boundaries`): a
tensor entering a layer arrives as the layer making it leaves it, the reader paying any
redistribution (greedy, in model order: a layer does not see what the next would prefer). The
first user of a tied parameter (an output layer reading the embedding's weight), whose choice
the layers before it follow, is solved once without its arrivals to break that cycle, and again
with them and its choice pinned (`_settle`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from pathlib import Path
from typing import Optional

from autopar.capture.graph import OpGraph
from autopar.inter_op.ilp_cache import CostCache, IlpCache, cost_key, graph_digest, solve_key
from autopar.inter_op.layers import Layer, op_name_mapping
from autopar.inter_op.stage_cost import AnalyticProvider, LayerCost, autocast_device, fill_activations, float_bytes
from autopar.inter_op.tp_overlap import tp_overlap_deltas
from autopar.intra_op.solution import ShardingSolution
from autopar.schema import ClusterSpec, PlanError
from autopar.schema.placement import is_shard, shard_dim
from autopar.schema.software import SoftwareSpec
from cost_models.communication import logical_mesh
from cost_models.compute import MATRIX_OPS

# how a layer's cost says its ILP had no solution (so a cached cost has none to read back)
_ILP_FAILED = "intra-op ILP on tp="


class _Reentry(Exception):
    """`IlpProvider._boundaries` of a layer reached again while it solves the layers before it."""

    def __init__(self, key: tuple[str, int, int]) -> None:
        super().__init__(key)
        self.key = key


class IlpProvider(AnalyticProvider):
    name = "ilp"

    def __init__(self, graph: OpGraph, layers: list[Layer], cluster: ClusterSpec, dtype: str,
                 time_limit_s: float = 5.0, cache_dir: Optional[Path | str] = None,
                 sequence_parallel: bool = False, software: SoftwareSpec | str | None = None) -> None:
        """`cache_dir`: keep the per-layer solutions on disk there (`inter_op.ilp_cache`, a
        capture cache directory); None: solve every time. `sequence_parallel`: Megatron-SP on
        the tp axis (`solve_graph`'s option: norms, dropout and residual adds on sequence
        slices, the residual stream crossing every layer boundary split along its tokens).
        `software`: see `AnalyticProvider`."""
        super().__init__(graph, layers, cluster, dtype, software)
        self.sequence_parallel = bool(sequence_parallel)
        if self.sequence_parallel:
            self.name = "ilp+sp"
        self.cache = IlpCache(cache_dir) if cache_dir is not None else None
        self.cost_cache = CostCache(cache_dir) if cache_dir is not None else None
        self._digests: dict[tuple[int, int], Optional[str]] = {}     # (layer index, mb) -> graph_digest
        # solve_graph: fail here, where "auto" falls back, when OR-Tools is missing
        from autopar.intra_op import batch_dims_of, solve_graph, token_dims_of  # noqa: F401

        self.time_limit_s = time_limit_s
        self.batch_dims, self.token_dims = _graph_dims(graph)
        self.solve_s = 0.0
        self.solves = 0
        # (signature, micro-batch, tp) -> (the layer's solution, the layer it was solved on):
        # the per-op layouts a plan carries (`inter_op.stage_layouts`)
        self.solutions: dict[tuple[str, int, int], tuple[ShardingSolution, Layer]] = {}
        self._users: dict[str, list[Layer]] | None = None
        self._firsts: dict[str, Layer] | None = None     # signature -> its first layer (`_first_copy`)
        self._entries: dict[tuple[int, int, int], ShardingSolution] = {}   # `entry_solutions`
        self._bounds: dict[tuple[str, int, int], tuple[dict, dict, set]] = {}   # `_first_boundaries`
        self._waiting: set[tuple[str, int, int]] = set()   # layers whose `_boundaries` are being solved
        # layers solved without their arrivals to break a cycle through a tied parameter
        # (`_first_boundaries`), solved again with them once `cost` returns to its caller (`_settle`)
        self._provisional: dict[tuple[str, int, int], Layer] = {}
        self._self_pins: dict[tuple[str, int, int], dict[str, tuple[str]]] = {}   # `_settle`
        self._depth = 0                                   # nesting of `cost` calls
        self._expert_modules: Optional[tuple[str, ...]] = None    # `_expert_ops`

    def crossing_at(self, index: int, mb: int, tp: int) -> tuple[float, float, int, int]:
        """`crossing` per rank: with Megatron-SP, a tensor crossing with a gradient (the
        residual stream) is split along its tokens over the tp ranks (the ILP's convention at
        layer boundaries, `IntraOpProblem._sequence_boundary`), so each sends and keeps 1/tp."""
        total, grad, n, grads = self.crossing(index, mb)
        if not self.sequence_parallel or tp == 1:
            return total, grad, n, grads
        for name in self._cross_nodes[index] if 0 <= index < len(self._cross_nodes) else []:
            node = self.graph.node(name)
            dims = [d for d in self.token_dims.get(name, ()) if d not in self.batch_dims.get(name, ())]
            if not self.requires_grad.get(name, False) or not dims or not node.outputs:
                continue
            o = node.outputs[0]
            meta = o.at(mb) if self.graph.batch_size is None else o
            if int(meta.shape[dims[0]]) % tp:
                continue
            nb = float_bytes(meta, self.dtype) * (1 - 1 / tp)
            total, grad = total - nb, grad - nb
        return total, grad, n, grads

    def cost(self, layer: Layer, mb: int, tp: int) -> LayerCost:
        """`AnalyticProvider.cost`; a layer solved provisionally inside it (a tied-parameter
        cycle, `_first_boundaries`) is solved again with its arrivals before it returns to a
        caller outside the provider (`_settle`), so no caller sees a provisional solution."""
        self._depth += 1
        try:
            c = super().cost(layer, mb, tp)
        finally:
            self._depth -= 1
        if self._depth == 0 and self._provisional:
            self._settle()
            c = super().cost(layer, mb, tp)
        return c

    def _settle(self) -> None:
        """Solve again each layer solved provisionally without its arrivals (the first user of
        a tied parameter whose choice the layers before it follow: `_pins`), now that those
        layers are solved: with the tensors entering it fixed as they leave their makers (an
        output layer reading the encoder's output, a decoder block reading a bias made by the
        block before it), and its tied parameters pinned where its provisional solution put
        them (the layers before it pinned theirs to that). Without this its solution could
        assume a tensor arriving in a layout its maker does not leave it in, a redistribution
        no solution counts (`stage_layouts` refuses such a stage). Kept provisional where the
        ILP finds no solution so."""
        self._depth += 1
        try:
            while self._provisional:
                key, layer = self._provisional.popitem()
                old, got = self._cache.get(key), self.solutions.get(key)
                if old is None or got is None:
                    continue
                shared = self._shared()
                self._self_pins[key] = {f: (pl,) for f, pl in old.placements.items()
                                        if f in shared and shared[f][0].signature == layer.signature}
                self._bounds.pop(key, None)
                bounds = self._boundaries(layer, *key[1:])
                if not bounds[0]:
                    continue
                del self._cache[key]
                del self.solutions[key]
                AnalyticProvider.cost(self, layer, *key[1:])
                if key not in self.solutions:
                    # no solution holding the arrivals and the pins: keep the provisional one
                    self._cache[key], self.solutions[key] = old, got
        finally:
            self._depth -= 1

    def _names(self, rep: Layer, layer: Layer) -> dict[str, str]:
        return op_name_mapping(self.graph, rep, layer)

    def _shared(self) -> dict[str, list[Layer]]:
        """Parameters read by more than one layer (a tied embedding and output layer), by FQN:
        their users, the one whose choice the others follow first (`_pins`)."""
        if self._users is None:
            users: dict[str, list[Layer]] = {}
            for l in self.layers:
                for f in set(l.params):
                    users.setdefault(f, []).append(l)

            def weight(l: Layer, f: str) -> tuple[int, int]:
                # a matmul reading it (the output layer) before a lookup (the embedding); later first
                ops = [self.graph.node(n).op for n in l.nodes if f in (self.graph.node(n).params or ())]
                return (int(any(o in MATRIX_OPS for o in ops)), l.index)

            self._users = {f: sorted(us, key=lambda l: weight(l, f), reverse=True)
                           for f, us in users.items() if len(us) > 1}
        return self._users

    def _pins(self, layer: Layer, mb: int, tp: int) -> dict[str, tuple[str]]:
        """One placement for a parameter several layers read: each layer's ILP is solved apart,
        and a stage holds one copy of the parameter, so the layers after the first user (a
        matmul reading it first: the output layer of a tied embedding, Megatron's vocabulary-
        parallel choice when it pays there) take that user's choice."""
        pins: dict[str, tuple[str]] = {}
        for f, users in self._shared().items():
            if layer in users and users[0] is not layer:
                pl = self.cost(users[0], mb, tp).placements.get(f)
                if pl is not None:
                    pins[f] = (pl,)
        pins.update(self._self_pins.get((layer.signature, mb, tp), {}))
        return pins

    def _fixed_ops(self, layer: Layer, mb: int, tp: int) -> dict[str, str]:
        """{op: the strategy it must take} in `layer`'s solve (`solve_graph`'s `fixed_ops`): the
        ops of an expert block replicated over tp (`_expert_ops`); the ILP chooses every other's."""
        return self._expert_ops(layer) if tp > 1 else {}

    def _expert_ops(self, layer: Layer) -> dict[str, str]:
        """{op: "replicate"} for the ops of `layer` inside an expert block's module
        (`capture.experts.find_expert_blocks`). With expert parallelism the executor runs those
        ops as one call of `runtime.experts.ExpertParallelExperts`, which reads its inputs
        replicated over tp and hands its output on replicated: its only tp collectives are the
        redistributions of the block's inputs and output, which the ILP counts on the edges into
        and out of the block when the block's ops are replicated. Left free, under
        Megatron-SP (where slicing an activation along its hidden dim is not penalised,
        `IntraOpProblem._unrunnable`) the ILP ran the routing-weight product on hidden slices:
        its partial gradient of the top-k weights was one all-reduce per block and micro-batch
        that no rank issued (HF Mixtral 8x7B folded over dp4 x tp2, SP: 8192 all-reduces
        planned, 6144 run). The solutions are shared by every ep degree (ep 1 runs the ops as
        solved, replicated as well)."""
        if self._expert_modules is None:
            from autopar.capture.experts import find_expert_blocks

            self._expert_modules = tuple(b.module for b in find_expert_blocks(self.graph))
        if not self._expert_modules:
            return {}
        out = {}
        for name in layer.nodes:
            n = self.graph.node(name)
            path = n.module_path or ""
            if n.kind == "call" and n.outputs and any(path == m or path.startswith(m + ".")
                                                      for m in self._expert_modules):
                out[name] = "replicate"
        return out

    def entry_solutions(self, spans: list[tuple[int, int, int, str]], mb: int
                        ) -> dict[int, tuple[ShardingSolution, Layer]]:
        """{layer index: (its solution, itself)} for the first layer of each pipeline chunk of
        `spans` ((first layer, end layer, tp, recompute), model order) that follows a chunk of
        another tp degree, where the layer's own solution assumed a tensor arriving sharded:
        between tp degrees tensors cross replicated (`stage_layouts.chunk_layouts`), so that
        layer is solved again receiving them so (`chunk_layouts`' `entries`)."""
        out: dict[int, tuple[ShardingSolution, Layer]] = {}
        for c in range(1, len(spans)):
            k, _, tp, _ = spans[c]
            if tp == 1 or spans[c - 1][2] == tp:
                continue
            layer = self.layers[k]
            arrive, _, _ = self._boundaries(layer, mb, tp)
            if all(all(p == "R" for p in pl) for pl in arrive.values()):
                continue
            key = (k, mb, tp)
            if key not in self._entries:
                try:
                    self._entries[key] = self._solve(layer, mb, tp, replicated_entry=True)
                except PlanError:
                    continue
            out[k] = (self._entries[key], layer)
        return out

    def _solve(self, layer: Layer, mb: int, tp: int, replicated_entry: bool = False) -> ShardingSolution:
        """`layer`'s solution at (mb, tp) meeting its neighbours (`_boundaries`), a fused
        weight's rows free to be split chunk-interleaved (`solve_graph`'s `interleaved_splits`);
        `replicated_entry`: every tensor entering it arriving replicated instead (the first
        layer of a pipeline chunk after one of another tp degree, `entry_solutions`)."""
        from autopar.intra_op import solve_graph

        g = self.graph_at(mb, layer)
        mesh = logical_mesh(self.cluster, list(range(tp)), (tp,))
        # the layer's inputs arriving as the layers before leave them (`_boundaries`; a subgraph
        # holds no earlier op, so `cyclic_boundary` would find no cycle), and the tp axis as the
        # runtime runs it: model parallelism, every tp rank holding the whole micro-batch (no
        # batch split on it)
        # the batch and token dims of the layer's own tensors (the problem reads no other; the
        # whole graph's made every problem of a 96-layer model walk them all): a key per layer,
        # not per model
        own = {n.name for n in g.nodes}
        arrive, hand_on, leaving = self._boundaries(layer, mb, tp)
        if replicated_entry:
            arrive = {n: ("R",) * len(pl) for n, pl in arrive.items()}
        options = dict(time_limit_s=self.time_limit_s, interleaved_splits=tp > 1,
                       batch_dims={k: v for k, v in self.batch_dims.items() if k in own},
                       token_dims={k: v for k, v in self.token_dims.items() if k in own}, model_axes=(0,),
                       fixed_params=self._pins(layer, mb, tp), grad_inputs=self._grad_inputs(layer),
                       sequence_parallel=self.sequence_parallel, attention_kernel=self.software.attention_kernel,
                       pointwise_fusion=self.software.pointwise_fusion, autocast=self.software.autocast,
                       fixed_inputs=arrive, fixed_outputs=hand_on, leaving=sorted(leaving),
                       fixed_ops=self._fixed_ops(layer, mb, tp))
        key = None
        if self.cache is not None:
            key = solve_key(g, list(layer.nodes), mesh, self.dtype,
                            {k: sorted(v) if isinstance(v, set) else v for k, v in options.items()},
                            digest=self._digest(layer, mb))
            hit = self.cache.get(key) if key is not None else None
            if hit is not None:
                return hit
        sol = solve_graph(g, mesh, dtype=self.dtype, nodes=list(layer.nodes), **options)
        self.solves += 1
        self.solve_s += sol.solve_time_s
        if key is not None and self.cache is not None and sol.status in ("OPTIMAL", "FEASIBLE"):
            self.cache.put(key, sol)
        return sol

    def _boundaries(self, layer: Layer, mb: int, tp: int
                    ) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], set[str]]:
        """How `layer`'s solution at (mb, tp) meets its neighbours' (`solve_graph`'s
        `fixed_inputs`, `fixed_outputs`, `leaving`, in `layer`'s names), so that a stage's
        layers, solved apart, hand each other their tensors as each solution assumed and the
        executor runs no redistribution that no solution counted (`stage_layouts`):

        * a tensor entering the layer arrives as the layer making it leaves it (its solution's
          output layout): the reader pays any redistribution in this layer's solution. The
          layers before are solved first, in model order (greedy: a layer's own choices do not
          see what the next one would prefer; each pays for what it receives);
        * identical layers share one solution, solved on the first copy: what the first copy
          receives fixes the layout the copies hand each other (the output the next copy
          receives is produced in the layout the first copy received it in);
        * no layer hands on a partial sum on the tp axis (its reduction stays with its maker).

        At tp 1 there is nothing to meet: empty."""
        if tp == 1:
            return {}, {}, set()
        first = self._first_copy(layer)
        key = (first.signature, mb, tp)
        if key not in self._bounds:
            self._bounds[key] = self._first_boundaries(first, mb, tp)
        arrive, hand_on, leaving = self._bounds[key]
        if first is layer:
            return dict(arrive), dict(hand_on), set(leaving)
        to_layer = op_name_mapping(self.graph, first, layer)
        rename = lambda n: to_layer.get(n, n)  # noqa: E731
        return ({rename(i): pl for i, pl in arrive.items()}, {rename(n): pl for n, pl in hand_on.items()},
                {rename(n) for n in leaving})

    def _first_boundaries(self, first: Layer, mb: int, tp: int
                          ) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], set[str]]:
        """`_boundaries` of the first copy of a signature, in its names (once per (mb, tp))."""
        mine = set(first.nodes)
        cons = self._consumers
        leaving_first = {n for n in first.nodes
                         if any(u not in mine and self.graph.node(u).kind == "call" for u in cons.get(n, []))}
        key = (first.signature, mb, tp)
        if key in self._waiting:
            # an earlier layer's solve waits on this one (it reads a parameter this one reads
            # first, `_pins`): this one takes its inputs as they come (unpinned)
            raise _Reentry(key)
        self._waiting.add(key)
        try:
            for prev in self.layers[:first.index]:
                self.cost(prev, mb, tp)          # in model order: each layer's producers solved before it
        except _Reentry as e:
            if e.key != key:
                raise
            # a cycle through a tied parameter (the output layer decides the embedding's
            # placement, whose output reaches the output layer): this layer, the first user of
            # the parameter, is solved without its arrivals, to decide the parameter's placement,
            # and again with them once the layers before it are solved (`_settle`)
            self._provisional[key] = first
            return {}, {}, leaving_first
        finally:
            self._waiting.discard(key)
        arrive: dict[str, tuple[str, ...]] = {}
        for n in first.nodes:
            for i in self.graph.node(n).inputs:
                if i in mine or i in arrive or self.graph.node(i).kind != "call":
                    continue
                pl = self._leaves(i, mb, tp)
                if pl is not None:
                    arrive[i] = pl
        hand_on: dict[str, tuple[str, ...]] = {}
        nxt = self.layers[first.index + 1] if first.index + 1 < len(self.layers) else None
        if nxt is not None and nxt.signature == first.signature:
            to_next = op_name_mapping(self.graph, first, nxt)
            for i, pl in arrive.items():
                j = to_next.get(i)
                if j in mine:
                    hand_on[j] = pl
        return arrive, hand_on, leaving_first

    def _first_copy(self, layer: Layer) -> Layer:
        """The first layer in model order with `layer`'s signature."""
        if self._firsts is None:
            self._firsts = {}
            for lay in self.layers:
                self._firsts.setdefault(lay.signature, lay)
        return self._firsts.get(layer.signature, layer)

    def _leaves(self, name: str, mb: int, tp: int) -> Optional[tuple[str, ...]]:
        """The layout the solution of the layer making tensor `name` leaves it in at (mb, tp)
        (None: that layer has no solution there)."""
        idx = self._layer_of.get(name)
        if idx is None:
            return None
        lay = self.layers[idx]
        got = self.solutions.get((lay.signature, mb, tp))
        if got is None:
            return None
        sol, rep = got
        back = {v: k for k, v in op_name_mapping(self.graph, rep, lay).items()} if rep is not lay else {}
        ch = sol.op_choices.get(back.get(name, name))
        return tuple(ch.output_placements[0]) if ch is not None and ch.output_placements else None

    def solve_replicated(self, mb: int, layers: list[Layer]) -> None:
        """Record `layers`' solutions on a 1-device mesh (every op replicated) at micro-batch
        `mb`: the layouts of a 1-device stage beside tp stages (Alpa's sub-mesh choice), which
        the executor runs like the others. The costs at tp 1 need no solve (`_analyze_layer`)."""
        for layer in layers:
            key = (layer.signature, mb, 1)
            if key not in self.solutions:
                self.solutions[key] = (self._solve(layer, mb, 1), layer)

    def _digest(self, layer: Layer, mb: int) -> Optional[str]:
        """`graph_digest` of the layer's subgraph at `mb` (once per layer and micro-batch)."""
        key = (layer.index, mb)
        if key not in self._digests:
            self._digests[key] = graph_digest(self.graph_at(mb, layer))
        return self._digests[key]

    def _analyze(self, layer: Layer, mb: int, tp: int) -> LayerCost:
        """`_analyze_layer`, read from the layer cost cache when the caller keeps one (on a hit
        the layer's solution is read back too: the plan's layouts need it)."""
        key = None
        if self.cost_cache is not None:
            key = cost_key(self._digest(layer, mb), {
                "what": "ilp", "layer": [layer.name, layer.index, list(layer.nodes), sorted(layer.block_nodes),
                                         sorted(layer.params)],
                "boundary": self.boundary_names(layer), "mb": mb, "tp": tp, "dtype": self.dtype,
                "cluster": self.cluster.model_copy(update={"num_nodes": min(self.cluster.num_nodes, 2)})
                .model_dump(mode="json"),
                "software": self.software.model_dump(mode="json"), "sp": self.sequence_parallel,
                "time_limit_s": self.time_limit_s, "pins": self._pins(layer, mb, tp) if tp > 1 else {},
                "boundaries": [sorted(x.items()) if isinstance(x, dict) else sorted(x)
                               for x in self._boundaries(layer, mb, tp)],
                "grad_inputs": sorted(self._grad_inputs(layer)),
                "fixed_ops": sorted(self._fixed_ops(layer, mb, tp).items())})
            hit = self.cost_cache.get(key) if key is not None else None
            if hit is not None:
                if tp > 1 and not any(i.startswith(_ILP_FAILED) for i in hit.issues):
                    self.solutions[(layer.signature, mb, tp)] = (self._solve(layer, mb, tp), layer)
                return hit
        c = self._analyze_layer(layer, mb, tp)
        if key is not None:
            self.cost_cache.put(key, c)
        return c

    def _analyze_layer(self, layer: Layer, mb: int, tp: int) -> LayerCost:
        """The layer as the executor runs it, op by op as solved (`autopar.intra_op.execute`,
        the one runtime of tp stages): a fused projection's weight rows may be held
        chunk-interleaved (Megatron's QKV layout: each rank's shard holds its heads of q, k and
        v, so the split into q, k, v blocks needs no gather)."""
        base = super()._analyze(layer, mb, tp)
        if tp == 1:
            return base
        try:
            sol = self._solve(layer, mb, tp)
        except PlanError as e:
            base.issues.append(f"{_ILP_FAILED}{tp}: {e}")
            return base
        self.solutions[(layer.signature, mb, tp)] = (sol, layer)
        return self._cost_of(sol, layer, mb, tp, base)

    def _cost_of(self, sol: ShardingSolution, layer: Layer, mb: int, tp: int, base: LayerCost) -> LayerCost:
        """The LayerCost of running `layer` as `sol` shards it, op by op: its time and
        collectives the solution's, its activations as the executor keeps them (where an op
        reads a tensor redistributed, it saves that copy: `_read_shard`)."""
        g = self.graph_at(mb, layer)
        c = LayerCost()
        by_phase: dict[str, float] = Counter()
        c.coll_fwd, c.coll_bwd, c.coll_rc, c.coll_step = Counter(), Counter(), Counter(), Counter()
        for x in sol.collectives:
            by_phase[x.phase] += x.time_s
            n = max(1, len(x.mesh_axes))
            if x.phase == "forward":
                c.coll_fwd[x.kind] += n
                if x.op in layer.block_nodes:
                    c.coll_rc[x.kind] += n
            elif x.phase == "backward":
                c.coll_bwd[x.kind] += n
            else:
                c.coll_step[x.kind] = 1           # one bucket per kind
        c.fwd_comm_s = by_phase.get("forward", 0.0)
        c.bwd_comm_s = by_phase.get("backward", 0.0)
        c.fwd_s = max(0.0, sol.forward_s - c.fwd_comm_s)
        c.bwd_s = max(0.0, sol.backward_s - c.bwd_comm_s)
        c.iter_s = sol.grad_sync_s
        fwd_a = base.fwd_s + base.fwd_comm_s
        scale = sol.forward_s / fwd_a if fwd_a > 0 else 1.0
        c.rc_extra_s = {r: v * scale for r, v in base.rc_extra_s.items()}
        c.rc_comm_s = {r: v * scale for r, v in base.rc_comm_s.items()}
        if self.sequence_parallel and self.software.tp_comm_overlap:
            # the software's userbuffers overlaps (`SoftwareSpec.tp_comm_overlap`): the blocks'
            # collectives beside their GEMMs, the GEMMs as they run there (a recomputed forward's
            # collectives, `rc_comm_s`, are left waited)
            d = tp_overlap_deltas(sol, g, list(layer.nodes), tp, self.software, self.cluster, self.dtype)
            c.fwd_s, c.bwd_s = c.fwd_s + d["fwd_s"], c.bwd_s + d["bwd_s"]
            c.fwd_comm_s = max(0.0, c.fwd_comm_s + d["fwd_comm_s"])
            c.bwd_comm_s = max(0.0, c.bwd_comm_s + d["bwd_comm_s"])
        c.out_bytes = base.out_bytes
        for fqn, pl in sol.param_placements.items():
            if fqn in self.graph.params and fqn in set(layer.params):
                c.placements[fqn] = pl[0]
                numel = 1
                for d in self.graph.params[fqn].shape:
                    numel *= d
                c.param_elems[fqn] = numel / (tp if is_shard(pl[0]) else 1)
        for fqn in layer.params:
            if fqn not in c.param_elems:
                c.placements[fqn] = base.placements.get(fqn, "R")
                c.param_elems[fqn] = base.param_elems[fqn]
        sharded = _sharded(sol)
        sub = self._subgraph(g, layer, [g.node(n) for n in layer.nodes], self.requires_grad)
        shard = lambda node: tp if node.name in sharded else 1  # noqa: E731
        names = self.boundary_names(layer)
        if names["out_name"] in sharded:
            # the output the layer hands on (and a pipeline stage's forward cache keeps) is split
            c.out_bytes = base.out_bytes / tp
        # Megatron-SP's linears as Megatron-Core / Transformer Engine run them save their input
        # shard and gather it again in the backward (`SoftwareSpec.sp_linear_saves`)
        tokens = self.token_dims if self.sequence_parallel and self.software.sp_linear_saves == "shard" else None
        read = _read_shard(sol, tp, {n.name: n.fqn for n in sub.nodes if n.kind == "param" and n.fqn},
                           sp_shard_tokens=tokens)
        if not any(read(n, i) for n in sub.calls for i in n.inputs):
            read = None
        # the parameters' elements are set: each op's backward makes their gradients
        # (`fill_activations` reads them off the cost)
        fill_activations(c, sub, self.dtype, shard, autocast_device(self.cluster), dtensor=tp > 1, read_shard=read,
                         attention_kernel=self.software.attention_kernel, selective_region=layer.selective_region(tp),
                         modules=layer.modules, autocast=self.software.autocast,
                         norm_saves=self.software.norm_saves, **names)
        return c


def _sharded(sol: ShardingSolution) -> set[str]:
    """The tensors `sol` keeps split over tp: op outputs, and the layer's inputs where they
    arrive split (a sequence-parallel layer receives its predecessor's sequence shard)."""
    sharded = {n for n, ch in sol.op_choices.items()
               if ch.output_placements and any(map(is_shard, ch.output_placements[0]))}
    return sharded | {n for n, pl in sol.input_placements.items() if any(map(is_shard, pl))}


def _read_shard(sol: ShardingSolution, tp: int, params: dict[str, str] | None = None,
                sp_shard_tokens: dict | None = None):
    """`activation_memory`'s `read_shard` for a solution on a 1-D tp mesh: where an op reads an
    input in another layout than its producer gives it (or a parameter in another than it is
    stored in: `params` maps their node names to FQNs), the executor redistributes it and the
    op saves that copy (its divisor: tp if the copy is sharded, else 1; a parameter's copy is
    not kept, the executor gathers it again for the backward: `execute._Regather`, so it counts
    only while the op runs); where the copy is the
    tensor's junction value (one redistribution shared by its readers), the executor holds it
    until the tensor's last reader. Its gradient goes back to the producer's layout in the
    redistribution's own backward, after the op's (`execute._Reshard`): a gather along a dim
    other than the first holds its buffers there (the sixth item, `_gather_buffer`).
    `sp_shard_tokens` (the graph's token dims, `token_dims_of`; `SoftwareSpec.sp_linear_saves`
    "shard"): a matrix op reading whole an input split along a token dim (Megatron-SP's
    column-parallel linear) gathers it below autograd, the fifth item: it saves the shard as it
    arrived, holds the gathered copy while its forward runs and gathers it again for its
    backward (Transformer Engine's Linear: `saved_inputmat = inputmat`, the local shard, and
    `gather_along_first_dim` in the backward: transformer_engine/pytorch/module/linear.py at
    c6a9e26 lines 341-354 and 565-583, at v1.13 lines 305 and 429-430; LayerNormLinear's
    `ln_out` likewise, layernorm_linear.py at c6a9e26 lines 391-393, 443 and 632-656; Megatron-
    Core's own `LinearWithGradAccumulationAndAsyncCommunication` saves `input`, the shard)."""
    params = params or {}

    def sp_gather(node, name: str, want: tuple, have: tuple) -> bool:
        if sp_shard_tokens is None or node.op not in MATRIX_OPS or any(is_shard(p) or p == "P" for p in want):
            return False
        toks = set(sp_shard_tokens.get(name, ()))
        return any(is_shard(p) and shard_dim(p) in toks for p in have)

    def produced(name: str):
        if name in params:
            pl = sol.param_placements.get(params[name])
            return tuple(pl) if pl is not None else None
        ch = sol.op_choices.get(name)
        if ch is not None and ch.output_placements:
            return tuple(ch.output_placements[0])
        pl = sol.input_placements.get(name)
        return tuple(pl) if pl is not None else None

    def read(node, name: str):
        ch = sol.op_choices.get(node.name)
        if ch is None or name not in node.inputs:
            return None
        k = node.inputs.index(name)
        if k >= len(ch.input_placements):
            return None
        want, have = tuple(ch.input_placements[k]), produced(name)
        if have is None or want == have or "P" in want:
            return None
        j = sol.junctions.get(f"{name}#0")
        held = j is not None and tuple(j[0]) == want      # the junction's value, kept for all readers
        # the gradient goes back to the producer's layout, a partial sum's replicated
        # (`execute._grad_target`): a gather there holds its buffers too
        back = tuple("R" if p == "P" else p for p in have)
        return ((tp if any(map(is_shard, want)) else 1), ",".join(want), _gather_buffer(have, want, tp), held,
                sp_gather(node, name, want, have), _gather_buffer(want, back, tp))
    return read


def _gather_buffer(have: tuple, want: tuple, tp: int) -> float | None:
    """The divisor of what a redistribution from `have` to `want` holds beside its result: a
    gather along a dim other than the first (`execute._gather`) copies the shard, gathers the
    copy along dim 0 into a buffer and concatenates the buffer's pieces, so the copy (1/tp of
    the result) and the buffer (the result's size) are live with it. None where no axis
    gathers along a dim other than 0."""
    h, w = have[0], want[0]
    return tp / (tp + 1) if shard_dim(h) not in (None, 0) and not is_shard(w) else None


_DIMS: dict[int, tuple[weakref.ref, dict, dict]] = {}


def _graph_dims(graph: OpGraph) -> tuple[dict, dict]:
    """`batch_dims_of` and `token_dims_of` of `graph`, computed once per graph object: the
    planner builds two providers on one graph (with and without sequence parallelism), and
    the token dims of a 96-layer graph take ~0.5 s."""
    from autopar.intra_op import batch_dims_of, token_dims_of

    hit = _DIMS.get(id(graph))
    if hit is not None and hit[0]() is graph:
        return hit[1], hit[2]
    batch = batch_dims_of(graph)
    tokens = token_dims_of(graph, batch)
    for k in [k for k, v in _DIMS.items() if v[0]() is None]:
        del _DIMS[k]
    _DIMS[id(graph)] = (weakref.ref(graph), batch, tokens)
    return batch, tokens
