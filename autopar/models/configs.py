"""The zoo's model configurations: plain dataclasses, importing no torch (so that `autopar models`
lists the zoo without loading it; the model classes live in `gpt`, `llama`, `bert`, `mlp`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    seq_len: int = 1024
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn_mult: int = 4
    tie_embeddings: bool = True
    dropout: float = 0.0      # Megatron's hidden and attention dropout (0.1 in its published runs)

    def num_params(self) -> int:
        h, l, v, s = self.hidden, self.layers, self.vocab_size, self.seq_len
        per_layer = 4 * h * h + 4 * h + 2 * self.ffn_mult * h * h + (self.ffn_mult + 1) * h + 4 * h
        return l * per_layer + v * h + s * h + 2 * h + (0 if self.tie_embeddings else v * h)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    seq_len: int = 4096
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    ffn_hidden: int = 11008
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        per_layer = attn + 3 * h * self.ffn_hidden + 2 * h
        return self.layers * per_layer + 2 * self.vocab_size * h + h


@dataclass(frozen=True)
class MoEConfig:
    """A DeepSeek-style mixture-of-experts decoder (DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066):
    Llama attention; each MoE block has `shared_experts` always-on SwiGLU experts and
    `num_experts` fine-grained routed ones of width `expert_hidden`, `top_k` per token; the
    first `dense_layers` blocks have a dense SwiGLU of width `dense_hidden` instead."""

    vocab_size: int = 32000
    seq_len: int = 4096
    hidden: int = 2048
    layers: int = 28
    heads: int = 16
    kv_heads: int = 16
    num_experts: int = 64
    top_k: int = 6
    expert_hidden: int = 1408
    shared_experts: int = 2
    dense_layers: int = 1
    dense_hidden: int = 10944
    aux_loss_coef: float = 0.001     # sequence-wise balance loss weight (DeepSeek-V3's alpha: 1e-4)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h + 2 * h
        moe = (3 * h * self.expert_hidden * (self.num_experts + self.shared_experts) + self.num_experts * h)
        dense = 3 * h * self.dense_hidden
        return (self.layers * attn + self.dense_layers * dense + (self.layers - self.dense_layers) * moe
                + 2 * self.vocab_size * h + h)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    seq_len: int = 512
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn_hidden: int = 3072
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    mask_token: int = 103
    mask_prob: float = 0.15

    def num_params(self) -> int:
        h, f, v = self.hidden, self.ffn_hidden, self.vocab_size
        embed = (v + self.seq_len + self.type_vocab_size) * h + 2 * h
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        head = h * h + h + 2 * h + v      # transform dense + LayerNorm + decoder bias (weight tied)
        return embed + self.layers * per_layer + head


@dataclass(frozen=True)
class MLPConfig:
    """`MLP(dim, hidden, layers)`: dim -> hidden x (layers - 1) -> dim, no biases."""

    dim: int = 1024
    hidden: int = 4096
    layers: int = 4

    def num_params(self) -> int:
        return self.dim * self.hidden * 2 + self.hidden * self.hidden * max(0, self.layers - 2)
