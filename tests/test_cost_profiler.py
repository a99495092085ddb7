"""The machine profiler (quick mode) writes a profile that ClusterSpec.load accepts."""

from __future__ import annotations

import time
from pathlib import Path

import autopar
from cost_models.communication import axis_collective_time
from cost_models.profiler import profile_machine


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
