"""A fused qkv projection split into [q; k; v] blocks (nanoGPT's `c_attn(x).split(h, dim=2)`,
Hugging Face GPT-2's Conv1D) sharded by heads with no gather (issue 20, "a freed ILP"): the
executor holds the fused weight's output features chunk-interleaved over tp, Megatron's QKV
layout (`StageLayouts.param_layouts`), so each rank's shard holds its heads of q, k and v.
Checkpoints and `full_state` see the weight in the model's own row order
(`runtime.interleaved`), so a checkpoint resumes in any layout."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import autopar
from tests.captured import planned as plan  # one capture of nanoGPT, its per-layer costs shared

NANOGPT = "tests.user_models:nanogpt"
HF_GPT2 = ("hf:gpt2?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&seq_len=16&vocab_size=128"
           "&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0")


def _cpu(n: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": n})


def _graph(ref: str):
    from autopar.capture import capture
    from autopar.planner import resolve_model

    b = resolve_model(ref, None, None)
    return capture(b.model, b.example_inputs, name=b.name)


def test_the_projection_behind_a_split_is_found_through_reshapes():
    """`fused_weight`: nanoGPT's Linear (weight rows, bias), GPT-2's Conv1D (addmm reading
    the weight's columns, seen through the view back to 3-D); nothing for a split of a tensor
    that is not a projection of parameters (the zoo GPT's head-major qkv is split after a view
    that changes the last dim)."""
    from autopar.intra_op.rules.view import fused_weight

    def split_inputs(g):
        return [n.inputs[0] for n in g.calls if n.op == "split"]

    g = _graph(NANOGPT)
    first = split_inputs(g)[0]
    assert fused_weight(g, first) == [("h.0.attn.c_attn.weight", 0), ("h.0.attn.c_attn.bias", 0)]
    pytest.importorskip("transformers")
    g2 = _graph(HF_GPT2)
    found = fused_weight(g2, split_inputs(g2)[0])
    assert found == [("transformer.h.0.attn.c_attn.weight", 1), ("transformer.h.0.attn.c_attn.bias", 0)]
    gz = _graph("gpt-tiny")
    assert all(fused_weight(gz, x) is None for x in split_inputs(gz))


def test_a_tp_plan_holds_the_fused_qkv_interleaved_and_gathers_nothing():
    """nanoGPT at tp 2: every block's c_attn weight and bias interleaved in 3 chunks, and the
    plan's collectives are the Megatron ones (all-reduces only, no all-gather of the qkv
    output). Under ZeRO-3 too (dp 2 x tp 2, run as solved: FSDP shards the interleaved tp shard
    again over dp), its only all-gathers FSDP's, one per unit and pass."""
    p = plan(NANOGPT, _cpu(2), global_batch_size=8, dtype="fp32",
             constraints=autopar.Constraints(dp=1, tp=2, pp=1))
    lay = p.stages[0].op_layouts
    for i in range(4):
        assert lay.param_layouts[f"h.{i}.attn.c_attn.weight"] == (0, 3)
        assert lay.param_layouts[f"h.{i}.attn.c_attn.bias"] == (0, 3)
    assert "all_gather" not in p.predicted.collectives, p.predicted.collectives
    z3 = plan(NANOGPT, _cpu(4), global_batch_size=8, dtype="fp32",
              constraints=autopar.Constraints(dp=2, tp=2, pp=1, zero_stage=3))
    from autopar.planner import _zero3_counts

    st = z3.stages[0]
    assert st.op_layouts.param_layouts == lay.param_layouts
    assert z3.predicted.collectives["all_gather"] == _zero3_counts(st.fsdp_units, True, 1, False)["all_gather"]


def _exchange(rank: int, n: int, port: int) -> None:
    import torch.distributed as dist

    from autopar.intra_op.execute import interleave
    from autopar.runtime.interleaved import from_canonical, to_canonical

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        for dim, chunks, shape in [(0, 3, (6 * n, 5)), (1, 3, (5, 6 * n)), (0, 2, (4 * n,))]:
            w = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            mine = interleave(w, dim, chunks, n).chunk(n, dim)[rank]
            canon = to_canonical(mine, dim, chunks, None)
            assert torch.equal(canon, w.chunk(n, dim)[rank]), (n, dim, chunks)
            assert torch.equal(from_canonical(canon, dim, chunks, None), mine)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n", [2, 4])
