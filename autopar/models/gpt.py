"""GPT (GPT-2 / GPT-3 / Megatron shape): learned positions, pre-LayerNorm blocks, GELU MLP,
tied input/output embeddings. forward(tokens, targets) returns the mean cross-entropy loss."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.configs import GPTConfig
from autopar.models.init import init_weights
from autopar.models.positions import token_positions


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout only when configured, so dropout-free models capture without dropout ops."""
    return F.dropout(x, p, training) if p > 0 else x


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.p = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        # head-major fused rows ([q, k, v] of head 0, then of head 1, ...): a contiguous row
        # shard of the weight holds whole heads, so tensor parallelism needs no gather here
        q, k, v = self.qkv(x).view(b, s, self.heads, 3 * d).transpose(1, 2).split(d, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.p if self.training else 0.0)
        return _dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), self.p, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.p = cfg.dropout
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.proj = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")), self.p, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.p = cfg.dropout
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = token_positions(tokens.shape[1], tokens.device)
        return _dropout(self.tok(tokens) + self.pos(pos), self.p, self.training)


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    """Top-level children run in order (embed, blocks, head), so pipeline stages cut cleanly."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight
        init_weights(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
