"""Context parallelism (a "cp" mesh axis): every sample's sequence split over cp ranks, costed.

Each cp rank holds two chunks of every sequence, i and 2 cp - 1 - i (Llama 3's load balance,
Dubey et al. 2024 section 3.3.2): a causal attention's work is then equal on every rank. Every op
but the attention core is token-local, so a layer's cost on a cp rank is its cost at the same
micro-batch with every token-proportional term divided by cp: compute (the attention's too,
balanced: 1/cp of its score blocks), its tp collectives, saved activations, the tensors crossing
a pipeline boundary. Its parameters are whole on every cp rank; their gradients are synced over
dp and cp together (the search passes dp x cp as the sync group).

The attention exchanges keys and values as Llama 3 did (all-gather based, not a ring): before
each fused attention op the rank all-gathers the op's K and V over the cp axis, and in the
backward reduce-scatters their gradients; a recomputed attention gathers again. The all-gather
must finish before the kernel reads K and V, so the exchange is costed exposed (no overlap with
the attention compute: a ring exchange would overlap, the all-gather cannot). The gathered K and
V are what the attention saves for its backward: (1 - 1/cp) of the full-length K and V above
the layer's share, per layer whose core is saved; a recomputed core holds them during its
backward only.

A causal attention runs as two kernel calls per rank (`runtime.context_parallel`: query chunk i
against keys [0, (i + 1) c), chunk 2 cp - 1 - i against [0, (2 cp - i) c), each causal aligned
to the bottom right; no mask tensor on the fused CUDA kernels, and none was ever charged here):
their work is the causal-trimmed work, c^2 (i + 1/2) + c^2 (2 cp - i - 1/2) = 2 cp c^2 score
entries, 1/cp of the whole causal attention's on every rank, as the 1/cp of the kernel's time
charges it (the time model prices the whole attention at the measured causal kernel's rate).
Their saved outputs and log-sum-exps are the rank's share of one call's (in `act_bytes` over
cp); what the two calls add (`causal_bytes`, `layer_cost`): the rank's output concatenated from
the two (a copy the output projection saves, where one kernel's output was read in place), K and
V copied into sequence order in the forward (the gathered copy freed once the ordered one is
made: one K or V above the saved ones for a moment) and, in the backward, the two calls' key
and value gradients (S + S/2cp tokens each, where one call's were S) written back in rank order
into one full-length buffer before the reduce-scatter (one more full-length K or V gradient at
the worst moment), and those copies' memory time.

A loss that averages over tokens (cross-entropy / NLL, mean reduction, class-index targets, no
class weights) is made the mean over the cp group's tokens by the runtime: one all-reduce of the
rank's count of counted tokens over the cp axis per loss call and micro-batch (`collectives`;
its latency in the layer's forward communication, `layer_cost`).

Which sequences it applies to: models whose attention cores are torch's fused attention op
(`scaled_dot_product_attention`, causal or without a mask, or with a mask computed from the
positions alone that is the causal one), with the sequence dividing by 2 cp, that take their
positions from `models.positions.token_positions` or make them as an `arange` that follows the
sequence length, found at capture by two traces (`capture.own_positions`; the runtime then
runs the model's traced program with that `arange` made the rank's positions) (`blockers`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import fields, replace
from typing import Optional

from autopar.capture.graph import OpGraph, OpNode, Ref
from autopar.inter_op.layers import Layer
from autopar.inter_op.stage_cost import LayerCost, axis_link, coll_time, float_bytes
from autopar.schema.cluster import ClusterSpec
from cost_models.compute import memory_time

ATTENTION_OP = "scaled_dot_product_attention"
# the search tries cp > 1 unprompted only from this sequence length on (or where no plan fits
# without it): below it the exchange and the smaller kernels cost more than the memory saves,
# and the search time stays that of a search without context parallelism
LONG_SEQUENCE = 16384
# the policies whose backward holds the attention core's saved inputs from the forward; the
# others re-run the core (and its gather) inside the backward
_CORE_SAVED = ("none", "norm_act")

# the token-proportional fields of a `LayerCost` (floats, or dicts / lists of floats by policy)
_SCALED = ("fwd_s", "bwd_s", "fwd_comm_s", "bwd_comm_s", "rc_extra_s", "rc_comm_s", "act_bytes", "bwd_over",
           "bwd_over_grads", "bwd_over_loss", "bwd_over_body", "bwd_over_given", "bwd_over_given_grads",
           "bwd_given_backward", "bwd_first",
           "bwd_first_born", "bwd_acc", "bwd_acc_born",
           "out_saved", "in_saved", "kept_saved", "out_bytes", "cross_bytes", "cross_grad_bytes")


def attention_nodes(graph: OpGraph, layer: Layer) -> list:
    """The layer's fused attention ops."""
    return [n for n in (graph.node(x) for x in layer.nodes) if n.kind == "call" and n.op == ATTENTION_OP]


