"""The built-in model zoo and model references.

A reference is a zoo name (`gpt3-1.3b`), `MODULE:FACTORY` (a callable returning
`(model, example_inputs)` or `(model, example_inputs, batch_fn)`), or `hf:NAME` (Hugging Face,
optional extra). `batch_fn(step, global_batch_size)` returns that step's global batch; zoo batch
functions depend only on the step and the seed, so every plan sees the same data.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from autopar.models.catalogue import catalogue
from autopar.models.configs import MLPConfig
from autopar.models.gpt import GPT
from autopar.models.init import meta_initialisers_skipped
from autopar.models.mlp import MLP
from autopar.schema.errors import PlanError

BatchFn = Callable[..., tuple]


@dataclass
class ModelBundle:
    """A model with example inputs (batch dim 0) and a function giving each step's batch."""

    name: str
    model: nn.Module
    example_inputs: tuple
    batch_fn: Optional[BatchFn] = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]              # batch size -> example inputs (on meta)
    batch: Callable[[int, int, int], tuple]     # (step, global batch, seed) -> real inputs
    description: str
    params: int = 0


def _gen(step: int, seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


@dataclass(frozen=True)
class TokenBatch:
    """(step, global batch, seed) -> (tokens, next tokens): random ids below `vocab`, length `seq`.
    A picklable callable (workers may be spawned with the bundle)."""

    vocab: int
    seq: int

    def __call__(self, step: int, global_batch_size: int, seed: int = 0) -> tuple:
        t = torch.randint(0, self.vocab, (global_batch_size, self.seq + 1), generator=_gen(step, seed))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


@dataclass(frozen=True)
class TokenInputs:
    """batch size -> (tokens, targets) example inputs on meta."""

    seq: int

    def __call__(self, b: int) -> tuple:
        return (torch.zeros(b, self.seq, dtype=torch.long, device="meta"),
                torch.zeros(b, self.seq, dtype=torch.long, device="meta"))


def token_batch(vocab: int, seq: int) -> Callable[[int, int, int], tuple]:
    return TokenBatch(vocab, seq)


def token_inputs(seq: int) -> Callable[[int], tuple]:
    return TokenInputs(seq)


@dataclass(frozen=True)
class NormalBatch:
    """(step, global batch, seed) -> (x, y), both standard normal of width `dim`."""

    dim: int

    def __call__(self, step: int, global_batch_size: int, seed: int = 0) -> tuple:
        g = _gen(step, seed)
        return (torch.randn(global_batch_size, self.dim, generator=g),
                torch.randn(global_batch_size, self.dim, generator=g))


def register_token_family(family: str, build: Callable[[Any], nn.Module]) -> dict[str, tuple[Any, str]]:
    """Register every catalogue entry of `family` (a language model fed token ids and trained
    on next-token targets, its config with `seq_len`, `vocab_size` and `num_params()`) as a
    zoo model built by `build(config)`; returns {name: (config, description)}."""
    configs = {n: (e.config, e.description) for n, e in catalogue(family).items()}
    for name, (cfg, desc) in configs.items():
        register(ZooEntry(name, family, functools.partial(build, cfg), token_inputs(cfg.seq_len),
                          token_batch(cfg.vocab_size, cfg.seq_len), desc, cfg.num_params()))
    return configs


def _mlp_entry(name: str, cfg: MLPConfig, desc: str) -> ZooEntry:
    dim = cfg.dim
    return ZooEntry(name, "mlp", lambda: MLP(cfg.dim, cfg.hidden, cfg.layers),
                    lambda b: (torch.zeros(b, dim, device="meta"), torch.zeros(b, dim, device="meta")),
                    NormalBatch(dim), desc, cfg.num_params())


_ZOO: dict[str, ZooEntry] = {}


def register(entry: ZooEntry) -> None:
    _ZOO[entry.name] = entry


register_token_family("gpt", GPT)   # llama, bert and moe register theirs when imported (`_load_families`)
for _e in catalogue("mlp").values():
    register(_mlp_entry(_e.name, _e.config, _e.description))


def zoo() -> dict[str, ZooEntry]:
    """All built-in models by name, in the catalogue's order (importing optional families that
    are installed), then any registered since."""
    _load_families()
    order = list(catalogue())
    return dict(sorted(_ZOO.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def _load_families() -> None:
    for mod in ("autopar.models.llama", "autopar.models.bert", "autopar.models.moe"):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass


def build_model(ref: str, *, device: str | torch.device = "meta", batch_size: int = 1) -> ModelBundle:
    """Resolve a model reference into a ModelBundle. Zoo models are built on `device`."""
    if not isinstance(ref, str) or not ref.strip():
        raise PlanError("model reference is empty; give a zoo name (see `autopar models`), "
                        "MODULE:FACTORY, or hf:NAME")
    ref = ref.strip()
    if ref.startswith("hf:"):
        from autopar.models.hf import build_hf

        return build_hf(ref[3:], batch_size=batch_size, device=device)
    if ":" in ref:
        return _from_factory(ref)
    entries = zoo()
    if ref not in entries:
        import difflib

        close = difflib.get_close_matches(ref, entries, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `autopar models` lists the zoo"
        raise PlanError(f"unknown model {ref!r}{hint} (or give MODULE:FACTORY or hf:NAME)")
    e = entries[ref]
    with torch.device(device), (meta_initialisers_skipped() if str(device) == "meta" else contextlib.nullcontext()):
        model = e.build()
    inputs = e.inputs(batch_size)
    if str(device) != "meta":
        inputs = tuple(torch.zeros(x.shape, dtype=x.dtype, device=device) for x in inputs)
    return ModelBundle(ref, model, inputs, e.batch, e.description)


def _from_factory(ref: str) -> ModelBundle:
    mod_name, _, attr = ref.partition(":")
    import os
    import sys

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())     # as `python -m` does: modules beside the user resolve
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise PlanError(f"cannot import module {mod_name!r} of model factory {ref!r}: {e}; "
                        f"check the name and that it is on PYTHONPATH") from None
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise PlanError(f"module {mod_name!r} has no attribute {attr!r} (model factory {ref!r})")
    if not callable(fn):
        raise PlanError(f"{ref!r} is not callable; a factory returns (model, example_inputs[, batch_fn])")
    with meta_initialisers_skipped():      # a factory building on meta: nothing to initialise
        out = fn()
    if isinstance(out, ModelBundle):
        return out
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3) or not isinstance(out[0], nn.Module):
        raise PlanError(f"factory {ref!r} must return (model, example_inputs) or "
                        f"(model, example_inputs, batch_fn), got {type(out).__name__}")
    inputs = out[1] if isinstance(out[1], (tuple, list)) else (out[1],)
    return ModelBundle(ref, out[0], tuple(inputs), out[2] if len(out) == 3 else None, "user factory")


def call_batch_fn(batch_fn: BatchFn, step: int, global_batch_size: int, seed: int) -> tuple:
    """Call a batch function, passing the seed when it accepts one."""
    try:
        takes_seed = "seed" in inspect.signature(batch_fn).parameters
    except (TypeError, ValueError):
        takes_seed = False
    out = batch_fn(step, global_batch_size, seed=seed) if takes_seed else batch_fn(step, global_batch_size)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def default_batch_fn(example_inputs: Sequence[Any]) -> BatchFn:
    """For factories without a batch_fn: random data shaped like the example inputs (integer inputs
    drawn below their example's max+1, floats from a normal)."""
    specs = []
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            specs.append(("const", x))
        elif x.dtype.is_floating_point:
            specs.append(("float", (tuple(x.shape[1:]), x.dtype)))
        else:
            hi = int(x.max()) + 1 if x.device.type != "meta" and x.numel() else 2
            specs.append(("int", (tuple(x.shape[1:]), x.dtype, max(hi, 2))))
    return ShapedBatch(tuple(specs))


@dataclass(frozen=True)
class ShapedBatch:
    """Random inputs shaped like example inputs (see `default_batch_fn`); picklable."""

    specs: tuple

    def __call__(self, step: int, global_batch_size: int, seed: int = 0) -> tuple:
        g = _gen(step, seed)
        out = []
        for kind, spec in self.specs:
            if kind == "const":
                out.append(spec)
            elif kind == "float":
                shape, dtype = spec
                out.append(torch.randn((global_batch_size,) + shape, generator=g).to(dtype))
            else:
                shape, dtype, hi = spec
                out.append(torch.randint(0, hi, (global_batch_size,) + shape, generator=g).to(dtype))
        return tuple(out)
