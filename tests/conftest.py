"""Test session setup: `autopar plan` caches captures (issue 19); the tests' plans keep theirs in a
temporary directory, removed at exit, not in the user's cache."""

import atexit
import os
import shutil
import tempfile

if "AUTOPAR_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="autopar-test-captures-")
    os.environ["AUTOPAR_CACHE_DIR"] = _cache      # inherited by the CLI subprocesses the tests start
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# `autopar run` counts the collectives of its first two steps by default; the tests check every
# step's against the plan (a later step issuing other collectives is a defect too)
os.environ.setdefault("AUTOPAR_COUNT_COLLECTIVES", "all")


# -- the order files run in -------------------------------------------------------------------
# `-n 2 --dist loadfile` hands each file to a worker as the worker frees up. xdist's default
# order (files with the most tests first) left the few-test, many-process files (a launch of 4
# or 8 gloo processes: the notebook, the planned and context-parallel runtime files) for the
# end, where one worker ran them while the other had nothing left. The files measured slowest
# are handed out first, longest first (the rest after them, in collection order), so the two
# workers finish together.
SLOWEST_FIRST = (
    "test_moe.py", "test_runtime_user_models.py", "test_runtime.py", "test_verify.py", "test_runtime_planned.py",
    "test_runtime_context_parallel.py", "test_moe_8proc.py", "test_runtime_llama_tp.py", "test_hf_plan.py",
    "test_runtime_hetero.py", "test_planner.py", "test_interleaved_qkv.py", "test_sweep.py",
    "test_context_parallel.py", "test_notebook.py", "test_memory_model.py", "test_pointwise_fusion.py",
    "test_runtime_precision.py", "test_intra_op_execute.py", "test_memory_harness.py", "test_planner_unchanged.py",
    "test_cli.py", "test_runtime_selective.py",
)


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False      # hand files out in the order below


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's tests keep their order
