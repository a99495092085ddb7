"""Apply intra-op solutions on a 4-process gloo mesh (CPU) and check them against one process:
same loss, same gradients, and the collectives CommDebugMode counts equal the solution's
`collective_counts()`. A zoo Llama's solution is also executed (loss and gradients only).

The solutions come from `autopar.intra_op.auto_shard`; they are applied with
`autopar.runtime.spmd.parallelize` (parameters -> DTensors with the planned placements, inputs
-> DTensors from their local shards; each module's output redistributed to the layout the plan
consumes it in: `output_placements=ShardingSolution.module_output_placements`), and the
gradient synchronisation is the redistribution of each gradient to its parameter's placements
(`grads_to_param_layout`).
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autopar
from autopar.intra_op import auto_shard
from autopar.models.mlp import MLP

WORLD = 4


class MLPSumLoss(MLP):
    """The zoo MLP with its mean-squared error written as sum / numel: a batch-split loss is
    then a Partial(sum). (DTensor's mse_loss over a batch split gives Partial(avg), whose
    backward through a redistribution to Replicate scales the gradients by the mesh size in
    torch 2.13; the one-process loss is the same either way.)"""

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return ((x - y) ** 2).sum() / x.numel()


# (model, batch, hidden, mesh shape, expected plan): Megatron when the weights outweigh the
# activations, data parallel when the batch does, both on a 2-D mesh whose axis 0 is 100x
# slower (data parallel there, Megatron on the fast axis). alpha = 0: choices by bytes alone.
CASES = {
    "megatron": (MLP, 8, 64, (4,), {"layers.0.weight": ("S(0)",), "layers.1.weight": ("S(1)",)}),
    "data-parallel": (MLPSumLoss, 256, 16, (4,), {"layers.0.weight": ("R",), "layers.1.weight": ("R",)}),
    "2d": (MLPSumLoss, 192, 64, (2, 2), {"layers.0.weight": ("R", "S(0)"), "layers.1.weight": ("R", "S(1)")}),
}


# a zoo transformer (GQA, RoPE, RMSNorm, SwiGLU, cross-entropy), solved on (4,): its
# placements must execute with the one-process loss and gradients. Its collective counts are
# not compared: only module outputs follow the plan, and inside attention DTensor's own
# propagation picks other layouts than the plan's.
ZOO = ("llama-tiny", 4)


def _mesh(shape):
    beta = (1 / 25e9,) if len(shape) == 1 else (100 / 300e9, 1 / 300e9)
    return autopar.LogicalMesh(shape=shape, alpha=(0.0,) * len(shape), beta=beta)


def _solution(cls, batch, hidden, shape):
    with torch.device("meta"):
        m = cls(hidden, hidden, 2)
    x = torch.zeros(batch, hidden, device="meta")
    return auto_shard(m, (x, x), mesh=_mesh(shape))


def _kind(op) -> str:
    name = str(op).split(".")[-1] if "." in str(op) else str(op)
    name = getattr(op, "__name__", name)
    for k, v in (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("all_gather", "all_gather"),
                 ("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
                 ("all_to_all", "all_to_all"), ("alltoall", "all_to_all")):
        if k in str(op):
            return v
    return str(op)


def _zoo_case(mesh, zoo):
    from torch.distributed.tensor import DTensor

    from autopar.models import build_model
    from autopar.runtime.spmd import grads_to_param_layout, local_shard_rows, parallelize

    name, batch, params, inputs, mods = zoo
    torch.manual_seed(0)
    ref = build_model(name, device="cpu", batch_size=batch).model
    vocab = ref.embed.weight.shape[0]
    seq = 16
    toks, tgt = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    loss_ref = ref(toks, tgt)
    loss_ref.backward()
    torch.manual_seed(0)
    model = build_model(name, device="cpu", batch_size=batch).model
    sp = parallelize(model, mesh, params, inputs, output_placements=mods)
    loss = sp(*[local_shard_rows(t, mesh, pl) for t, pl in zip((toks, tgt), inputs)])
    loss.backward()
    grads_to_param_layout(model.parameters())
    ref_g = dict(ref.named_parameters())
    err = max(float(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - ref_g[n].grad).abs().max())
              for n, p in model.named_parameters())
    return {"loss": (float(loss.detach()), float(loss_ref.detach())), "grad_err": err}


def _worker(rank, port, cases, result_dir, zoo=None):
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.debug import CommDebugMode

        from autopar.runtime.spmd import grads_to_param_layout, local_shard_rows, parallelize

        out = {}
        for name, (cls, batch, hidden, shape, params, inputs, counts, mods) in cases.items():
            mesh = init_device_mesh("cpu", shape)
            torch.manual_seed(0)
            ref = cls(hidden, hidden, 2)
            x = torch.randn(batch, hidden)
            y = torch.randn(batch, hidden)
            loss_ref = ref(x, y)
            loss_ref.backward()
            grads_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}

            torch.manual_seed(0)
            model = cls(hidden, hidden, 2)
            sp = parallelize(model, mesh, params, inputs, output_placements=mods)
            xs = [local_shard_rows(t, mesh, pl) for t, pl in zip((x, y), inputs)]
            with CommDebugMode() as comm:
                loss = sp(*xs)
                loss.backward()
                grads_to_param_layout(model.parameters())
            got = {}
            for op, n in comm.get_comm_counts().items():
                got[_kind(op)] = got.get(_kind(op), 0) + n
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                     for n, p in model.named_parameters()}
            out[name] = {
                "loss": (float(loss.detach()), float(loss_ref.detach())),
                "grad_err": max(float((grads[n] - grads_ref[n]).abs().max()) for n in grads_ref),
                "counts": got,
                "placements": {n: tuple(str(q) for q in p.placements) for n, p in model.named_parameters()},
            }
        if zoo is not None:
            out["zoo"] = _zoo_case(init_device_mesh("cpu", (WORLD,)), zoo)
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - report to the parent
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def solutions():
    sols = {}
    for name, (cls, batch, hidden, shape, _) in CASES.items():
        sols[name] = _solution(cls, batch, hidden, shape)
    return sols


def test_solutions_are_the_expected_plans(solutions):
    for name, (_, _, _, _, expect) in CASES.items():
        assert solutions[name].param_placements == expect, name


def test_solutions_execute_on_a_gloo_mesh(solutions):
    cases = {}
    for name, (cls, batch, hidden, shape, _) in CASES.items():
        sol = solutions[name]
        inputs = [sol.input_placements[k] for k in ("args_0", "args_1")]
        cases[name] = (cls, batch, hidden, shape, sol.param_placements, inputs, sol.collective_counts(),
                       sol.module_output_placements)
    from autopar.models import build_model

    b = build_model(ZOO[0], batch_size=ZOO[1])
    zsol = auto_shard(b.model, b.example_inputs, mesh=_mesh((WORLD,)))
    assert not zsol.warnings
    zoo = (ZOO[0], ZOO[1], zsol.param_placements, [zsol.input_placements[k] for k in ("args_0", "args_1")],
           zsol.module_output_placements)
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_worker, args=(_free_port(), cases, d, zoo), nprocs=WORLD, join=True,
                               start_method="spawn")
        except Exception:
            errs = [open(os.path.join(d, f)).read() for f in os.listdir(d) if f.endswith(".err")]
            raise AssertionError("worker failed:\n" + "\n".join(errs[:1]))
        results = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]
    for name in CASES:
        expect = cases[name][6]
        for r, res in enumerate(results):
            got = res[name]
            loss, loss_ref = got["loss"]
            assert loss == pytest.approx(loss_ref, rel=1e-5), (name, r)
            assert got["grad_err"] < 1e-5, (name, r, got["grad_err"])
            assert got["counts"] == expect, (name, r, got["counts"], expect)
    for r, res in enumerate(results):
        loss, loss_ref = res["zoo"]["loss"]
        assert loss == pytest.approx(loss_ref, rel=1e-5), r
        assert res["zoo"]["grad_err"] < 1e-5, (r, res["zoo"]["grad_err"])
