"""The memory model: micro-batches in flight read from torch's pipeline schedules, what the
runtime holds phase by phase, and a planned stage's activations counted over all its chunks."""

import itertools

import numpy as np
import pytest

import autopar
from cost_models.memory import inflight_microbatches, runtime_phases
from cost_models.schedules import _actions, held_profile, peak_held, torch_schedule


def _simulate(kind: str, p: int, r: int, m: int, v: int, chunk_bytes) -> float:
    """Brute force: walk torch's action list for rank r, holding chunk_bytes[c] per forward of
    local chunk c until its backward, and return the largest total ever held."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    held = cur = 0.0
    for a in _actions(torch_schedule(kind, p, m, v), p, m, v)[r]:
        if a is None:
            continue
        c = a.stage_index // p
        if a.computation_type == C.FORWARD:
            cur += chunk_bytes[c]
            held = max(held, cur)
        elif a.computation_type == C.FULL_BACKWARD:
            cur -= chunk_bytes[c]
    assert cur == pytest.approx(0.0)
    return held


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (4, 4), (4, 8), (4, 3), (8, 16)])
def test_1f1b_and_gpipe_hold_what_torch_runs(p, m):
    for r in range(p):
        # torch's 1F1B warms up p - r forwards; with fewer micro-batches than stages the runtime
        # runs GPipe, which holds all m
        expect = m if m < p else min(p - r, m)
        assert inflight_microbatches("1f1b", p, r, m) == expect
        assert inflight_microbatches("gpipe", p, r, m) == m
    assert torch_schedule("1f1b", p, m) == ("ScheduleGPipe" if m < p else "Schedule1F1B")


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 8, 2), (4, 2, 8), (4, 3, 4), (8, 3, 64), (2, 4, 6)])
def test_interleaved_matches_megatron_closed_form_and_brute_force(p, v, m):
    rng = np.random.default_rng(p * 100 + v * 10 + m)
    for r in range(p):
        # uniform chunks, m a multiple of p: Korthikanti et al. 2022 §4.2.3 (in stage units)
        if m % p == 0:
            closed = min(((p - r - 1) * 2 + (v - 1) * p + 1) / v, m)
            assert inflight_microbatches("interleaved_1f1b", p, r, m, v) == pytest.approx(closed)
        # unequal chunks: the profile's peak equals a walk over torch's own action list
        sizes = rng.uniform(0.5, 3.0, size=v)
        assert peak_held("interleaved_1f1b", p, r, m, sizes, v) == pytest.approx(
            _simulate("interleaved_1f1b", p, r, m, v, sizes))


def test_interleaved_with_few_microbatches_holds_every_chunk():
    # issue 18's 39.1B plan: p=2, v=8, m=2 holds both micro-batches of all 8 chunks on rank 0
    prof = held_profile("interleaved_1f1b", 2, 0, 2, 8)
    assert prof.max(axis=0).tolist() == [2.0] * 8
    assert peak_held("interleaved_1f1b", 2, 0, 2, [1.0] * 8, 8) == 16.0


def test_interleaved_with_one_chunk_runs_1f1b():
    # torch's interleaved schedule with one local stage would warm up 2(p - 1 - r) forwards
    assert torch_schedule("interleaved_1f1b", 4, 8, 1) == "Schedule1F1B"
    assert inflight_microbatches("interleaved_1f1b", 4, 0, 8, 1) == 4


def test_profile_rejects_bad_rank():
    with pytest.raises(ValueError, match="outside"):
        held_profile("1f1b", 4, 4, 8)
    with pytest.raises(ValueError, match="unknown schedule"):
        inflight_microbatches("zb", 4, 0, 8)


def _phase(phases, name):
    return max((ph for ph in phases if ph.phase == name), key=lambda ph: ph.total)


def test_runtime_phases_zero0_mixed_precision():
    psi = 1e9
    ph = runtime_phases(psi, "bf16", 0, 8)
    fb = _phase(ph, "forward_backward")
    assert (fb.weights, fb.gradients, fb.optimizer, fb.buffers) == (2 * psi, 2 * psi, 12 * psi, 0)
    # the flat all-reduce buffer beside the gradients
    assert _phase(ph, "grad_sync").total == pytest.approx(18 * psi)
    # fp32 gradients of the masters in place of the 2-byte ones
    assert _phase(ph, "optimizer_step").gradients == pytest.approx(4 * psi)
    assert max(x.total for x in ph) == pytest.approx(18 * psi)
    # one process: no sync phase
    assert [x.phase for x in runtime_phases(psi, "bf16", 0, 1)] == ["forward_backward", "optimizer_step"]


@pytest.mark.parametrize("zero", [1, 2])
def test_runtime_phases_zero12_keeps_full_gradients_in_backward(zero):
    psi, D = 1e9, 8
    ph = runtime_phases(psi, "bf16", zero, D)
    fb = _phase(ph, "forward_backward")
    assert fb.gradients == pytest.approx(2 * psi)       # no bucketed reduce-scatter in the backward
    assert fb.optimizer == pytest.approx(12 * psi / D)
    sync = _phase(ph, "grad_sync")
    assert sync.total == pytest.approx(2 * psi + 12 * psi / D + 2 * psi + 2 * psi / D)
    # fp32 training: the flat fp32 shard the optimizer steps is a copy of the weights
    assert _phase(runtime_phases(psi, "fp32", zero, D), "forward_backward").optimizer == pytest.approx(12 * psi / D)


def test_runtime_phases_zero3():
    psi, D = 1e9, 8
    one = _phase(runtime_phases(psi, "bf16", 3, D, num_microbatches=1, gathered_params=1e8), "forward_backward")
    assert one.total == pytest.approx(16 * psi / D + 2 * 1e8)
    # several micro-batches: FSDP accumulates unsharded 2-byte gradients until the last one
    many = _phase(runtime_phases(psi, "bf16", 3, D, num_microbatches=4), "forward_backward")
    assert many.gradients == pytest.approx(2 * psi + 4 * psi / D)


def test_runtime_phases_take_arrays():
    pel = np.array([[1e6, 2e6], [3e6, 4e6]])
    for z, d in itertools.product(range(4), (1, 4)):
        for ph in runtime_phases(pel, "bf16", z, d, num_microbatches=2, gathered_params=pel / 4):
            assert np.shape(ph.total) == pel.shape


class _Provider:
    """Synthetic layer costs: equal time, `act[i]` activation bytes per micro-batch, 1e6 params."""

    def __init__(self, act, out=0.0):
        self.act, self.out = act, out

    def cost(self, layer, mb, tp):
        from autopar.inter_op.stage_cost import LayerCost

        a = self.act[layer.index] * mb
        return LayerCost(fwd_s=1e-3, bwd_s=2e-3, act_bytes={"none": a, "selective": a, "full": a / 10},
                         param_elems={f"l{layer.index}.w": 1e6}, out_bytes=self.out * mb)


def _search(act, cons, gbs=8, nodes=1, out=0.0):
    from autopar.capture.graph import OpGraph
    from autopar.inter_op.layers import Layer
    from autopar.inter_op.search import Search

    layers = [Layer(i, f"blocks.{i}", [f"blocks.{i}"], [], [f"l{i}.w"], signature=str(i)) for i in range(len(act))]
    cluster = autopar.ClusterSpec.load("dgx-a100-80g", num_nodes=nodes)
    graph = OpGraph(name="synthetic", nodes=[], params={})
    return Search(graph, layers, cluster, gbs, "bf16", cons, provider=_Provider(act, out)).run().best


def test_interleaved_stage_counts_every_chunk():
    """A stage's activations are what the schedule holds over all of its chunks (issue 18: the
    39.1B plan counted one chunk's layers)."""
    act = [1e9, 2e9, 3e9, 4e9, 5e9, 6e9, 7e9, 8e9]
    cons = autopar.Constraints(dp=4, tp=1, pp=2, microbatch_size=1, num_microbatches=2,
                               schedule="interleaved_1f1b", virtual_stages=2, recompute="none", zero_stage=0)
    best = _search(act, cons)
    assert best.v == 2 and best.m == 2
    for d, st in enumerate(best.stages):
        chunk = [sum(act[k:j]) for k, j in st.chunks]
        want = peak_held("interleaved_1f1b", 2, d, 2, chunk, 2)
        assert st.activations_bytes == pytest.approx(want)
    # m = p = 2: rank 0 holds both micro-batches of both chunks, every layer it has, twice
    st0 = best.stages[0]
    assert st0.activations_bytes == pytest.approx(2 * sum(sum(act[k:j]) for k, j in st0.chunks))
    total = st0.weights_bytes + st0.gradients_bytes + st0.optimizer_bytes + st0.activations_bytes + st0.buffers_bytes
    assert total == pytest.approx(st0.peak_bytes)


