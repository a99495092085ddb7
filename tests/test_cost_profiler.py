"""The machine profiler (quick mode) writes a profile that ClusterSpec.load accepts, with the
measured costs the compute model uses beyond the roofline (element-wise backward rates, fused
attention rates, the optimizer step's per-tensor and per-element cost)."""

from __future__ import annotations

import time
from pathlib import Path

import autopar
from cost_models.communication import axis_collective_time
from cost_models.compute import attention_time, op_backward_time, optimizer_step_time
from cost_models.profiler import _layer_param_sizes, profile_machine


def test_quick_profile_is_loadable(tmp_path: Path) -> None:
    out = tmp_path / "this-machine.yaml"
    t0 = time.perf_counter()
    spec = profile_machine(out, num_processes=2, quick=True, progress=False)
    assert time.perf_counter() - t0 < 60
    c = autopar.ClusterSpec.load(out)
    assert c.devices_per_node == 2 and c.num_devices == 2
    assert c.device.peak_flops["fp32"] > 1e8 and c.device.memory_bandwidth > 1e8
    assert set(c.device.gemm_efficiency) == {"fp32", "bf16"}
    kinds = {m.kind for m in c.intra_node.measured}
    assert {"all_reduce", "send_recv"} <= kinds
    for field in ("peak_flops", "gemm_efficiency", "memory_bandwidth", "memory_bytes", "kernel_overhead_s"):
        assert "measured" in c.device.sources[field] or field == "memory_bytes"
    assert "measured" in c.intra_node.sources["bandwidth"]
    # the measured table drives the communication model
    m = next(m for m in c.intra_node.measured if m.kind == "all_reduce")
    assert axis_collective_time("all_reduce", m.bytes, c, [0, 1]) == m.seconds
    assert spec.device.peak_flops == c.device.peak_flops
    assert not list(tmp_path.glob(".*.tmp"))                 # written atomically, no leftovers
    _check_measured_costs(c)


def _check_measured_costs(c: autopar.ClusterSpec) -> None:
    """The profile carries the measured backward, attention and optimizer costs, each with its
    source, and the compute model takes them up."""
    d = c.device
    for field in ("op_backward_flops", "attention_flops", "optimizer_step", "matmul_backward_ratio"):
        assert "measured" in d.sources[field]
    assert {"gelu", "layer_norm", "native_layer_norm", "softmax", "cross_entropy_loss"} <= set(d.op_backward_flops)
    assert all(r > 1e6 for r in d.op_backward_flops.values())
    assert set(d.attention_flops) == {"fp32", "bf16"}
    for pts in d.attention_flops.values():
        assert len(pts) >= 2 and [p.flops_per_head for p in pts] == sorted(p.flops_per_head for p in pts)
        assert all(p.forward_flops > 1e6 and p.backward_flops > 1e6 for p in pts)
    assert d.optimizer_step.per_tensor_s > 0 and d.optimizer_step.per_element_s >= 0
    assert 0.5 < d.matmul_backward_ratio < 20
    # the compute model uses them
    assert op_backward_time("gelu", 18e6, 8e6, d, "fp32") >= 18e6 / d.op_backward_flops["gelu"]
    fwd, bwd = attention_time((8, 4, 64, 32), (8, 4, 64, 32), (8, 4, 64, 32), d, "fp32")
    flops = 4.0 * 32 * 64 * 64 * 32
    assert fwd >= flops / max(p.forward_flops for p in d.attention_flops["fp32"])
    assert optimizer_step_time(1e6, d, "fp32", param_tensors=10) == \
        1e6 * d.optimizer_step.per_element_s + 10 * d.optimizer_step.per_tensor_s


def test_layer_param_sizes_are_a_gpt_layer() -> None:
    h = 256
    sizes = _layer_param_sizes(h)
    assert len(sizes) == 12 and sum(sizes) == 12 * h * h + 13 * h


def test_alignment_probe_becomes_the_profile_table() -> None:
    """On a GPU the profiler times bf16 GEMMs whose output width is aligned to 16, 8, 4 and 2 bytes;
    the rates over the aligned one are the profile's `gemm_alignment` (capped at 1: noise never
    makes a ragged width faster), which the cost model then applies (CPU profiles measure none)."""
    from cost_models.profiler import _measured_costs, _plan

    f = 2.0 * 4096 ** 3
    res = {"gemm_align": [(16, f, 1e-3), (2, f, 5e-3), (4, f, 3e-3), (8, f, 0.9e-3)]}
    fields, sources = _measured_costs(res, "measured")
    assert [(p.bytes, round(p.efficiency, 3)) for p in fields["gemm_alignment"]] == [
        (2, 0.2), (4, 0.333), (8, 1.0), (16, 1.0)]
    assert "gemm_alignment" in sources
    assert _plan(False, cuda=True).get("align") and not _plan(False, cuda=False).get("align")
    assert "gemm_alignment" not in _measured_costs({"gemm_align": []}, "measured")[0]
