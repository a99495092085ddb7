"""Fast runtime unit tests (one process, no launch): counting convention, deterministic
materialisation, placements, checkpoint discovery, plan validation."""

from __future__ import annotations

import pytest
import torch

from autopar.schema.errors import PlanError


def test_counting_convention_counts_stage_collectives_once():
    from autopar.runtime.counting import combine

    # pp2 x dp2: stages on [0, 1] and [2, 3]; representatives 0 and 2
    ev = {
        0: [("send_recv", ()), ("recv", ()), ("all_reduce", (0, 1)), ("all_reduce", (0, 2))],
        1: [("send_recv", ()), ("recv", ()), ("all_reduce", (0, 1)), ("all_reduce", (1, 3))],
        2: [("recv", ()), ("send_recv", ()), ("all_reduce", (2, 3)), ("all_reduce", (0, 2))],
        3: [("recv", ()), ("send_recv", ()), ("all_reduce", (2, 3)), ("all_reduce", (1, 3))],
    }
    # dp all-reduce once per stage (2), tied all-reduce across stages once (1), 2 transfers
    assert combine(ev, {0, 2}) == {"all_reduce": 3, "send_recv": 2}
    # dp4, one stage: once
    assert combine({r: [("all_reduce", (0, 1, 2, 3))] for r in range(4)}, {0}) == {"all_reduce": 1}


def test_materialize_is_layout_independent():
    from autopar.models import build_model
    from autopar.runtime.graph_stages import split_model
    from autopar.runtime.materialize import canonical_names, materialize

    full = build_model("gpt-tiny").model
    aliases = canonical_names(full)
    materialize(full, seed=3, aliases=aliases)
    assert full.head.out.weight is full.embed.tok.weight  # tie kept
    b = build_model("gpt-tiny", device="meta")
    mb = tuple(torch.empty((2, *x.shape[1:]), dtype=x.dtype, device="meta") for x in b.example_inputs)
    first, last = split_model(b.model, mb, ["blocks.1"], torch.device("cpu"))
    # the pipeline's last chunk, as the runtime cuts it: blocks.1 and the (tied) head
    materialize(last.module, seed=3, aliases=canonical_names(b.model), template=b.model)
    got = dict(last.module.named_parameters())
    assert set(got) >= {"blocks.1.attn.qkv.weight", "head.out.weight"}
    assert torch.equal(got["head.out.weight"], full.embed.tok.weight)  # tied copy, same value
    assert torch.equal(got["blocks.1.mlp.fc.weight"], full.blocks[1].mlp.fc.weight)
    assert torch.equal(got["head.ln.weight"], torch.ones(32))
    # the first chunk holds only what it reads: the head (its weight the embedding's) is not
    # left in it as a second name, and its layers stay on meta until materialised
    assert not any(n.startswith("head.") for n, _ in first.module.named_parameters(remove_duplicate=False))
    assert first.module.get_submodule("blocks.0").attn.qkv.weight.is_meta



