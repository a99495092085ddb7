"""Element-wise chains priced as one kernel, as software that fuses them runs them
(`SoftwareSpec.pointwise_fusion == "fused"`: torch.compile's Inductor, Megatron's fused
bias-GELU / bias-dropout-add kernels).

In eager PyTorch every element-wise op is a kernel that reads its inputs from memory and writes
its output back: Hugging Face GPT-2's `gelu_new`, `0.5 * x * (1 + tanh(sqrt(2/pi) * (x +
0.044715 * x**3)))`, is eight kernels and 18 tensor-sized accesses where `F.gelu(x,
approximate="tanh")` is one kernel and 2 (`cost_models.compute`, per op). A fusing compiler
runs the whole expression as one kernel that reads `x` once and writes the result once.

A *chain* here is a maximal connected set of element-wise ops (`POINTWISE_OPS`; free views
between them are looked through: Inductor indexes through them) whose outputs have the same
number of elements, and that one kernel can run: no path leaves the set and comes back into
it (a residual add after attention does not join the add that made the attention's input).
Priced as one kernel:

- forward: the chain's external inputs read once (each distinct tensor, at the size of the
  data the view chain reads: a broadcast bias is its own size) and the outputs that leave the
  chain (read by an op outside it, or by nothing in the graph: a graph output) written once;
  its FLOPs summed; one kernel launch. Intermediates cost no memory traffic.
- backward: the forward's boundary bytes times the members' eager backward-to-forward bytes
  ratio (`compute.backward_bytes_factor`, weighted by their eager bytes): an ESTIMATE. A fused
  backward reads the output gradients and the saved inputs and writes the input gradients
  (gelu: dy, x read, dx written, 1.5x the forward's x read and y written, which the eager
  ratio of `gelu_new`'s eight ops, 29/18 = 1.6x, comes within 7% of).

A chain of one op is priced exactly as eager (`compute.node_time`), so fusion changes only
what fusion changes. The per-op cost the intra-op ILP and the analytic provider read stays
per op: each member carries the share of its chain's time in proportion to the boundary bytes
it owns (the external inputs it reads first, its output if that leaves the chain), priced at
its own sharding (the ILP merges element-wise ops into their producer's group, so a chain's
members are sharded alike in practice).

Under `pointwise_fusion == "norm_moe"` (software whose libraries fuse some modules and leave the
rest eager: Transformer Engine's RMSNorm, Megatron-Core's fused MoE permutation and weighted
SwiGLU, as NeMo AutoModel runs them) the groups are modules instead (`module_groups`): each
norm module (its class an RMSNorm or LayerNorm) is one kernel, and each expert block's experts
module (`autopar.capture.experts.find_expert_blocks`) runs its non-matrix ops (the gathers into
expert order, the activation, the weighting and the sum back) as kernels whose traffic is the
group's boundary, priced as one chain; every other element-wise op stays eager. The boundary
of an experts module is what the fused kernels move: the tokens read and their T x k rows
written in expert order (permutation), the up projection's output read and the activation
written, the down projection's output read and the T tokens written (unpermutation).

Under `pointwise_fusion == "norm"` (Megatron-Core with Transformer Engine before its fused MoE
permutation, NeMo 24.05 and 24.12: each norm one TE kernel, everything else eager) the groups are the norm
modules alone.

Memory is not changed by fusion here: the memory model keeps what eager autograd saves.
Inductor's partitioner (AOTAutograd's min-cut rematerialisation) recomputes element-wise ops in
the backward and saves fewer tensors, so under "fused" the predicted activation memory is an
upper bound (Hugging Face GPT-2's `gelu_new` saves four 4h-wide tensors where one would do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from autopar.capture.flops import is_view
from autopar.schema.cluster import DeviceSpec

# ATen element-wise ops (short names, `OpNode.op`) that a fusing compiler runs inside one kernel
# with their neighbours: arithmetic, activations, comparisons and selects, casts and copies.
# Creation ops (arange, full), reductions, norms, softmax and matrix ops end a chain.
POINTWISE_OPS = frozenset({
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "square", "sqrt", "rsqrt", "reciprocal", "exp", "exp2",
    "expm1", "log", "log1p", "log2", "abs", "sign", "sin", "cos", "tanh", "sigmoid", "erf", "erfc", "gelu", "silu",
    "relu", "leaky_relu", "elu", "hardtanh", "hardswish", "hardsigmoid", "mish", "softplus", "clamp", "clamp_min",
    "clamp_max", "maximum", "minimum", "where", "masked_fill", "lerp", "addcmul", "addcdiv", "floor", "ceil",
    "round", "trunc", "remainder", "fmod", "lt", "le", "gt", "ge", "eq", "ne", "logical_not", "logical_and",
    "logical_or", "bitwise_not", "bitwise_and", "bitwise_or", "native_dropout", "dropout", "to", "_to_copy",
    "type_as", "clone", "contiguous", "copy", "fill", "zeros_like", "ones_like", "full_like",
})


@dataclass(frozen=True)
class PointwiseChain:
    """One fused kernel's worth of element-wise ops (see the module docstring). Byte counts are
    of the captured tensors: (bytes, captured dtype) pairs, rescaled to the training dtype when
    priced."""

    members: tuple[str, ...]
    flops: float
    boundary: tuple[tuple[float, str], ...]      # external inputs read and outputs leaving
    backward_ratio: float                        # eager backward bytes / forward bytes of the members


@dataclass(frozen=True)
class FusedChains:
    """The chains of two or more ops of a graph, and each member's share of its chain's time."""

    chain_of: dict[str, PointwiseChain]
    share: dict[str, float]

    def __contains__(self, name: str) -> bool:
        return name in self.chain_of


def _numel(n) -> Optional[int]:
    try:
        return n.outputs[0].numel if n.outputs else None
    except (TypeError, ValueError):        # a symbolic dimension
        return None


def _walk(nodes: list, copies: Optional[tuple[frozenset, frozenset]]) -> tuple:
    """What both groupings read of `nodes` (in execution order): (reshapes that copy, `contiguous`
    calls that copy nothing, each node's position, each tensor's consumers, whether a node is a
    view: a call that `is_view` or copies nothing, not a reshape that copies)."""
    copying, aliasing = copies if copies is not None else (frozenset(), frozenset())
    pos = {n.name: i for i, n in enumerate(nodes)}
    consumers: dict[str, list[str]] = {}
    for n in nodes:
        for i in n.inputs:
            consumers.setdefault(i, []).append(n.name)

    def view(n) -> bool:
        return n.kind == "call" and n.name not in copying and (is_view(n) or n.name in aliasing)

    return copying, aliasing, pos, consumers, view


def _view_base(name: str, index: dict, view: Any) -> tuple[str, float, str]:
    """(the op that made the data `name` views, bytes of the smallest tensor on the way, its
    dtype), following `view` ops (a predicate on nodes) back through their first input."""
    cur = index.get(name)
    best: tuple[float, str] = (float("inf"), "float32")
    for _ in range(64):
        if cur is None:
            break
        if cur.outputs:
            try:
                best = min(best, (float(cur.outputs[0].nbytes), cur.outputs[0].dtype))
            except (TypeError, ValueError):
                pass
        if not (view(cur) and cur.inputs):
            return cur.name, best[0], best[1]
        cur = index.get(cur.inputs[0])
    return name, (best[0] if best[0] != float("inf") else 0.0), best[1]


def pointwise_chains(nodes: Iterable, index: dict, copies: Optional[tuple[frozenset, frozenset]] = None) -> FusedChains:
    """The element-wise chains of `nodes` (a graph's nodes at a concrete batch, in execution
    order; `index`: name -> node of the graph) that fusing software runs as one kernel each.
    `copies`: the graph's (reshapes that copy, `contiguous` calls that copy nothing)
    (`cost_models.layouts.graph_layout_copies`): a reshape that copies ends a chain, a
    `contiguous` that copies nothing is a view."""

    nodes = list(nodes)
    copying, aliasing, pos, consumers, view = _walk(nodes, copies)

    def pointwise(n) -> bool:
        return (n.kind == "call" and n.op in POINTWISE_OPS and n.name not in copying and n.name not in aliasing
                and not is_view(n) and _numel(n) is not None)

    def base(name: str) -> tuple[str, float, str]:
        return _view_base(name, index, view)

    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    members: dict[str, list[str]] = {}

    def depends_on(start: str, group: set[str], lo: int) -> bool:
        """Whether the tensor `start` (outside `group`) depends on a member of `group` through
        ops after position `lo` (the group's first member)."""
        stack, seen = [start], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in group:
                return True
            nx = index.get(x)
            if nx is None or pos.get(x, -1) < lo:
                continue
            stack.extend(nx.inputs)
        return False

    def external_inputs(group: set[str]) -> set[str]:
        out = set()
        for m in group:
            for i in index[m].inputs:
                b = base(i)[0]
                if b not in group:
                    out.add(i)
        return out

    for n in nodes:
        if not pointwise(n):
            continue
        parent[n.name] = n.name
        members[n.name] = [n.name]
        size = _numel(n)
        roots = []
        for i in n.inputs:
            b = base(i)[0]
            if b in parent and _numel(index[b]) == size and find(b) not in roots:
                roots.append(find(b))
        for r in roots:
            group = set(members[find(n.name)]) | set(members[r])
            lo = min(pos[m] for m in group)
            if any(pos.get(base(e)[0], -1) > lo and depends_on(e, group, lo) for e in external_inputs(group)):
                continue            # one kernel cannot run it: a path leaves the chain and comes back
            a, b2 = find(n.name), r
            parent[b2] = a
            members[a] = members[a] + members.pop(b2)

    return _priced(list(members.values()), pos, index, consumers, view, base)


def _priced(groups: list[list[str]], pos: dict, index: dict, consumers: dict, view, base,
            alias_casts: bool = False) -> FusedChains:
    """`FusedChains` of `groups` (member names), each priced as one kernel (the module docstring).
    `alias_casts`: a cast of a tensor from outside the group is that tensor to the kernel (it
    casts in registers): a reader outside reads the tensor, so the cast's output is not written."""
    from cost_models.compute import backward_bytes_factor

    chain_of: dict[str, PointwiseChain] = {}
    share: dict[str, float] = {}
    for ms in groups:
        if len(ms) < 2:
            continue
        group = set(ms)
        ms = sorted(ms, key=lambda m: pos[m])
        owned: dict[str, float] = {m: 0.0 for m in ms}
        boundary: list[tuple[float, str]] = []
        read: set[str] = set()
        fwd_eager = bwd_eager = flops = 0.0
        for m in ms:
            node = index[m]
            flops += node.flops
            fwd_eager += node.bytes_moved
            bwd_eager += node.bytes_moved * backward_bytes_factor(node.op)
            for i in node.inputs:
                b, nbytes, dt = base(i)
                if b in group or b in read:
                    continue
                read.add(b)
                boundary.append((nbytes, dt))
                owned[m] += nbytes
            own_cast = alias_casts and node.op in ("to", "_to_copy", "type_as") and bool(node.inputs) \
                and base(node.inputs[0])[0] not in group
            if _leaves(m, group, consumers, index, view) and not own_cast:
                o = node.outputs[0]
                boundary.append((float(o.nbytes), o.dtype))
                owned[m] += float(o.nbytes)
        chain = PointwiseChain(tuple(ms), flops, tuple(boundary), bwd_eager / fwd_eager if fwd_eager > 0 else 1.5)
        total = sum(owned.values())
        for m in ms:
            chain_of[m] = chain
            share[m] = owned[m] / total if total > 0 else 1.0 / len(ms)
    return FusedChains(chain_of, share)


def _leaves(name: str, group: set[str], consumers: dict, index: dict, view) -> bool:
    """Whether the output of chain member `name` is read outside `group` (through views), or by
    nothing in the graph (then the graph returns it)."""
    stack = [name]
    while stack:
        for c in consumers.get(stack.pop(), []):
            if c in group:
                continue
            node = index.get(c)
            if node is not None and view(node):
                stack.append(c)
                continue
            return True
    return not consumers.get(name)


NORM_MODULE_NAMES = ("rmsnorm", "layernorm")   # lower-case class names of a norm module


def module_groups(nodes: Iterable, index: dict, expert_modules: Iterable[str],
                  copies: Optional[tuple[frozenset, frozenset]] = None) -> FusedChains:
    """The groups `pointwise_fusion == "norm_moe"` runs as one kernel each (the module
    docstring): the non-view call ops of each norm module instance (`module_type` naming an
    RMSNorm or LayerNorm), and the non-matrix, non-view call ops inside each of
    `expert_modules` (module FQNs, their submodules included)."""
    from cost_models.compute import MATRIX_OPS

    nodes = list(nodes)
    copying, aliasing, pos, consumers, view = _walk(nodes, copies)

    def base(name: str) -> tuple[str, float, str]:
        return _view_base(name, index, view)

    experts = tuple(expert_modules)
    groups: dict[str, list[str]] = {}
    for n in nodes:
        if n.kind != "call" or view(n) or n.name in copying or not n.outputs:
            continue
        path = n.module_path or ""
        owner = next((m for m in experts if path == m or path.startswith(m + ".")), None)
        if owner is not None:
            if n.op in MATRIX_OPS:
                continue
            groups.setdefault(owner, []).append(n.name)
        elif path and any(k in (n.module_type or "").lower() for k in NORM_MODULE_NAMES):
            groups.setdefault(path, []).append(n.name)
    # a norm module's upcast of its input, read by the residual beside it in an fp32 capture (the
    # same tensor there), is its input to the fused kernel: not written
    return _priced(list(groups.values()), pos, index, consumers, view, base, alias_casts=True)


def graph_module_groups(graph: Any, device_type: Optional[str] = None,
                        attention_kernel: str = "fused", experts: bool = True) -> FusedChains:
    """`module_groups` of `graph` (an `OpGraph` at a concrete batch) with its expert blocks
    (`experts`; False: the norm modules only, `pointwise_fusion == "norm"`), once per graph,
    device type, attention kernel and that choice."""
    from autopar.capture.experts import find_expert_blocks
    from cost_models.layouts import graph_layout_copies

    memo = graph.__dict__.setdefault("_module_groups", {})
    key = (device_type, attention_kernel, experts)
    if key not in memo:
        nodes = list(graph.nodes)
        blocks = [b.module for b in find_expert_blocks(graph)] if experts else []
        memo[key] = module_groups(nodes, {n.name: n for n in nodes}, blocks,
                                  graph_layout_copies(graph, device_type, attention_kernel))
    return memo[key]


def graph_pointwise_chains(graph: Any, device_type: Optional[str] = None,
                           attention_kernel: str = "fused") -> FusedChains:
    """`pointwise_chains` of every op of `graph` (an `OpGraph` at a concrete batch), once per
    graph, device type and attention kernel (the layout walk that says which reshapes copy
    depends on them)."""
    from cost_models.layouts import graph_layout_copies

    memo = graph.__dict__.setdefault("_pointwise_chains", {})
    key = (device_type, attention_kernel)
    if key not in memo:
        nodes = list(graph.nodes)
        memo[key] = pointwise_chains(nodes, {n.name: n for n in nodes},
                                     graph_layout_copies(graph, device_type, attention_kernel))
    return memo[key]


def chain_member_time(name: str, fused: FusedChains, device: DeviceSpec, dtype: str = "bf16",
                      shard: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of chain member `name`: its share of its chain's one kernel
    (forward: the boundary bytes and the chain's FLOPs at the device's vector rate, one launch;
    backward: the boundary bytes times the chain's backward ratio, one launch), the chain's work
    divided by `shard` (this member's sharding)."""
    from cost_models.compute import bytes_scale, memory_time, vector_peak

    chain = fused.chain_of[name]
    f = max(float(shard), 1.0)
    nbytes = sum(b * bytes_scale(dt, dtype) for b, dt in chain.boundary) / f
    rate = vector_peak(device)
    fwd = max(chain.flops / f / rate, memory_time(nbytes, device)) + device.kernel_overhead_s
    bwd = max(chain.flops / f / rate, memory_time(nbytes * chain.backward_ratio, device)) + device.kernel_overhead_s
    w = fused.share[name]
    return w * fwd, w * bwd
