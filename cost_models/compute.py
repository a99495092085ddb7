"""Compute time of one op from its FLOPs and bytes against a device (roofline plus overhead)."""

from __future__ import annotations

from autopar.schema.cluster import DeviceSpec

MATRIX_OPS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul",
                        "scaled_dot_product_attention", "convolution", "_convolution"})


def gemm_efficiency(device: DeviceSpec, flops: float, dtype: str) -> float:
    """Achieved fraction of peak for a matrix op of `flops` FLOPs (interpolated on the device's
    curve in log-space; a generic curve when it has none)."""
    import math

    pts = device.gemm_efficiency.get(dtype) or device.gemm_efficiency.get("bf16") or []
    if not pts:
        # generic: large GEMMs reach ~75% of peak, falling with size
        pts_x = [1e6, 1e8, 1e9, 1e10, 1e11, 1e12]
        pts_y = [0.02, 0.15, 0.35, 0.6, 0.72, 0.76]
    else:
        pts = sorted(pts, key=lambda p: p.flops)
        pts_x = [p.flops for p in pts]
        pts_y = [p.efficiency for p in pts]
    if flops <= pts_x[0]:
        return pts_y[0]
    if flops >= pts_x[-1]:
        return pts_y[-1]
    lx = math.log(flops)
    for (x0, y0), (x1, y1) in zip(zip(pts_x, pts_y), zip(pts_x[1:], pts_y[1:])):
        if flops <= x1:
            t = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return pts_y[-1]


def op_time(op: str, flops: float, bytes_moved: float, device: DeviceSpec, dtype: str = "bf16") -> float:
    """Forward seconds of one op with `flops` FLOPs and `bytes_moved` bytes (0 for free views)."""
    if flops <= 0 and bytes_moved <= 0:
        return 0.0
    mem = bytes_moved / (device.memory_bandwidth * device.memory_efficiency)
    if op in MATRIX_OPS:
        comp = flops / (device.peak(dtype) * gemm_efficiency(device, flops, dtype))
    else:
        comp = flops / (device.peak("fp32") if dtype == "fp32" else device.peak(dtype) * 0.25)
    return max(comp, mem) + device.kernel_overhead_s


def backward_factor(op: str) -> float:
    """Backward work relative to forward: matrix ops compute input and weight gradients (2x)."""
    return 2.0 if op in MATRIX_OPS else 1.0
