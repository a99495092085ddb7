"""Custom autograd Functions in a traced model: marked at export, run as the user wrote them.

torch.export traces through `torch.autograd.Function.apply`: the program holds the ops of the
Function's forward and nothing of its backward. Run as a program (the tensor-parallel executor,
`intra_op.execute`; pipeline chunks, `runtime.graph_stages`), autograd would differentiate those
ops instead of calling the user's backward: a straight-through estimator (`round` forward,
identity backward) would get a zero gradient, Hugging Face BLOOM's `GeLUFunction` (saves its
input, recomputes the tanh formula in its backward) the formula's autograd and its saves.

While a model is exported (`marking_functions`), each top-level call of `Function.apply` whose
tensors need a gradient is recorded on the ops its forward traced: every such node's
`node.meta[MARK]` holds a `FunctionMark` (the Function's class, its call's key, which of the
node's inputs are which of the call's arguments, which output of the call the node is, and
what the call's forward saved for its backward: `ctx.save_for_backward` and tensors kept as
`ctx` attributes, seen through saved-tensor hooks and the call's backward node). Marks are
plain data, so they survive the copies and renames the program goes through (device programs
renamed as the capture, pipeline chunks cut from it).

* The capture (`capture.export.export_nodes`) keeps the forward's ops (their FLOPs, their
  layouts) and records on each `OpNode.function` the call's key; the call's first op lists in
  `OpNode.function_saves` the tensors the Function saves, which the memory model counts in
  place of what the ops would save under autograd (`cost_models.memory.saved_tensors`).
* A program runs each call as `Function.apply` on the call's arguments (`regions`): the
  executor at the call's first op (its arguments as they are, DTensors in their layouts: the
  forward's ops run under DTensor's propagation, not the plan's per-op layouts), pipeline
  chunks with the call's ops folded into one node (`fold`).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.fx

from autopar.schema.errors import PlanError

log = logging.getLogger(__name__)

MARK = "autopar_function"


@dataclass(frozen=True)
class FunctionMark:
    """What a node of a custom Function's forward knows of its call.

    `key`: "<Function>#<k>", k counting the calls of the export. `reads`: (j, i) pairs, the node's
    j-th input (`node.all_input_nodes[j]`) is the call's argument i. `out`: which of the call's
    outputs the node is (0 for a call returning one tensor), None if none. `saves_self`: the
    Function saves this node's tensor. On the call's first node only: `saved_args` (the
    arguments it saves), `unseen_saves` (tensors it saves that are not the graph's)."""

    key: str
    fn: type
    arity: int
    consts: tuple = ()                 # (i, value) of the call's non-tensor arguments
    reads: tuple = ()
    out: Optional[int] = None
    single: bool = True                # the call returned one tensor, not a tuple
    saves_self: bool = False
    first: bool = False
    saved_args: tuple = ()
    unseen_saves: int = 0

    @property
    def name(self) -> str:
        return self.key.split("#", 1)[0]


class _State(threading.local):
    def __init__(self) -> None:
        self.active = 0
        self.depth = 0
        self.count = 0


_STATE = _State()
_ORIGINAL = torch.autograd.Function.__dict__["apply"]


def _tensors(v: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    torch.utils._pytree.tree_map(lambda x: out.append(x) if isinstance(x, torch.Tensor) else None, v)
    return out


def _node_of(t: Any, tracer: Any) -> Optional[torch.fx.Node]:
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    if not isinstance(t, torch.Tensor):
        return None
    slot = get_proxy_slot(t, tracer, None)
    proxy = getattr(slot, "proxy", None)
    return getattr(proxy, "node", None)


def _marked_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """`Function.apply`, its call recorded on the nodes its forward traces (`FunctionMark`)."""
    call = _ORIGINAL.__func__
    if not _STATE.active or _STATE.depth or kwargs or not torch.is_grad_enabled() \
            or not any(t.requires_grad for t in _tensors(args)):
        return call(cls, *args, **kwargs)
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    tracer = getattr(mode, "tracer", None)
    graph = getattr(tracer, "graph", None)
    if graph is None:
        return call(cls, *args, **kwargs)
    arg_nodes = [_node_of(a, tracer) for a in args]
    last = next(iter(reversed(graph.nodes)), None)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    _STATE.depth += 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call(cls, *args)
    finally:
        _STATE.depth -= 1
    region: list[torch.fx.Node] = []       # the nodes traced since the call began
    n = last.next if last is not None else next(iter(graph.nodes), None)
    while n is not None and n.op != "root":
        if n.op == "call_function":
            region.append(n)
        n = n.next
    if not region:
        return out
    key = f"{cls.__name__}#{_STATE.count}"
    _STATE.count += 1
    grad_fn = next((t.grad_fn for t in _tensors(out) if t.grad_fn is not None), None)
    if grad_fn is not None:      # tensors kept as attributes of ctx (`ctx.mask = mask`)
        saved += [v for v in vars(grad_fn).values() if isinstance(v, torch.Tensor)]
    saved_nodes = [_node_of(t, tracer) for t in saved]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    out_index = {}
    for k, o in enumerate(outs):
        nd = _node_of(o, tracer)
        if nd is not None:
            out_index.setdefault(nd, k)
    arg_index = {}
    for i, nd in enumerate(arg_nodes):
        if nd is not None:
            arg_index.setdefault(nd, i)
    inside = set(region)
    consts = tuple((i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
    saved_args = tuple(sorted({arg_index[s] for s in saved_nodes if s in arg_index and s not in inside}))
    unseen = sum(1 for s in saved_nodes if s is None or (s not in inside and s not in arg_index))
    for j, n in enumerate(region):
        reads = tuple((q, arg_index[a]) for q, a in enumerate(n.all_input_nodes) if a in arg_index)
        n.meta[MARK] = FunctionMark(
            key, cls, len(args), consts, reads, out_index.get(n), not isinstance(out, (tuple, list)),
            saves_self=n in saved_nodes, first=j == 0, saved_args=saved_args if j == 0 else (),
            unseen_saves=unseen if j == 0 else 0)
    return out


@contextlib.contextmanager
def marking_functions() -> Iterator[None]:
    """Record custom autograd Function calls on the nodes of what is traced inside (an export):
    `Function.apply` patched for the duration (the first caller's patch serves nested ones)."""
    if _STATE.active:
        _STATE.active += 1
        try:
            yield
        finally:
            _STATE.active -= 1
        return
    _STATE.active, _STATE.count = 1, 0
    torch.autograd.Function.apply = classmethod(_marked_apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _ORIGINAL
        _STATE.active = 0


def mark_of(n: torch.fx.Node) -> Optional[FunctionMark]:
    return n.meta.get(MARK) if isinstance(getattr(n, "meta", None), dict) else None


@dataclass
class Region:
    """One call of a custom Function in a graph: its nodes in order, the graph's nodes standing
    for its tensor arguments, its output nodes by output index."""

    key: str
    fn: type
    nodes: list[torch.fx.Node]
    args: list[Any]                     # per argument: an fx.Node, or the constant value
    outputs: dict[int, torch.fx.Node] = field(default_factory=dict)
    single: bool = True

    def apply(self, values: dict[torch.fx.Node, Any]) -> Any:
        """The Function run on the arguments' values (`values`: node -> its value)."""
        args = [values[a] if isinstance(a, torch.fx.Node) else a for a in self.args]
        return self.fn.apply(*args)


def regions(graph: torch.fx.Graph, strict: bool = True) -> list[Region]:
    """The custom Function calls marked in `graph` (`marking_functions`), in program order.
    With `strict`, raises PlanError for a call that cannot run as its Function: an argument
    tensor its forward does not read (no node of the call names it); else such an argument is
    None."""
    by_key: dict[str, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        m = mark_of(n)
        # a placeholder may carry its producer's meta (a pipeline chunk's submodule's input)
        if m is not None and n.op == "call_function":
            by_key.setdefault(m.key, []).append(n)
    out = []
    for key, nodes in by_key.items():
        m0 = mark_of(nodes[0])
        args: list[Any] = [None] * m0.arity
        found = [False] * m0.arity
        for i, v in m0.consts:
            args[i], found[i] = v, True
        outputs: dict[int, torch.fx.Node] = {}
        for n in nodes:
            m = mark_of(n)
            ins = n.all_input_nodes
            for q, i in m.reads:
                if q < len(ins):
                    args[i], found[i] = ins[q], True
            if m.out is not None:
                outputs[m.out] = n
        missing = [i for i, f in enumerate(found) if not f]
        if missing and strict:
            raise PlanError(f"the custom autograd Function {m0.name} ({m0.fn.__module__}.{m0.fn.__qualname__}) "
                            f"takes tensor argument(s) {missing} that its forward does not compute with: "
                            f"autopar cannot run it in a traced program (tensor or pipeline parallelism) "
                            f"with its own backward; use a plan without tp or pp (dp, ZeRO run the model "
                            f"itself), or make its forward read every tensor it is given")
        out.append(Region(key, m0.fn, nodes, args, outputs, m0.single))
    return out


def fold(gm: torch.fx.GraphModule) -> int:
    """Replace each custom Function call marked in `gm`'s graph (and its submodules' graphs) by
    one node calling `Function.apply` on its arguments, the call's outputs read from it: the
    graph then runs the user's forward and backward. Returns how many calls were folded."""
    done = 0
    for mod in list(gm.modules()):
        g = getattr(mod, "graph", None)
        if not isinstance(g, torch.fx.Graph):
            continue
        found = regions(g)
        replaced: dict[torch.fx.Node, torch.fx.Node] = {}   # an earlier call's output -> its getitem
        for r in found:
            r.args = [replaced.get(a, a) if isinstance(a, torch.fx.Node) else a for a in r.args]
            replaced.update(_fold_one(g, r))
            done += 1
        if found:
            g.lint()
            if isinstance(mod, torch.fx.GraphModule):
                mod.recompile()
            elif getattr(mod, "graph_module", None) is not None and hasattr(mod, "finalize"):
                mod.finalize()          # an unflattened `InterpreterModule`: its code made again
    return done


def _caller(fn: type, arity: int, single: bool, consts: dict) -> Any:
    """A function of the call's tensor arguments (in order) that runs `fn.apply` with its
    constants in place, returning a tuple."""
    slots = [i for i in range(arity) if i not in consts]

    def run(*tensors: Any) -> tuple:
        args = [consts.get(i) for i in range(arity)]
        for i, t in zip(slots, tensors):
            args[i] = t
        out = fn.apply(*args)
        return (out,) if single else tuple(out)

    run.__name__ = f"autograd_function_{fn.__name__}"
    run.__qualname__ = run.__name__
    return run


def _fold_one(g: torch.fx.Graph, r: Region) -> dict[torch.fx.Node, torch.fx.Node]:
    consts = {i: a for i, a in enumerate(r.args) if not isinstance(a, torch.fx.Node)}
    tensor_args = tuple(a for a in r.args if isinstance(a, torch.fx.Node))
    inside = set(r.nodes)
    with g.inserting_before(r.nodes[0]):
        call = g.call_function(_caller(r.fn, len(r.args), r.single, consts), tensor_args)
        call.meta = {k: v for k, v in r.nodes[0].meta.items() if k not in (MARK, "val")}
        gets = {}
        for k, n in sorted(r.outputs.items()):
            gets[n] = g.call_function(operator.getitem, (call, k))
            gets[n].meta = {k2: v for k2, v in n.meta.items() if k2 != MARK}
    for n, get in gets.items():
        n.replace_all_uses_with(get, delete_user_cb=lambda u: u not in inside)
    for n in reversed(r.nodes):
        if any(u not in inside for u in n.users):
            raise PlanError(f"the custom autograd Function {r.key}: its op {n.name} is read outside "
                            f"the call without being one of its outputs")
        g.erase_node(n)
    return gets


def function_calls(gm: torch.fx.GraphModule) -> dict[str, tuple[list[torch.fx.Node], float]]:
    """Per custom Function call marked in `gm` (its graph and subgraphs): the nodes of the
    tensors its forward saved (arguments and its own ops' results), and its backward's working
    memory (`backward_work`)."""
    out: dict[str, tuple[list[torch.fx.Node], float]] = {}
    for mod in gm.modules():
        g = getattr(mod, "graph", None)
        if not isinstance(g, torch.fx.Graph):
            continue
        for r in regions(g, strict=False):
            m0 = mark_of(r.nodes[0])
            saved = [r.args[i] for i in m0.saved_args if isinstance(r.args[i], torch.fx.Node)]
            saved += [n for n in r.nodes if mark_of(n).saves_self and n not in saved]
            if m0.unseen_saves:
                log.debug("custom autograd Function %s saves %d tensor(s) that are not the graph's: "
                          "not counted", r.key, m0.unseen_saves)
            out[r.key] = (saved, backward_work(r))
    return out


class _Live:
    """A dispatch mode's view of the bytes of tensors alive (made under it, not views)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        live = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t._base is None:
                        live.add(t, t.numel() * t.element_size())
                return out

        self.mode = Mode()
        self.now = self.peak = 0.0

    def add(self, t: torch.Tensor, nb: float) -> None:
        import weakref

        self.now += nb
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._free, nb)

    def _free(self, nb: float) -> None:
        self.now -= nb


def backward_work(r: Region) -> float:
    """The most bytes the call's backward holds at once (its temporaries and the gradients it
    makes), as a multiple of its first tensor argument's size: its forward and backward run on
    meta tensors of the arguments' shapes (at the traced batch) under a dispatch mode counting
    what is alive. Hugging Face BLOOM's `GeLUFunction` recomputes the tanh formula in its
    backward: 5 of its input's size (torch 2.13). 0 where it cannot be run so."""
    def hint_int(d: Any) -> int:
        return int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)

    args: list[Any] = []
    first: Optional[torch.Tensor] = None
    try:
        for a in r.args:
            val = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
            if isinstance(a, torch.fx.Node):
                if not isinstance(val, torch.Tensor):
                    return 0.0
                t = torch.empty([hint_int(d) for d in val.shape], dtype=val.dtype, device="meta",
                                requires_grad=val.is_floating_point())   # the trace's values hold no grad flags
                first = t if first is None else first
                val = t
            args.append(val)
        if first is None:
            return 0.0
        with torch.enable_grad():
            out = r.fn.apply(*args)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            ins = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if not outs or not ins:
                return 0.0
            grads = [torch.empty_like(o) for o in outs]
            live = _Live()
            with live.mode:
                got = torch.autograd.grad(outs, ins, grads, allow_unused=True)
            del got
        return live.peak / max(first.numel() * first.element_size(), 1)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        # a Function that does not run on meta tensors: its backward is taken to hold only the
        # gradients it makes (logged)
        log.info("custom autograd Function %s: its backward could not be measured on meta; its "
                 "working memory is taken as its gradients'", r.key, exc_info=True)
        return 0.0


def renumber(nodes: list) -> None:
    """Number the custom Function calls of a capture's OpNodes in order of appearance ("Name#0",
    "Name#1", ...), as a whole export numbers them: a stitched capture's copied blocks hold
    their template block's keys. A call's ops are consecutive."""
    count, prev, new = 0, None, None
    for n in nodes:
        key = getattr(n, "function", None)
        if key is not None and key != prev:
            new = f"{key.split('#', 1)[0]}#{count}"
            count += 1
        if key is not None:
            n.function = new
        prev = key
