"""Sharding strategies of one op and the generic enumerator the rules build on.

Most ops are described by *labels*, as in an einsum: every dimension of every tensor input and
output gets a label (None for a dimension that may not be split); labels shared between tensors
are the same loop of the op. A strategy assigns each mesh axis of size > 1 either to nothing
(the op is replicated along it) or to one label (the op's work is split along it):

  * a tensor holding the label is S(its dim) on that axis, a tensor without it is R;
  * an output without the label is P (partial sums) when the label is *reduced* (contracted
    in a matmul, summed in a reduction), which the consumer pays to reduce;
  * the gradient of an input without the label is partial on that axis (the matmul's weight
    under a batch split, a broadcast bias): its reduction is paid on the edge to its producer,
    in phase "backward", or "grad_sync" when the producer is a parameter.

Work (FLOPs, bytes) divides by the product of the sizes of the assigned axes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence

from autopar.capture.graph import OpGraph, OpNode, TensorMeta
from autopar.intra_op.placement import PARTIAL, REPLICATE, Spec, shard, shard_dim

Label = Optional[Hashable]


@dataclass
class Strategy:
    """One way to run an op on the mesh.

    in_specs: the layout each tensor input (node.inputs order) must have;
    out_specs: the layout of each output; grad_partial: per input, the mesh axes along which
    its gradient comes out partial; comms: collectives inside the op itself
    (kind, mesh axes, bytes, phase); work_div: how many ways its work is split."""

    name: str
    in_specs: list[Spec]
    out_specs: list[Spec]
    grad_partial: list[tuple[int, ...]] = field(default_factory=list)
    work_div: int = 1
    comms: list[tuple[str, tuple[int, ...], float, str]] = field(default_factory=list)
    note: str = ""


def output_index(consumer: OpNode, k: int) -> int:
    """Which output of its producer input `k` of `consumer` reads: the index of a `getitem` on a
    multi-output op, else 0."""
    if consumer.target == "getitem" and k == 0 and len(consumer.args) > 1 and isinstance(consumer.args[1], int):
        return consumer.args[1]
    return 0


@dataclass
class OpContext:
    """What a rule sees: the node, its tensor inputs' metas (node.inputs order), the mesh."""

    node: OpNode
    in_metas: list[TensorMeta]
    mesh_shape: tuple[int, ...]
    graph: Optional[OpGraph] = None
    float_bytes: int = 4
    interleaved_splits: bool = True     # may a split along a split dim assume an interleaved weight

    @property
    def out_metas(self) -> list[TensorMeta]:
        return self.node.outputs

    @property
    def ndim_mesh(self) -> int:
        return len(self.mesh_shape)

    @property
    def axes(self) -> list[int]:
        """Mesh axes of size > 1: the only ones a strategy can use."""
        return [a for a, m in enumerate(self.mesh_shape) if m > 1]

    def in_shape(self, i: int) -> tuple[int, ...]:
        return tuple(int(d) for d in self.in_metas[i].shape)

    def out_shape(self, i: int = 0) -> tuple[int, ...]:
        return tuple(int(d) for d in self.node.outputs[i].shape)

    def itemsize(self, meta: TensorMeta) -> int:
        return self.float_bytes if meta.dtype.startswith(("float", "bfloat", "complex")) else meta.itemsize

    def producer(self, i: int) -> Optional[OpNode]:
        if self.graph is None:
            return None
        try:
            return self.graph.node(self.node.inputs[i])
        except KeyError:
            return None

    def arg_index(self, pos: int) -> Optional[int]:
        """Index into node.inputs of positional arg `pos` when it is a tensor, else None."""
        from autopar.capture.graph import Ref, flatten_refs

        args = self.node.args
        if pos >= len(args) or not isinstance(args[pos], Ref):
            return None
        return sum(len(flatten_refs(a)) for a in args[:pos])


