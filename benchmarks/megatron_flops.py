"""Megatron-LM's training FLOP count, `num_floating_point_operations` in
megatron/training/training.py (github.com/NVIDIA/Megatron-LM), for a Hugging Face config: what a
figure Megatron publishes as TFLOP/s counted, so that it converts back to the step time it was.

The formula counts GEMMs only, 3 passes (forward, weight and data gradients) of 2 FLOPs a
multiply-add, per sample of s tokens (B = 1):

    12 s L h^2 [ (1 + g/a + c s/h) q/h  +  f k 3/2 / h  +  V / (2 L h) ]

q/h the query projection (heads x kv_channels) over the hidden size, g/a the key-value groups
over the heads, f the MLP width (an expert's, times k the experts a token is routed to: active
parameters), 3/2 the gated (SwiGLU) MLP, V the vocabulary padded to a multiple of 128 x tp
(`_vocab_size_with_padding`, --make-vocab-size-divisible-by 128). Routers, norms and element-wise
work are not counted; a recomputed forward is not counted.

c is the attention scores' share, which changed:

* `causal_half=False`, c = 1: the whole s x s score matrix, QK^T and PV both (training.py line 137
  at c230e0d7c2, 2024-11-21, the commit that put "Mixtral 8X7B ... 468 TFLOPS as of MCore v0.9"
  into megatron/core/transformer/moe/README.md; the same at core_v0.9.0, line 132);
* `causal_half=True`, c = 1/2: "Only half of the attention matrix is non-zero and needs to be
  multiplied with V" (training.py line 183 at 8873b55d6a, 2025-03-06, "Fixes in number of
  floating-point operation estimates for MoE and attention layer"), which also counts a dense
  layer's MLP apart from a MoE layer's (below).

Layers: a layer whose MLP is dense (Qwen's `mlp_only_layers`, or off `decoder_sparse_step`)
counts `intermediate_size` once; a MoE layer counts k routed experts of `moe_intermediate_size`
(Mixtral: `intermediate_size`) plus the shared expert (`shared_expert_intermediate_size`), as
8873b55d6a's formula does; the 2024 formula has no dense layers in a MoE model (every layer its
top-k), the same for a model whose every layer is MoE (Mixtral, Qwen3-MoE).
"""

from __future__ import annotations

from typing import Any

MEGATRON_TRAINING_PY = "github.com/NVIDIA/Megatron-LM megatron/training/training.py num_floating_point_operations"


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def moe_layer_pattern(cfg: Any) -> list[bool]:
    """Whether each layer's MLP is a MoE layer (Hugging Face's rule: experts present, the layer
    not in `mlp_only_layers`, and (i + 1) a multiple of `decoder_sparse_step`)."""
    layers = int(_get(cfg, "num_hidden_layers"))
    experts = _get(cfg, "num_local_experts") or _get(cfg, "num_experts") or 0
    if not experts:
        return [False] * layers
    dense = set(_get(cfg, "mlp_only_layers") or [])
    step = int(_get(cfg, "decoder_sparse_step") or 1)
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def padded_vocab(vocab: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron's `_vocab_size_with_padding`: `vocab` up to a multiple of divisible_by x tp."""
    m = divisible_by * tp
    return -(-int(vocab) // m) * m


def megatron_flops_per_sample(cfg: Any, seq_len: int, *, causal_half: bool, tp: int = 1,
                              vocab_divisible_by: int = 128) -> float:
    """Megatron-LM's training FLOPs of one sample of `seq_len` tokens of the model `cfg` (a
    Hugging Face config, or a dict of its fields), `causal_half` choosing the formula's version
    (module docstring). Gated MLPs (SwiGLU: Llama, Mixtral, Qwen) are assumed, as every family
    these runs train has."""
    h = int(_get(cfg, "hidden_size"))
    layers = int(_get(cfg, "num_hidden_layers"))
    heads = int(_get(cfg, "num_attention_heads"))
    groups = int(_get(cfg, "num_key_value_heads") or heads)
    kv_channels = int(_get(cfg, "head_dim") or h // heads)
    q_ratio = kv_channels * heads / h
    s = int(seq_len)
    pattern = moe_layer_pattern(cfg)
    moe_layers = sum(pattern)
    dense_layers = layers - moe_layers
    top_k = int(_get(cfg, "num_experts_per_tok") or 0) if moe_layers else 0
    dense_ffn = int(_get(cfg, "intermediate_size"))
    expert_ffn = int(_get(cfg, "moe_intermediate_size") or dense_ffn)
    shared_ffn = int(_get(cfg, "shared_expert_intermediate_size") or 0)
    gated = 3 / 2
    scores = s / h / (2 if causal_half else 1)
    attention = (1 + groups / heads + scores) * q_ratio
    mlp = (dense_ffn * dense_layers + (expert_ffn * top_k + shared_ffn) * moe_layers) * gated / (layers * h)
    logit = padded_vocab(int(_get(cfg, "vocab_size")), tp, vocab_divisible_by) / (2 * layers * h)
    return 3 * 2 * 2 * s * layers * h * h * (attention + mlp + logit)


def megatron_flops_for_ref(model_ref: str, *, causal_half: bool, tp: int = 1) -> float:
    """`megatron_flops_per_sample` of an autopar Hugging Face model reference
    ("hf:mixtral-8x7b?seq_len=4096": its built-in config with the overrides, its sequence)."""
    from autopar.models.hf import make_config, parse_ref

    if not model_ref.startswith("hf:"):
        raise ValueError(f"{model_ref!r}: Megatron's formula is computed from a Hugging Face config (hf:NAME)")
    name, overrides = parse_ref(model_ref[3:])
    _, cfg, seq, _ = make_config(name, **overrides)
    return megatron_flops_per_sample(cfg, seq, causal_half=causal_half, tp=tp)
