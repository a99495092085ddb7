"""How long `autopar sweep` takes (issue 16): Llama 3 70B over 2 cluster types x 7 sizes (target
at most 1 minute on 2 cores) and GPT-3 175B over 3 types x 8 sizes (at most 2 minutes).

    python benchmarks/sweep_time.py [--only llama3-70b|gpt3-175b] [--unshared] [--tables]

Each case runs in this process on a new cache directory (captures, schedule walks, per-layer
ILP solutions: `autopar.capture.cache`, `inter_op.ilp_cache`): the model is captured into it
first (printed apart), then `autopar.sweep` runs twice: "first" solves every per-layer ILP (the
cluster types' solutions shared across their sizes in memory, `planner.ProviderCache`), "again"
reads them from the disk cache the first left, as a user's next sweep of the model does. The
wall clock and the process's CPU time (user + system: what other jobs on a shared machine
inflate least) are printed beside the load average before and after. `--unshared` also times
a first sweep on another new cache directory planning every point as `autopar.plan` does alone
(only the disk cache shared, as it fills); `--tables` prints each sweep's table.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from autopar.capacity import parse_nodes, sweep
from autopar.capture import capture
from autopar.planner import resolve_model
from autopar.schema.plan import format_table

# name: (model, cluster types, node counts, tokens, target seconds)
CASES = {
    "llama3-70b": ("llama3-70b", ["dgx-a100-80g", "dgx-h100"], "1..64", 15e12, 60.0),
    "gpt3-175b": ("gpt3-175b", ["dgx-a100-80g", "dgx-h100", "hgx-h200"], "1..128", 300e9, 120.0),
}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(case: str, share: bool, cache: str) -> dict:
    model, clusters, nodes, tokens, target = CASES[case]
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), _cpu()
    res = sweep(model, clusters, parse_nodes(nodes), tokens=tokens, cache=cache, share_providers=share,
                keep_plans=False)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"case": case, "shared": share, "res": res, "wall": wall, "cpu": cpu, "target": target,
            "load": (load0, os.getloadavg()[0])}


def _capture(case: str, cache: str) -> float:
    b = resolve_model(CASES[case][0], None, None)
    t = time.perf_counter()
    capture(b.model, b.example_inputs, name=b.name, cache=cache)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case names: " + ", ".join(CASES))
    ap.add_argument("--unshared", action="store_true", help="also plan every point from scratch")
    ap.add_argument("--tables", action="store_true", help="print each sweep's table")
    args = ap.parse_args()
    cases = args.only.split(",") if args.only else list(CASES)
    rows = []
    cols = ["case", "types x sizes", "fit", "sweep", "wall s", "cpu s", "slowest point s", "target s", "met",
            "load avg before / after"]
    for case in cases:
        runs = []
        with tempfile.TemporaryDirectory(prefix="autopar-sweep-bench-") as d:
            # a user's first sweep captures the model too: its time counts in "first"
            cap = _capture(case, d)
            print(f"{case}: captured into a new cache in {cap:.1f} s", flush=True)
            first = run(case, True, d)
            first = {**first, "wall": first["wall"] + cap, "cpu": first["cpu"] + cap}
            runs += [("first (capture included)", first), ("again", run(case, True, d))]
        if args.unshared:
            with tempfile.TemporaryDirectory(prefix="autopar-sweep-bench-") as d:
                _capture(case, d)
                runs.append(("first, every point alone", run(case, False, d)))
        for label, r in runs:
            res = r["res"]
            fits = sum(p.iteration_time_s is not None for p in res.points)
            types = len({p.cluster for p in res.points})
            rows.append([case, f"{types} x {len(res.points) // types}", str(fits), label,
                         f"{r['wall']:.1f}", f"{r['cpu']:.1f}",
                         f"{max(p.search_time_s for p in res.points):.1f}", f"{r['target']:.0f}",
                         "yes" if r["wall"] <= r["target"] else "NO",
                         f"{r['load'][0]:.1f} / {r['load'][1]:.1f}"])
            print(format_table(cols, rows[-1:]), flush=True)
        if args.tables:
            print(runs[0][1]["res"].summary(), flush=True)
    print(f"\n{os.cpu_count()} CPUs")
    print(format_table(cols, rows))


if __name__ == "__main__":
    main()
