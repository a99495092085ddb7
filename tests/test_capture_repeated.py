"""Issue 19: a stack of identical blocks captured once and stitched gives the graph a whole
export gives (node names, shapes, arguments, parameters, layers: every cost the search reads);
models it cannot stitch fall back to the whole export and say why."""

import pytest
import torch
import torch.nn as nn

from autopar.capture import capture
from autopar.capture.export import STITCHED
from autopar.inter_op.layers import build_layers
from autopar.models.bert import Bert, BertConfig
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLP
from autopar.models.registry import build_model

HF = {
    "hf-gpt2": "hf:gpt2?hidden_size=64&num_hidden_layers=6&num_attention_heads=4&vocab_size=128&seq_len=16",
    "hf-llama": "hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_hidden_layers=6"
                "&num_attention_heads=4&vocab_size=128&seq_len=16",
}


def _tokens(seq: int) -> tuple:
    return (torch.zeros(1, seq, dtype=torch.long, device="meta"),
            torch.zeros(1, seq, dtype=torch.long, device="meta"))


def _zoo(kind: str):
    with torch.device("meta"):
        if kind == "gpt":
            return GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=6, heads=4)), _tokens(16)
        if kind == "llama":
            return Llama(LlamaConfig(vocab_size=128, seq_len=16, hidden=32, layers=6, heads=4, kv_heads=2,
                                     ffn_hidden=64)), _tokens(16)
        return Bert(BertConfig(vocab_size=128, seq_len=16, hidden=32, layers=6, heads=4, ffn_hidden=64,
                               mask_token=3)), _tokens(16)


def _build(case: str):
    if case in HF:
        pytest.importorskip("transformers")
        b = build_model(HF[case])
        return b.model, b.example_inputs
    return _zoo(case)


def _same_graph(whole, stitched) -> None:
    assert [n.name for n in stitched.nodes] == [n.name for n in whole.nodes]
    for a, b in zip(whole.nodes, stitched.nodes):
        assert a == b, f"{a.name}: {a} != {b}"
    assert list(stitched.params.items()) == list(whole.params.items())
    assert list(stitched.buffers.items()) == list(whole.buffers.items())
    assert (stitched.layers, stitched.layer_types, stitched.top_modules, stitched.batch_size) == \
        (whole.layers, whole.layer_types, whole.top_modules, whole.batch_size)
    assert stitched.fingerprint() == whole.fingerprint()
    # the figures the search reads: FLOPs, bytes and shapes at a batch, layer signatures
    w4, s4 = whole.at_batch(4), stitched.at_batch(4)
    assert [(n.flops, n.bytes_moved, n.outputs) for n in s4.nodes] == [(n.flops, n.bytes_moved, n.outputs)
                                                                     for n in w4.nodes]
    assert [whole.layer_signature(l) for l in whole.layers] == [stitched.layer_signature(l) for l in whole.layers]


@pytest.mark.parametrize("case", ["gpt", "llama", "bert", "hf-gpt2", "hf-llama"])
def test_stitched_capture_equals_whole_export(case):
    model, inputs = _build(case)
    whole = capture(model, inputs, repeated=False)
    stitched = capture(model, inputs)
    assert whole.capture_method == "torch.export (symbolic batch)"
    assert stitched.capture_method == STITCHED
    _same_graph(whole, stitched)
    # the layers the search builds from either graph hold the same ops and parameters
    lw, ls = build_layers(whole, model), build_layers(stitched, model)
    assert [(l.name, l.nodes, l.params, l.signature) for l in lw] == [(l.name, l.nodes, l.params, l.signature)
                                                                      for l in ls]


def test_blocks_that_depend_on_their_number_are_exported_whole():
    """MLP(64, 64, 6): six identical Linear blocks, but the forward skips the ReLU after the
    last one, so a cut model's last block differs from a whole one's: refused, exported whole."""
    with torch.device("meta"):
        model = MLP(64, 64, 6)
    inputs = (torch.zeros(2, 64, device="meta"), torch.zeros(2, 64, device="meta"))
    g = capture(model, inputs)
    assert "blocks not stitched" in g.capture_method
    _same_graph(capture(model, inputs, repeated=False), g)


class _Skip2(nn.Module):
    """Identical blocks, each also reading the output of the block two before it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x, x]
        for b in self.blocks:
            outs.append(b(outs[-1]) + outs[-2])
        return outs[-1].sum()


def test_a_block_reading_two_blocks_back_is_exported_whole():
    with torch.device("meta"):
        model = _Skip2()
    inputs = (torch.zeros(2, 16, device="meta"),)
    g = capture(model, inputs)
    assert "blocks not stitched" in g.capture_method
    _same_graph(capture(model, inputs, repeated=False), g)


def test_models_without_a_stack_take_the_whole_export():
    model, inputs = build_model("gpt-tiny").model, build_model("gpt-tiny").example_inputs   # 2 blocks
    assert capture(model, inputs).capture_method == "torch.export (symbolic batch)"


def _counting_exports(monkeypatch) -> list:
    import importlib

    E = importlib.import_module("autopar.capture.export")   # the package's `capture` shadows the name
    calls: list = []
    orig = E._export_symbolic

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(E, "_export_symbolic", counted)
    return calls


@pytest.mark.parametrize("case", ["gpt", "hf-llama"])
def test_one_cut_is_exported_where_it_shows_enough(case, monkeypatch):
    """A forward that goes once over its blocks: the model cut to 3 blocks is all that is
    exported (the post-stack names' steps read off its graph), and the graph is the whole one."""
    model, inputs = _build(case)
    whole = capture(model, inputs, repeated=False)
    calls = _counting_exports(monkeypatch)
    g = capture(model, inputs)
    assert g.capture_method == STITCHED and len(calls) == 1
    _same_graph(whole, g)


class _Scaled(nn.Module):
    """Identical blocks; the ops after them divide by their number."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(n))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return (self.head(x) / len(self.blocks)).sum()


class _Sliced(_Scaled):
    """Identical blocks, of which the forward runs the first `used`."""

    def __init__(self, used: int) -> None:
        super().__init__()
        self.used = used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks[:self.used]:
            x = torch.relu(b(x))
        return self.head(x).sum()


@pytest.mark.parametrize("model", [_Scaled(), _Sliced(4), _Sliced(6)], ids=["len", "slice-short", "slice-all"])
def test_a_forward_that_reads_the_number_of_blocks_gets_the_whole_graph(model, monkeypatch):
    """`len(self.blocks)` after the loop: one cut cannot show it, two do (exported whole);
    a slice that stops before the last block: refused after one cut; one to the end: one cut."""
    model = model.to("meta")
    inputs = (torch.zeros(2, 16, device="meta"),)
    whole = capture(model, inputs, repeated=False)
    calls = _counting_exports(monkeypatch)
    g = capture(model, inputs)
    _same_graph(whole, g)
    if isinstance(model, _Sliced) and model.used == 6:
        assert g.capture_method == STITCHED and len(calls) == 1
    else:
        assert "blocks not stitched" in g.capture_method
        # len(): the cuts to 3 and 2, then the whole; the short slice: the cut to 3, the whole
        assert len(calls) == (3 if isinstance(model, _Scaled) and not isinstance(model, _Sliced) else 2)
