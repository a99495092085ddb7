"""Cost models: collective formulas, cluster groups and meshes, measured tables, compute, memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.schema.cluster import AttentionPoint, ClusterSpec, DeviceSpec, LinkSpec, MeasuredCollective, OptimizerCost
from cost_models.communication import (
    axis_collective_time,
    collective_time,
    hierarchical_time,
    link_collective_time,
    logical_mesh,
    mesh_axis_collective_time,
)
from cost_models.compute import (
    MATRIX_OPS,
    attention_rates,
    attention_time,
    backward_factor,
    gemm_efficiency,
    grad_accumulation_time,
    graph_compute_time,
    op_backward_time,
    op_time,
    optimizer_step_time,
)
from cost_models.memory import (
    activation_memory,
    inflight_microbatches,
    korthikanti_layer_bytes,
    model_state_bytes,
    peak_memory,
)

INTRA = LinkSpec(bandwidth=200e9, latency=2e-6)
INTER = LinkSpec(bandwidth=25e9, latency=8e-6)
DEV = DeviceSpec(name="gpu", peak_flops={"bf16": 300e12, "fp32": 20e12}, memory_bytes=80e9,
                 memory_bandwidth=2e12)


def cluster(nodes: int = 2, per_node: int = 8, intra: LinkSpec = INTRA, inter: LinkSpec = INTER) -> ClusterSpec:
    return ClusterSpec(num_nodes=nodes, devices_per_node=per_node, device=DEV, intra_node=intra, inter_node=inter)


# -- communication -------------------------------------------------------------------------------

def test_collective_closed_forms() -> None:
    a, b, n, s = 1e-5, 1 / 100e9, 8, 1e9
    assert collective_time("all_reduce", s, n, a, b) == pytest.approx(2 * 7 * a + 2 * 7 / 8 * s * b)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, s, n, a, b) == pytest.approx(7 * a + 7 / 8 * s * b)
    assert collective_time("send_recv", s, 2, a, b) == pytest.approx(a + s * b)
    assert collective_time("all_reduce", s, 1, a, b) == 0.0
    assert collective_time("all_reduce", 0, 8, a, b) == 0.0
    with pytest.raises(ValueError):
        collective_time("broadcastish", s, n, a, b)


def test_logical_mesh_takes_the_slowest_link_per_axis() -> None:
    c = cluster()
    m = logical_mesh(c, list(range(16)), (2, 8))
    assert m.beta == (pytest.approx(1 / 25e9), pytest.approx(1 / 200e9))
    assert m.alpha == (8e-6, 2e-6)
    assert m.device == c.device and m.shape == (2, 8)
    m = logical_mesh(c, list(range(16)), (4, 4))       # axis 0 groups [0,4,8,12] cross nodes
    assert m.beta == (pytest.approx(1 / 25e9), pytest.approx(1 / 200e9))
    m = logical_mesh(c, list(range(8)), (2, 4))        # one node: both axes on NVLink
    assert m.beta == (pytest.approx(1 / 200e9), pytest.approx(1 / 200e9))


def test_group_inside_a_node_and_rails() -> None:
    c = cluster()
    s = 1e8
    assert axis_collective_time("all_reduce", s, c, list(range(8))) == pytest.approx(
        collective_time("all_reduce", s, 8, 2e-6, 1 / 200e9))
    # one device per node: its own NIC at the inter-node link
    assert axis_collective_time("all_reduce", s, c, [3, 11]) == pytest.approx(
        collective_time("all_reduce", s, 2, 8e-6, 1 / 25e9))
    assert axis_collective_time("send_recv", s, c, [0, 8]) == pytest.approx(8e-6 + s / 25e9)


def test_hierarchical_all_reduce_across_nodes() -> None:
    c = cluster(nodes=4)
    s = 1e9
    expect = (collective_time("reduce_scatter", s, 8, 2e-6, 1 / 200e9)
              + collective_time("all_reduce", s / 8, 4, 8e-6, 1 / 25e9)
              + collective_time("all_gather", s, 8, 2e-6, 1 / 200e9))
    assert hierarchical_time("all_reduce", s, 8, 4, INTRA, INTER) == pytest.approx(expect)
    got = axis_collective_time("all_reduce", s, c, list(range(32)))
    rings = collective_time("all_reduce", s, 32, 8e-6, 1 / min(200e9, 8 * 25e9))
    assert got == pytest.approx(min(expect, rings))
    flat = collective_time("all_reduce", s, 32, 8e-6, 1 / 25e9)
    assert got < flat / 3                                   # 8 rails in parallel beat one flat ring
    # a slow network (25 Gb/s per node shared by 8 GPUs): the two-level algorithm wins
    slow = LinkSpec(bandwidth=0.39e9, latency=30e-6)
    c2 = cluster(nodes=2, inter=slow)
    assert axis_collective_time("all_reduce", s, c2, list(range(16))) == pytest.approx(
        hierarchical_time("all_reduce", s, 8, 2, INTRA, slow))
    # a mesh axis runs its groups concurrently: time of the slowest group
    assert mesh_axis_collective_time("all_reduce", s, c, list(range(32)), (4, 8), 0) == pytest.approx(
        collective_time("all_reduce", s, 4, 8e-6, 1 / 25e9))


def test_all_to_all_across_nodes_sends_each_peer_over_its_own_link() -> None:
    """An all-to-all over g ranks in each of k nodes (PyTorch's all_to_all_single: one NCCL
    send/receive per peer, issued at once): a rank's (g - 1) / n of its buffer for its node's peers
    over NVLink and (n - g) / n over its NIC, concurrently; the slower is the time, below the flat
    ring that put all (n - 1) / n on the network."""
    c = cluster(nodes=4)
    s = 1e9
    got = axis_collective_time("all_to_all", s, c, list(range(32)))
    local = collective_time("all_to_all", s / 4, 8, 2e-6, 1 / 200e9)
    remote = 24 * 8e-6 + 24 / 32 * s / 25e9
    assert local == pytest.approx(2e-6 * 7 + 7 / 32 * s / 200e9)
    assert got == pytest.approx(max(local, remote)) == pytest.approx(remote)
    assert got < collective_time("all_to_all", s, 32, 8e-6, 1 / 25e9)
    # a rail (one rank a node) and an irregular group keep their rules
    assert axis_collective_time("all_to_all", s, c, [0, 8, 16, 24]) == pytest.approx(
        collective_time("all_to_all", s, 4, 8e-6, 1 / 25e9))
    assert axis_collective_time("all_to_all", s, c, [0, 1, 8]) == pytest.approx(
        collective_time("all_to_all", s, 3, 8e-6, 1 / 25e9))


def test_dgx_a100_bus_bandwidths_match_nccl_tests() -> None:
    """design.md: all-reduce busbw ~230 GB/s inside a DGX A100 and ~192 GB/s across nodes (8 x HDR)."""
    c = autopar.ClusterSpec.load("dgx-a100-80g", num_nodes=2)
    s = 4e9
    inside = 2 * 7 / 8 * s / axis_collective_time("all_reduce", s, c, list(range(8)))
    across = 2 * 15 / 16 * s / axis_collective_time("all_reduce", s, c, list(range(16)))
    assert inside == pytest.approx(230e9, rel=0.03)
    assert across == pytest.approx(192e9, rel=0.03)


@pytest.mark.parametrize("name,nbytes,busbw", [
    # nccl-tests all_reduce_perf -g 8 on one 8x A100 NVLink3 node (S. Bekman, ml-engineering,
    # network/README.md, "Real network throughput"): the rows as published
    ("dgx-a100-80g", 32 * 2**10, 1.31e9), ("dgx-a100-80g", 32 * 2**20, 138.49e9),
    ("dgx-a100-80g", 2**30, 229.04e9), ("dgx-a100-40g", 128 * 2**20, 176.92e9),
    # nccl-tests on 8x H200, NVLS on (ml-engineering, network/benchmarks/README.md)
    ("hgx-h200", 32 * 2**10, 3.20e9), ("hgx-h200", 16 * 2**20, 242.45e9), ("hgx-h200", 16 * 2**30, 480.70e9),
])
def test_intra_node_all_reduce_reproduces_the_published_nccl_tests(name: str, nbytes: float, busbw: float) -> None:
    """Issue 14: the bundled profiles' intra-node all-reduce, by message size, is the published
    nccl-tests run of that device (typed here from the source, not read from the profile), and a
    size between two published rows falls between their times."""
    c = autopar.ClusterSpec.load(name, num_nodes=1)
    t = axis_collective_time("all_reduce", nbytes, c, list(range(8)))
    assert 2 * 7 / 8 * nbytes / t == pytest.approx(busbw, rel=0.01)
    lo, hi = (axis_collective_time("all_reduce", x, c, list(range(8))) for x in (nbytes / 2, nbytes * 2))
    assert lo <= t <= hi


def test_h200_ring_collectives_match_nccl_tests() -> None:
    """8x H200 at 16 GiB (ml-engineering network/README.md, SHARP section): all-gather busbw 361.4
    GB/s, reduce-scatter 362.9 (ring); the profile prices both at its bandwidth."""
    c = autopar.ClusterSpec.load("hgx-h200", num_nodes=1)
    s = 16 * 2**30
    for kind, busbw in (("all_gather", 361.4e9), ("reduce_scatter", 362.9e9)):
        t = axis_collective_time(kind, s, c, list(range(8)))
        assert 7 / 8 * s / t == pytest.approx(busbw, rel=0.01)


def test_measured_table_overrides_and_interpolates() -> None:
    rows = [MeasuredCollective(kind="all_reduce", num_devices=8, bytes=1e6, seconds=1e-4),
            MeasuredCollective(kind="all_reduce", num_devices=8, bytes=1e8, seconds=1e-3)]
    link = LinkSpec(bandwidth=200e9, latency=2e-6, measured=rows)
    assert link_collective_time("all_reduce", 1e6, 8, link) == pytest.approx(1e-4)
    assert link_collective_time("all_reduce", 1e7, 8, link) == pytest.approx(10 ** -3.5)   # log-log
    assert link_collective_time("all_reduce", 1e3, 8, link) == pytest.approx(1e-4)         # latency floor
    slope = (1e-3 - 1e-4) / (1e8 - 1e6)
    assert link_collective_time("all_reduce", 2e8, 8, link) == pytest.approx(1e-3 + 1e8 * slope)
    # another kind has no table: the formula
    assert link_collective_time("all_gather", 1e8, 8, link) == pytest.approx(
        collective_time("all_gather", 1e8, 8, 2e-6, 1 / 200e9))
    # another device count: the table scaled by the formula's ratio
    ratio = (collective_time("all_reduce", 1e6, 4, 2e-6, 1 / 200e9)
             / collective_time("all_reduce", 1e6, 8, 2e-6, 1 / 200e9))
    assert link_collective_time("all_reduce", 1e6, 4, link) == pytest.approx(1e-4 * ratio)
    c = cluster(intra=link)
    assert axis_collective_time("all_reduce", 1e7, c, list(range(8))) == pytest.approx(10 ** -3.5)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]),
       nbytes=st.floats(1, 1e10), bw=st.floats(1e8, 1e12), more=st.floats(1.0, 100.0),
       group=st.sampled_from([[0, 1], list(range(8)), [0, 8], list(range(16)), [0, 1, 8, 9]]))
def test_more_bandwidth_never_slower(kind: str, nbytes: float, bw: float, more: float, group: list[int]) -> None:
    slow = cluster(intra=LinkSpec(bandwidth=bw, latency=1e-6), inter=LinkSpec(bandwidth=bw / 4, latency=5e-6))
    fast = cluster(intra=LinkSpec(bandwidth=bw * more, latency=1e-6),
                   inter=LinkSpec(bandwidth=bw * more / 4, latency=5e-6))
    assert (axis_collective_time(kind, nbytes, fast, group)
            <= axis_collective_time(kind, nbytes, slow, group) * (1 + 1e-12))
    assert axis_collective_time(kind, nbytes * 2, slow, group) >= axis_collective_time(kind, nbytes, slow, group)


# -- compute --------------------------------------------------------------------------------------

def test_gemm_efficiency_curve() -> None:
    small, big = gemm_efficiency(DEV, 1e7, "bf16"), gemm_efficiency(DEV, 1e12, "bf16")
    assert small < 0.1 < 0.6 < big <= 1.0                 # generic curve: small GEMMs far below peak
    prof = autopar.ClusterSpec.load("dgx-a100-80g").device
    pts = sorted((p.flops, p.efficiency) for p in prof.gemm_efficiency["bf16"])
    assert gemm_efficiency(prof, pts[2][0], "bf16") == pytest.approx(pts[2][1])
    mid = math.sqrt(pts[2][0] * pts[3][0])                 # linear in log(FLOPs)
    assert gemm_efficiency(prof, mid, "bf16") == pytest.approx((pts[2][1] + pts[3][1]) / 2)
    assert gemm_efficiency(prof, 1e20, "fp16") == pytest.approx(pts[-1][1])   # fp16 falls back to bf16


@settings(max_examples=50, deadline=None)
@given(op=st.sampled_from(["mm", "linear", "gelu", "layer_norm", "add"]), flops=st.floats(1e3, 1e14),
       more=st.floats(1.0, 1e3), nbytes=st.floats(0, 1e10))
def test_more_flops_never_faster(op: str, flops: float, more: float, nbytes: float) -> None:
    assert op_time(op, flops * more, nbytes, DEV, "bf16") >= op_time(op, flops, nbytes, DEV, "bf16") * (1 - 1e-12)
    assert op_time(op, flops, nbytes * more, DEV, "bf16") >= op_time(op, flops, nbytes, DEV, "bf16") * (1 - 1e-12)


def test_op_time_roofline_and_backward() -> None:
    f = 1e12
    t = op_time("mm", f, 0, DEV, "bf16")
    assert t == pytest.approx(f / (300e12 * gemm_efficiency(DEV, f, "bf16")) + DEV.kernel_overhead_s)
    assert op_time("add", 1e6, 1e9, DEV) == pytest.approx(1e9 / (2e12 * 0.8) + DEV.kernel_overhead_s)
    assert backward_factor("linear") == 2.0 and backward_factor("gelu") == 1.0
    assert "mm" in MATRIX_OPS and backward_factor("scaled_dot_product_attention") == 2.5


def test_optimizer_and_accumulation_are_memory_bound() -> None:
    n = 1e9
    assert optimizer_step_time(n, DEV, "bf16", num_tensors=0) == pytest.approx(28 * n / (2e12 * 0.8))
    assert optimizer_step_time(n, DEV, "bf16", shard=4, num_tensors=0) == pytest.approx(7 * n / (2e12 * 0.8))
    assert grad_accumulation_time(n, DEV, "bf16", 1) == 0.0
    assert grad_accumulation_time(n, DEV, "bf16", 3) == pytest.approx(2 * (6 * n / 1.6e12 + DEV.kernel_overhead_s))


def test_unfused_attention_costs_more_than_fused() -> None:
    """The attention kernel is the software's choice (`SoftwareSpec.attention_kernel`), not the
    device's: the same device prices unfused attention (stored scores) above fused."""
    q = (4, 16, 2048, 128)
    fused = attention_time(q, q, q, DEV, "bf16")
    assert attention_time(q, q, q, DEV, "bf16", kernel="fused") == fused        # the default: autopar run's
    unfused = attention_time(q, q, q, DEV, "bf16", kernel="unfused")
    assert unfused[0] > fused[0] and unfused[1] > fused[1]
    with pytest.raises(ValueError, match="attention kernel"):
        attention_time(q, q, q, DEV, "bf16", kernel="flash3")
    assert attention_time(q, q, q, DEV, "bf16", shard=4)[0] < fused[0]