def sequence_length(graph: OpGraph) -> Optional[int]:
    """The length of the sequences the model's attention runs over (the query's dim -2 of its
    first fused attention op); None without one."""
    for n in graph.calls:
        if n.op == ATTENTION_OP:
            s = graph.node(n.inputs[0]).outputs[0].shape[-2]
            return s if isinstance(s, int) else None
    return None


def blockers(graph: OpGraph, layers: list[Layer]) -> str:
    """Why context parallelism cannot split this model's sequences ("" where it can): an
    attention other than the fused op (its score matmuls would need the gathered keys in
    another form), an explicit mask (its columns follow the sequence), dropout in it, or none;
    a first input that is not the attention's sequence of token ids (what the runtime splits)."""
    s = sequence_length(graph)
    if s is None:
        return "the model has no fused attention op (scaled_dot_product_attention) over a static sequence"
    # the runtime splits the inputs whose dim 1 is the plan's tokens per sample (dim 1 of the
    # first input where it is a (batch, sequence, ...) tensor of ids, else 1:
    # `planner._tokens_per_sample`, `runtime.context_parallel.ContextParallel`): they must be the
    # attention's sequence, or a cp plan is one the runtime refuses (float features: "1 token")
    first = next((n.outputs[0] for n in graph.nodes if n.kind == "input" and n.outputs), None)
    if first is None or first.dtype.startswith(("float", "bfloat")) or len(first.shape) < 2 or first.shape[1] != s:
        return (f"the model's first input is not a (batch, sequence) tensor of token ids of the attention's {s} "
                f"tokens, the sequence the runtime splits over the cp ranks")
    if any(_softmax_over(graph, n, s) for n in graph.calls):
        return "the model's attention is not one fused attention op (a softmax over the sequence was captured)"
    # a model that makes its own positions: its masks were found to be the causal one of them
    # (`capture.own_positions`), which the runtime runs as causal attention
    own = graph.reads_positions is False and graph.own_positions == ""
    for lay in layers:
        for n in attention_nodes(graph, lay):
            if (len(n.args) > 3 and isinstance(n.args[3], Ref) or n.kwargs.get("attn_mask") is not None) and not own:
                return f"{n.name} takes an explicit attention mask"
            if len(n.args) > 4 and n.args[4] or n.kwargs.get("dropout_p"):
                return f"{n.name} applies dropout to its attention weights"
    if graph.reads_positions is False and graph.own_positions:
        return ("the model does not take its token positions from autopar.models.positions.token_positions "
                f"and its own cannot be set for a rank's chunks: {graph.own_positions}")
    if graph.reads_positions is False and graph.own_positions is None:
        return ("the model does not take its token positions from autopar.models.positions.token_positions "
                "(it makes its own, or has none), so under cp every rank's chunks would be encoded at the "
                "sequence's start; make its forward read them (Hugging Face models: autopar's hf: references "
                "pass them as position_ids)")
    mixers = token_mixers(graph)
    if mixers:
        n = mixers[0]
        where = f" in {n.module_path}" if n.module_path else ""
        more = f" (and {len(mixers) - 1} more)" if len(mixers) > 1 else ""
        return (f"{n.name} ({n.op}{where}) mixes tokens along the sequence{more}, which a rank's chunks of "
                f"it would compute wrong (a cumulative sum, pooling or convolution over tokens, or a shift "
                f"of the targets inside the model: shift them in the data instead)")
    return ""


