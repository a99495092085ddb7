"""A pytest plugin: each test's CPU seconds, the gloo workers' included (which `--durations`
leaves out: they run in processes forked from the runtime's forkserver, whose CPU time reaches
pytest's process only when the forkserver exits). On a shared machine a test's wall clock says
little; its CPU seconds say what it costs the suite's two cores.

    AUTOPAR_TEST_CPU=cpu.txt python -m pytest -q -p no:xdist -p benchmarks.pytest_cpu tests/test_moe.py
    sort -rn cpu.txt | head

Writes one line a test, "<cpu s> <wall s> <node id>": this process's CPU (its own and its
reaped children's: CLI subprocesses, a notebook's kernel) and the forkserver's (its own and its
reaped children's: every job's leader and ranks), from the test's setup to its teardown. The
forkserver's start-up (importing torch and the runtime, a few seconds) falls to the test that
starts it. Sums over a file agree with `benchmarks/cpu_seconds.py` to within pytest's own
collection and start-up.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_TICKS = os.sysconf("SC_CLK_TCK")
_ROWS: list[tuple[float, float, str]] = []
_LAST_SERVER = [0.0]


def _server_cpu() -> float:
    """The forkserver's CPU seconds and its reaped children's (0 before it starts; its last
    reading once it has gone)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return _LAST_SERVER[0]
    _LAST_SERVER[0] = sum(int(x) for x in fields[11:15]) / _TICKS    # utime stime cutime cstime
    return _LAST_SERVER[0]


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + _server_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, w0 = _cpu(), time.perf_counter()
    yield
    _ROWS.append((_cpu() - c0, time.perf_counter() - w0, item.nodeid))


def pytest_sessionfinish(session):
    out = os.environ.get("AUTOPAR_TEST_CPU")
    if out:
        with open(out, "w") as f:
            f.writelines(f"{c:8.2f} {w:8.2f} {n}\n" for c, w, n in _ROWS)