def test_1f1b_with_fewer_microbatches_than_stages_counts_gpipe():
    act = [1e9] * 8
    cons = autopar.Constraints(dp=2, tp=1, pp=4, microbatch_size=1, num_microbatches=2,
                               schedule="1f1b", recompute="none", zero_stage=0)
    best = _search(act, cons, gbs=4)
    for st in best.stages:      # the runtime runs GPipe: every stage holds both micro-batches
        assert st.activations_bytes == pytest.approx(2 * sum(sum(act[k:j]) for k, j in st.chunks))


def test_pipeline_stage_buffers_and_boundaries():
    """torch.pipelining keeps a receive buffer per micro-batch for a stage's input and for its
    output's gradient; a stage also keeps its output until the backward, and its input is
    that receive buffer (the layer's first op saves it)."""
    act, out, m = [1e9] * 8, 1e8, 8
    cons = autopar.Constraints(dp=2, tp=1, pp=4, microbatch_size=1, num_microbatches=m,
                               schedule="1f1b", recompute="none", zero_stage=0)
    best = _search(act, cons, gbs=16, out=out)
    p = len(best.stages)
    for i, st in enumerate(best.stages):
        (k, j), = st.chunks
        n_in, n_out = int(i > 0), int(i < p - 1)
        assert st.buffers_bytes == pytest.approx(m * out * (n_in + n_out))
        held = min(p - i, m)
        assert st.activations_bytes == pytest.approx(held * (sum(act[k:j]) - n_in * out + n_out * out))