# views that may merge the sequence dim with its neighbours ((b, s, h) -> (b * s, h)) or split
# off others: every row of a merged dim is still one token, so they are token-local as they are
_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "flatten", "unflatten", "view_as", "reshape_as",
                    "_reshape_alias", "squeeze", "unsqueeze"})


def _softmax_over(graph: OpGraph, n: OpNode, s: int) -> bool:
    """Whether `n` is a softmax along a dim of the sequence's length `s` (attention's scores,
    written out); a router's softmax over experts is token-local and runs on a rank's chunks."""
    if n.op not in ("softmax", "_softmax") or not n.inputs:
        return False
    shape = graph.node(n.inputs[0]).outputs[0].shape
    dim = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else n.kwargs.get("dim", -1)
    if not isinstance(dim, int) or not shape:
        return True          # cannot tell: refuse as before
    return shape[dim] == s


def token_mixers(graph: OpGraph) -> list[OpNode]:
    """The ops other than the fused attention that would be wrong on a rank's chunks of the
    sequence: an op reading a tensor whose dims carry tokens (followed from the model's token-id
    inputs, as `intra_op.dims.token_dims_of` does, and through views that merge the sequence
    with other dims) and none of whose own sharding rules (`intra_op.rules`, on a 2-way probe
    mesh) runs it on a slice of those tokens, every token input split along a token dim, every
    output split and nothing exchanged: a cumulative sum or a convolution along the sequence,
    pooling over tokens (its sum partial), a shift of the targets inside the model (a pad or a
    slice along the sequence), token mixing by a matmul over the sequence. A reduction to a
    scalar (the loss: a mean over the rank's tokens, averaged over dp x cp as over dp; a token-
    mean cross-entropy made the cp group's mean by the runtime) is not one. Computed once per
    graph."""
    memo = getattr(graph, "_cp_token_mixers", None)
    if memo is not None:
        return memo
    import warnings

    from autopar.capture.experts import find_expert_blocks
    from autopar.capture.graph import concrete
    from autopar.intra_op import rules as rules_mod
    from autopar.intra_op.dims import _norm, batch_dims_of, token_ops
    from autopar.intra_op.placement import PARTIAL, shard_dim
    from autopar.intra_op.rules.view import view_groups
    from autopar.intra_op.strategy import OpContext

    batch = batch_dims_of(graph)
    b = graph.batch_size or 2
    shifted = input_shifts(graph) if graph.reads_positions is False and graph.own_positions == "" else set()
    tok: dict[tuple[str, int], set[int]] = {}
    out: list[OpNode] = []
    experts = tuple(x.module for x in find_expert_blocks(graph))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n, outs, keys, in_metas in token_ops(graph, batch, b, tok):
            live = [(k, tok[key]) for k, key in enumerate(keys) if key in tok]
            if n.name in shifted:
                # a shift of a model input the runtime does on the whole sequence instead
                # (`capture.own_positions`): its slice is the input's tokens
                for o, meta in enumerate(outs):
                    if len(meta.shape) >= 2:
                        tok[(n.name, o)] = {len(meta.shape) - 1}
                continue
            if n.op == "index" and live and all(k == 0 for k, _ in live) and _index_after(n, live[0][1]):
                # indices along later dims only (Falcon's multi-query split of its fused qkv by
                # index lists): each token's row indexed alike, its dims kept in place
                tok[(n.name, 0)] = set(live[0][1])
                continue
            if n.op == ATTENTION_OP:
                # the runtime's cp attention: its output's tokens are the query's
                tok[(n.name, 0)] = set(tok.get(keys[0], ()))
                continue
            if experts and any(n.module_path == m or n.module_path.startswith(m + ".") for m in experts):
                # a dropless expert block sorts the rank's token-expert pairs by expert and back:
                # its rows are tokens' (each one token's), whatever order they pass in, and what
                # it returns is each token's own result, so the block runs on a rank's chunks
                # as on the whole sequence (a capacity factor, which drops tokens by their
                # order in the batch, would not)
                for o, meta in enumerate(outs):
                    if meta.shape and not isinstance(meta.shape[0], int):
                        tok[(n.name, o)] = {0}
                continue
            if n.op in _VIEWS and len(in_metas) >= 1 and live[0][0] == 0:
                got = set()
                for gi, gj in view_groups(tuple(in_metas[0].shape), tuple(outs[0].shape)):
                    if set(gi) & live[0][1]:
                        got |= {d for d in gj if outs[0].shape[d] != 1} or set(gj)
                if got:
                    tok[(n.name, 0)] = got
                continue
            node = replace(n, outputs=outs, args=concrete(n.args, b), kwargs=concrete(n.kwargs, b))
            try:
                sts, family = rules_mod.strategies(OpContext(node, in_metas, (2,), graph, 4, True))
            except Exception:  # noqa: BLE001 - no rule understands it: it may mix tokens
                sts, family = [], "fallback"
            local = False
            for st in sts if family != "fallback" else []:
                if st.comms or any(sp and sp[0] == PARTIAL for sp in st.out_specs):
                    continue
                if not all(k < len(st.in_specs) and st.in_specs[k] and shard_dim(st.in_specs[k][0]) is not None
                           and _norm(shard_dim(st.in_specs[k][0]), in_metas[k]) in dims for k, dims in live):
                    continue
                split = [(o, shard_dim(sp[0]) if sp else None) for o, sp in enumerate(st.out_specs)]
                if any(d is None and o < len(outs) and outs[o].shape for o, d in split):
                    continue
                local = True
                for o, d in split:
                    if d is not None and o < len(outs):
                        tok.setdefault((n.name, o), set()).add(_norm(d, outs[o]))
            if not local and not all(len(o.shape) == 0 for o in outs):
                out.append(n)
    graph._cp_token_mixers = out
    return out


