"""Token positions a model makes itself, found in its traced program, for context parallelism.

Under context parallelism a rank runs a program traced at its S / cp tokens of every sequence
(`runtime.context_parallel`). A model that takes its positions from
`models.positions.token_positions` records them as the `autopar::token_positions` op, which
yields the rank's positions in the whole sequence when it runs. A model written by others (a
Hugging Face causal LM wrapped by its user: `cache_position = torch.arange(seq_len)`,
`position_ids = cache_position.unsqueeze(0)`) makes its own `arange`, baked into the trace at
the rank's length: every rank's chunks would be encoded at the sequence's start.

Which `arange`s are the positions is decided by how they depend on the sequence length, not by
their length alone: the program is traced twice, at the rank's `l` tokens and at the whole
sequence's `s` (the one-process program), and its nodes matched by name (the same code traced
at two lengths names its ops alike). An `arange` of 0 .. l - 1 in the first whose namesake is
0 .. s - 1 in the second is the tokens' positions, and becomes the `autopar::token_positions`
op; everything derived from it (position ids, rotary tables, a learned position embedding's
lookup) then follows the rank's positions. An `arange` of length l in the first trace only (a
head dimension that happens to equal l) is a constant and stays. One whose length follows the
sequence otherwise (0 .. 2 l - 1, l .. 2 l - 1) is refused: it is not the tokens' positions
and no rank's chunks would compute it right. Two traces rather than one with a symbolic
sequence dim: torch.export specialises a symbolic sequence length the first time model code
branches on it (Hugging Face's mask code does), failing the export, where two static traces
of the same code always succeed where one does.

Also found: a shift of a model input along the sequence inside the model (Hugging Face's loss
pads its labels by one ignored target and drops the first: `pad(labels, (0, 1), value=-100)
[..., 1:]`), which on a rank's chunks would give each chunk's last token the ignored target
instead of the next chunk's first. The shift is taken out of the program (the slice's users
read the input as given) and the runtime shifts that input on the whole sequence before
splitting it (`ContextParallel.split_input`).

An explicit attention mask computed from the positions alone (Hugging Face's Falcon builds
one under tracing: `q_pos >= k_pos` expanded) is evaluated in the one-process trace: where it
is the causal mask (bool, or additive 0 / -inf) its attention is made `is_causal=True` without
it, which the cp attention runs; another mask, or one reading anything but positions and
constants, is refused (the cp attention runs causal or unmasked attention only).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx
import torch.nn as nn

from autopar.schema.errors import PlanError

_ARANGES = {"default": ("end",), "start": ("start", "end"), "start_step": ("start", "end", "step"),
            "start_out": ("start", "end", "step"), "out": ("end",)}
_SDPA = "scaled_dot_product_attention"
_BIG = 2 ** 62
# node meta key of a fused attention whose explicit mask is the causal one (`rewrite`)
CAUSAL_MASK = "autopar_causal_mask"
# the whole sequence's length while a program of a cp rank's tokens is traced (`whole_sequence`)
_WHOLE: ContextVar[Optional[int]] = ContextVar("autopar_whole_sequence", default=None)


@dataclass
class OwnPositions:
    """What `find` found in a program traced at a rank's tokens: its `arange`s that are the
    tokens' positions (module path, node name), its shifts of model inputs along the sequence
    (model input index -> (places, fill value)) and its attention calls whose explicit mask is
    the causal one (module path, node name)."""

    positions: list[tuple[str, str]] = field(default_factory=list)
    shifts: dict[int, tuple[int, Any]] = field(default_factory=dict)
    causal: list[tuple[str, str]] = field(default_factory=list)
    _shift_nodes: list[tuple[str, str]] = field(default_factory=list)


def _graphs(root: nn.Module) -> Iterator[tuple[str, nn.Module, torch.fx.Graph]]:
    for path, mod in root.named_modules(remove_duplicate=False):
        g = getattr(mod, "graph", None)
        if isinstance(g, torch.fx.Graph):
            yield path, mod, g


def _packet(n: torch.fx.Node) -> str:
    return getattr(getattr(n.target, "_overloadpacket", None), "__name__", "") if n.op == "call_function" else ""


def _arange(n: torch.fx.Node) -> Optional[tuple[Any, Any, Any]]:
    """(start, end, step) of an `arange` node, as traced (ints, or nodes where symbolic)."""
    if _packet(n) != "arange":
        return None
    names = _ARANGES.get(getattr(n.target, "_overloadname", ""), ("start", "end", "step"))
    a = {"start": 0, "step": 1, **dict(zip(names, n.args)), **{k: v for k, v in n.kwargs.items() if k in names}}
    return a["start"], a.get("end"), a["step"]


def _length(n: torch.fx.Node) -> Optional[int]:
    """The number of elements an `arange` node makes (None where symbolic)."""
    start, end, step = _arange(n)
    if all(isinstance(x, int) for x in (start, end, step)) and step:
        return max(0, -(-(end - start) // step))
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 1 and isinstance(val.shape[0], int):
        return int(val.shape[0])
    return None


def _val_shape(n: Any) -> Optional[tuple]:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def find(traced: nn.Module, whole: nn.Module, l: int, s: int, inputs: dict[str, int]) -> OwnPositions:
    """The token positions, input shifts and causal masks of program `traced` (a GraphModule,
    its submodules' graphs included), traced at `l` tokens a sequence, by comparison with
    `whole`, the same program traced at the whole sequence's `s` tokens (the module
    docstring). `inputs`: the root graph's placeholders that are model inputs, by name, their
    index among the model's inputs. PlanError for an `arange` that follows the sequence length
    without being the positions, an input shift other than one by k places along the sequence
    read only past its first k, or an explicit attention mask that is not the causal one of
    the positions."""
    if l == s:
        raise PlanError(f"the program is traced at {l} tokens, the whole sequence's: nothing to compare")
    others = {path: g for path, _, g in _graphs(whole)}
    found = OwnPositions()
    for path, _, g in _graphs(traced):
        other = {n.name: n for n in others.get(path, torch.fx.Graph()).nodes}
        for n in g.nodes:
            if _arange(n) is None:
                continue
            twin = other.get(n.name)
            if twin is None or _arange(twin) is None:
                raise PlanError(f"the model's program traced at {l} and at {s} tokens differs ({n.name} in "
                                f"{path or 'the model'} has no namesake at {s}), so its token positions cannot "
                                f"be told from its other aranges: re-plan with cp=1")
            a, b = _length(n), _length(twin)
            if a == b:
                continue            # a constant (of length l or not), or symbolic alike in both
            start, _, step = _arange(n)
            if (a, b, start, step) == (l, s, 0, 1):
                found.positions.append((path, n.name))
                continue
            raise PlanError(f"{n.name} in {path or 'the model'} is an arange whose length follows the sequence "
                            f"({a} elements at {l} tokens, {b} at {s}) but is not the tokens' positions "
                            f"0 .. {l} - 1, which context parallelism sets for a rank's chunks: re-plan with cp=1")
        _find_shifts(traced, path, g, l, inputs, found)
    _find_masks(traced, whole, found, s)
    return found


def _find_shifts(root: nn.Module, path: str, g: torch.fx.Graph, l: int, inputs: dict[str, int],
                 found: OwnPositions) -> None:
    """Shifts of a model input along its last dim (the sequence) by k places: `pad(x, [0, k])`
    read only through slices from k on (`find`)."""
    for n in g.nodes:
        if _packet(n) not in ("pad", "constant_pad_nd") or not n.args:
            continue
        x = n.args[0]
        if not isinstance(x, torch.fx.Node) or x.op != "placeholder":
            continue
        idx = _input_index(root, path, x, inputs)
        if idx is None:
            continue
        pad = list(n.args[1]) if len(n.args) > 1 else list(n.kwargs.get("pad", ()))
        mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
        value = n.args[3] if len(n.args) > 3 else n.kwargs.get("value", 0)
        if _packet(n) == "constant_pad_nd":
            mode, value = "constant", (n.args[2] if len(n.args) > 2 else n.kwargs.get("value", 0))
        shape = _val_shape(x)
        ndim = len(shape) if shape else None
        k = pad[1] if len(pad) == 2 and pad[0] == 0 and isinstance(pad[1], int) else None
        users = list(n.users)
        ok = (k is not None and k > 0 and mode == "constant" and ndim is not None and ndim >= 2
              and shape[-1] == l and users and all(_tail_slice(u, k, ndim, l) for u in users))
        if not ok:
            raise PlanError(f"{n.name} in {path or 'the model'} pads model input {idx} along the sequence other than "
                            f"as a shift by some places read past them, which a rank's chunks of it cannot "
                            f"compute: shift it in the data instead, or re-plan with cp=1")
        if idx in found.shifts and found.shifts[idx] != (k, value):
            raise PlanError(f"model input {idx} is shifted two ways inside the model: re-plan with cp=1")
        found.shifts[idx] = (k, value)
        found._shift_nodes.append((path, n.name))


def _tail_slice(u: torch.fx.Node, k: int, ndim: int, l: int) -> bool:
    """Whether `u` is `x[..., k:]` along the last of `ndim` dims (of a padded tensor of l + k)."""
    if _packet(u) != "slice" or len(u.args) < 3:
        return False
    dim, start = u.args[1], u.args[2]
    end = u.args[3] if len(u.args) > 3 else u.kwargs.get("end", _BIG)
    step = u.args[4] if len(u.args) > 4 else u.kwargs.get("step", 1)
    return dim in (ndim - 1, -1) and start == k and (end is None or isinstance(end, int) and end >= l + k) \
        and step == 1


def _caller(mods: dict[str, nn.Module], path: str) -> Optional[tuple[str, torch.fx.Node]]:
    """(the path of the nearest enclosing module whose graph calls module `path`, that call:
    its target relative to it, `h.0` where `h` is a container), None where not one call."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        parent, rel = ".".join(parts[:i]), ".".join(parts[i:])
        pg = getattr(mods.get(parent), "graph", None)
        calls = [c for c in pg.nodes if c.op == "call_module" and c.target == rel] \
            if isinstance(pg, torch.fx.Graph) else []
        if calls:
            return (parent, calls[0]) if len(calls) == 1 and not calls[0].kwargs else None
    return None


