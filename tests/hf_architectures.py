"""Hugging Face causal LMs of architectures autopar has no `hf:` family for, built from tiny
configs (4 layers, hidden 64, 4 heads, vocabulary 128, 16 tokens; dropout off so that losses
compare with one process) and wrapped as a user would (`HFCausalLM`: the loss read off the
model's output, its FQNs under `m.`). Each is a MODULE:FACTORY reference,
`tests.hf_architectures:<name>` for every name in `ARCHITECTURES`; `benchmarks/layout_matrix.py
--architectures` runs every layout of each.

What they add beyond the zoo and `hf:gpt2`/`hf:llama`: Falcon's multi-query attention split
out of its fused qkv by index lists (tensor constants the forward makes) with parallel
attention and MLP, and its new decoder architecture (grouped KV heads broadcast over the query
heads); GPTBigCode's multi-query attention; GPT-NeoX's and Phi's partial rotary embeddings
and parallel residual; GPT-J's interleaved rotary; Phi-3's fused qkv and gate/up projections
(with rotation of the whole head, its unrotated rest empty); BLOOM's ALiBi; Gemma's and
Qwen-3's head dimension apart from the hidden size and Qwen-3's per-head norms; Cohere's
LayerNorm without bias and tied head; OLMo's non-parametric LayerNorm; Qwen-2's qkv biases;
Mistral, StableLM and StarCoder-2."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from autopar.models.registry import token_batch

VOCAB, SEQ = 128, 16
_NOISE = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                   max_position_embeddings=64, intermediate_size=128, **_NOISE)
_GPT_LIKE = dict(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64, **_NOISE)
# name -> (transformers config class, its values)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "falcon": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    max_position_embeddings=64, new_decoder_architecture=False, multi_query=True,
                                    parallel_attn=True, alibi=False, hidden_dropout=0.0, attention_dropout=0.0,
                                    **_NOISE)),
    "falcon_new": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                        max_position_embeddings=64, new_decoder_architecture=True, num_kv_heads=2,
                                        parallel_attn=True, alibi=False, hidden_dropout=0.0,
                                        attention_dropout=0.0, **_NOISE)),
    "bigcode": ("GPTBigCodeConfig", dict(_GPT_LIKE, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)),
    "gptj": ("GPTJConfig", dict(_GPT_LIKE, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "neox": ("GPTNeoXConfig", dict(_LLAMA_LIKE, hidden_dropout=0.0, attention_dropout=0.0)),
    "phi": ("PhiConfig", dict(_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "phi3": ("Phi3Config", dict(_LLAMA_LIKE, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                attention_dropout=0.0)),
    "bloom": ("BloomConfig", dict(vocab_size=VOCAB, hidden_size=64, n_layer=4, n_head=4, hidden_dropout=0.0,
                                  attention_dropout=0.0, **_NOISE)),
    "gemma": ("GemmaConfig", dict(_LLAMA_LIKE, num_key_value_heads=1, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(_LLAMA_LIKE, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(_LLAMA_LIKE, num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", dict(_LLAMA_LIKE, num_key_value_heads=2, sliding_window=None)),
    "olmo": ("OlmoConfig", dict(_LLAMA_LIKE, num_key_value_heads=2)),
    "stablelm": ("StableLmConfig", dict(_LLAMA_LIKE, num_key_value_heads=2, hidden_dropout=0.0,
                                        attention_dropout=0.0)),
    "starcoder2": ("Starcoder2Config", dict(_LLAMA_LIKE, num_key_value_heads=2, residual_dropout=0.0,
                                            embedding_dropout=0.0, attention_dropout=0.0)),
    "cohere": ("CohereConfig", dict(_LLAMA_LIKE, num_key_value_heads=2)),
}


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM wrapped as a user would: built from its config, called with
    keyword arguments, the loss read off its output (its FQNs under `m.`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        import transformers

        self.m = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels, use_cache=False).loss


def build(name: str) -> tuple[nn.Module, tuple, Callable]:
    """(model on meta, example inputs, batch function) of architecture `name`."""
    import transformers

    cls, values = ARCHITECTURES[name]
    cfg = getattr(transformers, cls)(**values)      # attention: SDPA where the class has it (transformers' default)
    with torch.device("meta"):
        model = HFCausalLM(cfg)
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x.clone()), token_batch(VOCAB, SEQ)


def __getattr__(name: str) -> Callable:
    """`tests.hf_architectures:<name>`: the factory of that architecture."""
    if name in ARCHITECTURES:
        return lambda: build(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
