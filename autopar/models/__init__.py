"""Built-in model zoo (plain PyTorch, buildable on the meta device) and model references.

The names below load `registry` (and torch) on first use; `catalogue` lists the zoo without it."""

from __future__ import annotations

from typing import Any

__all__ = ["ModelBundle", "ZooEntry", "build_model", "call_batch_fn", "default_batch_fn",
           "register", "zoo"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from autopar.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