def _argument(mods: dict[str, nn.Module], path: str, x: torch.fx.Node) -> Optional[tuple[str, Any]]:
    """(caller's path, the value its call passes) for placeholder `x` of module `path`'s graph."""
    up = _caller(mods, path)
    holders = [p for p in x.graph.nodes if p.op == "placeholder"]
    if up is None or x not in holders:
        return None
    j = holders.index(x)
    return up[0], (up[1].args[j] if j < len(up[1].args) else None)


def _input_index(root: nn.Module, path: str, x: torch.fx.Node, inputs: dict[str, int]) -> Optional[int]:
    """The model input a placeholder of the graph of module `path` (of `root`) is, following the
    call_module arguments of an unflattened program up to the root; None where it is not one."""
    mods = dict(root.named_modules(remove_duplicate=False))
    while path:
        got = _argument(mods, path, x)
        if got is None or not isinstance(got[1], torch.fx.Node) or got[1].op != "placeholder":
            return None
        path, x = got
    return inputs.get(x.name)


def _find_masks(traced: nn.Module, whole: nn.Module, found: OwnPositions, s: int) -> None:
    """Attention calls with an explicit mask: causal ones recorded, others refused (`find`)."""
    positions = set(found.positions)
    for path, _, g in _graphs(traced):
        for n in g.nodes:
            if _packet(n) != _SDPA:
                continue
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            if mask is None:
                continue
            where = f"{n.name} in {path or 'the model'}"
            made = _resolve(traced, path, mask) if isinstance(mask, torch.fx.Node) else None
            if made is None or not _from_positions(made[0], made[1], positions):
                raise PlanError(f"{where} takes an explicit attention mask computed from more than the tokens' "
                                f"positions; context parallelism runs causal or unmasked attention only: "
                                f"re-plan with cp=1")
            twin = _resolve(whole, path, _namesake(whole, path, mask))
            value = _evaluate(twin[1]) if twin is not None else None
            if value is None or not _is_causal(value, s):
                raise PlanError(f"{where} takes an explicit attention mask that is not the causal one; context "
                                f"parallelism runs causal or unmasked attention only: re-plan with cp=1")
            found.causal.append((path, n.name))