def test_interleaved_shards_exchange_into_the_model_row_order(n: int):
    """Each rank's interleaved shard ([q_r; k_r; v_r]) becomes its contiguous shard of the
    model-order tensor and back, in one all-to-all (3 chunks over 2 and 4 ranks, along dim 0
    and dim 1; 2 chunks)."""
    import socket

    from tests.launch import start_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_processes(_exchange, (n, port), n)


@pytest.mark.slow
def test_a_checkpoint_of_interleaved_weights_resumes_in_another_layout(tmp_path: Path):
    """nanoGPT at tp 2 (qkv interleaved) saves every 2 steps; a dp 2 plan resumes its step-2
    checkpoint, and a tp 2 run resumes the dp run's step-3 one: all end at the parameters
    of the uninterrupted tp run."""
    steps = 4
    cons = {"tp": autopar.Constraints(dp=1, tp=2, pp=1), "dp": autopar.Constraints(dp=2, tp=1, pp=1)}
    plans = {k: plan(NANOGPT, _cpu(2), global_batch_size=8, dtype="fp32", constraints=c) for k, c in cons.items()}
    assert plans["tp"].stages[0].op_layouts.param_layouts
    _round_trip(tmp_path, plans["tp"], plans["dp"], steps)


@pytest.mark.slow
def test_a_zero3_checkpoint_of_interleaved_weights_resumes_in_another_layout(tmp_path: Path):
    """nanoGPT at dp 2 x tp 2 with ZeRO-3 (qkv interleaved, FSDP's 2-D shards) saves every 2
    steps; a tp 2 plan resumes its step-2 checkpoint (the save's model order), and the ZeRO-3
    plan resumes the tp run's step-3 one (a load back into the interleaved 2-D shards): both
    end at the parameters of the uninterrupted ZeRO-3 run."""
    steps = 4
    z3 = plan(NANOGPT, _cpu(4), global_batch_size=8, dtype="fp32",
              constraints=autopar.Constraints(dp=2, tp=2, pp=1, zero_stage=3))
    tp = plan(NANOGPT, _cpu(2), global_batch_size=8, dtype="fp32", constraints=autopar.Constraints(dp=1, tp=2, pp=1))
    assert z3.stages[0].op_layouts.param_layouts and z3.stages[0].fsdp_units
    _round_trip(tmp_path, z3, tp, steps)


def _round_trip(tmp_path: Path, first, second, steps: int) -> None:
    """Train nanoGPT with plan `first`, checkpoint at step 2, resume with `second` to step 3,
    resume that with `first` to the end: the final weights of the three runs are equal (the
    fused qkv weight stored in the model's row order whatever layout held it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from autopar.runtime import run
    from tests.captured import untracked

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    with untracked():      # the weights are compared, not memory (the memory tests')
        run(first, NANOGPT, steps=steps, checkpoint_dir=str(a), checkpoint_every=2, quiet=True)
        b.mkdir()
        shutil.copytree(a / "step_00000002", b / "step_00000002")
        rb = run(second, NANOGPT, steps=steps, checkpoint_dir=str(b), quiet=True)
        assert [r["step"] for r in rb if "step" in r] == [2, 3]
        c.mkdir()
        shutil.copytree(b / "step_00000003", c / "step_00000003")
        rc = run(first, NANOGPT, steps=steps, checkpoint_dir=str(c), quiet=True)
    assert [r["step"] for r in rc if "step" in r] == [3]

    def final(d: Path) -> dict:
        out = d / "final.pt"
        dcp_to_torch_save(str(d / f"step_{steps:08d}"), str(out))
        return torch.load(out, weights_only=False)

    fa, fb, fc = final(a), final(b), final(c)
    keys = [k for k in fa if k.startswith("model.")]
    assert "model.h.0.attn.c_attn.weight" in keys
    for k in keys:
        assert torch.allclose(fa[k], fb[k], rtol=1e-4, atol=1e-5), (k, (fa[k] - fb[k]).abs().max())
        assert torch.allclose(fa[k], fc[k], rtol=1e-4, atol=1e-5), (k, (fa[k] - fc[k]).abs().max())