def _index_after(n: OpNode, dims: set[int]) -> bool:
    """Whether `aten.index` node `n` indexes its input along dims after every one of `dims`
    only (None in their places), so those dims stay where they are in its output."""
    idx = n.args[1] if len(n.args) > 1 else n.kwargs.get("indices")
    if not isinstance(idx, (list, tuple)) or not dims or min(dims) < 0:
        return False
    return all(i >= len(idx) or idx[i] is None for i in range(max(dims) + 1))


def input_shifts(graph: OpGraph) -> set[str]:
    """The ops of the model's shifts of its inputs along the sequence (`pad(x, [0, k])` read
    through `[..., k:]`: Hugging Face's loss shifting its labels), which the runtime takes out
    of a model that makes its own positions and does on the whole sequence before the split
    (`capture.own_positions`, `runtime.context_parallel.ContextParallel.split_input`)."""
    inputs = {n.name for n in graph.nodes if n.kind == "input"}
    out: set[str] = set()
    for n in graph.calls:
        if n.op not in ("pad", "constant_pad_nd") or not n.inputs or n.inputs[0] not in inputs:
            continue
        pad = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad")
        if not isinstance(pad, (list, tuple)) or len(pad) != 2 or pad[0] != 0 or not isinstance(pad[1], int):
            continue
        users = [u for u in graph.calls if n.name in u.inputs]
        if users and all(u.op == "slice" and len(u.args) > 2 and u.args[2] == pad[1] for u in users):
            out |= {n.name, *(u.name for u in users)}
    return out


def degrees(graph: OpGraph, layers: list[Layer], devices: int, pinned: Optional[int]) -> tuple[list[int], str]:
    """The cp degrees > 1 the search may try (powers of two dividing the device count whose
    2 cp chunks divide the sequence), and why none where the model admits none. `pinned`:
    `Constraints.cp`."""
    why = blockers(graph, layers)
    if why:
        return [], why
    s = sequence_length(graph) or 0
    out = [c for c in (2 ** i for i in range(1, 12)) if c <= devices and devices % c == 0 and s % (2 * c) == 0]
    if pinned is not None:
        out = [c for c in out if c == pinned]
        if not out:
            return [], (f"pick a power of two dividing the {devices} devices whose 2 x cp chunks divide the "
                        f"sequence of {s} tokens")
    return out, ""


