"""Multi-node execution as documented (autopar/runtime/README.md, "Multi-node"): the same
torchrun command on every node, c10d rendezvous, global ranks. Two torchrun agents on this
machine stand for two nodes of 2 processes each; a pp2 x dp2 plan for a 2-node cluster puts
one pipeline stage on each node, so activations and gradients cross the "nodes"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autopar.schema import LinkSpec
from tests.plans import cpu_cluster, make_plan
from tests.test_runtime import ROOT, close, reference_losses

pytestmark = pytest.mark.slow
STEPS = 2


def test_two_nodes_same_command(tmp_path):
    from autopar.runtime import _free_port

    plan = make_plan("pp2xdp2")
    two_nodes = cpu_cluster(4).model_copy(update={"num_nodes": 2, "devices_per_node": 2,
                                                  "inter_node": LinkSpec(bandwidth=1e9, latency=1e-4)})
    plan = plan.model_validate(plan.model_copy(update={"cluster": two_nodes}).model_dump())
    path, metrics = tmp_path / "plan.json", tmp_path / "m.jsonl"
    plan.save(path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "autopar-test",
           "-m", "autopar.runtime.worker", str(path), "--model", "gpt-tiny", "--steps", str(STEPS),
           "--metrics", str(metrics)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outs)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert close([r["loss"] for r in steps], reference_losses(steps=STEPS), 1e-5), steps
    assert steps[-1]["collectives"] == plan.predicted.collectives
    assert rows[-1]["summary"] and rows[-1]["collectives_match"] is True
