"""Placements of one tensor over a logical mesh, and the collectives that change them.

A *spec* is a tuple with one entry per mesh axis: "R" (replicated), "S(d)" (dimension d split
evenly over the axis) or "P" (partial: the devices of the axis hold summands of the tensor).
Several axes may split the same dimension (("S(0)", "S(0)") splits dim 0 over both, axis 0
outermost, as DTensor does).

`transition` lists the collectives that turn one spec into another, axis by axis:

    P -> R     all_reduce          S(i) -> R     all_gather
    P -> S(d)  reduce_scatter      S(i) -> S(j)  all_to_all
    R -> S(d)  free (local slice)  R|S -> P      free (keep one summand, zero the rest)

A collective's `bytes` is the whole buffer it works on, as in nccl-tests: the buffer reduced
(all_reduce), the gathered result (all_gather), the tensor before scattering (reduce_scatter),
the local buffer exchanged (all_to_all); "whole" means whole over the axis it runs on, i.e. the
local shard along the other axes.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Sequence

from autopar.schema.placement import PARTIAL, REPLICATE, shard, shard_dim  # noqa: F401 - parsed there

Spec = tuple[str, ...]


def replicated(ndim_mesh: int) -> Spec:
    return (REPLICATE,) * ndim_mesh


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    out = list(int(d) for d in shape)
    for p, m in zip(spec, mesh_shape):
        d = shard_dim(p)
        if d is not None and m > 1:
            out[d] = -(-out[d] // m)
    return tuple(out)


def local_numel(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> int:
    return math.prod(local_shape(shape, spec, mesh_shape))


def is_valid(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """Every split dimension exists and divides evenly by the axes splitting it."""
    div: dict[int, int] = {}
    for p, m in zip(spec, mesh_shape):
        d = shard_dim(p)
        if d is not None:
            if d >= len(shape) or m <= 1:
                return m <= 1 and d < len(shape)
            div[d] = div.get(d, 1) * m
    return all(int(shape[d]) % k == 0 for d, k in div.items())


def all_specs(shape: Sequence[int], mesh_shape: Sequence[int], allow_partial: bool = False) -> list[Spec]:
    """Every valid R/S(d) (and P, if asked) spec of a tensor of `shape`; axes of size 1 are R."""
    opts = [REPLICATE] + [shard(d) for d in range(len(shape))] + ([PARTIAL] if allow_partial else [])
    specs: list[Spec] = [()]
    for m in mesh_shape:
        choices = opts if m > 1 else [REPLICATE]
        specs = [s + (c,) for s in specs for c in choices]
    return [s for s in specs if is_valid(shape, s, mesh_shape)]


def _bytes(shape: Sequence[int], spec: Sequence[str], mesh_shape: Sequence[int], itemsize: int) -> float:
    return float(local_numel(shape, tuple(spec), mesh_shape) * itemsize)


@lru_cache(maxsize=200_000)
def transition(shape: tuple[int, ...], itemsize: int, src: Spec, dst: Spec,
               mesh_shape: tuple[int, ...], axis_cost: Optional[tuple[float, ...]] = None
               ) -> tuple[tuple[str, int, float], ...]:
    """Collectives (kind, mesh axis, bytes) turning layout `src` into `dst`, axis by axis.

    A step on one axis is one collective only if no later mesh axis splits a dim the step
    touches (DTensor shards nest: a later axis splits what the earlier one left). The axes go in
    such a *simple* order when there is one; among those, the order that moves the fewest
    weighted bytes (`axis_cost[a]`: seconds per byte on axis a; gather along a slow axis while
    the tensor is still small, reduce-scatter along it once it has shrunk). Without one, each
    step in mesh order first gathers the later axes nested in it, innermost first, and slices
    them back afterwards (`intra_op.execute.redistribute` runs exactly this)."""
    axes = [a for a in range(len(src)) if src[a] != dst[a] and mesh_shape[a] > 1]
    orders = _simple_orders(tuple(src), tuple(dst), tuple(axes))
    if not orders:
        return _nested_transition(shape, itemsize, src, dst, mesh_shape, axes)
    rest = lambda perm: tuple(perm) + tuple(a for a in range(len(src)) if a not in perm)  # noqa: E731
    if len(orders) == 1 or axis_cost is None:
        return _transition(shape, itemsize, src, dst, mesh_shape, rest(orders[0]))
    best, best_c = None, None
    for perm in orders:
        t = _transition(shape, itemsize, src, dst, mesh_shape, rest(perm))
        c = sum(axis_cost[a] * b for _, a, b in t)
        if best_c is None or c < best_c - 1e-18:
            best, best_c = t, c
    return best


def _touched(c: str, d: str) -> set[int]:
    return {x for x in (shard_dim(c), shard_dim(d)) if x is not None}


def nested_axes(cur: Sequence[str], a: int, d: str) -> list[int]:
    """Later mesh axes splitting a dim that changing axis `a` of `cur` to `d` touches."""
    t = _touched(cur[a], d)
    return [b for b in range(a + 1, len(cur)) if shard_dim(cur[b]) in t]


def _simple_orders(cur: Spec, dst: Spec, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every order of `axes` in which no step has a nested later axis (`nested_axes`)."""
    if not axes:
        return [()]
    out = []
    for a in axes:
        if nested_axes(cur, a, dst[a]):
            continue
        nxt = cur[:a] + (dst[a],) + cur[a + 1:]
        out += [(a,) + r for r in _simple_orders(nxt, dst, tuple(b for b in axes if b != a))]
    return out


def _nested_transition(shape, itemsize, src, dst, mesh_shape, axes) -> tuple[tuple[str, int, float], ...]:
    """No simple order: per changing axis a (mesh order), all-gather the axes nested in it
    (innermost first), change a, slice back the nested axes that keep their layout."""
    cur = list(src)
    out: list[tuple[str, int, float]] = []
    for a in axes:
        inner = nested_axes(cur, a, dst[a])
        for b in reversed(inner):
            whole = list(cur)
            whole[b] = REPLICATE
            out.append(("all_gather", b, _bytes(shape, whole, mesh_shape, itemsize)))
            cur[b] = REPLICATE
        out += _transition(shape, itemsize, tuple(cur), tuple(dst[x] if x == a else cur[x] for x in range(len(cur))),
                           mesh_shape, (a,))
        cur[a] = dst[a]
        for b in inner:
            if b not in axes:
                cur[b] = src[b]          # R -> S: a local slice
    return tuple(out)


def _transition(shape, itemsize, src, dst, mesh_shape, order) -> tuple[tuple[str, int, float], ...]:
    cur = list(src)
    out: list[tuple[str, int, float]] = []
    for a in order:
        s, d = cur[a], dst[a]
        if s == d or mesh_shape[a] <= 1:
            cur[a] = d
            continue
        whole = list(cur)
        whole[a] = REPLICATE
        if s == PARTIAL:
            if d == REPLICATE:
                out.append(("all_reduce", a, _bytes(shape, whole, mesh_shape, itemsize)))
            else:
                out.append(("reduce_scatter", a, _bytes(shape, whole, mesh_shape, itemsize)))
        elif shard_dim(s) is not None:
            if d == REPLICATE:
                out.append(("all_gather", a, _bytes(shape, whole, mesh_shape, itemsize)))
            elif shard_dim(d) is not None:
                out.append(("all_to_all", a, _bytes(shape, cur, mesh_shape, itemsize)))
            # S -> P: free
        # R -> S, R -> P: free
        cur[a] = d
    return tuple(out)
