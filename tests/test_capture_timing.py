"""Capture time of the big zoo models and full-size Hugging Face presets.

Opt-in (about a minute of CPU): `AUTOPAR_TIMING=1 pytest tests/test_capture_timing.py`; also a
script: `python tests/test_capture_timing.py [REF ...]` prints one line per model. (gpt3-175b is
timed in the default suite by tests/test_capture.py.)"""

from __future__ import annotations

import os
import sys
import time

import pytest

from autopar.capture import capture
from autopar.models import build_model

BIG = ["gpt3-175b", "llama2-70b", "llama3-70b", "bert-large"]
HF = ["hf:gpt2", "hf:llama-2-7b", "hf:bert-base-uncased", "hf:opt-125m", "hf:t5-small", "hf:mixtral-8x7b"]


def time_capture(ref: str) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    b = build_model(ref)
    t1 = time.perf_counter()
    g = capture(b.model, b.example_inputs, name=ref)
    t2, c2 = time.perf_counter(), time.process_time()
    return {"ref": ref, "build_s": t1 - t0, "capture_s": t2 - t1, "cpu_s": c2 - c0, "ops": len(g.calls),
            "layers": len(g.layers), "params": g.num_params, "method": g.capture_method,
            "fwd_tflop_b1": g.at_batch(1).forward_flops / 1e12}


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("AUTOPAR_TIMING"), reason="set AUTOPAR_TIMING=1")]


@pytest.mark.parametrize("ref", ["llama2-70b"] + HF)
def test_big_captures_within_a_minute(ref: str) -> None:
    if ref.startswith("hf:"):
        pytest.importorskip("transformers")
    r = time_capture(ref)
    assert r["cpu_s"] < 60, r
    assert r["layers"] >= 2


if __name__ == "__main__":
    for ref in sys.argv[1:] or BIG + HF:
        r = time_capture(ref)
        print(f"{r['ref']:24s} build {r['build_s']:5.2f}s  capture {r['capture_s']:6.2f}s  cpu {r['cpu_s']:6.2f}s  "
              f"{r['ops']:6d} ops  {r['layers']:3d} layers  {r['params'] / 1e9:8.3f}B params  "
              f"fwd {r['fwd_tflop_b1']:9.2f} TFLOP at b=1  [{r['method']}]", flush=True)
