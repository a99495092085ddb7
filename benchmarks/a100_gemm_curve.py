"""The A100 bf16 GEMM-efficiency curve of hardware_profiles/dgx-a100-*.yaml, derived from published
measurements (no fitting to the calibration runs).

    python benchmarks/a100_gemm_curve.py            # the curve as the profiles' YAML rows
    python benchmarks/a100_gemm_curve.py --points   # every measured shape and its efficiency

Shape of the curve: the A100 cuBLAS fp16 matmul times of LLMCompass (Zhang et al., ISCA 2024,
"LLMCompass: Enabling Efficient Hardware Design for Large Language Model Inference"), artifact
file ae/figure5/ab/real_hardware/matmul_A100.csv of github.com/PrincetonUniversity/LLMCompass
(their Figure 5a/5b; the GPU its simulator names A100_80GB, SXM or PCIe not stated): two
sweeps, M x 12288 x 12288 for M = 64..32768 and 8192 x K x K for K = 64..32768, each time the
median over repeated single launches (torch.matmul, then a synchronise). The construction:

1. keep the shapes whose token dimension M is at least 2048: in a training GEMM M is micro-batch
   x sequence length (>= 2048 in every calibration case); M = 64..1024 are decode-like shapes;
2. efficiency = 2MNK / ((t - 21 us) x 312 TFLOP/s): 21 us is LLMCompass's own per-launch
   constant for the A100 (the `+ 2.1e-5` its simulator adds to every matmul of the same figure,
   the host launch and synchronise that single timed launches pay and back-to-back training
   kernels do not; autopar adds its own `kernel_overhead_s` per kernel);
3. one point per half-decade of FLOPs: the geometric mean of the FLOPs and the median
   efficiency of the shapes in it.

Level (an estimate, labelled so in the profile): the curve is scaled so that its best point
equals the best sustained bf16 matmul measured on an A100 SXM, 271.2 TFLOP/s = 86.9% of peak
(Maximum Achievable Matmul FLOPS, S. Bekman, ml-engineering, compute/accelerator/README.md: mean
of 100 back-to-back iterations of the best of a shape sweep, torch 2.6.0+cu126). LLMCompass's
best shape reaches 94.1%; the two A100 measurements disagree by that ratio (0.924), and
back-to-back bf16, as MAMF measures, is what training runs. The README reports the calibration
with the unscaled curve and with the level +-5%.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Optional

PEAK = 312e12                # A100 dense bf16/fp16 tensor-core peak (datasheet)
LAUNCH_S = 2.1e-5            # LLMCompass's A100 per-launch constant (ae/figure5/ab/test_matmul.py)
MAMF = 0.869                 # 271.2 / 312 TFLOP/s, A100 SXM bf16 (ml-engineering MAMF table)
MIN_TOKENS = 2048            # training GEMMs: M = micro-batch x sequence >= 2048

# (M, N, K, median ms) from LLMCompass ae/figure5/ab/real_hardware/matmul_A100.csv
LLMCOMPASS_A100: tuple[tuple[int, int, int, float], ...] = (
    (64, 12288, 12288, 0.1900), (128, 12288, 12288, 0.2003), (256, 12288, 12288, 0.3185),
    (512, 12288, 12288, 0.6118), (1024, 12288, 12288, 1.1990), (2048, 12288, 12288, 2.3586),
    (4096, 12288, 12288, 4.4576), (8192, 12288, 12288, 8.6216), (16384, 12288, 12288, 17.0307),
    (32768, 12288, 12288, 35.4407),
    (8192, 64, 64, 0.0296), (8192, 128, 128, 0.0310), (8192, 256, 256, 0.0356), (8192, 512, 512, 0.0471),
    (8192, 1024, 1024, 0.0927), (8192, 2048, 2048, 0.2818), (8192, 4096, 4096, 1.0210),
    (8192, 8192, 8192, 3.9614), (8192, 16384, 16384, 15.0087), (8192, 32768, 32768, 61.1346))


def measured_points() -> list[tuple[float, float]]:
    """(FLOPs, efficiency) of every kept shape (steps 1 and 2 of the module docstring), by FLOPs."""
    pts = []
    for m, n, k, ms in LLMCOMPASS_A100:
        if m < MIN_TOKENS:
            continue
        flops = 2.0 * m * n * k
        pts.append((flops, flops / ((ms * 1e-3 - LAUNCH_S) * PEAK)))
    return sorted(pts)


def curve(level: Optional[float] = MAMF) -> list[tuple[float, float]]:
    """The profile's (FLOPs, efficiency) rows: half-decade medians, scaled so that the best
    measured shape sits at `level` (None: unscaled)."""
    pts = measured_points()
    scale = 1.0 if level is None else level / max(e for _, e in pts)
    buckets: dict[int, list[tuple[float, float]]] = {}
    for f, e in pts:
        buckets.setdefault(math.floor(2 * math.log10(f)), []).append((f, e))
    rows = []
    for key in sorted(buckets):
        fs, es = zip(*buckets[key])
        rows.append((math.exp(sum(map(math.log, fs)) / len(fs)), statistics.median(es) * scale))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", action="store_true", help="every kept shape, unscaled")
    ap.add_argument("--unscaled", action="store_true", help="the curve at LLMCompass's own level")
    args = ap.parse_args(argv)
    if args.points:
        for f, e in measured_points():
            print(f"{f:.3g} FLOPs: {e:.3f} of peak")
        return 0
    for f, e in curve(None if args.unscaled else MAMF):
        print(f"      - {{flops: {f:.3g}, efficiency: {e:.3f}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