def _namesake(root: nn.Module, path: str, node: torch.fx.Node) -> Optional[torch.fx.Node]:
    g = getattr(dict(root.named_modules(remove_duplicate=False)).get(path), "graph", None)
    return next((m for m in g.nodes if m.name == node.name), None) if isinstance(g, torch.fx.Graph) else None


def _resolve(root: nn.Module, path: str, node: Optional[torch.fx.Node]) -> Optional[tuple[str, torch.fx.Node]]:
    """(module path, node) that computes `node` of module `path`'s graph: a placeholder of an
    unflattened submodule followed to its caller's argument (None where not one call's)."""
    mods = dict(root.named_modules(remove_duplicate=False))
    while node is not None and node.op == "placeholder" and path:
        got = _argument(mods, path, node)
        if got is None:
            return None
        path, node = got[0], (got[1] if isinstance(got[1], torch.fx.Node) else None)
    return (path, node) if node is not None else None


def _from_positions(path: str, mask: torch.fx.Node, positions: set) -> bool:
    """Whether `mask` is computed from the positions (`positions`' aranges in module `path`)
    and constants alone: no placeholder, parameter or buffer behind it."""
    seen, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int and n.args[1:] == (0,):
            continue        # the batch size (an expand to it), not the inputs' values
        if n.op in ("placeholder", "get_attr", "call_module", "call_method"):
            return False
        if n.op == "call_function" and _arange(n) is not None and (path, n.name) not in positions \
                and not all(isinstance(x, int) for x in _arange(n)):
            return False
        todo.extend(n.all_input_nodes)
    return True