def kv_bytes(graph: OpGraph, layer: Layer, mb: int, dtype: str) -> float:
    """Bytes of the keys and values of the layer's attention ops at micro-batch `mb`, whole
    sequence, all heads."""
    total = 0.0
    for n in attention_nodes(graph, layer):
        for name in n.inputs[1:3]:
            o = graph.node(name).outputs[0]
            total += float_bytes(o.at(mb) if graph.batch_size is None else o, dtype)
    return total


def kept_kv_bytes(graph: OpGraph, layer: Layer, mb: int, dtype: str) -> float:
    """Bytes (whole sequence, all heads) of the layer's attention K and V whose storage the
    query's keeps alive: under cp the attention saves the gathered K and V, new tensors, and the
    rank's own K and V are freed unless they are views of a tensor something else saves, as a
    fused qkv projection's output is (the query, a view of it, is saved by the attention). Then
    the rank's share of them stays beside the gathered copies."""
    from cost_models.memory import tensor_bases

    nodes = [graph.node(x) for x in layer.nodes]
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        for i in n.inputs:
            if i not in by_name:
                by_name[i] = graph.node(i)
    base = tensor_bases(nodes, by_name)
    total = 0.0
    for n in attention_nodes(graph, layer):
        q = base.get(n.inputs[0], n.inputs[0])
        for name in n.inputs[1:3]:
            if base.get(name, name) == q:
                o = graph.node(name).outputs[0]
                total += float_bytes(o.at(mb) if graph.batch_size is None else o, dtype)
    return total


def is_causal(node) -> bool:
    """Whether a captured fused attention op is causal (its `is_causal`)."""
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))


def causal_bytes(graph: OpGraph, layer: Layer, mb: int, dtype: str) -> tuple[float, float]:
    """(K and V bytes, output bytes) of the layer's causal attention ops at micro-batch `mb`,
    whole sequence, all heads: what the runtime's two calls per rank copy (K and V into sequence
    order; the two outputs into one)."""
    kv = out = 0.0
    for n in attention_nodes(graph, layer):
        if not is_causal(n):
            continue
        for name in n.inputs[1:3]:
            o = graph.node(name).outputs[0]
            kv += float_bytes(o.at(mb) if graph.batch_size is None else o, dtype)
        o = n.outputs[0]
        out += float_bytes(o.at(mb) if graph.batch_size is None else o, dtype)
    return kv, out


# the captured losses the runtime averages over the cp group's tokens (`F.cross_entropy`,
# `F.nll_loss` as torch.export records them): (self, target, weight, reduction, ignore_index, ...)
_TOKEN_MEAN_LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward"})


def token_mean_losses(graph: OpGraph, layer: Layer) -> int:
    """The layer's losses that average over tokens (mean reduction, class-index targets, no
    class weights): the runtime all-reduces each one's token count over the cp group."""
    count = 0
    for n in (graph.node(x) for x in layer.nodes):
        if n.kind != "call" or n.op not in _TOKEN_MEAN_LOSSES or len(n.inputs) < 2:
            continue
        weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        reduction = n.args[3] if len(n.args) > 3 else n.kwargs.get("reduction", 1)
        target = graph.node(n.inputs[1]).outputs[0]
        if weight is None and reduction == 1 and not target.dtype.startswith(("float", "bfloat")):
            count += 1
    return count


