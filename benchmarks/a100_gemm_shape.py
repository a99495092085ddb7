"""Does an A100 GEMM's efficiency depend on its shape beyond its FLOPs? A check of the FLOPs-indexed
curve of hardware_profiles/dgx-a100-*.yaml against the one published A100 GEMM table by shape found.

    python benchmarks/a100_gemm_shape.py --vidur PATH   # PATH: a checkout of github.com/microsoft/vidur

The table: Vidur's A100 compute profiles (Agrawal et al., MLSys 2024; github.com/microsoft/vidur at
7d47513, data/profiling/compute/a100/<model>/mlp.csv, added in bee57da): the median kernel time of
each linear layer of eight models (phi-2, Llama-2 7B/70B, Llama-3 8B/70B, CodeLlama-34B,
InternLM-20B, Qwen-72B) at tensor parallelism 1, 2, 4, 8 and 1 to 32768 tokens, fp16 under
torch.inference_mode, each time the CUDA kernels' durations from a torch profiler trace of 20
back-to-back repeats (vidur/profiling/mlp/mlp_wrapper.py, utils/record_function_tracer.py). A
layer's shape comes from the row's own columns: M = num_tokens; (K, N) = (h, (heads + 2 kv heads)
x head dim / tp) for attn_pre_proj, (heads x head dim / tp, h) for attn_post_proj, (h, [2 x]
ffn / tp) for mlp_up_proj, (ffn / tp, h) for mlp_down_proj. Vidur's docs/profiling.md does not
say which A100 80GB (PCIe or SXM4) ran them, so only ratios within the table are read here.

Kept: M >= 2048 (training GEMMs, as benchmarks/a100_gemm_curve.py) and >= 1e10 FLOPs.
Efficiency = 2MNK / (t x 312 TFLOP/s); a shape's ratio = its efficiency over the median of every
kept row in the same half-decade of FLOPs, i.e. what a FLOPs-only curve drawn through this
table would miss for that shape. Nothing is fitted; the profiles are not changed by it.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

PEAK = 312e12          # A100 dense fp16/bf16 tensor-core peak (datasheet)
MIN_TOKENS = 2048      # training GEMMs, as benchmarks/a100_gemm_curve.py
MIN_FLOPS = 1e10
SMALL = 2048           # shapes listed one by one: K or N below this
K_EDGES = (0, 768, 1280, 2048, 4096, 8192, math.inf)


def shapes(row: dict[str, str]) -> dict[str, tuple[int, int]]:
    """(K, N) of each linear layer of one Vidur mlp.csv row."""
    h, heads, kv = int(row["n_embd"]), int(row["n_head"]), int(row["n_kv_head"])
    ffn, tp = int(row["n_expanded_embd"]), int(row["num_tensor_parallel_workers"])
    d = h // heads
    up = (2 if row["use_gated_mlp"] == "True" else 1) * ffn
    return {"attn_pre_proj": (h, (heads + 2 * kv) * d // tp), "attn_post_proj": (heads * d // tp, h),
            "mlp_up_proj": (h, up // tp), "mlp_down_proj": (ffn // tp, h)}


def measured(root: Path) -> list[tuple[int, int, int, float]]:
    """(M, N, K, efficiency) of every kept linear layer under root/data/profiling/compute/a100."""
    files = sorted((root / "data/profiling/compute/a100").glob("**/mlp.csv"))
    if not files:
        raise SystemExit(f"no data/profiling/compute/a100/**/mlp.csv under {root}: pass a checkout of "
                         f"github.com/microsoft/vidur")
    out = []
    for f in files:
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                m = int(row["num_tokens"])
                if m < MIN_TOKENS:
                    continue
                for op, (k, n) in shapes(row).items():
                    flops = 2.0 * m * n * k
                    if flops >= MIN_FLOPS:
                        out.append((m, n, k, flops / (float(row[f"time_stats.{op}.median"]) * 1e-3 * PEAK)))
    return out


def ratios(pts: list[tuple[int, int, int, float]]) -> list[tuple[int, int, int, float, float]]:
    """(M, N, K, efficiency, ratio to its half-decade's median) of every point."""
    def bucket(m: int, n: int, k: int) -> int:
        return math.floor(2 * math.log10(2.0 * m * n * k))
    by: dict[int, list[float]] = defaultdict(list)
    for m, n, k, e in pts:
        by[bucket(m, n, k)].append(e)
    med = {b: statistics.median(es) for b, es in by.items()}
    return [(m, n, k, e, e / med[bucket(m, n, k)]) for m, n, k, e in pts]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur", type=Path, required=True, help="a checkout of github.com/microsoft/vidur")
    args = ap.parse_args(argv)
    rows = ratios(measured(args.vidur))
    print(f"{len(rows)} kept layer times, {len({(n, k) for _, n, k, _, _ in rows})} shapes (N, K)")
    print("\nby K (the reduction dimension):   median efficiency, median ratio, rows, shapes")
    for lo, hi in zip(K_EDGES, K_EDGES[1:]):
        sel = [r for r in rows if lo <= r[2] < hi]
        if sel:
            print(f"  K in [{lo}, {hi}):".ljust(28) + f"{statistics.median(r[3] for r in sel):.3f}  "
                  f"{statistics.median(r[4] for r in sel):.3f}  {len(sel):5d}  {len({(r[1], r[2]) for r in sel})}")
    print(f"\nshapes with K or N < {SMALL} (M >= 8192 where measured there):")
    by: dict[tuple[int, int], list[tuple[int, int, int, float, float]]] = defaultdict(list)
    for r in rows:
        if min(r[1], r[2]) < SMALL:
            by[(r[1], r[2])].append(r)
    for (n, k), sel in sorted(by.items(), key=lambda x: (min(x[0]), x[0])):
        big = [r for r in sel if r[0] >= 8192] or sel
        print(f"  N = {n:5d}, K = {k:5d}:  efficiency {statistics.median(r[3] for r in big):.3f}, "
              f"ratio {statistics.median(r[4] for r in big):.3f}  ({len(big)} rows, M {min(r[0] for r in big)}"
              f"-{max(r[0] for r in big)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
