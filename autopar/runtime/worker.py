"""The per-process training loop (what every torchrun worker runs).

    torchrun --nproc-per-node 4 -m autopar.runtime.worker plan.json --model gpt-tiny --steps 10 \\
        --metrics out.jsonl [--seed S] [--checkpoint-dir DIR --checkpoint-every K]

Rank 0 writes one JSON line per step to the metrics file (`step`, `loss`, `time_s`,
`peak_memory_bytes`, `collectives`) and a last line comparing measured with predicted figures
(`"summary": true`).

Peak memory: on GPU `torch.cuda.max_memory_allocated`. On CPU the tracked peak of the step's
tensors (`memory_tracking.track_step`: torch's MemTracker, by category and phase), the largest
over ranks, for the steps tracked: by default the first two of the process (the first allocates
the optimizer state; the second is the steady state the summary compares with the plan); later
rows carry the second step's figure with `"memory_tracked": false`. `AUTOPAR_TRACK_MEMORY=all`
tracks every step, `=0` none (rows then carry the process's peak RSS, as `memory_source: "rss"`
says in the summary). A tracked step runs several times slower (a Python dispatch per op); the
summary's time leaves tracked steps out when untracked ones remain. Test hook:
`AUTOPAR_FAULT=RANK:STEP` makes that rank exit abruptly before that step on the first attempt
(TORCHELASTIC_RESTART_COUNT 0), to exercise restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autopar.schema.plan import Plan


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: max allocated by the caching allocator. CPU: the process's peak resident set size
    (includes the Python/torch runtime, so it overstates what the plan predicts; `train` reports
    the tracked peak instead unless AUTOPAR_TRACK_MEMORY=0)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_tracking_mode(device: torch.device) -> str:
    """How `train` measures peak memory: "cuda" (max allocated) on GPU unless AUTOPAR_TRACK_MEMORY
    is set there (then tracked by category as on CPU, besides the allocator's figure); on CPU
    "step" (track the first two steps, the default), "all" (every step) or "off" (process RSS),
    from AUTOPAR_TRACK_MEMORY (unset/1/step, all, 0/off)."""
    cuda = device.type == "cuda"
    v = os.environ.get("AUTOPAR_TRACK_MEMORY", "off" if cuda else "step").strip().lower()
    if v in ("0", "off", "false", "no", "rss"):
        return "cuda" if cuda else "off"
    if v == "all":
        return "all"
    if v in ("", "1", "step", "true", "yes", "on"):
        return "step"
    raise ValueError(f"AUTOPAR_TRACK_MEMORY={v!r}: use 1 (the first two steps), all, or 0 (off)")


def collective_counting_mode() -> str:
    """Which steps `train` counts the collectives of (a dispatch mode that sees every op: 10 to
    25% of a small CPU step): "step" (the first two, the default: a pipeline's first step may
    issue transfers its later steps do not, the second is the steady step the plan counts), "all"
    (every step) or "off", from AUTOPAR_COUNT_COLLECTIVES (unset/1/step, all, 0/off). Counted
    steps, like memory-tracked ones, are left out of the measured median step time when others
    remain (`summarize`)."""
    v = os.environ.get("AUTOPAR_COUNT_COLLECTIVES", "step").strip().lower()
    if v in ("0", "off", "false", "no"):
        return "off"
    if v == "all":
        return "all"
    if v in ("", "1", "step", "true", "yes", "on"):
        return "step"
    raise ValueError(f"AUTOPAR_COUNT_COLLECTIVES={v!r}: use 1 (the first two steps), all, or 0 (off)")


def init_distributed() -> torch.device:
    """Initialise the default process group from torchrun's environment (NCCL on GPU, gloo on
    CPU) and return this process's device."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=int(os.environ.get("AUTOPAR_TIMEOUT_S", "300")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # the agent's store outlives a restart of the group: keys of the failed attempt
                # (gloo's listening addresses) would be read back; prefix them per attempt
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                     is_master=False, timeout=timeout)
                store = dist.PrefixStore(f"autopar/attempt_{attempt}", base)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
            else:
                dist.init_process_group(backend, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return device


def train(plan: Plan, bundle: Any, *, steps: int, seed: int = 0, metrics_path: str | None = None,
          checkpoint_dir: str | None = None, checkpoint_every: int = 1, quiet: bool = False,
          optimizer_factory=None, count_collectives: bool = True) -> list[dict]:
    """Run `steps` training iterations of `plan` in this (already initialised) process group.
    Returns the metric rows (on every rank; rank 0 also writes them to `metrics_path`)."""
    from autopar.models.registry import call_batch_fn, default_batch_fn
    from autopar.runtime import checkpoint as ckpt
    from autopar.runtime.counting import CollectiveCounter, global_counts
    from autopar.runtime.engine import ParallelModel

    rank = dist.get_rank()
    dev_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mem_mode = memory_tracking_mode(torch.device(dev_type))
    base = None
    if mem_mode in ("step", "all"):
        from autopar.runtime.memory_tracking import baseline, track_step

        base = baseline()   # what this process held before the model: not the plan's
    pm = ParallelModel(plan, bundle, seed=seed, optimizer_factory=optimizer_factory)
    start = 0
    if checkpoint_dir:
        if rank == 0:
            ckpt.cleanup_tmp(checkpoint_dir)
        dist.barrier()
        found = ckpt.latest(checkpoint_dir)
        if found is not None:
            start = ckpt.load(pm, found[1])
            if not quiet and rank == 0:
                print(f"autopar: resumed from {found[1]} (step {start})", file=sys.stderr, flush=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = None
    if rank == 0 and metrics_path:
        out = open(metrics_path, "a" if (restart > 0 or start > 0) else "w")  # noqa: SIM115 - closed in the finally below
    fault = os.environ.get("AUTOPAR_FAULT", "")
    fault_rank, fault_step = (int(x) for x in fault.split(":")) if fault else (-1, -1)
    batch_fn = bundle.batch_fn or default_batch_fn(bundle.example_inputs)
    G = plan.global_batch_size
    count_mode = collective_counting_mode() if count_collectives else "off"
    counter = CollectiveCounter() if count_mode != "off" else None
    counted_steps = (set(range(start, steps)) if count_mode == "all" else
                     {start, start + 1} if count_mode == "step" else set())
    rows: list[dict] = []
    tracked_steps = (set(range(start, steps)) if mem_mode == "all" else
                     {start, start + 1} if mem_mode == "step" else set())
    reports: list[dict] | None = None   # every rank's MemoryReport of the last tracked step
    last_mem: int | None = None
    try:
        for step in range(start, steps):
            if rank == fault_rank and step == fault_step and restart == 0:
                os._exit(1)
            # the rank's share only: the global batch is dropped before the step, as a sharded
            # data loader would never hold it
            batch = pm.local_batch(call_batch_fn(batch_fn, step, G, seed))
            counting = counter if step in counted_steps else None
            if counting is not None:
                counting.reset()
            tracked = step in tracked_steps
            t0 = time.perf_counter()
            if tracked:
                local, rep = track_step(pm, batch, counter=counting, skip=base)
            else:
                # a step whose memory is not tracked (mode "step": after the first two) does
                # not wait for gloo's thread to let go of collectives' operands
                local = pm.train_step(batch, counter=counting, exact_memory=mem_mode != "step")
            if pm.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            loss = pm.reduce_loss(local)
            if tracked:
                mem = rep.peak_bytes
                reports = [rep.to_dict()]
                if dist.get_world_size() > 1:
                    reports = [None] * dist.get_world_size()
                    dist.all_gather_object(reports, rep.to_dict())
            elif mem_mode in ("step", "all"):
                mem = last_mem if last_mem is not None else 0
            else:
                mem = peak_memory_bytes(pm.device)
            tm = torch.tensor([dt, float(mem)], dtype=torch.float64, device=pm.device)
            if dist.get_world_size() > 1:
                dist.all_reduce(tm, op=dist.ReduceOp.MAX)
            tm = tm.cpu()
            if tracked:
                last_mem = int(tm[1])
            row = {"step": step, "loss": loss, "time_s": float(tm[0]), "peak_memory_bytes": int(tm[1])}
            if counting is not None:        # only counted steps carry a count
                row["collectives"] = global_counts(counting, pm.representatives)
            if mem_mode in ("step", "all"):
                row["memory_tracked"] = tracked
            rows.append(row)
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            if not quiet and rank == 0:
                print(f"step {step}: loss {loss:.6f}  {dt * 1e3:.1f} ms", file=sys.stderr, flush=True)
            if checkpoint_dir and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
                ckpt.save(pm, checkpoint_dir)
        summary = summarize(plan, rows, counted=counter is not None, memory_reports=reports,
                            memory_source={"cuda": "cuda", "off": "rss"}.get(mem_mode, "tracked"))
        sb = torch.tensor([float(pm.model_state_bytes())], dtype=torch.float64, device=pm.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(sb, op=dist.ReduceOp.MAX)
        # parameters + optimizer state of the fullest rank
        summary["measured_model_state_bytes"] = int(sb.cpu()[0])
        if out is not None:
            out.write(json.dumps(summary) + "\n")
        rows.append(summary)
    finally:
        if out is not None:
            out.close()
    return rows


def summarize(plan: Plan, rows: list[dict], counted: bool = True,
              memory_reports: list[dict] | None = None, memory_source: str = "") -> dict:
    """The comparison line: measured vs predicted time, memory and collectives.

    Time: the median over the steps after the first, leaving out memory-tracked steps and
    steps whose collectives were counted when others remain (both instrument every op).
    Collectives: the last counted step's. Memory: the largest step peak over ranks (`peak_memory_bytes` of the
    rows: tracked ones when tracking ran); with `memory_reports` (every rank's
    `MemoryReport.to_dict()` of the last tracked step) also `measured_memory` (the fullest
    rank's peak by category and phase), `predicted_memory` (the plan's fullest stage, by
    category) and `memory_per_rank` (each rank against the stage it belongs to)."""
    steps = [r for r in rows if "step" in r]
    untracked = [r for r in steps if not r.get("memory_tracked") and "collectives" not in r]
    later = [r for r in untracked if r is not steps[0]] if steps else []
    timed = later or [r for r in steps[1:]] or steps
    times = [r["time_s"] for r in timed]
    meas_t = statistics.median(times) if times else 0.0
    pred = plan.predicted
    mem_rows = [r for r in steps if r.get("memory_tracked")] or steps
    mem = max((r["peak_memory_bytes"] for r in mem_rows), default=0)
    coll = next((r["collectives"] for r in reversed(steps) if "collectives" in r), {})
    out = {"summary": True, "steps": len(steps),
           "measured_time_s": meas_t, "predicted_time_s": pred.iteration_time_s,
           "time_ratio": (meas_t / pred.iteration_time_s) if pred.iteration_time_s else None,
           "measured_peak_memory_bytes": mem, "predicted_peak_memory_bytes": pred.peak_memory_bytes,
           "memory_ratio": (mem / pred.peak_memory_bytes) if pred.peak_memory_bytes else None,
           "measured_collectives": coll, "predicted_collectives": dict(pred.collectives),
           "collectives_match": (coll == {k: v for k, v in pred.collectives.items() if v})
           if counted and pred.collectives else None}
    if memory_source:
        out["memory_source"] = memory_source
    if memory_reports:
        out.update(memory_comparison(plan, memory_reports))
    return out


def memory_comparison(plan: Plan, reports: list[dict]) -> dict:
    """Tracked vs predicted memory from every rank's `MemoryReport.to_dict()` (index = rank)."""
    from autopar.runtime.memory_tracking import (
        fullest_stage,
        predicted_for_rank,
        relative_error,
    )

    full = max(range(len(reports)), key=lambda r: reports[r]["peak_bytes"])
    fr = reports[full]
    per_rank = []
    for r, rep in enumerate(reports):
        p = predicted_for_rank(plan, r)
        per_rank.append({"rank": r, "tracked_peak_bytes": rep["peak_bytes"], "peak_phase": rep["peak_phase"],
                         "categories": rep["categories"], "predicted": p,
                         "error": relative_error(rep["peak_bytes"], p["peak_bytes"]) if p else None,
                         "untracked_bytes": rep["untracked_bytes"], "notes": rep["notes"]})
    return {"measured_memory": {"rank": full, "peak_bytes": fr["peak_bytes"], "peak_phase": fr["peak_phase"],
                                "categories": fr["categories"], "detail": fr["detail"],
                                "phases": {k: v["peak_bytes"] for k, v in fr["phases"].items()}},
            "predicted_memory": fullest_stage(plan),
            "memory_per_rank": per_rank}


def worker_entry(plan_json: str, model: Any, steps: int, seed: int, metrics_path: str | None,
                 checkpoint_dir: str | None, checkpoint_every: int, quiet: bool,
                 optimizer_factory=None) -> list[dict] | None:
    """What each launched process runs (picklable for the elastic launcher)."""
    from autopar.models.registry import ModelBundle, build_model

    init_distributed()
    try:
        plan = Plan.from_json(plan_json)
        bundle = model if isinstance(model, ModelBundle) else build_model(model, device="meta")
        rows = train(plan, bundle, steps=steps, seed=seed, metrics_path=metrics_path,
                     checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, quiet=quiet,
                     optimizer_factory=optimizer_factory)
        return rows if dist.get_rank() == 0 else None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _record(fn):
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


@_record
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autopar.runtime.worker",
                                 description="run an autopar plan in this torchrun worker")
    ap.add_argument("plan")
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metrics")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--checkpoint-every", type=int, default=1)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    from autopar.runtime import run

    run(a.plan, a.model, steps=a.steps, seed=a.seed, metrics_path=a.metrics,
        checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every, quiet=a.quiet)
    hard_exit(0)
    return 0


def hard_exit(code: int) -> None:
    """Leave without interpreter teardown: process groups still referenced by meshes/FSDP
    state are otherwise freed in an order that sometimes aborts gloo's threads ("terminate
    called without an active exception") after a successful run. A worker forked by the
    runtime's launcher (`processes`) raises SystemExit instead: its launcher waits for it to
    return, and it leaves through os._exit anyway."""
    from autopar.runtime.processes import in_forked_worker

    if in_forked_worker():
        raise SystemExit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