def layer_cost(cost: LayerCost, cp: int, kv: float, tp: int, cluster: ClusterSpec,
               causal: tuple[float, float] = (0.0, 0.0), losses: int = 0, kept: float = 0.0) -> LayerCost:
    """`cost` (one layer, one micro-batch, one tp degree, per device) on one of cp ranks: its
    token-proportional terms over cp, plus the attention's K/V exchange over the cp axis (ranks
    tp apart) and the gathered K/V it holds. `kv`: the layer's attention K and V bytes at the
    micro-batch, whole (`kv_bytes`), of which a rank holds 1/tp (the heads split); `causal`:
    its causal attention ops' (`causal_bytes`), run as two calls (the module docstring);
    `losses`: its token-mean losses (`token_mean_losses`), each one all-reduce of a count over
    the cp axis; `kept`: its K and V bytes (whole) whose storage the query's keeps alive
    (`kept_kv_bytes`): the rank's share of them stays beside the gathered ones it saves. Its
    counted collectives stay the tp axis's; the plan adds the exchange's and
    the counts' (`collectives`)."""
    def scale(v):
        if isinstance(v, dict):
            return {k: scale(x) for k, x in v.items()}
        if isinstance(v, list):
            return [scale(x) for x in v]
        return v / cp if isinstance(v, float | int) and not isinstance(v, bool) else v

    out = replace(cost, **{f: scale(getattr(cost, f)) for f in _SCALED})
    link = axis_link(cluster, cp, stride=tp)
    out.fwd_comm_s += losses * coll_time("all_reduce", 8.0, cp, link)
    if kv <= 0:
        return out
    dev = kv / tp
    # K and V: one all-gather each in the forward (and a recomputation), one reduce-scatter of
    # their gradients each in the backward
    gather = 2 * coll_time("all_gather", dev / 2, cp, link)
    scatter = 2 * coll_time("reduce_scatter", dev / 2, cp, link)
    out.fwd_comm_s += gather
    out.bwd_comm_s += scatter
    extra = dev * (1 - 1 / cp)
    # causal: K and V copied into sequence order and the rank's output concatenated from the two
    # calls' (read and written) in the forward (again where the core is recomputed); in the
    # backward the two calls' key gradients (S + S/2cp tokens) read and written back in rank
    # order (S)
    ckv, cout = causal[0] / tp, causal[1] / tp / cp
    copy_fwd = memory_time(2 * ckv + 2 * cout, cluster.device) if ckv else 0.0
    out.fwd_s += copy_fwd
    out.bwd_s += memory_time((2 + 1 / (2 * cp)) * ckv, cluster.device) if ckv else 0.0
    for r in list(out.act_bytes):
        if r in _CORE_SAVED:
            # the concatenated output the output projection saves, beside the calls' own
            out.act_bytes[r] = out.act_bytes[r] + extra + cout + kept / tp / cp
        else:
            out.rc_extra_s[r] = out.rc_extra_s.get(r, 0.0) + gather + copy_fwd
            out.rc_comm_s[r] = out.rc_comm_s.get(r, 0.0) + gather
    # parameter gradients are whole on every cp rank: the first backward's moments keep theirs
    for r, ms in cost.bwd_first.items():
        out.bwd_first[r] = [[m[0] / cp, m[1] / cp, *m[2:]] for m in ms]
    out.bwd_first_born = cost.bwd_first_born
    for r, ms in cost.bwd_acc.items():
        out.bwd_acc[r] = [[m[0] / cp, m[1] / cp, *m[2:]] for m in ms]
    out.bwd_acc_born = cost.bwd_acc_born
    # what the attention saves above its share (the gathered K and V, the rank's own where the
    # query's storage keeps them, the concatenated output), and what its backward holds above
    # its share besides (the full-length gradients of K and V before their reduce-scatter and,
    # causal, the two calls' gradients of K and V, S/2cp tokens more than one call's, beside
    # the rank-order gradient of one of them; in the forward likewise one gathered K or V
    # beside its ordered copy)
    saves = extra + cout + kept / tp / cp
    grads = extra + (ckv / 2 + ckv / (2 * cp) if ckv else 0.0)
    for r, regions in cost.rc_attention.items():
        if r in _CORE_SAVED or r not in out.bwd_over:
            continue
        _recomputed_attention(out, r, regions, cp, saves, grads)
    for r, mo in cost.attention_moments.items():
        if r in _CORE_SAVED and r in out.bwd_over:
            _saved_attention(out, r, mo, cp, saves, grads, ckv / 2, cout)
    for r in list(out.bwd_over):
        if r in cost.rc_attention if r not in _CORE_SAVED else r in cost.attention_moments:
            continue
        held = (extra if r in _CORE_SAVED else 2 * extra) + (ckv / 2 + ckv / (2 * cp) if ckv else 0.0)
        if not out.bwd_over_rc.get(r, False):
            # the moment may now be another one: its split into gradients and freed
            # activations is not known (the whole transient counts as gradients)
            out.bwd_over_grads.pop(r, None)
        if r in out.bwd_over_given:
            out.bwd_over_given[r] += held
        if r in out.bwd_given_backward:
            out.bwd_given_backward[r] += held
        if r in out.bwd_over_body:
            # the worst moment: the body's, now larger, or the loss's, as it was
            out.bwd_over_body[r] += held
            out.bwd_over[r] = max(out.bwd_over[r], out.bwd_over_body[r])
        else:
            out.bwd_over[r] += held
    return out


