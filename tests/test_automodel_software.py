"""NeMo AutoModel's software as the cost model prices it (issues 14, 17; the `nemo-automodel-2025`
preset and the published Qwen3-30B-A3B row of `benchmarks/moe_plans.py --published`):

- the cross-entropy on the 2-byte logits (`loss_kernel` "half", `MaskedCrossEntropy` with
  `fp32_upcast: false`) sizes what it saves and the gradients its backward holds as torch's own
  kernels do, measured here in-process on bf16 logits;
- DeepEP's exchange (`expert_dispatch` "ranks", and "nodes" across nodes: once per node over the
  network, DeepEP's internode kernels, checked against DeepEP's published bandwidth) and AutoModel's
  fake balanced gate
  (`expert_routing` "fake_balanced") reach the ranks that gate's rule sends a token to, and a
  plan with them carries that many rows, with no imbalance;
- `pointwise_fusion` "norm_moe" prices each RMSNorm module and each experts module's routing ops
  as one kernel of their boundary traffic, and leaves every other op as eager prices it.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from autopar import ClusterSpec, Constraints
from autopar.capture import capture
from autopar.capture.experts import find_expert_blocks
from autopar.inter_op.experts import fake_ranks_per_token, random_ranks_per_token
from autopar.models import build_model
from autopar.planner import plan, resolve_model
from autopar.schema.software import SoftwareSpec
from cost_models.compute import MATRIX_OPS, fusion_of, memory_time, node_time
from cost_models.fused_loss import HALF_OVERLOAD, fuse_losses, is_fused_loss, is_half_loss
from cost_models.memory import BACKWARD_LIVE, activation_memory

H100 = ClusterSpec.load("dgx-h100").device
# a Hugging Face Qwen3-MoE small enough for the CPU: eager RMSNorm modules, grouped-GEMM experts
_QWEN3 = ("hf:qwen3_moe?hidden_size=64&intermediate_size=128&moe_intermediate_size=32&num_key_value_heads=2"
          "&num_experts=8&num_experts_per_tok=2&num_hidden_layers=2&num_attention_heads=4&head_dim=16"
          "&vocab_size=128&seq_len=16")


@pytest.fixture(scope="module")
def gpt():
    b = build_model("gpt-tiny")
    return capture(b.model, b.example_inputs)


@pytest.fixture(scope="module")
def qwen3():
    pytest.importorskip("transformers")
    b = resolve_model(_QWEN3, None, None)
    return b, capture(b.model, b.example_inputs, name="qwen3-moe-tiny")


def _loss(g):
    (n,) = [n for n in g.calls if n.op == "cross_entropy_loss"]
    return n


def _torch_bf16_cross_entropy(shape: tuple) -> tuple[int, int]:
    """(bytes of the floating tensors autograd saves, bytes of the gradients the backward makes)
    of torch's cross-entropy on bf16 logits of `shape` (log_softmax then nll_loss, as
    `F.cross_entropy` runs it), measured in this process; nll_loss's 0-dim total weight apart."""
    v = shape[-1]
    logits = torch.randn(shape, dtype=torch.bfloat16).view(-1, v).requires_grad_()
    target = torch.randint(0, v, (logits.shape[0],))
    saved: dict[int, int] = {}

    def pack(t):
        if t.is_floating_point() and t.dim() > 0:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    grads: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = F.log_softmax(logits, -1)
        loss = F.nll_loss(lp, target, reduction="sum")
    assert torch.allclose(loss.float(), F.cross_entropy(logits, target, reduction="sum").float())
    lp.register_hook(lambda g: grads.append(g.nbytes))
    logits.register_hook(lambda g: grads.append(g.nbytes))
    loss.backward()
    assert lp.dtype == logits.grad.dtype == torch.bfloat16
    return sum(saved.values()), sum(grads)


