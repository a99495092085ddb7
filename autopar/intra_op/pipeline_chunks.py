"""Pipeline chunks of a solved program: the executor inside `torch.distributed.pipelining`.

A pipelined plan whose chunks carry per-op layouts (`StagePlan.op_layouts`) runs each chunk op
by op as solved, like a stage that is not pipelined (`autopar.intra_op.execute`), on its tp
sub-mesh. Every rank exports the model with its loss once (from a meta copy, so no chunk's
weights are needed to trace it) and cuts the program's nodes where the next chunk's first op
stands; each chunk of the rank runs its run of nodes with `_PlanInterpreter.run_span`.

* A chunk receives, as local tensors, every tensor made before it and read by it or a later
  chunk (`StageLayouts.receives`, in program order; the planner's `stage_layouts.crossing`),
  and sends the next chunk's: a tensor it reads is made a DTensor in the layout its producer's
  solution left it in (which every reader's solution assumed, the planner checks), a tensor it
  only passes on goes as it came. So a boundary costs the sends the plan counts and no
  collective; a gradient goes back in the layout the reader's resharding left it (partial made
  replicated, as inside one program). Between chunks of different tp degrees (meshes of
  different sizes, joined by `runtime.pipeline_p2p`'s fan-out) every tensor crosses
  replicated: the sender redistributes what its ops left sharded or partial (the collective
  the plan counts in its forward, `stage_layouts.chunk_layouts`) and its gradient comes back
  whole.
* Model inputs a chunk reads (the targets, in the last chunk) come from the step's
  micro-batches (`start_step`), as `runtime.graph_stages.FedChunk` feeds traced chunks; the
  first chunk gets the first input from the schedule.
* Only the rank's chunks' parameters are materialised and sharded (`ShardedProgram.own`); the
  others stay on meta. A chunk's `holder` presents its parameters under their model FQNs (the
  optimizer, checkpoints and tied-gradient groups address them so), and the chunk reads them
  from it. Under ZeRO-3 each chunk is the FSDP root of its units (`units`: its holder holds
  the unit modules themselves; the runtime's `zero.ZeroSharding._shard_solved_chunks`), each
  unit's ops one FSDP call (`ShardedProgram.run_units`).
* Shapes and dtypes of what crosses a boundary, for torch's static send and receive buffers,
  come from a run of the plain program on fake tensors under the plan's autocast, divided by
  the layouts (`_fake_run`, `_examples`). Shape arithmetic crossing a boundary (the sizes of a
  symbolically batched program) is not sent: the micro-batch size is fixed, so it is a
  constant of the receiving chunk, taken from the same run.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.intra_op.execute import (
    ShardedProgram,
    _flat_nodes,
    _grad_target,
    _PlanInterpreter,
    _program_calls,
    _Reshard,
    _run_target,
    _subgraph_index,
    _ToLocal,
    contiguous_strides,
    fitting_program,
    redistribute,
    to_placements,
)
from autopar.intra_op.solution import ShardingSolution
from autopar.runtime.graph_stages import contiguous_send, retarget
from autopar.schema.errors import PlanError

__all__ = ["ProgramChunk", "parallelize_chunks"]


class _FromLocal(torch.autograd.Function):
    """A received local tensor as a DTensor laid out `placements`; its gradient goes back as the
    local tensor of the gradient laid out `grad_placements` (the sender's `_ToLocal` expects it
    so)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, placements: tuple, grad_placements: tuple,
                shape: torch.Size, stride: tuple) -> DTensor:
        ctx.grad_placements = grad_placements
        return DTensor.from_local(x.view_as(x), mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx: Any, g: Any) -> tuple:
        if isinstance(g, DTensor):
            g = redistribute(g, ctx.grad_placements).to_local()
        return g, None, None, None, None, None


