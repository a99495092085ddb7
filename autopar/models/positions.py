"""The positions of a sample's tokens, as a model reads them to place its position encodings.

Without context parallelism a sample's tokens are at 0 .. s - 1: `token_positions` is
`torch.arange(s)`, the op a capture records. Under context parallelism a rank holds only some
chunks of every sequence (`runtime.context_parallel`), and their positions are set here for
the step (`positions_set`): a model that takes its positions from `token_positions` (the zoo's
Llama rotary tables, the zoo GPT's and BERT's position embeddings) then encodes each token where it is in
the whole sequence. A model that makes its own `arange` would place a rank's chunks at 0: the
runtime refuses one whose forward never read them (`reads`).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Optional

import torch

_POSITIONS: ContextVar[Optional[torch.Tensor]] = ContextVar("autopar_token_positions", default=None)
# how many times a forward read the positions `positions_set` gave (`reads`)
_READS = [0]
# how many times a forward called `token_positions` at all, positions set or not (`calls`)
_CALLS = [0]


def token_positions(seq: int, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The positions of the `seq` tokens a forward holds: 0 .. seq - 1, or those set by
    `positions_set` (the same count)."""
    _CALLS[0] += 1
    pos = _POSITIONS.get()
    if pos is None or pos.numel() != seq:
        return torch.arange(seq, device=device, dtype=dtype)
    _READS[0] += 1
    return pos.to(device=device, dtype=dtype or pos.dtype)


def reads() -> int:
    """How many times `token_positions` returned positions set by `positions_set` (so far, in
    this process): whether a model reads them at all."""
    return _READS[0]


def calls() -> int:
    """How many times `token_positions` was called (so far, in this process), positions set or
    not: whether a captured forward asks for its positions (`capture.export.capture`)."""
    return _CALLS[0]


@contextlib.contextmanager
def positions_set(positions: torch.Tensor) -> Iterator[None]:
    """Within it, `token_positions` of `positions.numel()` tokens returns `positions`."""
    token = _POSITIONS.set(positions)
    try:
        yield
    finally:
        _POSITIONS.reset(token)