def test_split_model_kept_per_model_cut_and_inputs(monkeypatch):
    """`split_model` traces a model's cut once per process: another instance of the same model
    cut the same way gets its own deep copy of the kept chunks (no module or parameter shared),
    which train as the traced ones do (the same loss and gradients); another cut, another
    micro-batch shape or a model differing only in a config field (dropout: the same
    parameters) is traced anew. Hits and misses are counted (`SPLIT_STATS`)."""
    import dataclasses

    from autopar.models import build_model
    from autopar.models.gpt import GPT
    from autopar.runtime import graph_stages
    from autopar.runtime.graph_stages import FedChunk, split_model
    from autopar.runtime.materialize import canonical_names, materialize

    monkeypatch.setattr(graph_stages, "_SPLITS", type(graph_stages._SPLITS)())
    monkeypatch.setattr(graph_stages, "SPLIT_STATS", {"hits": 0, "misses": 0})
    cpu = torch.device("cpu")
    b = build_model("gpt-tiny", device="meta")
    mb = tuple(torch.empty((2, *x.shape[1:]), dtype=x.dtype, device="meta") for x in b.example_inputs)
    traced = split_model(b.model, mb, ["blocks.1"], cpu)
    kept = split_model(build_model("gpt-tiny", device="meta").model, mb, ["blocks.1"], cpu)
    assert graph_stages.SPLIT_STATS == {"hits": 1, "misses": 1}
    assert [c.module.code for c in kept] == [c.module.code for c in traced]
    assert [(c.sources, c.sends) for c in kept] == [(c.sources, c.sends) for c in traced]
    mine = {id(t) for c in traced for t in [*c.module.parameters(), *c.module.modules()]}
    assert not mine & {id(t) for c in kept for t in [*c.module.parameters(), *c.module.modules()]}
    torch.manual_seed(0)
    batch = (torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16)))
    runs = []
    for chunks in (traced, kept):
        received: tuple = (batch[0],)
        for ch in chunks:
            materialize(ch.module, seed=3, aliases=canonical_names(b.model), template=b.model)
            y = FedChunk(ch.module, ch.sources, ch.sends).run(received, lambda k: batch[k])
            received = y if isinstance(y, tuple) else (y,)
        received[0].backward()
        runs.append((float(received[0].detach()), {n: p.grad for c in chunks for n, p in c.module.named_parameters()}))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1].keys() == runs[1][1].keys() and all(torch.equal(g, runs[1][1][n]) for n, g in runs[0][1].items())
    split_model(b.model, mb, ["blocks.0"], cpu)                                        # another cut
    split_model(b.model, tuple(x[:1] for x in mb), ["blocks.1"], cpu)                  # another micro-batch
    with torch.device("meta"):
        dropped = GPT(dataclasses.replace(b.model.cfg, dropout=0.1))
    drop_chunks = split_model(dropped, mb, ["blocks.1"], cpu)                          # another config
    assert graph_stages.SPLIT_STATS == {"hits": 1, "misses": 4}
    ops = [{str(n.target) for m in c.module.modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)
            for n in m.graph.nodes} for c in (traced[1], drop_chunks[1])]
    assert not any("dropout" in o for o in ops[0]) and any("dropout" in o for o in ops[1])

def test_placements_parse():
    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.spmd import to_placements

    assert to_placements(["R", "S(0)", "S(-1)"], ndim=2) == (Replicate(), Shard(0), Shard(1))
    with pytest.raises(PlanError):
        to_placements(["X"])


def test_latest_checkpoint_ignores_incomplete(tmp_path):
    from autopar.runtime.checkpoint import latest

    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / ".metadata").write_text("x")
    (tmp_path / "step_00000004").mkdir()  # no metadata: incomplete
    (tmp_path / ".tmp-step_00000006").mkdir()
    assert latest(tmp_path)[0] == 2
    assert latest(tmp_path / "missing") is None