def _saved_attention(out: LayerCost, r: str, mo: dict, cp: int, saves: float, grads: float, copy: float,
                     cout: float) -> None:
    """Under a policy that keeps the attention core's saved tensors (`out`: the layer's cost on
    one cp rank, its token-proportional fields already over cp), its backward's moments
    (`LayerCost.attention_moments`) with the attention's cp tensors where they are alive: the
    full-length K and V gradients (`grads`) at its backward; its saves above its share
    (`saves`, in `act_bytes`) freed after it; nothing before it (the block's later ops: the MLP's
    backward, where the saves are counted in `act_bytes` already). The forward's moments
    likewise by where they fall (`copy`: one gathered K or V, causal, beside its ordered copy
    at the attention; `cout`: the concatenated output, made after it)."""
    add = {"post": (0.0, 0.0), "at": (grads, grads), "pre": (-saves, 0.0), "loss": (0.0, 0.0)}
    plain = [(k, v[0] / cp + add[k][0], v[1] / cp + add[k][1], v[2] / cp + add[k][0], v[3] / cp + add[k][1])
             for k, v in mo.items() if k in add]
    if not plain:
        return
    # the forward: before the attention its saves above its share are not yet made (they are
    # counted in `act_bytes`); at it one gathered K or V beside its ordered copy (causal: `copy`),
    # the concatenated output not yet made; after it as without cp; none below 0
    fa = {"forward_pre": -saves, "forward_at": copy - cout, "forward_post": 0.0}
    fw = [(v[0] / cp + fa[k], v[1] / cp + fa[k]) for k, v in mo.items() if k in fa]
    fwd, fwd_given = (max([0.0] + [f[i] for f in fw]) for i in (0, 1))
    body = [p for p in plain if p[0] != "loss"]
    if r in out.bwd_over_body:
        out.bwd_over_body[r] = max([p[1] for p in body] + [fwd])
    _, val, g, *_ = max(plain, key=lambda p: p[1])
    if fwd > val:
        out.bwd_over[r], out.bwd_over_rc[r], out.bwd_over_grads[r] = fwd, True, 0.0
    else:
        out.bwd_over[r], out.bwd_over_rc[r], out.bwd_over_grads[r] = val, False, g
    *_, gv, gg = max(plain, key=lambda p: p[3])
    if r in out.bwd_given_backward:
        out.bwd_given_backward[r] = gv
    if r in out.bwd_over_given:
        if fwd_given > gv:
            out.bwd_over_given[r], out.bwd_over_given_rc[r], out.bwd_over_given_grads[r] = fwd_given, True, 0.0
        else:
            out.bwd_over_given[r], out.bwd_over_given_rc[r], out.bwd_over_given_grads[r] = gv, False, gg


