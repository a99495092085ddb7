"""Alpa's inter-operator DP (Zheng et al. 2022, §5, eq. 2-5).

Given L layers, sub-mesh choices of sizes `sizes` (in device units) and a stage-cost table
`cost[k, j, m, s]` (the per-micro-batch latency of a stage running layers k..j-1 on sub-mesh m
when it is the first of s remaining stages, so its memory can depend on the activations it
keeps in flight; inf when infeasible, e.g. out of memory), find stages (contiguous layer ranges,
one sub-mesh each, sizes summing to exactly `num_devices`) minimising

    T* = sum_i t_i + (B - 1) * max_j t_j

The max is handled by enumerating its bound t_max over the sorted distinct stage costs: for a
fixed t_max, F(s, k, d) = min over (j, m) with cost <= t_max of cost[k, j, m, s] + F(s-1, j, d - size_m),
F(0, L, 0) = 0, and T*(t_max) = min_s F(s, 0, N) + (B - 1) t_max. The enumeration starts at the
smallest feasible t_max (binary search; feasibility is monotone in it) and stops once
LB + (B - 1) t_max >= best, LB being the unbounded optimum of sum_i t_i (a lower bound for every
t_max). Between the two it runs the DP only where the least sum F drops: F(t_max) never rises
with t_max (a min over a growing set of paths, each summed in the same order), and where it
has not dropped since the last run, the DP returns that run's stages or ones that use a newly
allowed stage, above the last run's t_max: the same sum with a larger max, never better. So
the next drop is found by bisection: GPT 39.1B's sub-mesh DP, 324 runs of the sweep over every
value, 10 drops. `brute_force` enumerates every split and assignment, to check the DP on small
instances; `tests/test_inter_op.py` checks the result against the sweep over every value.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

INF = float("inf")


@dataclass
class DPResult:
    """The best slicing: stages as (first layer, end layer exclusive, sub-mesh index)."""

    total: float                 # sum t_i + (B - 1) max t_i
    sum_t: float
    t_max: float
    stages: list[tuple[int, int, int]]
    evaluations: int = 0         # DP runs (t_max values tried)



def first_feasible(vals: Sequence[float], feasible: Callable[[float], bool]) -> int:
    """Index of the smallest value in ascending `vals` for which the monotone `feasible` holds;
    the caller has checked that the largest one does (binary search)."""
    lo, hi = 0, len(vals) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(vals[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo

def stage_dp(cost: np.ndarray, sizes: Sequence[int], num_devices: int, B: int,
             num_stages: Optional[int] = None) -> Optional[DPResult]:
    """Alpa's DP. `cost` has shape (L, L+1, M, S+1) (index s = 1..S); `num_stages` pins the
    stage count. None when no slicing is feasible."""
    cost = np.asarray(cost, dtype=float)
    L, _, M, S1 = cost.shape
    S = S1 - 1
    if num_stages is not None:
        S = min(S, num_stages)
    sizes = list(sizes)
    uniform = M == 1 and num_stages is not None and sizes[0] * num_stages == num_devices
    finite = cost[np.isfinite(cost)]
    if finite.size == 0:
        return None
    vals = np.unique(finite)
    done: dict[float, Optional[tuple]] = {}

    def run(tmax: float):
        if tmax not in done:
            done[tmax] = (_run_uniform(cost, num_stages, tmax) if uniform else
                          _run_general(np.where(cost <= tmax, cost, INF), sizes, num_devices, S, num_stages))
        return done[tmax]

    unbounded = run(INF)
    if unbounded is None:
        return None
    lb = unbounded[0]
    # smallest feasible t_max
    lo = first_feasible(vals, lambda t: run(t) is not None)
    best: Optional[tuple[float, float, float, list]] = None
    i, r = lo, run(vals[lo])
    while r is not None:
        sum_t, stages = r
        tmax = max(cost[k, j, m, s] for (k, j, m, s) in stages)
        total = sum_t + (B - 1) * tmax
        if best is None or total < best[0] * (1 - 1e-12):
            best = (total, sum_t, tmax, stages)
        # the sweep stops at the first t_max with lb + (B - 1) t_max >= best (none below it
        # can beat the best), as the loop over every value did
        bar = best[0] * (1 - 1e-12)
        stop = bisect.bisect_left(vals, True, lo=i + 1, key=lambda t: lb + (B - 1) * t >= bar)
        # only a t_max at which the least sum drops can give a better plan (the module's note):
        # the first one before `stop`, by bisection (the least sum never rises with t_max)
        a, b, nxt = i + 1, stop, None
        while a < b:
            mid = (a + b) // 2
            rm = run(vals[mid])
            if rm is not None and rm[0] < sum_t:
                b, nxt = mid, (mid, rm)
            else:
                a = mid + 1
        if nxt is None:
            break
        i, r = nxt
    if best is None:
        return None
    total, sum_t, tmax, stages = best
    return DPResult(total, sum_t, tmax, [(k, j, m) for k, j, m, _ in stages], len(done))


def _run_uniform(cost: np.ndarray, p: int, tmax: float = INF):
    """Every stage on the one sub-mesh, exactly p stages of at least one layer each, no stage
    above `tmax`: F_s[k] = min_j cost[k, j, 0, s] + F_{s-1}[j]. The s-th stage from the end
    can only start at k in [p - s, L - s] and end at j in [p - s + 1, L - s + 1] (the stages
    before and after it need a layer each): each step works on that (L - p + 1)-square block
    of the table, not all of it (64 stages of 128 layers: a quarter)."""
    L = cost.shape[0]
    w = L - p + 1
    if w < 1:
        return None
    F = np.full(L + 1, INF)
    F[L] = 0.0
    args = []
    rows = np.arange(w)
    for s in range(1, p + 1):
        k0, j0 = p - s, p - s + 1
        C = cost[k0:k0 + w, j0:j0 + w, 0, s]
        if tmax < INF:
            C = np.where(C <= tmax, C, INF)
        X = C + F[None, j0:j0 + w]                     # (w, w)
        j = X.argmin(axis=1)
        Fn = np.full(L + 1, INF)
        Fn[k0:k0 + w] = X[rows, j]
        args.append(j + j0)
        F = Fn
    if not np.isfinite(F[0]):
        return None
    stages, k = [], 0
    for s in range(p, 0, -1):
        j = int(args[s - 1][k - (p - s)])
        stages.append((k, j, 0, s))
        k = j
    return float(F[0]), stages


def _run_general(cm: np.ndarray, sizes: list[int], N: int, S: int, num_stages: Optional[int]):
    L = cm.shape[0]
    F = np.full((L + 1, N + 1), INF)
    F[L, 0] = 0.0
    hist = []
    best, best_s = INF, 0
    for s in range(1, S + 1):
        Fn = np.full((L + 1, N + 1), INF)
        argj = np.zeros((L, N + 1), dtype=int)
        argm = np.zeros((L, N + 1), dtype=int)
        for m, u in enumerate(sizes):
            if u > N:
                continue
            G = np.full((L + 1, N + 1), INF)
            G[:, u:] = F[:, :N + 1 - u]
            X = cm[:, :, m, s][:, :, None] + G[None, :, :]     # (L, L+1, N+1)
            j = X.argmin(axis=1)                              # (L, N+1)
            v = np.take_along_axis(X, j[:, None, :], axis=1)[:, 0, :]
            better = v < Fn[:L]
            Fn[:L] = np.where(better, v, Fn[:L])
            argj = np.where(better, j, argj)
            argm = np.where(better, m, argm)
        hist.append((argj, argm))
        F = Fn
        if (num_stages is None or s == num_stages) and F[0, N] < best:
            best, best_s = F[0, N], s
    if not np.isfinite(best):
        return None
    stages, k, d = [], 0, N
    for s in range(best_s, 0, -1):
        argj, argm = hist[s - 1]
        j, m = int(argj[k, d]), int(argm[k, d])
        stages.append((k, j, m, s))
        k, d = j, d - sizes[m]
    return float(best), stages


def brute_force(cost: np.ndarray, sizes: Sequence[int], num_devices: int, B: int,
                num_stages: Optional[int] = None) -> Optional[DPResult]:
    """Every split of the layers into contiguous stages and every sub-mesh assignment."""
    cost = np.asarray(cost, dtype=float)
    L, _, M, S1 = cost.shape
    best = None
    for s in range(1, min(L, S1 - 1) + 1):
        if num_stages is not None and s != num_stages:
            continue
        for cuts in itertools.combinations(range(1, L), s - 1):
            bounds = [0, *cuts, L]
            for ms in itertools.product(range(M), repeat=s):
                if sum(sizes[m] for m in ms) != num_devices:
                    continue
                ts = [cost[bounds[i], bounds[i + 1], ms[i], s - i] for i in range(s)]
                if not all(np.isfinite(ts)):
                    continue
                total = sum(ts) + (B - 1) * max(ts)
                if best is None or total < best.total - 1e-12:
                    best = DPResult(total, sum(ts), max(ts),
                                    [(bounds[i], bounds[i + 1], ms[i]) for i in range(s)])
    return best
