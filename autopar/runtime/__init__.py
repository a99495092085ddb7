"""The runtime: executes a Plan on torch.distributed (see README.md in this folder).

    rows = autopar.runtime.run("plan.json", "gpt-tiny", steps=4, metrics_path="out.jsonl")

`run` launches `plan.world_size` local processes through torch's elastic launcher (torchrun's
engine; gloo on CPU, NCCL on GPU) unless it already runs under torchrun (RANK/WORLD_SIZE set),
in which case this process is one worker. A one-process plan runs in this process.

For your own loop: every rank calls

    pm = autopar.runtime.build(plan, "gpt-tiny", seed=0)      # after init_process_group
    loss = pm.step(global_batch)                              # every rank passes the global batch

The runtime reads a plan and a model; it never imports the solvers.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from autopar.models.registry import ModelBundle, build_model
from autopar.schema.errors import PlanError
from autopar.schema.plan import Plan, load_plan

__all__ = ["run", "build", "check_plan", "ParallelModel"]


def __getattr__(name: str) -> Any:  # lazy: keep `import autopar.runtime` light
    if name == "ParallelModel":
        from autopar.runtime.engine import ParallelModel

        return ParallelModel
    raise AttributeError(name)


def _load(plan: Plan | str | os.PathLike) -> Plan:
    if isinstance(plan, Plan):
        return plan
    return load_plan(plan)


def _bundle(model: str | ModelBundle) -> ModelBundle:
    if isinstance(model, ModelBundle):
        return model
    return build_model(model, device="meta")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_plan(plan: Plan, bundle: ModelBundle, *, world_size: Optional[int] = None,
               model_ref: Optional[str] = None) -> None:
    """Raise PlanError when the plan was made for another model (fingerprint of the captured
    graph) or needs another number of processes/devices than are available."""
    from autopar.capture.export import fingerprint

    ref = model_ref or bundle.name
    try:
        fp = fingerprint(bundle.model, bundle.example_inputs)
    except PlanError:
        raise
    except Exception as e:  # capture failure: say so rather than run blind
        raise PlanError(f"cannot capture model {ref} to check it against the plan: {e}") from None
    if fp != plan.model.fingerprint:
        raise PlanError(f"plan was made for {plan.model.name} (fingerprint {plan.model.fingerprint}), "
                        f"not {ref} (fingerprint {fp}); re-plan with --model {ref}")
    from autopar.runtime.engine import validate_plan

    validate_plan(plan, bundle.model)
    stages = sorted(plan.stages, key=lambda s: s.index)
    if len(stages) > 1 and stages[0].op_layouts is None:
        # cut from the traced model on every rank: trace it here once, so a model the graph
        # pipelines cannot carry is refused before any process starts
        from autopar.runtime.graph_stages import split_model

        mb = plan.microbatch_size
        ex = tuple(torch.empty((mb, *x.shape[1:]), dtype=x.dtype, device="meta")
                   if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in bundle.example_inputs)
        split_model(bundle.model, ex, [s.layers[0] for s in stages[1:]], torch.device("cpu"))
    need = plan.world_size
    if world_size is not None and world_size != need:
        raise PlanError(f"the plan needs {need} processes (one per device), but {world_size} "
                        f"{'are running' if _under_torchrun() else 'were asked for'}; run it with "
                        f"{need} (torchrun --nproc-per-node/--nnodes) or re-plan for {world_size} devices")
    if torch.cuda.is_available() and not _under_torchrun():
        n = torch.cuda.device_count()
        if n < need:
            raise PlanError(f"the plan needs {need} GPUs, this machine has {n}; launch it across "
                            f"nodes with torchrun --nnodes (see autopar/runtime/README.md) or re-plan")


def build(plan: Plan | str, model: str | ModelBundle | Callable[[], Any], *, seed: int = 0,
          optimizer_factory: Optional[Callable] = None, check: bool = True):
    """This rank's ParallelModel (a collective: every rank of an initialised process group calls
    it). `model`: a model reference, a ModelBundle, or a factory returning one / (model, inputs)."""
    import torch.distributed as dist

    from autopar.runtime.engine import ParallelModel
    from autopar.runtime.spmd import register_extra_strategies

    p = _load(plan)
    if callable(model) and not isinstance(model, (str, ModelBundle)):
        out = model()
        if isinstance(out, ModelBundle):
            model = out
        else:
            model = ModelBundle("custom", out[0], tuple(out[1]), out[2] if len(out) > 2 else None)
    b = _bundle(model)
    if check:
        check_plan(p, b, world_size=dist.get_world_size() if dist.is_initialized() else None,
                   model_ref=model if isinstance(model, str) else None)
    register_extra_strategies()
    return ParallelModel(p, b, seed=seed, optimizer_factory=optimizer_factory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(path: str | Path) -> list[dict]:
    """Metric rows of a metrics file, the last row per step kept (restarts re-run steps), then
    the summary line."""
    by_step: dict[int, dict] = {}
    summary = None
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        r = json.loads(line)
        if r.get("summary"):
            summary = r
        elif "step" in r:
            by_step[int(r["step"])] = r
    rows = [by_step[k] for k in sorted(by_step)]
    return rows + ([summary] if summary else [])


def run(plan: Plan | str, model: str | ModelBundle, *, steps: int = 10, seed: int = 0,
        metrics_path: Optional[str] = None, checkpoint_dir: Optional[str] = None,
        checkpoint_every: int = 1, quiet: bool = False, nproc: Optional[int] = None,
        max_restarts: int = 0, optimizer_factory: Optional[Callable] = None,
        env: Optional[dict[str, str]] = None, count_collectives: bool = True) -> list[dict]:
    """Train `steps` iterations of `plan`; returns the per-step metric rows (step, loss, time_s,
    peak_memory_bytes, collectives) followed by the summary row (measured vs predicted).

    Outside torchrun: checks the plan against the model, launches `nproc` (default
    `plan.world_size`) local worker processes with torch's elastic launcher (`max_restarts`
    restarts of the whole group on a failure; with `checkpoint_dir` the restarted group resumes
    from the latest checkpoint) and reads the metrics back. Under torchrun: runs this worker
    (the rows come back on rank 0, the other ranks get []).
    `env`: extra environment variables for the launched workers. `count_collectives=False`
    skips the per-step collective count (its dispatch mode costs ~10-20% of a small CPU step)."""
    from autopar.runtime.worker import init_distributed, train

    p = _load(plan)
    b = _bundle(model)
    ref = model if isinstance(model, str) else None
    if steps < 1:
        raise PlanError("steps must be at least 1")
    if _under_torchrun():
        if os.environ.get("AUTOPAR_CHECKED") != p.model.fingerprint:  # the launcher checked already
            check_plan(p, b, world_size=int(os.environ["WORLD_SIZE"]), model_ref=ref)
        init_distributed()
        import torch.distributed as dist

        try:
            rows = train(p, b, steps=steps, seed=seed, metrics_path=metrics_path,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, quiet=quiet,
                         optimizer_factory=optimizer_factory, count_collectives=count_collectives)
            return rows if dist.get_rank() == 0 else []  # one copy (the CLI prints what it gets)
        finally:
            dist.destroy_process_group()
    n = nproc or p.world_size
    check_plan(p, b, world_size=n, model_ref=ref)
    if checkpoint_dir:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    tmpdir = tempfile.mkdtemp(prefix="autopar-run-")
    if metrics_path is None:
        mpath = os.path.join(tmpdir, "metrics.jsonl")
    else:
        mpath = str(metrics_path)
        d = Path(mpath).parent
        if str(d) and not d.exists():
            raise PlanError(f"cannot write metrics to {mpath}: directory {d} does not exist")
        if Path(mpath).exists():
            Path(mpath).unlink()
    try:
        if not count_collectives:
            env = dict(env or {}, AUTOPAR_COUNT_COLLECTIVES="0")
        import torch.distributed as dist

        if n == 1 and not env and not dist.is_initialized():
            _run_inline(p, b, steps, seed, mpath, checkpoint_dir, checkpoint_every, quiet, optimizer_factory)
        else:
            _launch(p, model if isinstance(model, str) else b, n, steps, seed, mpath, checkpoint_dir,
                    checkpoint_every, quiet, max_restarts, optimizer_factory,
                    dict(env or {}, AUTOPAR_CHECKED=p.model.fingerprint))
        return read_metrics(mpath)
    finally:
        if tmpdir:  # noqa: SIM102
            import shutil

            shutil.rmtree(tmpdir, ignore_errors=True)


def _run_inline(p, b, steps, seed, mpath, checkpoint_dir, checkpoint_every, quiet, optimizer_factory) -> None:
    import torch.distributed as dist

    from autopar.runtime.worker import train

    if dist.is_initialized():
        raise PlanError("a process group is already initialised in this process; call "
                        "autopar.runtime.build(...) and step() from your own loop instead")
    store = dist.HashStore()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        train(p, b, steps=steps, seed=seed, metrics_path=mpath, checkpoint_dir=checkpoint_dir,
              checkpoint_every=checkpoint_every, quiet=quiet, optimizer_factory=optimizer_factory)
    finally:
        dist.destroy_process_group()


def _launch(p: Plan, model: Any, n: int, steps: int, seed: int, mpath: str, checkpoint_dir, checkpoint_every,
            quiet: bool, max_restarts: int, optimizer_factory, env: dict[str, str]) -> None:
    """torchrun's engine in this process: `n` workers forked from one server that imported torch
    and the runtime once (`processes`), each running `worker.worker_entry`. A ModelBundle or an
    optimizer factory is pickled to the workers (a calling script defining them needs an
    `if __name__ == "__main__":` guard, as multiprocessing re-imports it)."""
    import functools

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from autopar.runtime.processes import launch
    from autopar.runtime.shared_programs import trace_plan
    from autopar.runtime.worker import worker_entry

    old = {k: os.environ.get(k) for k in list(env) + ["PYTHONPATH", "OMP_NUM_THREADS"]}
    os.environ.update(env)
    # the cores split evenly between the local processes: the rule `autopar profile` measures under
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, n))))
    paths = [os.getcwd()] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # CPU ranks trace the same programs: traced once, before they fork (`shared_programs`); GPU
    # ranks trace each for its own device
    prepare = None if torch.cuda.is_available() else functools.partial(trace_plan, p.to_json(indent=None), model, seed)
    try:
        launch(worker_entry, p.to_json(indent=None), model, steps, seed, os.path.abspath(mpath),
               os.path.abspath(checkpoint_dir) if checkpoint_dir else None, checkpoint_every, quiet, optimizer_factory,
               nproc=n, max_restarts=max_restarts, prepare=prepare)
    except ChildFailedError as e:
        def msg(f: Any) -> str:
            m = f.message
            if isinstance(m, dict):
                m = m.get("message") or str(m)
            return str(m or f"exit code {f.exitcode}")[:2000]

        fails = "; ".join(f"rank {r}: {msg(f)}" for r, f in sorted(e.failures.items()))
        raise PlanError(f"the run failed: {fails}") from None
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
