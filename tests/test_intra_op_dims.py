"""Batch and token dims (`autopar.intra_op.dims`) and the ILP on a model axis: the tp axis as
the runtime runs it (whole micro-batch and sequence on every rank) gets Megatron's layers, with
the collectives DTensor issues for them, for GPT and Llama at the scale where the free ILP
prefers sequence slices."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture
from autopar.inter_op.layers import build_layers
from autopar.inter_op.stage_cost import AnalyticProvider
from autopar.intra_op import batch_dims_of, solve_graph, token_dims_of
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.planner import resolve_model
from autopar.schema import ClusterSpec
from cost_models.communication import logical_mesh


def _gpt(hidden: int, seq: int, heads: int, layers: int = 2):
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab_size=256, seq_len=seq, hidden=hidden, layers=layers, heads=heads))
    x = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return capture(m, (x, x))


def _ops(g, op):
    return [n.name for n in g.nodes if n.kind == "call" and n.op == op]


def test_token_dims_follow_the_sequence_not_sizes():
    """hidden == sequence length (as in GPT-3 1.3B): only the sequence dims are token dims."""
    g = _gpt(hidden=32, seq=32, heads=4)
    b, t = batch_dims_of(g), token_dims_of(g)
    ids = [n.name for n in g.nodes if n.kind == "input"]
    assert all(b[i] == (0,) and t[i] == (1,) for i in ids)
    (emb, *_), (q_lin, *_) = _ops(g, "embedding"), _ops(g, "linear")
    assert t[emb] == (1,) and t[q_lin] == (1,)          # (b, s, h): not the hidden dim
    sdpa = _ops(g, "scaled_dot_product_attention")[0]
    assert t[sdpa] == (2,)                               # (b, heads, s, d)
    for n in g.nodes:
        if n.kind == "param":
            assert n.name not in t
    # the residual stream of every block carries the sequence in dim 1 only
    for add in _ops(g, "add"):
        if len(g.node(add).outputs[0].shape) == 3:
            assert t[add] == (1,), add


def _llama3():
    """llama-tiny's shapes with three blocks, so that block 1 is a middle one."""
    with torch.device("meta"):
        m = Llama(LlamaConfig(vocab_size=256, seq_len=32, hidden=64, layers=3, heads=4, kv_heads=2, ffn_hidden=128))
    x = torch.zeros(1, 32, dtype=torch.long, device="meta")
    return m, (x, x)


def _layer_problem(name: str, mb: int, tp: int, li: int = 1):
    if name == "llama-3-blocks":
        model, inputs = _llama3()
    else:
        b = resolve_model(name, None, None)
        model, inputs = b.model, b.example_inputs
    g = capture(model, inputs)
    layers = build_layers(g, model)
    cl = ClusterSpec.load("dgx-a100-80g")
    lay = layers[li]
    gg = AnalyticProvider(g, layers, cl, "bf16").graph_at(mb, lay)
    mesh = logical_mesh(cl, list(range(tp)), (tp,))
    kw = dict(dtype="bf16", nodes=list(lay.nodes), interleaved_splits=False, cyclic_boundary=True)
    return g, gg, mesh, kw


@pytest.mark.parametrize("model,mb,tp", [("gpt3-1.3b", 16, 2), ("llama-3-blocks", 4, 2)])
def test_model_axis_gives_megatron_layers(model, mb, tp):
    g, gg, mesh, kw = _layer_problem(model, mb, tp)
    free = solve_graph(gg, mesh, **kw)
    sol = solve_graph(gg, mesh, **kw, batch_dims=batch_dims_of(g), token_dims=token_dims_of(g), model_axes=(0,))
    # per block: the two row-parallel outputs all-reduced forward, the two norms' output
    # gradients backward (Megatron's f and g); nothing sliced, gathered or exchanged
    assert sol.collective_counts() == {"all_reduce": 4}, sol.collective_counts()
    for fqn, pl in sol.param_placements.items():
        if fqn.endswith("weight") and len(g.params[fqn].shape) == 2:
            assert pl[0] != "R", fqn                     # every weight GEMM splits its weight
    mine = set(kw["nodes"])
    for n in gg.nodes:
        if n.name in mine and n.op in ("add", "layer_norm", "rms_norm") and len(n.outputs[0].shape) == 3:
            # the residual stream stays whole (no sequence or hidden slices between blocks)
            assert sol.op_choices[n.name].output_placements[0] == ("R",), n.name
    if model == "gpt3-1.3b":
        # what the model axis removes: left free, the ILP runs this layer otherwise
        assert free.collective_counts() != sol.collective_counts()
        assert free.objective < sol.objective
