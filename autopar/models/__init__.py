"""Built-in model zoo (plain PyTorch, buildable on the meta device) and model references."""

from autopar.models.registry import ModelBundle, ZooEntry, build_model, call_batch_fn, default_batch_fn, register, zoo

__all__ = ["ModelBundle", "ZooEntry", "build_model", "call_batch_fn", "default_batch_fn",
           "register", "zoo"]