# -- measured costs (autopar profile) -------------------------------------------------------------

CPU = DeviceSpec(name="cpu", peak_flops={"fp32": 100e9}, memory_bytes=8e9, memory_bandwidth=40e9,
                 memory_efficiency=1.0, kernel_overhead_s=3e-6, op_flops={"gelu": 15e9}, vector_flops=12e9)


def _measured(dev: DeviceSpec = CPU, bwd: float = 10e9, att: tuple = (60e9, 70e9), per_tensor: float = 15e-6,
              per_element: float = 1e-9) -> DeviceSpec:
    """`dev` with the fields `autopar profile` measures beyond the roofline's inputs."""
    return dev.model_copy(update={
        "op_backward_flops": {"gelu": bwd, "layer_norm": bwd},
        "attention_flops": {"fp32": [AttentionPoint(flops_per_head=5e5, forward_flops=att[0], backward_flops=att[1]),
                                     AttentionPoint(flops_per_head=5e7, forward_flops=2 * att[0],
                                                    backward_flops=2 * att[1])]},
        "optimizer_step": OptimizerCost(per_tensor_s=per_tensor, per_element_s=per_element)})


def test_measured_backward_rate_replaces_the_forward_rate() -> None:
    f, nbytes = 18e6, 8e6
    plain = op_backward_time("gelu", f, nbytes, CPU, "fp32")
    assert plain == pytest.approx(op_time("gelu", f, 1.5 * nbytes, CPU, "fp32"))        # the forward's rate
    slow, fast = op_backward_time("gelu", f, nbytes, _measured(bwd=5e9), "fp32"), \
        op_backward_time("gelu", f, nbytes, _measured(bwd=50e9), "fp32")
    assert slow == pytest.approx(f / 5e9 + CPU.kernel_overhead_s)
    assert fast == pytest.approx(max(f / 50e9, 1.5 * nbytes / 40e9) + CPU.kernel_overhead_s)   # memory still bounds it
    assert slow > plain > fast
    # ops the profile did not measure, and matrix ops, keep the formulas
    assert op_backward_time("silu", f, nbytes, _measured(bwd=5e9), "fp32") == \
        op_backward_time("silu", f, nbytes, CPU, "fp32")
    assert op_backward_time("linear", 1e9, nbytes, _measured(bwd=5e9), "fp32") == \
        op_backward_time("linear", 1e9, nbytes, CPU, "fp32")


