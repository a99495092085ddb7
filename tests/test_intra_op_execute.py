"""Apply intra-op solutions on a 4-process gloo mesh (CPU) and check them against one process:
the same loss and gradients (1e-4 relative), and the collectives CommDebugMode counts equal the
solution's `collective_counts()`: forward against phase "forward", backward against "backward"
plus "grad_sync".

The solutions come from `autopar.intra_op.auto_shard`, for MLPs and for zoo transformers: a GPT
in the Megatron regime (batch 1: weights outweigh activations), the same GPT in the
data-parallel regime (batch 64), a Llama (GQA, RoPE, SwiGLU) at batch 1, whose plan mixes
reduce-scatters, all-to-alls and free shard-to-partial steps and splits its 4 query heads over
the 4 devices with K and V (2 heads) replicated, each device slicing its KV head (`hq@0`, K/V
gradients partial), and both on a (2, 2) mesh (see ZOO). They are applied by
`ShardingSolution.apply` (`autopar.intra_op.execute`, the runtime's one executor): the exported
program runs op by op, each op's inputs redistributed to the layouts its chosen strategy reads
them in. Every case, counts forward and backward. (DTensor propagation with the solution's
parameter placements, once compared here, is no longer a runtime path: issue 20.)
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.intra_op import auto_shard
from autopar.intra_op.execute import deinterleave, interleave
from autopar.models.mlp import MLP
from tests.launch import start_processes

WORLD = 4
REL = 1e-4


class MLPSumLoss(MLP):
    """The zoo MLP with its mean-squared error written as sum / numel: a batch-split loss is
    then a Partial(sum). (Under DTensor propagation, mse_loss over a batch split gives
    Partial(avg), whose backward scales the gradients by the mesh size in torch 2.13; the
    executor computes a split loss itself and takes either.)"""

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return ((x - y) ** 2).sum() / x.numel()


class MLPInPlace(MLP):
    """The zoo MLP halving its hidden activations in place (`x /= 2`, as Hugging Face's Mixtral
    router normalises its top-k weights): an op writing to a tensor that needs a gradient, read
    through the executor's `_Reshard` (autograd forbids writing to the view it returns; the
    executor writes to a copy, `execute._written_inputs`)."""

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x /= 2.0
                x = torch.relu(x)
        return F.mse_loss(x, y)


# (model, batch, hidden, mesh shape, expected plan): Megatron when the weights outweigh the
# activations, data parallel when the batch does, both on a 2-D mesh whose axis 0 is 100x
# slower (data parallel there, Megatron on the fast axis). alpha = 0: choices by bytes alone.
CASES = {
    "megatron": (MLP, 8, 64, (4,), {"layers.0.weight": ("S(0)",), "layers.1.weight": ("S(1)",)}),
    "megatron-in-place": (MLPInPlace, 8, 64, (4,), {"layers.0.weight": ("S(0)",), "layers.1.weight": ("S(1)",)}),
    "data-parallel": (MLPSumLoss, 256, 16, (4,), {"layers.0.weight": ("R",), "layers.1.weight": ("R",)}),
    "2d": (MLPSumLoss, 192, 64, (2, 2), {"layers.0.weight": ("R", "S(0)"), "layers.1.weight": ("R", "S(1)")}),
}

# zoo transformers: (model, batch, mesh shape, a parameter and the placement the regime gives
# it). On (2, 2) (axis 0 slow): the GPT's fused QKV split over both axes (interleaved rows,
# nested all-to-alls, vocab-parallel cross-entropy on one axis and batch on none); the Llama
# data parallel on both axes with its norm weights stored sharded on the fast one (ZeRO-3:
# gathered again for the backward pass) and a vocab-parallel loss over a split batch.
ZOO = {
    "gpt-megatron": ("gpt-tiny", 1, (4,), ("blocks.0.attn.qkv.weight", ("S(0)",))),
    "gpt-data-parallel": ("gpt-tiny", 64, (4,), ("blocks.0.attn.qkv.weight", ("R",))),
    "llama-megatron": ("llama-tiny", 1, (4,), ("layers.0.attn.q_proj.weight", ("S(0)",))),
    "gpt-2d": ("gpt-tiny", 2, (2, 2), ("blocks.0.attn.qkv.weight", ("S(0)", "S(0)"))),
    "llama-2d": ("llama-tiny", 8, (2, 2), ("layers.0.attn_norm.weight", ("R", "S(0)"))),
}
# a Hugging Face Llama: its rotary embedding runs under torch.no_grad (a wrapped subgraph in the
# program) and it traces differently on the meta device than on the CPU (the solution's capture
# is on meta, so the executor runs the meta program on the CPU)
HF_LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=4&num_attention_heads=8"
            "&num_hidden_layers=2&vocab_size=128&seq_len=16")
try:
    import transformers  # noqa: F401

    ZOO["hf-llama"] = (HF_LLAMA, 2, (4,), ("model.layers.0.self_attn.q_proj.weight", ("S(0)",)))
except ImportError:  # pragma: no cover - the [hf] extra is not installed
    pass


def _mesh(shape):
    beta = (1 / 25e9,) if len(shape) == 1 else (100 / 300e9, 1 / 300e9)
    return autopar.LogicalMesh(shape=shape, alpha=(0.0,) * len(shape), beta=beta)


def _solution(cls, batch, hidden, shape):
    with torch.device("meta"):
        m = cls(hidden, hidden, 2)
    x = torch.zeros(batch, hidden, device="meta")
    return auto_shard(m, (x, x), mesh=_mesh(shape))


def _zoo_solution(name, batch, shape):
    from autopar.models import build_model

    b = build_model(name, batch_size=batch)
    return auto_shard(b.model, b.example_inputs, mesh=_mesh(shape))


def _kind(op) -> str:
    for k, v in (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("all_gather", "all_gather"),
                 ("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
                 ("all_to_all", "all_to_all"), ("alltoall", "all_to_all")):
        if k in str(op):
            return v
    return str(op)


def _counts(comm) -> dict[str, int]:
    got: dict[str, int] = {}
    for op, n in comm.get_comm_counts().items():
        got[_kind(op)] = got.get(_kind(op), 0) + n
    return got


def _rel_err(got: dict, ref: dict) -> float:
    """Largest gradient difference, relative to the largest reference gradient."""
    scale = max(float(g.abs().max()) for g in ref.values()) or 1.0
    return max(float((got[n] - ref[n]).abs().max()) for n in ref) / scale


def _run_executor(mesh, model, ref_model, inputs, sol):
    """One step with `sol.apply`: the loss, the gradients' error, counts forward / backward;
    then an SGD step on both and the next loss (the program trains)."""
    from torch.distributed.tensor.debug import CommDebugMode

    loss_ref = ref_model(*inputs)
    loss_ref.backward()
    prog = sol.apply(model, inputs, mesh)
    with CommDebugMode() as fwd:
        loss = prog(*inputs)
    with CommDebugMode() as bwd:
        loss.backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    out = {"loss": (float(loss.detach()), float(loss_ref.detach())),
           "grad_err": _rel_err(prog.full_gradients(), ref),
           "forward": _counts(fwd), "backward": _counts(bwd)}
    for params in (prog.parameters(), ref_model.parameters()):
        torch.optim.SGD(params, lr=0.5, foreach=False).step()
    with torch.no_grad():
        out["next_loss"] = (float(prog(*inputs)), float(ref_model(*inputs)))
    return out


def _zoo_inputs(name, batch):
    from autopar.models import build_model

    torch.manual_seed(0)
    b = build_model(name, device="cpu", batch_size=batch)
    vocab = next(m for m in b.model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    torch.manual_seed(1)
    return b.model, tuple(torch.randint(0, vocab, tuple(x.shape)) for x in b.example_inputs)


def _check_redistribute(shape):
    """Every pair of layouts of an 8x8 tensor on a mesh of `shape`: the values after
    `execute.redistribute`, and its collectives against `placement.transition`'s."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.intra_op.execute import redistribute, to_placements
    from autopar.intra_op.placement import all_specs, transition

    mesh = init_device_mesh("cpu", shape)
    t = torch.arange(64.0).reshape(8, 8)
    wrong, differ = [], []
    for src in all_specs((8, 8), shape, allow_partial=True):
        start = tuple("R" if p == "P" else p for p in src)
        x = redistribute(distribute_tensor(t, mesh, to_placements(start, 2)), to_placements(src, 2))
        for dst in all_specs((8, 8), shape, allow_partial=True):
            with CommDebugMode() as comm:
                y = redistribute(x, to_placements(dst, 2))
            if not torch.equal(y.full_tensor(), t) or y.placements != to_placements(dst, 2):
                wrong.append((src, dst))
            if sum(comm.get_comm_counts().values()) != len(transition((8, 8), 4, src, dst, shape)):
                differ.append((src, dst))
    return {"wrong": wrong, "differ": differ}


