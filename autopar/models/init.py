"""Weight initialisation shared by the zoo models: the runtime's deterministic rule
(autopar.runtime.materialize) in eager form, so a model built directly on a real device starts
like a materialised one: normal(0, 0.02) for matrices and embeddings, zeros for biases, ones for
normalisation weights. On the meta device it costs nothing."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

# torch.nn.init's in-place initialisers (what module constructors' `reset_parameters` call)
_INITIALISERS = ("normal_", "uniform_", "trunc_normal_", "constant_", "zeros_", "ones_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if p.is_meta:
                continue
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, std)
            elif name == "weight" and ("norm" in type(mod).__name__.lower() or isinstance(mod, nn.LayerNorm)):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)


@contextlib.contextmanager
def meta_initialisers_skipped() -> Iterator[None]:
    """Inside: torch.nn.init's initialisers return a meta tensor as it is. Module constructors
    initialise their parameters; on the meta device the values do not exist, yet the first
    `normal_` on a meta tensor runs torch's Python reference kernel, which imports
    torch._dynamo (about 0.8 s of a warm `autopar plan`, nothing else in it needing dynamo)."""
    saved = {n: getattr(nn.init, n) for n in _INITIALISERS if hasattr(nn.init, n)}

    def skipping(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def init(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return f(tensor, *args, **kwargs)
        return init

    for n, f in saved.items():
        setattr(nn.init, n, skipping(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)