def test_half_loss_sizes_memory_as_torch_bf16_cross_entropy(gpt):
    """The zoo GPT's loss (`logits.float()` then cross-entropy) as AutoModel runs it: the upcast
    gone, the loss saving its 2-byte log-probabilities and its backward holding 2-byte gradients
    of them and of the logits, as torch's kernels on bf16 logits do (measured in-process)."""
    h = fuse_losses(gpt, HALF_OVERLOAD)
    loss = _loss(h)
    assert is_half_loss(loss) and not is_fused_loss(loss) and h.node(loss.inputs[0]).op == "alias"
    assert SoftwareSpec.load("nemo-automodel-2025").on_graph(gpt).node(loss.name).target == loss.target
    g4, h4 = gpt.at_batch(4), h.at_batch(4)
    logits = g4.node(_loss(g4).inputs[0]).outputs[0]
    n = logits.numel
    saved, grads = _torch_bf16_cross_entropy(tuple(logits.shape))
    assert saved == 2 * n and grads == BACKWARD_LIVE * 2 * n       # torch: bf16 log-probs, two bf16 gradients
    kw = dict(device_type="cuda", layers=[None], autocast=False)
    eager = activation_memory(g4, "bf16", False, **kw)
    half = activation_memory(h4, "bf16", False, **kw)
    # eager saves the fp32 upcast (4 bytes an element) where the half loss saves what torch saves
    assert eager.saved_bytes - half.saved_bytes == pytest.approx(4 * n - saved)
    assert half.loss_grad_bytes == grads and eager.loss_grad_bytes == 2 * grads
    # time: the upcast costs nothing and the loss moves 2-byte log-probabilities
    assert node_time(h4.node(_loss(h4).inputs[0]), H100, "bf16", 1.0, h4._index) == (0.0, 0.0)