def test_measured_matmul_backward_ratio() -> None:
    f, nbytes = 5e8, 4e6
    two = op_backward_time("linear", f, nbytes, CPU, "fp32")
    assert two == pytest.approx(2 * op_time("linear", f, nbytes, CPU, "fp32"))
    slow = CPU.model_copy(update={"matmul_backward_ratio": 2.2})
    assert op_backward_time("linear", f, nbytes, slow, "fp32") == pytest.approx(1.1 * two)
    assert op_backward_time("bmm", f, nbytes, slow, "fp32") > op_backward_time("bmm", f, nbytes, CPU, "fp32")
    # fused attention has its own measurement; element-wise ops are untouched
    q = (16, 4, 64, 32)
    assert attention_time(q, q, q, slow, "fp32") == attention_time(q, q, q, CPU, "fp32")
    assert op_backward_time("gelu", f, nbytes, slow, "fp32") == op_backward_time("gelu", f, nbytes, CPU, "fp32")


@settings(max_examples=25, deadline=None)
@given(r1=st.floats(1e8, 1e12), r2=st.floats(1e8, 1e12))
def test_slower_measured_backward_never_predicts_faster(r1: float, r2: float) -> None:
    lo, hi = sorted((r1, r2))
    assert op_backward_time("layer_norm", 8e6, 8e6, _measured(bwd=lo), "fp32") >= \
        op_backward_time("layer_norm", 8e6, 8e6, _measured(bwd=hi), "fp32")


def test_measured_attention_rates_interpolate_by_size() -> None:
    dev = _measured()
    assert attention_rates(CPU, 1e6, "fp32") is None                          # nothing measured
    assert attention_rates(dev, 1e3, "fp32") == (60e9, 70e9)                  # constant below the table
    assert attention_rates(dev, 1e9, "fp32") == (120e9, 140e9)                # and above it
    mid = attention_rates(dev, 5e6, "fp32")                                   # halfway in log(FLOPs)
    assert mid == (pytest.approx(90e9), pytest.approx(105e9))
    assert attention_rates(dev, 5e6, "tf32") == mid and attention_rates(dev, 5e6, "bf16") is None
    q = (16, 4, 64, 32)                                                       # 4*64*64*32 FLOPs per head: 5.2e5
    flops = 4.0 * 16 * 4 * 64 * 64 * 32
    fwd, bwd = attention_time(q, q, q, dev, "fp32")
    r = attention_rates(dev, flops / 64, "fp32")
    assert fwd == pytest.approx(flops / r[0] + dev.kernel_overhead_s)
    assert bwd == pytest.approx(2.5 * flops / r[1] + dev.kernel_overhead_s)
    # a slower measured kernel predicts a slower attention, both passes; bf16 (not measured) keeps the GEMM curve
    slow = attention_time(q, q, q, _measured(att=(30e9, 35e9)), "fp32")
    assert slow[0] > fwd and slow[1] > bwd
    assert attention_time(q, q, q, dev, "bf16") == attention_time(q, q, q, CPU, "bf16")


def test_attention_rates_read_at_the_nearest_measured_head_dim() -> None:
    """A table measured at several head dimensions is read at the one nearest the op's (in log);
    the A100 80GB's FlashAttention-2 table (Dao 2023, Figure 4: causal, fwd+bwd 155 TFLOP/s at
    s = 2k, d = 128, FLOPs halved there) reads twice the printed rate, the capture's FLOP count."""
    dev = ClusterSpec.load("dgx-a100-80g").device
    at = 4.0 * 2048 * 2048
    assert attention_rates(dev, at * 128, "bf16", head_dim=128) == (pytest.approx(310e12), pytest.approx(310e12))
    assert attention_rates(dev, at * 64, "bf16", head_dim=64) == (pytest.approx(280e12), pytest.approx(280e12))
    assert attention_rates(dev, at * 80, "bf16", head_dim=80) == attention_rates(dev, at * 80, "bf16", head_dim=64)
    assert attention_rates(dev, at * 128, "fp16", head_dim=128) == attention_rates(dev, at * 128, "bf16", head_dim=128)
    # the attention of one GPT-3 1.3B layer (s = 2k, 16 heads of 128): fwd + bwd = 3.5 x its FLOPs at 310
    q = (8, 16, 2048, 128)
    fwd, bwd = attention_time(q, q, q, dev, "bf16")
    assert fwd + bwd == pytest.approx(3.5 * 8 * 16 * at * 128 / 310e12 + 2 * dev.kernel_overhead_s, rel=1e-6)


