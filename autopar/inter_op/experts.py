"""Expert parallelism in the plan search: which ep degrees to try, and a layer's cost with its
routed experts sharded over ep data-parallel ranks.

The layer costs the providers give (`stage_cost.LayerCost`, analytic or ILP) run every expert
on every rank (the captured one-process program: each rank's T x k token-expert pairs through all
E experts). With ep > 1 (`ep_layer_costs`), per expert block and micro-batch:

* weights: the block's stacked expert weights divided by ep (their gradients and optimizer
  state with them; `Search` averages their gradients over the dp / ep ranks that hold the same
  experts, not over dp);
* exchange, dropless (no capacity, no dropped token, as the one-process run): the dispatch sends
  each rank's T x k pairs (T the micro-batch's tokens, k the top-k) of width H to the ranks
  holding their experts, the combine returns as many: 2 all-to-alls forward, 2 backward, plus
  one small all-to-all of the per-expert counts (the split sizes, data dependent) in the
  forward; each costed over the ep group (consecutive dp ranks, `tp` apart) by
  `cost_models.communication.axis_collective_time` on `imbalance` x the mean bytes;
* expert GEMMs: E / ep groups of `imbalance` x T x k x ep / E rows each, on the profile's GEMM
  curve (`cost_models.compute.grouped_gemm_time`), in place of E groups of T x k / E rows.

With expert tensor parallelism (`etp` = tp, Megatron-Core's ETP; `etp` 1: the experts
replicated over tp, as the tp layer costs have them, the grouped GEMMs having no tp rule), each
rank holds 1/etp of every expert it holds (the input projections' output columns, the output
projection's input rows, `capture.experts.tp_split`) and runs every pair it receives through it:

* weights (their gradients and optimizer state with them) divided by ep x etp;
* expert GEMMs: 1/etp of the FLOPs; the up projections' outputs and the down projection's
  inputs 1/etp of the bytes, their other activation operand whole (the received rows are
  replicated over tp: each tp rank exchanges the same rows over its own ep group);
* the collective ETP adds: the experts' output (the received rows, width H) all-reduced over
  the tp group in the forward (the down projection is row-parallel: partial sums), and the
  gradient of their input the same in the backward (the column-parallel input projections'
  partial input gradients), each `imbalance` x T x k x H elements, costed on the tp group's
  links (`axis_collective_time` over ranks 0..tp-1, tp the innermost axis); once more in the
  forward under full recomputation.

* activations: what the block's ops save for the backward from the input projections' outputs
  to the output projection's input (the gate/up products, the activation, their product:
  `split_saved`) 1/etp of it.

Folded (`fold`, Megatron-Core's MoE parallel folding, arXiv 2504.14960; with tp > 1 and the
experts not split over tp): the expert mesh (expert_dp, ep) lies over the stage's dp x tp ranks,
ep consecutive ranks (tp innermost) sharing one copy of every expert, so ep may exceed dp. Each tp
rank takes 1/tp of the block's tokens (the dense layers hold them replicated over tp):

* weights (their gradients and optimizer state with them) divided by ep, copies dp x tp / ep
  (`Search` syncs them over those ranks, ep apart);
* exchange: each rank's T x k / tp pairs, over ep consecutive ranks of the stage;
* expert GEMMs: E / ep groups of `imbalance` x T x k / tp x ep / E rows each;
* the collectives folding adds: the block's output (T x H) all-gathered over the tp group in the
  forward, the gradients of its inputs (the hidden states and the top-k weights, T x (H + k))
  all-gathered in the backward (`FOLD_FORWARD`, `FOLD_BACKWARD`; once more in the forward under
  full recomputation);
* activations: what the block's ops save for the backward (`block_saved`) 1/tp of it, the
  exchange's combine (`combine_saved`) on the rank's 1/tp of the pairs.

* the experts module's other ops (the sort into expert order, the gathers, the activation,
  the weighting and the sum back: `_fold_ops_delta`) on 1/tp of the tokens too, as the runtime
  runs them (`runtime.experts.ExpertParallelExperts._folded` splits the module's inputs before
  any of them; Megatron-Core's folded MoE layer routes the sequence-parallel shard of the tokens
  each tp rank holds): their layer cost, priced replicated (the intra-op solve keeps the block's
  ops replicated over tp, `ilp_provider._expert_ops`), less what 1/tp of their work saves, each
  op priced as the layer's solve prices it (`intra_op.ilp.op_compute_time` on the layer's graph
  at the micro-batch, with the software's fusion). Hugging Face Qwen3-235B's eager routing is
  1.46 s of a micro-batch of 4 at tp 2 replicated (of 4.95 s compute), 0.73 s folded.

The software's token exchange and routing (`SoftwareSpec.expert_dispatch`, `expert_routing`)
change the exchange's bytes and the imbalance: under "ranks" (DeepEP) a rank sends each token
once to each rank holding any of its experts (`ranks_per_token`), T x r rows of width H instead
of T x k, and the combine returns as many; under "nodes" (DeepEP's internode kernels), with an
ep group over k > 1 nodes of g ranks each, the exchange is two stages that run at once
(`exchange_time`): the network carries each token once to each node holding any of its experts
(T x n rows, n = `nodes_per_token`, the experts of a node E / k consecutive ones), a rail's
all-to-all over the k nodes (each rank to the rank of its local index on the others), and
NVLink carries the T x r rows from the node's receiving ranks to the ranks holding the experts,
an all-to-all over the g ranks of a node; the slower of the two is the exchange's time (DeepEP
V1 csrc/kernels/internode.cu: `dispatch`'s RDMA-sender, forwarder and NVL-receiver warps of one
kernel, a token's copy written once per destination node, `is_token_in_rank`'s 8 ranks of a node
read as one word, `nvshmemi_ibgda_put_nbi_warp` only for another node; the combine reduces in
the node before the network). DeepEP's README checks it: internode EP32 on H800 with one CX7
400 Gb/s NIC a GPU, 4096 tokens, top-8 of 256 experts over 4 nodes, measured 58 GB/s dispatch
and 57 GB/s combine of "RDMA" bandwidth counted over a token's distinct nodes, its own node
included (tests/test_internode.py `num_rdma_token_sent`); a token reaches 3.61 nodes at random,
2.70 of them others, so the NIC carried 43-44 GB/s, 0.91 of the profile's 47.5 for the same NIC
(dgx-h100 inter_node): the rule prices DeepEP's network stage about 9% faster than it measured.
Under "fake_balanced" routing (NeMo AutoModel's
`FakeBalancedGate`: token t to experts (k t + j) mod E) every expert takes the same pairs
(imbalance 1) and r (and n) follow from the rule (`fake_ranks_per_token`); under the model's
router r (and n) is the mean for experts drawn at random (`random_ranks_per_token`), and so under
"forced_balance" (Megatron-Core's --moe-router-force-load-balancing: random logits), with imbalance 1.

`EP_IMBALANCE` is an estimate, not a measurement: the most-loaded rank of an ep group
receives 10% more pairs than the mean. Trained with a balance loss (the zoo MoE's, Mixtral's,
DeepSeek's), routers stay near uniform over a batch of thousands of tokens; Megatron-Core
and torchtitan do not publish one figure for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from typing import Any, Optional

import numpy as np

from autopar.capture.experts import ExpertBlock, find_expert_blocks, tp_width, weight_param
from autopar.capture.graph import OpGraph, TensorMeta
from autopar.inter_op.layers import Layer
from autopar.inter_op.stage_cost import LayerCost
from autopar.schema import ClusterSpec
from cost_models.communication import axis_collective_time, link_collective_time
from cost_models.compute import bytes_scale, grouped_gemm_time
from cost_models.memory import INDEX_SOURCE_WRITES, norm_act_regions, requires_grad, saved_tensors, tensor_bases

EP_IMBALANCE = 1.1        # an estimate (see the module docstring)
# the `SoftwareSpec.expert_dispatch` values that send a token once per rank holding its experts
DEDUPLICATED = frozenset({"ranks", "nodes"})
# all-to-alls per expert block and micro-batch, as `autopar.runtime.experts` issues them
A2A_FORWARD = 3           # the counts (split sizes), the dispatch, the combine
A2A_BACKWARD = 2          # the combine's and the dispatch's gradients
# expert tensor parallelism: all-reduces over tp per expert block and micro-batch
ETP_FORWARD = 1           # the experts' output (row-parallel down projection's partial sums)
ETP_BACKWARD = 1          # the gradient of the experts' input (column-parallel up projections')
# MoE parallel folding: all-gathers over tp per expert block and micro-batch
FOLD_FORWARD = 1          # the block's output, each tp rank's 1/tp of the tokens
FOLD_BACKWARD = 1         # the gradients of its inputs (hidden states and top-k weights, one buffer)


# DeepEP's recommended configs (deep_ep/buffer.py at 9fe9021, 2025-05: `Buffer.get_dispatch_config` /
# `get_combine_config`), by the group's ranks: (NVL chunked send tokens, NVL chunked recv tokens,
# RDMA chunked send tokens, RDMA chunked recv tokens), dispatch then combine; `Buffer.num_sms` 20
# (Megatron-LM's fused_a2a.py `get_buffer` at 1e057005 sets none: the default)
DEEPEP_CONFIGS: dict[int, tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = {
    2: ((16, 256, 6, 128), (6, 256, 6, 128)), 4: ((16, 256, 6, 128), (6, 256, 6, 128)),
    8: ((6, 256, 6, 128), (6, 256, 6, 128)), 16: ((16, 288, 20, 128), (2, 288, 28, 128)),
    24: ((8, 288, 32, 128), (1, 288, 20, 128)), 32: ((8, 288, 32, 128), (1, 288, 20, 128)),
    64: ((20, 288, 28, 128), (1, 288, 20, 128)), 128: ((20, 560, 32, 128), (1, 560, 12, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)), 160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}
DEEPEP_NUM_SMS = 20
NVSHMEM_GRANULE = 2 ** 29     # buffer.py: NVSHMEM_CUMEM_GRANULARITY, set before NVSHMEM starts (internode)


def deepep_buffer_bytes(num_ranks: int, hidden_bytes: int) -> float:
    """Device bytes one rank's DeepEP `Buffer` takes for a group of `num_ranks` (normal kernels,
    Megatron's `get_buffer`: the larger of the dispatch and combine configs' size hints), tokens
    of `hidden_bytes` each: the NVLink buffer (csrc/config.hpp `get_nvl_buffer_size_hint`, cudaMalloc
    outside torch's allocator) plus, across nodes (more than 8 ranks), the RDMA buffer
    (`get_rdma_buffer_size_hint`, NVSHMEM's symmetric heap) rounded up to NVSHMEM_CUMEM_GRANULARITY
    (an assumption: the heap mapped in those granules). 0 for a group size DeepEP has no config for
    (it refuses to run one)."""
    cfgs = DEEPEP_CONFIGS.get(num_ranks)
    if cfgs is None:
        return 0.0
    peers, topk, scales, meta = 8, 128, 128, 8        # NUM_MAX_NVL_PEERS, kNumMaxTopK, kNumMaxScales, SourceMeta
    channels = DEEPEP_NUM_SMS // 2
    rdma_ranks, nvl_ranks = max(num_ranks // peers, 1), min(num_ranks, peers)
    nvl = rdma = 0
    for _, nvl_recv, rdma_send, rdma_recv in cfgs:
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send          # Config: aligned to the send chunk
        n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        n += channels * nvl_ranks * nvl_recv * (hidden_bytes + meta + topk * 8 + topk * 4 + scales * 4)
        nvl = max(nvl, -(-n // 128) * 128)
        if num_ranks > peers:
            r = channels * rdma_ranks * (peers * 2 + 2) * 2 * 4
            r += channels * rdma_ranks * rdma_recv * (hidden_bytes + meta + topk * 8 + topk * 4 + scales * 4 + 16) * 2
            rdma = max(rdma, -(-r // 128) * 128)
    if rdma:
        rdma = -(-rdma // NVSHMEM_GRANULE) * NVSHMEM_GRANULE
    return float(nvl + rdma)


def random_ranks_per_token(num_experts: int, top_k: int, ep: int) -> float:
    """The mean number of the `ep` ranks (each holding E / ep experts) a token's `top_k` distinct
    experts fall on, the experts drawn at random: ep (1 - C(E - E/ep, k) / C(E, k))."""
    if ep <= 1:
        return 1.0
    per = num_experts // ep
    k = min(top_k, num_experts)
    return ep * (1.0 - math.comb(num_experts - per, k) / math.comb(num_experts, k))


def _block_nodes(g: OpGraph, b: ExpertBlock) -> tuple[dict[str, Any], list[Any]]:
    """(the graph's nodes by name, the call nodes inside `b`'s experts module)."""
    by_name = {n.name: n for n in g.nodes}
    inside = [n for n in g.nodes if n.kind == "call" and (
        (n.module_path or "") == b.module or (n.module_path or "").startswith(b.module + "."))]
    return by_name, inside


def _grad_saves(inside: list[Any], by_name: dict[str, Any], rg: dict[str, bool], base: dict[str, str]):
    """What the ops `inside` save for their backward as autograd records them (an op reading
    nothing that needs a gradient records nothing; a gather saves its index only when its source
    needs one): (the saved tensor's base name, the node making it or None, None) for a graph
    tensor, (None, None, bytes) for what an op keeps on the side (`saved_tensors`)."""
    for n in inside:
        if not any(rg.get(i, False) for i in n.inputs):
            continue
        if n.op in ("index", "index_select", "gather") and n.inputs and not rg.get(n.inputs[0], False):
            continue
        for name, nbytes in saved_tensors(n, by_name, rg=rg):
            if nbytes is not None:
                yield None, None, nbytes
                continue
            key = base.get(name, name)
            yield key, by_name.get(key), None


def fake_ranks_per_token(num_experts: int, top_k: int, ep: int) -> float:
    """The mean number of ranks a token reaches under NeMo AutoModel's `FakeBalancedGate`
    (nemo_automodel/components/moe/layers.py: `indices = arange(T * k).view(-1, k) % E`, token t
    to experts (k t + j) mod E, j < k), the E experts split over `ep` ranks in consecutive blocks
    of E / ep (`ExpertParallel`, Shard(0)); exact over the rule's period."""
    if ep <= 1:
        return 1.0
    per = num_experts // ep
    period = num_experts // math.gcd(top_k, num_experts)
    hits = sum(len({((top_k * t + j) % num_experts) // per for j in range(top_k)}) for t in range(period))
    return hits / period


class ExpertCosting:
    """A model's expert blocks by layer, and their costs under expert parallelism."""

    def __init__(self, graph: OpGraph, layers: list[Layer], blocks: Optional[list[ExpertBlock]] = None,
                 software: Any = None) -> None:
        """`software` (a `SoftwareSpec`, None: the default's choices): its `expert_dispatch` and
        `expert_routing` (the module docstring)."""
        self.graph = graph
        self.dispatch = getattr(software, "expert_dispatch", "pairs")
        self.routing = getattr(software, "expert_routing", "router")
        self.saves = getattr(software, "expert_saves", "runtime")
        # the most-loaded rank's pairs over the mean: exact balance under the fake gate, and
        # none charged under random logits (`forced_balance`: every expert the same pairs in
        # expectation; over the thousands of pairs a rank takes its excess is a few percent at
        # most, binomial: about 2% at 8192 pairs among 8 ranks, under 1% at 65536: not charged)
        self.imbalance = 1.0 if self.routing in ("fake_balanced", "forced_balance") else EP_IMBALANCE
        self.blocks = find_expert_blocks(graph) if blocks is None else blocks
        where = {l.name: i for i, l in enumerate(layers)}
        self.by_layer: dict[int, list[ExpertBlock]] = {}
        for b in self.blocks:
            i = where.get(b.layer)
            if i is None:      # a block outside the repeated layers: find the layer reading its weights
                i = next((k for k, l in enumerate(layers) if b.weights[0] in l.params), None)
            if i is not None:
                self.by_layer.setdefault(i, []).append(b)
        self.weights = {w for b in self.blocks for w in b.weights}
        self.num_experts = min((b.num_experts for b in self.blocks), default=0)
        self._cache: dict[tuple, list[LayerCost]] = {}
        # `_gemm_delta` by what it reads of a block's GEMMs: the blocks of a model's identical
        # layers give one result (DeepSeekMoE 16B: 27 layers, 4 GEMMs each, every ep and mb)
        self._deltas: dict[tuple, tuple[float, float]] = {}
        self._devices: dict[int, Any] = {}
        self._gemm_sigs: dict[str, tuple] = {}      # `_block_gemms`, by the block's module
        self._combine: dict[str, list] = {}          # `combine_saved`'s sources (per sample), by block
        self._row_index: dict[str, float] = {}       # `row_index_saved` (per sample), by block
        self._split: dict[str, list] = {}            # `split_saved`'s tensors (per sample), by block
        self._saved: dict[str, list] = {}            # `block_saved`'s tensors (per sample), by block
        self._megatron: dict[str, tuple] = {}        # `megatron_saved`'s parts (per sample), by block
        # the layer cost provider (set by the search): its layers' graphs at a micro-batch
        # (`graph_at`) price the folded block's other ops (`_fold_ops_delta`; None: left as priced)
        self.provider: Any = None
        self._fold_ops: dict[tuple, tuple[float, float]] = {}   # `_fold_ops_delta`, by layer kind
        self.layers = layers
        self.software = software

    @functools.cached_property
    def _g1(self) -> OpGraph:
        """The graph at batch 1 (per-sample FLOPs and bytes), made on the first ep > 1 costing."""
        return self.graph.at_batch(1) if self.graph.batch_size is None else self.graph

    def __bool__(self) -> bool:
        return bool(self.by_layer)

    def degrees(self, dp: int, pinned: Optional[int] = None) -> list[int]:
        """The ep degrees to try with `dp` data-parallel ranks: divisors of dp that divide every
        block's expert count (`pinned`: only that one, where it fits)."""
        if not self:
            return [1]
        out = [e for e in range(1, dp + 1) if dp % e == 0 and all(b.num_experts % e == 0 for b in self.blocks)]
        return [e for e in out if e == pinned] if pinned is not None else out

    def fold_degrees(self, dp: int, tp: int, pinned: Optional[int] = None) -> list[int]:
        """The ep degrees to try folded over a stage's dp x tp ranks (tp > 1): the divisors > 1
        of dp x tp that divide every block's expert count (`pinned`: only that one, where it fits)."""
        if not self or tp <= 1:
            return []
        n = dp * tp
        out = [e for e in range(2, n + 1) if n % e == 0 and all(b.num_experts % e == 0 for b in self.blocks)]
        return [e for e in out if e == pinned] if pinned is not None else out

    def fold_comm_s(self, block: ExpertBlock, mb: int, tp: int, cluster: ClusterSpec, dtype: str
                    ) -> tuple[float, float]:
        """Seconds of folding's all-gathers over the tp group (ranks 0..tp-1) for a micro-batch
        of `mb` samples: (forward: the block's output, T x H; backward: its inputs' gradients,
        T x (H + k))."""
        elem = 4 if dtype == "fp32" else 2
        rows = mb * block.tokens_per_sample
        group = list(range(tp))
        return (axis_collective_time("all_gather", rows * block.hidden * elem, cluster, group),
                axis_collective_time("all_gather", rows * (block.hidden + block.top_k) * elem, cluster, group))

    def tp_degrees(self, tp: int, pinned: Optional[int] = None) -> list[int]:
        """The expert tensor-parallel degrees to try at `tp` (with ep > 1): 1 (the experts
        replicated over tp) and tp where every block's split width divides by it
        (`capture.experts.tp_width`); `pinned`: only that one, where it fits."""
        out = [1]
        if tp > 1 and self and all((w := tp_width(self.graph, b)) and w % tp == 0 for b in self.blocks):
            out.append(tp)
        return [e for e in out if e == pinned] if pinned is not None else out

    def etp_comm_s(self, block: ExpertBlock, mb: int, etp: int, cluster: ClusterSpec, dtype: str) -> float:
        """Seconds of one of ETP's all-reduces over the tp group (ranks 0..etp-1): the received
        rows' width-H output (forward) or input gradient (backward), `dispatch_bytes` of them."""
        if etp <= 1:
            return 0.0
        elem = 4 if dtype == "fp32" else 2
        rows = mb * block.pairs_per_sample * self.imbalance
        return axis_collective_time("all_reduce", rows * block.hidden * elem, cluster, list(range(etp)))

    def ranks_per_token(self, block: ExpertBlock, ep: int) -> float:
        """The ranks of an ep group one token is sent to under "ranks" or "nodes" dispatch (the
        module docstring); the top-k under "pairs" (one row per pair). With `ep` the number of
        nodes the group spans, the nodes it is sent to (each node's E / nodes experts consecutive)."""
        if self.dispatch not in DEDUPLICATED:
            return float(block.top_k)
        if self.routing == "fake_balanced":
            return fake_ranks_per_token(block.num_experts, block.top_k, ep)
        return random_ranks_per_token(block.num_experts, block.top_k, ep)

    def dispatch_bytes(self, block: ExpertBlock, mb: int, dtype: str, ep: int = 1) -> float:
        """Bytes one rank sends in `block`'s dispatch for a micro-batch of `mb` samples over an
        ep group of `ep` ranks: its pairs (or, under "ranks" and "nodes" dispatch, its tokens times
        the ranks each reaches) x width x element size x the imbalance."""
        elem = 4 if dtype == "fp32" else 2
        rows = mb * block.pairs_per_sample
        if self.dispatch in DEDUPLICATED:
            rows = rows / block.top_k * self.ranks_per_token(block, ep)
        return rows * block.hidden * elem * self.imbalance

    def comm_buffer_bytes(self, ep: int, etp: int, dtype: str) -> float:
        """Device bytes the exchange's library keeps for the whole run on each rank: DeepEP's
        `Buffer` under "ranks" / "nodes" dispatch (`deepep_buffer_bytes`; Megatron's flex
        dispatcher over the expert tp x ep group, tokens of the hidden width at 2 bytes an element,
        fused_a2a.py `get_hidden_bytes`: `max(element_size, 2)`); 0 under "pairs" (torch's
        all-to-all, NCCL's buffers counted with the device's) or without ep."""
        if self.dispatch not in DEDUPLICATED or ep <= 1 or not self.blocks:
            return 0.0
        hidden = max(b.hidden for b in self.blocks) * (4 if dtype == "fp32" else 2)
        return deepep_buffer_bytes(ep * max(etp, 1), hidden)

    def node_span(self, cluster: ClusterSpec, group: list[int]) -> tuple[int, int]:
        """(k, g): the nodes an ep group's ranks span and the ranks of it in each, where "nodes"
        dispatch takes DeepEP's internode path (k > 1, every node g ranks, a network); (1, n)
        otherwise (one flat exchange)."""
        by: dict[int, int] = {}
        for r in group:
            by[r // cluster.devices_per_node] = by.get(r // cluster.devices_per_node, 0) + 1
        sizes = set(by.values())
        if self.dispatch != "nodes" or len(by) <= 1 or len(sizes) > 1 or cluster.inter_node is None:
            return 1, len(group)
        return len(by), sizes.pop()

    @staticmethod
    def ep_group(ep: int, tp: int, fold: bool) -> list[int]:
        """The first ep group's ranks in its stage: consecutive ranks folded (tp innermost, tp > 1),
        else dp ranks tp apart."""
        return list(range(ep)) if fold and tp > 1 else [i * tp for i in range(ep)]

    def exchange_kind(self, ep: int, tp: int, fold: bool, cluster: ClusterSpec) -> str:
        """`ExpertParallelism.exchange` of the plan: how a token is carried (`expert_dispatch`, and
        under "nodes" whether the ep group spans nodes)."""
        if self.dispatch not in DEDUPLICATED:
            return "dropless_all_to_all"
        k, _ = self.node_span(cluster, self.ep_group(ep, tp, fold))
        return "node_deduplicated_all_to_all" if k > 1 else "deduplicated_all_to_all"

    def exchange_time(self, block: ExpertBlock, mb: int, dtype: str, ep: int, cluster: ClusterSpec,
                      group: list[int], share: float = 1.0) -> float:
        """Seconds of one dispatch (or combine) of `block` for a micro-batch of `mb` samples over
        the ep group `group` (global ranks), each rank sending `share` of its tokens: one
        all-to-all of `dispatch_bytes` over the group (`axis_collective_time`), or under "nodes"
        dispatch over k > 1 nodes the slower of DeepEP's two concurrent stages (the module
        docstring): the network's all-to-all over the k nodes on a rail of `nodes_per_token` rows
        a token, and NVLink's over the g ranks of a node of the `dispatch_bytes`."""
        nbytes = self.dispatch_bytes(block, mb, dtype, ep) * share
        k, g = self.node_span(cluster, group)
        if k <= 1:
            return axis_collective_time("all_to_all", nbytes, cluster, group)
        network = nbytes / self.ranks_per_token(block, ep) * self.ranks_per_token(block, k)
        return max(link_collective_time("all_to_all", network, k, cluster.inter_node),
                   link_collective_time("all_to_all", nbytes, g, cluster.intra_node))

    def counts_time(self, block: ExpertBlock, cluster: ClusterSpec, group: list[int]) -> float:
        """Seconds of the small exchange of per-expert counts (int64, the split sizes) before a
        dispatch: one all-to-all over the group, or under "nodes" dispatch over k > 1 nodes
        DeepEP's `notify_dispatch` (internode.cu), an exchange over the network among the k nodes
        then, after a barrier, one over NVLink among the g ranks of a node (latency-bound)."""
        nbytes = 8.0 * block.num_experts
        k, g = self.node_span(cluster, group)
        if k <= 1:
            return axis_collective_time("all_to_all", nbytes, cluster, group)
        return (link_collective_time("all_to_all", nbytes, k, cluster.inter_node)
                + link_collective_time("all_to_all", nbytes, g, cluster.intra_node))

    def layer_costs(self, costs: list[LayerCost], ep: int, mb: int, tp: int, cluster: ClusterSpec,
                    dtype: str, etp: int = 1, fold: bool = False) -> list[LayerCost]:
        """`costs` (the layers at (mb, tp), experts replicated) with each expert block's experts
        sharded over `ep` ranks, and with `etp` > 1 each split over the tp ranks, or `fold`ed
        over the stage's dp x tp ranks (the module docstring); the same list for ep = 1."""
        if ep <= 1 or not self:
            return costs
        fold = fold and tp > 1
        key = (id(costs), ep, mb, tp, cluster.num_nodes, etp, fold)
        if key in self._cache:
            return self._cache[key]
        # the ep group: consecutive ranks of the stage folded (tp innermost), else dp ranks tp apart
        group = self.ep_group(ep, tp, fold)
        share = 1.0 / tp if fold else 1.0        # the block's tokens a rank runs
        dev = cluster.device
        out = list(costs)
        for i, blocks in self.by_layer.items():
            # (the exchange's collectives are counted by the planner, `expert_collectives`, not
            # here: the tp counts of a layer come from DTensor dry runs or the solved layouts)
            c = dataclasses.replace(costs[i], param_elems=dict(costs[i].param_elems),
                                    rc_extra_s=dict(costs[i].rc_extra_s), rc_comm_s=dict(costs[i].rc_comm_s))
            # the first backward's moments hold the rank's experts' gradients, 1/ep of them (1/(ep
            # x etp) split over tp): of each moment's parameter gradients, the experts' share
            # (`LayerCost.bwd_first_egrads`) scaled as their elements (moe-tiny dp4 x ep2 ZeRO-3:
            # a moment counted every expert's gradient of a weight, 8 KiB more than a rank's)
            keep = 1.0 / ep if etp == 1 else 1.0 / (ep * etp)
            for moments, field_ in (("bwd_first", "bwd_first_egrads"), ("bwd_acc", "bwd_acc_egrads")):
                ms_by, eg_by = getattr(c, moments), getattr(c, field_)
                new_ms, new_eg = {}, {}
                for r, ms in ms_by.items():
                    eg = eg_by.get(r) or [0.0] * len(ms)
                    new_ms[r] = [[m[0], m[1], m[2] - e * (1.0 - keep), *m[3:]] for m, e in zip(ms, eg)]
                    new_eg[r] = [e * keep for e in eg]
                setattr(c, moments, new_ms)
                setattr(c, field_, new_eg)
            for b in blocks:
                for w in b.weights:
                    if w in c.param_elems:
                        c.param_elems[w] = c.param_elems[w] / ep if etp == 1 else c.param_elems[w] / (ep * etp)
                a2a = self.exchange_time(b, mb, dtype, ep, cluster, group, share)
                counts = self.counts_time(b, cluster, group)
                c.fwd_comm_s += 2 * a2a + counts
                c.bwd_comm_s += 2 * a2a
                c.rc_extra_s["full"] = c.rc_extra_s.get("full", 0.0) + 2 * a2a + counts
                c.rc_comm_s["full"] = c.rc_comm_s.get("full", 0.0) + 2 * a2a + counts
                if etp > 1:
                    ar = self.etp_comm_s(b, mb, etp, cluster, dtype)
                    c.fwd_comm_s += ETP_FORWARD * ar
                    c.bwd_comm_s += ETP_BACKWARD * ar
                    c.rc_extra_s["full"] = c.rc_extra_s.get("full", 0.0) + ETP_FORWARD * ar
                    c.rc_comm_s["full"] = c.rc_comm_s.get("full", 0.0) + ETP_FORWARD * ar
                if fold:
                    agf, agb = self.fold_comm_s(b, mb, tp, cluster, dtype)
                    c.fwd_comm_s += FOLD_FORWARD * agf
                    c.bwd_comm_s += FOLD_BACKWARD * agb
                    c.rc_extra_s["full"] = c.rc_extra_s.get("full", 0.0) + FOLD_FORWARD * agf
                    c.rc_comm_s["full"] = c.rc_comm_s.get("full", 0.0) + FOLD_FORWARD * agf
                dfwd, dbwd = self._gemm_delta(b, ep, mb, dev, dtype, etp, share)
                if fold:
                    ofwd, obwd = self._fold_ops_delta(b, i, mb, tp, dev, dtype)
                    dfwd, dbwd = dfwd + ofwd, dbwd + obwd
                c.fwd_s += dfwd
                c.bwd_s += dbwd
                c.rc_extra_s["full"] = c.rc_extra_s.get("full", 0.0) + dfwd
                if self.saves == "megatron_core":
                    # the rank keeps Megatron's tensors (its `share` of the pairs, 1/etp of the split
                    # ones) in place of the module's as the layer counts them under each policy
                    c.act_bytes = {r: v + (self.megatron_saved(b, mb, dtype, ep, r, etp)[0] * share
                                           - self.megatron_saved(b, mb, dtype, ep, r, etp)[1]
                                           if r != "full" else 0.0) for r, v in c.act_bytes.items()}
                    continue
                extra = self.combine_saved(b, mb, dtype) * share
                if etp > 1:
                    extra -= self.split_saved(b, mb, dtype) * (1 - 1 / etp)
                # folding: the block saves on 1/tp of the tokens what it saves under each policy
                # (under norm_act less the activation's outputs, which the layer's count left out)
                folded = {r: self.block_saved(b, mb, dtype, r) * (1 - share) if fold else 0.0 for r in c.act_bytes}
                if extra or fold:
                    c.act_bytes = {r: v + (extra - folded[r] if r != "full" else 0.0) for r, v in c.act_bytes.items()}
            out[i] = c
        self._cache[key] = out
        return out

    def combine_saved(self, b: ExpertBlock, mb: int, dtype: str) -> float:
        """Bytes the exchange changes what the block saves for its backward by, a micro-batch of
        `mb` samples (dropless: a rank receives as many pairs as it sends, at the mean). The
        runtime (`runtime.experts.ExpertParallelExperts`) runs the experts module itself on the
        rows it received, each row its own token with a unit weight that needs no gradient, and
        combines the rows sent back itself; so the rank saves, in place of what the module's ops
        save in the one-process run (`module_saved`, weights needing a gradient):

        * what the module's ops save on the received rows with weights needing none
          (`module_saved(..., unit_weights=True)`: a product by the weights keeps the weights
          alone, a gather of them nothing; Hugging Face's combine `proj_out * weights` no longer
          keeps `proj_out`, the zoo's `index_add` still keeps its source), and
        * the exchange's own: the product of the rows sent back by their top-k weights keeps
          both (a [pairs, H] tensor and the weights), its `index_add` into the tokens keeps its
          source (another [pairs, H]), and four int64 permutations of the pairs are saved by the
          gathers and the combine reading them (each pair's token, the sort by expert, the
          received rows' sort by local expert and its inverse).

        Seen through saved-tensor hooks in one process (`tests/test_memory_model.py::
        test_expert_exchange_saves_what_the_model_counts`): a [pairs, H] tensor, the weights
        and 3 int64 permutations more than the one-process block, for the zoo's `index_add`
        combine and Hugging Face Mixtral's `sum` one alike (before session 36 this counted the
        module's `index_add` sources, none in Hugging Face's experts: HF Mixtral ep 2 verified
        -5.5%)."""
        if b.module not in self._combine:
            wrapper = b.pairs_per_sample * 4 * 8      # the exchange's int64 permutations
            one, one_side = self.module_saved(b)
            unit, unit_side = self.module_saved(b, unit_weights=True)
            self._combine[b.module] = (one, one_side, unit, unit_side, wrapper)
        one, one_side, unit, unit_side, wrapper = self._combine[b.module]
        elem = bytes_scale("float32", dtype) * 4
        rows = b.pairs_per_sample * (2 * b.hidden + 1) * elem       # the rows, the product, the weights
        size = sum(o.nbytes * bytes_scale(o.dtype, dtype) for o in unit) + unit_side
        size -= sum(o.nbytes * bytes_scale(o.dtype, dtype) for o in one) + one_side
        return (size + rows + wrapper) * mb

    def megatron_saved(self, b: ExpertBlock, mb: int, dtype: str, ep: int, recompute: str, etp: int = 1
                       ) -> tuple[float, float]:
        """(Megatron's, the module's): the bytes the block saves for its backward under
        `expert_saves` "megatron_core" on a rank running all of its tokens' pairs (`layer_costs`
        scales them by the rank's share when folded), and what the model's experts module saves
        in the one-process run as the layer's activation bytes under `recompute` count it (every
        tensor `module_saved` names, less the activation's outputs "norm_act" discards), a
        micro-batch of `mb` samples over `ep` ranks (dropless: a rank runs as many pairs as it
        sends, at the mean), with `etp` > 1 the projections' outputs and the output projection's
        input 1/etp. Megatron-Core's
        TEGroupedMLP (megatron/core/transformer/moe/experts.py, `TEGroupedMLP.forward`, and
        token_dispatcher.py at 1e057005, 2025-05-24, the commit the Megatron MoE model zoo's Qwen3
        table names; the probabilities moved into the activation by 2659630721, 2025-04-09) keeps,
        per pair:

        * the permuted row, the first grouped GEMM's input (TE's GroupedLinear saves its input);
        * the input projections' outputs, which `weighted_bias_swiglu_impl` (fusions/
          fused_bias_swiglu.py, `WeightedSwiGLUFunction.forward`: `save_for_backward(input,
          weights)`) saves with the probability, fp32 (4 bytes: DeepEP and the weighted SwiGLU take
          fp32 probabilities);
        * the output projection's input, unless "norm_act" discards it (`--recompute-modules
          moe_act`: `CheckpointWithoutOutput` around the activation);

        and nothing else of the rows: the probabilities are applied in the SwiGLU, so no product
        keeps the output projection's output (Hugging Face's `proj_out * weights` does), the
        fused `unpermute` without probabilities saves its row map only (Transformer Engine
        permutation.py at c6a9e26, `_moe_unpermute_mask_map.forward`), and the fused permutation
        and chunk sorts save only their int64 row maps (`_moe_permute_mask_map`,
        `_moe_chunk_sort`), in place of the module's integer permutations:

        * DeepEP's flex dispatcher (`expert_dispatch` "ranks" / "nodes", `_DeepepManager.
          get_permuted_hidden_states_by_experts`): one map of E / ep local experts by the received
          rows (T x r, a token's ranks `ranks_per_token`);
        * the all-to-all dispatcher ("pairs", `MoEAlltoAllTokenDispatcher`): the source permute's map
          of E experts by T tokens, and with more than one local expert the two chunk sorts' maps of
          the received pairs.

        What DeepEP's dispatch and combine keep (the handle's per-token layout, ints a token) is
        not counted. The activation's eager intermediates (HF's `act_fn(gate)`, saved by the
        product with `up`) are not kept by the fused SwiGLU: under policies that keep the
        activation they are part of what this drops."""
        if b.module not in self._megatron:
            g = self._g1
            by_name, inside = _block_nodes(g, b)
            base = tensor_bases(inside, by_name)
            act = {x for r in norm_act_regions(inside) if r.kind == "act" for x in r.ops}
            made = {n.name for n in inside}
            kept: dict[str, tuple[Any, bool]] = {}
            side = 0.0
            for key, owner, nbytes in _grad_saves(inside, by_name, requires_grad(g.nodes), base):
                if nbytes is not None:
                    side += nbytes
                elif owner is not None and owner.outputs and owner.kind == "call" and key in made:
                    kept[key] = (owner.outputs[0], key in act)

            def size(name: str) -> TensorMeta:
                x = by_name[base.get(name, name)]
                return x.outputs[0]

            first, last = g.node(b.gemms[0]), g.node(b.gemms[-1])
            rows = size(first.inputs[0])
            projections = [g.node(x).outputs[0] for x in b.gemms[:-1]]
            down_in = size(last.inputs[0])
            self._megatron[b.module] = (list(kept.values()), side, rows, projections, down_in)
        kept, side, rows, projections, down_in = self._megatron[b.module]

        def nb(o: TensorMeta) -> float:
            return o.nbytes * bytes_scale(o.dtype, dtype)

        discards = recompute == "norm_act"
        one = sum(nb(o) for o, in_act in kept if not (discards and in_act)) + side
        pairs = b.pairs_per_sample
        split = sum(nb(o) for o in projections) + (0.0 if discards else nb(down_in))
        mine = nb(rows) + split / max(etp, 1) + pairs * 4.0
        local = max(b.num_experts // max(ep, 1), 1)
        if self.dispatch in DEDUPLICATED and ep > 1:
            received = b.tokens_per_sample * self.ranks_per_token(b, ep)
            mine += 8.0 * local * received
        else:
            mine += 8.0 * b.num_experts * b.tokens_per_sample + (2 * 8.0 * pairs if local > 1 else 0.0)
        return mine * mb, one * mb

    def module_saved(self, b: ExpertBlock, unit_weights: bool = False) -> tuple[list, float]:
        """What the ops of `b`'s experts module save for their backward, per sample: (the
        tensors, by storage, `cost_models.memory.saved_tensors`; the bytes they keep on the
        side). Autograd records no op reading nothing that needs a gradient, and a gather saves
        its index only when its source needs one. `unit_weights`: as the exchange runs it, the
        top-k weights (the module's float (T, k) input) needing no gradient, and the module's
        own inputs it saves counted as the received rows it then reads (each its own tensor,
        one per pair); else those inputs are the layer's (counted there)."""
        g = self._g1
        by_name, inside = _block_nodes(g, b)
        made = {n.name for n in inside}
        rg = requires_grad(g.nodes)
        if unit_weights:
            for n in inside:
                for i in n.inputs:
                    x = by_name.get(i)
                    if i not in made and x is not None and x.kind != "param" and x.outputs and \
                            x.outputs[0].dtype.startswith(("float", "bfloat")) and \
                            len(x.outputs[0].shape) == 2 and x.outputs[0].shape[-1] == b.top_k:
                        rg[i] = False
            for n in inside:
                rg[n.name] = bool(n.outputs) and n.outputs[0].dtype.startswith(("float", "bfloat")) and \
                    any(rg.get(i, False) for i in n.inputs)
        base = tensor_bases(inside, by_name)
        kept: dict[str, Any] = {}
        side = 0.0
        for key, owner, nbytes in _grad_saves(inside, by_name, rg, base):
            if nbytes is not None:
                side += nbytes
                continue
            if owner is None or not owner.outputs or owner.kind == "param":
                continue
            if key in made:
                kept[key] = owner.outputs[0]
            elif unit_weights:
                # the module's input as the exchange hands it: one row per pair (the
                # hidden states H wide, the index and the weights one)
                o = owner.outputs[0]
                width = int(o.shape[-1]) if o.shape and int(o.shape[-1]) == b.hidden else 1
                kept[key] = TensorMeta((b.pairs_per_sample, width), o.dtype)
        return list(kept.values()), side

    def row_index_saved(self, b: ExpertBlock) -> float:
        """Bytes per sample of the integer indices `b`'s gathers and scatters of width-H rows
        save for their backward (`hidden[perm // k]`'s and `out.index_add(0, perm // k, y)`'s:
        an index op reading a tensor of `b.hidden` columns, an `INDEX_SOURCE_WRITES` op
        writing one), each tensor once."""
        if b.module not in self._row_index:
            g = self._g1
            by_name = {n.name: n for n in g.nodes}
            kept: dict[str, Any] = {}

            def wide(name: str) -> bool:
                x = by_name.get(name)
                # rows: two dims or more, the last H wide (the routing weights' flat view is not)
                return x is not None and bool(x.outputs) and len(x.outputs[0].shape) >= 2 and \
                    x.outputs[0].shape[-1] == b.hidden

            for n in g.nodes:
                p = n.module_path or ""
                if n.kind != "call" or not (p == b.module or p.startswith(b.module + ".")):
                    continue
                if n.op in ("index", "index_select") and n.inputs and wide(n.inputs[0]):
                    idx = n.inputs[1:]
                elif n.op in INDEX_SOURCE_WRITES and len(n.inputs) > 2 and wide(n.inputs[2]):
                    idx = n.inputs[1:2]
                else:
                    continue
                for i in idx:
                    x = by_name.get(i)
                    if x is not None and x.outputs and not x.outputs[0].dtype.startswith(("float", "bfloat")):
                        kept[i] = x.outputs[0]
            self._row_index[b.module] = float(sum(o.nbytes for o in kept.values()))
        return self._row_index[b.module]

    def split_saved(self, b: ExpertBlock, mb: int, dtype: str) -> float:
        """Bytes of what `b`'s ops save for their backward that expert tensor parallelism splits
        over tp, a micro-batch of `mb` samples: the tensors from the input projections' outputs
        up to the output projection's input (each read by ops of the block that derive from
        them), by storage (a chunk of the fused gate/up output is a view of it), as
        `cost_models.memory.saved_tensors` says each op keeps them."""
        if b.module not in self._split:
            g = self._g1
            by_name, inside = _block_nodes(g, b)
            split = set(b.gemms[:-1])
            for n in inside:
                if n.name not in b.gemms and any(i in split for i in n.inputs):
                    split.add(n.name)
            base = tensor_bases(inside, by_name, dtype=dtype)
            kept: dict[str, Any] = {}
            for n in inside:
                for name, nbytes in saved_tensors(n, by_name, dtype):
                    if nbytes is None and name in split:
                        owner = by_name.get(base.get(name, name))
                        if owner is not None and owner.outputs:
                            kept[owner.name] = owner.outputs[0]
            self._split[b.module] = list(kept.values())
        return sum(o.nbytes * bytes_scale(o.dtype, dtype) * mb for o in self._split[b.module])

    def block_saved(self, b: ExpertBlock, mb: int, dtype: str, recompute: Optional[str] = None) -> float:
        """Bytes of everything `b`'s ops save for their backward, a micro-batch of `mb` samples
        (graph tensors by storage, as `split_saved` counts them, and what ops keep on the side):
        what folding runs on 1/tp of the tokens. `recompute` "norm_act": less the outputs of the
        block's activation regions (`norm_act_regions`), which that policy discards (the layer's
        count leaves them out already)."""
        if b.module not in self._saved:
            by_name, inside = _block_nodes(self._g1, b)
            base = tensor_bases(inside, by_name, dtype=dtype)
            act = {x for r in norm_act_regions(inside) if r.kind == "act" for x in r.ops}
            kept: dict[str, tuple[Any, bool]] = {}
            side = 0.0
            for n in inside:
                for name, nbytes in saved_tensors(n, by_name, dtype):
                    if nbytes is not None:
                        side += nbytes
                        continue
                    owner = by_name.get(base.get(name, name))
                    if owner is not None and owner.outputs and owner.kind == "call":
                        kept[owner.name] = (owner.outputs[0], owner.name in act)
            self._saved[b.module] = (list(kept.values()), side)
        kept, side = self._saved[b.module]
        discards = recompute == "norm_act"
        return sum(o.nbytes * bytes_scale(o.dtype, dtype) * mb for o, in_act in kept
                   if not (discards and in_act)) + side * mb

    def _gemm_delta(self, b: ExpertBlock, ep: int, mb: int, dev, dtype: str, etp: int = 1,
                    share: float = 1.0) -> tuple[float, float]:
        """(forward, backward) seconds the block's expert GEMMs change by with ep: E / ep groups
        of imbalance x the pairs (each GEMM 1/etp of its FLOPs with expert tensor parallelism;
        `share` of them folded), against E groups of the rank's own pairs."""
        gemms = self._block_gemms(b)
        key = (gemms, b.num_experts, ep, mb, id(dev), dtype, etp, share, self.imbalance)
        hit = self._deltas.get(key)
        if hit is None:
            self._devices[id(dev)] = dev        # held: its id stays its own while keyed
            hit = self._deltas[key] = self._delta_of(list(gemms), b.num_experts, ep, mb, dev, dtype, etp, share,
                                                     self.imbalance)
        return hit

    def op_pricing(self, layer: Layer, mb: int, dev, dtype: str) -> tuple:
        """What `intra_op.ilp.op_compute_time` reads to price the ops of `layer` at micro-batch `mb`
        as the layer's solve does: (the provider's graph of the layer, which tensors need a
        gradient, the software's attention kernel, the graph's copying reshapes, its fused chains,
        its fp32 tensors)."""
        from autopar.intra_op.ilp import requires_grad_of
        from cost_models.compute import fusion_of
        from cost_models.layouts import graph_layout_copies
        from cost_models.memory import graph_fp32_tensors

        sw, prov = self.software, self.provider
        att = getattr(sw, "attention_kernel", "fused")
        g = prov.graph_at(mb, layer)
        copies = graph_layout_copies(g, dev.device_type, att)
        fusion = fusion_of(g, dev, att, getattr(sw, "pointwise_fusion", "eager"))
        fp32 = graph_fp32_tensors(g, dev.device_type, dtype, att, getattr(sw, "autocast", True))
        return g, requires_grad_of(g, prov._grad_inputs(layer)), att, copies, fusion, fp32

    def _fold_ops_delta(self, b: ExpertBlock, i: int, mb: int, tp: int, dev, dtype: str) -> tuple[float, float]:
        """(forward, backward) seconds the experts module's ops other than its grouped GEMMs change
        by when folding runs them on 1/tp of the block's tokens (the module docstring): each op's
        time with its work split tp ways less its time replicated, as the layer's solve prices
        them (`op_compute_time` on the provider's graph of layer `i` at `mb`, the software's
        attention kernel, fusion and precision); (0, 0) without a provider to read the layer's
        graph from, or with the analytic provider (whose rules may split some of them already).
        Kept per layer kind (identical layers give one result)."""
        prov = self.provider
        if prov is None or tp <= 1 or not hasattr(prov, "_expert_ops"):
            # only the intra-op solve keeps the block's ops replicated over tp (`_expert_ops`);
            # the analytic rules may split some already: their costs are left as they are
            return 0.0, 0.0
        layer = self.layers[i]
        key = (layer.signature, b.module.rsplit(".", 1)[-1], mb, tp, id(dev), dtype)
        hit = self._fold_ops.get(key)
        if hit is not None:
            return hit
        from autopar.intra_op.ilp import op_compute_time

        g, rg, att, copies, fusion, fp32 = self.op_pricing(layer, mb, dev, dtype)
        gemms = set(b.gemms)
        dfwd = dbwd = 0.0
        for name in layer.nodes:
            n = g.node(name)
            path = n.module_path or ""
            if n.kind != "call" or name in gemms or not n.outputs or not (
                    path == b.module or path.startswith(b.module + ".")):
                continue
            if n.flops <= 0 and n.bytes_moved <= 0 and name not in copies[0]:
                continue
            whole = op_compute_time(n, rg, rg.get(name, False), dev, dtype, 1, g._index, att, copies, fusion, fp32)
            part = op_compute_time(n, rg, rg.get(name, False), dev, dtype, tp, g._index, att, copies, fusion, fp32)
            dfwd += part[0] - whole[0]
            dbwd += part[1] - whole[1]
        self._devices[id(dev)] = dev        # held: its id stays its own while keyed
        hit = self._fold_ops[key] = (dfwd, dbwd)
        return hit

    def _block_gemms(self, b: ExpertBlock) -> tuple[tuple[float, float, float, str, float, bool], ...]:
        """The block's expert GEMMs as `_delta_of` reads them, per sample (once per block): (FLOPs,
        bytes moved, weight bytes, output dtype, output bytes, whether it is the output projection
        (the block's last GEMM: row-parallel under ETP, the others column-parallel,
        `capture.experts.tp_split`))."""
        if b.module not in self._gemm_sigs:
            gemms = []
            for i, name in enumerate(b.gemms):
                n = self._g1.node(name)
                w = self.graph.params.get(weight_param(self.graph, self.graph.node(name).inputs[1]) or "")
                wbytes = float(np.prod(w.shape)) * 4 if w is not None else 0.0      # the capture is fp32
                out = n.outputs[0] if n.outputs else None
                gemms.append((float(n.flops), float(n.bytes_moved), wbytes,
                              out.dtype if out is not None else "float32",
                              float(out.nbytes) if out is not None else 0.0,
                              i == len(b.gemms) - 1))
            self._gemm_sigs[b.module] = tuple(gemms)
        return self._gemm_sigs[b.module]

    @staticmethod
    def _delta_of(gemms: list[tuple[float, float, float, str, float, bool]], experts: int, ep: int, mb: int, dev,
                  dtype: str, etp: int = 1, share: float = 1.0, imbalance: float = EP_IMBALANCE
                  ) -> tuple[float, float]:
        """`_gemm_delta` of GEMMs given as `_block_gemms` gives them, each for one sample."""
        dfwd = dbwd = 0.0
        for flops, moved, wbytes, out_dtype, out_bytes, down in gemms:
            act = max(moved - wbytes, 0.0) * mb
            scale = bytes_scale(out_dtype, dtype)
            old = grouped_gemm_time(flops * mb, (act + wbytes) * scale, experts, dev, dtype)
            if etp == 1:
                new = grouped_gemm_time(flops * mb * imbalance * share,
                                        (act * imbalance * share + wbytes / ep) * scale, experts // ep, dev, dtype)
            else:
                # the split operand: an output projection's input rows, an input projection's
                # output columns; the other activation operand whole
                a_out = min(out_bytes * mb, act)
                a_in = act - a_out
                split, whole = (a_in, a_out) if down else (a_out, a_in)
                new = grouped_gemm_time(flops * mb * imbalance / etp,
                                        ((split / etp + whole) * imbalance + wbytes / (ep * etp)) * scale,
                                        experts // ep, dev, dtype)
            dfwd += new[0] - old[0]
            dbwd += new[1] - old[1]
        return dfwd, dbwd

    def expert_collectives(self, layers: range, m: int, recompute: str, etp: int = 1, fold: bool = False
                           ) -> Counter:
        """The exchange's all-to-alls of `layers` in one step of `m` micro-batches (the forward's
        again under full recomputation, which re-runs the blocks), with expert tensor
        parallelism its all-reduces over tp, folded its all-gathers over tp."""
        n = sum(len(self.by_layer.get(i, ())) for i in layers)
        full = recompute == "full"
        per = A2A_FORWARD + A2A_BACKWARD + (A2A_FORWARD if full else 0)
        out = Counter({"all_to_all": m * n * per}) if n else Counter()
        if n and etp > 1:
            out["all_reduce"] += m * n * (ETP_FORWARD + ETP_BACKWARD + (ETP_FORWARD if full else 0))
        if n and fold:
            out["all_gather"] += m * n * (FOLD_FORWARD + FOLD_BACKWARD + (FOLD_FORWARD if full else 0))
        return out

    def expert_largest(self, costs: list[LayerCost]) -> np.ndarray:
        """Per layer, the largest expert weight's elements per device in `costs`."""
        return np.array([max((e for f, e in c.param_elems.items() if f in self.weights), default=0.0) for c in costs],
                        dtype=float)

    def expert_elems(self, costs: list[LayerCost]) -> np.ndarray:
        """Per layer, the expert weights' elements per device in `costs`."""
        return np.array([sum(e for f, e in c.param_elems.items() if f in self.weights) for c in costs], dtype=float)
