"""The CPU seconds a command's whole process tree spends: pytest, the forkserver it starts and
every gloo worker forked from it (which outlive pytest's own accounting: the forkserver reaps
them, and nobody reaps the forkserver). On a machine shared with other work the wall clock of a
test file says little (it grows with the load); its CPU seconds do not, and on a quiet 2-core
machine running the suite with `-n 2` the wall clock is about the suite's CPU seconds / 2.

    python benchmarks/cpu_seconds.py python -m pytest -q -p no:xdist tests/test_runtime_user_models.py

Prints "cpu_seconds: <cpu> s (user .. sys ..), wall .. s, load .." on stderr after the command
ends, and exits with its status. This process makes itself the tree's child subreaper (Linux),
so orphaned descendants are reparented here and their CPU time counted when they are reaped.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("cpu_seconds: cannot become a child subreaper (Linux only): orphans are not counted",
              file=sys.stderr)
    t0 = time.perf_counter()
    rc = subprocess.call(argv)
    wall = time.perf_counter() - t0
    while True:                      # the orphans: the forkserver and what it has not reaped
        try:
            os.wait()
        except ChildProcessError:
            break
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"cpu_seconds: {r.ru_utime + r.ru_stime:.1f} s (user {r.ru_utime:.1f}, sys {r.ru_stime:.1f}), "
          f"wall {wall:.1f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