def _worker(rank, port, cases, zoo, result_dir):
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from torch.distributed.device_mesh import init_device_mesh

        out = {}
        for name, (cls, batch, hidden, shape, sol) in cases.items():
            mesh = init_device_mesh("cpu", shape)
            torch.manual_seed(0)
            x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)
            torch.manual_seed(0)
            ref = cls(hidden, hidden, 2)
            torch.manual_seed(0)
            out[("executor", name)] = _run_executor(mesh, cls(hidden, hidden, 2), ref, (x, y), sol)
        for name, (model_name, batch, shape, sol) in zoo.items():
            mesh = init_device_mesh("cpu", shape)
            ref, inputs = _zoo_inputs(model_name, batch)
            model, _ = _zoo_inputs(model_name, batch)
            out[("executor", name)] = _run_executor(mesh, model, ref, inputs, sol)
        out["redistribute"] = {shape: _check_redistribute(shape) for shape in ((4,), (2, 2))}
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
    sols = {name: _solution(cls, batch, hidden, shape) for name, (cls, batch, hidden, shape, _) in CASES.items()}
    sols.update({name: _zoo_solution(model, batch, shape) for name, (model, batch, shape, _) in ZOO.items()})
    return sols


def test_solutions_are_the_expected_plans(solutions):
    for name, (_, _, _, _, expect) in CASES.items():
        assert solutions[name].param_placements == expect, name
    for name, (_, _, _, (param, spec)) in ZOO.items():
        assert solutions[name].param_placements[param] == spec, name
        assert not solutions[name].warnings, name


