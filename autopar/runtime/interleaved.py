"""Fused weights held chunk-interleaved, seen in the model's own row order.

The executor may hold a fused projection's weight (q, k and v as `chunks` row blocks along
`dim`) chunk-interleaved over the tp ranks, Megatron's QKV layout: rank r's contiguous shard is
[q_r; k_r; v_r] (`StageLayouts.param_layouts`, `intra_op.execute.interleave`), so splitting the
projection's output into q, k and v needs no gather. The logical tensor a checkpoint stores and
`full_state` returns is the model's own: [q; k; v], sharded contiguously (rank d holding rows
[d·3R/n, (d+1)·3R/n) of the 3R rows). Between the two, each rank exchanges its pieces of R/n
rows with the others in one all-to-all (`to_canonical`, `from_canonical`): nothing is gathered
whole, a shard's size is held once more while it is exchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["to_canonical", "from_canonical"]


def _exchange(local: torch.Tensor, dim: int, chunks: int, group: Any, forward: bool) -> torch.Tensor:
    """The all-to-all both directions share: `local` cut along `dim` into `chunks` equal pieces;
    piece i of rank r is global piece g = i·n + r in the interleaved order and sits at position
    g mod chunks on rank g // chunks in the model's order (`forward`), or the reverse."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    x = local.movedim(dim, 0).contiguous()
    rows = x.shape[0] // chunks
    if forward:                       # interleaved -> model order
        dest = [(i * n + r) // chunks for i in range(chunks)]
        # what each source sends here, and where it goes: source s's pieces i with
        # (i·n + s) // chunks == r, in order of i, at position i·n + s - r·chunks
        incoming = [[(i * n + s) - r * chunks for i in range(chunks) if (i * n + s) // chunks == r]
                    for s in range(n)]
    else:                             # model order -> interleaved
        dest = [((r * chunks + i) % n) for i in range(chunks)]
        incoming = [[g // n for g in range(s * chunks, (s + 1) * chunks) if g % n == r] for s in range(n)]
    order = sorted(range(chunks), key=lambda i: (dest[i], i))
    send = torch.cat([x[i * rows:(i + 1) * rows] for i in order]) if chunks > 1 else x
    in_splits = [rows * sum(1 for i in range(chunks) if dest[i] == d) for d in range(n)]
    out_splits = [rows * len(pos) for pos in incoming]
    recv = torch.empty_like(x)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    out = torch.empty_like(x)
    k = 0
    for pos in incoming:
        for p in pos:
            out[p * rows:(p + 1) * rows] = recv[k * rows:(k + 1) * rows]
            k += 1
    return out.movedim(0, dim)


def to_canonical(local: torch.Tensor, dim: int, chunks: int, group: Any) -> torch.Tensor:
    """This rank's contiguous shard of the model-order tensor, from its interleaved shard
    `local` (a collective over the tp `group`)."""
    return _exchange(local, dim, chunks, group, forward=True)


def from_canonical(local: torch.Tensor, dim: int, chunks: int, group: Any) -> torch.Tensor:
    """This rank's interleaved shard, from its contiguous shard `local` of the model-order
    tensor (a collective over the tp `group`)."""
    return _exchange(local, dim, chunks, group, forward=False)
