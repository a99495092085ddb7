"""Capture a model into an OpGraph with torch.export (non-strict), torch.fx as fallback.

The model may live on the meta device: nothing is allocated or computed, only shapes are
propagated. The batch dimension (dim 0 of every example input) is captured symbolically, so the
graph serves every micro-batch size; models that refuse a symbolic batch are captured at two
batch sizes and the dims that change are read off as linear in the batch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from autopar.capture.graph import OpGraph, OpNode, ParamInfo, Ref, SymDim, TensorMeta, flatten_refs
from autopar.schema.errors import PlanError

log = logging.getLogger(__name__)

LossFn = Callable[[Any], torch.Tensor]


def default_loss(out: Any) -> torch.Tensor:
    """The output itself when it is a scalar; a Hugging Face output's `loss` when set; else the sum
    of the first tensor output (a stand-in loss with the right backward cost)."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return default_loss(o)
    raise PlanError(f"the model returned {type(out).__name__}, which holds no tensor; pass loss_fn= "
                    f"to turn its output into a scalar loss")


class _WithLoss(nn.Module):
    """The model and its loss as one module; `names` turns positional inputs into keyword
    arguments (example inputs given as a dict, e.g. {"input_ids": ..., "labels": ...})."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, names: Optional[Sequence[str]] = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.names = list(names) if names else None

    def forward(self, *args: Any) -> torch.Tensor:
        out = self.model(**dict(zip(self.names, args))) if self.names else self.model(*args)
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            return out
        return self.loss_fn(out)


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def find_layers(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Repeated blocks: children of a ModuleList, Sequential or ModuleDict (blocks kept under
    names) holding >= 2 modules of one class with parameters, outermost only (experts inside a
    block stay inside it)."""
    layers: list[str] = []
    types: dict[str, str] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or any(
                name == l or name.startswith(l + ".") for l in layers):
            continue
        kids = [(n, c) for n, c in mod.named_children() if any(True for _ in c.parameters())]
        classes = {type(c).__name__ for _, c in kids}
        if len(kids) >= 2 and len(classes) == 1:
            for n, c in kids:
                fq = f"{name}.{n}" if name else n
                layers.append(fq)
                types[fq] = type(c).__name__
    return layers, types


def capture(model: nn.Module, example_inputs: Sequence[Any], *, loss_fn: Optional[LossFn] = None,
            name: Optional[str] = None, batch_dim: bool = True, repeated: bool = True,
            cache: Any = None) -> OpGraph:
    """Capture `model(*example_inputs)` (plus its loss) as an OpGraph.

    With `batch_dim`, dim 0 of every tensor input is the batch and shapes are kept symbolic in it.
    `model` may be any nn.Module, a Hugging Face `PreTrainedModel` included (its `.loss` is the
    loss when the inputs hold labels). `example_inputs` is a tuple of positional inputs, or a dict
    of keyword inputs (`{"input_ids": ids, "labels": ids}`). Tries torch.export (symbolic batch,
    then two batch sizes), then torch.fx.symbolic_trace; raises PlanError naming the module and
    op when all fail. With `repeated`, a stack of identical blocks is exported cut to 3 blocks
    (and 2 where needed) and stitched to its depth (`capture.repeated`; the same graph, in a fraction of the
    time). `cache`: a `CaptureCache`, True for the one under the user's cache directory, or
    None/False for none (`capture.cache`).
    """
    if cache:
        from autopar.capture.cache import cached_capture

        g = cached_capture(model, example_inputs, cache=cache, loss_fn=loss_fn, name=name,
                           batch_dim=batch_dim, repeated=repeated)
        _remember(model, example_inputs, g, loss_fn=loss_fn, batch_dim=batch_dim, repeated=repeated)
        return g
    if not isinstance(model, nn.Module):
        raise PlanError(f"expected a torch.nn.Module, got {type(model).__name__}")
    from autopar.models.positions import calls

    before = calls()
    g = _capture(model, example_inputs, loss_fn=loss_fn, name=name, batch_dim=batch_dim, repeated=repeated)
    g.reads_positions = calls() > before
    if not g.reads_positions:
        g.own_positions = _own_positions(model, example_inputs, loss_fn, g)
    _remember(model, example_inputs, g, loss_fn=loss_fn, batch_dim=batch_dim, repeated=repeated)
    return g


