"""Buffers computed in a model's __init__ (rotary inv_freq, BERT position_ids) survive building on
meta and come back with their values when the runtime materialises the model."""

import pytest
import torch

pytest.importorskip("transformers")

from autopar.models import build_model  # noqa: E402
from autopar.runtime.materialize import materialize  # noqa: E402

LLAMA = ("hf:llama?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&num_key_value_heads=2"
         "&intermediate_size=128&vocab_size=256&seq_len=32")
BERT = ("hf:bert?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&intermediate_size=128"
        "&vocab_size=256&seq_len=32")


@pytest.mark.parametrize("ref", [LLAMA, BERT])
def test_buffers_restored_on_materialise(ref):
    meta = build_model(ref)                      # what planning and the runtime build from
    real = build_model(ref, device="cpu")        # built directly, buffers computed by transformers
    assert all(p.is_meta for p in meta.model.parameters())
    materialize(meta.model, seed=0, device="cpu")
    got, want = dict(meta.model.named_buffers()), dict(real.model.named_buffers())
    assert got.keys() == want.keys() and got
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    loss = meta.model(*[torch.zeros_like(x, device="cpu") for x in meta.example_inputs])
    assert torch.isfinite(loss)
