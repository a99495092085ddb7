"""Fallback capture with `torch.fx.symbolic_trace` when `torch.export` fails.

The model is traced symbolically (torch.nn modules stay leaves), its nodes are run on fake tensors
to read every shape, and each node is mapped to the ATen-style name the rest of autopar uses
(`nn.Linear` -> "aten.linear.default" with (input, weight, bias) arguments, `torch.matmul` ->
"aten.matmul.default", `x.view(...)` -> "aten.view.default", ...). The loss function is run
eagerly on the traced output's fake value, with its torch calls recorded, so a Hugging Face
`ModelOutput.loss` or any Python loss works. The batch dimension is recovered by capturing at two
batch sizes (see `export._two_batches`).
"""

from __future__ import annotations

import operator
import re
import traceback
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from autopar.capture.graph import OpGraph, OpNode, ParamInfo, Ref, TensorMeta, flatten_refs

_OPERATORS = {
    operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
    operator.floordiv: "floor_divide", operator.neg: "neg", operator.matmul: "matmul",
    operator.pow: "pow", operator.getitem: "getitem", operator.eq: "eq", operator.ne: "ne",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
    operator.and_: "bitwise_and", operator.or_: "bitwise_or", operator.invert: "bitwise_not",
    operator.mod: "remainder",
}

# torch-level names whose ATen op is named differently
_ALIASES = {
    "cross_entropy": "cross_entropy_loss", "float": "_to_copy", "half": "_to_copy",
    "bfloat16": "_to_copy", "double": "_to_copy", "long": "_to_copy", "int": "_to_copy",
    "bool": "_to_copy", "type_as": "_to_copy", "to": "_to_copy", "cuda": "_to_copy", "cpu": "_to_copy",
    "truediv": "div", "floordiv": "floor_divide", "__add__": "add", "__radd__": "add",
    "__iadd__": "add", "__sub__": "sub", "__rsub__": "rsub", "__mul__": "mul", "__rmul__": "mul",
    "__imul__": "mul", "__truediv__": "div", "__rtruediv__": "div", "__matmul__": "matmul",
    "__neg__": "neg", "__pow__": "pow", "__getitem__": "getitem", "add_": "add", "mul_": "mul",
    "sub_": "sub", "div_": "div", "masked_fill_": "masked_fill", "copy_": "copy_", "softmax": "softmax",
}

_OVERLOAD_ORDER = ("Tensor", "default", "int", "using_ints", "dim_IntList", "self", "Tensor_Scalar")


def aten_name(name: str) -> str:
    """"matmul" -> "aten.matmul.default", "add" -> "aten.add.Tensor"; unknown names pass through."""
    name = _ALIASES.get(name, name)
    if name == "getitem":
        return "getitem"
    base = name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return name
    try:
        overloads = packet.overloads()
    except Exception:  # noqa: BLE001
        return f"aten.{base}.default"
    for o in _OVERLOAD_ORDER:
        if o in overloads:
            return f"aten.{base}.{o}"
    rest = [o for o in overloads if "out" not in o]
    return f"aten.{base}.{(rest or overloads or ['default'])[0]}"


class CaptureFailure(RuntimeError):
    """A capture attempt failed inside `module` (FQN, "" for the root) at `op` (a source line)."""

    def __init__(self, message: str, module: str = "", module_type: str = "", op: str = "") -> None:
        super().__init__(message)
        self.module, self.module_type, self.op = module, module_type, op


def user_frame(tb: Any) -> str:
    """`file:line: code` of the innermost traceback frame outside torch and autopar.capture: the
    model's line that failed."""
    frames = traceback.extract_tb(tb)
    skip = ("/torch/", "/autopar/capture/", "/transformers/utils/", "/contextlib.py", "/sympy/",
            "<frozen", "/functools.py",
            "/transformers/configuration_utils.py", "/transformers/utils/generic.py")
    for fr in reversed(frames):
        if not any(s in fr.filename for s in skip):
            return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}: `{(fr.line or '').strip()}`"
    return ""


