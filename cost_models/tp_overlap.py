"""Tensor-parallel collectives run beside the GEMMs that produce or read them, as Transformer
Engine's userbuffers do (`SoftwareSpec.tp_comm_overlap`; TE's `initialize_ub`, module/base.py, and
its CommOverlap / CommOverlapP2P, comm_gemm_overlap.h / comm_gemm_overlap.cpp, identical in the
rules used here from v1.10 to v1.13). What one GEMM and its collective take together:

- "bulk" (`CommOverlapBase::bulk_overlap`): the collective, whole, on `num_sm` SMs of its own
  stream, beside the GEMM launched on every SM (`set_sm_margin` 0) or on the rest (1): max(GEMM,
  collective). The GEMM loses the collective's SMs while both run: ESTIMATE, the GEMM slowed by
  num_sm / sm_count of the collective's duration (set_sm_margin 0: the two kernels share the SMs).
- "pipeline" (`split_overlap_rs`): the GEMM in `num_splits` row chunks, each chunk's reduce-scatter
  after it while the next chunk computes; the last chunk's reduce-scatter waited: g + (n - 1)
  max(g, c) + c, g one chunk's GEMM, c one chunk's reduce-scatter.
- "ring_exchange" (`CommOverlapP2PBase::split_overlap_ag`): the all-gather as tp - 1 point-to-point
  exchanges of one shard with the ring's neighbours on the copy engines (use_ce, TE's default: no
  SMs), the GEMM in tp chunks, each on the shard at hand while the next arrives: (tp - 1) max(g, s)
  + g, s one shard's transfer; with `aggregate` one 1-shard exchange first, then tp / 2 steps of two
  shards: s + (tp / 2 - 1) max(g2, 2s) + g2. As a reduce-scatter (`split_overlap_rs` of the P2P
  class) the same steps and the last shard's send.

A chunk of a GEMM runs at the GEMM curve's efficiency at its own FLOPs (`chunk_gemm_time`); a GEMM
on `sm_count - num_sm` SMs (`set_sm_margin`) at that share of its rate (ESTIMATE: a compute-bound
GEMM's tiles spread over fewer SMs; cuBLAS's SM-count target, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
as TE passes `_math_sms`). The collectives' own speed is NCCL's as the link prices it (ESTIMATE:
userbuffers' kernels and copy-engine transfers taken at the link's bandwidth).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from cost_models.compute import gemm_efficiency


def chunk_gemm_time(gemm_s: float, flops: float, k: int, device: Any, dtype: str) -> float:
    """Seconds of one of `k` equal row chunks of a GEMM priced `gemm_s` whole (`flops` FLOPs):
    its share, at the efficiency of a GEMM of flops / k FLOPs instead of the whole's."""
    if k <= 1 or flops <= 0:
        return gemm_s / max(k, 1)
    whole, part = gemm_efficiency(device, flops, dtype), gemm_efficiency(device, flops / k, dtype)
    return gemm_s / k * (whole / part if part > 0 else 1.0)


def sm_margin_factor(cfg: Any, device: Any) -> float:
    """How much longer a GEMM runs on the SMs the overlap leaves it (`set_sm_margin`: sm_count -
    num_sm of sm_count); 1 without a margin or where the device's SM count is not known."""
    sms = getattr(device, "sm_count", None)
    if not cfg.set_sm_margin or not sms or cfg.num_sm <= 0 or cfg.num_sm >= sms:
        return 1.0
    return sms / (sms - cfg.num_sm)


def overlapped_time(cfg: Any, gemm_s: float, flops: float, comm_s: float, tp: int, device: Any, dtype: str,
                    comm_part: Callable[[float], float], send_s: float,
                    reduce_scatter: bool = False) -> tuple[float, float]:
    """(the GEMM's seconds as it runs beside the collective, the seconds the pair takes) for one
    GEMM of `gemm_s` (`flops` FLOPs a device) and its collective of `comm_s` overlapped as `cfg`
    (`SoftwareSpec.tp_comm_overlap`'s entry) says. `comm_part(f)`: the collective's seconds on a
    fraction f of its bytes (a pipeline chunk's); `send_s`: one shard's point-to-point transfer (a
    ring exchange's step)."""
    r = sm_margin_factor(cfg, device)
    if cfg.method == "bulk":
        sms: Optional[int] = getattr(device, "sm_count", None)
        g = gemm_s * r
        if sms and not cfg.set_sm_margin and cfg.num_sm > 0:
            g += comm_s * min(cfg.num_sm, sms) / sms
        return g, max(g, comm_s)
    if cfg.method == "pipeline":
        n = max(1, cfg.num_splits)
        g = chunk_gemm_time(gemm_s, flops, n, device, dtype) * r
        c = comm_part(1.0 / n)
        return n * g, g + (n - 1) * max(g, c) + c
    # ring_exchange
    if cfg.aggregate and tp > 2 and tp % 2 == 0:
        steps = tp // 2
        g = chunk_gemm_time(gemm_s, flops, steps, device, dtype) * r
        total = send_s + (steps - 1) * max(g, 2 * send_s) + g
        return steps * g, total + (send_s if reduce_scatter else 0.0)
    g = chunk_gemm_time(gemm_s, flops, tp, device, dtype) * r
    total = (tp - 1) * max(g, send_s) + g
    return tp * g, total + (send_s if reduce_scatter else 0.0)