def test_llama_attention_splits_query_heads_over_more_devices_than_kv_heads(solutions):
    """llama-tiny (4 query heads, 2 KV heads) on 4 devices: the attention splits its query heads
    and reads K and V replicated (`rules.attention`), not replicated itself."""
    sol = solutions["llama-megatron"]
    att = [c for c in sol.op_choices.values() if c.family == "attention"]
    assert att and all(c.strategy == "hq@0" for c in att), [c.strategy for c in att]
    assert all(c.input_placements == [("S(1)",), ("R",), ("R",)] for c in att)


def test_interleave_round_trip():
    w = torch.arange(24.0).reshape(12, 2)              # fused q, k, v of 4 rows each
    lay = interleave(w, 0, 3, 2)
    assert lay[:6, 0].tolist() == [0, 2, 8, 10, 16, 18]            # device 0: rows 0-1 of q, k, v
    assert torch.equal(deinterleave(lay, 0, 3, 2), w)


def test_regather_frees_a_gathered_parameter_after_its_last_forward_reader(monkeypatch):
    """A parameter gathered for an op (`_Reshard` of a sharded parameter, `_Regather.track`) is
    not kept by the executor: once the forward drops its last reference it is freed, before the
    forward ends (the plan counts it while its op runs; a strong reference kept Megatron-SP's
    tied embedding table, gathered for the lookup, to the forward's end: +17 KiB activations,
    `benchmarks/memory_accuracy.py`). What an op saved from it is still unpacked by gathering
    the shard again, and a later tensor that happens to get the freed storage's identity is
    saved as itself, not as the parameter's recipe."""
    import gc
    import types
    import weakref

    from autopar.intra_op import execute

    shard = torch.arange(6.0).reshape(3, 2)
    regathered = []

    def regather(x, dst, whole=()):       # stands in for the all-gather of the backward pass
        regathered.append(dst)
        return types.SimpleNamespace(_local_tensor=x.repeat(2, 1))    # read as a DTensor's

    monkeypatch.setattr(execute, "redistribute", regather)
    rg = execute._Regather()
    with rg:
        param = shard.clone().requires_grad_()              # the stored shard, a leaf
        gathered = param.repeat(2, 1)                        # the gathered parameter (6 x 2)
        rg.track(gathered, shard, ("R",))
        x = torch.ones(4, 6, requires_grad=True)
        with rg.saving([x, gathered]):
            y = x @ gathered                                 # saves x and the gathered parameter
        assert list(rg.state.readers.values()) == [1]        # packed as a recipe, not held
        alive = weakref.ref(gathered)
        del gathered
        gc.collect()
        assert alive() is None                               # freed mid-forward
        assert rg.state.live == {}                           # and no longer followed
        later = torch.zeros(6, 2)                            # may reuse the storage's identity
        with rg.saving([later]):
            pass
        assert execute._storage(later) not in rg.state.live
    y.sum().backward()
    assert regathered == [("R",)]                            # gathered again for the backward
    assert torch.equal(x.grad, shard.repeat(2, 1).sum(1).expand(4, 6))
    assert rg.state.gathered == {}
    assert torch.equal(param.grad, torch.full((3, 2), 8.0))