def _evaluate(node: torch.fx.Node) -> Optional[torch.Tensor]:
    """The value of `node` of the one-process trace, run on CPU from its inputs (aranges,
    constants and shape ops only: `_from_positions`), or None where it cannot be run."""
    order: list[torch.fx.Node] = []
    seen: set = set()

    def visit(n: torch.fx.Node) -> None:
        if n in seen:
            return
        seen.add(n)
        if n.target is not torch.ops.aten.sym_size.int:
            for i in n.all_input_nodes:
                visit(i)
        order.append(n)

    visit(node)
    env: dict[torch.fx.Node, Any] = {}
    cpu = torch.device("cpu")

    def fix(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return env[v]
        if isinstance(v, torch.device):
            return cpu
        if isinstance(v, (tuple, list)):
            return type(v)(fix(x) for x in v)
        return v

    for n in order:
        if n.op != "call_function":
            return None
        if n.target is torch.ops.aten._assert_tensor_metadata.default:
            env[n] = None
            continue
        if n.target is torch.ops.aten.sym_size.int:
            env[n] = 1      # the batch (`_from_positions`): the mask broadcasts over it
            continue
        try:
            env[n] = n.target(*fix(n.args), **{k: fix(v) for k, v in n.kwargs.items()})
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


def _is_causal(mask: torch.Tensor, s: int) -> bool:
    """Whether `mask` (broadcast to (..., s, s)) keeps exactly each query's keys up to itself."""
    if mask.dim() < 2 or mask.shape[-2:] != (s, s):
        return False
    keep = torch.ones(s, s, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    if not mask.is_floating_point():
        return False
    return bool(((mask == 0) == keep).all() and (mask[..., ~keep] == float("-inf")).all()) or \
        bool(((mask == 0) == keep).all() and (mask[..., ~keep] <= torch.finfo(mask.dtype).min).all())


def rewrite(traced: nn.Module, found: OwnPositions, l: int, drop_masks: bool = True) -> None:
    """`traced` (in place) as context parallelism runs it: each positions `arange` the
    `autopar::token_positions` op of `l` tokens (the rank's positions when it runs), each input
    shift's slices' users read the input itself (shifted on the whole sequence by the runtime), each
    causal-masked attention `is_causal=True` without its mask (`drop_masks=False`: the mask
    stays an argument, the node marked `CAUSAL_MASK` in its meta, for a program run op by op as
    solved, whose solution reads the mask as an input: `causal_call` there). Idempotent."""
    from autopar.models.positions import traced_op

    op = traced_op()
    want = {("pos", p, n) for p, n in found.positions} | {("shift", p, n) for p, n in found._shift_nodes} | \
        {("mask", p, n) for p, n in found.causal}
    for path, mod, g in _graphs(traced):
        changed = False
        for n in list(g.nodes):
            if ("pos", path, n.name) in want and _arange(n) is not None:
                val = n.meta.get("val")
                dtype = n.kwargs.get("dtype") or (val.dtype if isinstance(val, torch.Tensor) else torch.int64)
                n.target, n.args = op, (l,)
                n.kwargs = {"device": n.kwargs.get("device") or torch.device("cpu"), "dtype": dtype}
                changed = True
            elif ("shift", path, n.name) in want and n.op == "call_function" and n.target is not op:
                # its slices' users read the input (the pad and slices stay, unread: a plan's
                # solution names them)
                for u in list(n.users):
                    u.replace_all_uses_with(n.args[0])
                changed = True
            elif ("mask", path, n.name) in want and _packet(n) == _SDPA and not drop_masks:
                n.meta[CAUSAL_MASK] = True
            elif ("mask", path, n.name) in want and _packet(n) == _SDPA:
                n.args, n.kwargs = causal_call(n.args, n.kwargs)
                changed = True
        if changed:
            g.lint()
            if hasattr(mod, "recompile"):
                mod.recompile()


def causal_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of a fused attention call marked `CAUSAL_MASK`, as causal attention
    without its mask (`rewrite`)."""
    a = list(args)
    k = dict(kwargs)
    if len(a) > 3:
        a[3] = None
    k.pop("attn_mask", None)
    if len(a) > 5:
        a[5] = True
    else:
        k["is_causal"] = True
    return tuple(a), k


def reads_positions(root: nn.Module) -> bool:
    """Whether a program (its submodules' graphs included) holds the `autopar::token_positions` op."""
    from autopar.models.positions import traced_op

    op = traced_op()
    return any(n.op == "call_function" and n.target is op for _, _, g in _graphs(root) for n in g.nodes)


@contextlib.contextmanager
def whole_sequence(s: Optional[int]) -> Iterator[None]:
    """Within it, a program traced at a cp rank's tokens (`intra_op.execute.meta_program`)
    whose model makes its own positions is compared with its trace at the whole sequence's `s`
    tokens and rewritten (`adopt`)."""
    token = _WHOLE.set(s)
    try:
        yield
    finally:
        _WHOLE.reset(token)


def whole_length() -> Optional[int]:
    """The whole sequence's length set by `whole_sequence`, else None."""
    return _WHOLE.get()


def widened(inputs: Any, l: int, s: int) -> Any:
    """`inputs` with every tensor of `l` tokens (dim 1) made one of `s` (zeros: for tracing)."""
    if isinstance(inputs, dict):
        return {k: widened(v, l, s) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(widened(v, l, s) for v in inputs)
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[1] == l:
        return inputs.new_zeros((inputs.shape[0], s, *inputs.shape[2:]))
    return inputs


def tokens_of(inputs: Any) -> Optional[int]:
    """The tokens a sequence of the first (batch, sequence, ...) tensor of `inputs` holds."""
    vals = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    return next((int(x.shape[1]) for x in vals if isinstance(x, torch.Tensor) and x.dim() >= 2), None)


def adopt(traced: nn.Module, trace_whole: Callable[[int], nn.Module], l: int, s: int,
          inputs: dict[str, int], drop_masks: bool = True) -> dict[int, tuple[int, Any]]:
    """Make program `traced` (at `l` tokens a sequence) take the rank's positions where its
    model makes its own (`find`, against `trace_whole(s)`, the same program at `s` tokens;
    `rewrite`): the input shifts the runtime must then do on the whole sequence. Nothing where
    it holds the positions op already (the model reads `token_positions`, or was adopted)."""
    return adopt_chunks([traced], lambda length: [trace_whole(length)], l, s, [inputs], drop_masks)


def adopt_chunks(traced: list[nn.Module], trace_whole: Callable[[int], list[nn.Module]], l: int, s: int,
                 inputs: list[dict[str, int]], drop_masks: bool = True) -> dict[int, tuple[int, Any]]:
    """`adopt` for a program cut into chunks (pipeline stages, in order; `trace_whole(s)`: the
    same cut at `s` tokens; `inputs`: each chunk's placeholders that are model inputs): the
    positions may be made in one chunk and read in later ones."""
    if any(reads_positions(t) for t in traced):
        shifts: dict[int, tuple[int, Any]] = {}
        for t in traced:
            shifts.update(getattr(t, "autopar_input_shifts", {}))
        return shifts
    wholes = trace_whole(s)
    founds = [find(t, w, l, s, ins) for t, w, ins in zip(traced, wholes, inputs)]
    if not any(f.positions for f in founds):
        raise PlanError("under context parallelism the model must take its token positions from "
                        "autopar.models.positions.token_positions, or make them as an arange of the sequence's "
                        f"length; this one has none that follows the sequence ({l} tokens traced against {s}), "
                        "so its position encodings cannot be set for a rank's chunks: re-plan with cp=1")
    shifts = {}
    for t, f in zip(traced, founds):
        rewrite(t, f, l, drop_masks)
        t.autopar_input_shifts = dict(f.shifts)
        shifts.update(f.shifts)
    return shifts
