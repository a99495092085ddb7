"""Imported by the runtime's forkserver last (`processes.PRELOAD`): one torch.export of a tiny
module on the meta device, so that the one-time set-up of torch.export and dynamo (lazy imports,
tables built on first use) is done once in the server instead of in every forked worker (gpt-tiny's
first export in a process 1.3 s, a later one 0.64 s, measured on the 2-core machine). Meta
tensors run no kernel: the server still has no OpenMP thread pool for a fork to copy."""

from __future__ import annotations

import warnings

import torch


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.proj(self.norm(x)))
        return torch.nn.functional.cross_entropy(h.softmax(-1).view(-1, 8), torch.zeros(4, dtype=torch.long,
                                                                                       device=x.device))


def warm_up() -> None:
    """Export the tiny block on meta (what a worker's first `meta_program` would pay for). A
    failure only costs the workers their warm start: it is reported, not raised (an exception
    here would stop the server, and every launch with it)."""
    try:
        with torch.device("meta"):
            block = _Block()
            x = torch.empty(2, 2, 8)
        torch.export.export(block, (x,))
    except Exception as e:  # noqa: BLE001 - reported; the workers export cold
        warnings.warn(f"autopar: the worker server's torch.export warm-up failed ({type(e).__name__}: {e}); "
                      "each worker sets torch.export up itself", RuntimeWarning, stacklevel=1)


warm_up()
