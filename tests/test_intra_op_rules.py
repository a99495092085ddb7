"""One test per strategy-rule family (autopar/intra_op/rules/)."""

from __future__ import annotations

import pytest

from autopar.capture.graph import OpNode, Ref, TensorMeta
from autopar.intra_op import rules
from autopar.intra_op.placement import all_specs, transition
from autopar.intra_op.strategy import OpContext


def make(op: str, in_shapes, out_shapes, extra_args=(), kwargs=None, mesh=(2,), target=None,
         dtypes=None, arg_layout=None):
    """An OpContext for `aten.<op>` with tensor inputs of `in_shapes` (passed first, as Refs,
    unless `arg_layout` gives the args with "T<i>" markers for tensors)."""
    names = [f"t{i}" for i in range(len(in_shapes))]
    if arg_layout is None:
        args = tuple(Ref(n) for n in names) + tuple(extra_args)
    else:
        def conv(a):
            if isinstance(a, str) and a.startswith("T"):
                return Ref(names[int(a[1:])])
            if isinstance(a, list):
                return [conv(x) for x in a]
            return a
        args = tuple(conv(a) for a in arg_layout)
    dtypes = dtypes or ["float32"] * len(in_shapes)
    node = OpNode("n", "call", target or f"aten.{op}.default", args, kwargs or {}, names,
                  [TensorMeta(tuple(s), "float32") for s in out_shapes])
    return OpContext(node, [TensorMeta(tuple(s), d) for s, d in zip(in_shapes, dtypes)], tuple(mesh))


def by_name(ctx):
    sts, fam = rules.strategies(ctx)
    return {s.name: s for s in sts}, fam


def test_registry_covers_transformer_ops():
    ops = rules.registered_ops()
    for op in ["linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "embedding", "layer_norm",
               "rms_norm", "softmax", "log_softmax", "scaled_dot_product_attention", "add", "mul",
               "gelu", "silu", "relu", "pow", "rsqrt", "mean", "view", "reshape", "transpose",
               "permute", "split", "chunk", "cat", "slice", "expand", "getitem", "sum",
               "cross_entropy_loss", "nll_loss", "mse_loss", "dropout", "gather", "index_select",
               "arange", "broadcast_tensors", "to", "neg", "outer", "unsqueeze"]:
        assert op in ops, op


def test_matmul_family():
    s, fam = by_name(make("linear", [(8, 16), (32, 16)], [(8, 32)]))
    assert fam == "matmul"
    assert set(s) == {"replicate", "b0@0", "k@0", "n@0"}
    dp, row, col = s["b0@0"], s["k@0"], s["n@0"]
    assert dp.in_specs == [("S(0)",), ("R",)] and dp.out_specs == [("S(0)",)]
    assert dp.grad_partial == [(), (0,)]                    # weight gradient needs an all-reduce
    assert row.in_specs == [("S(1)",), ("S(1)",)] and row.out_specs == [("P",)]
    assert col.in_specs == [("R",), ("S(0)",)] and col.out_specs == [("S(1)",)]
    assert col.grad_partial == [(0,), ()]                   # input gradient is partial
    # bias of a row-parallel linear is added after the reduction: its gradient stays whole
    s, _ = by_name(make("linear", [(8, 16), (32, 16), (32,)], [(8, 32)]))
    assert s["k@0"].grad_partial[2] == ()
    assert s["b0@0"].grad_partial[2] == (0,)
    # 2-D mesh: both axes on one dim, or one each
    s, _ = by_name(make("mm", [(8, 16), (16, 32)], [(8, 32)], mesh=(2, 2)))
    assert s["m@0 n@1"].out_specs == [("S(0)", "S(1)")]
    assert s["m@0 m@1"].in_specs[0] == ("S(0)", "S(0)") and s["m@0 m@1"].work_div == 4
    s, _ = by_name(make("bmm", [(4, 8, 16), (4, 16, 32)], [(4, 8, 32)]))
    assert s["b0@0"].in_specs == [("S(0)",), ("S(0)",)]
    s, _ = by_name(make("addmm", [(32,), (8, 16), (16, 32)], [(8, 32)]))
    assert s["n@0"].in_specs[0] == ("S(0)",)
    s, _ = by_name(make("matmul", [(4, 8, 16), (16, 32)], [(4, 8, 32)]))
    assert s["k@0"].in_specs == [("S(2)",), ("S(0)",)]
    s, _ = by_name(make("baddbmm", [(4, 8, 32), (4, 8, 16), (4, 16, 32)], [(4, 8, 32)]))
    assert "b0@0" in s
    s, _ = by_name(make("convolution", [(4, 8, 16, 16), (32, 8, 3, 3), (32,)], [(4, 32, 14, 14)],
                        extra_args=([1, 1], [0, 0], [1, 1], False, [0, 0], 1)))
    assert s["n@0"].in_specs == [("S(0)",), ("R",), ("R",)] and s["c@0"].out_specs == [("P",)]
    assert s["o@0"].in_specs[1] == ("S(0)",) and s["o@0"].out_specs == [("S(1)",)]
    # divisibility: a dim of 3 cannot split over 2
    s, _ = by_name(make("linear", [(3, 16), (32, 16)], [(3, 32)]))
    assert "b0@0" not in s


