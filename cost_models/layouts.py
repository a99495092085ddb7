"""Which of a graph's reshapes copy when the model runs, from the strides its kernels give.

A captured graph records shapes, not strides, and its fake tensors do not always have the strides
the real kernels give: a fused attention kernel writes its output [b, s, h, d] in memory and
returns it as [b, h, s, d] (CUDA's flash and memory-efficient kernels always; CPU's flash kernel
when the query is laid out so), where the captured fake value is contiguous. Whether a
`reshape` (or `flatten`) is a view or makes a new tensor depends on exactly that: the usual
attention epilogue `out.transpose(1, 2).reshape(b, s, h * d)` is a view of a fused kernel's
output, and a grouped-query attention's `k[:, :, None].expand(...).reshape(...)` (the repeat of
keys and values over the query heads) always copies. So the memory model must not take every
reshape for a view (the repeated keys and values went uncounted: 2 x 64 MiB a layer of a
Llama-3.2-1B shape on an H100) nor every one for a copy.

`layout_copies` walks the ops in order with each tensor's strides: contiguous for what an op
makes, except a fused attention's output (above) and an elementwise op's, which keeps its first
operand's layout (TensorIterator); a view op's strides follow from its input's (torch's own view
rules, run on meta tensors). A tensor whose shape is not concrete, or a view op it cannot
follow, has no known layout: a reshape of it counts as a view, as before this module.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.capture.flops import VIEW_OPS, identity_dropout, identity_move
from cost_models.compute import FUSED_ATTENTION

Strides = Optional[tuple[int, ...]]

# views whose result may instead be a copy (torch's reshape: a view when the strides allow one)
RESHAPES = frozenset({"reshape", "flatten"})
# elementwise ops whose output takes the layout of their first operand (TensorIterator), and
# clone (its default memory_format=torch.preserve_format)
LAYOUT_KEEPING = frozenset({"add", "sub", "mul", "div", "neg", "to", "_to_copy", "type_as", "clone"})
# the split family: each piece keeps the input's strides
_SPLITS = frozenset({"split", "split_with_sizes", "chunk", "unsafe_split", "slice", "narrow"})


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


def _shape(node) -> Optional[tuple[int, ...]]:
    if not node.outputs:
        return None
    try:
        return tuple(int(d) for d in node.outputs[0].shape)
    except (TypeError, ValueError):
        return None


def _dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """A permutation of a contiguous layout (no gaps, no overlap): what TensorIterator keeps."""
    dims = sorted((s, d) for s, d in zip(strides, shape) if d != 1)
    acc = 1
    for s, d in dims:
        if s != acc:
            return False
        acc *= d
    return True


def _attention_out(node, q: Strides, shape: tuple[int, ...], device_type: Optional[str]) -> tuple[int, ...]:
    """A fused attention kernel's output strides: [b, s, h, d] in memory on CUDA; on CPU as its
    query is laid out (measured: strides (512, 8, 32, 1) for a [16, 4, 16, 8] output whose query
    was the transpose of a [b, s, h, d] tensor)."""
    if len(shape) != 4:
        return contiguous_strides(shape)
    b, h, s, d = shape
    bshd = (s * h * d, d, h * d, 1)
    if device_type != "cpu":
        return bshd
    if q is not None and len(q) == 4 and q[1] < q[2]:
        return bshd
    return contiguous_strides(shape)


def _view_strides(node, src_shape: tuple[int, ...], src: tuple[int, ...],
                  shape: tuple[int, ...]) -> tuple[Strides, bool]:
    """(strides of the view op's output, whether it copied) from its input's layout."""
    op = node.op
    nd = len(src_shape)
    if op in ("transpose", "swapaxes", "swapdims") and len(node.args) >= 3 \
            and all(isinstance(a, int) for a in node.args[1:3]):
        a, b = (x % nd for x in node.args[1:3])
        st = list(src)
        st[a], st[b] = st[b], st[a]
        return tuple(st), False
    if op == "t" and nd == 2:
        return (src[1], src[0]), False
    if op == "numpy_T":                 # `x.T`: every dim reversed
        return tuple(reversed(src)), False
    if op == "permute" and len(node.args) >= 2 and isinstance(node.args[1], (list, tuple)):
        return tuple(src[int(d) % nd] for d in node.args[1]), False
    if op in ("expand", "expand_as"):
        off = len(shape) - nd
        st = []
        for i, d in enumerate(shape):
            j = i - off
            st.append(0 if j < 0 or (src_shape[j] == 1 and d != 1) else src[j])
        return tuple(st), False
    if op in _SPLITS and len(shape) == nd:
        return src, False
    if op == "select" and len(node.args) >= 2 and isinstance(node.args[1], int):
        k = node.args[1] % nd
        return src[:k] + src[k + 1:], False
    if op in ("alias", "detach", "lift_fresh_copy") or identity_dropout(node) or identity_move(node) \
            or shape == src_shape:
        return src, False
    if op in ("view", "_unsafe_view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as"):
        t = torch.empty_strided(src_shape, src, device="meta")
        try:
            return tuple(t.view(shape).stride()), False
        except RuntimeError:
            if op in RESHAPES:
                return contiguous_strides(shape), True
            return None, False
    return None, False


def layout_copies(nodes: list, by_name: dict, device_type: Optional[str] = None,
                  attention_kernel: str = "fused", copied_queries: frozenset = frozenset()
                  ) -> tuple[frozenset, frozenset]:
    """(reshapes that copy, `contiguous` calls that copy nothing) when the graph `nodes` runs on
    `device_type` (None: a GPU) with the software's `attention_kernel` ("unfused": attention's
    output is a product's, contiguous). `copied_queries`: attention ops that read their query
    as a copy in standard strides (the op-by-op executor's redistribution of it: a gather
    concatenates), whatever the strides of the query the graph makes. See the module
    docstring."""
    from cost_models.memory import attention_is_fused  # memory imports this module

    strides: dict[str, Strides] = {}
    copying: set[str] = set()
    aliasing: set[str] = set()

    def of(name: Optional[str]) -> Strides:
        return strides.get(name) if name is not None else None

    for n in nodes:
        shape = _shape(n)
        if shape is None:
            strides[n.name] = None
            continue
        if n.kind != "call":
            strides[n.name] = contiguous_strides(shape)
            continue
        src = n.inputs[0] if n.inputs else None
        if n.target == "getitem":
            prod = by_name.get(src)
            if prod is not None and prod.kind == "call" and prod.op in _SPLITS | {"unbind"}:
                ps = of(prod.inputs[0] if prod.inputs else None)
                if ps is not None and prod.op == "unbind":
                    dim = prod.args[1] if len(prod.args) > 1 and isinstance(prod.args[1], int) else 0
                    k = dim % len(ps)
                    ps = ps[:k] + ps[k + 1:]
                strides[n.name] = ps if ps is not None and len(ps) == len(shape) else None
            elif prod is not None and prod.kind == "call" and prod.op in FUSED_ATTENTION and n.args[1:2] == (0,):
                strides[n.name] = of(prod.name)
            else:
                strides[n.name] = contiguous_strides(shape)
            continue
        if n.op in VIEW_OPS or identity_dropout(n) or identity_move(n):
            sp = by_name.get(src)
            ss = of(src)
            src_shape = _shape(sp) if sp is not None else None
            if ss is None or src_shape is None or len(ss) != len(src_shape):
                strides[n.name] = None
                continue
            st, copied = _view_strides(n, src_shape, ss, shape)
            strides[n.name] = st
            if copied:
                copying.add(n.name)
            continue
        if n.op == "contiguous":
            ss = of(src)
            if ss is not None and len(ss) == len(shape) and torch.empty_strided(
                    shape, ss, device="meta").is_contiguous():
                aliasing.add(n.name)
            strides[n.name] = contiguous_strides(shape)
            continue
        if n.op in FUSED_ATTENTION and attention_is_fused(n, device_type, attention_kernel, by_name):
            q = of(src)
            if n.name in copied_queries and src in by_name and _shape(by_name[src]) is not None:
                q = contiguous_strides(_shape(by_name[src]))
            strides[n.name] = _attention_out(n, q, shape, device_type)
            continue
        if n.op in LAYOUT_KEEPING:
            ss = of(src)
            sp = by_name.get(src)
            if ss is not None and sp is not None and _shape(sp) == shape and _dense(shape, ss):
                strides[n.name] = ss
                continue
        strides[n.name] = contiguous_strides(shape)
    return frozenset(copying), frozenset(aliasing)


class LayoutCopies(tuple):
    """`layout_copies`' pair (reshapes that copy, `contiguous` calls that copy nothing) of a whole
    graph, with what the time model reads of the same graph beside it: `grad_sums`, op name ->
    the tensors whose gradient sums autograd charges it with (`gradient_sums`)."""

    def __new__(cls, copying: frozenset, aliasing: frozenset, grad_sums: Optional[dict] = None) -> "LayoutCopies":
        t = super().__new__(cls, (copying, aliasing))
        t.grad_sums = dict(grad_sums or {})
        return t

    def __getnewargs__(self) -> tuple:
        return self[0], self[1], self.grad_sums


# readers through which no gradient reaches a tensor (shape queries, detaching, *_like makers)
_NO_GRAD_READERS = frozenset({"detach", "sym_size", "sym_numel", "_assert_tensor_metadata", "zeros_like",
                              "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                              "new_full"})
_FLOATING = ("float32", "float64", "float16", "bfloat16")


def gradient_sums(nodes: list, by_name: dict) -> dict[str, tuple[str, ...]]:
    """Op name -> the tensors whose gradients autograd's engine adds its gradient into: a tensor
    that k readers take a gradient from (each read an edge: `x * x` two) gets k gradients, summed
    by k - 1 adds (`InputBuffer::accumulate`, torch/csrc/autograd/input_buffer.cpp), each reading
    two of the tensor's size and writing one; the second reader on (in graph order) pays one
    each. The residual stream read by a norm and the residual add; a post-norm block's fp32 norm
    output read by the q, k and v projections and the residual (BERT-large on an H100: 96 fp32
    adds of its size a step, benchmarks/results/h100-2026-11-25/profiles/profile_bert-large.txt).
    Charged to the readers, a layer's part of a model (its tensors from other layers as inputs)
    pays for the tensors it reads. A split's or a multi-output op's pieces are read through
    `getitem`, not summed (a split's backward is its `cat`); the model's own inputs need none."""
    seen: dict[str, int] = {}
    out: dict[str, list[str]] = {}
    for r in nodes:
        if r.kind != "call" or r.target == "getitem" or r.op in _NO_GRAD_READERS or not r.outputs \
                or r.outputs[0].dtype not in _FLOATING:
            continue
        for i in r.inputs:
            src = by_name.get(i)
            if src is None or not src.outputs or src.outputs[0].dtype not in _FLOATING or not (
                    src.kind == "call" or (src.kind == "input" and src.target != "placeholder")):
                continue
            seen[i] = seen.get(i, 0) + 1
            if seen[i] > 1:
                out.setdefault(r.name, []).append(i)
    return {k: tuple(v) for k, v in out.items()}


def graph_layout_copies(graph, device_type: Optional[str] = None,
                        attention_kernel: str = "fused") -> LayoutCopies:
    """`layout_copies` of every op of `graph` (an `OpGraph` at a concrete batch), once per graph,
    device type and attention kernel: the walk depends on nothing else, and the memory model
    (every recomputation policy of a layer) and the time model (every op of it) both ask. With
    the graph's `gradient_sums` (the time model's)."""
    memo = graph.__dict__.setdefault("_layout_copies", {})
    key = (device_type, attention_kernel)
    if key not in memo:
        nodes = list(graph.nodes)
        by_name = {n.name: n for n in nodes}
        memo[key] = LayoutCopies(*layout_copies(nodes, by_name, device_type, attention_kernel),
                                 gradient_sums(nodes, by_name))
    return memo[key]


def executor_layout_copies(graph, device_type: Optional[str], attention_kernel: str,
                           copied_queries: frozenset) -> tuple[frozenset, frozenset]:
    """`graph_layout_copies` where the attention ops `copied_queries` read their query as the
    executor's copy in standard strides (`layout_copies`): on CPU, whose flash kernel writes its
    output as its query is laid out, the heads' merge after such an attention copies (a
    replicated attention reading the head-split RoPE output all-gathered: llama-small tp 4 on
    the CPU profile, [b, s, h] a layer that a column-parallel o_proj saves). What the query's
    layout changes is taken from `graph`'s own nodes' walk, with and without it, on top of the
    shared walk (`share_layout_walk`); once per graph and set of queries."""
    if not copied_queries:
        return graph_layout_copies(graph, device_type, attention_kernel)
    memo = graph.__dict__.setdefault("_layout_copies", {})
    key = (device_type, attention_kernel, copied_queries)
    if key not in memo:
        nodes = list(graph.nodes)
        by_name = {n.name: n for n in nodes}
        copying, aliasing = graph_layout_copies(graph, device_type, attention_kernel)
        with_q = layout_copies(nodes, by_name, device_type, attention_kernel, copied_queries)
        without = layout_copies(nodes, by_name, device_type, attention_kernel)
        memo[key] = ((copying | (with_q[0] - without[0])) - (without[0] - with_q[0]),
                     (aliasing | (with_q[1] - without[1])) - (without[1] - with_q[1]))
    return memo[key]


def share_layout_walk(sub, graph) -> None:
    """Make `sub` (a part of `graph`'s ops, with what it reads from outside as inputs) answer
    `graph_layout_copies` with `graph`'s walk: its ops are laid out as in `graph`, what it reads
    from outside as `graph` lays it (not taken contiguous), and one walk serves both."""
    sub.__dict__["_layout_copies"] = graph.__dict__.setdefault("_layout_copies", {})


def chain_strides(name: str, index: dict, device_type: Optional[str] = None,
                  attention_kernel: str = "fused") -> Strides:
    """The strides of tensor `name` (`index`: name -> node) from the op that made its data,
    followed through the view ops between, by `layout_copies`' rules: the op's output
    contiguous (a fused attention's [b, s, h, d] in memory), each view's from its input's. None
    where a shape is not concrete or a view cannot be followed. For one tensor where the
    graph's walk is not at hand (`cost_models.compute.split_backward_time` asks per op)."""
    from cost_models.memory import attention_is_fused  # memory imports this module

    chain = []
    cur = index.get(name)
    while cur is not None and cur.kind == "call" and cur.op in VIEW_OPS and cur.target != "getitem" \
            and cur.inputs and len(chain) < 32:
        chain.append(cur)
        cur = index.get(cur.inputs[0])
    shape = _shape(cur) if cur is not None else None
    if shape is None:
        return None
    st: Strides = contiguous_strides(shape)
    if cur.kind == "call" and cur.op in FUSED_ATTENTION and attention_is_fused(cur, device_type, attention_kernel,
                                                                                 index):
        st = _attention_out(cur, None, shape, device_type)
    for v in reversed(chain):
        src_shape, shp = _shape(index[v.inputs[0]]), _shape(v)
        if st is None or src_shape is None or shp is None or len(st) != len(src_shape):
            return None
        st, _ = _view_strides(v, src_shape, st, shp)
    return st
