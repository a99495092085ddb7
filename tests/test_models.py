"""The model zoo (GPT, Llama, BERT, MLP) and model references (zoo names, MODULE:FACTORY, hf:)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import autopar
from autopar.capture import OpGraph, capture
from autopar.models import ModelBundle, build_model, call_batch_fn, zoo

# published sizes (parameters), to 0.1%
PUBLISHED = {"gpt2": 124.4e6, "gpt2-xl": 1.558e9, "gpt3-175b": 174.6e9, "llama2-7b": 6.738e9,
             "llama2-13b": 13.016e9, "llama2-70b": 68.977e9, "llama3-8b": 8.030e9,
             "llama3-70b": 70.554e9, "bert-base": 109.5e6, "bert-large": 335.1e6}


def test_zoo_lists_every_family() -> None:
    z = zoo()
    for name in ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-350m", "gpt3-1.3b", "gpt3-2.7b",
                 "gpt3-6.7b", "gpt3-13b", "gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b",
                 "llama3-8b", "llama3-70b", "bert-base", "bert-large", "gpt-tiny", "llama-tiny",
                 "bert-tiny", "mlp-tiny"]:
        assert name in z, name
    assert {e.family for e in z.values()} >= {"gpt", "llama", "bert", "mlp"}
    assert all(e.description and e.params > 0 for e in z.values())


def test_zoo_params_match_built_models() -> None:
    """ZooEntry.params equals the parameter count of the model built on meta (tied counted once)."""
    for name, e in zoo().items():
        with torch.device("meta"):
            m = e.build()
        assert sum(p.numel() for p in m.parameters()) == e.params, name
        assert all(p.device.type == "meta" for p in m.parameters())
        if name in PUBLISHED:
            assert e.params == pytest.approx(PUBLISHED[name], rel=1e-3), name


def test_llama_shapes_gqa_and_untied_head() -> None:
    from autopar.models.llama import CONFIGS

    cfg = CONFIGS["llama2-70b"][0]
    b = build_model("llama2-70b")
    m = b.model
    assert [n for n, _ in m.named_children()] == ["embed", "layers", "norm", "head"]
    assert len(m.layers) == 80
    assert m.layers[0].attn.k_proj.weight.shape == (8 * 128, 8192)     # 8 KV heads of 128
    assert m.layers[0].attn.q_proj.weight.shape == (64 * 128, 8192)
    assert m.head.weight is not m.embed.weight
    assert b.example_inputs[0].shape == (1, 4096) and cfg.vocab_size == 32000
    l3 = build_model("llama3-8b", batch_size=2)
    assert l3.example_inputs[0].shape == (2, 8192) and l3.model.embed.weight.shape == (128256, 4096)
    assert l3.model.layers[0].attn.kv_heads == 8
    assert build_model("llama2-7b").model.layers[0].attn.kv_heads == 32


def test_bert_post_ln_and_tied_head() -> None:
    m = build_model("bert-base").model
    assert [n for n, _ in m.named_children()] == ["embed", "layers", "head"]
    assert m.head.decoder.weight is m.embed.word.weight
    assert len(m.layers) == 12


@pytest.fixture(scope="module")
def tiny_graphs() -> dict[str, OpGraph]:
    out = {}
    for ref in ["gpt-tiny", "llama-tiny", "bert-tiny", "mlp-tiny"]:
        b = build_model(ref)
        out[ref] = capture(b.model, b.example_inputs, name=ref)
    return out


@pytest.mark.parametrize("ref,layers,top", [
    ("gpt-tiny", ["blocks.0", "blocks.1"], ["embed", "blocks", "head"]),
    ("llama-tiny", ["layers.0", "layers.1"], ["embed", "layers", "norm", "head"]),
    ("bert-tiny", ["layers.0", "layers.1"], ["embed", "layers", "head"]),
    ("mlp-tiny", ["layers.0", "layers.1", "layers.2"], ["layers"]),
])
def test_tiny_zoo_capture(tiny_graphs: dict[str, OpGraph], ref: str, layers: list[str], top: list[str]) -> None:
    g = tiny_graphs[ref]
    assert g.layers == layers
    assert g.top_modules == top
    assert g.num_params == zoo()[ref].params
    if ref != "mlp-tiny":
        assert len({g.layer_signature(l) for l in layers}) == 1
    f1, f2, f8 = (g.at_batch(b).forward_flops for b in (1, 2, 8))
    assert f8 - f1 == pytest.approx(7 * (f2 - f1), rel=1e-9)


def test_llama_tiny_ops(tiny_graphs: dict[str, OpGraph]) -> None:
    g = tiny_graphs["llama-tiny"].at_batch(2)
    ops = {n.target for n in g.layer_nodes("layers.0")}
    assert {"aten.rms_norm.default", "aten.silu.default", "aten.scaled_dot_product_attention.default",
            "aten.cos.default", "aten.sin.default"} <= ops
    (k,) = [n for n in g.calls if n.module_path == "layers.0.attn.k_proj"]
    assert k.out.shape == (2, 16, 2 * 8)          # 2 KV heads of 8: GQA
    assert k.flops == 2 * 2 * 16 * 32 * 16
    (att,) = [n for n in g.layer_nodes("layers.1") if n.op == "scaled_dot_product_attention"]
    assert att.out.shape == (2, 4, 16, 8)         # K/V repeated to the 4 query heads


@pytest.mark.parametrize("ref", ["gpt-tiny", "llama-tiny", "bert-tiny", "mlp-tiny"])
def test_tiny_models_run_on_cpu(ref: str) -> None:
    torch.manual_seed(0)
    b = build_model(ref, device="cpu", batch_size=2)
    batch = call_batch_fn(b.batch_fn, step=0, global_batch_size=2, seed=0)
    loss = b.model(*batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    if ref != "mlp-tiny":      # initialised like the runtime's materialize: near-uniform logits
        assert loss.item() == pytest.approx(math.log(128), rel=0.1)
    loss.backward()
    assert all(p.grad is not None for p in b.model.parameters())


def test_batch_fns_deterministic() -> None:
    for ref in ["gpt-tiny", "llama-tiny", "bert-tiny", "mlp-tiny"]:
        fn = build_model(ref).batch_fn
        a = call_batch_fn(fn, 3, 4, 7)
        b = call_batch_fn(fn, 3, 4, 7)
        c = call_batch_fn(fn, 4, 4, 7)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert not all(torch.equal(x, y) for x, y in zip(a, c))
        assert a[0].shape[0] == 4
    tokens, targets = call_batch_fn(build_model("bert-tiny").batch_fn, 0, 8, 0)
    masked = targets != -100
    assert masked.any() and masked.float().mean() < 0.5
    assert (tokens[masked] == 3).all()


# -- references ------------------------------------------------------------------------------------
def test_unknown_model_suggests() -> None:
    with pytest.raises(autopar.PlanError, match="unknown model 'gpt3-175'.*did you mean"):
        build_model("gpt3-175")
    with pytest.raises(autopar.PlanError, match="unknown model"):
        build_model("no-such-model-at-all")
    with pytest.raises(autopar.PlanError, match="empty"):
        build_model("  ")


def test_factory_two_and_three() -> None:
    b = build_model("test_models_factory:two")
    assert isinstance(b, ModelBundle) and b.batch_fn is None and len(b.example_inputs) == 2
    g = capture(b.model, b.example_inputs)
    assert g.layers == ["layers.0", "layers.1"]
    b3 = build_model("test_models_factory:three")
    x, y = call_batch_fn(b3.batch_fn, 0, 5, 1)
    assert x.shape == (5, 8)
    assert b3.model(x, y).dim() == 0


@pytest.mark.parametrize("ref,match", [
    ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
    ("test_models_factory:missing", "has no attribute 'missing'"),
    ("test_models_factory:not_callable", "is not callable"),
    ("test_models_factory:wrong_type", r"must return \(model, example_inputs\)"),
    ("test_models_factory:wrong_arity", r"must return \(model, example_inputs\)"),
])
def test_bad_factories(ref: str, match: str) -> None:
    with pytest.raises(autopar.PlanError, match=match):
        build_model(ref)


def test_hf_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)     # import transformers -> ImportError
    with pytest.raises(autopar.PlanError, match=r"pip install autopar\[hf\]"):
        build_model("hf:gpt2")


@pytest.mark.parametrize("ref", ["gpt-tiny", "llama-tiny", "bert-tiny", "mlp-tiny", "test_models_factory:two"])
def test_bundles_pickle(ref: str) -> None:
    """Bundles go to spawned workers: model, inputs and batch function must pickle."""
    import pickle

    from autopar.models import default_batch_fn

    b = build_model(ref, device="cpu")
    fn = b.batch_fn or default_batch_fn(b.example_inputs)
    b2 = pickle.loads(pickle.dumps(b))
    fn2 = pickle.loads(pickle.dumps(fn))
    x, y = call_batch_fn(fn, 2, 3, 5), call_batch_fn(fn2, 2, 3, 5)
    assert all(torch.equal(a, c) for a, c in zip(x, y))
    assert not all(torch.equal(a, c) for a, c in zip(x, call_batch_fn(fn, 2, 3, 6)))   # seed matters
    assert torch.equal(b2.model(*x), b.model(*x))


@pytest.mark.parametrize("ref", ["llama-tiny", "bert-tiny"])
def test_children_chain_to_the_loss(ref: str) -> None:
    """Pipeline stages run the top-level children (ModuleLists expanded) in order, then
    `pipeline_loss`: that must equal forward."""
    b = build_model(ref, device="cpu", batch_size=2)
    tokens, targets = call_batch_fn(b.batch_fn, 0, 2, 0)
    x = tokens
    for _, child in b.model.named_children():
        for mod in (child if isinstance(child, torch.nn.ModuleList) else [child]):
            x = mod(x)
    assert torch.equal(b.model.pipeline_loss(x, targets), b.model(tokens, targets))


def test_a_meta_build_initialises_nothing_and_imports_no_dynamo():
    """Building a zoo model on the meta device (what `autopar plan` does) skips torch.nn.init's
    initialisers: on meta they would run torch's reference kernels, importing torch._dynamo
    (about 0.8 s of a warm plan). Outside the build they initialise as ever."""
    import subprocess
    import sys

    code = ("import sys, torch; from autopar.models import build_model; b = build_model('gpt3-1.3b'); "
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'; "
            "assert next(b.model.parameters()).is_meta; "
            "w = torch.nn.Linear(4, 4).weight; assert w.abs().sum() > 0; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
