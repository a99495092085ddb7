"""What a user waits for: `autopar plan` on large clusters, end to end, as a new process (issue 19).

    python benchmarks/search_time.py [--only NAME[,NAME]] [--repeat 3] [--before PATH]

Each case runs the CLI (`python -m autopar plan ... --json --timings`) in a fresh process, first
with an empty capture cache (cold: the model is captured), then again with the cache it left
(warm), `--repeat` times each; the table gives the medians of the whole command's wall clock
and CPU time (user + system: what other jobs on a shared machine inflate least) beside its
parts as the CLI measures them (`plan --timings`: imports, building the model,
capture, search with the plan's assembly, printing; "start-up" is the wall clock the process
spent outside them: the interpreter and the CLI's own import). `--before PATH` times the code at
PATH instead (a checkout of an earlier commit, put first on PYTHONPATH; cold only, in an
empty cache directory; no `--timings`: its parts come from the plan's `search` record). Targets (issue 19): GPT-3 175B
on 1536 A100 at most 5 s warm and 8 s cold; Llama 3 405B on 16384 H100 and GPT 1T on 3072 A100
at most 10 s.

`--features` (issue 13: what sequence parallelism, context parallelism and the recomputation
choice each add to the search): each case warm, planned freely and then with one choice pinned
away (`--no-sequence-parallel`, `--cp 1`, `--recompute` pinned to the free plan's), the median
CPU time of `--repeat` runs of each (what a shared machine's load inflates least), the candidates the search
enumerated and evaluated, and the plan it chose; the difference from the free row is what that
choice's search costs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.registry import ModelBundle, token_inputs

ROOT = Path(__file__).resolve().parent.parent


def _gpt(name: str, cfg: GPTConfig) -> ModelBundle:
    with torch.device("meta"):
        m = GPT(cfg)
    return ModelBundle(name, m, token_inputs(cfg.seq_len)(1))


def gpt_1t() -> ModelBundle:
    """GPT 1T (Narayanan et al. 2021, Table 1: h=25600, 128 layers, 160 heads)."""
    return _gpt("gpt-1t", GPTConfig(vocab_size=51200, seq_len=2048, hidden=25600, layers=128, heads=160))


def gpt_39b() -> ModelBundle:
    """Megatron's 39.1B GPT (h=8192, 48 layers, 64 heads)."""
    return _gpt("gpt-39.1b", GPTConfig(vocab_size=51200, seq_len=2048, hidden=8192, layers=48, heads=64))


def llama3_405b() -> ModelBundle:
    """Llama 3 405B (Meta 2024: h=16384, 126 layers, 128 heads, 8 KV heads, FFN 53248, s=8192)."""
    cfg = LlamaConfig(vocab_size=128256, seq_len=8192, hidden=16384, layers=126, heads=128, kv_heads=8,
                      ffn_hidden=53248, rope_theta=500000.0)
    with torch.device("meta"):
        m = Llama(cfg)
    return ModelBundle("llama3-405b", m, token_inputs(cfg.seq_len)(1))


def llama3_8b_128k() -> ModelBundle:
    """Llama 3 8B at a 131072-token sequence (Meta 2024: h=4096, 32 layers, 32 heads, 8 KV heads,
    FFN 14336; the long-context stage's length), where the search tries context parallelism."""
    cfg = LlamaConfig(vocab_size=128256, seq_len=131072, hidden=4096, layers=32, heads=32, kv_heads=8,
                      ffn_hidden=14336, rope_theta=500000.0)
    with torch.device("meta"):
        m = Llama(cfg)
    return ModelBundle("llama3-8b-128k", m, token_inputs(cfg.seq_len)(1))


# name: (model reference, cluster, nodes, global batch)
CASES = {
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80g", 192, 1536),
    "gpt-1t": ("benchmarks.search_time:gpt_1t", "dgx-a100-80g", 384, 3072),
    "llama3-405b": ("benchmarks.search_time:llama3_405b", "dgx-h100", 2048, 2048),
    "gpt-39.1b": ("benchmarks.search_time:gpt_39b", "dgx-a100-80g", 64, 1536),
    "llama2-70b": ("llama2-70b", "dgx-h100", 8, 1024),
    "gpt3-1.3b": ("gpt3-1.3b", "dgx-a100-80g", 1, 512),
    "llama3-8b-128k": ("benchmarks.search_time:llama3_8b_128k", "dgx-h100", 8, 16),
}


