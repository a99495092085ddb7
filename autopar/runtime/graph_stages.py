"""Pipeline chunks cut from the traced model: pipelines for any model, its loss included.

Every model (the zoo's, one written by a user, a Hugging Face model: the runtime knows none of
their classes) is cut by torch's own pipeline tracer,
`torch.distributed.pipelining.pipeline(model, mb_args, split_spec)` (torch.export underneath),
at the first layer of every stage after the first. Each chunk is a GraphModule that calls the
model's own submodules under their original FQNs, so plan placements, recomputation, FSDP units
and checkpoint keys address them as in the whole model, and runs the code between them as
traced: a head written `x @ emb.weight.t()`, the loss at the end of the last chunk. A parameter
read by two chunks (a tied embedding) is in each under its name; the runtime sums their
gradients (`engine._build_tied_groups`).

What torch's tracer-built stages do not do, done here (`FedChunk`):

* a later chunk that reads a model input (the targets, in the last chunk) takes it from this
  step's micro-batches, not from the pipeline's sends (torch's stages feed model inputs to the
  first stage only);
* the trace was taken on the meta device: tensors the forward creates (`arange` positions) are
  made on the rank's device, and the tracer's dtype/device assertions are dropped (the runtime
  runs the chunks under autocast, where they would not hold);
* a custom `torch.autograd.Function`'s call, which the tracer records as its forward's ops, is
  folded back into one node calling `Function.apply` (`capture.functions.fold`): the chunk
  runs the user's backward, not autograd through the traced ops.

What the tracer gets wrong, set right around it: a module registered under several names (T5's
embedding) gets an object per name before the trace (`_unshare_modules`); a module called from
two chunks holds its parameters under the model's names in each (`_plain_call_names`); a tied
parameter is named so that each chunk resolves it (`_tied_names_resolved`).

A boundary carries every tensor a later chunk reads: a mask, position ids or rotary table
computed once before the first layer and read by every layer travel with the activation, passed
on by each chunk in between (`FedChunk.sends`); torch's stages send and receive tuples of
tensors, with gradients for the ones that require them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from autopar.capture.export import move_not_cast
from autopar.intra_op.execute import histc_any_dtype
from autopar.schema.errors import PlanError

log = logging.getLogger(__name__)

# a source of a chunk's input: ("act", k) the k-th tensor received from the previous chunk;
# ("input", i) the model's i-th input (its micro-batch)
Source = tuple[str, int]
# what a chunk sends on: ("act", k) the k-th tensor it received, passed on; ("out", k) the k-th
# element of its traced module's output (-1: the output itself, a single tensor)
Send = tuple[str, int]


@dataclass
class Chunk:
    """One pipeline chunk cut from the traced model: its module, where each of its module's
    inputs comes from, and what it sends to the next chunk (None: the last chunk, whose output
    is the loss)."""

    module: torch.fx.GraphModule
    sources: list[Source]
    sends: Optional[list[Send]]


def _drop_unused_modules(gm: torch.fx.GraphModule) -> None:
    """Remove the submodules `gm`'s graph never reaches. torch's tracer leaves a module holding
    a tied parameter in a chunk that does not read it (the zoo GPT's `head`, whose weight is the
    embedding's, in the first chunk): a second name for a parameter the chunk owns, which FSDP
    refuses to put in two units and which the chunk would otherwise materialise and sync."""
    used = {str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}

    def reached(fqn: str) -> bool:
        return any(u == fqn or u.startswith(fqn + ".") or fqn.startswith(u + ".") for u in used)

    gone: list[str] = []
    for fqn, _ in list(gm.named_modules()):
        if not fqn or reached(fqn) or any(fqn.startswith(g + ".") for g in gone):
            continue
        parent, _, leaf = fqn.rpartition(".")
        delattr(gm.get_submodule(parent) if parent else gm, leaf)
        gone.append(fqn)


_CALL = re.compile(r"(.+)@\d+")


def _plain_call_names(gm: torch.fx.GraphModule) -> None:
    """A module the forward calls more than once gets, from torch's tracer, one module per
    call after the first ("shared@1"), holding the first's parameters under that name. In the
    chunk holding the first call too they are the same tensors; in a chunk holding only a
    later call (an embedding called by the encoder's chunk and again by the decoder's) the
    name matches no parameter of the model: the copy was neither loaded nor synced with the
    others (a wrong loss, no error). There the module takes its own name back, so the chunk
    holds the parameter under the model's name, a tied copy like any other."""
    renamed = True
    while renamed:
        renamed = False
        for path, mod in list(gm.named_modules()):
            for name in list(mod._modules):
                m = _CALL.fullmatch(name)
                if m is None or m.group(1) in mod._modules:
                    continue
                plain = m.group(1)
                mod._modules[plain] = mod._modules.pop(name)
                _retarget_graphs(gm, path, name, plain)
                renamed = True
                break
            if renamed:
                break


def _retarget_graphs(gm: nn.Module, parent: str, old: str, new: str) -> None:
    """Rename child `old` of the module at `parent` to `new` in every graph above or at it
    (their call_module / get_attr targets are relative to their own module)."""
    for path, mod in gm.named_modules():
        g = getattr(mod, "graph", None)
        if not isinstance(g, torch.fx.Graph) or not (path == parent or not path or parent.startswith(path + ".")):
            continue
        rel = (parent[len(path):].lstrip(".") + "." if parent != path else "") + old
        rel = rel.lstrip(".")
        hits = [n for n in g.nodes if n.op in ("call_module", "get_attr")
                and (str(n.target) == rel or str(n.target).startswith(rel + "."))]
        for n in hits:
            n.target = rel[:-len(old)] + new + str(n.target)[len(rel):]
        if hits and callable(getattr(mod, "finalize", None)):
            # an InterpreterModule's graph is owned by the GraphModule it built from its
            # attributes then (the old name's): built again (`Graph.lint`, deep copies look there)
            mod.finalize()
        elif hits and hasattr(mod, "recompile"):
            mod.recompile()


# splits already traced in this process, by the model's structure (`capture.cache.model_key`),
# the micro-batch's shapes, the cuts, the device, the compute dtype and whether positions are
# traced as an op (context parallelism): the last few, each handed out as a deep copy
_SPLITS: "OrderedDict[tuple, list[Chunk]]" = OrderedDict()
SPLITS_KEPT = 4
#: how often `split_model` found its chunks kept ("hits") or traced them ("misses"), in this process
SPLIT_STATS = {"hits": 0, "misses": 0}


def split_model(model: nn.Module, example_mb: Sequence[Any], first_layers: Sequence[str],
                device: torch.device, param_dtype: Optional[torch.dtype] = None) -> list[Chunk]:
    """Cut `model` (on meta: it is copied) before each of `first_layers` (module FQNs, in
    order): one `Chunk` per chunk. `example_mb`: the model's inputs at the micro-batch size
    (meta tensors do). `param_dtype`: the dtype the runtime computes the floating parameters in
    (bf16 under a bf16 plan): the trace is taken with them in it, so a cast the code writes as
    `x.to(input_dtype)` (Hugging Face's RMSNorm restoring its input's dtype) is recorded to
    that dtype, not to the meta model's fp32; the chunks' parameters keep the model's dtypes.

    The tracer (torch.export underneath) is most of the cost, and a process that runs several
    plans of one model (a test launch, a sweep) cuts it the same way again: the last few splits
    are kept, keyed by everything the trace depends on (the model's structure as the capture
    cache keys it: module types, settings and class source, parameter names, shapes, dtypes and
    tying; the micro-batch's shapes and dtypes; the cuts; the device; `param_dtype`; traced
    positions), and each call gets its own deep copy of the chunks (the runtime materialises,
    wraps and shards them in place). `SPLIT_STATS` counts hits and misses; each is logged at
    debug level."""
    from autopar.capture.cache import model_key
    from autopar.models.positions import _TRACED

    with unset_fake_temporarily():
        key = (model_key(model, tuple(example_mb)), tuple(first_layers), str(device), str(param_dtype),
               bool(_TRACED[0]))
        kept = _SPLITS.get(key)
        if kept is not None:
            _SPLITS.move_to_end(key)
            SPLIT_STATS["hits"] += 1
            log.debug("pipeline split of %s at %s: kept", type(model).__name__, list(first_layers))
            return copy.deepcopy(kept)
    SPLIT_STATS["misses"] += 1
    log.debug("pipeline split of %s at %s: tracing", type(model).__name__, list(first_layers))
    chunks = _split_model(model, example_mb, first_layers, device, param_dtype)
    with unset_fake_temporarily():
        _SPLITS[key] = copy.deepcopy(chunks)
    while len(_SPLITS) > SPLITS_KEPT:
        _SPLITS.popitem(last=False)
    return chunks


def _split_model(model: nn.Module, example_mb: Sequence[Any], first_layers: Sequence[str],
                 device: torch.device, param_dtype: Optional[torch.dtype] = None) -> list[Chunk]:
    """`split_model`, traced."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from autopar.capture.functions import fold, marking_functions
    from autopar.models.hf import eager_attention_masks

    spec = {f: SplitPoint.BEGINNING for f in first_layers}
    # the tracer patches the forward of the modules it splits before, in place: trace a copy
    # (of a meta model: nothing allocated), so the model can be traced again
    dtypes = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    original = model
    with unset_fake_temporarily():   # a meta model's copy (its real buffers too), under verify's fake mode
        model = copy.deepcopy(model)
        _unshare_modules(model)
        if param_dtype is not None:
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(param_dtype)
    try:
        # Hugging Face attention masks as the capture builds them (`capture.export._export`)
        # custom autograd Functions' ops marked as theirs, folded below (`capture.functions`)
        with _keeping_hop_bodies(), _tied_names_resolved(), eager_attention_masks(), marking_functions():
            pipe = pipeline(model, mb_args=tuple(example_mb), split_spec=spec)
    except Exception as e:  # noqa: BLE001 - the tracer's own errors, reported with the split
        raise PlanError(f"cannot trace {type(model).__name__} into pipeline stages at "
                        f"{list(first_layers)}: {type(e).__name__}: {str(e)[:300]}") from e
    if pipe.num_stages != len(first_layers) + 1:
        raise PlanError(f"the pipeline tracer cut {type(model).__name__} into {pipe.num_stages} chunks, "
                        f"the plan has {len(first_layers) + 1}: a stage boundary at "
                        f"{list(first_layers)} is not a module the forward calls in order")
    sg = pipe.split_gm
    inputs = [n for n in sg.graph.nodes if n.op == "placeholder"]
    calls = [n for n in sg.graph.nodes if n.op == "call_module"]
    index = {c: i for i, c in enumerate(calls)}
    name = type(model).__name__

    def value(a: Any, i: int) -> tuple[int, int]:
        """(producing chunk, output element or -1) of chunk `i`'s argument `a`."""
        if isinstance(a, torch.fx.Node) and a in index:
            return index[a], -1
        if (isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target is operator.getitem
                and a.args and a.args[0] in index and isinstance(a.args[1], int)):
            return index[a.args[0]], a.args[1]
        raise PlanError(f"pipeline chunk {i} of {name} reads {a}, which is neither a model input nor "
                        f"a tensor an earlier chunk makes")

    reads: list[list[Any]] = []        # per chunk: per argument, ("input", k) or a value
    for i, call in enumerate(calls):
        if call.kwargs:
            raise PlanError(f"pipeline chunk {i} of {name} takes keyword inputs {sorted(call.kwargs)}; "
                            f"graph pipelines pass positional tensors")
        reads.append([("input", inputs.index(a)) if isinstance(a, torch.fx.Node) and a.op == "placeholder"
                      else value(a, i) for a in call.args])
    # carry[i]: the values chunk i receives, those made before it and read by it or later
    carry: list[list[tuple[int, int]]] = [[] for _ in calls]
    for i in range(1, len(calls)):
        for r in reads[i:]:
            for v in r:
                if isinstance(v[0], int) and v[0] < i and v not in carry[i]:
                    carry[i].append(v)
    out: list[Chunk] = []
    for i in range(len(calls)):
        srcs: list[Source] = [v if isinstance(v[0], str) else ("act", carry[i].index(v)) for v in reads[i]]
        sends: Optional[list[Send]] = None
        if i + 1 < len(calls):
            sends = [("out", v[1]) if v[0] == i else ("act", carry[i].index(v)) for v in carry[i + 1]]
            if not sends:
                raise PlanError(f"pipeline chunk {i + 1} of {name} reads nothing from the chunks before it")
        gm = pipe.get_stage_module(i)
        fold(gm)            # each custom Function call runs as `Function.apply`: its own backward
        _drop_unused_modules(gm)
        _plain_call_names(gm)
        retarget(gm, device)
        with unset_fake_temporarily():   # the meta parameters back to the model's dtypes
            for n, p in gm.named_parameters(remove_duplicate=False):
                if n in dtypes and p.dtype != dtypes[n]:
                    p.data = p.data.to(dtypes[n])
        out.append(Chunk(gm, srcs, sends))
    _lifted_values(out, original, example_mb, device, param_dtype)
    return out


def _unshare_modules(root: nn.Module) -> None:
    """Give every module registered under several names (Hugging Face T5's one embedding as
    `shared`, `encoder.embed_tokens` and `decoder.embed_tokens`) an object of its own at each
    name after the first, holding the same parameters and buffers: a tied parameter under
    several names, which the chunks and the runtime handle (`tied_groups`). A module object
    under two names makes torch's tracer record the calls inside a split module by their
    relative names (its `_ModuleStackTracer` proxies shared modules, and the split point's
    patched forward is bound to the module, not the proxy), and the cut failed: "Child module
    'norm' is not a descendant of parent module 'decoder.block.0'"."""
    seen = {id(root)}

    def visit(mod: nn.Module) -> None:
        for name, child in list(mod._modules.items()):
            if child is None:
                continue
            if id(child) in seen:
                twin = copy.copy(child)
                twin._parameters = dict(child._parameters)
                twin._buffers = dict(child._buffers)
                twin._modules = dict(child._modules)
                mod._modules[name] = child = twin
            seen.add(id(child))
            visit(child)

    visit(root)


_LIFTED = re.compile(r"lifted_tensor_\d+")


def _lifted_values(chunks: list[Chunk], model: nn.Module, example_mb: Sequence[Any], device: torch.device,
                   param_dtype: Optional[torch.dtype]) -> None:
    """Give the chunks' lifted tensor constants their values. A tensor the forward makes from
    Python data (Falcon's `fused_qkv[..., [-2], :]`: the index list becomes a tensor on the
    indexed tensor's device) is traced on the meta device with no value, and materialising
    would zero it: the chunk would read row 0 where the model reads row -2, a wrong loss and no
    error. The program the executor traces for `device` (fake tensors there:
    `intra_op.execute.meta_program`) holds them with their values, under the same names (the
    same trace order); they are copied in. Where that trace fails, a PlanError names them."""
    lost = [(ch.module, n) for ch in chunks for n, b in ch.module.named_buffers()
            if b.is_meta and _LIFTED.fullmatch(n.rsplit(".", 1)[-1])]
    if not lost:
        return
    from autopar.intra_op.execute import meta_program

    with unset_fake_temporarily():
        program, _ = meta_program(model, tuple(example_mb), param_dtype=param_dtype, device=device)
    held = {k.split(".", 1)[1] if k.startswith("model.") else k: v for k, v in program.constants.items()
            if isinstance(v, torch.Tensor) and not v.is_meta and type(v) is torch.Tensor}
    missing = [n for _, n in lost if n not in held]
    if missing:
        raise PlanError(f"the pipeline chunks of {type(model).__name__} read tensors its forward makes from "
                        f"Python data ({', '.join(missing[:4])}), which a trace on the meta device leaves without "
                        f"values, and tracing it for {device} did not give them "
                        f"({getattr(program, 'autopar_trace_fallback', None) or 'no such constant'})")
    for gm, n in lost:
        path, _, leaf = n.rpartition(".")
        owner = gm.get_submodule(path) if path else gm
        want = owner._buffers[leaf]
        value = held[n]
        if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
            raise PlanError(f"the pipeline chunks of {type(model).__name__}: constant {n} is "
                            f"{tuple(want.shape)} {want.dtype} in the split but {tuple(value.shape)} {value.dtype} "
                            f"in the program traced for {device}")
        owner._buffers[leaf] = value.detach().clone().to(device if device.type != "meta" else "cpu")


@contextlib.contextmanager
def _tied_names_resolved() -> Iterator[None]:
    """torch.pipelining's tracer (torch 2.13, `_IR._from_traced`) hands each chunk a parameter
    it reads under one of the parameter's names: the first of a list made from a set
    (`id_to_fqns`), so for a tied parameter (an embedding also the head's weight) which name
    depends on the string hash seed, and a name whose module the chunk does not hold fails
    the trace ("Attribute 'shared' not found in model": a chunk reading the embedding's
    weight outside the embedding module, for 4 of 6 hash seeds tried). Around the tracer, each
    chunk's top-level `_sink_params` gets the names ordered those the chunk can resolve
    first, then by name: every process traces the same chunks."""
    import sys

    import torch.distributed.pipelining._IR as ir

    uf = sys.modules[ir._sink_params.__module__]   # torch.export.unflatten (the name is also a function)
    orig = uf._sink_params

    def resolves(module: nn.Module, fqn: str) -> bool:
        obj: Any = module
        for atom in fqn.split("."):
            obj = getattr(obj, atom, None)
            if obj is None:
                return False
        return True

    def within(scope: list, fqn: str) -> Optional[str]:
        """`fqn` relative to `scope` (a repeated call's "name@1" read as "name"), or None."""
        atoms, plain = fqn.split("."), [x.split("@")[0] for x in scope]
        return ".".join(atoms[len(plain):]) if atoms[:len(plain)] == plain else None

    def sink(module: nn.Module, inputs_to_state: dict, scope: list, *rest: Any) -> Any:
        if not scope:
            inputs_to_state = {k: sorted(v, key=lambda f: (not resolves(module, f), f))
                               for k, v in inputs_to_state.items()}
        else:
            # a module called a second time ("shared@1") holds no parameters of its own: a
            # tied name under its scope would be read from it and fail ("'InterpreterModule'
            # object has no attribute 'weight'"); without such a name the caller passes it
            inputs_to_state = {k: [f for f in v if (r := within(scope, f)) is None or resolves(module, r)]
                               for k, v in inputs_to_state.items()}
        return orig(module, inputs_to_state, scope, *rest)

    ir._sink_params = sink
    uf._sink_params = sink
    try:
        yield
    finally:
        ir._sink_params = orig
        uf._sink_params = orig


@contextlib.contextmanager
def _keeping_hop_bodies() -> Iterator[None]:
    """torch.pipelining's tracer, while it rebuilds each chunk's module tree
    (`_IR._outline_submodules`, torch 2.13), loses the subgraph a higher-order op of a module
    runs (`wrap_with_set_grad_enabled` for a forward under `torch.no_grad()`, as Hugging Face's
    rotary embedding is): the module gets a placeholder for it that its caller never fills.
    Around the tracer, put each such subgraph back as the module's attribute, read where the op
    reads it."""
    import torch.distributed.pipelining._IR as ir

    orig = ir._outline_submodules

    def outline(graph: torch.fx.Graph) -> torch.fx.GraphModule:
        bodies = [(n.target, _module_path(n), getattr(graph.owning_module, n.target)) for n in graph.nodes
                  if n.op == "get_attr" and isinstance(getattr(graph.owning_module, str(n.target), None),
                                                       torch.fx.GraphModule)]
        new = orig(graph)
        for name, path, body in bodies:
            _restore_body(new, path, str(name), body)
        return new

    ir._outline_submodules = outline
    try:
        yield
    finally:
        ir._outline_submodules = orig


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _restore_body(root: nn.Module, path: str, name: str, body: torch.fx.GraphModule) -> None:
    """Make the module at `path` of `root` read `body` as its attribute `name` instead of from a
    placeholder of that name, and drop that argument (and what made it) from its callers."""
    try:
        mod = root.get_submodule(path) if path else root
    except AttributeError:
        return
    g = getattr(mod, "graph", None)
    if not isinstance(g, torch.fx.Graph):
        return
    phs = [n for n in g.nodes if n.op == "placeholder"]
    ph = next((n for n in phs if n.target == name), None)
    if ph is None:
        return
    pos = phs.index(ph)
    setattr(mod, name, body)
    with g.inserting_after(phs[-1]):
        attr = g.get_attr(name)
    ph.replace_all_uses_with(attr)
    g.erase_node(ph)
    g.lint()
    for owner in root.modules():
        og = getattr(owner, "graph", None)
        if not isinstance(og, torch.fx.Graph) or owner is mod:
            continue
        for n in list(og.nodes):
            if n.op != "call_module" or len(n.args) <= pos:
                continue
            try:
                if owner.get_submodule(str(n.target)) is not mod:
                    continue
            except AttributeError:
                continue
            dropped = n.args[pos]
            n.args = n.args[:pos] + n.args[pos + 1:]
            if isinstance(dropped, torch.fx.Node) and not dropped.users:
                og.erase_node(dropped)
        og.lint()


def retarget(gm: nn.Module, device: torch.device, traced: Optional[torch.device] = None) -> None:
    """Make a chunk traced on meta (or for the device `traced`) run on `device`, in its graph
    and in the graphs of the tracer's submodules: tensors its ops create or move get `device` (a
    meta device, or `traced`, in an op's arguments becomes `device`), and the tracer's metadata
    assertions (dtype and device as traced) go."""
    def fix(v: Any) -> Any:
        if isinstance(v, torch.device) and (v.type == "meta" or traced is not None and v.type == traced.type
                                            and v.index in (None, traced.index)):
            return device
        if isinstance(v, (tuple, list)):
            return type(v)(fix(x) for x in v)
        return v

    for mod in gm.modules():
        g = getattr(mod, "graph", None)
        if not isinstance(g, torch.fx.Graph):
            continue
        for n in list(g.nodes):
            if n.op != "call_function":
                continue
            if n.target is torch.ops.aten._assert_tensor_metadata.default:
                g.erase_node(n)
                continue
            n.args = fix(n.args)
            n.kwargs = {k: fix(v) for k, v in n.kwargs.items()}
            move_not_cast(n)
            if n.target is torch.ops.aten.histc.default and device.type == "cpu":
                # a model's branch for other devices (Hugging Face's experts count tokens with
                # an integer histc unless on CPU) traced on meta: CPU has no integer kernel
                n.target = histc_any_dtype
        g.lint()
        if hasattr(mod, "recompile"):
            mod.recompile()


class FedChunk(nn.Module):
    """A chunk as its PipelineStage runs it: forward(*received) takes what the schedule hands
    the stage (the tensors the previous chunk sends; on the first chunk the micro-batch of the
    first input), calls `inner` with its inputs in the traced order, model inputs taken from
    the micro-batches given to `start_step` (one forward per micro-batch, in order: every torch
    schedule runs a chunk's forwards in micro-batch order), and returns what the next chunk
    receives (`sends`; the last chunk: the loss)."""

    def __init__(self, inner: Any, sources: list[Source], sends: Optional[list[Send]] = None) -> None:
        super().__init__()
        self.inner = inner
        self.sources = list(sources)
        self.sends = None if sends is None else list(sends)
        self._mbs: dict[int, Sequence[Any]] = {}
        self._next = 0

    @property
    def model_inputs(self) -> set[int]:
        """The model inputs this chunk reads (indices)."""
        return {i for kind, i in self.sources if kind == "input"}

    def start_step(self, local: Sequence[Any], num_microbatches: int) -> None:
        """This step's model inputs (the rank's rows), split into micro-batches as the schedule
        splits what it is given."""
        self._mbs = step_microbatches(local, self.model_inputs, num_microbatches, "pipeline chunk")
        self._next = 0

    def forward(self, *received: Any) -> Any:
        mb = self._next
        self._next += 1
        return self.run(received, lambda k: self._mbs[k][mb])

    def run(self, received: Sequence[Any], model_input: Any) -> Any:
        """The chunk on `received` with `model_input(k)` giving the model's k-th input."""
        args = [received[k] if kind == "act" else model_input(k) for kind, k in self.sources]
        y = self.inner(*args)
        if self.sends is None:
            return y
        outs = tuple(_passed_on(received[k]) if kind == "act" else contiguous_send(y if k < 0 else y[k])
                     for kind, k in self.sends)
        return outs[0] if len(outs) == 1 else outs


def step_microbatches(local: Sequence[Any], inputs: set[int], num_microbatches: int, who: str
                      ) -> dict[int, Sequence[Any]]:
    """{model input index: its micro-batches} of this step's rows `local` for the `inputs` a
    chunk reads, split as the schedule splits what it is given (a non-tensor repeated)."""
    out: dict[int, Sequence[Any]] = {}
    for i in inputs:
        x = local[i] if i < len(local) else None
        if x is None:
            raise PlanError(f"{who} needs model input {i}, which this rank was not given")
        out[i] = (torch.tensor_split(x, num_microbatches) if isinstance(x, torch.Tensor) and x.dim() > 0
                  else [x] * num_microbatches)
    return out


def contiguous_send(x: Any) -> Any:
    """A tensor the chunk makes for the next one, contiguous: torch's send (gloo's and NCCL's)
    takes contiguous tensors only, and the receiver's buffer is a contiguous tensor of its
    shape. Falcon's causal mask crosses every boundary expanded over the batch (stride 0 along
    it: gloo's send refused it, "input tensor has to be contiguous"); a copy where a tensor is
    such a view, nothing otherwise."""
    return x.contiguous() if isinstance(x, torch.Tensor) and not x.is_contiguous() else x


def _passed_on(x: Any) -> Any:
    """A received tensor sent on unchanged: a view, so its gradient (a later chunk's) flows
    back through this chunk's backward to the chunk that made it."""
    return x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x