class _Spans:
    """The program cut into chunks: each chunk's nodes, the placeholders they read, what each
    chunk receives (tensors made before it and read by it or later), in program order."""

    def __init__(self, gm: torch.fx.GraphModule, chunk_ops: Sequence[Sequence[str]], values: dict) -> None:
        nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
        order = {n: i for i, n in enumerate(nodes)}
        top: dict[str, torch.fx.Node] = {}
        calls = _program_calls(gm)
        for name, n in calls.items():
            # an op inside a wrapped subgraph stands where its wrapper does
            top[name] = n if n in order else next(w for w in nodes if name.startswith(w.name + "__"))
        starts = []
        for c, ops in enumerate(chunk_ops):
            at = [order[top[o]] for o in ops if o in top]
            if not at:
                raise PlanError(f"pipeline chunk {c}: none of its {len(ops)} solved ops is in the model's program")
            starts.append(min(at))
        starts[0] = 0
        if starts != sorted(starts):
            raise PlanError("the model's program runs the pipeline chunks' ops in another order than the plan")
        bounds = starts[1:] + [len(nodes)]
        self.nodes = [nodes[a:b] for a, b in zip(starts, bounds)]
        where = {n: c for c, ns in enumerate(self.nodes) for n in ns}
        for c, ops in enumerate(chunk_ops):
            stray = [o for o in ops if o in top and where[top[o]] != c]
            if stray:
                raise PlanError(f"pipeline chunk {c}'s op {stray[0]} runs among another chunk's ops in the "
                                f"model's program; the plan's chunk boundaries do not cut it in order")
        self.placeholders = [[p for p in gm.graph.nodes if p.op == "placeholder"
                              and any(where.get(u) == c for u in p.users)] for c in range(len(self.nodes))]
        # OpGraph names: an output of a wrapped subgraph (a getitem of its wrapper) is named
        # after the subgraph's node that makes it, as the capture inlines it
        self.names: dict[torch.fx.Node, str] = {n: n.name for n in nodes}
        for n in nodes:
            if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) \
                    and _subgraph_index(n.args[0], gm) is not None:
                w = n.args[0]
                sub = getattr(gm, str(w.args[_subgraph_index(w, gm)].target))
                out = next(x for x in sub.graph.nodes if x.op == "output")
                inner = _flat_nodes(out.args[0])[n.args[1]]
                if isinstance(inner, torch.fx.Node):
                    self.names[n] = f"{w.name}__{inner.name}"
        # what crosses into chunk c: tensors are sent; shape arithmetic on the micro-batch's
        # sizes (a symbolic batch's sym_size) is the same every micro-batch, a constant there
        self.receives: list[list[torch.fx.Node]] = [[]]
        self.constants: list[dict[torch.fx.Node, Any]] = [{}]
        for c in range(1, len(self.nodes)):
            crossing = [n for n in nodes[:starts[c]] if any(where.get(u, -1) >= c for u in n.users)]
            self.receives.append([n for n in crossing if isinstance(values.get(n), torch.Tensor)])
            self.constants.append({n: values.get(n) for n in crossing if not isinstance(values.get(n), torch.Tensor)})
            bad = [n.name for n, v in self.constants[-1].items() if not isinstance(v, (int, float, bool, type(None)))]
            if bad:
                raise PlanError(f"pipeline chunk {c} reads {bad[0]} from an earlier chunk, which is neither a "
                                f"tensor nor a number: it cannot cross a pipeline boundary")


def _holder(model: nn.Module, fqns: Sequence[str], units: Sequence[str] = ()) -> nn.Module:
    """A module tree holding `model`'s parameters `fqns` (the same objects) under those names;
    the modules `units` (ZeRO-3's FSDP units) themselves, so that FSDP, which swaps a unit's
    parameters on its module, swaps them where the program reads them too."""
    root = nn.Module()
    for u in units:
        *path, name = u.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod._modules[part] = nn.Module()
            mod = mod._modules[part]
        mod._modules[name] = model.get_submodule(u)
    for fqn in fqns:
        if any(fqn == u or fqn.startswith(u + ".") for u in units):
            continue
        *path, name = fqn.split(".")
        mod, src = root, model
        for part in path:
            src = getattr(src, part)
            if part not in mod._modules:
                mod._modules[part] = nn.Module()
            mod = mod._modules[part]
        mod._parameters[name] = getattr(src, name)
    return root


