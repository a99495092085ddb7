"""The program a rank traces for its device is matched to the solution solved on the planner's
meta capture (`intra_op.program_match`, issue 20).

Hugging Face attention's `.transpose(1, 2).contiguous()` is an op on the meta device (its
attention kernel writes heads-major) and none on the CPU (CPU's kernel writes as the query is
laid out), and torch.export's op numbers shift after it; the device's program used to be thrown
away for the meta one (a second export per worker). A difference that computes something still
makes the rank run the meta program, and says so.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import autopar
from autopar.intra_op import auto_shard, execute
from autopar.intra_op.program_match import match_names

HF_LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=2"
            "&num_attention_heads=4&seq_len=16&vocab_size=128")


def test_hugging_face_llama_runs_the_program_traced_for_the_cpu():
    pytest.importorskip("transformers")
    from autopar.models.registry import build_model
    from autopar.planner import plan

    cl = autopar.ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 2})
    p = plan(HF_LLAMA, cl, global_batch_size=2, dtype="fp32",
             constraints=autopar.Constraints(dp=1, tp=2, pp=1, recompute="none"))
    sol = p.stages[0].op_layouts.solution((2,))
    b = build_model(HF_LLAMA, device="cpu", batch_size=2)
    meta, _ = execute.meta_program(b.model, b.example_inputs, device=torch.device("cpu"), trace=False)
    contiguous = [k for k in execute._program_calls(meta.graph_module) if k.startswith("contiguous")]
    assert len(contiguous) == 2                  # one per layer, after attention, on meta only

    program, _ = execute.fitting_program(b.model, b.example_inputs, sol, device=torch.device("cpu"))
    assert program.autopar_traced_device == torch.device("cpu")
    calls = execute._program_calls(program.graph_module)
    assert not any(k.startswith("contiguous") for k in calls)
    # every other op of the solution is in the device's program under the capture's name, with
    # the same kind of op and the same tensor inputs (the attention's output reads on as a view)
    missing = set(sol.op_choices) - set(calls)
    assert missing == set(contiguous)
    assert execute._mismatch(program, sol) == []
    for name in sol.op_choices.keys() - missing:
        assert calls[name].target == execute._program_calls(meta.graph_module)[name].target


class DeviceOps(nn.Module):
    """A model computing a tanh on the CPU only (`cpu_tanh`), or everywhere but on the CPU."""

    def __init__(self, cpu_tanh: bool) -> None:
        super().__init__()
        self.cpu_tanh = cpu_tanh
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if (h.device.type == "cpu") == self.cpu_tanh:
            h = torch.tanh(h)
        return ((self.fc2(h) - y) ** 2).mean()


def _programs(cpu_tanh: bool, caplog):
    torch.manual_seed(0)
    model, inputs = DeviceOps(cpu_tanh), (torch.randn(4, 8), torch.randn(4, 8))
    with torch.device("meta"):
        meta_model = DeviceOps(cpu_tanh)
    mesh = autopar.LogicalMesh(shape=(2,), alpha=(1e-5,), beta=(1 / 25e9,))
    sol = auto_shard(meta_model, tuple(torch.empty(4, 8, device="meta") for _ in range(2)), mesh=mesh)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        program, _ = execute.fitting_program(model, inputs, sol, device=torch.device("cpu"))
    return program, sol


def test_an_op_only_the_device_computes_runs_unplanned_and_is_said(caplog):
    """The CPU's branch is what the model computes on the CPU: it runs, its extra op laid out by
    DTensor's propagation, and the log says which op the plan did not solve."""
    program, sol = _programs(True, caplog)
    assert program.autopar_traced_device == torch.device("cpu")
    assert "tanh" not in sol.op_choices and "tanh" in execute._program_calls(program.graph_module)
    assert "run unplanned" in caplog.text and "tanh" in caplog.text


def test_a_solved_op_the_device_program_lacks_runs_the_meta_program_and_says_so(caplog):
    """The plan solved a tanh the CPU's program does not compute, and it is no layout change: the
    rank runs the program the planner captured, and the log says so, naming the op."""
    program, sol = _programs(False, caplog)
    assert "tanh" in sol.op_choices
    cpu, _ = execute.meta_program(DeviceOps(False), (torch.randn(4, 8), torch.randn(4, 8)), device=torch.device("cpu"))
    assert "tanh" in match_names(cpu, sol)
    assert program.autopar_traced_device is None
    assert "does not fit the plan's solution" in caplog.text and "tanh" in caplog.text