def _recomputed_attention(out: LayerCost, r: str, regions: list, cp: int, saves: float, grads: float) -> None:
    """Under a policy that re-runs the attention core (`out`: the layer's cost on one cp rank,
    its token-proportional fields already over cp), the recomputed regions' moments
    (`LayerCost.rc_attention`) with the attention's cp tensors where they are alive: its saves
    above its share (`saves`: the re-gathered K and V, the concatenated output) at every moment
    before its backward (the block's later ops' backward: the worst moment of a recomputed
    transformer block, in its MLP), and at its backward those and the full-length K and V
    gradients (`grads`); none after it. Each moment stays where it was if larger (the forward's,
    the loss's), else the region's takes its place, in the worst moment, the body's, the given
    one's and the first backward's at the region's position."""
    for reg in regions:
        kinds = []
        for k, add_acts, add_grads in (("pre", 0.0, 0.0), ("at", saves, grads), ("post", saves, 0.0)):
            if k in reg:
                m, g, given = reg[k]
                kinds.append((m / cp + add_acts + add_grads, g / cp + add_grads, given / cp))
        if not kinds:
            continue
        val, g, given = max(kinds)
        if val > out.bwd_over[r]:
            out.bwd_over[r], out.bwd_over_rc[r], out.bwd_over_grads[r] = val, True, g
        if r in out.bwd_over_body:
            out.bwd_over_body[r] = max(out.bwd_over_body[r], val)
        gv = max(v - gi for v, _, gi in kinds)
        gk = max(kinds, key=lambda x: x[0] - x[2])
        if r in out.bwd_over_given and gv > out.bwd_over_given[r]:
            out.bwd_over_given[r], out.bwd_over_given_rc[r] = gv, True
            out.bwd_over_given_grads[r] = gk[1] - gk[2]
        if r in out.bwd_given_backward:
            out.bwd_given_backward[r] = max(out.bwd_given_backward[r], gv)
        ats, ms = out.bwd_first_at.get(r), out.bwd_first.get(r)
        if ats and ms and reg["position"] in ats:
            i = ats.index(reg["position"])
            cand = [val - g, g, reg["param_grads"]]
            if sum(cand) > sum(ms[i][:3]):
                out.bwd_first[r] = [*ms[:i], cand + list(ms[i][3:]), *ms[i + 1:]]
        ats, ms = out.bwd_acc_at.get(r), out.bwd_acc.get(r)
        if ats and ms and reg["position"] in ats:
            i = ats.index(reg["position"])
            if val > ms[i][0] + ms[i][1]:
                out.bwd_acc[r] = [*ms[:i], [val - g, g, reg["param_grads"]] + list(ms[i][3:]), *ms[i + 1:]]


def collectives(graph: OpGraph, layers: list[Layer], k: int, j: int, recompute: str) -> Counter:
    """The cp collectives of layers [k, j) per micro-batch, as the runtime issues them: per
    attention op, K and V all-gathered in the forward (again where `recompute` re-runs the
    core) and their gradients reduce-scattered in the backward; per token-mean loss, its count
    all-reduced (`token_mean_losses`)."""
    out: Counter = Counter()
    for lay in layers[k:j]:
        n = len(attention_nodes(graph, lay))
        gathers = 2 if recompute in _CORE_SAVED else 4
        out.update({"all_gather": gathers * n, "reduce_scatter": 2 * n, "all_reduce": token_mean_losses(graph, lay)})
    return +out


def _check_fields() -> None:
    names = {f.name for f in fields(LayerCost)}
    missing = [f for f in _SCALED if f not in names]
    assert not missing, f"context_parallel._SCALED names fields LayerCost lacks: {missing}"


_check_fields()


def unexecuted_parts(ep: int, tp: int = 1, pp: int = 1, own_positions: bool = False) -> list[str]:
    """What of a context-parallel layout `autopar run` (`runtime.context_parallel`) does not
    execute with it (empty where it runs; here, not there, so that the planner asks without
    importing the runtime and torch's attention modules): it runs it on one stage (tensor
    parallelism op by op as solved, `runtime.context_parallel.ProgramContext`; any ZeRO stage
    over dp x cp, any recomputation) and in pipeline stages (the traced chunks, `graph_stages`,
    their positions read when they run: with dp and with tp, under every recomputation policy),
    and with expert parallelism (the ep groups are consecutive ranks of the stage's dp x cp
    ranks, `runtime.experts.expert_meshes`): without tp in one stage or in pipeline stages (a
    traced chunk's experts run as the model's code, `runtime.experts.eager_experts`), with tp
    in one stage, op by op as solved (`runtime.experts.check_executable` refuses DTensor's
    path, `planner._ep_executor` marks it); not yet with tp in pipeline stages.
    (pp2 x cp2 x tp2 was refused while it hung: the stage meshes flattened a size-1 dp
    axis with cp on the stage's own ranks only, `runtime.meshes.StageMesh.flattens`.)
    `own_positions`: the model makes its own positions (`capture.own_positions`), run in one
    stage without tp as its traced program, whose experts are not sharded there yet."""
    out = ["expert parallelism with tensor parallelism in pipeline stages"] if ep > 1 and tp > 1 and pp > 1 else []
    if own_positions and ep > 1 and tp == 1 and pp == 1:
        out.append("expert parallelism in one stage without tp for a model that makes its own positions")
    return out
