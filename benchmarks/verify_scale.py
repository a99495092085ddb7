"""`autopar verify` at full scale: the time to build and step every kind of rank of a large plan
on fake tensors and a fake process group, and what it finds (issue 15).

    python benchmarks/verify_scale.py [--only SUBSTRING] [--jobs N] [--json] [--top N] [--rank R ...]
                                      [--all-microbatches]

Cases: GPT-3 175B on 128 DGX A100 nodes (`autopar plan --model gpt3-175b --cluster dgx-a100-80g
--nodes 128 -b 1536`) and Llama 2 70B on 8 DGX H100 nodes (`--model llama2-70b --cluster
dgx-h100 --nodes 8 -b 1024`); and, for `--only search-table --rank 0`, the search-time table's
Llama 3 405B on 2048 DGX H100 nodes and GPT 1T on 384 DGX A100 nodes. Each is planned freely
(the capture cache as the CLI uses it), then
`autopar.runtime.verify.verify` with `--jobs` worker processes (default 2). Printed per case: the
plan's world size and rank kinds, the time to plan and to verify, per kind the tracked peak
against the plan's predicted peak for its stage, (predicted - tracked) / tracked, and whether
the collectives match. A difference over 10% is marked; `--top N` lists, for those kinds, the N
largest tensors at the tracked peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [
    {"name": "gpt3-175b", "model": "gpt3-175b", "cluster": "dgx-a100-80g", "nodes": 128, "gbs": 1536},
    {"name": "llama2-70b", "model": "llama2-70b", "cluster": "dgx-h100", "nodes": 8, "gbs": 1024},
    # the search-time table's two other free plans (`benchmarks/search_time.py`'s models), run only
    # when `--only` names them, meant with `--rank 0` (their first device set): all their kinds are 8
    # and 32, hours of CPU on 2 cores
    {"name": "search-table-405b", "model": "benchmarks.search_time:llama3_405b", "cluster": "dgx-h100",
     "nodes": 2048, "gbs": 2048, "opt_in": True},
    {"name": "search-table-1t", "model": "benchmarks.search_time:gpt_1t", "cluster": "dgx-a100-80g",
     "nodes": 384, "gbs": 3072, "opt_in": True},
]


def run_case(case: dict, jobs: int, top: int, all_microbatches: bool = False,
             ranks: list[int] | None = None) -> dict:
    import autopar
    from autopar.planner import plan
    from autopar.runtime.verify import verify
    from autopar.schema.plan import format_bytes

    t0 = time.perf_counter()
    cluster = autopar.ClusterSpec.load(case["cluster"], num_nodes=case["nodes"])
    p = plan(case["model"], cluster, global_batch_size=case["gbs"], cache=True)
    t_plan = time.perf_counter() - t0
    rep = verify(p, case["model"], jobs=jobs, top=top, check=False, progress=True, all_microbatches=all_microbatches,
                 ranks=ranks)
    rows = []
    for rc in rep.ranks:
        rows.append({"rank": rc.rank, "stages": rc.stages, "ranks_of_kind": rc.ranks_of_kind,
                     "tracked": rc.tracked_peak_bytes, "tracked_phase": rc.tracked_peak_phase,
                     "predicted": rc.predicted_peak_bytes, "error": rc.memory_error,
                     "tracked_categories": rc.tracked_categories, "predicted_categories": rc.predicted_categories,
                     "build_error": rc.error, "time_s": rc.time_s, "peak_tensors": rc.peak_tensors,
                     "stepped": rc.microbatches_stepped, "cpu_s": rc.cpu_s})
    return {"case": case["name"], "cluster": f"{case['nodes']} x {case['cluster']}",
            "world_size": p.world_size,
            "layout": f"dp{p.dp} tp{p.tp} pp{p.pp} {p.schedule} M={p.num_microbatches} zero={p.zero_stage}"
                      f"{' recompute' if any(s.recompute != 'none' for s in p.stages) else ''}",
            "kinds": len(rep.ranks), "plan_s": t_plan, "verify_s": rep.time_s, "jobs": jobs,
            "load_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "collectives_match": rep.collectives_match, "collectives": rep.collectives_measured,
            "failures": rep.failures, "capacity": format_bytes(rep.capacity_bytes), "ranks": rows}


def _collectives(res: dict) -> str:
    if res["collectives_match"] is None:
        return "not combined (not every stage's representative verified)"
    return "match" if res["collectives_match"] else f"DIFFER: {res['collectives']}"


def show(res: dict, top: int) -> None:
    from autopar.schema.plan import format_bytes, format_table

    print(f"\n{res['case']} on {res['cluster']} ({res['world_size']} ranks, {res['layout']}): "
          f"{res['kinds']} rank kinds, planned in {res['plan_s']:.1f} s, verified in {res['verify_s']:.1f} s "
          f"({res['jobs']} workers, load average {res['load_before']:.1f} after planning), "
          f"collectives {_collectives(res)}")
    rows = []
    for r in res["ranks"]:
        err = r["error"]
        mark = "" if err is None or abs(err) <= 0.10 else "  > 10%"
        rows.append([",".join(map(str, r["stages"])), str(r["rank"]), str(r["ranks_of_kind"]),
                     format_bytes(r["tracked"]) if not r["build_error"] else "FAILED", r["tracked_phase"],
                     format_bytes(r["predicted"]) if r["predicted"] is not None else "-",
                     (f"{err:+.1%}" if err is not None else "-") + mark, str(r["stepped"]), f"{r['time_s']:.0f}",
                     f"{r['cpu_s']:.0f}"])
    print(format_table(["stage", "rank", "ranks", "tracked peak", "phase", "predicted", "pred-tracked",
                        "micro-batches stepped", "time s", "cpu s"], rows))
    cpu = sum(r["cpu_s"] for r in res["ranks"])
    print(f"CPU time of the kinds: {cpu:.0f} s in all ({cpu / res['jobs']:.0f} s per worker)")
    for f in res["failures"]:
        print(f"FAIL: {f}")
    for r in res["ranks"]:
        if r["error"] is not None and abs(r["error"]) > 0.10:
            cats = ", ".join(f"{k} {format_bytes(v)} / {format_bytes(r['predicted_categories'].get(k, 0))}"
                             for k, v in r["tracked_categories"].items())
            print(f"  stage {r['stages']}: tracked / predicted at the peak: {cats}")
            for t in r["peak_tensors"][:top]:
                print(f"    {format_bytes(t['bytes'])} {t['label']} {t.get('op', '')} {t.get('shape', '')} "
                      f"{t.get('phase', '')} {t.get('pass', '')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="cases whose name contains this")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--top", type=int, default=0, help="largest tensors at the peak of a kind off by > 10%%")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank", type=int, action="append", help="verify only the kinds of these ranks")
    ap.add_argument("--all-microbatches", action="store_true",
                    help="step every micro-batch (default: the fewest reaching the same schedule states)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = []
    for case in CASES:
        if a.only in case["name"] and (a.only or not case.get("opt_in")):
            res = run_case(case, a.jobs, a.top, a.all_microbatches, a.rank)
            out.append(res)
            if not a.json:
                show(res, a.top)
    if a.json:
        print(json.dumps(out, indent=2))
    # a case that failed to verify is a miss: the exit status says so
    return 1 if any(r.get("failures") for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
