"""Local worker processes: forked from one server that has imported torch and the runtime once.

`autopar run` (outside torchrun), `autopar verify --jobs` and the test suite start local worker
processes. A fresh Python process spends about 4 s of CPU importing torch, its distributed
stack, torch.export and the runtime before its first step: on a 2-core machine two thirds of a
small 4-rank run (profiled with py-spy), and on an 8-GPU node eight imports side by side.
Python's forkserver imports `PRELOAD` once, when it starts, and forks every worker from that
state: a launch of n workers costs one import, and later launches from the same process (a
sweep, verify, a test session) none.

A forked worker starts with the forkserver's environment as it was when the server started,
not the launching process's at launch time; `in_launcher_env` puts the launcher's environment
back (keeping the variables torch's elastic agent set for this rank) and sets torch's thread
count from OMP_NUM_THREADS, which the OpenMP runtime read once, when torch was first imported
in the server. The server imports modules only: it runs no tensor operation, so it has no
OpenMP thread pool or CUDA context for a fork to copy.

Work every worker would do alike (the programs CPU ranks of one plan trace: `shared_programs`)
is done once: `launch(..., prepare=fn)` forks a leader from the server, which runs fn() and then
the job, its workers forked from itself (`fork`), so each starts with what fn left.

    results = launch(fn, arg1, arg2, nproc=4)    # fn(arg1, arg2) in each worker: {rank: result}
    ProcessPoolExecutor(mp_context=worker_context()).submit(in_launcher_env, *launcher_args(fn, a))
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import uuid
from typing import Any, Callable, Optional

#: how local workers are started (multiprocessing start method)
START_METHOD = "forkserver"

#: what the server imports before forking (everything a worker's first step imports that
#: costs time; a name that fails to import is skipped by multiprocessing, silently, and the
#: worker then imports it itself)
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.export",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing",
    "torch.utils.checkpoint",
    "torch.utils.flop_counter",
    "autopar.runtime",
    "autopar.runtime.worker",
    "autopar.runtime.engine",
    "autopar.runtime.verify",
    "autopar.models",
    "autopar.capture.export",
    "autopar.intra_op.execute",
    "autopar.runtime.warmup",       # last: one tiny export on meta (first-use set-up of torch.export)
)

#: variables torch's elastic agent sets per worker (local_elastic_agent._start_workers)
_AGENT_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "CUDA_VISIBLE_DEVICES",
})   # not OMP_NUM_THREADS: the agent copies the launcher's, so the launcher's environment has it
     # when it is set, and a value in the worker's environment otherwise is the server's, stale


def worker_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context local workers are started from. Sets the server's preload
    list the first time (it takes effect when the server starts: the first start of a worker
    in this process)."""
    ctx = multiprocessing.get_context(START_METHOD)
    from multiprocessing import forkserver

    have = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])   # the caller's own
    ctx.set_forkserver_preload(list(dict.fromkeys([*have, *PRELOAD])))
    return ctx


def launch(fn: Callable[..., Any], *args: Any, nproc: int, max_restarts: int = 0,
           prepare: Optional[Callable[[], Any]] = None) -> dict[int, Any]:
    """fn(*args) on `nproc` local workers of one elastic job (torchrun's engine in this process:
    c10d rendezvous on a free local port, `max_restarts` restarts of the whole group), forked
    from the server in this process's environment and directory as they are now: {local rank:
    fn's result}. Raises torch's ChildFailedError when a worker fails.

    `prepare`: work every worker would do alike (picklable; `shared_programs.trace_programs`,
    the programs each rank traces): done once, in a process forked from the server, which then
    runs the job and forks the workers from itself, so each starts with what it left (its
    kept programs) and does not do it again. Not with one worker (nothing to share)."""
    if prepare is None or nproc < 2:
        return _elastic(fn, args, nproc, max_restarts, START_METHOD)
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=worker_context()) as leader:
        out = leader.submit(in_launcher_env, *launcher_args(_prepared_job, prepare, fn, args, nproc,
                                                            max_restarts)).result()
    if isinstance(out, _Failed):
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        raise ChildFailedError(out.name, out.failures)
    return out


class _Failed:
    """A job's ChildFailedError as its leader returns it (the error itself does not unpickle)."""

    def __init__(self, name: str, failures: dict) -> None:
        self.name, self.failures = name, failures


def _prepared_job(prepare: Callable[[], Any], fn: Callable[..., Any], args: tuple, nproc: int,
                  max_restarts: int) -> Any:
    """`launch`'s leader: `prepare()`, then the job, its workers forked from this process."""
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # one thread: no OpenMP pool for the forked workers to inherit (as the server has none)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prepare()
    finally:
        torch.set_num_threads(threads)
    try:
        return _elastic(fn, args, nproc, max_restarts, "fork")
    except ChildFailedError as e:
        return _Failed(e.name, e.failures)


def _elastic(fn: Callable[..., Any], args: tuple, nproc: int, max_restarts: int, start_method: str) -> dict[int, Any]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from autopar.runtime import _free_port

    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"autopar-{uuid.uuid4().hex[:8]}",
                       rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                       max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method)
    return elastic_launch(cfg, in_launcher_env)(*launcher_args(fn, *args))


def launcher_args(fn: Callable[..., Any], *args: Any) -> tuple:
    """The arguments of `in_launcher_env` that run fn(*args) in a worker, in this process's
    environment and working directory as they are now (and the server's preload set)."""
    worker_context()
    return (dict(os.environ), os.getcwd(), fn, *args)


_forked_worker = False


def in_forked_worker() -> bool:
    """Whether this process is a worker forked by `in_launcher_env` (it must return, not exit:
    the launcher waits for its return value; it leaves with os._exit, no interpreter teardown)."""
    return _forked_worker


def in_launcher_env(env: dict[str, str], cwd: str, fn: Callable[..., Any], *args: Any) -> Any:
    """A worker's entry (picklable): the launcher's environment and directory, then fn(*args)."""
    global _forked_worker
    _forked_worker = True
    agent = {k: v for k, v in os.environ.items() if k in _AGENT_VARS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(agent)
    os.chdir(cwd)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    return fn(*args)


def run_script(path: str, *argv: str) -> None:
    """Run a Python file as `python path *argv` would (as __main__), in a forked worker. An exit
    with status 0 returns; another raises (the error that led to it, when there was one)."""
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code in (0, None):
            return
        if isinstance(e.__context__, Exception):
            raise e.__context__ from None
        raise RuntimeError(f"{path} exited with status {e.code}") from None
