"""Hugging Face models plan on one and on four DGX A100 nodes (issue: the user's side).

Real widths, fewer layers where a family is slow to capture; Llama is Llama 3 (grouped-query
attention). Each model is captured once and planned for both cluster sizes, as `autopar.sweep`
plans a model on several node counts: the per-layer costs (`planner.ProviderCache`) solved for
the first serve the second, whose plan equals one made without them."""

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.models import build_model  # noqa: E402
from autopar.planner import ProviderCache, plan  # noqa: E402

REFS = {
    "gpt2": "hf:gpt2",
    "llama-gqa": "hf:llama-3-8b?num_hidden_layers=4&seq_len=1024",
    "bert": "hf:bert-base-uncased",
    "opt": "hf:opt-125m",
    "t5": "hf:t5-small",
    "mixtral": "hf:mixtral-8x7b?num_hidden_layers=2&seq_len=1024",
    "qwen-moe": "hf:Qwen/Qwen1.5-MoE-A2.7B?num_hidden_layers=2&seq_len=1024",
}


@pytest.mark.parametrize("family", list(REFS))
def test_hf_family_plans_on_one_and_four_nodes(family):
    bundle = build_model(REFS[family])
    graph = capture(bundle.model, bundle.example_inputs, name=bundle.name)
    assert graph.layers, "repeated blocks must be found"
    providers = ProviderCache()
    for nodes in (1, 4):
        cluster = autopar.ClusterSpec.load("dgx-a100-80g", num_nodes=nodes)
        p = plan(bundle, cluster, global_batch_size=64 * nodes, graph=graph, providers=providers)
        assert p.world_size == 8 * nodes
        assert sorted(d for s in p.stages if s.virtual_chunk == 0 for d in s.devices) == list(range(8 * nodes))
        assert 0 < p.predicted.peak_memory_bytes <= cluster.device.memory_bytes
        assert p.predicted.iteration_time_s > 0 and p.predicted.tflops_per_device > 0
        covered = {fqn for s in p.stages for fqn in s.placements}
        assert set(graph.params) <= covered, set(graph.params) - covered
        if p.tp > 1:
            assert any("S(" in x for s in p.stages for pl in s.placements.values() for x in pl)


def test_hf_model_through_the_cli(tmp_path):
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "autopar", "plan", "--model", "hf:gpt2", "--cluster",
                        "dgx-a100-80g", "--nodes", "4", "-b", "256", "-o", str(out), "-q"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "autopar plan for hf:gpt2" in r.stdout and autopar.load_plan(out).world_size == 32


def test_tensor_parallelism_beyond_the_key_value_heads_plans_where_the_executor_runs_it():
    """Llama with 2 key/value heads: k_proj's 32 output features are 2 heads of 16, so 4 ranks
    cannot each take whole heads. The executor runs the ILP's layout (tp=4 plans, op by op:
    `tests/test_runtime_user_models.py` runs it against one process), under ZeRO-3 and in a
    pipeline too. (DTensor's propagation, which splits heads Megatron-style, runs only stages of
    different tp degrees now, where the head split still binds.)"""
    ref = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=2"
           "&num_attention_heads=4&seq_len=16&vocab_size=128")
    p = plan(ref, _cpu(4), global_batch_size=8, dtype="fp32", constraints=autopar.Constraints(dp=1, tp=4, pp=1))
    assert p.tp == 4 and all(s.op_layouts is not None for s in p.stages)
    z3 = plan(ref, _cpu(8), global_batch_size=8, dtype="fp32",
              constraints=autopar.Constraints(dp=2, tp=4, pp=1, zero_stage=3))
    assert z3.tp == 4 and all(s.op_layouts is not None for s in z3.stages)
    piped = plan(ref, _cpu(16), global_batch_size=8, dtype="fp32",
                 constraints=autopar.Constraints(dp=2, tp=4, pp=2, zero_stage=3, num_microbatches=2))
    assert piped.pp == 2 and all(s.op_layouts is not None for s in piped.stages)


def _cpu(n: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})