def run_cli(case: str, cache_dir: str | None, before: str | None, extra: tuple[str, ...] = ()) -> dict:
    """One fresh `autopar plan` process: its wall clock, its parts and the plan's key fields."""
    ref, cluster, nodes, gbs = CASES[case]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("AUTOPAR_DEBUG", None)
    cmd = [sys.executable, "-m", "autopar", "plan", "--model", ref, "--cluster", cluster, "--nodes", str(nodes),
           "-b", str(gbs), "--json", "--quiet", *extra]
    if before:
        # the older code first; this file's factories as a top-level module (an older checkout
        # has its own benchmarks/search_time.py)
        env["PYTHONPATH"] = os.pathsep.join([before, str(ROOT / "benchmarks")])
        cmd[cmd.index(ref)] = ref.replace("benchmarks.search_time:", "search_time:")
        # an empty cache directory: a checkout that caches reads nothing the user's cache holds
        env["AUTOPAR_CACHE_DIR"] = cache_dir or ""
    else:
        env["AUTOPAR_CACHE_DIR"] = cache_dir or ""
        cmd.append("--timings")
    t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    # `python -m` puts the working directory first on sys.path: the checkout timed
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=before or ROOT)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if r.returncode != 0:
        raise SystemExit(f"{case}: {' '.join(cmd)} failed:\n{r.stderr}")
    p = json.loads(r.stdout)
    s = p["search"]
    parts = next((json.loads(line)["timings"] for line in r.stderr.splitlines() if line.startswith('{"timings"')),
                 None)
    if parts is None:      # an older CLI: the plan's own record
        parts = {"capture_s": s["capture_time_s"], "search_s": s["search_time_s"],
                 "assemble_s": s["assemble_time_s"]}
    known = sum(parts.get(k, 0.0) for k in ("imports_s", "model_s", "capture_s", "search_s", "print_s"))
    st = p["stages"]
    shape = dict(zip(st[0].get("mesh_axis_names", ["dp", "tp"]), st[0]["mesh_shape"]))
    layout = (f"dp{shape.get('dp', 1)}{' cp' + str(shape['cp']) if shape.get('cp', 1) > 1 else ''} "
              f"tp{shape.get('tp', 1)}{' SP' if p.get('sequence_parallel') else ''} "
              f"pp{len({tuple(x['devices']) for x in st})}, "
              f"mb {p['microbatch_size']}, {p['schedule']}"
              f"{' v=' + str(p['virtual_stages']) if p['virtual_stages'] > 1 else ''}, ZeRO-{p['zero_stage']}"
              f"{', ' + st[0]['recompute'] + ' recompute' if st[0]['recompute'] != 'none' else ''}")
    return {"wall_s": wall, "cpu_s": cpu, **parts, "rest_s": wall - known if "imports_s" in parts else None,
            "plan": layout, "iteration_s": p["predicted"]["iteration_time_s"],
            "peak_gib": p["predicted"]["peak_memory_bytes"] / 2**30, "capture": s.get("capture", ""),
            "candidates": s.get("candidates"), "evaluated": s.get("evaluated"), "recompute": st[0]["recompute"]}


def features(names: list[str], repeat: int) -> None:
    """Each case warm: free, then SP, cp and the recomputation choice each pinned away; the median
    CPU time of `repeat` runs of each."""
    cols = ["model", "GPUs", "search", "CPU s", "CPU vs free s", "candidates", "evaluated", "plan", "iter s"]
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            first = run_cli(name, d, None)              # cold: fills the capture cache
            pins = {"free": (), "SP pinned off": ("--no-sequence-parallel",), "cp pinned to 1": ("--cp", "1"),
                    f"recompute pinned ({first['recompute']})": ("--recompute", first["recompute"])}
            runs = {label: [run_cli(name, d, None, extra) for _ in range(repeat)] for label, extra in pins.items()}
        free_cpu = statistics.median(r["cpu_s"] for r in runs["free"])
        for label, rs in runs.items():
            r, cpu = rs[0], statistics.median(x["cpu_s"] for x in rs)
            row = [name, str(CASES[name][2] * 8), label, f"{cpu:.2f}",
                   "" if label == "free" else f"{cpu - free_cpu:+.2f}", str(r["candidates"]),
                   str(r["evaluated"]), r["plan"], f"{r['iteration_s']:.3g}"]
            rows.append(row)
            print(" | ".join(row), flush=True)
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _fmt_median(rows: list[dict], key: str) -> str:
    v = _median(rows, key)
    return "" if v is None else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="cases, comma-separated: " + ", ".join(CASES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", default=None, help="time the autopar checkout at this path instead")
    ap.add_argument("--json", action="store_true", help="one JSON record per run")
    ap.add_argument("--features", action="store_true",
                    help="what SP, cp and the recomputation choice each add to the search (warm, CPU time)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else ["gpt3-175b", "gpt-1t", "llama3-405b"]
    for n in names:
        if n not in CASES:
            ap.error(f"--only {n!r}: no such case; one of {', '.join(CASES)}")
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, torch {torch.__version__}, "
          f"{'code at ' + args.before if args.before else 'this checkout'}", flush=True)
    if args.features:
        features(names, args.repeat)
        return
    table = []
    for name in names:
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as d:
                for mode in (["cold"] if args.before else ["cold", "warm"]):
                    r = run_cli(name, d, args.before)
                    runs[mode].append(r)
                    if args.json:
                        print(json.dumps({"case": name, "mode": mode, **r}), flush=True)
        cold, warm = runs["cold"], runs["warm"]
        med = _fmt_median
        both = warm or cold
        row = [name, f"{CASES[name][2] * 8}", str(CASES[name][3]), med(cold, "wall_s"), med(warm, "wall_s"),
               med(cold, "cpu_s"), med(warm, "cpu_s"), med(both, "rest_s"), med(both, "imports_s"),
               med(both, "model_s"), med(cold, "capture_s"), med(warm, "capture_s"), med(both, "search_s"),
               med(both, "assemble_s"), med(both, "print_s"), cold[0]["plan"], f"{cold[0]['iteration_s']:.3g}",
               f"{cold[0]['peak_gib']:.1f}"]
        table.append(row)
        print(" | ".join(row), flush=True)
    cols = ["model", "GPUs", "batch", "CLI cold s", "CLI warm s", "CPU cold s", "CPU warm s", "start-up s",
            "imports s", "model s",
            "capture cold s", "capture warm s", "search s", "of which assembly s", "print s", "plan",
            "iter s", "peak GiB"]
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in table:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