def test_validate_plan_names_the_problem():
    from autopar.models import build_model
    from autopar.runtime.engine import validate_plan
    from tests.plans import StagePlan, _plan, make_plan

    model = build_model("gpt-tiny").model
    assert validate_plan(make_plan("pp2xdp2"), model)["devsets"] == [(0, 1), (2, 3)]
    st = [StagePlan(index=i, devices=[i % 2], mesh_shape=(1,), mesh_axis_names=("dp",), layers=[lay],
                    virtual_chunk=i // 2) for i, lay in enumerate(["embed", "blocks.0", "blocks.1", "head"])]
    with pytest.raises(PlanError, match="multiple of the pipeline depth"):
        validate_plan(_plan("gpt-tiny", st, gbs=6, mb=2, m=3, schedule="interleaved_1f1b", v=2, nodes_devices=2),
                      model)
    with pytest.raises(PlanError, match="need schedule interleaved_1f1b"):
        validate_plan(_plan("gpt-tiny", st, gbs=8, mb=2, m=4, schedule="1f1b", nodes_devices=2), model)


def test_flat_sync_buffers_are_freed_even_if_the_backend_keeps_them(monkeypatch):
    """gloo's worker thread can hold a collective's tensors after the wait returns (a rank kept
    a step's flat all-reduce buffer into the next forward): the flat buffers' storage must be
    freed by the runtime itself, and the gradients still get the reduced values."""
    from autopar.runtime import tied_grads

    kept = []

    def all_reduce(t, group=None):      # a backend that keeps its work's tensor, as gloo may
        kept.append(t)
        t.mul_(2.0)

    monkeypatch.setattr(tied_grads.dist, "all_reduce", all_reduce)
    grads = [torch.ones(3, 4), torch.full((5,), 3.0)]
    tied_grads.allreduce_flat(grads, group=None, scale=0.5)
    assert torch.equal(grads[0], torch.ones(3, 4)) and torch.equal(grads[1], torch.full((5,), 3.0))
    assert kept and kept[0].untyped_storage().nbytes() == 0

    p = torch.nn.Parameter(torch.zeros(2, 3))
    p.grad = torch.full((2, 3), 1.5)
    tied_grads.FlatTiedSync(None, [("w", [p])]).sync()
    assert torch.equal(p.grad, torch.full((2, 3), 3.0))
    assert kept[1].untyped_storage().nbytes() == 0


def test_a_ranks_copies_of_a_tied_parameter_are_summed_before_the_group_sums_them(monkeypatch):
    """An interleaved rank may hold two copies of one tied weight (two of its chunks read it,
    each materialising its own): it puts their sum in the flat buffer once, so every rank of
    the group all-reduces a buffer of the same size, and every copy gets the group's total.
    Copies on one rank only are summed without a collective."""
    from autopar.runtime import tied_grads

    sizes = []

    def all_reduce(t, group=None):      # a group of two ranks whose other rank holds the same
        sizes.append(t.numel())
        t.mul_(2.0)

    monkeypatch.setattr(tied_grads.dist, "all_reduce", all_reduce)

    def param(v: float, shape=(2, 3)) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.full(shape, v)
        return p

    a1, a2, b = param(1.0), param(2.0), param(5.0, (4,))
    sync = tied_grads.FlatTiedSync(None, [("z.b", [b]), ("emb.weight", [a1, a2])], ranks=[0, 2])
    assert sync.signature() == [("emb.weight", 6), ("z.b", 4)]      # by name, one entry per parameter
    sync.sync()
    assert sizes == [10]
    assert torch.equal(a1.grad, torch.full((2, 3), 6.0)) and torch.equal(a2.grad, a1.grad)
    assert torch.equal(b.grad, torch.full((4,), 10.0))

    c1, c2, c3 = param(1.0), param(2.0), param(4.0)
    tied_grads.LocalTiedSum([("w", [c1, c2, c3])]).sync()
    assert sizes == [10]                                              # no collective
    assert all(torch.equal(c.grad, torch.full((2, 3), 7.0)) for c in (c1, c2, c3))


def test_tied_groups_whose_ranks_lay_out_different_buffers_are_refused_at_setup():
    """Ranks of one tied-gradient group that would all-reduce flat buffers of different sizes
    (gloo aborts every process: "Received data size doesn't match expected size") are a
    PlanError naming the weight and the ranks, found from one all-gather at setup."""
    from autopar.runtime.tied_grads import check_agreement

    good = [[(0, [0, 2], [("shared.weight", 8192)])], [], [(0, [0, 2], [("shared.weight", 8192)])], []]
    check_agreement(0, good[0], good)
    bad = [[(0, [0, 2], [("shared.weight", 8192)])], [], [(0, [0, 2], [("shared.weight", 16384)])], []]
    with pytest.raises(PlanError, match=r"shared\.weight.*ranks \[0, 2\].*rank 0 holds 8192.*rank 2 16384"):
        check_agreement(0, bad[0], bad)
    missing = [[(0, [0, 2], [("shared.weight", 8192)])], [], [], []]
    with pytest.raises(PlanError, match=r"ranks \[0, 2\].*rank 2 does not join"):
        check_agreement(0, missing[0], missing)


def test_gloo_reduce_scatter_copy_is_freed_when_the_call_returns():
    """ProcessGroupGloo's reduce-scatter clones its input and all-reduces the clone on a worker
    thread, which drops it some time after the wait returns: the runtime's flat reduce-scatter
    frees that copy's storage itself as the call returns (every run alike), the shard still
    gets the reduced values. Real gloo, one process."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.runtime import tied_grads

    viewed = []

    class Views(TorchDispatchMode):      # what the wait's copy-out reads: gloo's clone
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.split.Tensor:
                viewed.append(args[0].untyped_storage())
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        full = torch.arange(12.0)
        out = torch.empty(12)
        with Views():
            tied_grads.reduce_scatter_flat(out, full, dist.group.WORLD)
        assert torch.equal(out, torch.arange(12.0)) and torch.equal(full, torch.arange(12.0))
        assert viewed and viewed[0].data_ptr() != full.untyped_storage().data_ptr()
        assert all(st.nbytes() == 0 for st in viewed)
        # the operands are left alone
        assert full.untyped_storage().nbytes() == 48 and out.untyped_storage().nbytes() == 48
    finally:
        dist.destroy_process_group()


def test_gloo_collective_returns_once_the_worker_thread_let_go():
    """gloo's worker thread drops a finished work (and its tensors) only when it takes its
    queue's lock again, after waking the waiter: a buffer dropped right after the call lived on
    a scheduling-dependent time (FSDP2's all-gather output, milliseconds under load). Run on
    `gloo_quiesced`'s views, the collective returns once nothing of gloo references them: the
    caller's buffer is freed when the caller drops it. Real gloo, one process."""
    import weakref

    import torch.distributed as dist

    from autopar.runtime import tied_grads

    refs: list = []

    def gather(o, i):
        # the views the collective runs on: tensors of their own over the caller's storage
        refs.extend([weakref.ref(o), weakref.ref(i), o.untyped_storage().data_ptr()])
        tied_grads.all_gather_flat(o, i, dist.group.WORLD)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(20):
            refs.clear()
            buf = torch.zeros(64)
            part = buf.narrow(0, 0, 64)
            part.fill_(3.0)
            tied_grads.gloo_quiesced(gather, dist.group.WORLD, buf, part)
            assert refs[2] == buf.untyped_storage().data_ptr()
            assert refs[0]() is None and refs[1]() is None       # nothing holds the views now
            assert torch.equal(buf, torch.full((64,), 3.0))
            st = weakref.ref(buf.untyped_storage())
            del buf, part
            assert st() is None
    finally:
        dist.destroy_process_group()


def test_functional_collectives_on_gloo_return_once_gloo_let_go():
    """Tensor and context parallelism's functional collectives (DTensor's; cp's K/V all-gather
    and its backward's reduce-scatter) under `GlooFunctionalSync`: each
    runs synchronously on views of its operands and returns with gloo holding nothing of the
    step's tensors: an all-gather's, reduce-scatter's or all-to-all's input view is dead, and the output is
    either one gloo let go of or a copy, the storage gloo still holds emptied; the results are
    the plain ops'. On exit torch's own kernels are back (an asynchronous all-reduce, waited on
    through its `AsyncCollectiveTensor`). Real gloo, one process."""
    import weakref

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from autopar.runtime import tied_grads
    from autopar.runtime.tied_grads import GlooFunctionalSync

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    inputs: list = []
    outputs: list = []
    real_settled, real_unheld = tied_grads._settled, tied_grads._unheld

    def settled(run, *vs):
        inputs.extend(weakref.ref(v) for v in vs)
        real_settled(run, *vs)

    def unheld(out, ref):
        res = real_unheld(out, ref)
        outputs.append((ref, out, res))
        return res

    tied_grads._settled, tied_grads._unheld = settled, unheld
    try:
        g = dist.group.WORLD
        x = torch.arange(6.0)
        with GlooFunctionalSync():
            with GlooFunctionalSync():                             # nested: one registration
                red = funcol.all_reduce(x, "sum", g) * 1.0
            gat = funcol.all_gather_tensor(x, 0, g) * 1.0
            a2a = funcol.all_to_all_single(x, None, None, g) * 1.0
            rs = funcol.reduce_scatter_tensor(x, "sum", 0, g) * 1.0
        assert len(inputs) == 3 and all(r() is None for r in inputs)      # inputs let go
        assert len(outputs) == 4
        for ref, out, res in outputs:
            assert res is out and ref() is None or res is not out and out.untyped_storage().nbytes() == 0
        assert torch.equal(red, x) and torch.equal(gat, x) and torch.equal(a2a, x) and torch.equal(rs, x)
        assert torch.equal(x, torch.arange(6.0))
        outputs.clear()
        assert torch.equal(funcol.all_reduce(x, "sum", g) * 1.0, x) and outputs == []   # torch's kernel
    finally:
        tied_grads._settled, tied_grads._unheld = real_settled, real_unheld
        dist.destroy_process_group()


def test_elementwise_optimizer_steps_local_shards_like_the_dtensors():
    """`local_optim`: AdamW rebuilt over the DTensors' local tensors makes the same update as
    over the DTensors (same storage: the parameters change), keeps the hyperparameters of each
    group, hands its state out as DTensors in the parameters' layouts, and is not used for an
    optimizer that is not element-wise or already holds state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from autopar.runtime.local_optim import localize

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        full = [torch.randn(4, 3), torch.randn(5)]

        def params():
            return [torch.nn.Parameter(distribute_tensor(full[0].clone(), mesh, [Shard(0)])),
                    torch.nn.Parameter(distribute_tensor(full[1].clone(), mesh, [Replicate()]))]

        def groups(ps):
            return [{"params": [ps[0]], "lr": 0.1}, {"params": [ps[1]], "lr": 0.01, "weight_decay": 0.0}]

        ref, mine = params(), params()
        opt_ref = torch.optim.AdamW(groups(ref))
        ls = localize(torch.optim.AdamW(groups(mine)), mine)
        assert ls is not None and [g["lr"] for g in ls.optimizer.param_groups] == [0.1, 0.01]
        for step in range(3):
            for a, b in zip(ref, mine):
                g = distribute_tensor(torch.full(a.shape, 0.5 + step), mesh, a.placements)
                a.grad, b.grad = g, g.clone()
            opt_ref.step()
            ls.step()
        for a, b in zip(ref, mine):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        view = ls.views[0]
        st = ls.optimizer.state[view]["exp_avg"]
        as_dt = ls.dtensor_state(view, st)
        assert isinstance(as_dt, DTensor) and as_dt.placements == mine[0].placements
        assert as_dt.to_local().untyped_storage().data_ptr() == st.untyped_storage().data_ptr()
        assert not isinstance(ls.dtensor_state(view, ls.optimizer.state[view]["step"]), DTensor)
        # not element-wise, or already stepped: the optimizer keeps its DTensors
        assert localize(torch.optim.Adafactor(params()), mine) is None
        assert localize(opt_ref, ref) is None
    finally:
        dist.destroy_process_group()


def test_recompute_checkpoints_the_modules_found_from_the_ops():
    """A model whose blocks sit in a ModuleDict under names and whose attention module is called
    `mixer` (`tests.user_models:renamed_gpt`: nothing a runtime could find by name): the plan
    names what to recompute, found from the captured ops, and the runtime recomputes exactly
    that: "selective" re-runs each block's attention core (its sdpa call, in the module holding
    it, `mixer`) and neither its projections nor its MLP, "full" each whole block; the loss is the
    same under every policy."""
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.models.registry import build_model, call_batch_fn
    from autopar.runtime import build

    ref = "tests.user_models:renamed_gpt"
    cl = autopar.ClusterSpec.load("cpu", num_nodes=1).model_copy(update={"devices_per_node": 1})
    from tests.user_models import RenamedGPT

    names = RenamedGPT.NAMES
    want = {"none": None, "full": [f"blocks.{n}" for n in names],
            "selective": [f"blocks.{n}.mixer" for n in names]}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        losses = {}
        for rc, modules in want.items():
            p = autopar.plan(ref, cl, global_batch_size=4, dtype="fp32", constraints=autopar.Constraints(recompute=rc))
            assert p.stages[0].recompute == rc and p.stages[0].recompute_modules == modules
            sdpas = ["scaled_dot_product_attention"] + [f"scaled_dot_product_attention_{i}" for i in (1, 2, 3)]
            assert p.stages[0].recompute_ops == (sdpas if rc == "selective" else None)
            shown = {"none": "", "full": f"full: modules {', '.join(want['full'])} checkpointed whole",
                     "selective": "selective: ops scaled_dot_product_attention (4)"}[rc]
            assert shown in p.summary()   # `autopar show`
            b = build_model(ref, device="meta")
            pm = build(p, b, seed=0)
            # the first projection inside each: checkpoint re-runs a module's own forward, so
            # hooks on the checkpointed module itself do not fire again, those inside it do
            calls = {"mixer.c_attn": 0, "mlp.0": 0}
            for core in pm.local_modules:
                for name, mod in core.named_modules():
                    for kind in calls:
                        if name.endswith(kind):
                            mod.register_forward_pre_hook(
                                lambda *_, k=kind, c=calls: c.__setitem__(k, c[k] + 1))
            # the attention calls, the backward's re-runs among them (the profiler sees those too)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                losses[rc] = pm.step(call_batch_fn(b.batch_fn, 0, 4, 0))
            sdpa = sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events())
            runs = {"none": (1, 1, 1), "selective": (1, 1, 2), "full": (2, 2, 2)}[rc]
            n = len(names)
            assert (calls["mixer.c_attn"], calls["mlp.0"], sdpa) == tuple(n * r for r in runs), (rc, calls, sdpa)
        assert losses["none"] == pytest.approx(losses["selective"], rel=1e-6) == pytest.approx(losses["full"], rel=1e-6)
    finally:
        dist.destroy_process_group()
