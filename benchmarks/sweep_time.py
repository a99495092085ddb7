"""How long `autopar sweep` takes (issue 16): Llama 3 70B over 2 cluster types x 7 sizes (target
at most 1 minute on 2 cores) and GPT-3 175B over 3 types x 8 sizes (at most 2 minutes).

    python benchmarks/sweep_time.py [--only llama3-70b|gpt3-175b] [--unshared] [--tables]

Each case is one `autopar.sweep` call in this process with the capture cache warm (the first
case captures its model once; that time is printed apart: a user's second sweep of a model
reads the cache too). The wall clock and the process's CPU time (user + system: what other
jobs on a shared machine inflate least) are printed beside the load average before and after.
`--unshared` also times the same sweep planning every point from scratch (no intra-op solutions
shared across sizes), which is what the sharing saves; `--tables` prints each sweep's table.
"""

from __future__ import annotations

import argparse
import os
import resource
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


def run(case: str, share: bool) -> dict:
    model, clusters, nodes, tokens, target = CASES[case]
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), _cpu()
    res = sweep(model, clusters, parse_nodes(nodes), tokens=tokens, cache=True, share_providers=share,
                keep_plans=False)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"case": case, "shared": share, "res": res, "wall": wall, "cpu": cpu, "target": target,
            "load": (load0, os.getloadavg()[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case names: " + ", ".join(CASES))
    ap.add_argument("--unshared", action="store_true", help="also plan every point from scratch")
    ap.add_argument("--tables", action="store_true", help="print each sweep's table")
    args = ap.parse_args()
    cases = args.only.split(",") if args.only else list(CASES)
    rows = []
    for case in cases:
        b = resolve_model(CASES[case][0], None, None)
        t = time.perf_counter()
        capture(b.model, b.example_inputs, name=b.name, cache=True)     # warm the capture cache
        print(f"{case}: capture cache warmed in {time.perf_counter() - t:.1f} s", flush=True)
        for share in ([True, False] if args.unshared else [True]):
            r = run(case, share)
            res = r["res"]
            fits = sum(p.iteration_time_s is not None for p in res.points)
            types = len({p.cluster for p in res.points})
            rows.append([case, f"{types} x {len(res.points) // types}", str(fits),
                         "shared" if share else "from scratch", f"{r['wall']:.1f}", f"{r['cpu']:.1f}",
                         f"{max(p.search_time_s for p in res.points):.1f}", f"{r['target']:.0f}",
                         "yes" if r["wall"] <= r["target"] else "NO",
                         f"{r['load'][0]:.1f} / {r['load'][1]:.1f}"])
            print(format_table(["case", "types x sizes", "fit", "intra-op costs", "wall s", "cpu s",
                                "slowest point s", "target s", "met", "load avg before / after"], rows[-1:]),
                  flush=True)
            if args.tables:
                print(res.summary(), flush=True)
    print(f"\n{os.cpu_count()} CPUs")
    print(format_table(["case", "types x sizes", "fit", "intra-op costs", "wall s", "cpu s", "slowest point s",
                        "target s", "met", "load avg before / after"], rows))


if __name__ == "__main__":
    main()