def test_embedding():
    s, fam = by_name(make("embedding", [(100, 16), (4, 8)], [(4, 8, 16)], dtypes=["float32", "int64"]))
    assert fam == "embedding"
    assert s["i0@0"].in_specs == [("R",), ("S(0)",)] and s["i0@0"].grad_partial[0] == (0,)
    assert s["v@0"].in_specs[0] == ("S(0)",) and s["v@0"].out_specs == [("P",)]   # vocab parallel
    assert s["h@0"].out_specs == [("S(2)",)]


def test_norm():
    ctx = make("layer_norm", [(4, 8, 16), (16,), (16,)], [(4, 8, 16)], arg_layout=["T0", [16], "T1", "T2", 1e-5])
    s, fam = by_name(ctx)
    assert fam == "norm"
    assert "d2@0" not in s                                   # the normalised dim stays whole
    assert s["d0@0"].in_specs == [("S(0)",), ("R",), ("R",)]
    assert s["d0@0"].grad_partial == [(), (0,), (0,)]        # weight/bias gradients all-reduced
    s, _ = by_name(make("rms_norm", [(4, 8, 16), (16,)], [(4, 8, 16)], arg_layout=["T0", [16], "T1", 1e-5]))
    assert set(s) == {"replicate", "d0@0", "d1@0"}


def test_softmax():
    s, fam = by_name(make("_softmax", [(4, 8, 16)], [(4, 8, 16)], extra_args=(-1, False)))
    assert fam == "softmax" and set(s) == {"replicate", "d0@0", "d1@0"}
    assert rules.rule_for("softmax").follow


def test_attention_and_gqa():
    q, kv = (2, 8, 16, 4), (2, 8, 16, 4)
    s, fam = by_name(make("scaled_dot_product_attention", [q, kv, kv], [q], extra_args=(None, 0.0, True)))
    assert fam == "attention" and set(s) == {"replicate", "b0@0", "h@0"}
    assert s["h@0"].in_specs == [("S(1)",)] * 3
    # GQA: 8 query heads, 2 kv heads: a split of 4 keeps whole groups only if it divides both
    gq = make("scaled_dot_product_attention", [(2, 8, 16, 4), (2, 2, 16, 4), (2, 2, 16, 4)], [(2, 8, 16, 4)],
              mesh=(2,), kwargs={"enable_gqa": True})
    assert "h@0" in by_name(gq)[0]
    gq4 = make("scaled_dot_product_attention", [(2, 8, 16, 4), (2, 2, 16, 4), (2, 2, 16, 4)], [(2, 8, 16, 4)],
               mesh=(4,), kwargs={"enable_gqa": True})
    assert "h@0" not in by_name(gq4)[0]


