"""Software with a fused cross-entropy kernel (`SoftwareSpec.loss_kernel == "fused"`, issue 14):
the flash-attn training stack's apex xentropy reads the 2-byte logits, saves them and one fp32
log-sum-exp per row and writes their gradient in place, where eager PyTorch upcasts the logits,
saves fp32 log-probabilities and holds fp32 gradients of the logits' size
(`cost_models.fused_loss`)."""

import pytest

from autopar.capture import capture
from autopar.models import build_model
from autopar.planner import plan
from autopar.schema import ClusterSpec, Constraints
from autopar.schema.software import SoftwareSpec
from cost_models.compute import node_time
from cost_models.fused_loss import fuse_losses, is_fused_loss
from cost_models.memory import BACKWARD_LIVE, activation_memory, graph_fp32_tensors

A100 = ClusterSpec.load("dgx-a100-80g").device


@pytest.fixture(scope="module")
def tiny():
    b = build_model("gpt-tiny")
    return b, capture(b.model, b.example_inputs)


def _loss(g):
    (n,) = [n for n in g.calls if n.op == "cross_entropy_loss"]
    return n


def test_the_rewrite_marks_the_loss_and_drops_its_upcast(tiny):
    _, g = tiny
    f = fuse_losses(g)
    loss, eager = _loss(f), _loss(g)
    assert is_fused_loss(loss) and not is_fused_loss(eager) and loss.name == eager.name
    up = f.node(loss.inputs[0])                  # the zoo GPT's `logits.float()`: the kernel's own now
    assert g.node(eager.inputs[0]).op == "to" and up.op == "alias" and up.bytes_moved == 0
    assert [n.name for n in f.nodes] == [n.name for n in g.nodes]          # same ops, same names
    assert _loss(g) is eager and not is_fused_loss(eager)                  # the capture is untouched
    assert fuse_losses(f) is f                                            # nothing left to fuse


def test_memory_saves_the_two_byte_logits_and_holds_no_gradient_beside_them(tiny):
    _, g = tiny
    g4, f4 = g.at_batch(4), fuse_losses(g).at_batch(4)
    logits = g4.node(_loss(g4).inputs[0]).outputs[0]
    n, rows = logits.numel, logits.numel // logits.shape[-1]
    eager = activation_memory(g4, "bf16", False, device_type="cuda", layers=[None])
    fused = activation_memory(f4, "bf16", False, device_type="cuda", layers=[None])
    # eager saves the fp32 upcast (4 bytes an element); fused the bf16 logits and a fp32 statistic per row
    assert eager.saved_bytes - fused.saved_bytes == pytest.approx(4 * n - (2 * n + 4 * rows))
    assert eager.loss_grad_bytes == BACKWARD_LIVE * 4 * n and fused.loss_grad_bytes == 0


def test_time_reads_the_logits_once_each_way(tiny):
    _, g = tiny
    g4, f4 = g.at_batch(4), fuse_losses(g).at_batch(4)
    logits = g4.node(_loss(g4).inputs[0]).outputs[0]
    bw = A100.memory_bandwidth * A100.memory_efficiency
    fp = graph_fp32_tensors(f4, "cuda", "bf16")
    fwd, bwd = node_time(_loss(f4), A100, "bf16", 1.0, f4._index, fp32=fp)
    # forward: the bf16 logits read (and the targets, the per-row losses); backward: read and written
    targets = g4.node(_loss(g4).inputs[1]).outputs[0].nbytes
    assert fwd == pytest.approx((2 * logits.numel + targets + 4) / bw + A100.kernel_overhead_s, rel=1e-3)
    assert bwd == pytest.approx(2 * (fwd - A100.kernel_overhead_s) + A100.kernel_overhead_s, rel=1e-3)
    up = f4.node(_loss(f4).inputs[0])
    assert node_time(up, A100, "bf16", 1.0, f4._index, fp32=fp) == (0.0, 0.0)
    # eager, its traffic (the kernels' launch overheads apart): the upcast (2 bytes read, 4 written,
    # each way) and the fp32 loss writing log-probabilities (8 bytes forward, 16 backward): 36
    # bytes an element against the fused kernel's 6
    ge = graph_fp32_tensors(g4, "cuda", "bf16")
    eager = sum(sum(node_time(n, A100, "bf16", 1.0, g4._index, fp32=ge))
                for n in (g4.node(_loss(g4).inputs[0]), _loss(g4))) - 4 * A100.kernel_overhead_s
    assert eager / (fwd + bwd - 2 * A100.kernel_overhead_s) == pytest.approx(36 / 6, rel=0.05)


def test_a_plan_for_the_flash_stack_holds_less_and_says_so(tiny):
    b, g = tiny
    sw = SoftwareSpec.load("flash-attn-2-2023")
    assert sw.loss_kernel == "fused" and "fused cross-entropy" in sw.summary()
    eager_sw = sw.model_copy(update={"loss_kernel": "eager"})
    assert "loss_kernel" not in eager_sw.model_dump() and sw.model_dump()["loss_kernel"] == "fused"
    cons = Constraints(dp=8, tp=1, pp=1, microbatch_size=4, zero_stage=1, recompute="none")
    p = {k: plan(b, "dgx-a100-80g", global_batch_size=32, graph=g, software=s, constraints=cons)
         for k, s in (("fused", sw), ("eager", eager_sw))}
    assert p["fused"].software.loss_kernel == "fused"
    assert p["fused"].predicted.peak_memory_bytes < p["eager"].predicted.peak_memory_bytes
    assert p["fused"].predicted.iteration_time_s < p["eager"].predicted.iteration_time_s
    # the software is recorded: a plan file read back plans the same way
    assert type(p["fused"]).model_validate_json(p["fused"].model_dump_json()).software.loss_kernel == "fused"
