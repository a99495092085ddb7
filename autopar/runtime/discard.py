"""Output-discarding recomputation ("norm_act"): Megatron-Core's `--recompute-granularity
selective --recompute-modules layernorm moe_act` for module-cut stages.

Megatron runs each block's input and pre-MLP layer norms, and the routed experts' activation,
under `tensor_parallel.CheckpointWithoutOutput` (megatron/core/tensor_parallel/random.py): the
function runs without saving anything but its inputs, and once the next module's forward has
saved its output, that output's storage is freed (`discard_output_and_register_recompute`, in
megatron/core/transformer/transformer_layer.py after the attention and the MLP, in
moe/experts.py after the experts' second grouped GEMM), re-made by a hook on that module's
output gradient, just before its backward needs it.

Here the same saving, by torch's saved-tensor hooks: the calls of a region (a norm module's
forward; in an experts module, an activation call and the element-wise calls after it that read
what it made, up to the first call of another kind: `cost_models.memory.ACTIVATION_OPS`,
`ACT_CONTINUE_OPS`, the memory model's rule) are recorded as they run (a `TorchFunctionMode`,
`_Tape`). Every tensor a region call made that autograd then saves, in the region or after it
(the norm's output saved by the projections reading it, the activation's product saved by the
output GEMM), is packed as (region, which output, view geometry) instead of the tensor
(`_pack`), so nothing but the region's inputs from outside (which the tape holds) keeps it
alive. The first backward that unpacks one re-runs the region's calls without autograd, under
the forward's autocast state (`_Tape.values`), keeps the outputs still to be unpacked, and
frees each once its last saver has unpacked it. The backward re-runs each region's forward once
(the time `inter_op.layers.Layer.recomputed_ops` prices). An op saving its own output (rsqrt)
packs it before the call returns, so that one is kept, as the memory model counts it. The
hooks are installed on the module holding each norm (its readers run there) and on each experts
module. Regions are deterministic (norms, activations: no random state to restore).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from autopar.runtime.validate import get_submodule
from cost_models.memory import ACT_CONTINUE_OPS, ACTIVATION_OPS

# storage pointer -> (tape, call index, output index, a weak reference to the output): the entry
# (and with it the tape) goes when the output does, so a reused storage is never matched
_REGISTRY: dict[int, tuple[Any, int, int, Any]] = {}


def func_kind(func: Any) -> str:
    """The op kind of a torch function or aten overload: `F.silu` -> silu, `Tensor.__mul__` ->
    mul, `aten.mul.Tensor` -> mul, `aten._to_copy.default` -> _to_copy."""
    name = getattr(func, "__name__", "") or ""
    if isinstance(func, torch._ops.OpOverload):
        name = func._schema.name.split("::")[-1]
    elif name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("r") and name[1:] in ("mul", "add"):
            name = name[1:]
    return name


class _Ref:
    """A region-made tensor in a recorded call's arguments: output `j` of call `i`."""

    __slots__ = ("i", "j")

    def __init__(self, i: int, j: int) -> None:
        self.i, self.j = i, j