def test_gqa_query_heads_split_over_more_devices_than_kv_heads():
    """tp above the KV heads (Megatron's answer): q and the output split by heads, K and V
    replicated (each device slices the KV head its query heads read), their gradients partial
    on the axis; work divided by the axis. Offered only where `h` cannot split the KV heads and
    each device's query heads share one KV head."""
    q, kv2, kv1 = (2, 8, 16, 4), (2, 2, 16, 4), (2, 1, 16, 4)
    s, _ = by_name(make("scaled_dot_product_attention", [q, kv2, kv2], [q], mesh=(4,), kwargs={"enable_gqa": True}))
    assert set(s) == {"replicate", "hq@0"}          # a batch of 2 does not split 4 ways
    st = s["hq@0"]
    assert st.in_specs == [("S(1)",), ("R",), ("R",)] and st.out_specs == [("S(1)",)]
    assert st.grad_partial == [(), (0,), (0,)] and st.work_div == 4
    # 2 KV heads over 2 devices: `h` keeps whole groups and needs no K/V reduction
    assert "hq@0" not in by_name(make("scaled_dot_product_attention", [q, kv2, kv2], [q], mesh=(2,),
                                      kwargs={"enable_gqa": True}))[0]
    # multi-query attention (1 KV head) on a (2, 4) mesh: batch on one axis, query heads on the other
    s, _ = by_name(make("scaled_dot_product_attention", [q, kv1, kv1], [q], mesh=(2, 4), kwargs={"enable_gqa": True}))
    assert {"b0@0 hq@1", "hq@0 hq@1"} <= set(s)
    st = s["b0@0 hq@1"]
    assert st.in_specs == [("S(0)", "S(1)"), ("S(0)", "R"), ("S(0)", "R")] and st.grad_partial[1] == (1,)
    # 8 query heads over 8 devices, 4 KV heads: each device's head is in one group, `h` cannot
    s, _ = by_name(make("scaled_dot_product_attention", [q, (2, 4, 16, 4), (2, 4, 16, 4)], [q], mesh=(8,),
                        kwargs={"enable_gqa": True}))
    assert "hq@0" in s and "h@0" not in s
    # 3 KV heads, 6 query heads over 2 devices: a device's 3 heads span two KV heads: left out
    s, _ = by_name(make("scaled_dot_product_attention", [(2, 6, 16, 4), (2, 3, 16, 4), (2, 3, 16, 4)],
                        [(2, 6, 16, 4)], mesh=(2,), kwargs={"enable_gqa": True}))
    assert not any(n.startswith("hq") for n in s)
    # plain attention (as many KV heads as query heads) gets no such strategy
    s, _ = by_name(make("scaled_dot_product_attention", [q, q, q], [q], mesh=(8,)))
    assert not any(n.startswith("hq") for n in s)


def test_elementwise_broadcast():
    s, fam = by_name(make("add", [(4, 8, 16), (16,)], [(4, 8, 16)], target="aten.add.Tensor"))
    assert fam == "elementwise"
    assert s["d0@0"].in_specs == [("S(0)",), ("R",)]
    assert s["d0@0"].grad_partial == [(), (0,)]             # broadcast operand: partial gradient
    assert s["d2@0"].in_specs == [("S(2)",), ("S(0)",)]
    s, _ = by_name(make("mul", [(4, 1, 16), (4, 8, 16)], [(4, 8, 16)], target="aten.mul.Tensor"))
    assert s["d1@0"].in_specs[0] == ("R",)
    for op in ("gelu", "silu", "relu", "pow", "rsqrt", "dropout", "neg"):
        assert rules.rule_for(op).family == "elementwise"
    # ops linear in their input pass a partial through; relu does not
    s, _ = by_name(make("neg", [(4, 8)], [(4, 8)]))
    assert any(st.in_specs[0] == ("P",) and st.out_specs[0] == ("P",) for st in s.values())
    s, _ = by_name(make("relu", [(4, 8)], [(4, 8)]))
    assert not any("P" in st.in_specs[0] for st in s.values())
    s, _ = by_name(make("broadcast_tensors", [(4, 8), (4, 8)], [(4, 8), (4, 8)], arg_layout=[["T0", "T1"]]))
    assert s["d0@0"].out_specs == [("S(0)",), ("S(0)",)]


def test_view_groups():
    from autopar.intra_op.rules.view import reshape_labels

    assert reshape_labels((2, 3, 4), (6, 4)) == (["g0", None, "g1"], ["g0", "g1"])
    assert reshape_labels((4, 6), (2, 2, 6)) == (["g0", "g1"], ["g0", None, "g1"])
    assert reshape_labels((1, 16, 32), (16, 32)) == ([None, "g0", "g1"], ["g0", "g1"])
    assert reshape_labels((2, 1, 3), (2, 3)) == (["g0", None, "g1"], ["g0", "g1"])
    assert reshape_labels((2, 2, 1), (4,)) == (["g0", None, None], ["g0"])


