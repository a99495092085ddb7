"""Recomputation of module-cut stages: `torch.utils.checkpoint` around a repeated block or its
attention child. A stage run op by op as solved checkpoints its solved regions instead
(`intra_op.execute`)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn


def is_repeated_block(fqn: str) -> bool:
    """Recomputation covers the repeated blocks (`blocks.3`), as in Megatron; the embedding and
    head run once (checkpointing a vocab-parallel embedding would also re-materialise its
    DTensor mask buffer, which torch refuses)."""
    return fqn.rsplit(".", 1)[-1].isdigit()


def apply_recompute(layer: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    target = layer
    if mode == "selective":
        for name in ("attn", "attention", "self_attn"):
            if isinstance(getattr(layer, name, None), nn.Module):
                target = getattr(layer, name)
                break
    orig = target.forward

    def fwd(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(orig, *args, use_reentrant=False, **kwargs)

    target.forward = fwd  # instance attribute: hooks (fully_shard) still run around __call__
