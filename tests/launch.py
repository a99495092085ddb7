"""Launch a test script under torch's elastic launcher (what torchrun runs), as the multi-process
runtime tests do: `nproc` local processes, one thread each, the repository on PYTHONPATH, run
from the repository root, memory tracking off unless asked for; the environment is restored
afterwards."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def elastic_run(script: Path, args: list[str], nproc: int) -> None:
    """Run `python script *args` on `nproc` processes of one elastic job; raises on failure."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from autopar.runtime import _free_port

    env_old = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH", "AUTOPAR_TRACK_MEMORY")}
    os.environ["OMP_NUM_THREADS"] = "1"
    # the layout jobs check losses and collectives; the worker's per-step memory tracking (8x a
    # step's time) is left to the memory tests, which track explicitly or through `run`
    os.environ.setdefault("AUTOPAR_TRACK_MEMORY", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in (env_old["PYTHONPATH"] or "").split(os.pathsep) if p])
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
                       rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                       monitor_interval=0.1)
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        elastic_launch(cfg, sys.executable)(str(script), *args)
    finally:
        os.chdir(cwd)
        for k, v in env_old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
