"""Hugging Face models built from transformers' config classes (no downloads) and captured.

Tiny size overrides keep these fast; the presets' parameter counts are checked on meta."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.models import build_model, call_batch_fn  # noqa: E402
from autopar.models.hf import build_hf, parse_ref  # noqa: E402

COMMON = "num_hidden_layers=2&num_attention_heads=4&seq_len=16&vocab_size=128"
TINY = {
    "gpt2": f"hf:gpt2?hidden_size=64&{COMMON}",
    "llama": f"hf:llama?hidden_size=64&intermediate_size=128&num_key_value_heads=2&{COMMON}",
    "bert": f"hf:bert?hidden_size=64&intermediate_size=128&{COMMON}",
    "opt": f"hf:opt?hidden_size=64&ffn_dim=128&{COMMON}",
    "t5": f"hf:t5?hidden_size=64&d_ff=128&decoder_seq_len=8&{COMMON}",
    "mixtral": f"hf:mixtral?hidden_size=64&intermediate_size=128&num_key_value_heads=2&num_local_experts=4&{COMMON}",
}
LAYERS = {
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "opt": ["model.decoder.layers.0", "model.decoder.layers.1"],
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "mixtral": ["model.layers.0", "model.layers.1"],
}


@pytest.fixture(scope="module")
def graphs() -> dict[str, tuple]:
    out = {}
    for fam, ref in TINY.items():
        b = build_model(ref, batch_size=2)
        out[fam] = (b, capture(b.model, b.example_inputs, name=fam))
    return out


@pytest.mark.parametrize("family", list(TINY))
def test_hf_family_captures(graphs: dict, family: str) -> None:
    b, g = graphs[family]
    assert isinstance(b.model, transformers.PreTrainedModel)
    assert not b.model.config.use_cache
    assert g.capture_method.startswith("torch.export")
    assert g.layers == LAYERS[family]
    assert g.num_params == sum(p.numel() for p in b.model.parameters())        # tied counted once
    assert g.calls[-1].op in ("cross_entropy_loss", "nll_loss", "div", "mean", "sum") or \
        "cross_entropy" in " ".join(n.target for n in g.calls[-12:])
    assert [n for n in g.calls if n.target == "aten.cross_entropy_loss.default"]   # the model's loss
    f1, f2, f8 = (g.at_batch(b_).forward_flops for b_ in (1, 2, 8))
    assert f1 > 0 and f8 - f1 == pytest.approx(7 * (f2 - f1), rel=1e-9)
    stacks: dict[str, list[str]] = {}
    for l in g.layers:
        stacks.setdefault(l.rsplit(".", 1)[0], []).append(l)
    for layers in stacks.values():
        if family == "t5":      # block 0 alone holds T5's relative position bias table
            assert g.layer_signature(layers[0]) != g.layer_signature(layers[1])
        else:
            assert len({g.layer_signature(l) for l in layers}) == 1, layers
    # every op of a layer lies inside that layer's module
    for n in g.calls:
        if n.layer:
            assert n.module_path == n.layer or n.module_path.startswith(n.layer + ".")


def test_gpt2_tied_head_and_linear_flops(graphs: dict) -> None:
    b, g = graphs["gpt2"]
    assert g.params["transformer.wte.weight"].tied == ["lm_head.weight"]
    g2 = g.at_batch(3)
    (head,) = [n for n in g2.calls if n.module_path == "lm_head"]
    assert head.flops == 2 * 3 * 16 * 64 * 128
    (fc,) = [n for n in g2.calls if n.module_path == "transformer.h.0.mlp.c_fc" and n.op == "addmm"]
    assert fc.out.shape == (3 * 16, 4 * 64)                      # Conv1D: addmm on (b*s, h)
    assert fc.flops == 2 * 3 * 16 * 64 * 256 + 3 * 16 * 256


def test_gpt2_device_moves_are_views_and_its_loss_upcast_is_not(graphs: dict) -> None:
    """Hugging Face GPT-2 moves its position embeddings and labels with `.to(device)`, which
    export records as `aten.to.dtype_layout` with their own dtype: `Tensor.to` returns the
    tensor itself, so they move nothing and cost nothing (`capture.flops.identity_move`). Its
    logits' `.float()` (`aten.to.dtype`) stays a cast: under mixed precision it is the loss's
    upcast."""
    from autopar.capture.flops import identity_move, is_view

    _, g = graphs["gpt2"]
    moves = [n for n in g.calls if n.target == "aten.to.dtype_layout"]
    casts = [n for n in g.calls if n.target == "aten.to.dtype"]
    assert moves and all(identity_move(n) and is_view(n) and n.bytes_moved == 0 for n in moves)
    assert casts and not any(is_view(n) for n in casts)


def test_llama_gqa(graphs: dict) -> None:
    _, g = graphs["llama"]
    # the rotary embedding runs under @torch.no_grad: export wraps it in a higher-order op, which
    # capture inlines, so its ops are visible and costed
    assert not any("wrap_with" in n.target for n in g.calls)
    assert any(n.op == "cos" and n.module_path == "model.rotary_emb" for n in g.calls)
    g2 = g.at_batch(2)
    (k,) = [n for n in g2.calls if n.module_path == "model.layers.0.self_attn.k_proj"]
    assert k.out.shape == (2, 16, 2 * 16)                        # 2 KV heads of 16
    (att,) = [n for n in g2.layer_nodes("model.layers.1") if n.op == "scaled_dot_product_attention"]
    assert att.out.shape == (2, 4, 16, 16)
    assert att.flops == 4 * 2 * 4 * 16 * 16 * 16


def test_t5_encoder_decoder(graphs: dict) -> None:
    b, g = graphs["t5"]
    assert b.example_inputs[0].shape == (2, 16) and b.example_inputs[1].shape == (2, 8)
    assert g.top_modules[:2] == ["encoder", "decoder"]
    g1 = g.at_batch(1)
    dec = [n for n in g1.layer_nodes("decoder.block.0") if n.op in ("matmul", "bmm") and n.out.shape[-1] == 16]
    assert dec, "cross-attention scores (8 decoder x 16 encoder positions) expected in the decoder"
    assert "shared.weight" in g.params


def test_mixtral_experts_stay_in_their_layer(graphs: dict) -> None:
    _, g = graphs["mixtral"]
    assert not any("experts." in l for l in g.layers)
    experts = [n for n in g.calls if ".mlp.experts" in n.module_path]
    assert experts and all(n.layer in ("model.layers.0", "model.layers.1") for n in experts)
    g2 = g.at_batch(2)
    gmm = [n for n in g2.layer_nodes("model.layers.0") if "grouped_mm" in n.target or n.op in ("bmm",)]
    assert gmm
    routed = 2 * 16 * 2                                           # tokens x top-2
    total = sum(n.flops for n in gmm)
    # gate+up (64 -> 2*128) and down (128 -> 64) for every routed token
    assert total == pytest.approx(2 * routed * 64 * 256 + 2 * routed * 128 * 64, rel=1e-6)


def test_pretrained_model_passed_directly() -> None:
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)
    with torch.device("meta"):
        m = transformers.GPT2LMHeadModel(cfg)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    g = capture(m, {"input_ids": ids, "labels": ids})           # keyword inputs: .loss is the loss
    assert g.layers == ["transformer.h.0", "transformer.h.1"]
    assert any(n.op == "cross_entropy_loss" for n in g.calls)
    g0 = capture(m, (ids,))                                       # no labels: sum of the logits
    assert g0.calls[-1].op == "sum"
    assert g0.num_params == g.num_params == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("family", ["gpt2", "t5", "bert"])
def test_hf_tiny_runs_on_cpu(family: str) -> None:
    torch.manual_seed(0)
    b = build_model(TINY[family], device="cpu", batch_size=2)
    batch = call_batch_fn(b.batch_fn, 0, 2, seed=0)
    assert [tuple(x.shape) for x in batch] == [tuple(x.shape) for x in b.example_inputs]
    loss = b.model(*batch)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_batch_fn_deterministic() -> None:
    b = build_model(TINY["bert"])
    a1, a2, c = (call_batch_fn(b.batch_fn, s, 4, 3) for s in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a1, a2))
    assert not torch.equal(a1[0], c[0])
    assert (a1[1] != -100).any() and (a1[1] == -100).any()
    ids, labels = call_batch_fn(build_model(TINY["llama"]).batch_fn, 0, 3, 0)
    # next-token targets, shifted in the batch (the model shifts nothing: context parallelism
    # splits both along the sequence)
    assert torch.equal(labels[:, :-1], ids[:, 1:]) and (labels[:, -1] == -100).all() and ids.max() < 128


@pytest.mark.parametrize("ref,params", [
    ("gpt2", 124.44e6), ("llama-2-7b", 6.738e9), ("meta-llama/Llama-2-70b-hf", 68.98e9),
    ("bert-base-uncased", 109.5e6), ("facebook/opt-125m", 125.2e6), ("t5-small", 60.5e6),
    ("mistralai/Mixtral-8x7B-v0.1", 46.70e9),
])
def test_presets_on_meta(ref: str, params: float) -> None:
    b = build_hf(ref)
    assert sum(p.numel() for p in b.model.parameters()) == pytest.approx(params, rel=2e-3)
    assert all(p.device.type == "meta" for p in b.model.parameters())


def test_overrides_and_bad_refs() -> None:
    assert parse_ref("llama?hidden_size=256&num_hidden_layers=2&rope_theta=1e4&tie_word_embeddings=true") == (
        "llama", {"hidden_size": 256, "num_hidden_layers": 2, "rope_theta": 1e4, "tie_word_embeddings": True})
    b = build_hf("llama", hidden_size=128, num_hidden_layers=3, num_attention_heads=4, seq_len=32)
    assert b.model.config.hidden_size == 128 and len(b.model.model.layers) == 3
    assert b.example_inputs[0].shape == (1, 32)
    t5 = build_hf("t5?num_hidden_layers=3&hidden_size=64&num_attention_heads=4")
    assert len(t5.model.encoder.block) == 3 and len(t5.model.decoder.block) == 3
    with pytest.raises(autopar.PlanError, match="unknown Hugging Face model"):
        build_model("hf:not-a-model")
    with pytest.raises(autopar.PlanError, match="no built-in config for that size"):
        build_model("hf:opt-2.7b")


def test_positional_model_pickles() -> None:
    import pickle

    b = build_model(TINY["gpt2"], device="cpu")
    m2 = pickle.loads(pickle.dumps(b.model))
    assert type(m2) is type(b.model) and type(m2).__name__ == "GPT2LMHeadModel"
    batch = call_batch_fn(b.batch_fn, 0, 2, seed=0)
    b.model.eval(), m2.eval()                                      # no dropout
    assert torch.equal(m2(*batch), b.model(*batch))


def test_attention_heads_are_checked_before_transformers_builds_the_model():
    """A multi-head preset with its heads overridden keeps KV heads = heads (the preset's 32 KV
    heads of a 4-head model would fail deep inside attention); KV heads that do not divide the
    heads, or heads that do not divide the hidden size, are a PlanError naming the field."""
    from autopar.models.hf import make_config

    _, cfg, _, _ = make_config("llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    assert cfg.num_key_value_heads == 4
    _, cfg, _, _ = make_config("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert cfg.num_key_value_heads == 2
    with pytest.raises(autopar.PlanError, match="num_key_value_heads=8 does not divide num_attention_heads=4"):
        make_config("llama-3-8b", hidden_size=64, num_attention_heads=4)
    with pytest.raises(autopar.PlanError, match="hidden_size=66 is not a multiple of num_attention_heads=4"):
        make_config("llama", hidden_size=66, num_attention_heads=4)
    with pytest.raises(autopar.PlanError, match="n_embd=66 is not a multiple of n_head=4"):
        make_config("gpt2", hidden_size=66, num_attention_heads=4)
    m = build_model("hf:llama?num_hidden_layers=1&hidden_size=64&num_attention_heads=4&intermediate_size=128"
                    "&seq_len=16&vocab_size=128")
    assert capture(m.model, m.example_inputs).name