@pytest.fixture(scope="module")
def results(solutions):
    cases = {name: (cls, batch, hidden, shape, solutions[name])
             for name, (cls, batch, hidden, shape, _) in CASES.items()}
    zoo = {name: (model, batch, shape, solutions[name]) for name, (model, batch, shape, _) in ZOO.items()}
    with tempfile.TemporaryDirectory() as d:
        try:
            start_processes(_worker, (_free_port(), cases, zoo, d), WORLD)
        except Exception as e:
            errs = [open(os.path.join(d, f)).read() for f in os.listdir(d) if f.endswith(".err")]
            raise AssertionError("worker failed:\n" + "\n".join(errs[:1])) from e
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(CASES) + list(ZOO))
def test_executor_matches_one_process_and_the_plan(solutions, results, name):
    sol = solutions[name]
    expect = {"forward": sol.collective_counts(("forward",)),
              "backward": sol.collective_counts(("backward", "grad_sync"))}
    for r, res in enumerate(results):
        got = res[("executor", name)]
        loss, loss_ref = got["loss"]
        assert loss == pytest.approx(loss_ref, rel=REL), (name, r)
        assert got["grad_err"] < REL, (name, r, got["grad_err"])
        assert got["next_loss"][0] == pytest.approx(got["next_loss"][1], rel=REL), (name, r)
        for phase in ("forward", "backward"):
            assert got[phase] == expect[phase], (name, r, phase, got[phase], expect[phase])


def test_redistribute_runs_the_planned_transitions(results):
    """`execute.redistribute` gives the right values for every pair of layouts and runs exactly
    as many collectives as the plan's `placement.transition` counts, nested 2-D shards included
    (a later axis splitting a dim the changing one touches is gathered around the step)."""
    for r, res in enumerate(results):
        for shape, got in res["redistribute"].items():
            assert got["wrong"] == [], (r, shape, got["wrong"][:3])
            assert got["differ"] == [], (r, shape, got["differ"][:3])


def _count_exports(monkeypatch) -> list:
    """A list that gets one item per `torch.export` of a model's program (`export_program`),
    with the process's kept meta programs emptied first."""
    import importlib

    from autopar.intra_op import execute

    capture_export = importlib.import_module("autopar.capture.export")
    calls: list = []
    real = capture_export.export_program

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(capture_export, "export_program", counting)
    monkeypatch.setattr(execute, "_META_PROGRAMS", type(execute._META_PROGRAMS)())
    return calls


