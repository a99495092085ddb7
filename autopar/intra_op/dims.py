"""Which dims of a captured graph's tensors carry the batch, and which carry tokens.

A "tp" mesh axis runs as tensor (model) parallelism: every rank holds the whole micro-batch and
the whole sequence. The ILP (`solve_graph(model_axes=...)`) must then never split those dims on
that axis, or it prices data, sequence (Megatron-SP) or Ulysses parallelism the runtime does not
run. `batch_dims_of` reads the batch from the symbolic capture; `token_dims_of` follows the
token dims of the model's inputs through the graph along the sharding rules themselves.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Iterator

from autopar.capture.graph import OpGraph, SymDim, concrete
from autopar.intra_op.placement import shard_dim
from autopar.intra_op.strategy import OpContext, output_index

Dims = dict[str, tuple[int, ...]]


def batch_dims_of(graph: OpGraph) -> Dims:
    """For each node of a symbolic-batch capture, the dims of its first output that carry the
    batch (a SymDim: the batch itself or a product with it, such as flattened tokens)."""
    out: Dims = {}
    for n in graph.nodes:
        if n.outputs:
            dims = tuple(d for d, x in enumerate(n.outputs[0].shape) if isinstance(x, SymDim))
            if dims:
                out[n.name] = dims
    return out


def _seed(shape: tuple, dtype: str, batch: tuple[int, ...]) -> set[int]:
    """The token dims of a model input: every non-batch dim of an index tensor (token ids,
    positions, labels: integer dtypes), the middle dims of a float sequence (b, s, ..., h)."""
    rest = [d for d in range(len(shape)) if d not in batch]
    if not dtype.startswith(("float", "bfloat", "complex")):
        return set(rest)
    if len(shape) == 3:
        return {d for d in rest if 0 < d < len(shape) - 1}
    return set()


def token_ops(graph: OpGraph, batch: dict, b: int, tok: dict[tuple[str, int], set[int]]) -> Iterator[tuple]:
    """The call nodes of `graph` reading a tensor with token dims, in graph order, as (node, its
    outputs' metadata at batch `b`, its inputs as (producer, output index), their metadata).
    `tok` ((producer, output index) -> token dims) is seeded here from the model's inputs
    (`_seed`); the caller records each yielded node's outputs in it before the next is read."""
    metas: dict[str, list] = {}
    for n in graph.nodes:
        outs = [o.at(b) for o in n.outputs]
        metas[n.name] = outs
        if n.kind == "input":
            for k, o in enumerate(outs):
                s = _seed(tuple(o.shape), o.dtype, batch.get(n.name, ()) if k == 0 else ())
                if s:
                    tok[(n.name, k)] = s
            continue
        if n.kind != "call" or not outs:
            continue
        ins = [(i, output_index(n, k)) for k, i in enumerate(n.inputs)]
        in_metas = []
        for i, idx in ins:
            m = metas.get(i)
            in_metas.append(m[idx] if m and idx < len(m) else (m[0] if m else outs[0]))
        if any(key in tok for key in ins):
            yield n, outs, ins, in_metas


def token_dims_of(graph: OpGraph, batch_dims: dict | None = None, *, probe: int = 2) -> Dims:
    """For each node, the dims of each output that index tokens (the sequence), keyed by node
    name (first output) and "name#k" (output k > 0).

    Seeds are the model inputs' token dims (`_seed`). An op's output dim is a token dim when one
    of the op's own strategies on a `probe`-way mesh splits a token dim of an activation input
    and that output along it: the rules already know how every op maps dims (a transpose moves
    the sequence, a view keeps it, attention scores have it twice, a reduction over it drops
    it), so this needs no per-op table and no guess from sizes (hidden == sequence length is
    common). Parameters never seed: their dims are the model's."""
    from autopar.intra_op import rules as rules_mod

    batch = batch_dims if batch_dims is not None else batch_dims_of(graph)
    b = graph.batch_size or probe
    tok: dict[tuple[str, int], set[int]] = {}
    mesh = (probe,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n, outs, ins, in_metas in token_ops(graph, batch, b, tok):
            node = replace(n, outputs=outs, args=concrete(n.args, b), kwargs=concrete(n.kwargs, b))
            ctx = OpContext(node, in_metas, mesh, graph, 4, True)
            try:
                sts, _ = rules_mod.strategies(ctx)
            except Exception:  # noqa: BLE001 - an op no rule understands carries nothing on
                continue
            for st in sts:
                if not any(shard_dim(sp[0]) is not None and _norm(shard_dim(sp[0]), in_metas[k]) in tok.get(key, ())
                           for k, (key, sp) in enumerate(zip(ins, st.in_specs)) if sp):
                    continue
                for o, sp in enumerate(st.out_specs):
                    d = shard_dim(sp[0]) if sp else None
                    if d is not None and o < len(outs):
                        tok.setdefault((n.name, o), set()).add(_norm(d, outs[o]))
            # an op with no strategy splitting the sequence (fused attention splits only batch
            # and heads) maps it positionally: an output shaped like an input with token dims
            # (the query) keeps them
            for o, om in enumerate(outs):
                if (n.name, o) in tok:
                    continue
                for key, im in zip(ins, in_metas):
                    if key in tok and tuple(im.shape) == tuple(om.shape):
                        tok[(n.name, o)] = set(tok[key])
                        break
    out: Dims = {}
    for (name, k), dims in tok.items():
        out[name if k == 0 else f"{name}#{k}"] = tuple(sorted(dims))
    return out


def _norm(d: int, meta) -> int:
    return d + len(meta.shape) if d < 0 else d