class ProgramChunk(nn.Module):
    """One pipeline chunk of a solved program, as its PipelineStage runs it: forward(*received)
    takes the local tensors the previous chunk sent (on the first chunk, the micro-batch of the
    first model input) and returns what the next chunk receives (the last chunk: the loss).
    Call `start_step` with the step's model inputs before the schedule runs."""

    def __init__(self, prog: ShardedProgram, index: int, spans: _Spans,
                 layouts: Sequence[dict[str, tuple[str, ...]]], user_inputs: dict[torch.fx.Node, int],
                 specs: dict[torch.fx.Node, Any], params: set[str], param_names: dict[torch.fx.Node, str],
                 units: Sequence[str] = (), handover: bool = False) -> None:
        super().__init__()
        self._prog = [prog]                 # not a submodule: its model holds every chunk's parameters
        self.index = index
        self.nodes = spans.nodes[index]
        self.mine = set(self.nodes)
        self.last = index == len(spans.nodes) - 1
        self.placeholders = spans.placeholders[index]
        self.recv = spans.receives[index]
        self.constants = spans.constants[index]
        self.names = spans.names
        # set by `parallelize_chunks` from the fake run: (received, sent) as meta tensors, and
        # the global shape of each received tensor
        self.examples: tuple = ((), ())
        self.shapes: dict[torch.fx.Node, torch.Size] = {}
        self.sends = None if self.last else spans.receives[index + 1]
        self.recv_layouts = layouts[index]
        self.send_layouts = None if self.last else layouts[index + 1]
        # the next chunk runs on a mesh of another tp degree: what it receives is replicated
        # (its `receives`), what this chunk made in another layout is redistributed first
        self.handover = handover
        self.specs = specs
        self.user_inputs = {ph: user_inputs[ph] for ph in self.placeholders if ph in user_inputs}
        if index == 0 and 0 not in self.user_inputs.values():
            raise PlanError("the first pipeline chunk does not read the model's first input")
        self.param_names = sorted(params)
        self.units = list(units)
        self.holder = _holder(prog.model, self.param_names, self.units)
        self._names_of = param_names        # parameter placeholder -> its name in `holder`
        self._mbs: dict[int, Sequence[Any]] = {}
        self._next = 0

    @property
    def prog(self) -> ShardedProgram:
        return self._prog[0]

    def rehold(self) -> None:
        """Hold the model's parameters again (`holder`) after the runtime replaced some of them
        (expert parallelism's slices of the experts' weights, under the same names): what
        torch's PipelineStage sees of this chunk (the gradients it scales, what the optimizer
        and data parallelism reach) is what the chunk's run reads."""
        self.holder = _holder(self.prog.model, self.param_names, self.units)

    @property
    def model_inputs(self) -> set[int]:
        """The model inputs this chunk takes from the step (the first chunk's first: from the schedule)."""
        return {k for k in self.user_inputs.values() if not (self.index == 0 and k == 0)}

    def start_step(self, local: Sequence[Any], num_microbatches: int) -> None:
        """This step's model inputs (the rank's rows), split into micro-batches as the schedule
        splits what it is given; the chunk's forwards then run in micro-batch order."""
        from autopar.runtime.graph_stages import step_microbatches

        self._mbs = step_microbatches(local, self.model_inputs, num_microbatches, f"pipeline chunk {self.index}")
        self._next = 0

    def forward(self, *received: Any) -> Any:
        mb = self._next
        self._next += 1
        prog = self.prog
        env: dict[torch.fx.Node, Any] = {}
        for ph in self.placeholders:
            env[ph] = self._placeholder(ph, mb, received)
        if self.index > 0:
            for node, x in zip(self.recv, received):
                env[node] = self._receive(node, x)
            env.update(self.constants)
        interp = _PlanInterpreter(prog)
        keep = set(self.sends or ())
        try:
            with interp.regather:
                out = interp.run_span(self.nodes, env, keep)
                if self.last:
                    loss = out[0] if isinstance(out, (tuple, list)) else out
                    return loss.to_local() if isinstance(loss, DTensor) else loss
                return tuple(self._send(n, interp.env[n], received) for n in self.sends)
        finally:
            interp.release()

    # -- boundary ------------------------------------------------------------------------
    def _placeholder(self, ph: torch.fx.Node, mb: int, received: Sequence[Any]) -> Any:
        from torch.export.graph_signature import InputKind

        prog, spec = self.prog, self.specs[ph]
        if spec.kind == InputKind.PARAMETER:
            # the holder's: under ZeRO-3 FSDP swaps the root unit's parameters there
            return self.holder.get_parameter(self._names_of[ph])
        if spec.kind == InputKind.BUFFER:
            return prog._replicated(prog._wrapped[0].get_buffer(spec.target).to(prog.run_device))
        if spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            c = prog.constants[spec.target]
            if isinstance(c, torch.Tensor) and c.is_meta:
                raise PlanError(f"the model's program holds a tensor constant ({spec.target}) traced on the meta "
                                f"device only, which a pipeline chunk cannot run")
            return prog._replicated(c) if isinstance(c, torch.Tensor) else c
        k = self.user_inputs[ph]
        x = received[0] if self.index == 0 and k == 0 else self._mbs[k][mb]
        return prog._user_input(ph.name, x)

    def _receive(self, node: torch.fx.Node, x: Any) -> Any:
        """A received local tensor this chunk reads, as a DTensor in its solved layout (one it
        only passes on stays as it came)."""
        name = self._name(node)
        if not isinstance(x, torch.Tensor) or not any(u in self.mine for u in node.users):
            return x
        spec = self.recv_layouts.get(name)
        if spec is None:
            raise PlanError(f"pipeline chunk {self.index} reads {name}, which crosses into it with no solved layout")
        pl = to_placements(spec, x.dim())
        shape = self.shapes[node]
        return _FromLocal.apply(x, self.prog.mesh, pl, _grad_target(pl, ()), shape, contiguous_strides(shape))

    def _send(self, node: torch.fx.Node, v: Any, received: Sequence[Any]) -> Any:
        if node in self.recv:
            # passed on (or read here and passed on): the local tensor as it came, a view so
            # that a later chunk's gradient flows back through this chunk's backward
            x = received[self.recv.index(node)]
            return x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x
        if not isinstance(v, DTensor):
            return contiguous_send(v)
        want = self.send_layouts.get(self._name(node))
        if want is not None and self.handover and all(w == "R" for w in want):
            # the gradient comes back whole: back to this chunk's layout by a slice
            v = _Reshard.apply(v, tuple(to_placements(want, v.ndim)), _grad_target(v.placements, ()))
        if want is None or tuple(to_placements(want, v.ndim)) != tuple(v.placements):
            raise PlanError(f"pipeline chunk {self.index} sends {self._name(node)} laid out "
                            f"{tuple(map(str, v.placements))}, but the next chunk expects {want}")
        return contiguous_send(_ToLocal.apply(v, _grad_target(v.placements, ())))

    def _name(self, node: torch.fx.Node) -> str:
        return self.names.get(node, node.name)