def test_unfused_attention_core_reads_the_published_pytorch_bars() -> None:
    """Megatron-LM 2021's unfused attention core (baddbmm, softmax, bmm and their backward) on an
    A100 80GB costs what PyTorch's standard attention took there: Dao 2023 (arXiv 2307.08691),
    Figure 4 (a) and (b), "Pytorch" bars, no causal mask, fwd + bwd, FLOPs 3.5 x 4 s^2 d per head.
    At the figure's own shapes (hidden 2048, 16k tokens, dropout 0) the priced time is the bar's;
    between its head dimensions it is linear in d; the attention dropout the benchmark ran without
    is added on top, and a profile without the table keeps the roofline."""
    dev = ClusterSpec.load("dgx-a100-80g").device
    # (head dim, batch, sequence) -> TFLOP/s as printed: (a) d = 64, (b) d = 128
    bars = {(64, 8, 2048): 43, (128, 8, 2048): 76, (64, 32, 512): 36, (128, 2, 8192): 86, (128, 16, 1024): 67}
    for (d, b, s), tflops in bars.items():
        q = (b, 2048 // d, s, d)
        fwd, bwd = attention_time(q, q, q, dev, "bf16", kernel="unfused")
        assert fwd + bwd == pytest.approx(3.5 * 4 * b * (2048 // d) * s * s * d / (tflops * 1e12), rel=1e-9)
        assert attention_time(q, q, q, dev, "fp16", kernel="unfused") == (fwd, bwd)
        assert 0 < fwd < bwd
    # head dim 96 (Table 1's 1.7B: 24 heads of 96): the mean of the two bars' seconds per score
    per64, per128 = 3.5 * 4 * 64 / 43e12, 3.5 * 4 * 128 / 76e12
    q = (16, 24, 2048, 96)
    fwd, bwd = attention_time(q, q, q, dev, "bf16", kernel="unfused")
    assert fwd + bwd == pytest.approx(16 * 24 * 2048 ** 2 * (per64 + per128) / 2, rel=1e-9)
    dropped = attention_time(q, q, q, dev, "bf16", kernel="unfused", dropout_p=0.1)
    assert dropped[0] > fwd and dropped[1] > bwd
    # the roofline it replaces priced these kernels faster than the A100 ran them
    roofline = dev.model_copy(update={"unfused_attention_flops": None})
    assert sum(attention_time(q, q, q, roofline, "bf16", kernel="unfused")) < 0.7 * (fwd + bwd)
    # far below the measured sizes (a 32-token toy) fixed per-kernel costs dominate: the roofline
    tiny = (1, 2, 32, 16)
    assert attention_time(tiny, tiny, tiny, dev, "bf16", kernel="unfused") == \
        attention_time(tiny, tiny, tiny, roofline, "bf16", kernel="unfused")
    # the fused kernel is untouched by the unfused table
    assert attention_time(q, q, q, dev, "bf16") == attention_time(q, q, q, roofline, "bf16")


def test_non_causal_attention_does_the_whole_square() -> None:
    """The measured tables are causal kernels' rates on the capture's whole-square FLOPs; a
    non-causal attention (an encoder's, or one given a mask tensor, which makes the kernel
    compute every tile) does twice the work at the same shapes (`NONCAUSAL_WORK`, an estimate)."""
    from autopar.capture.export import capture
    from autopar.models.registry import build_model
    from cost_models.compute import NONCAUSAL_WORK, attention_is_causal

    dev = ClusterSpec.load("dgx-a100-80g").device
    q = (8, 16, 2048, 128)
    causal = sum(attention_time(q, q, q, dev, "bf16")) - 2 * dev.kernel_overhead_s
    full = sum(attention_time(q, q, q, dev, "bf16", causal=False)) - 2 * dev.kernel_overhead_s
    assert full == pytest.approx(NONCAUSAL_WORK * causal, rel=1e-6)
    cpu_less = dev.model_copy(update={"attention_flops": None})     # the GEMM curve: no causal table
    assert attention_time(q, q, q, cpu_less, "bf16") == attention_time(q, q, q, cpu_less, "bf16", causal=False)
    for ref, want in [("gpt-tiny", True), ("bert-tiny", False)]:
        b = build_model(ref, device="meta")
        g = capture(b.model, b.example_inputs, loss_fn=getattr(b, "loss_fn", None))
        att = [n for n in g.nodes if n.kind == "call" and n.op == "scaled_dot_product_attention"]
        assert att and all(attention_is_causal(n) == want for n in att), ref


def test_software_brings_its_own_attention_rates() -> None:
    """A software preset that runs another attention kernel (flash-attn 1) carries its rates on the
    devices it was measured on; on other devices the hardware profile's stand."""
    from autopar.schema.software import SoftwareSpec

    a100 = ClusterSpec.load("dgx-a100-80g")
    fa1 = SoftwareSpec.load("flash-attn-1-2022")
    mine = fa1.on_cluster(a100)
    at = 4.0 * 2048 * 2048 * 128
    assert attention_rates(mine.device, at, "bf16", head_dim=128) == (pytest.approx(138e12), pytest.approx(138e12))
    assert a100.device.attention_flops != mine.device.attention_flops                # the original untouched
    h100 = ClusterSpec.load("dgx-h100")
    assert fa1.on_cluster(h100) is h100
    assert SoftwareSpec.load("autopar").on_cluster(a100) is a100


def test_measured_optimizer_step_counts_tensors_and_elements() -> None:
    dev = _measured(per_tensor=20e-6, per_element=2e-9)
    n = 1e6
    assert optimizer_step_time(n, dev, "fp32", param_tensors=52) == pytest.approx(52 * 20e-6 + n * 2e-9)
    assert optimizer_step_time(n, dev, "fp32", shard=2, param_tensors=1) == pytest.approx(20e-6 + n / 2 * 2e-9)
    assert optimizer_step_time(n, dev, "fp32", num_tensors=3) == pytest.approx(3 * 20e-6 + n * 2e-9)
    assert (optimizer_step_time(n, dev, "fp32", param_tensors=100)
            > optimizer_step_time(n, dev, "fp32", param_tensors=10))
    # SGD has no measurement: the memory-bound formula
    assert optimizer_step_time(n, dev, "fp32", "sgd") == optimizer_step_time(n, CPU, "fp32", "sgd")


@pytest.mark.parametrize("name", ["dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "hgx-h200", "p3.16xlarge"])
def test_gpu_profiles_keep_the_formulas(name: str) -> None:
    """Bundled GPU profiles measure none of the new fields: their predictions are the formulas'
    (but for the A100's published FlashAttention-2 rates, each with its source: measured on the 80GB,
    transferred to the 40GB as a labelled estimate)."""
    dev = ClusterSpec.load(name).device
    assert dev.op_backward_flops is None and dev.optimizer_step is None
    assert (dev.attention_flops is None) == (name not in ("dgx-a100-80g", "dgx-a100-40g"))
    if dev.attention_flops:
        assert "2307.08691" in dev.sources["attention_flops"]
    if name == "dgx-a100-40g":
        assert dev.attention_flops == ClusterSpec.load("dgx-a100-80g").device.attention_flops
        assert dev.sources["attention_flops"].startswith("ESTIMATE")
    assert dev.matmul_backward_ratio is None
    assert op_backward_time("linear", 1e12, 1e9, dev) == 2 * op_time("linear", 1e12, 1e9, dev)
    n = 1e9
    assert optimizer_step_time(n, dev, "bf16", param_tensors=500) == optimizer_step_time(n, dev, "bf16")
    assert optimizer_step_time(n, dev, "bf16", num_tensors=0) == pytest.approx(
        28 * n / (dev.memory_bandwidth * dev.memory_efficiency))
    assert op_backward_time("gelu", 1e9, 1e9, dev) == op_time("gelu", 1e9, 1.5e9, dev)
    q = (4, 16, 2048, 128)
    flops, nbytes = 4.0 * 4 * 16 * 2048 * 2048 * 128, 2 * 4 * 4 * 16 * 2048 * 128
    if dev.attention_flops is None:
        assert attention_time(q, q, q, dev, "bf16", kernel="fused") == (
            op_time("scaled_dot_product_attention", flops, nbytes, dev, "bf16"),
            op_backward_time("scaled_dot_product_attention", flops, nbytes, dev, "bf16"))


def test_misaligned_gemm_costs_what_the_h100_measured() -> None:
    """A language-model head whose vocabulary is odd (GPT-2's 50257) runs at about a fifth of the
    aligned rate on an H100 (cuBLAS's slower kernels below 16-byte alignment), one a multiple of 2
    or 4 elements at about a third; the profile's measured table prices that, the rows M do not
    matter, and a profile without the table (A100 here) charges nothing."""
    import torch.nn as nn

    from autopar.capture import capture
    from cost_models.compute import gemm_alignment_factor, node_time

    h100, a100 = ClusterSpec.load("dgx-h100").device, ClusterSpec.load("dgx-a100-80g").device

    def head_time(vocab: int, rows: int = 64, dev=h100) -> tuple[float, float]:
        g = capture(nn.Linear(256, vocab, bias=False), (torch.zeros(rows, 256),)).at_batch(rows)
        index = {n.name: n for n in g.nodes}
        (lin,) = [n for n in g.calls if n.op == "linear"]
        return node_time(lin, dev, "bf16", 1.0, index)

    aligned, odd, even2 = head_time(50304), head_time(50257), head_time(30522)
    assert odd[0] / aligned[0] == pytest.approx(50257 / 50304 / 0.195, rel=0.02)
    assert odd[1] / aligned[1] == pytest.approx(50257 / 50304 / 0.195, rel=0.02)
    assert even2[0] > head_time(30528)[0] * 2.5            # 30522 = 2 x 15261: 4-byte aligned
    assert head_time(50304, rows=63) == pytest.approx(head_time(50304, rows=64), rel=0.05)
    assert head_time(50257, dev=a100)[0] < 1.1 * head_time(50304, dev=a100)[0]
    assert a100.gemm_alignment is None
    g = capture(nn.Linear(255, 512), (torch.zeros(8, 255),)).at_batch(8)      # K odd
    index = {n.name: n for n in g.nodes}
    (lin,) = [n for n in g.calls if n.op == "linear"]
    assert gemm_alignment_factor(lin, index, h100, "bf16") == 0.195
    assert gemm_alignment_factor(lin, index, h100, "fp32") == 0.345    # 4 bytes an element


def test_cluster_file_with_measured_costs_loads(tmp_path) -> None:
    import yaml

    data = yaml.safe_load((autopar.schema.cluster.bundled_profiles_dir() / "cpu.yaml").read_text())
    dev = _measured()
    data["device"].update(dev.model_dump(mode="json", include={"op_backward_flops", "attention_flops",
                                                               "optimizer_step"}))
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    c = ClusterSpec.load(path)
    assert c.device.optimizer_step == dev.optimizer_step and c.device.attention_flops == dev.attention_flops
    assert c.device.op_backward_flops == dev.op_backward_flops
    data["device"]["optimizer_step"]["per_tensor_s"] = -1.0
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(autopar.PlanError, match="optimizer_step.per_tensor_s"):
        ClusterSpec.load(path)
    data["device"]["optimizer_step"]["per_tensor_s"] = 1e-5
    data["device"]["attention_flops"]["fp32"][0]["forward_flops"] = 0
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(autopar.PlanError, match="forward_flops"):
        ClusterSpec.load(path)
    data["device"]["attention_flops"]["fp32"][0]["forward_flops"] = 1e9
    data["device"]["op_backward_flops"]["gelu"] = 0
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(autopar.PlanError, match="op_backward_flops"):
        ClusterSpec.load(path)


def test_planner_costs_the_optimizer_per_parameter_tensor() -> None:
    """With a measured per-tensor cost, the plan's optimizer time counts the stage's parameter
    tensors (gpt-tiny: 28, the tied embedding once); a slower measured step predicts a slower plan."""
    base = ClusterSpec.load("cpu")
    dp1 = base.model_copy(update={"devices_per_node": 1})

    def plan(per_tensor: float, per_element: float = 0.0):
        dev = base.device.model_copy(update={"optimizer_step": OptimizerCost(per_tensor_s=per_tensor,
                                                                             per_element_s=per_element)})
        return autopar.plan("gpt-tiny", dp1.model_copy(update={"device": dev}), global_batch_size=4, dtype="fp32")

    p0, p1 = plan(0.0), plan(1e-3)
    with torch.device("meta"):
        tensors = len(list(autopar.models.registry.build_model("gpt-tiny").model.parameters()))
    assert p1.predicted.iteration_time_s - p0.predicted.iteration_time_s == pytest.approx(tensors * 1e-3, rel=1e-6)
    assert plan(0.0, 1e-6).predicted.iteration_time_s > p0.predicted.iteration_time_s


# -- captured models ------------------------------------------------------------------------------

class MegatronBlock(nn.Module):
    """Megatron-LM's GPT layer as Korthikanti et al. count it: unfused attention with dropout on the
    probabilities, dropout after both residual branches (p = 0.1)."""

    def __init__(self, h: int, a: int) -> None:
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.d_attn, self.d1, self.d2 = nn.Dropout(0.1), nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.a, h // self.a).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, -1))
        p = self.d_attn(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(h // self.a), -1))
        x = x + self.d1(self.proj(torch.matmul(p, v).transpose(1, 2).reshape(b, s, h)))
        return x + self.d2(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class Stack(nn.Module):
    def __init__(self, h: int, a: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MegatronBlock(h, a) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x.sum()


H, A, S = 256, 4, 128


@pytest.fixture(scope="module")
def megatron_graph():
    with torch.device("meta"):
        m = Stack(H, A, 2).train()
    return autopar.capture(m, (torch.zeros(1, S, H, device="meta"),))


@pytest.fixture(scope="module")
def zoo_graph():
    from autopar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, seq_len=S, hidden=H, layers=2, heads=A)
    with torch.device("meta"):
        m = GPT(cfg)
    x = torch.zeros(1, S, dtype=torch.long, device="meta")
    return autopar.capture(m, (x, x))


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_match_korthikanti(megatron_graph, recompute: str) -> None:
    b = 2
    g = megatron_graph.at_batch(b)
    am = activation_memory(g, "bf16", recompute)
    want = korthikanti_layer_bytes(S, b, H, A, recompute=recompute)
    for layer in g.layers:
        assert am.per_layer[layer] == pytest.approx(want, rel=0.05)
    if recompute == "full":
        # the recomputed layer is live again during its backward, beside the gradients of the
        # op whose backward runs (at most two of the largest tensor the layer makes)
        full_layer = korthikanti_layer_bytes(S, b, H, A)
        assert am.working_bytes >= full_layer * 0.95
        assert am.working_bytes - full_layer <= am.backward_bytes


def test_zoo_gpt_layer_activations(zoo_graph) -> None:
    """The zoo's GPT layer has fused attention (no s x s scores) and no dropout: Korthikanti's count
    without the score terms and the two dropout masks, 32·s·b·h in 16-bit; 2·s·b·h under full."""
    b = 3
    g = zoo_graph.at_batch(b)
    sbh = S * b * H
    none = activation_memory(g, "bf16", "none").per_layer[g.layers[0]]
    assert none == pytest.approx(korthikanti_layer_bytes(S, b, H, A, recompute="selective") - 2 * sbh, rel=0.05)
    assert activation_memory(g, "bf16", "full").per_layer[g.layers[0]] == pytest.approx(2 * sbh, rel=0.05)
    assert activation_memory(g, "fp32", "none").per_layer[g.layers[0]] == pytest.approx(2 * none, rel=0.05)
    with pytest.raises(ValueError):
        activation_memory(zoo_graph, "bf16", "none")        # symbolic batch


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 16), rec=st.sampled_from(["none", "selective", "full"]))
def test_bigger_batch_never_less_memory(zoo_graph, b: int, rec: str) -> None:
    small = activation_memory(zoo_graph.at_batch(b), "bf16", rec)
    big = activation_memory(zoo_graph.at_batch(b + 1), "bf16", rec)
    assert big.peak_bytes >= small.peak_bytes


def test_graph_compute_time_recompute_and_shard(zoo_graph) -> None:
    g = zoo_graph.at_batch(4)
    dev = autopar.ClusterSpec.load("dgx-a100-80g").device
    none = graph_compute_time(g, dev, "bf16")
    full = graph_compute_time(g, dev, "bf16", recompute="full")
    sel = graph_compute_time(g, dev, "bf16", recompute="selective")
    assert none.recompute_s == 0 and full.recompute_s == pytest.approx(full.forward_s)
    assert full.total_s == pytest.approx(none.total_s + none.forward_s)
    assert 0 < sel.recompute_s < full.recompute_s
    assert none.backward_s > 1.5 * none.forward_s             # matrix ops dominate: ~2x
    half = graph_compute_time(g, dev, "bf16", shard=lambda n: 2.0 if n.op in MATRIX_OPS else 1.0)
    assert half.total_s < none.total_s
    one = graph_compute_time(g, dev, "bf16", layers=[g.layers[0]])
    assert set(one.per_layer) == {g.layers[0]} and one.total_s < none.total_s


class Heads(nn.Module):
    """Heads [b, h, s, d] merged back to [b, s, h * d], spelled `how`: "reshape" (the attention
    epilogue: a transpose then a reshape, which cannot be a view of a contiguous input),
    "contiguous" (Megatron's `.contiguous().view()`: the same copy spelled out), "view" (no
    transpose: a view)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x):
        b, h, s, d = x.shape
        y = x * 2.0
        if self.how == "view":
            z = y.reshape(b, s, h * d)
        elif self.how == "contiguous":
            z = y.transpose(1, 2).contiguous().view(b, s, h * d)
        else:
            z = y.transpose(1, 2).reshape(b, s, h * d)
        return (z * 3.0).sum()


def test_a_reshape_that_copies_costs_a_copy() -> None:
    """A reshape whose input's strides allow no view runs `clone` + `_unsafe_view` (ATen's
    `reshape`): its output's bytes read and written, priced as a `clone` of them, and in the
    backward the transposed gradient copied again (measured: one `clone` in the backward of the
    matmul that made the input, as after `.contiguous()`). A pure view stays free. So the
    transpose + reshape costs what Megatron's `.contiguous().view()` costs, however it is spelled,
    and the time difference from the view is the clone's, forward and backward."""
    from autopar.capture.flops import node_cost
    from cost_models.compute import node_time, op_list_time
    from cost_models.layouts import graph_layout_copies

    b, h, s, d = 2, 4, 64, 32
    graphs = {how: autopar.capture(Heads(how), (torch.zeros(b, h, s, d, device="meta"),)).at_batch(b)
              for how in ("view", "reshape", "contiguous")}
    times = {how: graph_compute_time(g, DEV, "bf16") for how, g in graphs.items()}
    out_bytes = b * s * h * d * 2                                   # bf16
    clone_f = op_time("clone", 0.0, 2 * out_bytes, DEV, "bf16")
    clone_b = op_backward_time("clone", 0.0, 2 * out_bytes, DEV, "bf16")
    assert clone_f == pytest.approx(2 * out_bytes / (DEV.memory_bandwidth * DEV.memory_efficiency)
                                    + DEV.kernel_overhead_s)
    assert times["reshape"].forward_s - times["view"].forward_s == pytest.approx(clone_f)
    assert times["reshape"].backward_s - times["view"].backward_s == pytest.approx(clone_b)
    assert times["reshape"].total_s == pytest.approx(times["contiguous"].total_s)

    g = graphs["reshape"]
    copying, _ = graph_layout_copies(g, DEV.device_type)
    (name,) = copying
    n = g.node(name)
    assert n.op == "reshape" and node_cost(n, {}) == (0.0, 0.0)    # the capture's count: a view
    # a reshape's work is split like other element-wise ops': its bytes over the sharding
    f, bw = node_time(n, DEV, "bf16", 1.0, g._index, copies=(copying, frozenset()))
    f4, b4 = node_time(n, DEV, "bf16", 4.0, g._index, copies=(copying, frozenset()))
    assert f4 - DEV.kernel_overhead_s == pytest.approx((f - DEV.kernel_overhead_s) / 4)
    assert b4 - DEV.kernel_overhead_s == pytest.approx((bw - DEV.kernel_overhead_s) / 4)
    # without the layouts (or read as a view) it is free, as before
    assert node_time(n, DEV, "bf16", 1.0, g._index) == (0.0, 0.0)
    assert op_list_time([n], DEV, "bf16", index=g._index).total_s == 0.0
    # the memo: one walk per graph, device type and attention kernel
    assert graph_layout_copies(g, DEV.device_type) is graph_layout_copies(g, DEV.device_type)


def test_grouped_query_repeat_costs_a_copy_and_a_sum() -> None:
    """Llama's repeat of keys and values over the query heads (`expand` + `reshape`, llama-tiny
    written so: `tests.user_models:llama_repeat_kv`, 4 query heads, 2 key/value heads; the zoo's
    runs grouped-query attention inside SDPA) copies forward; backward, the expand's
    gradient is summed over the repeated dim (autograd: `ExpandBackward0` -> `sum`): the
    output's gradient read, a key/value-sized one written."""
    from autopar.capture import capture
    from autopar.models.registry import build_model
    from cost_models.compute import node_time
    from cost_models.layouts import LayoutCopies, graph_layout_copies

    bundle = build_model("tests.user_models:llama_repeat_kv")
    g = capture(bundle.model, bundle.example_inputs, name=bundle.name).at_batch(2)
    copies = graph_layout_copies(g, DEV.device_type)
    repeats = [g.node(x) for x in copies[0] if g.node(g.node(x).inputs[0]).op == "expand"]
    assert len(repeats) == 4
    bw = DEV.memory_bandwidth * DEV.memory_efficiency
    for n in repeats:
        out = n.outputs[0].numel * 2                                 # bf16
        rep = n.outputs[0].shape[1] // g.node(n.inputs[0]).outputs[0].shape[1]
        assert rep == 2
        f, b = node_time(n, DEV, "bf16", 1.0, g._index, copies=copies)
        assert f == pytest.approx(2 * out / bw + DEV.kernel_overhead_s)
        assert b == pytest.approx((out + out / rep) / bw + DEV.kernel_overhead_s)
    # the whole model: the repeats' time on top of the views'
    base = graph_compute_time(g, DEV, "bf16").total_s
    charged = sum(sum(node_time(n, DEV, "bf16", 1.0, g._index, copies=copies)) for n in repeats)
    g2 = capture(bundle.model, bundle.example_inputs, name=bundle.name).at_batch(2)
    g2.__dict__["_layout_copies"] = {(DEV.device_type, "fused"): LayoutCopies(frozenset(), copies[1],
                                                                               copies.grad_sums)}
    assert base - graph_compute_time(g2, DEV, "bf16").total_s == pytest.approx(charged)


class FusedEpilogue(nn.Module):
    """Hugging Face's attention epilogue: `out.transpose(1, 2).contiguous().view(b, s, h * d)`."""

    def forward(self, x):
        b, h, s, d = x.shape
        y = F.scaled_dot_product_attention(x, x, x)
        return (y.transpose(1, 2).contiguous().view(b, s, h * d) * 3.0).sum()


def test_a_contiguous_that_copies_nothing_is_free() -> None:
    """A fused attention kernel on a GPU lays its output out [b, s, h, d], so its transpose back
    is contiguous and `.contiguous()` returns it (`cost_models.layouts`): no time, as the memory
    model holds no copy. After unfused attention (a contiguous [b, h, s, d] product) it copies,
    priced as the capture counts it."""
    from cost_models.compute import node_time
    from cost_models.layouts import graph_layout_copies

    g = autopar.capture(FusedEpilogue(), (torch.zeros(2, 4, 64, 32, device="meta"),)).at_batch(2)
    (n,) = [n for n in g.calls if n.op == "contiguous"]
    fused, unfused = (graph_layout_copies(g, "cuda", k) for k in ("fused", "unfused"))
    assert fused[1] == {n.name} and not unfused[1]
    assert node_time(n, DEV, "bf16", 1.0, g._index, "fused", fused) == (0.0, 0.0)
    copy = node_time(n, DEV, "bf16", 1.0, g._index, "unfused", unfused)
    assert copy == node_time(n, DEV, "bf16", 1.0, g._index) and copy[0] > 0 and copy[1] > 0


# -- model states and schedules -------------------------------------------------------------------

def test_zero_formulas() -> None:
    psi, n = 1e9, 64
    assert model_state_bytes(psi, "bf16", 0).total == pytest.approx(16 * psi)
    assert model_state_bytes(psi, "bf16", 1, n).total == pytest.approx(4 * psi + 12 * psi / n)
    assert model_state_bytes(psi, "bf16", 2, n).total == pytest.approx(2 * psi + 14 * psi / n)
    assert model_state_bytes(psi, "bf16", 3, n).total == pytest.approx(16 * psi / n)
    assert model_state_bytes(psi, "fp32", 0).total == pytest.approx(16 * psi)
    assert model_state_bytes(psi, "fp32", 0).weights == pytest.approx(4 * psi)
    with pytest.raises(ValueError):
        model_state_bytes(psi, "int4")


def test_inflight_microbatches_by_schedule() -> None:
    assert inflight_microbatches("gpipe", 4, 0, 16) == 16
    assert [inflight_microbatches("1f1b", 4, s, 16) for s in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 4, 0, 2) == 2
    p, v = 8, 3
    assert inflight_microbatches("interleaved_1f1b", p, 0, 64, v) == pytest.approx(p + (p - 1) / v)
    assert inflight_microbatches("interleaved_1f1b", p, 0, 64, 1) == p
    peak = peak_memory(1e9, 1e9, DEV, schedule="1f1b", num_stages=4, stage=1, num_microbatches=8)
    assert peak.peak == pytest.approx(16e9 + 3e9) and peak.fits


def test_schedule_moments_repeat_past_the_equivalent_microbatches() -> None:
    """`held_moments` walks `equivalent_microbatches` of a long step: the full walk's maximal
    moments equal the short one's for every rank (1F1B and interleaved, up to 8 stages; one
    stage too, where a second micro-batch's activations meet the first one's gradients: an H100
    run of GPT-3 1.3B with 4 micro-batches held 2.45 GiB of gradients the plan left out)."""
    from cost_models.schedules import _walk_moments, equivalent_microbatches

    for p in (1, 2, 3, 5, 8):
        for r in range(p):
            for kind, v, ms in (("1f1b", 1, (p, 2 * p, 4 * p + 3)), ("interleaved_1f1b", 2, (3 * p, 5 * p)),
                                ("interleaved_1f1b", 4, (4 * p,)), ("gpipe", 1, (2 * p,))):
                for m in ms:
                    m0 = equivalent_microbatches(kind, p, r, m, v)
                    assert m0 <= m and (kind != "gpipe" or m0 == m)
                    assert _walk_moments(kind, p, r, m0, v) == _walk_moments(kind, p, r, m, v), (kind, p, r, m, v)


class _PromotedSoftmax(nn.Module):
    def forward(self, x):
        y = x * 2.0                       # bf16 in, bf16 out
        p = torch.softmax(y, dim=-1)      # CUDA autocast's fp32-dtype list: bf16 in, fp32 out
        z = p * 3.0                       # promoted by its fp32 input: fp32 in, fp32 out
        return z.view(-1, z.shape[-1]).sum()   # a view of an fp32 tensor: moves nothing


def test_ops_promoted_to_fp32_move_four_byte_elements() -> None:
    """Issue 18: under bf16 autocast on CUDA a softmax gives an fp32 output and the element-wise
    op reading it computes in fp32 by type promotion (`cost_models.memory.mixed_fp32`, the rule
    the memory model sizes tensors by); the time model priced both at 2-byte traffic. Now each
    tensor moves at the dtype the run gives it (`fp32_extra_bytes`): by hand, N elements, the
    achieved bandwidth `memory_bandwidth * memory_efficiency` and the kernel's overhead (every
    op here memory-bound)."""
    from cost_models.compute import fp32_extra_bytes, node_time
    from cost_models.memory import graph_fp32_tensors

    b, s, h = 2, 64, 1024
    N = b * s * h
    g = autopar.capture(_PromotedSoftmax(), (torch.zeros(b, s, h, device="meta"),)).at_batch(b)
    assert DEV.device_type == "cuda"
    fp32 = graph_fp32_tensors(g, DEV.device_type, "bf16")
    ops = {n.op + ("_1" if n.name.endswith("_1") else ""): n for n in g.calls}
    assert {ops["softmax"].name, ops["mul_1"].name} <= fp32 and ops["mul"].name not in fp32
    bw = DEV.memory_bandwidth * DEV.memory_efficiency

    def fwd(op: str) -> float:
        return node_time(ops[op], DEV, "bf16", 1.0, g._index, fp32=fp32)[0]

    assert fwd("mul") == pytest.approx((2 + 2) * N / bw + DEV.kernel_overhead_s)      # bf16 -> bf16
    assert fwd("softmax") == pytest.approx((2 + 4) * N / bw + DEV.kernel_overhead_s)  # bf16 -> fp32
    assert fwd("mul_1") == pytest.approx((4 + 4) * N / bw + DEV.kernel_overhead_s)    # fp32 -> fp32
    assert ops["view"].name in fp32 and node_time(ops["view"], DEV, "bf16", 1.0, g._index, fp32=fp32) == (0.0, 0.0)
    # the backward scales the same bytes (its gradients are fp32 where the tensors are)
    n = ops["mul_1"]
    assert node_time(n, DEV, "bf16", 1.0, g._index, fp32=fp32)[1] == pytest.approx(
        op_backward_time(n.op, n.flops, 8 * N, DEV, "bf16"))
    # without the set (or in an fp32 run) every floating tensor is at the training dtype
    assert node_time(n, DEV, "bf16", 1.0, g._index)[0] == pytest.approx(4 * N / bw + DEV.kernel_overhead_s)
    assert graph_fp32_tensors(g, DEV.device_type, "fp32") == frozenset()
    assert fp32_extra_bytes(n, g._index, fp32, "fp32") == 0.0
    # the graph's time model reads it: the two fp32 ops and the sum of fp32 elements cost more
    assert graph_compute_time(g, DEV, "bf16").forward_s == pytest.approx(
        sum(node_time(x, DEV, "bf16", 1.0, g._index, fp32=fp32)[0] for x in g.calls))


def test_a_model_cast_to_half_holds_no_autocast_fp32_tensors() -> None:
    """Issue 14: software that casts the model to bf16 and runs fused kernels writing bf16
    (`SoftwareSpec.mixed_precision == "half"`: Megatron-LM's Float16Module, NeMo) has no autocast
    fp32 list: the softmax and the product after it move 2-byte elements, while a loss still reads
    an explicit fp32 upcast (`x.float()`), in either precision."""
    from cost_models.compute import node_time
    from cost_models.memory import graph_fp32_tensors

    b, s, h = 2, 64, 1024
    N = b * s * h
    g = autopar.capture(_PromotedSoftmax(), (torch.zeros(b, s, h, device="meta"),)).at_batch(b)
    assert graph_fp32_tensors(g, DEV.device_type, "bf16", autocast=False) == frozenset()
    soft = next(n for n in g.calls if n.op == "softmax")
    half = graph_fp32_tensors(g, DEV.device_type, "bf16", autocast=False)
    bw = DEV.memory_bandwidth * DEV.memory_efficiency
    assert node_time(soft, DEV, "bf16", 1.0, g._index, fp32=half)[0] == pytest.approx(
        (2 + 2) * N / bw + DEV.kernel_overhead_s)
    assert graph_compute_time(g, DEV, "bf16", autocast=False).forward_s < graph_compute_time(
        g, DEV, "bf16").forward_s

    class Upcast(nn.Module):
        def forward(self, x, y):
            return F.cross_entropy(x.float(), y)

    g2 = autopar.capture(Upcast(), (torch.zeros(64, 128, device="meta"),
                                    torch.zeros(64, dtype=torch.long, device="meta"))).at_batch(64)
    cast = {n.name for n in g2.calls if n.op in ("to", "_to_copy")}
    assert cast and cast <= graph_fp32_tensors(g2, DEV.device_type, "bf16", autocast=False)


class _NormQKV(nn.Module):
    """A layer norm read by two projections, then GPT's fused-projection head split."""

    def __init__(self, h: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.ln, self.a, self.qkv, self.heads = nn.LayerNorm(h), nn.Linear(h, h), nn.Linear(h, 3 * h), heads

    def forward(self, x):
        b, s, h = x.shape
        y = self.ln(x)
        q, k, v = self.qkv(y).view(b, s, self.heads, 3 * h // self.heads).transpose(1, 2).split(
            h // self.heads, dim=-1)
        return self.a(y).sum() + (q * k * v).sum()


def test_autocast_casts_layer_norm_and_split_backward_are_priced() -> None:
    """Issue 14 (the H100 step, benchmarks/results/h100-2026-11-25/profiles): eager work the time
    model did not price. Under bf16 autocast on CUDA a layer norm reads autocast's fp32 copy of
    its input (a cast kernel: 2 bytes read, 4 written, and its weight's and bias's) and each
    projection reading its fp32 output casts it down (4 read, 2 written), the casts' backward the
    same bytes the other way (`autocast_cast_time`); a layer norm's CUDA backward moves 2.5x its
    forward's bytes; a split's backward concatenates (the input's bytes read and written) and,
    its input a transposed view, copies once more (`split_backward_time`). By hand, N elements."""
    from cost_models.compute import autocast_cast_time, autocast_casts, node_time, priced, split_backward_time
    from cost_models.memory import graph_fp32_tensors

    b, s, h = 2, 64, 256
    N = b * s * h
    g = autopar.capture(_NormQKV(h), (torch.zeros(b, s, h, device="meta"),)).at_batch(b)
    fp32 = graph_fp32_tensors(g, DEV.device_type, "bf16")
    ops = {n.op + ("_1" if n.name.endswith("_1") else ""): n for n in g.calls}
    ln, split = ops["layer_norm"], ops["split"]
    assert ln.name in fp32
    bw = DEV.memory_bandwidth * DEV.memory_efficiency
    k = DEV.kernel_overhead_s
    # the layer norm: x, weight and bias cast up (x has no gradient: the model's input)
    assert sorted(autocast_casts(ln, g._index, fp32, "bf16")) == [(float(h), True), (float(h), True),
                                                                  (float(N), False)]
    cf, cb = autocast_cast_time(ln, g._index, fp32, DEV, "bf16")
    assert cf == pytest.approx(6 * N / bw + 2 * 6 * h / bw + 3 * k)
    assert cb == pytest.approx(2 * 6 * h / bw + 2 * k)
    f, bk = node_time(ln, DEV, "bf16", 1.0, g._index, fp32=fp32)
    # the op itself reads x's fp32 copy (4) and writes fp32 (4), its weight and bias fp32 too
    ln_bytes = 8 * N + 2 * 4 * h
    assert f - cf == pytest.approx(ln_bytes / bw + k)
    assert bk - cb == pytest.approx(2.5 * ln_bytes / bw + k)
    # both projections cast the norm's fp32 output down, each its own cast
    for lin in (n for n in g.calls if n.op == "linear"):
        assert autocast_casts(lin, g._index, fp32, "bf16") == [(float(N), True)]
        assert autocast_cast_time(lin, g._index, fp32, DEV, "bf16") == pytest.approx(
            (6 * N / bw + k, 6 * N / bw + k))
    # fp32 run, or no fp32 set: no casts
    assert autocast_casts(ln, g._index, frozenset(), "bf16") == []
    # the split: free forward; backward a cat and, behind the transpose, the re-layout copy
    assert priced(split) and split.flops == 0 and split.bytes_moved == 0
    qkv = 3 * N * 2                                   # the projection's output in bf16
    assert split_backward_time(split, g._index, DEV, "bf16") == pytest.approx(2 * (2 * qkv / bw + k))
    assert node_time(split, DEV, "bf16", 1.0, g._index, fp32=fp32) == pytest.approx(
        (0.0, 2 * (2 * qkv / bw + k)))
    # a linear layer's bias gradient: its output's bytes read, one reduction kernel (none where
    # the profile measured the backward with its bias sum)
    from cost_models.compute import bias_grad_time
    lin = next(n for n in g.calls if n.op == "linear")
    assert bias_grad_time(lin, g._index, DEV, "bf16") == pytest.approx(2 * lin.outputs[0].numel / bw + k)
    assert bias_grad_time(lin, g._index, DEV.model_copy(update={"matmul_backward_ratio": 2.0}), "bf16") == 0.0
    # autograd sums the norm's two gradients (two projections read it): one add, 3 fp32 tensors
    from cost_models.compute import grad_sum_time
    from cost_models.layouts import graph_layout_copies
    copies = graph_layout_copies(g, DEV.device_type)
    second = [n for n in g.calls if n.op == "linear"][1]          # the second reader pays
    assert copies.grad_sums == {second.name: (ln.name,)}
    assert priced(second, copies)
    assert grad_sum_time(second, DEV, "bf16", 1.0, copies, fp32, g._index) == pytest.approx(3 * 4 * N / bw + k)
    assert grad_sum_time(ln, DEV, "bf16", 1.0, copies, fp32, g._index) == 0.0
    import pickle
    again = pickle.loads(pickle.dumps(copies))
    assert again == copies and again.grad_sums == copies.grad_sums