def test_fake_balanced_gate_reaches_the_ranks_its_rule_gives():
    """AutoModel's FakeBalancedGate (`arange(T * k).view(-1, k) % E`) run here: every expert the
    same pairs, and the mean ranks a token's experts fall on, E / ep consecutive experts a rank,
    is `fake_ranks_per_token`; for experts drawn at random, the exact mean over every top-k set
    is `random_ranks_per_token`."""
    for E, k, ep, T in ((128, 8, 8, 4096), (8, 2, 4, 64), (8, 3, 4, 64), (64, 6, 8, 1024)):
        idx = torch.arange(T * k).view(-1, k) % E
        assert torch.bincount(idx.flatten(), minlength=E).unique().numel() == 1      # balanced
        ranks = torch.tensor([len(set((row // (E // ep)).tolist())) for row in idx], dtype=torch.float64)
        assert fake_ranks_per_token(E, k, ep) == pytest.approx(ranks.mean().item())
    assert fake_ranks_per_token(128, 8, 8) == 1.0                # Qwen3-30B-A3B, ep 8: one rank a token
    for E, k, ep in ((8, 2, 4), (8, 3, 2), (12, 4, 3)):
        sets = list(itertools.combinations(range(E), k))
        exact = sum(len({e // (E // ep) for e in s}) for s in sets) / len(sets)
        assert random_ranks_per_token(E, k, ep) == pytest.approx(exact)


def test_a_plan_with_deepep_and_the_fake_gate_sends_each_token_once(qwen3):
    """`autopar.plan` of a Qwen3-MoE at ep 4 with AutoModel's software and its fake gate: each
    token reaches one rank (its 2 experts are consecutive, 2 a rank), so a dispatch carries the
    micro-batch's tokens once at the hidden width, no imbalance, where autopar's own exchange
    carries every pair and the imbalance estimate; the exchange costs less, and the plan says so."""
    b, g = qwen3
    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    cons = Constraints(dp=4, tp=1, pp=1, ep=4, microbatch_size=2, zero_stage=3, recompute="full")
    sw = SoftwareSpec.load("nemo-automodel-2025").model_copy(update={"expert_routing": "fake_balanced"})
    ours = plan(b, cpu, global_batch_size=16, graph=g, intra_op="analytic", constraints=cons, software=sw)
    runs = plan(b, cpu, global_batch_size=16, graph=g, intra_op="analytic", constraints=cons)
    (blk,) = {(x.tokens_per_sample, x.hidden, x.top_k) for x in find_expert_blocks(g)}
    tokens, hidden, k = blk
    assert ours.experts.exchange == "deduplicated_all_to_all" and ours.experts.imbalance == 1.0
    assert ours.experts.dispatch_bytes == pytest.approx(2 * tokens * hidden * 2)
    assert runs.experts.exchange == "dropless_all_to_all" and runs.experts.imbalance > 1.0
    assert runs.experts.dispatch_bytes == pytest.approx(2 * tokens * k * hidden * 2 * runs.experts.imbalance)
    text = ours.summary()
    assert "deduplicated all to all" in text and "an estimate" not in text.split("experts:")[1].split("\n")[0]
    assert "once per expert rank inside it (DeepEP)" in ours.software.summary()
    assert ours.predicted.communication_s < runs.predicted.communication_s
    # the software is recorded: the plan file read back names it
    back = type(ours).model_validate_json(ours.model_dump_json())
    assert (back.software.expert_dispatch, back.software.expert_routing) == ("nodes", "fake_balanced")


def test_norm_moe_fuses_the_norm_modules_and_the_experts_routing_only(qwen3):
    """Under "norm_moe" each RMSNorm module's ops cost one kernel reading its input and weight
    and writing its output, the experts module's non-matrix ops one kernel of their boundary
    (tokens in, rows in expert order out, the projections' outputs in, the activation and the
    combined tokens out), the grouped GEMMs and every op outside those modules as eager."""
    _, g = qwen3
    g4 = g.at_batch(4)
    fused = fusion_of(g4, H100, "fused", "norm_moe")
    assert fusion_of(g4, H100, "fused", "eager") is None
    idx = g4._index
    norms: dict[str, list] = {}
    for n in g4.calls:
        if "rmsnorm" in (n.module_type or "").lower():
            norms.setdefault(n.module_path, []).append(n)
    assert len(norms) >= 5          # input, post-attention, q and k norms of each layer, the final norm
    for path, ops in norms.items():
        members = [n for n in ops if n.name in fused.chain_of]
        chain = fused.chain_of[members[0].name]
        assert {n.name for n in members} == set(chain.members)
        x = next(o for o in ops if o.op in ("to", "_to_copy"))              # the norm's upcast reads x
        nbytes = sum(bb for bb, _ in chain.boundary) / 2    # the capture is fp32; priced at bf16
        xin = idx[x.inputs[0]].outputs[0].numel
        weight = g4.params[next(p for p in g4.params if p.startswith(path))].numel
        assert nbytes == pytest.approx(2 * (2 * xin + weight), rel=1e-6), path      # x and y, the weight
        fwd = sum(node_time(n, H100, "bf16", 1.0, idx, fusion=fused)[0] for n in members)
        assert fwd == pytest.approx(memory_time(nbytes, H100) + H100.kernel_overhead_s)
        eager = sum(node_time(n, H100, "bf16", 1.0, idx)[0] for n in members)
        assert eager > 3 * fwd
    blocks = find_expert_blocks(g4)
    for blk in blocks:
        inside = [n for n in g4.calls if (n.module_path or "").startswith(blk.module)]
        gemms = [n for n in inside if n.op in MATRIX_OPS]
        assert gemms and all(n.name not in fused.chain_of for n in gemms)
        grouped = {n.name for n in inside if n.name in fused.chain_of}
        assert len({id(fused.chain_of[m]) for m in grouped}) == 1       # one group per experts module
    outside = [n for n in g4.calls if n.name not in fused.chain_of and n.op == "add" and n.module_path == ""]
    for n in outside:
        assert node_time(n, H100, "bf16", 1.0, idx, fusion=fused) == node_time(n, H100, "bf16", 1.0, idx)


def test_optimizer_states_in_the_parameters_dtype_are_adams_own(qwen3):
    """`optimizer_states` "param" (AutoModel: torch.optim.Adam over a model cast to bf16): torch's
    Adam, stepped here on a bf16 parameter, keeps its two moments in bf16, 4 bytes a parameter
    and no master; a plan with it holds a third of the fp32 policy's optimizer state (12 bytes:
    fp32 master and moments), the 2-byte weight shards beside it, and steps in less time."""
    from cost_models.memory import PRECISION_POLICIES

    w = torch.nn.Parameter(torch.randn(64, 32, dtype=torch.bfloat16))
    opt = torch.optim.Adam([w])
    w.grad = torch.randn_like(w)
    opt.step()
    state = [t for t in opt.state[w].values() if torch.is_tensor(t) and t.dim() > 0]
    assert {t.dtype for t in state} == {torch.bfloat16}
    assert sum(t.nbytes for t in state) / w.numel() == PRECISION_POLICIES["bf16_param"][2] == 4
    b, g = qwen3
    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    cons = Constraints(dp=4, tp=1, pp=1, ep=4, microbatch_size=2, zero_stage=3, recompute="full")
    sw = SoftwareSpec.load("nemo-automodel-2025")
    assert sw.optimizer_states == "param" and sw.state_policy("bf16") == "bf16_param"
    assert "no fp32 master" in sw.summary()
    p = {k: plan(b, cpu, global_batch_size=16, graph=g, intra_op="analytic", constraints=cons, dtype="bf16",
                 software=sw.model_copy(update={"optimizer_states": k})) for k in ("param", "fp32")}
    own, master = p["param"].stages[0].predicted, p["fp32"].stages[0].predicted
    assert own.optimizer_bytes == pytest.approx(master.optimizer_bytes / 3)
    assert own.weights_bytes > master.weights_bytes         # the 2-byte shards are the weights now
    assert p["param"].predicted.peak_memory_bytes < p["fp32"].predicted.peak_memory_bytes
    assert "optimizer_states" not in p["fp32"].software.model_dump()     # the default is written as before


def test_deepep_internode_exchange_crosses_the_network_once_per_node(qwen3):
    """`expert_dispatch` "nodes" (DeepEP's internode kernels): over an ep group of k nodes x g ranks
    the exchange is the slower of the network's all-to-all over the k nodes of a token's distinct
    nodes (each node E / k consecutive experts; `random_ranks_per_token` at k, counted here over every
    top-k set) and NVLink's over the g ranks of the per-rank rows; inside one node it is "ranks"'
    flat exchange. Against the bare "ranks" exchange over the same nodes, it carries fewer bytes on
    the slow link, so it costs less."""
    from autopar.inter_op.experts import ExpertCosting
    from cost_models.communication import axis_collective_time, link_collective_time

    _, g = qwen3
    (blk,) = find_expert_blocks(g)[:1]
    E, k = blk.num_experts, blk.top_k
    for nodes in (2, 4):
        sets = list(itertools.combinations(range(E), k))
        exact = sum(len({e // (E // nodes) for e in s}) for s in sets) / len(sets)
        assert random_ranks_per_token(E, k, nodes) == pytest.approx(exact)
    cl = ClusterSpec.load("dgx-h100", num_nodes=2).model_copy(update={"devices_per_node": 4})
    ranks = ExpertCosting(g, [], [blk], SoftwareSpec.load("nemo-megatron-core-2024").model_copy(
        update={"expert_dispatch": "ranks"}))
    nodes = ExpertCosting(g, [], [blk], SoftwareSpec.load("nemo-megatron-core-2024").model_copy(
        update={"expert_dispatch": "nodes"}))
    mb, ep, group = 64, 8, list(range(8))                     # 2 nodes x 4 ranks
    nbytes = nodes.dispatch_bytes(blk, mb, "bf16", ep)
    assert nbytes == ranks.dispatch_bytes(blk, mb, "bf16", ep)
    assert nodes.node_span(cl, group) == (2, 4) and ranks.node_span(cl, group) == (1, 8)
    network = nbytes / random_ranks_per_token(E, k, ep) * random_ranks_per_token(E, k, 2)
    want = max(link_collective_time("all_to_all", network, 2, cl.inter_node),
               link_collective_time("all_to_all", nbytes, 4, cl.intra_node))
    assert nodes.exchange_time(blk, mb, "bf16", ep, cl, group) == pytest.approx(want)
    flat = axis_collective_time("all_to_all", nbytes, cl, group)
    assert ranks.exchange_time(blk, mb, "bf16", ep, cl, group) == pytest.approx(flat)
    assert want < flat
    assert nodes.exchange_kind(ep, 1, False, cl) == "node_deduplicated_all_to_all"
    assert ranks.exchange_kind(ep, 1, False, cl) == "deduplicated_all_to_all"
    # inside one node: the same flat exchange and counts as "ranks"
    inside = list(range(4))
    assert nodes.exchange_time(blk, mb, "bf16", 4, cl, inside) == ranks.exchange_time(blk, mb, "bf16", 4, cl, inside)
    assert nodes.counts_time(blk, cl, inside) == ranks.counts_time(blk, cl, inside)
    assert nodes.exchange_kind(4, 1, False, cl) == "deduplicated_all_to_all"


def test_deepep_internode_rule_against_deepeps_published_bandwidth():
    """DeepEP's README (docs/legacy.md, 'Normal kernels with NVLink and RDMA forwarding'): internode
    EP32 on H800 with one CX7 400 Gb/s NIC a GPU, 4096 tokens, hidden 7168, top-8 of 256 experts over
    4 nodes (tests/test_internode.py: top-4 node groups of 4, so any), FP8 dispatch, 58 GB/s dispatch
    bandwidth counted over each token's distinct nodes, its own included (`num_rdma_token_sent`).
    The network stage as "nodes" prices it on dgx-h100's inter-node link (the same NIC) takes
    0.85-1.0 of the measured time: the rule is within 15% of DeepEP and, as expected of a link
    figure from nccl-tests, not slower than it."""
    from cost_models.communication import link_collective_time

    cl = ClusterSpec.load("dgx-h100", num_nodes=4)
    per_token = 7168 + 7168 // 128 * 4                 # FP8 values and one fp32 scale per 128
    distinct = random_ranks_per_token(256, 8, 4)
    assert 3.5 < distinct < 3.7
    sent = 4096 * distinct * per_token
    measured = sent / 58e9
    rule = link_collective_time("all_to_all", sent, 4, cl.inter_node)
    assert 0.85 < rule / measured < 1.0


def test_fsdp_reduce_dtype_fp32_accumulates_the_dense_gradients_in_fp32(qwen3):
    """`grad_dtype` "fp32_reduce" (AutoModel's FSDP2 MixedPrecisionPolicy(reduce_dtype=float32),
    moe/parallelizer.py apply_fsdp): under ZeRO-3 with the gradients kept unsharded until the
    last micro-batch, the dense units' accumulate in fp32 (torch's `to_accumulated_grad_if_needed`
    upcasts the first, checked here on one FSDPParam-like tensor), 2 bytes an element more than
    bf16, the experts' (outside FSDP's policy) as they were; the step's reduce-scatter moves 4
    bytes an element and the accumulation 2 + 4 + 4: the plan is slower. Reduce-scattered every
    micro-batch, nothing is held unsharded: the memory as "param". The preset takes it."""
    from cost_models.compute import grad_accumulation_bytes

    g16 = torch.randn(8, dtype=torch.bfloat16)
    acc = g16.to(torch.float32)                 # FSDPParam.to_accumulated_grad_if_needed
    acc += torch.randn(8, dtype=torch.bfloat16)  # accumulate_unsharded_grad_if_needed: stays fp32
    assert acc.dtype == torch.float32 and acc.element_size() - g16.element_size() == 2
    assert grad_accumulation_bytes("bf16_fp32grad") == 10.0 and grad_accumulation_bytes("bf16_param") == 6.0
    b, g = qwen3
    cpu = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    sw = SoftwareSpec.load("nemo-automodel-2025")
    assert sw.grad_dtype == "fp32_reduce" and "gradients accumulated and reduced in fp32" in sw.summary()
    dense = sum(p.numel() for n, p in b.model.named_parameters() if ".experts." not in n)
    for sync in ("step", "microbatch"):
        cons = Constraints(dp=4, tp=1, pp=1, ep=4, microbatch_size=2, zero_stage=3, recompute="full",
                           zero3_grad_sync=sync)
        p = {k: plan(b, cpu, global_batch_size=32, graph=g, intra_op="analytic", constraints=cons, dtype="bf16",
                     software=sw.model_copy(update={"grad_dtype": k})) for k in ("fp32_reduce", "param")}
        assert p["param"].num_microbatches == 4 and p["param"].zero3_grad_sync == sync
        more = p["fp32_reduce"].stages[0].predicted.gradients_bytes - p["param"].stages[0].predicted.gradients_bytes
        assert more == (2.0 * dense if sync == "step" else 0.0)
    assert "grad_dtype" not in p["param"].software.model_dump()      # the default is written as before
    # time on the H100 profile (the CPU's measured gloo tables are not monotonic at these sizes)
    cons = Constraints(dp=8, tp=1, pp=1, ep=8, microbatch_size=2, zero_stage=3, recompute="full",
                       zero3_grad_sync="step")
    t = {k: plan(b, ClusterSpec.load("dgx-h100"), global_batch_size=64, graph=g, intra_op="analytic",
                 constraints=cons, dtype="bf16", software=sw.model_copy(update={"grad_dtype": k})).predicted
         for k in ("fp32_reduce", "param")}
    assert t["fp32_reduce"].iteration_time_s > t["param"].iteration_time_s