#: the fingerprints of this process's captures (`OpGraph.fingerprint`) by the model's structure,
#: the capture cache's key (`cache.model_key`: every module's type, settings and class source,
#: every parameter's and buffer's name, shape and dtype, the inputs' shapes, torch's and
#: autopar's capture code). `fingerprint` reads it: checking a plan against its model
#: (`runtime.check_plan`, before every `autopar.runtime.run` and `verify`) captured the model
#: again each time, in a process that had just captured one of the same structure to plan it
#: (the test suite's one-process reference runs and verifies: about a second of CPU each).
_FINGERPRINTS: dict[str, str] = {}


def _remember(model: Any, example_inputs: Any, g: OpGraph, **options: Any) -> None:
    """Keep `g`'s fingerprint under the model's structure (`_FINGERPRINTS`). A model the key
    cannot describe is not kept: its next check captures it again, as before."""
    from autopar.capture.cache import model_key

    try:
        key = model_key(model, example_inputs, **options)
    except (TypeError, ValueError, OSError) as e:
        log.debug("capture: no fingerprint kept for %s (%s)", type(model).__name__, e)
        return
    _FINGERPRINTS[key] = g.fingerprint()


def fingerprint(model: nn.Module, example_inputs: Sequence[Any]) -> str:
    """`capture(model, example_inputs).fingerprint()`: the one this process found for a model of
    the same structure and inputs (`_FINGERPRINTS`), else a new capture's."""
    from autopar.capture.cache import model_key

    _prepare_hf(model)          # what capture changes of a Hugging Face config, before the key reads it
    try:
        fp = _FINGERPRINTS.get(model_key(model, example_inputs))
    except (TypeError, ValueError, OSError):
        fp = None
    return fp if fp is not None else capture(model, example_inputs).fingerprint()


