"""The per-process training loop (what every torchrun worker runs).

    torchrun --nproc-per-node 4 -m autopar.runtime.worker plan.json --model gpt-tiny --steps 10 \\
        --metrics out.jsonl [--seed S] [--checkpoint-dir DIR --checkpoint-every K]

Rank 0 writes one JSON line per step to the metrics file (`step`, `loss`, `time_s`,
`peak_memory_bytes`, `collectives`) and a last line comparing measured with predicted figures
(`"summary": true`). Test hook: `AUTOPAR_FAULT=RANK:STEP` makes that rank exit abruptly before
that step on the first attempt (TORCHELASTIC_RESTART_COUNT 0), to exercise restarts.
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
from typing import Any, Optional

import torch
import torch.distributed as dist

from autopar.schema.plan import Plan


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: max allocated by the caching allocator. CPU: the process's peak resident set size
    (includes the Python/torch runtime, so it overstates what the plan predicts)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


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


def train(plan: Plan, bundle: Any, *, steps: int, seed: int = 0, metrics_path: Optional[str] = None,
          checkpoint_dir: Optional[str] = None, checkpoint_every: int = 1, quiet: bool = False,
          optimizer_factory=None, count_collectives: bool = True) -> list[dict]:
    """Run `steps` training iterations of `plan` in this (already initialised) process group.
    Returns the metric rows (on every rank; rank 0 also writes them to `metrics_path`)."""
    from autopar.models.registry import call_batch_fn, default_batch_fn
    from autopar.runtime import checkpoint as ckpt
    from autopar.runtime.counting import CollectiveCounter, global_counts
    from autopar.runtime.engine import ParallelModel

    rank = dist.get_rank()
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
        out = open(metrics_path, "a" if (restart > 0 or start > 0) else "w")
    fault = os.environ.get("AUTOPAR_FAULT", "")
    fault_rank, fault_step = (int(x) for x in fault.split(":")) if fault else (-1, -1)
    batch_fn = bundle.batch_fn or default_batch_fn(bundle.example_inputs)
    G = plan.global_batch_size
    if os.environ.get("AUTOPAR_COUNT_COLLECTIVES") == "0":
        count_collectives = False
    counter = CollectiveCounter() if count_collectives else None
    rows: list[dict] = []
    try:
        for step in range(start, steps):
            if rank == fault_rank and step == fault_step and restart == 0:
                os._exit(1)
            batch = call_batch_fn(batch_fn, step, G, seed)
            if counter is not None:
                counter.reset()
            t0 = time.perf_counter()
            local = pm.train_step(batch, counter=counter)
            if pm.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            loss = pm.reduce_loss(local)
            mem = peak_memory_bytes(pm.device)
            tm = torch.tensor([dt, float(mem)], dtype=torch.float64, device=pm.device)
            if dist.get_world_size() > 1:
                dist.all_reduce(tm, op=dist.ReduceOp.MAX)
            tm = tm.cpu()
            coll = global_counts(counter, pm.representatives) if counter is not None else {}
            row = {"step": step, "loss": loss, "time_s": float(tm[0]), "peak_memory_bytes": int(tm[1]),
                   "collectives": coll}
            rows.append(row)
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
            if not quiet and rank == 0:
                print(f"step {step}: loss {loss:.6f}  {dt * 1e3:.1f} ms", file=sys.stderr, flush=True)
            if checkpoint_dir and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
                ckpt.save(pm, checkpoint_dir)
        summary = summarize(plan, rows, counted=counter is not None)
        sb = torch.tensor([float(pm.model_state_bytes())], dtype=torch.float64, device=pm.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(sb, op=dist.ReduceOp.MAX)
        # parameters + optimizer state of the fullest rank (CPU peak memory is the process RSS)
        summary["measured_model_state_bytes"] = int(sb.cpu()[0])
        if out is not None:
            out.write(json.dumps(summary) + "\n")
        rows.append(summary)
    finally:
        if out is not None:
            out.close()
    return rows


def summarize(plan: Plan, rows: list[dict], counted: bool = True) -> dict:
    """The comparison line: measured vs predicted time, memory and collectives."""
    steps = [r for r in rows if "step" in r]
    times = [r["time_s"] for r in steps[1:]] or [r["time_s"] for r in steps]
    meas_t = statistics.median(times) if times else 0.0
    pred = plan.predicted
    mem = max((r["peak_memory_bytes"] for r in steps), default=0)
    coll = steps[-1]["collectives"] if steps else {}
    return {"summary": True, "steps": len(steps),
            "measured_time_s": meas_t, "predicted_time_s": pred.iteration_time_s,
            "time_ratio": (meas_t / pred.iteration_time_s) if pred.iteration_time_s else None,
            "measured_peak_memory_bytes": mem, "predicted_peak_memory_bytes": pred.peak_memory_bytes,
            "memory_ratio": (mem / pred.peak_memory_bytes) if pred.peak_memory_bytes else None,
            "measured_collectives": coll, "predicted_collectives": dict(pred.collectives),
            "collectives_match": (coll == {k: v for k, v in pred.collectives.items() if v})
            if counted and pred.collectives else None}


def worker_entry(plan_json: str, model: Any, steps: int, seed: int, metrics_path: Optional[str],
                 checkpoint_dir: Optional[str], checkpoint_every: int, quiet: bool,
                 optimizer_factory=None) -> Optional[list[dict]]:
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
def main(argv: Optional[list[str]] = None) -> int:
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
    called without an active exception") after a successful run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
