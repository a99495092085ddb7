"""The zoo's GPT and Llama plans from 8 to 1536 devices (and Hugging Face GPT-2's on 8; context- and
expert-parallel plans: Llama 3 8B at 131072 tokens, DeepSeekMoE 16B, HF Mixtral 8x7B), each
built and stepped at full scale by `autopar verify`: tracked peak memory against the plan's
predicted peak for every kind of rank, and the collectives (issue 15: within 10% for every
stage, ZeRO-1/2/3, recomputation and interleaved pipelines included).

    python benchmarks/verify_sweep.py [--only SUBSTRING] [--jobs N] [--json]

Each case is planned by `autopar.plan` (the capture cache as the CLI uses it), freely or with
the constraints it names, then verified in a fresh process (`autopar.verify` with `--jobs`
workers: DTensor keeps sharding decisions keyed by process-group names, which a second fake
world in one process would reuse). A case that does not plan or whose ranks fail to build
counts as a miss. Printed: per case the layout, the rank kinds, the worst |predicted - tracked|
/ tracked over its kinds, whether the collectives match, and the CPU time of the verify; then
the summary line. GPT-3 175B on 128 nodes and Llama 2 70B on 8 nodes are `verify_scale.py`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name, model, cluster, nodes, global batch, constraints (autopar.Constraints fields; none: free)
CASES = [
    ("gpt3-1.3b 8xA100 free", "gpt3-1.3b", "dgx-a100-80g", 1, 512, {}),
    ("gpt3-1.3b 8xA100 ZeRO-3", "gpt3-1.3b", "dgx-a100-80g", 1, 512, {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 3}),
    ("gpt3-2.7b 8xA100 tp4 full recompute ZeRO-1", "gpt3-2.7b", "dgx-a100-80g", 1, 512,
     {"dp": 2, "tp": 4, "pp": 1, "recompute": "full", "zero_stage": 1}),
    ("llama3-8b 8xH100 free", "llama3-8b", "dgx-h100", 1, 256, {}),
    ("llama3-8b 8xH100 tp2 ZeRO-2 selective", "llama3-8b", "dgx-h100", 1, 256,
     {"dp": 4, "tp": 2, "pp": 1, "zero_stage": 2, "recompute": "selective"}),
    ("gpt3-6.7b 16xA100 tp2 pp4 interleaved", "gpt3-6.7b", "dgx-a100-80g", 2, 512,
     {"dp": 2, "tp": 2, "pp": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2}),
    ("llama2-13b 32xH100 ZeRO-3 full recompute", "llama2-13b", "dgx-h100", 4, 512,
     {"dp": 32, "tp": 1, "pp": 1, "zero_stage": 3, "recompute": "full"}),
    ("gpt3-13b 64xA100 free", "gpt3-13b", "dgx-a100-80g", 8, 1024, {}),
    ("llama3-70b 128xH100 free", "llama3-70b", "dgx-h100", 16, 1024, {}),
    # issue 18's case: Megatron's 39.1B GPT planned freely on 64 DGX A100 nodes, batch 1536
    ("gpt 39.1B 512xA100 free", "benchmarks.search_time:gpt_39b", "dgx-a100-80g", 64, 1536, {}),
    ("gpt3-175b 1024xA100 tp8 pp16 1F1B", "gpt3-175b", "dgx-a100-80g", 128, 1536,
     {"dp": 8, "tp": 8, "pp": 16, "schedule": "1f1b"}),
    ("gpt3-175b 1536xA100 free", "gpt3-175b", "dgx-a100-80g", 192, 1536, {}),
    # a model written by others: Hugging Face GPT-2 (124M, its default dropout and gelu_new)
    ("hf gpt2 8xA100 free", "hf:gpt2", "dgx-a100-80g", 1, 256, {}),
    ("hf gpt2 8xA100 dp2 tp2 pp2 GPipe", "hf:gpt2", "dgx-a100-80g", 1, 256,
     {"dp": 2, "tp": 2, "pp": 2, "schedule": "gpipe"}),
    # what the search emits since: context parallelism (Llama 3 8B at 131072 tokens, the free plans
    # of benchmarks/context_parallel.py) and expert parallelism (benchmarks/moe_plans.py's free plans)
    ("llama3-8b 131072 tokens 8xH100 free (cp)", "benchmarks.search_time:llama3_8b_128k", "dgx-h100", 1, 16, {}),
    ("llama3-8b 131072 tokens 64xH100 free (cp)", "benchmarks.search_time:llama3_8b_128k", "dgx-h100", 8, 16, {}),
    ("deepseek-moe-16b 8xH100 free (ep)", "deepseek-moe-16b", "dgx-h100", 1, 1024, {}),
    ("deepseek-moe-16b 16xH100 free (ep)", "deepseek-moe-16b", "dgx-h100", 2, 1024, {}),
    ("hf mixtral-8x7b 16xH100 free (ep)", "hf:mixtral-8x7b?seq_len=4096", "dgx-h100", 2, 256, {}),
]


def run_case(case: tuple, jobs: int) -> dict:
    """Plan and verify one case (in this process: call it in a fresh one)."""
    import autopar
    from autopar.runtime.verify import verify

    name, model, cluster_name, nodes, gbs, cons = case
    t0 = time.perf_counter()
    cluster = autopar.ClusterSpec.load(cluster_name, num_nodes=nodes)
    try:
        p = autopar.plan(model, cluster, global_batch_size=gbs, cache=True,
                         constraints=autopar.Constraints(**cons) if cons else None)
    except autopar.PlanError as e:
        return {"case": name, "error": f"did not plan: {e}"}
    t_plan = time.perf_counter() - t0
    rep = verify(p, model, jobs=jobs, check=False)
    errors = [rc.memory_error for rc in rep.ranks if rc.memory_error is not None]
    folded = " folded" if p.experts is not None and p.experts.folded else ""
    return {"case": name, "world_size": p.world_size,
            "layout": (f"dp{p.dp}{f' ep{p.ep}' if p.ep > 1 else ''}{folded}"
                       f"{f' cp{p.cp}' if p.cp > 1 else ''} tp{p.tp} pp{p.pp} {p.schedule}"
                       f"{f' v{p.virtual_stages}' if p.virtual_stages > 1 else ''} mb {p.microbatch_size}x"
                       f"{p.num_microbatches} zero {p.zero_stage}"
                       f"{''.join(sorted({f' {s.recompute}' for s in p.stages if s.recompute != 'none'}))}"
                       f"{' SP' if p.sequence_parallel else ''}"),
            "kinds": len(rep.ranks), "plan_s": t_plan, "verify_s": rep.time_s,
            "cpu_s": sum(rc.cpu_s for rc in rep.ranks),
            "errors": errors, "worst": max(errors, key=abs) if errors else None,
            "built": all(rc.error is None for rc in rep.ranks), "collectives_match": rep.collectives_match,
            "collectives": rep.collectives_measured, "collectives_planned": rep.collectives_predicted,
            "failures": rep.failures,
            "kinds_off": [{"stages": rc.stages, "error": rc.memory_error, "tracked": rc.tracked_categories,
                           "predicted": rc.predicted_categories}
                          for rc in rep.ranks if rc.memory_error is not None and abs(rc.memory_error) > 0.10]}


def _fresh(case: tuple, jobs: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--case", case[0], "--jobs", str(jobs), "--json"],
                       capture_output=True, text=True)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])[0]
    except (IndexError, ValueError):
        return {"case": case[0], "error": f"verify process failed: {r.stderr.strip()[-400:]}"}


def _miss(r: dict) -> bool:
    return ("error" in r or not r["built"] or r["collectives_match"] is False or r["worst"] is None
            or abs(r["worst"]) > 0.10)


def show(results: list[dict]) -> None:
    from autopar.schema.plan import format_table

    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["case"], "-", "-", "-", r["error"][:80], "-", "-"])
            continue
        errs = r["errors"]
        rows.append([r["case"], f"{r['world_size']}: {r['layout']}", str(r["kinds"]),
                     f"{min(errs):+.1%} .. {max(errs):+.1%}" if errs else "-",
                     "match" if r["collectives_match"] else ("not combined" if r["collectives_match"] is None
                                                             else "DIFFER"),
                     f"{r['cpu_s']:.0f}", "miss" if _miss(r) else "ok"])
    print(format_table(["case", "ranks: layout", "kinds", "predicted vs tracked", "collectives", "verify CPU s",
                        "within 10%"], rows))
    ok = sum(not _miss(r) for r in results)
    print(f"\n{ok} of {len(results)} plans verified with every kind within 10% and the collectives matched "
          "(a plan that did not plan or build counts as a miss)")
    for r in results:
        for k in r.get("kinds_off", []):
            cats = ", ".join(f"{c} {v / 2**30:.2f}/{k['predicted'].get(c, 0) / 2**30:.2f}"
                             for c, v in k["tracked"].items())
            print(f"  {r['case']} stage {k['stages']}: {k['error']:+.1%} (GiB tracked/predicted: {cats})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="cases whose name contains this")
    ap.add_argument("--jobs", type=int, default=2, help="verify worker processes per case")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--case", help=argparse.SUPPRESS)      # one case, in this process
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.case:
        out = [run_case(next(c for c in CASES if c[0] == a.case), a.jobs)]
    else:
        out = []
        for case in CASES:
            if a.only in case[0]:
                out.append(_fresh(case, a.jobs))
                if not a.json:
                    print(f"{case[0]}: {'miss' if _miss(out[-1]) else 'ok'}", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(out))
    else:
        show(out)
    return 1 if any(_miss(r) for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