def test_meta_program_exported_once_per_model_structure(monkeypatch):
    """Building several ranks (verify's kinds) or plans of one model in a process exports its
    program once: the same structure, inputs, loss, weight dtype and device reuse the program;
    another shape, dtype or device exports anew."""
    from autopar.intra_op import execute
    from autopar.models.registry import build_model

    calls = _count_exports(monkeypatch)
    cpu = torch.device("cpu")
    first = build_model("gpt-tiny")
    p1, _ = execute.meta_program(first.model, first.example_inputs, device=cpu)
    again = build_model("gpt-tiny")          # another instance, the same structure
    p2, _ = execute.meta_program(again.model, again.example_inputs, device=cpu)
    assert p2 is p1 and len(calls) == 1
    p3, _ = execute.meta_program(again.model, again.example_inputs, param_dtype=torch.bfloat16, device=cpu)
    assert p3 is not p1 and len(calls) == 2
    pair = build_model("gpt-tiny", batch_size=2)   # inputs of another shape
    p4, _ = execute.meta_program(pair.model, pair.example_inputs, device=cpu)
    assert p4 is not p1 and len(calls) == 3
    p5, _ = execute.meta_program(first.model, first.example_inputs, device=torch.device("meta"))
    assert p5 is not p1 and len(calls) == 4
    assert len(execute._META_PROGRAMS) == min(4, execute.META_PROGRAMS_KEPT)


def test_meta_program_keeps_the_constants_its_forward_makes(monkeypatch):
    """A forward that makes tensors from Python data (an index list, as Falcon's split of its
    fused qkv: `lifted_tensor_0`) exports a program holding them with their values; it is kept
    like any other (each rank of a Falcon plan exported its own before, 1.5 CPU s each), and a
    model whose forward makes other values is another program."""
    from autopar.intra_op import execute

    class Pick(torch.nn.Module):
        def __init__(self, cols: list) -> None:
            super().__init__()
            self.cols = cols
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)[..., self.cols].sum()

    calls = _count_exports(monkeypatch)
    cpu = torch.device("cpu")
    with torch.device("meta"):
        a, b, other = Pick([-2, -1]), Pick([-2, -1]), Pick([0, 1])
    x = torch.empty(2, 8, device="meta")
    p1, _ = execute.meta_program(a, (x,), loss_fn=lambda out, *_: out, device=cpu)
    consts = [c.tolist() for c in p1.constants.values() if isinstance(c, torch.Tensor)]
    assert consts == [[-2, -1]], consts
    assert execute.meta_program(b, (x,), loss_fn=lambda out, *_: out, device=cpu)[0] is p1 and len(calls) == 1
    p3, _ = execute.meta_program(other, (x,), loss_fn=lambda out, *_: out, device=cpu)
    assert p3 is not p1 and [c.tolist() for c in p3.constants.values()] == [[0, 1]]


def test_meta_program_keyed_by_config_and_inputs(monkeypatch):
    """Two models of the same class, parameter names and shapes that differ in a config field
    (dropout) get different programs, as do the same model's inputs of another sequence length;
    each hit and miss is counted (`META_PROGRAM_STATS`)."""
    import dataclasses

    from autopar.intra_op import execute
    from autopar.models.gpt import GPT
    from autopar.models.registry import build_model

    monkeypatch.setattr(execute, "_META_PROGRAMS", type(execute._META_PROGRAMS)())
    monkeypatch.setattr(execute, "META_PROGRAM_STATS", {"hits": 0, "misses": 0})
    b = build_model("gpt-tiny")
    with torch.device("meta"):
        dropped = GPT(dataclasses.replace(b.model.cfg, dropout=0.1))
    def shapes(m):
        return [(n, p.shape) for n, p in m.named_parameters()]

    assert shapes(dropped) == shapes(b.model)
    plain, _ = execute.meta_program(b.model, b.example_inputs)
    other, _ = execute.meta_program(dropped, b.example_inputs)
    assert other is not plain
    ops = [{str(n.target) for n in p.graph.nodes if n.op == "call_function"} for p in (plain, other)]
    assert not any("dropout" in o or "bernoulli" in o for o in ops[0])
    assert any("dropout" in o or "bernoulli" in o for o in ops[1])
    shorter = tuple(x[:, :8] for x in b.example_inputs)
    short, _ = execute.meta_program(b.model, shorter)
    assert short is not plain and all(p is not short for p in (plain, other))
    assert execute.META_PROGRAM_STATS == {"hits": 0, "misses": 3}
    assert execute.meta_program(dropped, b.example_inputs)[0] is other
    assert execute.META_PROGRAM_STATS == {"hits": 1, "misses": 3}


