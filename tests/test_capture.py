"""Capture: torch.export into an OpGraph, symbolic batch, FLOPs by hand, layers, tied parameters,
fingerprints, the torch.fx fallback, and errors for models that cannot be captured."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.capture import OpGraph, SymDim, capture
from autopar.capture.export import _WithLoss, default_loss
from autopar.capture.fx_fallback import aten_name, capture_fx
from autopar.models import build_model
from autopar.models.gpt import GPTConfig

TINY = GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4)   # = zoo "gpt-tiny"


def _capture(ref: str) -> OpGraph:
    b = build_model(ref)
    return capture(b.model, b.example_inputs, name=ref)


@pytest.fixture(scope="module")
def gpt() -> OpGraph:
    return _capture("gpt-tiny")


@pytest.fixture(scope="module")
def gpt_fx() -> OpGraph:
    b = build_model("gpt-tiny")
    return capture_fx(_WithLoss(b.model, default_loss), b.example_inputs, "gpt-tiny")


def _one(g: OpGraph, module_path: str, target: str):
    hits = [n for n in g.calls if n.module_path == module_path and n.target == target]
    assert len(hits) == 1, (module_path, target, [(n.module_path, n.target) for n in g.calls])
    return hits[0]


def _well_formed(g: OpGraph) -> None:
    seen = set()
    for n in g.nodes:
        for i in n.inputs:
            assert i in seen, f"{n.name} reads {i} before it is defined"
        seen.add(n.name)
    assert g.nodes[-1].kind == "output"
    for n in g.calls:
        for p in n.params:
            assert p in g.params or p in g.buffers


# -- shapes and FLOPs against hand computation -----------------------------------------------------
def test_linear_sdpa_embedding_flops_by_hand(gpt: OpGraph) -> None:
    _well_formed(gpt)
    h, s, v, a = TINY.hidden, TINY.seq_len, TINY.vocab_size, TINY.heads
    fc = _one(gpt, "blocks.0.mlp.fc", "aten.linear.default")
    assert fc.out.shape == (SymDim("b"), s, 4 * h)              # symbolic batch
    assert fc.params == ["blocks.0.mlp.fc.weight", "blocks.0.mlp.fc.bias"]
    for b in (1, 3, 8):
        g = gpt.at_batch(b)
        fc = _one(g, "blocks.0.mlp.fc", "aten.linear.default")
        assert fc.out.shape == (b, s, 4 * h)
        # (b, s, h) x (4h, h)^T: 2*b*s*h*4h multiply-adds, plus the bias add
        assert fc.flops == 2 * b * s * h * 4 * h + b * s * 4 * h
        att = _one(g, "blocks.1.attn", "aten.scaled_dot_product_attention.default")
        assert att.out.shape == (b, a, s, h // a)
        assert att.flops == 2 * (2 * b * a * s * s * (h // a))   # QK^T and PV, causality not discounted
        emb = _one(g, "embed.tok", "aten.embedding.default")
        assert emb.flops == 0 and emb.out.shape == (b, s, h)
        head = _one(g, "head.out", "aten.linear.default")
        assert head.flops == 2 * b * s * h * v
        assert head.params == ["embed.tok.weight"]             # the tied head reads the embedding


def test_symbolic_batch_flops_scale_linearly(gpt: OpGraph) -> None:
    assert gpt.batch_size is None and gpt.capture_method == "torch.export (symbolic batch)"
    f = {b: gpt.at_batch(b).forward_flops for b in (1, 2, 8)}
    assert f[1] > 0
    assert f[8] - f[1] == pytest.approx(7 * (f[2] - f[1]), rel=1e-12)
    assert f[8] / f[1] == pytest.approx(8, rel=1e-3)           # batch-independent ops are tiny
    g8 = gpt.at_batch(8)
    assert g8.batch_size == 8
    assert all(not o.is_batched for n in g8.nodes for o in n.outputs)


def test_layers_top_modules_and_signatures(gpt: OpGraph) -> None:
    assert gpt.layers == ["blocks.0", "blocks.1"]
    assert gpt.layer_types == {"blocks.0": "Block", "blocks.1": "Block"}
    assert gpt.top_modules == ["embed", "blocks", "head"]
    assert gpt.layer_signature("blocks.0") == gpt.layer_signature("blocks.1")
    # ops of one layer are contiguous and in execution order
    order = [n.layer for n in gpt.calls if n.layer]
    assert order == sorted(order, key=gpt.layers.index)


def test_tied_parameters_counted_once(gpt: OpGraph) -> None:
    b = build_model("gpt-tiny")
    unique = sum(p.numel() for p in b.model.parameters())
    with_dups = sum(p.numel() for _, p in b.model.named_parameters(remove_duplicate=False))
    assert gpt.num_params == unique == TINY.num_params() < with_dups
    assert "head.out.weight" not in gpt.params
    assert gpt.params["embed.tok.weight"].tied == ["head.out.weight"]


def test_fingerprint_stable_and_distinct(gpt: OpGraph) -> None:
    again = _capture("gpt-tiny")
    assert again.fingerprint() == gpt.fingerprint()
    assert _capture("gpt-small").fingerprint() != gpt.fingerprint()
    assert _capture("llama-tiny").fingerprint() != gpt.fingerprint()


def test_capture_without_batch_dim() -> None:
    b = build_model("mlp-tiny", batch_size=4)
    g = capture(b.model, b.example_inputs, batch_dim=False)
    assert g.batch_size == 4 and g.forward_flops > 0
    lin = [n for n in g.calls if n.target == "aten.linear.default"]
    assert lin[0].out.shape == (4, 64) and lin[0].flops == 2 * 4 * 32 * 64


def test_model_on_cpu_and_output_not_scalar() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = capture(m, (torch.randn(3, 8),))
    assert g.layers == ["0", "2"]   # same-class children with parameters of a Sequential
    assert g.calls[-1].target == "aten.sum.default"      # default loss: sum of the output
    b = 5   # linear (2*b*8*16 + bias), relu, linear (2*b*16*4 + bias), sum
    assert g.at_batch(b).forward_flops == (2 * b * 8 * 16 + b * 16) + b * 16 + (2 * b * 16 * 4 + b * 4) + b * 4


# -- the torch.fx fallback -------------------------------------------------------------------------
def test_fx_fallback_matches_export(gpt: OpGraph, gpt_fx: OpGraph) -> None:
    _well_formed(gpt_fx)
    assert gpt_fx.capture_method.startswith("torch.fx")
    assert gpt_fx.layers == gpt.layers and gpt_fx.top_modules == gpt.top_modules
    assert gpt_fx.num_params == gpt.num_params
    for b in (1, 8):
        assert gpt_fx.at_batch(b).forward_flops == pytest.approx(gpt.at_batch(b).forward_flops, rel=1e-9)
    fc = _one(gpt_fx.at_batch(2), "blocks.0.mlp.fc", "aten.linear.default")
    assert fc.params == ["blocks.0.mlp.fc.weight", "blocks.0.mlp.fc.bias"]
    assert fc.flops == 2 * 2 * 16 * 32 * 128 + 2 * 16 * 128
    assert gpt_fx.layer_signature("blocks.0") == gpt_fx.layer_signature("blocks.1")
    targets = {n.target for n in gpt_fx.calls}
    assert {"aten.embedding.default", "aten.layer_norm.default", "aten.scaled_dot_product_attention.default",
            "aten.cross_entropy_loss.default", "aten.view.default", "aten.transpose.int"} <= targets


def test_capture_falls_back_to_fx_when_export_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    ex = importlib.import_module("autopar.capture.export")   # (autopar.capture is also the function)

    def boom(*a, **k):
        raise RuntimeError("export unavailable")

    monkeypatch.setattr(ex, "_export_dynamic", boom)
    monkeypatch.setattr(ex, "_from_export", boom)
    g = _capture("llama-tiny")
    assert g.capture_method.startswith("torch.fx")
    assert g.layers == ["layers.0", "layers.1"]
    assert g.top_modules == ["embed", "layers", "norm", "head"]
    from autopar.models import zoo

    assert g.num_params == zoo()["llama-tiny"].params
    assert g.at_batch(3).forward_flops == pytest.approx(_capture("llama-tiny").at_batch(3).forward_flops,
                                                        rel=1e-3)


def test_aten_names() -> None:
    assert aten_name("matmul") == "aten.matmul.default"
    assert aten_name("add") == "aten.add.Tensor"
    assert aten_name("transpose") == "aten.transpose.int"
    assert aten_name("cross_entropy") == "aten.cross_entropy_loss.default"
    assert aten_name("float") == "aten._to_copy.default"


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:          # data-dependent control flow: neither export nor fx can trace it
            return y * 2
        return y


class _Uncapturable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.inp(x))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_uncapturable_model_names_module_and_op(device: str) -> None:
    m = _Uncapturable().to(device)
    with pytest.raises(autopar.PlanError) as ei:
        capture(m, (torch.zeros(4, 8, device=device),), name="gated")
    msg = str(ei.value)
    assert "cannot capture gated" in msg
    assert "module `gate` (_Gate)" in msg                 # the module ...
    assert "if y.sum() > 0" in msg                         # ... and the op that failed
    assert "torch.fx" in msg and "torch.export" in msg


def test_not_a_module() -> None:
    with pytest.raises(autopar.PlanError, match="expected a torch.nn.Module"):
        capture(lambda x: x, (torch.zeros(2),))


# -- scale: GPT-3 175B on meta ---------------------------------------------------------------------
def test_gpt3_175b_capture_is_fast_and_allocates_nothing() -> None:
    # CPU time, not wall time: the test machine may be shared (about 6 s of CPU on one core)
    t = time.process_time()
    b = build_model("gpt3-175b")
    g = capture(b.model, b.example_inputs, name="gpt3-175b")
    elapsed = time.process_time() - t
    assert elapsed < 60, elapsed
    assert all(p.device.type == "meta" for p in b.model.parameters())
    assert g.num_params == GPTConfig(vocab_size=51200, seq_len=2048, hidden=12288, layers=96,
                                     heads=96).num_params() == 174_615_846_912
    assert len(g.layers) == 96 and g.layers[0] == "blocks.0" and g.layers[-1] == "blocks.95"
    assert len({g.layer_signature(l) for l in g.layers}) == 1
    # forward FLOPs: Megatron's 72*B*s*l*h^2*(1 + s/6h + V/12lh) is fwd+bwd (3x forward)
    B, s, l, h, V = 1, 2048, 96, 12288, 51200
    megatron_fwd = 24 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert g.at_batch(1).forward_flops == pytest.approx(megatron_fwd, rel=0.01)
    assert math.isclose(g.at_batch(4).forward_flops / g.at_batch(1).forward_flops, 4, rel_tol=1e-4)


class _ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))) + x


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*[_ConvBlock() for _ in range(3)])
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc(self.blocks(self.stem(x)).mean((2, 3))), y)


def test_convnet_with_buffers_export_and_fx_agree() -> None:
    m = _ConvNet().to("meta")
    ins = (torch.zeros(4, 3, 16, 16, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))
    g = capture(m, ins)
    f = capture_fx(_WithLoss(m, default_loss), ins, "convnet")
    for graph in (g, f):
        _well_formed(graph)
        assert graph.layers == ["blocks.0", "blocks.1", "blocks.2"]
        assert "blocks.0.bn.running_mean" in graph.buffers
        (conv,) = [n for n in graph.at_batch(2).calls if n.module_path == "blocks.1.conv"]
        assert conv.flops == 2 * (2 * 8 * 16 * 16) * 8 * 9        # 2 * out elements * C_in * k*k


def test_two_batch_fallback_reads_linear_dims(monkeypatch: pytest.MonkeyPatch, gpt: OpGraph) -> None:
    import importlib

    ex = importlib.import_module("autopar.capture.export")

    def no_dynamic(*a, **k):
        raise RuntimeError("symbolic batch refused")

    monkeypatch.setattr(ex, "_export_dynamic", no_dynamic)
    g = _capture("gpt-tiny")
    assert g.capture_method == "torch.export (two batch sizes)" and g.batch_size is None
    fc = _one(g, "blocks.0.mlp.fc", "aten.linear.default")
    assert fc.out.shape == (SymDim("b"), 16, 128)
    flat = [n for n in g.calls if n.target == "aten.flatten.using_ints"]
    assert flat and flat[0].out.shape[0] == SymDim("16*b")         # (b*s, V) logits for the loss
    for b in (1, 5):
        assert g.at_batch(b).forward_flops == pytest.approx(gpt.at_batch(b).forward_flops, rel=1e-12)
    assert g.fingerprint() == gpt.fingerprint()


def test_compiled_module_is_unwrapped(gpt: OpGraph) -> None:
    b = build_model("gpt-tiny")
    g = capture(torch.compile(b.model), b.example_inputs)
    assert g.layers == gpt.layers and g.fingerprint() == gpt.fingerprint()


def test_a_flop_formula_that_does_not_fit_falls_back_and_says_so():
    """An op torch has a FLOP formula for, called with arguments the formula cannot take (here
    `_scaled_mm` missing its scales), is counted per output element, with a warning naming the
    op (once), not silently."""
    import warnings

    from autopar.capture import flops as F
    from autopar.capture.graph import OpNode, Ref, TensorMeta

    metas = {"a": [TensorMeta((4, 8), "float32")], "b": [TensorMeta((8, 2), "float32")]}
    node = OpNode("s", "call", "aten._scaled_mm.default", args=(Ref("a"),), inputs=["a"],
                  outputs=[TensorMeta((4, 2), "float32")])
    F._FORMULA_MISSES.discard(node.op)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        flops, _ = F.node_cost(node, metas)
        F.node_cost(node, metas)
    assert flops == 8.0                                  # per output element
    said = [str(x.message) for x in w if "FLOP formula" in str(x.message)]
    assert len(said) == 1 and "_scaled_mm" in said[0]


def test_batch_dependent_dimensions_read_without_sympy_agree_with_it():
    """`SymDim.at` reads "a*b + c" forms directly (a warm plan's first `at_batch` spent half a
    second in sympy); every form, linear or not, gives what sympy's lambdify gives."""
    from autopar.capture.graph import SymDim, _compiled, _linear

    for expr in ("b", "2048*b", "4*b + 1", "3*b + 17", "2*b - 1", "b**2", "b*(b + 1)/2"):
        for b in (1, 3, 8):
            assert SymDim(expr).at(b) == int(_compiled(expr)(b)), (expr, b)
    assert _linear("2048*b") == (2048, 0) and _linear("4*b + 1") == (4, 1) and _linear("b**2") is None


def test_export_records_no_stack_traces():
    """autopar's exports leave out the Python stack trace torch records on every node (nothing
    reads it; 15-17% of an export's CPU, `export._no_stack_traces`), and put torch's setting
    back."""
    import torch.fx.config as fx_config

    from autopar.capture.export import export_program

    before = fx_config.do_not_emit_stack_traces
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ep, _, _ = export_program(m, (torch.zeros(4, 8),))
    assert [n.name for n in ep.graph.nodes if n.stack_trace] == []
    assert fx_config.do_not_emit_stack_traces == before
