"""Software that fuses element-wise chains (`SoftwareSpec.pointwise_fusion`, issue 20): under
"fused" a chain of element-wise ops is priced as one kernel that reads its inputs once and
writes what leaves it once (`cost_models.fusion`); the default, eager, prices every op as its
own kernel, as before. Hugging Face's GPT-2 (`gelu_new`: eight element-wise ops) and the zoo's
GPT-2 (one GELU) are then predicted alike."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture import capture
from autopar.models.gpt import GPT, GPTConfig
from autopar.planner import plan
from autopar.schema import ClusterSpec, Constraints, SoftwareSpec
from autopar.schema.software import resolve_software
from cost_models.compute import fusion_of, graph_compute_time, memory_time, node_time
from cost_models.fusion import pointwise_chains
from cost_models.layouts import graph_layout_copies

A100 = ClusterSpec.load("dgx-a100-80g").device
B, S, H = 8, 256, 512


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `NewGELUActivation`, as written there: eight element-wise ops in eager mode."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MLP(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.fc, self.proj, self.act = nn.Linear(H, 4 * H), nn.Linear(4 * H, H), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y = gelu_new(y) if self.act == "new" else F.gelu(y, approximate="tanh")
        return self.proj(y).sum()


def _graph(act: str):
    with torch.device("meta"):
        m, x = MLP(act), torch.zeros(B, S, H)
    return capture(m, (x,)).at_batch(B)


def _elementwise(g):
    return [n for n in g.calls if n.op not in ("linear", "addmm", "sum") and n.bytes_moved > 0]


def _time(g, nodes, fusion):
    copies = graph_layout_copies(g, A100.device_type)
    return sum(sum(node_time(n, A100, "bf16", 1.0, g._index, "fused", copies, fusion)) for n in nodes)


def test_a_gelu_new_chain_is_one_kernel_of_its_boundary_traffic():
    g = _graph("new")
    ew = _elementwise(g)
    assert sorted(n.op for n in ew) == ["add", "add", "mul", "mul", "mul", "mul", "pow", "tanh"]
    fusion = fusion_of(g, A100, "fused", "fused")
    assert fusion_of(g, A100, "fused", "eager") is None              # eager: every op its own kernel
    chain = fusion.chain_of[ew[0].name]
    assert set(chain.members) == {n.name for n in ew}
    # its boundary: the fc output read once, the activation written once (both B x S x 4H fp32
    # captured; the pow, tanh and products in between move nothing)
    elems = B * S * 4 * H
    assert sorted(chain.boundary) == [(4.0 * elems, "float32")] * 2
    fwd = sum(node_time(n, A100, "bf16", 1.0, g._index, "fused", None, fusion)[0] for n in ew)
    one_kernel = memory_time(2 * 2.0 * elems, A100) + A100.kernel_overhead_s       # bf16: 2 bytes
    assert fwd == pytest.approx(one_kernel, rel=1e-6)
    eager = _time(g, ew, None)
    fused = _time(g, ew, fusion)
    assert eager > 8 * fused                                          # 47 tensor-sized accesses against 5
    # fused, the eight ops cost what the one GELU kernel costs eagerly (its backward within 10%:
    # the chain's backward takes the eight ops' eager backward/forward bytes ratio, 1.6 against 1.5)
    g1 = _graph("gelu")
    gelu = _time(g1, _elementwise(g1), None)
    assert gelu <= fused <= 1.05 * gelu
    # the chain's share is priced at the member's sharding, as the ILP prices a strategy
    half = sum(sum(node_time(n, A100, "bf16", 2.0, g._index, "fused", None, fusion)) for n in ew)
    assert half == pytest.approx((fused - 2 * A100.kernel_overhead_s) / 2 + 2 * A100.kernel_overhead_s, rel=1e-6)


def test_a_single_op_and_a_chain_that_leaves_and_comes_back_stay_eager():
    """`a + linear(a)`: the add reads `a` and a tensor made from `a` outside the chain, so one
    kernel cannot run both (a residual add after attention does not join the add before it);
    the zoo's lone GELU is a chain of one: priced as eager."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x * 2.0
            return (a + self.lin(a)).sum()

    with torch.device("meta"):
        g = capture(Residual(), (torch.zeros(B, S, H),)).at_batch(B)
    assert not pointwise_chains(g.nodes, g._index).chain_of
    g1 = _graph("gelu")
    assert not fusion_of(g1, A100, "fused", "fused").chain_of
    assert graph_compute_time(g1, A100, pointwise_fusion="fused").total_s == graph_compute_time(g1, A100).total_s


def test_the_default_software_is_eager_and_its_plans_are_written_as_before():
    sw = resolve_software(None)
    assert sw.pointwise_fusion == "eager" and "pointwise_fusion" not in sw.model_dump()
    fused = SoftwareSpec.load("torch-compile-2025")
    assert fused.pointwise_fusion == "fused" and fused.model_dump()["pointwise_fusion"] == "fused"
    assert SoftwareSpec.model_validate_json(fused.model_dump_json()) == fused
    assert "element-wise chains fused" in fused.summary() and "element-wise" not in sw.summary()
    with pytest.raises(Exception, match="pointwise_fusion"):
        SoftwareSpec(name="x", pointwise_fusion="compiled")


HF_SMALL = ("hf:gpt2?hidden_size=512&num_hidden_layers=2&num_attention_heads=8&vocab_size=2048&seq_len=512"
            "&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0")


@pytest.fixture(scope="module")
def two_gpt2s():
    """(bundle, graph) of the same GPT-2 (h=512, s=512, 2 layers) written by the zoo and by
    Hugging Face, each captured once (`tests.captured`)."""
    pytest.importorskip("transformers")
    from autopar.models import ModelBundle
    from tests.captured import captured

    with torch.device("meta"):
        zoo = GPT(GPTConfig(vocab_size=2048, seq_len=512, hidden=512, layers=2, heads=8))
    tokens = torch.zeros(1, 512, dtype=torch.long, device="meta")
    zb = ModelBundle("zoo-gpt2-small", zoo, (tokens, tokens))
    return {"zoo": (zb, capture(zoo, zb.example_inputs, name=zb.name)), "hf": captured(HF_SMALL)}


@pytest.mark.parametrize("pinned", [True, False], ids=["tp4xdp2", "free"])
def test_hugging_face_gpt2_and_the_zoo_gpt2_predicted_alike_when_fused(two_gpt2s, pinned):
    """The same GPT-2 written by Hugging Face and by the zoo, on 8 A100s: under torch.compile's
    fusion within 3% of each other; eager, Hugging Face's eight-kernel `gelu_new` makes it
    slower (a real cost of running it eagerly)."""
    cl = ClusterSpec.load("dgx-a100-80g")
    cons = Constraints(tp=4, pp=1, dp=2, sequence_parallel=False) if pinned else None
    t = {}
    for sw in ("autopar", "torch-compile-2025"):
        for way, (bundle, graph) in two_gpt2s.items():
            t[way, sw] = plan(bundle, cl, global_batch_size=64, dtype="bf16", constraints=cons, graph=graph,
                                      software=sw).predicted.iteration_time_s
    fused = t["hf", "torch-compile-2025"] / t["zoo", "torch-compile-2025"] - 1
    eager = t["hf", "autopar"] / t["zoo", "autopar"] - 1
    assert abs(fused) < 0.03, t
    assert eager > fused + 0.03, t