def test_a_pipeline_rank_runs_the_program_traced_for_the_cpu():
    """A pipeline rank's chunks are part of the program: it is matched against every chunk's op
    choices (in pipeline order), so the later chunks' ops keep the capture's names too."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from autopar.models.registry import build_model
    from autopar.planner import plan

    cl = autopar.ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    p = plan(HF_LLAMA, cl, global_batch_size=4, dtype="fp32",
             constraints=autopar.Constraints(dp=1, tp=2, pp=2, num_microbatches=2, recompute="none"))
    every = SimpleNamespace(op_choices={k: c for s in p.stages
                                        for k, c in s.op_layouts.solution((2,)).op_choices.items()})
    b = build_model(HF_LLAMA, device="cpu", batch_size=2)
    program, _ = execute.fitting_program(b.model, b.example_inputs, p.stages[0].op_layouts.solution((2,)),
                                         device=torch.device("cpu"), whole=every)
    assert program.autopar_traced_device == torch.device("cpu")
    calls = execute._program_calls(program.graph_module)
    last = [op for lay in p.stages[-1].op_layouts.layers for op in lay.ops]
    assert all(op in calls for op in last if not op.startswith("contiguous"))


class CudaSyncMLP(nn.Module):
    """An MLP that synchronises the GPU when it runs on one: a CPU-only torch cannot trace that
    for CUDA ("Torch not compiled with CUDA enabled")."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda.synchronize()
        return ((self.fc2(torch.relu(self.fc1(x))) - y) ** 2).mean()


def cuda_sync_mlp():
    """(model on meta, example inputs, batch function): `autopar`'s MODULE:FACTORY contract."""
    with torch.device("meta"):
        model = CudaSyncMLP()
    x = torch.zeros(4, 16, device="meta")

    def batch(step: int, batch_size: int):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 16, generator=g), torch.randn(batch_size, 16, generator=g)

    return model, (x, x), batch


def _gpu_plan(ref: str, **kw):
    from autopar.planner import plan

    return plan(ref, autopar.ClusterSpec.load("dgx-h100", num_nodes=1), global_batch_size=8, dtype="bf16",
                constraints=autopar.Constraints(pp=1, recompute="none", zero_stage=0, **kw))


def test_verify_says_when_a_rank_ran_the_program_traced_on_meta():
    """verify of a GPU plan traces each rank's program for CUDA on fake tensors; where that
    trace fails, the rank runs the meta program, and its report says so and why."""
    from autopar.runtime.verify import verify

    ref = "tests.test_program_match:cuda_sync_mlp"
    p = _gpu_plan(ref, dp=4, tp=2)
    r = verify(p, ref, jobs=1)
    assert r.ok, r.failures
    notes = [n for rc in r.ranks for n in rc.notes if "traced on the meta device" in n]
    assert notes and "CudaSyncMLP" in notes[0] and "cuda" in notes[0]


def test_hugging_face_gpt2_gpu_ranks_run_the_program_traced_for_cuda():
    """A CPU-only torch traces Hugging Face GPT-2 for CUDA (`fake_cuda.CudaMethods`: its
    attention's `.contiguous()` and the logits' slice as the ops they call), and the program fits
    the plan's solution: verify runs it, with no note of the meta program."""
    pytest.importorskip("transformers")
    from autopar.runtime.cuda_program import cuda_program
    from autopar.runtime.verify import verify

    ref = "hf:gpt2?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&seq_len=16&vocab_size=128"
    p = _gpu_plan(ref, dp=1, tp=8)
    from autopar.models.registry import build_model

    b = build_model(ref, device="meta", batch_size=1)
    with cuda_program():
        program, _ = execute.fitting_program(b.model, b.example_inputs, p.stages[0].op_layouts.solution((8,)),
                                             device=torch.device("cpu"), param_dtype=torch.bfloat16)
    assert program.autopar_traced_device == torch.device("cuda", 0)
    # CUDA's program copies where the meta capture did not (`reshape(...).contiguous()` after
    # the attention kernel): those copies pass their input on as planned (`pass_through`)
    assert any(k.startswith("contiguous_device") for k in execute._program_calls(program.graph_module))
    r = verify(p, ref, jobs=1)
    assert r.ok and r.collectives_match, r.failures
    assert not [n for rc in r.ranks for n in rc.notes if "traced on the meta device" in n]


@pytest.mark.parametrize("index", [
    (slice(None), slice(-3, None), slice(None)), (Ellipsis, 1), (None, 0), (slice(0, None),),
    (slice(None), slice(None, None, 2)), 2, (slice(1, 3), None, Ellipsis, -1)])
def test_basic_index_is_torchs_indexing(index):
    """`fake_cuda.basic_index` computes what `x[index]` does (values, shape and strides), an
    index that selects everything as an alias."""
    from autopar.intra_op.fake_cuda import basic_index

    x = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)
    got, want = basic_index(x, index), x[index]
    assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(got, want)
    assert basic_index(x, (torch.tensor([0, 1]),)) is NotImplemented