class _Tracer(fx.Tracer):
    """Records the module path (and class) under which each node is created."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, str]] = [("", "")]

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        self.stack.append((self.path_of_module(m), type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()     # not on an exception: the stack then says where tracing failed
        return out

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        n = super().create_node(*args, **kwargs)
        n.meta["module_path"], n.meta["module_type"] = self.stack[-1]
        return n


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _meta_of(v: Any) -> list[TensorMeta]:
    if isinstance(v, torch.Tensor):
        return [TensorMeta(tuple(int(d) for d in v.shape), _dtype(v.dtype))]
    if isinstance(v, (list, tuple)):
        return [m for x in v for m in _meta_of(x)]
    if hasattr(v, "to_tuple"):       # a Hugging Face ModelOutput
        return _meta_of(v.to_tuple())
    return []


def _has_tensor(v: Any) -> bool:
    return bool(_meta_of(v))


def _plain(v: Any) -> Any:
    """A non-tensor value as something an OpNode argument may hold."""
    if isinstance(v, torch.Size):
        return tuple(int(d) for d in v)
    if isinstance(v, torch.dtype):
        return _dtype(v)
    if isinstance(v, (torch.device, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_plain(v.start), _plain(v.stop), _plain(v.step))
    if isinstance(v, (int, float, bool, str, type(None))):
        return v
    return repr(v)


def _leaf_call(m: nn.Module, x: list, p: Callable[[str], Any]) -> tuple[str, tuple, dict]:
    """(ATen target, args, kwargs) for a leaf torch.nn module called on `x` (converted args);
    `p(name)` is the Ref of the module's parameter `name` (None when it has none)."""
    if isinstance(m, nn.Linear):
        return "aten.linear.default", (x[0], p("weight"), p("bias")), {}
    if isinstance(m, nn.Embedding):
        return "aten.embedding.default", (p("weight"), x[0]), {}
    if isinstance(m, nn.LayerNorm):
        return ("aten.layer_norm.default",
                (x[0], list(m.normalized_shape), p("weight"), p("bias"), m.eps), {})
    if hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm):
        return "aten.rms_norm.default", (x[0], list(m.normalized_shape), p("weight"), m.eps), {}
    if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return ("aten.convolution.default",
                (x[0], p("weight"), p("bias"), list(m.stride), _plain(m.padding), list(m.dilation),
                 False, [0] * len(m.stride), m.groups), {})
    if isinstance(m, nn.Dropout):
        return "aten.dropout.default", (x[0], m.p, m.training), {}
    if isinstance(m, nn.Softmax):
        return "aten.softmax.int", (x[0], m.dim), {}
    if isinstance(m, nn.LogSoftmax):
        return "aten.log_softmax.int", (x[0], m.dim), {}
    if isinstance(m, nn.Identity):
        return "aten.alias.default", (x[0],), {}
    if isinstance(m, nn.GELU):
        return "aten.gelu.default", (x[0],), {"approximate": m.approximate}
    simple = {nn.ReLU: "relu", nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
              nn.Flatten: "flatten"}
    for cls, op in simple.items():
        if isinstance(m, cls):
            return aten_name(op), tuple(x), {}
    params = tuple(p(n) for n, _ in m.named_parameters(recurse=True))
    return f"nn.{type(m).__name__}", tuple(x) + params, {}


class _Recorder(TorchFunctionMode):
    """Records the torch calls made by a loss function on fake tensors."""

    def __init__(self, name_of: dict[int, str], emit: Callable[[str, Any, tuple, dict], None]) -> None:
        super().__init__()
        self.name_of, self.emit = name_of, emit

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _has_tensor(out):
            fname = getattr(func, "__name__", str(func))
            self.emit(fname, out, args, kwargs)
        return out


