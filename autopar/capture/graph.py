"""OpGraph: the captured forward graph of a model, one node per ATen op.

Shapes may depend on the batch size: a dimension is an `int` or a `SymDim` (an expression in
`b`, the batch size, e.g. "2048*b"), so one capture serves every micro-batch size;
`OpGraph.at_batch(b)` gives concrete shapes and FLOPs. Non-tensor arguments keep their values,
tensor arguments become `Ref(node_name)`.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, Sequence

if TYPE_CHECKING:
    import networkx as nx

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
               "bool": 1, "complex64": 8}


@dataclass(frozen=True)
class SymDim:
    """A dimension that depends on the batch size `b`, as an expression such as "2048*b"."""

    expr: str

    def at(self, b: int) -> int:
        linear = _linear(self.expr)
        if linear is not None:
            return linear[0] * b + linear[1]
        return int(_compiled(self.expr)(b))

    def __str__(self) -> str:
        return self.expr


_LINEAR_EXPR = re.compile(r"^(?:(\d+)\*)?b(?: \+ (\d+))?$")


@lru_cache(maxsize=None)
def _linear(expr: str) -> Optional[tuple[int, int]]:
    """(a, c) of an expression "a*b + c" as sympy prints one ("b", "2048*b", "4*b + 1"), else
    None: most of a capture's batch-dependent dimensions, read without sympy (its import and
    lambdify are most of a warm plan's first `at_batch`)."""
    m = _LINEAR_EXPR.match(expr)
    return (int(m.group(1) or 1), int(m.group(2) or 0)) if m else None


@lru_cache(maxsize=None)
def _compiled(expr: str):
    import sympy

    return sympy.lambdify(sympy.Symbol("b"), sympy.sympify(expr), "math")


Dim = int | SymDim


def map_nested(v: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """`v` with `fn` applied to every instance of `kind` in it, through tuples, lists and dicts."""
    if isinstance(v, kind):
        return fn(v)
    if isinstance(v, tuple):
        return tuple(map_nested(x, kind, fn) for x in v)
    if isinstance(v, list):
        return [map_nested(x, kind, fn) for x in v]
    if isinstance(v, dict):
        return {k: map_nested(x, kind, fn) for k, x in v.items()}
    return v


def concrete(v: Any, b: int) -> Any:
    """`v` with every SymDim evaluated at batch size `b` (recursing into lists/tuples/dicts)."""
    return map_nested(v, SymDim, lambda d: d.at(b))


@dataclass(frozen=True)
class Ref:
    """A tensor argument: the output of node `name` (element `index` when it returns several)."""

    name: str


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[Dim, ...]
    dtype: str

    def at(self, b: int) -> "TensorMeta":
        return TensorMeta(tuple(concrete(d, b) for d in self.shape), self.dtype)

    @property
    def numel(self) -> int:
        """Element count; requires concrete shapes (call `at(b)` first)."""
        return math.prod(int(d) for d in self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_batched(self) -> bool:
        return any(isinstance(d, SymDim) for d in self.shape)


# grouped GEMMs of routed tokens against stacked expert weights, by op name in any namespace
# (torch's, Hugging Face's fallback, the zoo MoE's): `OpNode.op` calls them all "grouped_mm"
GROUPED_GEMM_OPS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})

NodeKind = Literal["input", "param", "buffer", "constant", "call", "output"]


@dataclass
class OpNode:
    """One op (or graph input) of the forward graph.

    flops / bytes_moved are forward figures at the graph's current batch size (0 for views).
    `params` lists the FQNs of parameters the op reads directly.
    """

    name: str
    kind: NodeKind
    target: str                      # "aten.mm.default"; "input"/"param"/... for placeholders
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)   # producer names of tensor args, in order
    outputs: list[TensorMeta] = field(default_factory=list)
    flops: float = 0.0
    bytes_moved: float = 0.0
    params: list[str] = field(default_factory=list)
    fqn: Optional[str] = None         # param/buffer/input name for placeholders
    module_path: str = ""             # innermost module FQN ("" at the top)
    module_type: str = ""             # class name of that module
    layer: Optional[str] = None       # FQN of the repeated block holding it (e.g. "blocks.3")
    # an op of a custom autograd Function's forward: the call's key ("GeLUFunction#3"); on the
    # call's first op, the tensors the Function saves for its backward, which the memory model
    # counts in place of what its ops would save (`capture.functions`)
    function: Optional[str] = None
    function_saves: list[str] = field(default_factory=list)
    # on the call's first op: the most its backward holds at once, in units of its first tensor
    # argument's size (`capture.functions.backward_work`)
    function_work: float = 0.0

    @property
    def out(self) -> Optional[TensorMeta]:
        return self.outputs[0] if self.outputs else None

    @property
    def op(self) -> str:
        """Short op name, e.g. "mm" for aten.mm.default."""
        parts = self.target.split(".")
        if len(parts) >= 3 and parts[0] == "aten":
            return parts[1]
        if len(parts) >= 2 and parts[1] in GROUPED_GEMM_OPS:
            return "grouped_mm"       # a library's grouped GEMM (mixture-of-experts layers)
        return self.target