def test_views():
    # [b, s, h] -> [b, s, heads, hd]: h splits as heads
    s, fam = by_name(make("view", [(2, 8, 16)], [(2, 8, 4, 4)], extra_args=([2, 8, 4, 4],)))
    assert fam == "view"
    assert any(st.in_specs[0] == ("S(2)",) and st.out_specs[0] == ("S(2)",) for st in s.values())
    # flatten(0, 1): only the leading dim of a merged group may split
    s, _ = by_name(make("flatten", [(4, 8, 16)], [(32, 16)], extra_args=(0, 1), target="aten.flatten.using_ints"))
    ins = {st.in_specs[0] for st in s.values()}
    assert ("S(0)",) in ins and ("S(1)",) not in ins
    s, _ = by_name(make("transpose", [(2, 4, 8, 16)], [(2, 8, 4, 16)], extra_args=(1, 2), target="aten.transpose.int"))
    assert any(st.in_specs[0] == ("S(1)",) and st.out_specs[0] == ("S(2)",) for st in s.values())
    s, _ = by_name(make("permute", [(2, 4, 8)], [(8, 2, 4)], extra_args=([2, 0, 1],)))
    assert any(st.in_specs[0] == ("S(2)",) and st.out_specs[0] == ("S(0)",) for st in s.values())
    s, _ = by_name(make("expand", [(1, 8)], [(4, 8)], extra_args=([4, 8],)))
    assert any(st.in_specs[0] == ("R",) and st.out_specs[0] == ("S(0)",) for st in s.values())
    # split along the split dim is refused (no matmul producer) ...
    s, _ = by_name(make("split", [(4, 24)], [(4, 8)] * 3, extra_args=(8, -1), target="aten.split.Tensor"))
    assert not any(st.in_specs[0] == ("S(1)",) for st in s.values())
    s, _ = by_name(make("cat", [(4, 8), (4, 8)], [(4, 16)], arg_layout=[["T0", "T1"], -1]))
    assert not any(st.out_specs[0] == ("S(1)",) for st in s.values())
    assert any(st.out_specs[0] == ("S(0)",) for st in s.values())
    s, _ = by_name(make("slice", [(4, 8)], [(4, 4)], extra_args=(1, 0, 4), target="aten.slice.Tensor"))
    assert not any(st.in_specs[0] == ("S(1)",) for st in s.values())
    s, _ = by_name(make("unsqueeze", [(4, 8)], [(4, 1, 8)], extra_args=(1,)))
    assert any(st.out_specs[0] == ("S(2)",) for st in s.values())


def test_repeats():
    """`repeat` keeps the layout of a dim repeated once (a tiled or new dim is whole);
    `repeat_interleave` by a number keeps every dim's, the repeated one included: each device's
    rows repeated are its share of the result (checked on real tensors)."""
    import torch

    s, fam = by_name(make("repeat", [(4, 8)], [(4, 16)], extra_args=([1, 2],)))
    assert fam == "view"
    ins = {st.in_specs[0] for st in s.values()}
    assert ("S(0)",) in ins and ("S(1)",) not in ins
    s, _ = by_name(make("repeat", [(4, 8)], [(3, 4, 8)], extra_args=([3, 1, 1],)))
    assert any(st.in_specs[0] == ("S(0)",) and st.out_specs[0] == ("S(1)",) for st in s.values())
    assert not any(st.out_specs[0] == ("S(0)",) for st in s.values())
    s, _ = by_name(make("repeat_interleave", [(4, 8)], [(4, 16)], extra_args=(2, 1),
                        target="aten.repeat_interleave.self_int"))
    assert any(st.in_specs[0] == ("S(1)",) and st.out_specs[0] == ("S(1)",) for st in s.values())
    x = torch.arange(32.0).view(4, 8)
    shards = [c.repeat_interleave(2, 1) for c in x.chunk(2, 1)]
    assert torch.equal(torch.cat(shards, 1), x.repeat_interleave(2, 1))
    s, _ = by_name(make("repeat_interleave", [(4, 8)], [(64,)], extra_args=(2,),
                        target="aten.repeat_interleave.self_int"))          # flattened: nothing split
    assert all(st.in_specs[0] == ("R",) for st in s.values())


