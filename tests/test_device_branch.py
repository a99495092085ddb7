"""A model that branches on its device runs, op by op, the branch its device runs (issue 20).

The executor's program is a torch.export of a data-less copy of the model
(`execute.meta_program`). Traced on the meta device, a model's `if x.device.type == "cpu"`
took the other branch than the one its CPU run takes; traced on fake CPU tensors it takes the
CPU's. `DeviceBranchMLP` scales its hidden activations by 2 on the CPU and by 3 elsewhere, so
the two programs compute different losses from the same inputs and weights.
"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.intra_op import auto_shard, execute
from tests.launch import start_processes

WORLD = 2


class DeviceBranchMLP(nn.Module):
    """Two linears with a device-dependent scale between them, and a mean-squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if h.device.type == "cpu":
            h = h * 2.0
        else:
            h = h * 3.0
        return ((self.fc2(h) - y) ** 2).sum() / y.numel()


def _data() -> tuple[DeviceBranchMLP, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return DeviceBranchMLP(), (torch.randn(4, 8), torch.randn(4, 8))


def _solution():
    with torch.device("meta"):
        meta = DeviceBranchMLP()
    mesh = autopar.LogicalMesh(shape=(WORLD,), alpha=(1e-5,), beta=(1 / 25e9,))
    return auto_shard(meta, tuple(torch.empty(4, 8, device="meta") for _ in range(2)), mesh=mesh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, sol, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        try:
            model, inputs = _data()
            prog = sol.apply(model, inputs, init_device_mesh("cpu", (WORLD,)))
            loss = prog(*inputs)
            loss.backward()
            grads = {k: v.detach() for k, v in prog.full_gradients().items()}
            torch.save({"loss": loss.detach(), "grads": grads,
                        "traced": str(getattr(prog.program, "autopar_traced_device", None))},
                       os.path.join(folder, f"rank{rank}.pt"))
        finally:
            dist.destroy_process_group()
    except Exception:
        import traceback

        with open(os.path.join(folder, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def test_program_traced_for_the_cpu_takes_the_cpu_branch():
    """On the CPU the program is traced for the CPU (fake CPU tensors, no data) and multiplies
    by 2; traced on meta, by 3; the cache keeps both apart (the traced device in its key)."""
    model, inputs = _data()
    cpu, _ = execute.meta_program(model, inputs, device=torch.device("cpu"))
    meta, _ = execute.meta_program(model, inputs, device=torch.device("cpu"), trace=False)
    assert cpu is not meta
    assert cpu.autopar_traced_device == torch.device("cpu") and meta.autopar_traced_device is None

    def scales(p):
        return [n.args[1] for n in p.graph.nodes if n.target is torch.ops.aten.mul.Tensor]

    assert scales(cpu) == [2.0] and scales(meta) == [3.0]
    assert execute.meta_program(model, inputs, device=torch.device("cpu"))[0] is cpu


def test_fake_cuda_program_without_a_gpu():
    """A CUDA rank's program is traced on fake CUDA tensors, also on this CPU-only machine, and
    takes the model's non-CPU branch; its batch stays symbolic."""
    model, inputs = _data()
    p, _ = execute.meta_program(model, inputs, device=torch.device("cuda", 1))
    assert p.autopar_traced_device == torch.device("cuda", 1)
    assert [n.args[1] for n in p.graph.nodes if n.target is torch.ops.aten.mul.Tensor] == [3.0]
    from torch.export.graph_signature import InputKind

    users = {s.arg.name for s in p.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    batch = [n.meta["val"].shape[0] for n in p.graph.nodes if n.name in users]
    assert len(batch) == 2 and not any(isinstance(b, int) for b in batch)


def test_verify_of_a_gpu_plan_traces_the_cuda_program():
    """While `cuda_program` is active (verify of a GPU plan, ranks on CPU fake tensors) the
    program for a CPU-held model is traced for CUDA: the model's CUDA branch, kept apart from
    the CPU one."""
    from autopar.runtime.cuda_program import cuda_program

    model, inputs = _data()
    with cuda_program():
        p, _ = execute.meta_program(model, inputs, device=torch.device("cpu"))
    assert p.autopar_traced_device == torch.device("cuda", 0)
    assert [n.args[1] for n in p.graph.nodes if n.target is torch.ops.aten.mul.Tensor] == [3.0]
    assert execute.meta_program(model, inputs, device=torch.device("cpu"))[0] is not p


def test_tp2_executor_runs_the_cpu_branch_as_one_process():
    """tp2 on 2 gloo processes: the executor's loss and gradients are one process's CPU run's
    (the meta branch would scale by 3 instead of 2)."""
    sol = _solution()
    model, inputs = _data()
    want = model(*inputs)
    want.backward()
    with tempfile.TemporaryDirectory() as d:
        try:
            start_processes(_worker, (_free_port(), sol, d), WORLD)
        except Exception as e:
            errs = [open(os.path.join(d, f)).read() for f in os.listdir(d) if f.endswith(".err")]
            raise AssertionError("worker failed:\n" + "\n".join(errs[:1])) from e
        got = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]
    for res in got:
        assert res["traced"] == "cpu"
        torch.testing.assert_close(res["loss"], want.detach(), rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(res["grads"][name], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32"])
def test_hf_mixtral_fp32_verifies(dtype):
    """HF Mixtral's experts call `torch._grouped_mm` on CPU in fp32 (CPU's kernel takes it);
    torch 2.13's fake kernel applied CUDA's bf16-only check, so verify failed ("Expected inputs
    of BF16 type"); `runtime.fake_kernels` makes the CPU kernel's output."""
    pytest.importorskip("transformers")
    from autopar import ClusterSpec, Constraints
    from autopar.planner import plan
    from autopar.runtime.verify import verify
    from tests.test_moe import _MIXTRAL

    cluster = ClusterSpec.load("cpu").model_copy(update={"devices_per_node": 4})
    p = plan(_MIXTRAL, cluster, global_batch_size=8, dtype=dtype,
             constraints=Constraints(dp=2, tp=2, pp=1, ep=2, zero_stage=0, recompute="none", num_microbatches=1))
    r = verify(p, _MIXTRAL, jobs=1)
    assert r.ok, r.failures
    assert r.collectives_match is True
