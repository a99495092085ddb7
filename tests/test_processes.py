"""Local workers forked from the runtime's forkserver (`autopar.runtime.processes`): each sees
the launcher's environment as it is at launch (not the server's, from when it started), torch's
thread count from OMP_NUM_THREADS, the launcher's directory, torch's rank variables; a script's
`hard_exit(0)` returns and another status fails the launch; workers forked from a leader that
prepared first (`launch(prepare=...)`) find what it did, and fail the launch alike."""

from __future__ import annotations

import os
import textwrap

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from autopar.runtime.processes import launch, run_script


def _launch(fn, *args, prepare=None) -> dict:
    return launch(fn, *args, nproc=2, prepare=prepare)


_PREPARED: list = []


def _prepare() -> None:
    """What a launch's leader does before it forks the workers (`launch(prepare=...)`)."""
    _PREPARED.append(os.getpid())


def _probe(name: str) -> tuple:
    import torch

    return (os.environ.get(name), os.environ.get("AUTOPAR_PROBE_GONE"), torch.get_num_threads(), os.getcwd(),
            os.environ["RANK"], os.environ["WORLD_SIZE"], len(_PREPARED))


def test_workers_see_the_launchers_environment_at_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PROBE_GONE", "set when the server may have started")
    _launch(_probe, "AUTOPAR_PROBE")                         # the server is running after this
    monkeypatch.delenv("AUTOPAR_PROBE_GONE")
    monkeypatch.setenv("AUTOPAR_PROBE", "after")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    # the workers forked from a leader that prepared once (`launch(prepare=...)`): they find
    # what it did, and the launcher's environment as it is now
    got = _launch(_probe, "AUTOPAR_PROBE", prepare=_prepare)
    assert got == {r: ("after", None, 1, str(tmp_path), str(r), "2", 1) for r in range(2)}
    assert not _PREPARED


def test_a_scripts_exit_status_is_its_result(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text(textwrap.dedent("""
        from autopar.runtime.worker import hard_exit
        if __name__ == "__main__":
            hard_exit(0)
            raise AssertionError("hard_exit returned")
        """))
    assert _launch(run_script, str(ok)) == {0: None, 1: None}
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ChildFailedError, match="exited with status 3"):     # through a leader too
        _launch(run_script, str(bad), prepare=_prepare)
    raising = tmp_path / "raising.py"
    raising.write_text(textwrap.dedent("""
        from autopar.runtime.worker import hard_exit
        try:
            raise ValueError("the cause")
        finally:
            hard_exit(1)
        """))
    with pytest.raises(ChildFailedError, match="the cause"):
        _launch(run_script, str(raising))