@dataclass
class ParamInfo:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    tied: list[str] = field(default_factory=list)   # other FQNs naming the same tensor
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class OpGraph:
    """A captured model. `batch_size` is the batch the concrete figures refer to (None when the
    graph still holds SymDims)."""

    name: str
    nodes: list[OpNode]
    params: dict[str, ParamInfo]
    buffers: dict[str, ParamInfo] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)        # repeated blocks in execution order
    layer_types: dict[str, str] = field(default_factory=dict)  # layer FQN -> module class
    top_modules: list[str] = field(default_factory=list)   # direct children of the root, in order
    batch_size: Optional[int] = None
    capture_method: str = "torch.export"
    capture_time_s: float = 0.0     # how long `capture` took (the plan reports it)
    loss_is_output: bool = True
    # whether the captured forward asked `models.positions.token_positions` for its tokens'
    # positions (None: not known, a graph not made by `capture`): context parallelism sets them
    # to a rank's chunks, so a model that makes its own cannot take it (`inter_op.context_parallel`)
    reads_positions: Optional[bool] = None
    # where it does not (a model that makes its own positions): "" where they were found as
    # `arange`s that follow the sequence length, which the runtime makes the rank's under context
    # parallelism, else why not (`capture.own_positions`; None: not looked for)
    own_positions: Optional[str] = None

    def __post_init__(self) -> None:
        self._index = {n.name: n for n in self.nodes}

    # -- access -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, name: str) -> OpNode:
        return self._index[name]

    @property
    def calls(self) -> list[OpNode]:
        return [n for n in self.nodes if n.kind == "call"]

    def consumers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return out

    def to_networkx(self) -> "nx.DiGraph":
        import networkx as nx

        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, op=n)
        for n in self.nodes:
            for i in n.inputs:
                g.add_edge(i, n.name)
        return g

    def layer_nodes(self, layer: Optional[str]) -> list[OpNode]:
        return [n for n in self.nodes if n.kind == "call" and n.layer == layer]

    # -- totals -----------------------------------------------------------------------------
    @property
    def is_symbolic(self) -> bool:
        """Whether some shape still depends on the batch (a symbolic capture before `at_batch`)."""
        return any(o.is_batched for n in self.nodes for o in n.outputs)

    @property
    def num_params(self) -> int:
        """Parameters counted once (tied parameters once)."""
        return sum(p.numel for p in self.params.values())

    @property
    def forward_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    def layer_signature(self, layer: str) -> str:
        """Identical layers (same ops, shapes, params shapes) share a signature."""
        h = hashlib.sha256()
        prefix = layer + "."
        for n in self.layer_nodes(layer):
            h.update(n.target.encode())
            h.update(repr([o.shape for o in n.outputs]).encode())
            h.update(repr([self.params[p].shape if p in self.params else p.removeprefix(prefix)
                           for p in n.params]).encode())
        return h.hexdigest()[:16]

    def fingerprint(self) -> str:
        """Identifies the model's structure: ops, shapes and parameters (not their values)."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(f"{n.kind}|{n.target}|{n.fqn}|{[str(o.shape) for o in n.outputs]}|{n.inputs}".encode())
        for p in sorted(self.params.values(), key=lambda p: p.fqn):
            h.update(f"{p.fqn}{p.shape}{p.dtype}".encode())
        return h.hexdigest()[:24]

    # -- batch ------------------------------------------------------------------------------
    def at_batch(self, b: int) -> "OpGraph":
        """A copy with concrete shapes, FLOPs and bytes for batch size `b`."""
        from autopar.capture.flops import node_cost

        new_nodes = []
        metas: dict[str, list[TensorMeta]] = {}
        for n in self.nodes:
            outs = [o.at(b) for o in n.outputs]
            metas[n.name] = outs
            m = replace(n, outputs=outs, args=concrete(n.args, b), kwargs=concrete(n.kwargs, b))
            if n.kind == "call":
                m.flops, m.bytes_moved = node_cost(m, metas)
            new_nodes.append(m)
        return replace(self, nodes=new_nodes, batch_size=b)

    def summary(self) -> str:
        return (f"{self.name}: {len(self.calls)} ops, {self.num_params / 1e6:.2f}M params, "
                f"{len(self.layers)} layers, captured with {self.capture_method}")


def flatten_refs(v: Any) -> list[str]:
    """Names of all Refs in a nested argument structure, in order."""
    out: list[str] = []
    if isinstance(v, Ref):
        out.append(v.name)
    elif isinstance(v, (list, tuple)):
        for x in v:
            out.extend(flatten_refs(x))
    elif isinstance(v, dict):
        for x in v.values():
            out.extend(flatten_refs(x))
    return out


def shapes_of(refs: Sequence[Any], metas: dict[str, list[TensorMeta]]) -> Any:
    """Replace each Ref in `refs` by the torch.Size of the tensor it names."""
    import torch

    if isinstance(refs, Ref):
        ms = metas.get(refs.name) or [TensorMeta((), "float32")]
        return torch.Size([int(d) for d in ms[0].shape])
    if isinstance(refs, tuple):
        return tuple(shapes_of(x, metas) for x in refs)
    if isinstance(refs, list):
        return [shapes_of(x, metas) for x in refs]
    if isinstance(refs, dict):
        return {k: shapes_of(x, metas) for k, x in refs.items()}
    return refs
