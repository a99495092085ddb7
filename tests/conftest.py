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
