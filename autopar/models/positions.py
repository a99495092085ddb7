"""The positions of a sample's tokens, as a model reads them to place its position encodings.

Without context parallelism a sample's tokens are at 0 .. s - 1: `token_positions` is
`torch.arange(s)`, the op a capture records. Under context parallelism a rank holds only some
chunks of every sequence (`runtime.context_parallel`), and their positions are set here for
the step (`positions_set`): a model that takes its positions from `token_positions` (the zoo's
Llama rotary tables, the zoo GPT's and BERT's position embeddings) then encodes each token where it is in
the whole sequence. A model that makes its own `arange` (a Hugging Face model wrapped by its
user) would place a rank's chunks at 0: the runtime runs such a model as its traced program,
its `arange`s of the positions found by how they follow the sequence length and made the
`autopar::token_positions` op below (`capture.own_positions`); it refuses one whose forward
never read them and that cannot be traced (`reads`).

A trace taken for pipeline stages under context parallelism (`traced_positions`) records the
positions as one op, `autopar::token_positions`, instead of the `arange` a trace would bake in:
the traced chunk then asks for them when it runs, and gets the rank's (`positions_set`).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import torch

_POSITIONS: ContextVar[Optional[torch.Tensor]] = ContextVar("autopar_token_positions", default=None)
# how many times a forward read the positions `positions_set` gave (`reads`)
_READS = [0]
# how many times a forward called `token_positions` at all, positions set or not (`calls`)
_CALLS = [0]


# whether a trace records the positions as the `autopar::token_positions` op (`traced_positions`)
_TRACED = [False]


def token_positions(seq: int, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The positions of the `seq` tokens a forward holds: 0 .. seq - 1, or those set by
    `positions_set` (the same count). Within `traced_positions`, one `autopar::token_positions`
    op that a trace records and that reads them when the traced program runs."""
    _CALLS[0] += 1
    if _TRACED[0]:
        return _positions_op(seq, device, dtype)
    return _current(seq, device, dtype)


def _current(seq: int, device: torch.device, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The positions set for `seq` tokens (`positions_set`), else 0 .. seq - 1."""
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


@torch.library.custom_op("autopar::token_positions", mutates_args=())
def _positions_op(seq: int, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`token_positions` as one op of a traced program: the positions set when it runs (a copy:
    a custom op's output aliases nothing)."""
    return _current(seq, device, dtype).clone()


@_positions_op.register_fake
def _(seq: int, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return torch.empty(seq, device=device, dtype=dtype or torch.int64)


@contextlib.contextmanager
def traced_positions() -> Iterator[None]:
    """Within it, `token_positions` returns the `autopar::token_positions` op: a trace (the
    runtime's pipeline chunks under context parallelism) records it rather than an `arange` of
    the traced length, so each rank's chunks get their own positions when they run."""
    before = _TRACED[0]
    _TRACED[0] = True
    try:
        yield
    finally:
        _TRACED[0] = before


def tracing() -> bool:
    """Whether `token_positions` returns the traced op now (within `traced_positions`)."""
    return _TRACED[0]


def traced_op() -> Any:
    """The op `traced_positions` makes a trace record (to find it in a traced graph)."""
    return torch.ops.autopar.token_positions.default