def parallelize_chunks(model: nn.Module, example_inputs: Sequence[Any], solution: ShardingSolution,
                       mesh: DeviceMesh, chunk_ops: Sequence[Sequence[str]],
                       receives: Sequence[dict[str, tuple[str, ...]]], mine: Sequence[int], *,
                       materialize: Callable[[set[str]], None], aliases: dict[str, str],
                       device: torch.device, autocast: Callable[[], Any],
                       compute_dtype: Callable[[torch.Tensor], torch.dtype],
                       param_dtype: Optional[torch.dtype] = None, loss_fn: Any = None,
                       recompute: Sequence[Sequence[str]] = (),
                       units: Optional[dict[int, Sequence[str]]] = None,
                       handover: Sequence[int] = (), context: Any = None, every: Any = None,
                       discard: Sequence[Sequence[str]] = ()
                       ) -> tuple[list[ProgramChunk], list[set[str]]]:
    """The rank's pipeline chunks `mine` of `model` (on meta) run as `solution` plans (the
    merged solution of those chunks' layouts), and every chunk's parameters (canonical names).
    `chunk_ops`: every chunk's op names, in pipeline order; `receives`: every chunk's
    `StageLayouts.receives`. `materialize(names)` makes the parameters the rank's chunks read
    real on `device` (the rest stay on meta). `example_inputs`: one micro-batch of real inputs;
    `autocast()` the context the run computes under and `compute_dtype(p)` the dtype parameter
    `p` computes in (for the boundary buffers' dtypes). `units`: per chunk of the rank, the
    modules ZeRO-3 shards as FSDP units (their chunk's `holder` holds the modules themselves,
    every parameter of theirs materialised). `handover`: the chunks whose next chunk runs on a
    mesh of another tp degree (stages of different tp: they send it replicated tensors,
    redistributing what they made in another layout; `stage_layouts.chunk_layouts`).
    `context`: context parallelism, as `execute.parallelize_graph` takes it (`example_inputs`
    a cp rank's tokens; the positions an op of the program, read when a chunk runs). Call it
    on every rank of the tp mesh. `every`: every chunk's op choices (`op_choices`, in pipeline
    order), which the program traced for `device` is matched against (`fitting_program`); the
    rank's own where not given."""
    from torch.export.graph_signature import InputKind

    from autopar.capture.export import _WithLoss, default_loss

    if tuple(mesh.shape) != tuple(solution.mesh_shape):
        raise PlanError(f"the solution is for a mesh of shape {tuple(solution.mesh_shape)}, "
                        f"the device mesh has shape {tuple(mesh.shape)}")
    if context is not None:
        from autopar.capture.own_positions import whole_sequence
        from autopar.models.positions import traced_positions

        # a model that makes its own positions: its aranges of them made the op
        # (`execute.adopt_positions`), the inputs it shifts shifted on the whole sequence
        with traced_positions(), whole_sequence(context.cp.seq):
            program, names = fitting_program(model, example_inputs, solution, loss_fn=loss_fn,
                                             param_dtype=param_dtype, device=device, whole=every)
        context.check(program)
        context.cp.shifts.update(getattr(program.graph_module, "autopar_input_shifts", {}))
    else:
        program, names = fitting_program(model, example_inputs, solution, loss_fn=loss_fn, param_dtype=param_dtype,
                                         device=device, whole=every)
    gm = program.graph_module
    specs = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], program.graph_signature.input_specs))
    wrapped = _WithLoss(model, loss_fn or default_loss, names)
    values = _fake_run(gm, program, specs, wrapped, example_inputs, autocast, compute_dtype, device)
    spans = _Spans(gm, chunk_ops, values)

    def canon(target: str) -> str:
        fqn = target.removeprefix("model.")
        return aliases.get(fqn, fqn)

    params = [{canon(specs[ph].target) for ph in phs if specs[ph].kind == InputKind.PARAMETER}
              for phs in spans.placeholders]
    units = units or {}
    for c in mine:
        for u in units.get(c, ()):
            params[c] |= {canon(f"model.{u}.{n}") for n, _ in model.get_submodule(u).named_parameters()}
    own = set().union(*(params[c] for c in mine))
    materialize(own)
    prog = ShardedProgram(model, wrapped, program, solution, mesh, names, device=device,
                          recompute=recompute, own=own, discard=discard)
    prog.context = context
    users = [ph for ph, s in specs.items() if s.kind == InputKind.USER_INPUT]
    user_inputs = {ph: k for k, ph in enumerate(users)}
    names = {ph: canon(s.target) for ph, s in specs.items() if s.kind == InputKind.PARAMETER}
    chunks = [ProgramChunk(prog, c, spans, receives, user_inputs, specs, params[c], names, units.get(c, ()),
                           handover=c in handover) for c in mine]
    for ch in chunks:
        ch.examples = _examples(ch, values, example_inputs, mesh)
        ch.shapes = {n: torch.Size(values[n].shape) for n in ch.recv}
    return chunks, params