def capture_fx(wrapped: nn.Module, example_inputs: tuple, name: str, *, batch_dim: bool = True
               ) -> OpGraph:
    """Capture `wrapped` (the model with its loss, as built by `capture`) with torch.fx.

    With `batch_dim`, captures at two batch sizes and keeps dims linear in the batch symbolic.
    Raises CaptureFailure (module path, op) when the model cannot be traced."""
    from autopar.capture.export import _two_batches

    if not batch_dim:
        g = _fx_once(wrapped, tuple(example_inputs), name)
        g.capture_method = "torch.fx.symbolic_trace"
        return g
    g = _two_batches(lambda ins: _fx_once(wrapped, ins, name), tuple(example_inputs))
    g.capture_method = "torch.fx.symbolic_trace (two batch sizes)"
    return g


def _fx_once(wrapped: nn.Module, inputs: tuple, name: str) -> OpGraph:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.capture.export import _finish, _param_groups

    model = wrapped.model
    loss_fn = wrapped.loss_fn
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001
        path, mtype = tracer.stack[-1]
        raise CaptureFailure(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                             path, mtype, user_frame(e.__traceback__)) from e
    gm = fx.GraphModule(model, graph)
    canon, tied = _param_groups(model)
    mods = dict(model.named_modules())
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))

    # -- run the traced graph on fake tensors to read every shape ---------------------------------
    dev = next((p.device for p in model.parameters()), torch.device("meta"))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    vals: dict[str, Any] = {}
    with fake:
        fins = [torch.empty(tuple(x.shape), dtype=x.dtype, device=dev) if isinstance(x, torch.Tensor) else x
                for x in inputs]
        if getattr(wrapped, "names", None):     # keyword inputs: place them by placeholder name
            given = dict(zip(wrapped.names, fins))
            fins = [given.get(n.target, n.args[0] if n.args else None)
                    for n in graph.nodes if n.op == "placeholder"]

        class _Interp(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                try:
                    v = super().run_node(n)
                except Exception as e:  # noqa: BLE001
                    raise CaptureFailure(f"{type(e).__name__} while propagating shapes: "
                                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                                         n.meta.get("module_path", ""), n.meta.get("module_type", ""),
                                         f"{n.op} {n.target}") from e
                vals[n.name] = v
                return v

        out = _Interp(gm).run(*fins)

    # -- convert nodes ----------------------------------------------------------------------------
    taken = {n.name for n in graph.nodes}
    nodes: list[OpNode] = []
    params: dict[str, ParamInfo] = {}
    buffers: dict[str, ParamInfo] = {}
    pnode: dict[str, str] = {}            # canonical FQN -> OpNode name
    alias: dict[str, str] = {}            # fx node name -> OpNode name (get_attr of a parameter)
    consts: dict[str, Any] = {}           # fx node name -> non-tensor value

    def add_param(fq: str) -> str:
        c = canon.get(fq, fq)
        if c in pnode:
            return pnode[c]
        t = named_params.get(c)
        is_param = t is not None
        if t is None:
            t = named_buffers[c]
        nm = "p_" + re.sub(r"\W", "_", c)
        while nm in taken:
            nm += "_"
        taken.add(nm)
        info = ParamInfo(c, tuple(int(d) for d in t.shape), _dtype(t.dtype), tied=tied.get(c, []),
                         requires_grad=is_param and t.requires_grad)
        (params if is_param else buffers)[c] = info
        nodes.append(OpNode(nm, "param" if is_param else "buffer", "placeholder",
                            outputs=[TensorMeta(info.shape, info.dtype)], fqn=c))
        pnode[c] = nm
        return nm

    for fq in list(named_params) + list(named_buffers):
        add_param(fq)

    def conv(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a.name in alias:
                return Ref(alias[a.name])
            if a.name in consts:
                return consts[a.name]
            return Ref(a.name)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, dict):
            return {k: conv(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(conv(a.start), conv(a.stop), conv(a.step))
        return _plain(a)

    out_node: Optional[fx.Node] = None
    for n in graph.nodes:
        v = vals.get(n.name)
        mpath, mtype = n.meta.get("module_path", ""), n.meta.get("module_type", "")
        if n.op == "placeholder":
            if isinstance(v, torch.Tensor):
                nodes.append(OpNode(n.name, "input", "placeholder", outputs=_meta_of(v), fqn=n.name))
            else:
                consts[n.name] = _plain(v)
            continue
        if n.op == "get_attr":
            if canon.get(n.target, n.target) in pnode:
                alias[n.name] = pnode[canon.get(n.target, n.target)]
            elif isinstance(v, torch.Tensor):
                nodes.append(OpNode(n.name, "constant", "placeholder", outputs=_meta_of(v), fqn=n.target))
            else:
                consts[n.name] = _plain(v)
            continue
        if n.op == "output":
            out_node = n
            continue
        if not _has_tensor(v):
            consts[n.name] = _plain(v)
            continue
        if n.op == "call_module":
            m = mods[n.target]
            prefix = n.target + "."

            def p(pn: str, prefix: str = prefix, m: nn.Module = m) -> Any:
                return Ref(pnode[canon.get(prefix + pn, prefix + pn)]) if getattr(m, pn, None) is not None else None

            target, args, kwargs = _leaf_call(m, list(conv(n.args)), p)
            kwargs = {**kwargs, **{k: conv(x) for k, x in n.kwargs.items()}}
            mpath, mtype = n.target, type(m).__name__
        elif n.op == "call_function":
            fname = _OPERATORS.get(n.target) or getattr(n.target, "__name__", str(n.target))
            target, args, kwargs = aten_name(fname), conv(n.args), conv(n.kwargs)
        else:   # call_method
            target, args, kwargs = aten_name(str(n.target)), conv(n.args), conv(n.kwargs)
        ins = flatten_refs(args) + flatten_refs(kwargs)
        nodes.append(OpNode(n.name, "call", target, args=args, kwargs=kwargs, inputs=ins,
                            outputs=_meta_of(v), params=[q for q in _params_of(ins, pnode) if q in params],
                            module_path=mpath, module_type=mtype))

    # -- the loss: run loss_fn on the fake output, recording its torch calls -------------------------
    assert out_node is not None
    out_refs = flatten_refs(conv(out_node.args))
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        final = out_refs
    else:
        name_of: dict[int, str] = {}
        flat_vals = _flat_tensors(out)
        for t, r in zip(flat_vals, out_refs):
            name_of[id(t)] = r
        counter = [0]

        def emit(fname: str, res: Any, args: tuple, kwargs: dict) -> None:
            def c(a: Any) -> Any:
                if isinstance(a, torch.Tensor):
                    return Ref(name_of[id(a)]) if id(a) in name_of else TensorMeta(
                        tuple(int(d) for d in a.shape), _dtype(a.dtype))
                if isinstance(a, (list, tuple)):
                    return type(a)(c(x) for x in a)
                if isinstance(a, dict):
                    return {k: c(x) for k, x in a.items()}
                return _plain(a)

            nm = f"loss_{counter[0]}"
            counter[0] += 1
            while nm in taken:
                nm += "_"
            taken.add(nm)
            cargs, ckw = c(tuple(args)), c(kwargs)
            ins = flatten_refs(cargs) + flatten_refs(ckw)
            base = fname.removesuffix(".__get__")
            nodes.append(OpNode(nm, "call", aten_name(base), args=cargs, kwargs=ckw, inputs=ins,
                                outputs=_meta_of(res), module_path="", module_type=""))
            for t in _flat_tensors(res)[:1]:
                name_of[id(t)] = nm

        with fake, _Recorder(name_of, emit):
            loss = loss_fn(out)
        if not isinstance(loss, torch.Tensor):
            raise CaptureFailure(f"the loss function returned {type(loss).__name__}, not a tensor")
        final = [name_of[id(loss)]] if id(loss) in name_of else out_refs[:1]
    nodes.append(OpNode("output", "output", "output", inputs=final))
    return _finish(model, nodes, params, buffers, name, inputs, method="torch.fx.symbolic_trace")


def _params_of(ins: list[str], pnode: dict[str, str]) -> list[str]:
    by_node = {v: k for k, v in pnode.items()}
    return [by_node[i] for i in ins if i in by_node]


def _flat_tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if hasattr(v, "to_tuple"):
        v = v.to_tuple()
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _flat_tensors(x)]
    return []