def test_search_rejects_what_only_the_sync_phase_overflows():
    """ZeRO 0's flat all-reduce buffer and the fp32 gradients of the optimizer step count: a
    layout whose backward fits but whose 18 bytes/param do not is not planned."""
    from cost_models.memory import usable_memory

    cluster = autopar.ClusterSpec.load("dgx-a100-80g", num_nodes=1)
    n = usable_memory(cluster.device) / 17 / 1e6      # params (millions) per layer at 17 B/param
    from autopar.inter_op.stage_cost import LayerCost

    class P(_Provider):
        def cost(self, layer, mb, tp):
            return LayerCost(fwd_s=1e-3, bwd_s=2e-3, act_bytes={"none": 0.0, "selective": 0.0, "full": 0.0},
                             param_elems={f"l{layer.index}.w": n * 1e6}, out_bytes=1e3)

    from autopar.capture.graph import OpGraph
    from autopar.inter_op.layers import Layer
    from autopar.inter_op.search import Search

    layers = [Layer(0, "blocks.0", ["blocks.0"], [], ["l0.w"], signature="0")]
    cons = autopar.Constraints(dp=8, tp=1, pp=1, zero_stage=0)
    with pytest.raises(autopar.PlanError, match="no plan fits"):
        Search(OpGraph(name="synthetic", nodes=[], params={}), layers, cluster, 8, "bf16", cons, provider=P([0.0])).run()
    cons1 = autopar.Constraints(dp=8, tp=1, pp=1, zero_stage=1)
    best = Search(OpGraph(name="synthetic", nodes=[], params={}), layers, cluster, 8, "bf16", cons1, provider=P([0.0])).run().best
    assert best.zero == 1
