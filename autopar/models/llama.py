"""Llama 2 / Llama 3 (Touvron et al. 2023; Meta 2024): RMSNorm pre-norm blocks, SwiGLU MLP, rotary
position embeddings, grouped-query attention (n_kv_heads < n_heads), untied output head.
forward(tokens, targets) returns the mean next-token cross-entropy loss.

Top-level children run in execution order (`embed`, `layers`, `norm`, `head`), so pipeline stages
cut cleanly at top-level / ModuleList FQNs; each block is a function of the hidden state alone
(the rotary tables are recomputed per block from the sequence length: a few element-wise ops on
an (s, d/2) table, negligible next to the block, and no buffers that need materialising after
building on the meta device).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.configs import LlamaConfig
from autopar.models.init import init_weights
from autopar.models.positions import token_positions
from autopar.models.registry import register_token_family


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(seq: int, dim: int, theta: float, device: torch.device, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (seq, dim), in the half-split (rotate_half) layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    t = token_positions(seq, device, torch.float32)   # a context-parallel rank's chunks: where they are
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def rotated_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, heads, s, d], k and v [b, kv_heads, s, d], rotary embedding applied to q and k."""
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, s, self.heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        cos, sin = rotary_tables(s, d, self.theta, x.device, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.rotated_qkv(x)
        # grouped-query attention inside the kernel (each K/V head shared by heads / kv_heads
        # query heads), not by repeating K and V before it: context parallelism all-gathers
        # K and V as the attention reads them, kv_heads of them, not heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.heads * d))


class RepeatKVAttention(Attention):
    """Grouped-query attention as much code writes it (Hugging Face's eager `repeat_kv`): K and V
    repeated over the query heads (`expand` + `reshape`, which copies) before SDPA, instead of
    SDPA's `enable_gqa`. The zoo's Llama ran it until a272bca; the H100 measurement of
    `benchmarks/gpu_step.py`'s llama-1b case ran it (two [b, heads, s, d] copies saved a layer),
    and tests of the repeat's pricing use it (`tests.user_models:llama_repeat_kv`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.rotated_qkv(x)
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, rep, s, d).reshape(b, self.heads, s, d)
        v = v[:, :, None].expand(b, self.kv_heads, rep, s, d).reshape(b, self.heads, s, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.heads * d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Top-level children run in order (embed, layers, norm, head)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        init_weights(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.layers:
            x = blk(x)
        return self.pipeline_loss(self.head(self.norm(x)), targets)

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss after the last child (`head`): the runtime ends the last pipeline stage with
        it, the children (embed, layers.*, norm, head) each taking the previous one's output."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# the catalogue's llama models, as (config, description)
CONFIGS = register_token_family("llama", Llama)
