"""Embedding: out[i.., h] = sum_v onehot(idx)[i.., v] * W[v, h]. Splitting the index dims is
data parallelism (the table's gradient is partial: all-reduce); splitting h shards the table by
columns; splitting v is Megatron's vocab-parallel embedding (each device looks up its rows,
the output is partial)."""

from __future__ import annotations

from autopar.intra_op.rules import register
from autopar.intra_op.strategy import OpContext, Strategy, label_strategies


@register("embedding", family="embedding")
def embedding(ctx: OpContext) -> list[Strategy]:
    idx = ctx.in_shape(1)
    il = [f"i{k}" for k in range(len(idx))]
    return label_strategies(ctx, [["v", "h"], il], [il + ["h"]], reduced=["v"])
