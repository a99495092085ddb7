"""Alpha-beta costs of collectives (nccl-tests PERFORMANCE.md conventions).

For n devices, S bytes (the whole buffer: reduced, gathered, or before scattering), per-device
bandwidth B (bytes/s per direction) and latency alpha:
  all-reduce      2(n-1) alpha + 2(n-1)/n * S/B
  all-gather      (n-1) alpha + (n-1)/n * S/B
  reduce-scatter  (n-1) alpha + (n-1)/n * S/B
  all-to-all      (n-1) alpha + (n-1)/n * S/B
  send/recv       alpha + S/B
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def collective_time(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for collective `kind` of `nbytes` over `n` devices; beta = 1 / bandwidth."""
    if kind == "send_recv":
        return alpha + nbytes * beta if nbytes > 0 else 0.0
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * alpha + (n - 1) / n * nbytes * beta
    raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(COLLECTIVES)}")