def test_meta_program_hit_trains_as_a_miss(monkeypatch):
    """A solution applied with its program kept (a hit) computes the same losses and gradients
    as with it freshly exported (a miss), over two SGD steps, on a 1-process mesh; a Hugging
    Face Llama, whose program lifts its rotary table as a (meta) constant, is kept too."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.intra_op import execute
    from autopar.models.registry import build_model

    monkeypatch.setattr(execute, "_META_PROGRAMS", type(execute._META_PROGRAMS)())
    monkeypatch.setattr(execute, "META_PROGRAM_STATS", {"hits": 0, "misses": 0})
    sol = _zoo_solution("gpt-tiny", 2, (1,))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            b = build_model("gpt-tiny", device="cpu", batch_size=2)
            prog = sol.apply(b.model, b.example_inputs, mesh)
            opt = torch.optim.SGD(b.model.parameters(), lr=0.1)
            losses = []
            for _ in range(2):
                loss = prog(*b.example_inputs)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
            runs.append((prog.program, losses, {n: p.detach().clone() for n, p in b.model.named_parameters()}))
        assert execute.META_PROGRAM_STATS == {"hits": 1, "misses": 1}
        assert runs[0][0] is runs[1][0]
        assert runs[0][1] == runs[1][1]
        assert all(torch.equal(runs[0][2][n], runs[1][2][n]) for n in runs[0][2])
    finally:
        dist.destroy_process_group()
    if "hf-llama" in ZOO:
        ref = ZOO["hf-llama"][0]
        b = build_model(ref)
        p1, _ = execute.meta_program(b.model, b.example_inputs)
        assert any(isinstance(c, torch.Tensor) and c.is_meta for c in p1.constants.values())
        assert execute.meta_program(build_model(ref).model, b.example_inputs)[0] is p1


def test_meta_constants_read_from_the_model_not_exported_again(monkeypatch):
    """A Hugging Face Llama's meta program lifts its rotary table as a meta constant; applying
    a solution reads it from the model (`_real_constants`) instead of exporting the model itself
    on its device, and the program's loss is the model's own, on a 1-process mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models.registry import build_model

    if "hf-llama" not in ZOO:
        pytest.skip("the [hf] extra is not installed")
    ref = ZOO["hf-llama"][0]
    sol = _zoo_solution(ref, 2, (1,))
    calls = _count_exports(monkeypatch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        b = build_model(ref, device="cpu", batch_size=2)
        want = b.model(*b.example_inputs)        # before the solution makes the weights DTensors
        want = want.loss if hasattr(want, "loss") else want
        prog = sol.apply(b.model, b.example_inputs, mesh)
        # the data-less copy's export only, not the model's own: traced for the CPU, its ops
        # matched to the solution solved on the meta capture (attention's `contiguous` is none
        # on the CPU: `program_match`), not exported again on meta
        assert len(calls) == 1 and prog.program.autopar_traced_device == torch.device("cpu")
        held = {n: c for n, c in prog.constants.items() if isinstance(c, torch.Tensor)}
        assert held and not any(c.is_meta for c in held.values())
        # the program's own constants hold no data (fake CPU tensors): the model's are read
        from torch._subclasses.fake_tensor import FakeTensor
        assert all(c.is_meta or isinstance(c, FakeTensor) for c in prog.program.constants.values()
                   if isinstance(c, torch.Tensor))
        got = prog(*b.example_inputs)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