def label_strategies(ctx: OpContext, in_labels: Sequence[Sequence[Label]],
                     out_labels: Sequence[Sequence[Label]], *, reduced: Sequence[Label] = (),
                     forbid: Sequence[Label] = (), name: Optional[Callable[[dict], str]] = None,
                     extra: Optional[Callable[[dict, Strategy], Optional[Strategy]]] = None) -> list[Strategy]:
    """Every assignment of the mesh axes of size > 1 to the op's labels (or to nothing).

    `in_labels[i]` / `out_labels[j]` label each dimension of input i / output j (None: never
    split). `reduced` labels are summed over (outputs without them become partial). `extra`
    may adjust or veto (return None) a strategy given its assignment {axis: label}.
    """
    in_shapes = [ctx.in_shape(i) for i in range(len(in_labels))]
    out_shapes = [ctx.out_shape(j) for j in range(len(out_labels))]
    in_pos = [{l: d for d, l in enumerate(ls) if l is not None} for ls in in_labels]
    out_pos = [{l: d for d, l in enumerate(ls) if l is not None} for ls in out_labels]
    reduced = set(reduced)
    labels: list[Label] = []
    for ls in list(in_labels) + list(out_labels):
        for l in ls:
            if l is not None and l not in labels and l not in forbid:
                labels.append(l)
    # a label may be split only if every output holds it or it is reduced
    labels = [l for l in labels if l in reduced or all(l in p for p in out_pos)]
    axes = ctx.axes
    out: list[Strategy] = []
    for choice in itertools.product([None] + labels, repeat=len(axes)):
        assign = {a: l for a, l in zip(axes, choice) if l is not None}
        # divisibility: each split dimension divides by the product of its axes
        ok = True
        for l in set(assign.values()):
            k = math.prod(ctx.mesh_shape[a] for a, x in assign.items() if x == l)
            for pos, shapes in ((in_pos, in_shapes), (out_pos, out_shapes)):
                for p, shp in zip(pos, shapes):
                    if l in p and shp[p[l]] % k:
                        ok = False
        if not ok:
            continue

        def spec(pos: dict, is_out: bool, assign: dict = assign) -> Spec:
            s = []
            for a in range(ctx.ndim_mesh):
                l = assign.get(a)
                if l is None:
                    s.append(REPLICATE)
                elif l in pos:
                    s.append(shard(pos[l]))
                elif is_out and l in reduced:
                    s.append(PARTIAL)
                else:
                    s.append(REPLICATE)
            return tuple(s)

        st = Strategy(
            name=name(assign) if name else default_name(assign),
            in_specs=[spec(p, False) for p in in_pos],
            out_specs=[spec(p, True) for p in out_pos],
            grad_partial=[tuple(a for a, l in sorted(assign.items()) if l not in p) for p in in_pos],
            work_div=math.prod(ctx.mesh_shape[a] for a in assign))
        if extra is not None:
            st = extra(assign, st)
            if st is None:
                continue
        out.append(st)
    return out


def default_name(assign: dict) -> str:
    if not assign:
        return "replicate"
    return " ".join(f"{l}@{a}" for a, l in sorted(assign.items()))


def replicate_strategy(ctx: OpContext, name: str = "replicate") -> Strategy:
    r = (REPLICATE,) * ctx.ndim_mesh
    return Strategy(name, [r] * len(ctx.in_metas), [r] * len(ctx.out_metas),
                    [()] * len(ctx.in_metas), 1)


def with_partial_passthrough(ctx: OpContext, strategies: list[Strategy]) -> list[Strategy]:
    """For ops linear in their (single) tensor input (views, casts, negation, scaling): also
    accept a partial input on any axis the strategy leaves replicated, giving a partial output."""
    out = list(strategies)
    for st in strategies:
        free = [a for a in ctx.axes if st.in_specs[0][a] == REPLICATE and all(o[a] == REPLICATE for o in st.out_specs)
                and all(s[a] == REPLICATE for s in st.in_specs[1:])]
        for k in range(1, len(free) + 1):
            for sub in itertools.combinations(free, k):
                ins = list(st.in_specs)
                ins[0] = tuple(PARTIAL if a in sub else p for a, p in enumerate(ins[0]))
                outs = [tuple(PARTIAL if a in sub else p for a, p in enumerate(o)) for o in st.out_specs]
                out.append(Strategy(st.name + " " + " ".join(f"P@{a}" for a in sub), ins, outs,
                                    list(st.grad_partial), st.work_div, list(st.comms), st.note))
    return out


def dims_labels(n: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def broadcast_labels(shape: Sequence[int], out_shape: Sequence[int]) -> list[Label]:
    """Labels of an input broadcast (right-aligned) against the output's d0..dk labels."""
    off = len(out_shape) - len(shape)
    return [None if (int(s) == 1 and int(out_shape[off + i]) != 1) else f"d{off + i}"
            for i, s in enumerate(shape)]


def unspec_dims(spec: Spec) -> set[int]:
    return {shard_dim(p) for p in spec if shard_dim(p) is not None}