def _own_positions(model: nn.Module, example_inputs: Any, loss_fn: Optional[LossFn], g: OpGraph) -> Optional[str]:
    """For a model that does not read `token_positions`: "" where its program has token
    positions the runtime can set for a cp rank's chunks (`capture.own_positions.find`, the
    program at the example's S tokens against S / 2, as a cp2 rank traces it), else why not;
    None where context parallelism is out anyway (no fused attention op, no token ids)."""
    from autopar.capture.own_positions import find, tokens_of, widened
    from autopar.inter_op.context_parallel import sequence_length

    s = sequence_length(g)
    if not isinstance(example_inputs, (tuple, list, dict)) or s is None or tokens_of(example_inputs) != s or s % 4:
        return None
    half = widened(example_inputs, s, s // 2)
    probe: Any = contextlib.nullcontext()
    if g.capture_method == STITCHED:
        # the graph was stitched from a cut model, so the cut model runs as the whole does:
        # its positions are the whole's, found in a fraction of the time (a 48-block nanoGPT:
        # 82 of its 103 s of planning were these two exports of the whole model)
        from autopar.capture.repeated import cut_to, find_stack

        stack, _ = find_stack(model, find_layers(model)[0])
        if stack is not None:
            probe = cut_to(stack, 2)
    try:
        with probe:
            # at one fixed batch, both: an arange of the batch's length is the same in the two
            # programs, so it cannot pass for positions (what `find` compares is the sequence's
            # S / 2 against S), and an export at a fixed batch costs a third to a half of one
            # with a symbolic batch (nanoGPT's two: 1.10 -> 0.44 CPU s of its 1.9 s capture)
            local, _, _ = export_program(model, half, loss_fn=loss_fn, symbolic_batch=False)
            whole, _, _ = export_program(model, example_inputs, loss_fn=loss_fn, symbolic_batch=False)
    except Exception as e:  # noqa: BLE001 - the capture succeeded another way: say why cp cannot
        return f"the model's program could not be traced at {s // 2} tokens to find its positions ({type(e).__name__})"
    try:
        found = find(local.graph_module, whole.graph_module, s // 2, s,
                     {n: i for i, n in enumerate(local.graph_signature.user_inputs)})
    except PlanError as e:
        return str(e).removesuffix(": re-plan with cp=1")
    return "" if found.positions else "it has no arange that follows the sequence length (no positions found)"


def _capture(model: nn.Module, example_inputs: Sequence[Any], *, loss_fn: Optional[LossFn],
             name: Optional[str], batch_dim: bool, repeated: bool) -> OpGraph:
    """`capture` without the cache."""
    t0 = time.perf_counter()
    # torch.compile's wrapper: capture the module it wraps (same FQNs as the user's model)
    model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
    names = None
    if isinstance(example_inputs, dict):     # keyword inputs, e.g. a tokenizer's output + labels
        names = [str(k) for k in example_inputs]
        example_inputs = tuple(example_inputs.values())
    elif isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    name = name or type(model).__name__
    _prepare_hf(model)
    wrapped = _WithLoss(model, loss_fn or default_loss, names)
    not_stitched = ""
    if batch_dim and repeated:
        g, not_stitched = _capture_stitched(model, wrapped, example_inputs, name)
        if g is not None:
            g.capture_time_s = time.perf_counter() - t0
            return g
    errors: list[tuple[str, Exception, tuple[str, str]]] = []
    attempts: list[tuple[str, Callable[[], OpGraph]]] = []
    if batch_dim:
        attempts.append(("torch.export (symbolic batch)", lambda: _export_dynamic(wrapped, example_inputs, name)))
        attempts.append(("torch.export (two batch sizes)",
                         lambda: _two_batches(lambda ins: _from_export(wrapped, ins, name, None), example_inputs)))
    else:
        attempts.append(("torch.export", lambda: _from_export(wrapped, example_inputs, name, None)))
    for label, fn in attempts:
        tracker = _ModuleTracker(model)
        try:
            with tracker, _QuietTorch():
                g = fn()
            g.capture_method = label + (f"; blocks not stitched: {not_stitched}" if not_stitched else "")
            g.capture_time_s = time.perf_counter() - t0
            return g
        except PlanError:
            raise
        except Exception as e:  # noqa: BLE001 - try the next method, report all at the end
            log.debug("capture with %s failed", label, exc_info=True)
            errors.append((label, e, tracker.where()))
            if _is_data_dependent(e) and label.endswith("(symbolic batch)"):
                break   # the two-batch export would fail the same way; go to torch.fx
    from autopar.capture.fx_fallback import CaptureFailure, capture_fx

    try:
        g = capture_fx(wrapped, example_inputs, name, batch_dim=batch_dim)
        log.info("captured %s with torch.fx after torch.export failed: %s", name, _explain(errors[0][1]))
        g.capture_time_s = time.perf_counter() - t0
        return g
    except PlanError:
        raise
    except CaptureFailure as e:
        errors.append(("torch.fx.symbolic_trace", e, (e.module, e.module_type)))
    except Exception as e:  # noqa: BLE001
        errors.append(("torch.fx.symbolic_trace", e, ("", "")))
    raise PlanError(_failure_message(name, errors)) from None


STITCHED = "torch.export (symbolic batch, repeated blocks stitched)"


def _capture_stitched(model: nn.Module, wrapped: nn.Module, inputs: tuple, name: str
                      ) -> tuple[Optional[OpGraph], str]:
    """The graph of a model whose repeated blocks are one stack of identical modules, from an
    export of its first 3 blocks (and of its first 2 where that one does not show enough:
    `capture.repeated`); else (None, why it was not stitched: "" when the model has no such
    stack)."""
    from autopar.capture.repeated import find_stack, stitched

    stack, _ = find_stack(model, find_layers(model)[0])
    if stack is None:
        return None, ""
    used: list[tuple] = []

    def export_raw() -> tuple:
        ep, ins = _export_symbolic(wrapped, inputs)
        used.append(ins)
        return export_nodes(wrapped, ins, ep), [n.name for n in ep.graph.nodes]

    try:
        with _QuietTorch():
            raw, why = stitched(stack, export_raw)
    except Exception as e:  # noqa: BLE001 - the whole export runs next; the graph records why
        log.debug("stitched capture of %s failed", name, exc_info=True)
        return None, f"the cut model did not export ({_explain(e)})"
    if raw is None:
        return None, why
    g = _finish(model, *raw, name, used[-1], method=STITCHED)
    return g, ""


def _failure_message(name: str, errors: list[tuple[str, Exception, tuple[str, str]]]) -> str:
    """One message naming, for the export and the fx attempt, the module and the op that failed."""
    parts = []
    for label, e, (mod, mtype) in (errors[0], errors[-1]) if len(errors) > 1 else errors:
        from autopar.capture.fx_fallback import CaptureFailure, user_frame

        op = e.op if isinstance(e, CaptureFailure) and e.op else user_frame(e.__traceback__)
        where = f"in module `{mod}` ({mtype})" if mod else ("in the model's top-level forward"
                                                          if mtype or op else "")
        parts.append(f"{label} failed {where}{' at ' + op if op else ''}: {_explain(e)}".replace("  ", " "))
    hint = ("the forward has data-dependent control flow or shapes (a Python `if`/loop on tensor "
            "values, .item(), nonzero); express it with tensor ops (torch.where, masking) so that "
            "the graph depends on shapes only")
    return f"cannot capture {name}: " + "; ".join(parts) + f". Hint: {hint}"


def _is_data_dependent(e: Exception) -> bool:
    s = f"{type(e).__name__} {e}"
    return any(k in s for k in ("DataDependent", "data-dependent", "GuardOnDataDependent"))


class _ModuleTracker:
    """Global forward hooks that remember the stack of modules running when a capture attempt
    fails (post-hooks do not run on an exception, so the stack is left as it was)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): (n, type(m).__name__) for n, m in model.named_modules()}
        self.stack: list[tuple[str, str]] = []
        self.handles: list[Any] = []

    def __enter__(self) -> "_ModuleTracker":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(m: nn.Module, args: Any) -> None:
            if id(m) in self.names:
                self.stack.append(self.names[id(m)])

        def post(m: nn.Module, args: Any, out: Any) -> None:
            if id(m) in self.names and self.stack:
                self.stack.pop()

        self.handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def where(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else ("", "")


def _prepare_hf(model: nn.Module) -> None:
    """Hugging Face models: no KV cache, and an export-friendly MoE experts implementation."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return
    if getattr(cfg, "use_cache", False):
        cfg.use_cache = False
    try:
        from autopar.models.hf import prepare_for_capture

        prepare_for_capture(model)
    except ImportError:
        pass


def _explain(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    first = next((l for l in msg if l.strip()), "")
    if type(e).__name__ == "CaptureFailure":
        return first[:240]
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


class _QuietTorch:
    """Silence torch's shape-guard warnings and the partial graph torch.export prints to stderr on
    failure, during a capture attempt (the failure is reported in the PlanError instead)."""

    NAMES = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
             "torch._dynamo", "torch.fx.experimental.recording")

    def __enter__(self) -> None:
        self.levels = [(logging.getLogger(n), logging.getLogger(n).level) for n in self.NAMES]
        for lg, _ in self.levels:
            lg.setLevel(logging.ERROR)
        self.stderr = contextlib.redirect_stderr(io.StringIO())
        self.stderr.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.stderr.__exit__(*exc)
        for lg, lvl in self.levels:
            lg.setLevel(lvl)


def _with_batch(x: Any, b: int) -> Any:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    if x.device.type == "meta":
        return torch.empty((b,) + tuple(x.shape[1:]), dtype=x.dtype, device="meta")
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(x, FakeTensor):   # a fake input of another device (`execute.meta_program`): no kernel runs
        return FakeTensor(x.fake_mode, torch.empty((b,) + tuple(x.shape[1:]), dtype=x.dtype, device="meta"), x.device)
    reps = [b // x.shape[0] + 1] + [1] * (x.dim() - 1) if x.shape[0] else None
    return x.repeat(*reps)[:b].contiguous() if reps else x.new_zeros((b,) + tuple(x.shape[1:]))


def _export_dynamic(wrapped: nn.Module, inputs: tuple, name: str) -> OpGraph:
    ep, inputs = _export_symbolic(wrapped, inputs)
    return _from_export(wrapped, inputs, name, ep)


def _export_symbolic(wrapped: nn.Module, inputs: tuple) -> tuple[Any, tuple]:
    """torch.export of `wrapped` with a symbolic batch (dim 0 of every tensor input); returns
    the program and the inputs it was traced with."""
    from torch.export import Dim

    b0 = max(2, _batch_of(inputs))
    inputs = tuple(_with_batch(x, b0) for x in inputs)
    batch = Dim("batch", min=1, max=1 << 20)
    dyn = tuple({0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in inputs)
    return _export(wrapped, inputs, dynamic_shapes=(dyn,)), inputs


def _export(wrapped: nn.Module, inputs: tuple, **kwargs: Any) -> Any:
    """torch.export (non-strict) of `wrapped` at `inputs`, warnings silenced, a Hugging Face
    model's attention masks built as in eager mode (`models.hf.eager_attention_masks`)."""
    from torch.export import export

    from autopar.capture.functions import marking_functions
    from autopar.models.hf import eager_attention_masks

    # custom autograd Functions' ops are marked as theirs (`capture.functions`)
    with warnings.catch_warnings(), eager_attention_masks(), marking_functions(), _no_stack_traces():
        warnings.simplefilter("ignore")
        return export(wrapped, inputs, strict=False, **kwargs)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """torch.export without the Python stack trace it records on every node (`node.stack_trace`,
    `torch.fx.config.do_not_emit_stack_traces`): nothing in autopar reads it, and extracting it
    was 15-17% of an export's CPU (gpt3-13b's program 4.3 -> 3.6 CPU s; in `autopar verify` of
    GPT-3 175B, the traceback extraction was 4% of a kind's profile)."""
    import torch.fx.config as fx_config

    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def export_program(model: nn.Module, example_inputs: Sequence[Any], *,
                   loss_fn: Optional[LossFn] = None,
                   symbolic_batch: bool = True) -> tuple[Any, nn.Module, Optional[list[str]]]:
    """The torch.export program `capture` reads its OpGraph from (the model and its loss, batch
    symbolic; a fixed batch when the model refuses a symbolic one), so that its nodes carry the
    names a ShardingSolution uses. Returns (ExportedProgram, the wrapped module whose parameters
    it lifts, the keyword names of dict inputs or None). For executing a plan op by op
    (`autopar.intra_op.execute`); raises when torch.export cannot capture the model.
    `symbolic_batch=False`: exported at the batch the symbolic export would trace at (the
    example's, at least 2), fixed: a program only ever compared with another of the same
    batch (`_own_positions`), never run at another."""
    model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
    names = None
    if isinstance(example_inputs, dict):
        names = [str(k) for k in example_inputs]
        example_inputs = tuple(example_inputs.values())
    elif isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    _prepare_hf(model)
    wrapped = _WithLoss(model, loss_fn or default_loss, names)
    with _QuietTorch():
        if not symbolic_batch:
            b0 = max(2, _batch_of(tuple(example_inputs)))
            try:
                return _export(wrapped, tuple(_with_batch(x, b0) for x in example_inputs)), wrapped, names
            except Exception:  # noqa: BLE001 - at the example's own batch, as below
                return _export(wrapped, tuple(example_inputs)), wrapped, names
        try:
            ep, _ = _export_symbolic(wrapped, tuple(example_inputs))
        except Exception:  # noqa: BLE001 - as capture does: then at a fixed batch
            ep = _export(wrapped, tuple(example_inputs))
    return ep, wrapped, names


def _two_batches(capture_at: Callable[[tuple], OpGraph], inputs: tuple) -> OpGraph:
    """Capture at batch sizes b0 and 2*b0 and read the dims that change off as linear in b."""
    b0 = max(2, _batch_of(inputs))
    g0 = capture_at(tuple(_with_batch(x, b0) for x in inputs))
    g1 = capture_at(tuple(_with_batch(x, 2 * b0) for x in inputs))
    if [n.target for n in g0.nodes] != [n.target for n in g1.nodes]:
        raise RuntimeError("the graph's structure depends on the batch size")

    def sym(d0: Any, d1: Any) -> Any:
        if isinstance(d0, int) and isinstance(d1, int) and not isinstance(d0, bool) and d0 != d1:
            slope, rest = divmod(d1 - d0, b0)
            if rest:
                raise RuntimeError("a dimension is not linear in the batch size")
            const = d0 - slope * b0
            import sympy

            return SymDim(str(sympy.expand(slope * sympy.Symbol("b") + const)))   # "b", "2048*b", ...
        if isinstance(d0, (list, tuple)) and isinstance(d1, (list, tuple)) and len(d0) == len(d1):
            return type(d0)(sym(a, c) for a, c in zip(d0, d1))
        if isinstance(d0, dict) and isinstance(d1, dict) and d0.keys() == d1.keys():
            return {k: sym(d0[k], d1[k]) for k in d0}
        return d0

    for n0, n1 in zip(g0.nodes, g1.nodes):
        n0.outputs = [TensorMeta(tuple(sym(a, c) for a, c in zip(o0.shape, o1.shape)), o0.dtype)
                      for o0, o1 in zip(n0.outputs, n1.outputs)]
        n0.args = sym(n0.args, n1.args)
        n0.kwargs = sym(n0.kwargs, n1.kwargs)
    g0.batch_size = None
    return g0


def _batch_of(inputs: tuple) -> int:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise PlanError("no example input is a tensor with a batch dimension (dim 0)")


def _param_groups(model: nn.Module) -> tuple[dict[str, str], dict[str, list[str]]]:
    """canonical FQN of every parameter/buffer name, and the tied names of each canonical one."""
    canon: dict[str, str] = {}
    tied: dict[str, list[str]] = {}
    by_id: dict[int, str] = {}
    for fq, p in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        first = by_id.setdefault(id(p), fq)
        canon[fq] = first
        if first != fq:
            tied.setdefault(first, []).append(fq)
    return canon, tied


def _from_export(wrapped: nn.Module, inputs: tuple, name: str, ep: Any) -> OpGraph:
    nodes, params, buffers = export_nodes(wrapped, inputs, ep)
    return _finish(wrapped.model, nodes, params, buffers, name, inputs, method="torch.export")


def export_nodes(wrapped: nn.Module, inputs: tuple, ep: Any = None
                 ) -> tuple[list[OpNode], dict[str, ParamInfo], dict[str, ParamInfo]]:
    """The OpGraph's nodes, parameters and buffers of `wrapped`'s exported program `ep`
    (exported here at the inputs' fixed shapes when None), before layers and costs (`_finish`)."""
    from torch.export.graph_signature import InputKind

    from autopar.capture.functions import function_calls, mark_of

    if ep is None:
        ep = _export(wrapped, inputs)
    model = wrapped.model
    canon, tied = _param_groups(model)
    strip = lambda s: s[len("model."):] if s.startswith("model.") else ("" if s == "model" else s)  # noqa: E731
    spec_of = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    sym_names: dict[str, str] = {}   # fx symbol -> "b"

    def dim(d: Any) -> Any:
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            if not expr.free_symbols:
                return int(expr)
            import sympy

            subs = {}
            for s in expr.free_symbols:
                sym_names.setdefault(str(s), "b")
                subs[s] = sympy.Symbol("b")
            if len(set(sym_names)) > 1:
                raise RuntimeError("more than one symbolic dimension")
            return SymDim(str(sympy.expand(expr.subs(subs))))
        return d

    def meta_of(v: Any) -> list[TensorMeta]:
        if isinstance(v, torch.Tensor):
            return [TensorMeta(tuple(dim(d) for d in v.shape), _dtype(v.dtype))]
        if isinstance(v, (list, tuple)):
            return [m for x in v for m in meta_of(x)]
        return []

    subst: dict[torch.fx.Node, Any] = {}   # node -> the value standing for it (SymDims, inlined refs)
    names: dict[torch.fx.Node, str] = {}   # node -> OpNode name (nodes of inlined subgraphs)

    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a in subst:
                return subst[a]
            return Ref(names.get(a, a.name))
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, dict):
            return {k: conv(v) for k, v in a.items()}
        if isinstance(a, torch.dtype):
            return _dtype(a)
        if isinstance(a, (torch.device, torch.layout, torch.memory_format)):
            return str(a)
        return dim(a)

    nodes: list[OpNode] = []
    params: dict[str, ParamInfo] = {}
    buffers: dict[str, ParamInfo] = {}
    placeholder_param: dict[str, str] = {}
    # custom autograd Functions' calls: the tensors each saves, given to its first op emitted
    fn_calls = function_calls(ep.graph_module)
    getitem = __import__("operator").getitem

    def emit_calls(graph_nodes: Any, owner: nn.Module, prefix: str) -> Any:
        """Emit the call nodes of a graph; returns what its output node returns (converted).
        Higher-order ops that wrap a subgraph (torch.no_grad / autocast regions, e.g. a rotary
        embedding under @torch.no_grad) are inlined, so their ops are costed like any other."""
        for n in graph_nodes:
            if n.op == "output":
                return conv(n.args[0] if len(n.args) == 1 else n.args)
            if n.op != "call_function":
                continue
            val = n.meta.get("val")
            if isinstance(val, torch.SymInt) or (val is None and "sym_size" in str(n.target)):
                subst[n] = dim(val) if val is not None else None
                continue
            if "_assert" in str(n.target):     # shape/metadata assertions: no work, no users
                continue
            if n.target is getitem and n.args[0] in subst and isinstance(subst[n.args[0]], (tuple, list)):
                subst[n] = subst[n.args[0]][n.args[1]]
                continue
            sub_i = next((i for i, a in enumerate(n.args) if isinstance(a, torch.fx.Node)
                          and a.op == "get_attr" and isinstance(getattr(owner, str(a.target), None),
                                                                torch.fx.GraphModule)), None)
            if sub_i is not None and "wrap" in str(n.target):
                sub = getattr(owner, str(n.args[sub_i].target))
                operands = n.args[sub_i + 1:]
                phs = [x for x in sub.graph.nodes if x.op == "placeholder"]
                for ph, a in zip(phs, operands):
                    subst[ph] = conv(a)
                for x in sub.graph.nodes:
                    if x.op == "call_function":
                        names[x] = f"{prefix}{n.name}__{x.name}"
                subst[n] = emit_calls(sub.graph.nodes, sub, f"{prefix}{n.name}__")
                continue
            args, kwargs = conv(n.args), conv(n.kwargs)
            ins = flatten_refs(args) + flatten_refs(kwargs)
            stack = list((n.meta.get("nn_module_stack") or {}).values())
            paths = [strip(p[0] if isinstance(p, tuple) else str(p)) for p in stack]
            paths = [p for p in paths if p and not p.startswith("_empty")]
            mod_path = paths[-1] if paths else ""
            mtype = (stack[-1][1] if stack and isinstance(stack[-1], tuple) else "")
            mtype = str(mtype).rsplit(".", 1)[-1]
            target = "getitem" if n.target is getitem else str(n.target)
            mark = mark_of(n)
            saves, work = fn_calls.pop(mark.key, ([], 0.0)) if mark is not None else ([], 0.0)
            nodes.append(OpNode(
                names.get(n, n.name), "call", target, args=args, kwargs=kwargs, inputs=ins,
                outputs=meta_of(val), params=[placeholder_param[i] for i in ins if i in placeholder_param],
                module_path=mod_path, module_type=mtype, function=mark.key if mark is not None else None,
                function_saves=[names.get(x, x.name) for x in saves], function_work=work))
        return None

    graph_nodes = list(ep.graph_module.graph.nodes)
    for n in graph_nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        spec = spec_of.get(n.name)
        kind = spec.kind if spec is not None else InputKind.USER_INPUT
        outs = meta_of(val)
        if kind in (InputKind.PARAMETER, InputKind.BUFFER):
            fq = canon.get(strip(spec.target), strip(spec.target))
            info = ParamInfo(fq, tuple(int(d) for d in val.shape), _dtype(val.dtype),
                             tied=tied.get(fq, []), requires_grad=kind == InputKind.PARAMETER)
            (params if kind == InputKind.PARAMETER else buffers)[fq] = info
            if kind == InputKind.PARAMETER:        # OpNode.params lists parameters, not buffers
                placeholder_param[n.name] = fq
            nodes.append(OpNode(n.name, "param" if kind == InputKind.PARAMETER else "buffer",
                                "placeholder", outputs=outs, fqn=fq))
        elif kind == InputKind.USER_INPUT:
            nodes.append(OpNode(n.name, "input", "placeholder", outputs=outs, fqn=n.name))
        else:
            nodes.append(OpNode(n.name, "constant", "placeholder", outputs=outs,
                                fqn=strip(getattr(spec, "target", n.name) or n.name)))
    out = emit_calls(graph_nodes, ep.graph_module, "")
    nodes.append(OpNode("output", "output", "output", args=(), inputs=flatten_refs(out)))
    return nodes, params, buffers


def _finish(model: nn.Module, nodes: list[OpNode], params: dict[str, ParamInfo],
            buffers: dict[str, ParamInfo], name: str, inputs: tuple, method: str) -> OpGraph:
    """Assign layers (repeated blocks) and top-level module order; concrete FLOPs when no dim is
    symbolic."""
    from autopar.capture.functions import renumber

    renumber(nodes)
    layers, layer_types = find_layers(model)
    top = [n for n, _ in model.named_children()]
    for x in nodes:
        if x.kind == "call" and x.module_path:
            p = x.module_path
            x.layer = next((l for l in layers if p == l or p.startswith(l + ".")), None)
    seen: list[str] = []
    for x in nodes:
        if x.layer and x.layer not in seen:
            seen.append(x.layer)
    first_use: dict[str, int] = {}
    for i, x in enumerate(nodes):
        for t in top:
            if t not in first_use and (x.module_path == t or x.module_path.startswith(t + ".")):
                first_use[t] = i
    order = sorted((t for t in top if t in first_use), key=lambda t: first_use[t])
    g = OpGraph(name=name, nodes=nodes, params=params, buffers=buffers, layers=seen,
                layer_types={l: layer_types[l] for l in seen}, top_modules=order,
                capture_method=method)
    # concrete FLOPs for graphs without symbolic dims; symbolic ones get them from at_batch
    if not g.is_symbolic:
        g = g.at_batch(_batch_of(inputs))
    return g


def move_not_cast(n: torch.fx.Node) -> None:
    """`x.to(other.device)` is traced as `to.dtype_layout` with x's dtype as traced (a model
    traced in fp32): make it a move, not a cast, so that under autocast or 2-byte weights it
    keeps whatever dtype x has when run."""
    if n.op == "call_function" and n.target is torch.ops.aten.to.dtype_layout and "device" in n.kwargs and n.args:
        val = getattr(n.args[0], "meta", {}).get("val")
        if val is not None and n.kwargs.get("dtype") == val.dtype:
            n.kwargs = {**n.kwargs, "dtype": None}
