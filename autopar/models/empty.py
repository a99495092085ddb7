"""Build a model without its weights but with its buffers.

On the meta device a model costs nothing to build, but buffers computed in `__init__` (rotary
`inv_freq`, BERT's `position_ids`) come out as meta too, and a runtime that materialises the model
later cannot know their values. `empty_weights()` puts each parameter on meta as it is registered
while buffers are computed for real; `buffers_to_meta()` then moves the buffers to meta as well
(so capture sees an all-meta model) and keeps each value on its meta tensor, where
`autopar.runtime.materialize` finds it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn as nn

VALUE_ATTR = "_autopar_value"


@contextmanager
def empty_weights() -> Iterator[None]:
    """Parameters registered inside go to the meta device; everything else is built for real."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            extra = {k: v for k, v in p.__dict__.items()} if type(p) is not nn.Parameter else {}
            new = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            new.__dict__.update(extra)
            self._parameters[name] = new

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def buffers_to_meta(model: nn.Module) -> int:
    """Move every real buffer to meta, remembering its value; returns how many moved."""
    moved = 0
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and not b.is_meta:
                m = b.to("meta")
                setattr(m, VALUE_ATTR, b)
                mod._buffers[name] = m
                moved += 1
    return moved


def buffer_value(b: torch.Tensor) -> Optional[torch.Tensor]:
    """The value remembered for a meta buffer, if any."""
    return getattr(b, VALUE_ATTR, None)
