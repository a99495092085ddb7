"""Mixture-of-experts layers found in a captured graph: router, top-k, dispatch, expert GEMMs,
combine.

An expert block is recognised from the ops, not from class names: grouped GEMMs (`OpNode.op ==
"grouped_mm"`: torch's, Hugging Face's fallback, the zoo MoE's) whose weight operand is a
parameter stacked over experts (E, K, N) (through views and transposes). The module holding
those weights is the experts module; the top-k op feeding the block (the router's choice) gives
k, and its output's rows the tokens routed per sample. What expert parallelism needs of the
module (`autopar.runtime.experts`) is the interface Hugging Face's Mixtral / Qwen-MoE experts
and the zoo's `RoutedExperts` share: `forward(hidden (T, H), top_k_index (T, k), top_k_weights
(T, k)) -> (T, H)`, weights stacked on dim 0, the expert count read off the weights (or an
integer `num_experts` attribute, which the runtime sets to its local count).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.graph import OpGraph, OpNode, SymDim


@dataclass(frozen=True)
class ExpertBlock:
    """One MoE layer's routed experts in the captured graph."""

    module: str                   # FQN of the experts module
    layer: str                    # the repeated block holding it
    num_experts: int
    top_k: int
    hidden: int                   # width of a token (the exchange's row)
    weights: tuple[str, ...]      # parameter FQNs stacked over experts on dim 0
    gemms: tuple[str, ...]        # the grouped-GEMM nodes
    tokens_per_sample: int        # router rows per sample (sequence length for a decoder)
    router: str = ""              # the module of the top-k op

    @property
    def pairs_per_sample(self) -> int:
        """Token-expert pairs per sample: what the dispatch sends (dropless)."""
        return self.tokens_per_sample * self.top_k


def tp_split(graph: OpGraph, block: ExpertBlock) -> tuple[tuple[int, int], ...]:
    """How expert tensor parallelism splits each of `block`'s stacked weights over tp: (dim,
    pieces) per weight. The block's last grouped GEMM is its output projection (row-parallel:
    its contraction dim K split), the ones before it input projections (column-parallel: their
    output dim N split); a GEMM sees its weight as (E, K, N), the parameter as stored through
    transposes of its last two dims (Hugging Face's and the zoo's (E, N, K), nn.Linear's layout).
    `pieces`: an input projection whose N is twice the output projection's K is a fused gate/up
    projection, chunked in two after its GEMM: each half is split (so the rank's gate and up
    columns pair up), 2; else 1. Empty where a weight is reached through other ops or read by
    GEMMs of both kinds, or the widths are not such multiples (the experts then stay replicated)."""
    split: dict[str, tuple[int, int]] = {}
    last = len(block.gemms) - 1
    widths = {}
    for i, name in enumerate(block.gemms):
        n = graph.node(name)
        node = graph.node(n.inputs[1]) if len(n.inputs) > 1 else None
        swaps = 0
        while node is not None and node.kind != "param" and node.op == "transpose":
            if sorted(a % 3 for a in node.args[1:3] if isinstance(a, int)) != [1, 2]:
                return ()
            swaps += 1
            node = graph.node(node.inputs[0]) if node.inputs else None
        fqn = node.fqn if node is not None and node.kind == "param" else (
            node.params[0] if node is not None and node.op == "transpose" and node.params else None)
        if fqn is None or fqn not in block.weights:
            return ()
        view_dim = 1 if i == last else 2            # K of the output projection, N of the others
        dim = (3 - view_dim) if swaps % 2 else view_dim
        if split.get(fqn, (dim,))[0] != dim:
            return ()
        split[fqn] = (dim,)
        widths[fqn] = int(graph.params[fqn].shape[dim])
    if set(split) != set(block.weights) or last < 1:
        return ()
    k_out = widths[weight_param(graph, graph.node(block.gemms[last]).inputs[1])]
    out = []
    for w in block.weights:
        n = widths[w]
        if n % k_out or n // k_out > 2:
            return ()
        out.append((split[w][0], n // k_out))
    return tuple(out)


def tp_width(graph: OpGraph, block: ExpertBlock) -> int:
    """The width expert tensor parallelism splits (each piece of `tp_split`'s dims; 0 where it
    cannot): tp must divide it."""
    split = tp_split(graph, block)
    if not split:
        return 0
    return min(int(graph.params[w].shape[d]) // k for w, (d, k) in zip(block.weights, split))


def weight_param(graph: OpGraph, name: str) -> str | None:
    """The parameter a grouped GEMM's weight operand is a view of (following first inputs)."""
    seen = 0
    node: OpNode | None = graph.node(name)
    while node is not None and seen < 8:
        if node.kind == "param":
            return node.fqn
        if node.params:
            return node.params[0]
        node = graph.node(node.inputs[0]) if node.inputs else None
        seen += 1
    return None


def _rows_per_sample(d: object) -> int:
    """A dimension's size per sample: "16*b" -> 16; a concrete size as it is."""
    if isinstance(d, SymDim):
        return d.at(1)
    return int(d)


def find_expert_blocks(graph: OpGraph) -> list[ExpertBlock]:
    """The graph's expert blocks, in execution order (empty for a dense model)."""
    by_module: dict[str, list[tuple[OpNode, str]]] = {}
    for n in graph.calls:
        if n.op != "grouped_mm" or len(n.inputs) < 2:
            continue
        fqn = weight_param(graph, n.inputs[1])
        info = graph.params.get(fqn) if fqn else None
        if info is None or len(info.shape) != 3:
            continue
        by_module.setdefault(fqn.rpartition(".")[0], []).append((n, fqn))
    out = []
    calls = graph.calls
    pos = {n.name: i for i, n in enumerate(calls)}
    for module, gemms in by_module.items():
        first = min(pos[n.name] for n, _ in gemms)
        layer = gemms[0][0].layer or ""
        # the router's choice: the last top-k before the block's first GEMM, in its layer
        topk = next((c for c in reversed(calls[:first]) if c.op == "topk" and (c.layer or "") == layer), None)
        if topk is None or len(topk.args) < 2 or not isinstance(topk.args[1], int):
            continue
        weights = tuple(dict.fromkeys(f for _, f in gemms))
        E = graph.params[weights[0]].shape[0]
        out_shape = topk.outputs[0].shape if topk.outputs else ()
        rows = _rows_per_sample(out_shape[0]) if len(out_shape) == 2 else _rows_per_sample(out_shape[0]) * int(
            out_shape[1]) if len(out_shape) == 3 else 0
        if graph.batch_size and not any(isinstance(d, SymDim) for d in out_shape):
            rows //= graph.batch_size
        # a token's width: the first GEMM's rows (S, H) as dispatched
        x = graph.node(min(gemms, key=lambda t: pos[t[0].name])[0].inputs[0])
        hidden = int(x.outputs[0].shape[-1]) if x.outputs else 0
        out.append(ExpertBlock(module, layer, int(E), int(topk.args[1]), int(hidden), weights,
                               tuple(n.name for n, _ in gemms), int(rows), topk.module_path))
    return out