def _fake_run(gm: torch.fx.GraphModule, program: Any, specs: dict, wrapped: nn.Module, example_inputs: Sequence[Any],
              autocast: Callable[[], Any], compute_dtype: Callable[[torch.Tensor], torch.dtype],
              device: torch.device) -> dict[torch.fx.Node, Any]:
    """Every node's value in a run of the plain program (one device, no plan) on fake tensors
    under `autocast`, parameters in their compute dtype and requiring gradients as they do:
    the shapes, dtypes and gradient needs the chunks' boundaries will have, and the values of
    the shape arithmetic (a micro-batch's sizes) a later chunk reads."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputKind

    vals: dict[torch.fx.Node, Any] = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op == "call_function":
                # as the executor runs an op of a program exported on meta (`execute._run_target`:
                # a model's branch for other devices, HF's integer histc, runs on CPU)
                out = _run_target(n, *self.fetch_args_kwargs_from_env(n))
            else:
                out = super().run_node(n)
            vals[n] = out
            return out

    # a program traced on meta: the devices its ops name become `device` (the runtime's
    # interpreter maps them as it runs; the plain run here needs them in the graph)
    retarget(gm, device, getattr(program, "autopar_traced_device", None))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, autocast():
        flat = []
        users = iter(example_inputs)
        for spec in specs.values():
            if spec.kind == InputKind.PARAMETER:
                p = wrapped.get_parameter(spec.target)
                flat.append(torch.empty(p.shape, dtype=compute_dtype(p), device=device,
                                        requires_grad=p.requires_grad))
            elif spec.kind == InputKind.BUFFER:
                b = wrapped.get_buffer(spec.target)
                flat.append(torch.empty(b.shape, dtype=b.dtype, device=device))
            elif spec.kind == InputKind.USER_INPUT:
                x = next(users)
                flat.append(mode.from_tensor(x.to(device)) if isinstance(x, torch.Tensor) else x)
            else:
                c = program.constants[spec.target]
                flat.append(mode.from_tensor(c) if isinstance(c, torch.Tensor) else c)
        _Record(gm).run(*flat)
    return vals


def _examples(ch: ProgramChunk, values: dict, example_inputs: Sequence[Any], mesh: DeviceMesh
              ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(what chunk `ch` receives, what it sends) as meta tensors of the local shapes and dtypes
    of the run, requires_grad saying whether a gradient comes back: each boundary tensor of
    the fake run divided by its layout. The first chunk receives the first model input; the
    last sends its loss."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def local(node: torch.fx.Node, layouts: dict[str, tuple[str, ...]]) -> torch.Tensor:
        v = values[node]
        shape = tuple(v.shape)
        spec = layouts.get(ch.names.get(node, node.name))
        if spec is not None:
            # real tensors for its offsets even under a fake mode (`autopar verify`), which has
            # no values to read them from (a boundary split along its tokens: sequence parallelism)
            with unset_fake_temporarily():
                shape, _ = compute_local_shape_and_global_offset(shape, mesh, to_placements(spec, len(shape)))
        return torch.empty(shape, dtype=v.dtype, device="meta").requires_grad_(v.requires_grad)

    if ch.index == 0:
        x0 = example_inputs[0]
        ins: tuple = (torch.empty(x0.shape, dtype=x0.dtype, device="meta"),)
    else:
        ins = tuple(local(n, ch.recv_layouts) for n in ch.recv)
    if ch.last:
        out = next(n for n in ch.nodes if n.op == "output")
        lv = _flat_nodes(out.args[0])[0]
        v = values[lv]
        outs: tuple = (torch.empty(v.shape, dtype=v.dtype, device="meta").requires_grad_(v.requires_grad),)
    else:
        outs = tuple(local(n, ch.send_layouts) for n in ch.sends)
    return ins, outs
