"""The model's layers: the units the inter-op DP slices into pipeline stages.

- Repeated blocks (`graph.layers`, e.g. `blocks.0 .. blocks.47`) are the layers. Ops outside
  every block belong to the top-level module in their `module_path`; the ones before the first
  block join the first layer (`embed` + `blocks.0`), the ones after it join the block that ran
  last before them (`blocks.47` + `head` + the loss).
- Without repeated blocks (a plain MLP, a user model), the top-level units (children of the
  root, or the elements of a ModuleList/Sequential at the root's level) are clustered into
  at most `max_layers` layers by Alpa's eq. 6: contiguous groups whose FLOPs stay within
  (1 + delta) x the mean, minimising the largest activation a layer receives from earlier ones.

A layer's `modules` are the module FQNs the runtime cuts stages at, in execution order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch.nn as nn

from autopar.capture.graph import OpGraph, OpNode
from autopar.schema.constraints import SPLIT_SLOTS
from autopar.schema.errors import PlanError
from cost_models.memory import DiscardRegion, checkpointed_module, norm_act_regions, selective_ops


@dataclass
class Layer:
    """One layer: a contiguous run of ops and the modules that hold them."""

    index: int
    name: str                                   # e.g. "blocks.3" (the main module)
    modules: list[str]                          # module FQNs for the runtime, in order
    nodes: list[str]                            # call-node names, in graph order
    params: list[str]                           # canonical parameter FQNs the ops read
    block_nodes: frozenset[str] = frozenset()   # nodes inside the repeated block (recomputable)
    signature: str = ""                         # equal for identical layers (cost cache key)
    flops: float = 0.0                          # forward FLOPs at batch size 1
    # per recomputation policy, the module the recomputation runs in (`cost_models.memory.
    # checkpointed_module` of the block's ops); absent where the layer has no repeated block
    recompute_modules: dict[str, str] = field(default_factory=dict)
    # the ops selective recomputation re-runs (`cost_models.memory.selective_ops`: the attention
    # core's run of ops), in program order; empty without a core
    selective_ops: list[str] = field(default_factory=list)
    # the ops "attention" recomputation re-runs: the block's ops inside the module holding the
    # attention core (`recompute_modules["attention"]`), in program order; empty without a core
    attention_ops: list[str] = field(default_factory=list)
    # the regions "norm_act" recomputes (`cost_models.memory.norm_act_regions`: the block's norm
    # modules, the routed experts' activations), in program order; empty without a block
    discard_regions: list[DiscardRegion] = field(default_factory=list)

    def selective_region(self, tp: int) -> str:
        """What "selective" recomputes of this layer at tp degree `tp` (`cost_models.memory`'s
        `selective_region`): its `selective_ops` ("ops"), except on a stage run module by
        module (no tp) where they are several calls, which a module's forward cannot cut out:
        then the module holding them, whole ("module", `runtime.selective`)."""
        from autopar.runtime.selective import runs_as_one_call

        if tp > 1 or not self.selective_ops or runs_as_one_call(self.selective_ops):
            return "ops"
        return "module"

    def recomputed_ops(self, recompute: str, tp: int) -> list[str]:
        """The ops of this layer `recompute` re-runs in the backward on a stage of tp degree
        `tp`: the block's ("full"), the module holding the attention core's ("attention", and
        "selective" where it falls back to that module, `selective_region`), the core's run of
        ops ("selective"), the norms' and expert activations' ("norm_act"); none under "none"."""
        if recompute == "full":
            return [n for n in self.nodes if n in self.block_nodes]
        if recompute == "attention" or (recompute == "selective" and self.selective_region(tp) == "module"):
            return list(self.attention_ops)
        if recompute == "selective":
            return list(self.selective_ops)
        if recompute == "norm_act":
            return [n for r in self.discard_regions for n in r.ops]
        return []

    def rename_param(self, fqn: str, other: "Layer") -> str:
        """`fqn` of this layer as the corresponding FQN of `other` (same signature)."""
        if fqn.startswith(self.name + ".") and other.name != self.name:
            return other.name + fqn[len(self.name):]
        return fqn


def op_name_mapping(graph: OpGraph, rep: Layer, lay: Layer) -> dict[str, str]:
    """Names of `rep`'s ops and of the tensors they read -> those of `lay`, a layer of the same
    signature: how a cost or solution worked out once for `rep` is read for `lay` (the
    providers' per-signature caches, the per-signature layouts of `stage_layouts`)."""
    out = dict(zip(rep.nodes, lay.nodes))
    for rn, ln in zip(rep.nodes, lay.nodes):
        for a, b in zip(graph.node(rn).inputs, graph.node(ln).inputs):
            out.setdefault(a, b)
    return out


def _top(path: str, containers: set[str]) -> str:
    """The top-level unit of a module path: the root's child, or a container's element."""
    if not path:
        return ""
    parts = path.split(".")
    if parts[0] in containers and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def build_layers(graph: OpGraph, model: Optional[nn.Module] = None, max_layers: int = 16,
                 delta: float = 0.5, account: tuple[str, ...] = (), strict: bool = True) -> list[Layer]:
    """The layers of `graph` in execution order (see the module docstring); `account`: the
    `SPLIT_SLOTS` that are layers of their own (PlanError where the model has no such part,
    or, not `strict`, that part left with its block)."""
    calls = graph.calls
    g1 = graph.at_batch(1) if graph.batch_size is None else graph
    flops = {n.name: n.flops for n in g1.calls}
    bad = [a for a in account if a not in SPLIT_SLOTS]
    if bad:
        raise PlanError(f"account_in_split: {bad[0]!r} is not a layer slot; one of {', '.join(SPLIT_SLOTS)}",
                        constraint="account_in_split")
    if account and not graph.layers:
        raise PlanError(f"account_in_split={tuple(account)}: the model has no repeated blocks, so no embedding "
                        f"or loss outside them to give a layer slot of its own; drop account_in_split",
                        constraint="account_in_split")
    if graph.layers:
        groups = _block_groups(calls, graph.layers, _ancestors(graph.layers), tuple(account), strict)
    else:
        containers = set()
        if model is not None:
            containers = {n for n, c in model.named_children() if isinstance(c, (nn.ModuleList, nn.Sequential))}
        groups = _cluster(calls, graph, containers, flops, max_layers, delta)
    layers = []
    for i, (name, modules, nodes, block) in enumerate(groups):
        params: list[str] = []
        for n in nodes:
            for p in n.params:
                if p not in params:
                    params.append(p)
        lay = Layer(i, name, modules, [n.name for n in nodes], params,
                    frozenset(n.name for n in nodes if n.name in block),
                    flops=sum(flops.get(n.name, 0.0) for n in nodes))
        lay.signature = _signature(graph, lay, nodes)
        blk = [n for n in nodes if n.name in block]
        for rc in ("full", "selective", "attention"):
            m = checkpointed_module(blk, rc)
            if m is not None:
                lay.recompute_modules[rc] = m
        lay.selective_ops = selective_ops(blk)
        lay.attention_ops = _ops_under(blk, lay.recompute_modules.get("attention"))
        lay.discard_regions = norm_act_regions(blk)
        layers.append(lay)
    return layers


def _ops_under(block: list[OpNode], module: Optional[str]) -> list[str]:
    """The names of `block`'s ops run inside `module` (its forward or a child's); none for None."""
    if module is None:
        return []
    return [n.name for n in block if ((n.module_path or "") + ".").startswith(module + ".")]


def _ancestors(blocks: list[str]) -> set[str]:
    """The modules holding a repeated block (`transformer`, `transformer.h` for `transformer.h.3`)."""
    out = set()
    for b in blocks:
        parts = b.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


def _outside_module(path: str, ancestors: set[str]) -> str:
    """The module an op outside every block is cut with: the shortest prefix of its module path
    that holds no block (`transformer.wte`, not `transformer`, whose forward runs the blocks:
    a stage or a ZeRO-3 unit holding it would hold them all); "" for an op in the forward of a
    block's ancestor itself (it reads no module of its own)."""
    parts = path.split(".") if path else []
    for i in range(1, len(parts) + 1):
        pre = ".".join(parts[:i])
        if pre not in ancestors:
            return pre
    return ""


def _block_groups(calls: list[OpNode], blocks: list[str], ancestors: set[str], account: tuple[str, ...] = (),
                  strict: bool = True):
    order = {b: i for i, b in enumerate(blocks)}
    groups: dict[str, tuple[list[str], list[OpNode], set[str]]] = {b: ([], [], set()) for b in blocks}
    inside = [i for i, n in enumerate(calls) if n.layer in order]
    if not inside:                              # no op inside any block (should not happen)
        groups[blocks[0]] = ([], list(calls), set())
        return [(b, groups[b][0] or [b], groups[b][1], groups[b][2]) for b in blocks]
    first, last = inside[0], inside[-1]
    # the ops before the first block ("embedding") and after the last ("loss"), each its own
    # layer where `account` names it (and it holds a module to cut at), else with its block
    parts: dict[str, tuple[list[str], list[OpNode], set[str]]] = {}
    for slot, ops in (("embedding", calls[:first]), ("loss", calls[last + 1:])):
        part: tuple[list[str], list[OpNode], set[str]] = ([], [], set())
        for n in ops:
            _add(part, n, in_block=False, ancestors=ancestors)
        if slot in account and part[0]:
            parts[slot] = part
        elif slot in account and strict:
            where = "before the first" if slot == "embedding" else "after the last"
            raise PlanError(f"account_in_split names {slot!r}, but no module runs {where} repeated block "
                            f"({blocks[0] if slot == 'embedding' else blocks[-1]}) for a pipeline chunk to hold; "
                            f"drop {slot!r} from account_in_split", constraint="account_in_split")
    current: Optional[str] = None
    for i, n in enumerate(calls):
        if i < first:
            if "embedding" not in parts:
                _add(groups[calls[first].layer], n, in_block=False, ancestors=ancestors)
        elif n.layer in order:
            current = n.layer
            _add(groups[current], n, in_block=True, ancestors=ancestors)
        elif i > last and "loss" in parts:
            continue
        else:
            _add(groups[current], n, in_block=False, ancestors=ancestors)
    out = []
    if "embedding" in parts:
        mods, nodes, block = parts["embedding"]
        out.append((mods[0], mods, nodes, block))
    for b in blocks:
        mods, nodes, block = groups[b]
        out.append((b, mods or [b], nodes, block))       # modules in order of first use
    if "loss" in parts:
        mods, nodes, block = parts["loss"]
        out.append((mods[0], mods, nodes, block))
    return out


def _add(group, n: OpNode, in_block: bool, ancestors: set[str]) -> None:
    mods, nodes, block = group
    nodes.append(n)
    if in_block:
        block.add(n.name)
        mod = n.layer
    else:
        mod = _outside_module(n.module_path, ancestors)
    if mod and mod not in mods:
        mods.append(mod)


def _cluster(calls: list[OpNode], graph: OpGraph, containers: set[str], flops: dict[str, float],
             max_layers: int, delta: float):
    """Alpa eq. 6 over top-level units."""
    units: list[tuple[str, list[OpNode]]] = []
    for n in calls:
        u = _top(n.module_path, containers)
        if units and (u == "" or u == units[-1][0]):
            units[-1][1].append(n)
        elif u == "" and not units:
            units.append(("", [n]))
        else:
            units.append((u, [n]))
    # a leading root-level unit joins the next one
    if len(units) > 1 and units[0][0] == "":
        units[1] = (units[1][0], units[0][1] + units[1][1])
        units = units[1:]
    # the same module may appear twice when control flow interleaves; keep the order of ops
    if not units:
        return [("", [], [], set())]
    k = len(units)
    L = max(1, min(max_layers, k))
    uf = [sum(flops.get(n.name, 0.0) for n in ns) for _, ns in units]
    # bytes each unit receives from earlier units (activations crossing into it)
    pos = {}
    for ui, (_, ns) in enumerate(units):
        for n in ns:
            pos[n.name] = ui
    recv = [[0.0] * k for _ in range(k)]        # recv[i][j]: bytes into units i..j from < i
    produced_by = {}
    for n in graph.nodes:
        if n.kind == "call":
            produced_by[n.name] = n
    into = [dict() for _ in range(k)]           # unit -> {producer: (producer unit, bytes)}
    for ui, (_, ns) in enumerate(units):
        for n in ns:
            for src in n.inputs:
                p = produced_by.get(src)
                if p is None or src not in pos or pos[src] >= ui:
                    continue
                b = sum(_nbytes1(o) for o in p.outputs)
                into[ui][src] = (pos[src], b)
    for i in range(k):
        seen: dict[str, float] = {}
        for j in range(i, k):
            for src, (pu, b) in into[j].items():
                if pu < i:
                    seen[src] = b
            recv[i][j] = sum(seen.values())
    total = sum(uf) or 1.0
    groups = None
    d = delta
    while groups is None:
        cap = (1 + d) * total / L
        groups = _eq6(uf, recv, L, cap)
        d = d * 2 + 0.5
    out = []
    for a, b in groups:
        ns = [n for _, nn_ in units[a:b + 1] for n in nn_]
        mods = [u for u, _ in units[a:b + 1] if u]
        out.append((mods[0] if mods else "", mods or [""], ns, {n.name for n in ns}))
    return out


def _nbytes1(o) -> float:
    try:
        return float(o.nbytes)
    except (TypeError, ValueError):
        import math

        return float(math.prod(d if isinstance(d, int) else 1 for d in o.shape) * o.itemsize)


def _eq6(uf: list[float], recv: list[list[float]], L: int, cap: float):
    """G(k, r): units 0..k-1 in r layers, minimising the largest received activation under the
    FLOP cap; ties broken by the largest layer FLOPs. None when the cap cannot hold."""
    k = len(uf)
    pre = [0.0]
    for f in uf:
        pre.append(pre[-1] + f)
    INF = (float("inf"), float("inf"))
    G = [[INF] * (L + 1) for _ in range(k + 1)]
    arg = [[-1] * (L + 1) for _ in range(k + 1)]
    G[0][0] = (0.0, 0.0)
    for j in range(1, k + 1):
        for r in range(1, min(L, j) + 1):
            for i in range(r - 1, j):                 # layer = units i..j-1
                fl = pre[j] - pre[i]
                if fl > cap and j - i > 1:
                    continue
                prev = G[i][r - 1]
                if prev == INF:
                    continue
                c = recv[i][j - 1] if i > 0 else 0.0
                cand = (max(prev[0], c), max(prev[1], fl))
                if cand < G[j][r]:
                    G[j][r] = cand
                    arg[j][r] = i
    if G[k][L] == INF:
        return None
    out = []
    j, r = k, L
    while r > 0:
        i = arg[j][r]
        out.append((i, j - 1))
        j, r = i, r - 1
    return out[::-1]


def _signature(graph: OpGraph, layer: Layer, nodes: list[OpNode]) -> str:
    """Identical layers (same ops, shapes, parameter shapes, local wiring) share a signature."""
    h = hashlib.sha256()
    local = {n: i for i, n in enumerate(layer.nodes)}
    for n in nodes:
        h.update(n.target.encode())
        h.update(repr([str(o.shape) for o in n.outputs]).encode())
        h.update(repr([graph.params[p].shape if p in graph.params else None for p in n.params]).encode())
        h.update(repr([local.get(i, -1) for i in n.inputs]).encode())
        h.update(repr(_scalar_args(n.args)).encode())
        h.update(b"B" if n.name in layer.block_nodes else b"O")
    return h.hexdigest()[:16]


def _scalar_args(a):
    if isinstance(a, (list, tuple)):
        return [_scalar_args(x) for x in a]
    if isinstance(a, (int, float, str, bool)) or a is None:
        return a
    return type(a).__name__