class _Tape:
    """One region's recorded calls: arguments made outside the region held (its inputs), those
    made inside referenced (`_Ref`); re-run on demand without autograd."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple, dict]] = []
        self.ids: dict[int, tuple[int, int]] = {}     # id of a live output -> (call, index), while recording
        self.keep: list[torch.Tensor] = []            # the outputs while recording (ids stay unique)
        self.outer: set[int] = set()                  # storages of the region's inputs
        self.need: dict[tuple[int, int], int] = {}    # packed references not yet unpacked
        self.cache: Optional[dict[tuple[int, int], torch.Tensor]] = None
        self.autocast: list[tuple[str, bool, torch.dtype]] = []
        self.valid = True

    def reads(self, args: tuple, kwargs: dict) -> bool:
        return any(isinstance(t, torch.Tensor) and id(t) in self.ids for t in tree_flatten((args, kwargs))[0])

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        flat, _ = tree_flatten(out)
        if not any(isinstance(t, torch.Tensor) for t in flat):
            return
        if func_kind(func).endswith("_") and not func_kind(func).startswith("_"):
            self.valid = False          # an in-place call: a re-run would apply it twice
        if not self.calls:
            for dev in ("cuda", "cpu"):
                self.autocast.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))

        def ref(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                if id(t) in self.ids:
                    return _Ref(*self.ids[id(t)])
                self.outer.add(_ptr(t))
            return t

        i = len(self.calls)
        self.calls.append((func, tree_map(ref, args), tree_map(ref, kwargs)))
        for j, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                continue
            p = _ptr(t)
            if p in self.outer:
                continue            # an input returned as it is (`x.to(x.dtype)`): held already
            self.ids[id(t)] = (i, j)
            self.keep.append(t)
            if self.valid and p and (p not in _REGISTRY or _REGISTRY[p][0] is not self):
                _REGISTRY[p] = (self, i, j, weakref.ref(t, _forget(p)))

    def close(self) -> None:
        """Recording ends: the outputs are no longer held by the tape."""
        self.ids.clear()
        self.keep.clear()
        if not self.valid:
            for p in [p for p, e in _REGISTRY.items() if e[0] is self]:
                del _REGISTRY[p]

    def value(self, i: int, j: int) -> torch.Tensor:
        """Output `j` of call `i`, re-made (all the region's calls re-run once, without autograd,
        under the forward's autocast), kept until its last packed reference is unpacked."""
        from autopar.runtime.selective import recomputation_context

        if self.cache is None or (i, j) not in self.cache:
            vals: dict[tuple[int, int], torch.Tensor] = {}
            get = lambda x: vals[(x.i, x.j)] if isinstance(x, _Ref) else x  # noqa: E731
            with torch.no_grad(), recomputation_context(*[torch.autocast(d, dtype=dt, enabled=on)
                                                         for d, on, dt in self.autocast if on]):
                for k, (func, args, kwargs) in enumerate(self.calls):
                    out = func(*tree_map(get, args), **tree_map(get, kwargs))
                    for jj, t in enumerate(tree_flatten(out)[0]):
                        vals[(k, jj)] = t
            self.cache = {key: vals[key] for key, n in self.need.items() if n > 0}
        v = self.cache[(i, j)]
        self.need[(i, j)] = self.need.get((i, j), 1) - 1
        if self.need[(i, j)] <= 0:
            self.cache.pop((i, j), None)
        return v


def _ptr(t: torch.Tensor) -> int:
    """The identity of `t`'s storage: its StorageImpl's address (`_cdata`), not `data_ptr()`,
    which is 0 for the fake tensors `autopar verify` runs on (every output then looked alike
    and none was discarded: HF Mixtral's norm_act plan verified 2x its activations); 0 for a
    wrapper without storage (DTensor)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return 0


def _forget(p: int) -> Any:
    """A weak reference's callback dropping the registry's entry for storage `p` once its
    output is gone (unless a newer output took the pointer)."""
    def cb(ref: Any) -> None:
        e = _REGISTRY.get(p)
        if e is not None and e[3] is ref:
            del _REGISTRY[p]
    return cb


class _Packed:
    __slots__ = ("tape", "i", "j", "size", "stride", "offset")

    def __init__(self, tape: _Tape, i: int, j: int, t: torch.Tensor) -> None:
        self.tape, self.i, self.j = tape, i, j
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _pack(t: torch.Tensor) -> Any:
    if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter) or not _REGISTRY:
        return t
    e = _REGISTRY.get(_ptr(t))
    if e is None:
        return t
    tape, made = e[0], e[3]()
    if made is None or _ptr(made) != _ptr(t) or made.dtype != t.dtype or not tape.valid:
        return t
    key = (e[1], e[2])
    tape.need[key] = tape.need.get(key, 0) + 1
    return _Packed(tape, e[1], e[2], t)


def _unpack(p: Any) -> Any:
    if not isinstance(p, _Packed):
        return p
    return p.tape.value(p.i, p.j).as_strided(p.size, p.stride, p.offset)


def saved_hooks() -> Any:
    """The saved-tensor hooks packing region-made tensors as references (`_pack`)."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


class _Recording(TorchFunctionMode):
    """Records every call made inside it on `tape`."""

    def __init__(self, tape: _Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tape.record(func, args, kwargs, out)
        return out


class _ActivationTapes(TorchFunctionMode):
    """In an experts module's forward: a tape from each activation call (`ACTIVATION_OPS`) on
    through the element-wise calls reading what it made (`ACT_CONTINUE_OPS`), closed at the
    first call of another kind reading it (the output projection) or when the forward ends."""

    def __init__(self) -> None:
        super().__init__()
        self.tape: Optional[_Tape] = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = func_kind(func)
        reads = self.tape is not None and self.tape.reads(args, kwargs)
        if reads and kind not in ACT_CONTINUE_OPS:
            # a call reading the region's tensor that makes none (`untyped_storage`, a size or
            # a property: a memory tracker's look at each new tensor) is no call of the model's
            # and leaves the region open; before, under `track_step` (the harness, `autopar
            # verify`) the region ended at its activation, and its product with the up
            # projection stayed saved: HF Mixtral's norm_act tracked 5-11% over its prediction
            out = func(*args, **kwargs)
            if not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
                return out
            self.close()
            if kind in ACTIVATION_OPS:
                self.tape = _Tape()
                self.tape.record(func, args, kwargs, out)
            return out
        start = kind in ACTIVATION_OPS and self.tape is None
        if start:
            self.tape = _Tape()
        out = func(*args, **kwargs)
        if start or reads:
            self.tape.record(func, args, kwargs, out)
        return out

    def close(self) -> None:
        if self.tape is not None:
            self.tape.close()
            self.tape = None


def discard_norm(module: nn.Module) -> None:
    """Run `module` (a norm) as a region: its forward's calls recorded, what they made and
    autograd saves packed as references."""
    orig = module.forward

    def fwd(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        tape = _Tape()
        with saved_hooks(), _Recording(tape):
            out = orig(*args, **kwargs)
        tape.close()
        return out

    module.forward = fwd  # instance attribute: hooks (fully_shard) still run around __call__


def discard_activations(module: nn.Module) -> None:
    """Run each activation in `module`'s forward (an experts module) as a region
    (`_ActivationTapes`), its readers' saves packed."""
    orig = module.forward

    def fwd(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        mode = _ActivationTapes()
        try:
            with saved_hooks(), mode:
                return orig(*args, **kwargs)
        finally:
            mode.close()

    module.forward = fwd
    # a traced pipeline chunk's experts module is run by an eager copy behind the expert
    # exchange (`runtime.experts.eager_experts`), which takes the regions from this mark
    module._autopar_discard_acts = True


def readers_pack(module: nn.Module) -> None:
    """Pack region-made tensors in `module`'s forward (the module holding a norm: its readers)."""
    if getattr(module, "_autopar_discard_readers", False):
        return
    orig = module.forward

    def fwd(*args: Any, **kwargs: Any) -> Any:
        with saved_hooks():
            return orig(*args, **kwargs)

    module.forward = fwd
    module._autopar_discard_readers = True


def apply_discard(root: nn.Module, norms: list[str] | None, acts: list[str] | None) -> None:
    """"norm_act" in `root` (a stage's module tree): each of `norms` (its `recompute_modules`)
    a region, packed in the module holding it; each of `acts` (its `recompute_acts`, experts
    modules) with its activations' regions."""
    for fqn in norms or ():
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        readers_pack(get_submodule(root, parent) if parent else root)
        discard_norm(get_submodule(root, fqn))
    for fqn in acts or ():
        discard_activations(get_submodule(root, fqn))
