"""Launch a test script under torch's elastic launcher (what torchrun runs), as the multi-process
runtime tests do: `nproc` local processes, one thread each, the repository on PYTHONPATH, run
from the repository root, memory tracking off unless asked for; the environment is restored
afterwards. The processes are forked from the runtime's forkserver (`autopar.runtime.processes`,
as `autopar run` starts its workers), which imported torch and the runtime once for the whole
test session; each runs the script as `python script args` would."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def elastic_run(script: Path, args: list[str], nproc: int, prepare=None) -> None:
    """Run `python script *args` on `nproc` processes of one elastic job; raises on failure.
    `prepare`: what every process would do alike, done once before they fork
    (`processes.launch`)."""
    from autopar.runtime.processes import launch, run_script

    env_old = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH", "AUTOPAR_TRACK_MEMORY")}
    os.environ["OMP_NUM_THREADS"] = "1"
    # the layout jobs check losses and collectives; the worker's per-step memory tracking (8x a
    # step's time) is left to the memory tests, which track explicitly or through `run`
    os.environ.setdefault("AUTOPAR_TRACK_MEMORY", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in (env_old["PYTHONPATH"] or "").split(os.pathsep) if p])
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        launch(run_script, str(script), *args, nproc=nproc, prepare=prepare)
    finally:
        os.chdir(cwd)
        for k, v in env_old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_processes(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing's `start_processes(fn, args, nprocs)` (fn(rank, *args) in each),
    the processes forked from the runtime's forkserver rather than spawned (no import each)."""
    import torch.multiprocessing as mp

    from autopar.runtime.processes import START_METHOD, worker_context

    worker_context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=START_METHOD)


def run_plans(folder: Path, plans: dict, nproc: int, steps: int = 3, options: dict | None = None) -> dict:
    """Every plan of `plans` (name -> Plan) run in one launch of `nproc` processes (the layouts
    job, `tests/plans.py`), each `steps` steps unless `options[name]` says otherwise ({"steps":
    N, "checkpoint_dir": DIR}, as `autopar.runtime.run` takes them): name -> its rows (or the
    job's error for it). One launch rather than one per plan: the workers start once, and what
    they keep between plans of one model (DTensor's sharding rules) is worked out once; the
    programs every rank traces alike (exported, cut into pipeline chunks) are traced once, before
    the ranks fork (`tests.plans.trace_layouts`, `autopar.runtime.shared_programs`)."""
    from urllib.parse import urlencode

    folder = Path(folder)
    args = {}
    for name, p in plans.items():
        p.save(folder / f"{name}.json")
        opts = (options or {}).get(name)
        args[name] = f"plan:{folder / f'{name}.json'}" + (f"?{urlencode(opts)}" if opts else "")
    rows = layouts_job(list(args.values()), folder / "rows.json", nproc, steps)
    return {name: rows[a] for name, a in args.items()}


def layouts_job(entries: list[str], out: Path, nproc: int, steps: int) -> dict:
    """`entries` (layouts job arguments: a layout name, "plan:PATH", a check) run in turn by
    `tests/plans.py` on `nproc` processes: {entry: its rows, or {"error": ...}}. A layout that
    fails may leave the ranks in different collectives, so the job ends there; the entries after
    it run in a new job, so one failing layout fails its own test, not every later one's. The
    failure is reported from the ranks' error files (the earliest written), or as the
    job's error where none did (a rank killed)."""
    import functools
    import json

    from tests.plans import trace_layouts

    out = Path(out)
    rows: dict = {}
    remaining = list(entries)
    while remaining:
        for f in out.parent.glob(f"{out.name}*"):
            f.unlink()
        try:
            elastic_run(ROOT / "tests" / "plans.py", ["--out", str(out), "--steps", str(steps), *remaining], nproc,
                        prepare=functools.partial(trace_layouts, list(remaining)))
            failed = None
        except Exception as e:   # the job died: find which entry, report it, go on after it
            failed = f"{type(e).__name__}: {e}"
        rows.update(json.loads(out.read_text()) if out.exists() else {})
        left = [a for a in remaining if a not in rows]
        if failed is None:
            for a in left:
                rows[a] = {"error": "the layouts job ended without running it"}
            break
        # earliest first: the rank that failed writes before those its failure broke
        errs = [json.loads(f.read_text()) for f in sorted(out.parent.glob(f"{out.name}.err*"),
                                                         key=lambda f: f.stat().st_mtime_ns)]
        if left and not any(e.get("layout") == left[0] for e in errs) and len(left) == len(remaining):
            # nothing ran and no rank says why (the job failed to start): no point retrying
            for a in left:
                rows[a] = {"error": f"the layouts job failed before running it: {failed}"}
            break
        first: set = set()
        for e in errs:
            if e.get("layout") is not None and e["layout"] not in first:
                first.add(e["layout"])
                rows[e["layout"]] = {k: v for k, v in e.items() if k != "layout"}
        if not first and left:
            rows[left[0]] = {"error": f"the layouts job died during it: {failed}"}
        remaining = [a for a in left if a not in rows]
    return rows