def test_reductions():
    s, fam = by_name(make("sum", [(4, 8)], [(4,)], extra_args=([1],), target="aten.sum.dim_IntList"))
    assert fam == "reduction"
    assert s["d1@0"].out_specs == [("P",)]                   # a split summed dim: partial sum
    assert s["d0@0"].out_specs == [("S(0)",)]
    s, _ = by_name(make("mean", [(4, 8)], [(4, 1)], extra_args=([-1], True), target="aten.mean.dim"))
    assert s["d1@0"].out_specs == [("P",)]
    s, _ = by_name(make("amax", [(4, 8)], [(4,)], extra_args=([1],)))
    assert "d1@0" not in s                                   # max of a split dim is not a sum
    s, _ = by_name(make("topk", [(4, 8)], [(4, 2), (4, 2)], extra_args=(2, -1)))
    assert set(s) == {"replicate", "d0@0"}
    s, _ = by_name(make("max", [(4, 8), (4, 8)], [(4, 8)], target="aten.max.other"))
    assert "d1@0" in s                                       # element-wise max of two tensors


def test_losses():
    s, fam = by_name(make("cross_entropy_loss", [(16, 100), (16,)], [()], dtypes=["float32", "int64"]))
    assert fam == "loss"
    assert s["n0@0"].out_specs == [("P",)]
    vp = s["c@0 (vocab-parallel)"]
    assert vp.out_specs == [("R",)] and len(vp.comms) == 3   # max, sum-exp, target logit
    assert vp.comms[0][2] == 16 * 4
    s, _ = by_name(make("nll_loss", [(16, 100), (16,)], [()], dtypes=["float32", "int64"]))
    assert s["c@0"].out_specs == [("P",)]
    s, _ = by_name(make("mse_loss", [(8, 4), (8, 4)], [()]))
    assert s["d0@0"].out_specs == [("P",)] and s["d1@0"].out_specs == [("P",)]


def test_indexing():
    s, fam = by_name(make("gather", [(4, 8), (4, 2)], [(4, 2)], arg_layout=["T0", 1, "T1"],
                          dtypes=["float32", "int64"]))
    assert fam == "indexing" and "d0@0" in s and "d1@0" not in s
    s, _ = by_name(make("index_select", [(8, 16), (4,)], [(4, 16)], arg_layout=["T0", 0, "T1"],
                        dtypes=["float32", "int64"]))
    assert s["d1@0"].out_specs == [("S(1)",)] and s["i@0"].in_specs == [("R",), ("S(0)",)]


def test_creation():
    s, fam = by_name(make("arange", [], [(16,)], extra_args=(16,)))
    assert fam == "creation" and s["d0@0"].out_specs == [("S(0)",)]


def test_unknown_op_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="frobnicate"):
        sts, fam = rules.strategies(make("frobnicate", [(4, 8)], [(4, 8)]))
    assert fam == "fallback" and len(sts) == 1 and sts[0].in_specs == [("R",)]


def test_placement_transitions():
    shp, mesh = (8, 16), (2, 4)
    assert transition(shp, 4, ("P", "R"), ("R", "R"), mesh) == (("all_reduce", 0, 512.0),)
    assert transition(shp, 4, ("R", "S(0)"), ("R", "R"), mesh) == (("all_gather", 1, 512.0),)
    assert transition(shp, 4, ("R", "P"), ("R", "S(1)"), mesh) == (("reduce_scatter", 1, 512.0),)
    assert transition(shp, 4, ("S(0)", "R"), ("S(1)", "R"), mesh) == (("all_to_all", 0, 256.0),)
    assert transition(shp, 4, ("R", "R"), ("S(0)", "S(1)"), mesh) == ()
    # bytes are the whole buffer along the other axes: local shard of the other axis
    assert transition(shp, 4, ("P", "S(1)"), ("R", "S(1)"), mesh) == (("all_reduce", 0, 128.0),)
    assert ("S(0)", "S(0)") in all_specs((8, 3), (2, 4)) and ("S(1)", "R") not in all_specs((8, 3), (2, 4))
