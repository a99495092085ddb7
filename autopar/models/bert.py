"""BERT (Devlin et al. 2019): post-LayerNorm encoder with bidirectional attention, GELU MLP,
masked-language-model head tied to the word embeddings (BertForMaskedLM without the pooler).
forward(tokens, targets) returns the MLM cross-entropy over positions whose target is not -100.

Top-level children run in order (`embed`, `layers`, `head`). Dropout is left out (as in the GPT
zoo model) so that runs are deterministic and comparable across plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.catalogue import catalogue
from autopar.models.configs import BertConfig
from autopar.models.init import init_weights
from autopar.models.positions import token_positions
from autopar.models.registry import ZooEntry, _gen, register, token_inputs

IGNORE = -100


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        pos = token_positions(s, tokens.device)
        types = torch.zeros(s, dtype=torch.long, device=tokens.device)
        return self.ln(self.word(tokens) + self.pos(pos) + self.token_type(types))


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q = self.query(x).view(b, s, self.heads, d).transpose(1, 2)
        k = self.key(x).view(b, s, self.heads, d).transpose(1, 2)
        v = self.value(x).view(b, s, self.heads, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class Layer(nn.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.attn_ln = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)
        self.mlp_ln = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_ln(x + self.attn(x))
        return self.mlp_ln(x + self.fc2(F.gelu(self.fc1(x))))


class MLMHead(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.dense(x))))


class Bert(nn.Module):
    """Top-level children run in order (embed, layers, head); head.decoder.weight is tied to
    embed.word.weight."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.head = MLMHead(cfg)
        self.head.decoder.weight = self.embed.word.weight
        init_weights(self)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.pipeline_loss(self.head(x), targets)

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The MLM loss after the last child (`head`), for the runtime's last pipeline stage;
        the children (embed, layers.*, head) each take the previous one's output."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


@dataclass(frozen=True)
class MLMBatch:
    """(step, global batch, seed) -> (tokens with ~15% replaced by [MASK], targets: the original
    token at masked positions, -100 elsewhere); at least one masked position per sequence.
    A picklable callable."""

    cfg: BertConfig

    def __call__(self, step: int, global_batch_size: int, seed: int = 0) -> tuple:
        cfg = self.cfg
        g = _gen(step, seed)
        tokens = torch.randint(0, cfg.vocab_size, (global_batch_size, cfg.seq_len), generator=g)
        mask = torch.rand(global_batch_size, cfg.seq_len, generator=g) < cfg.mask_prob
        mask[:, 0] = True
        targets = torch.where(mask, tokens, torch.full_like(tokens, IGNORE))
        inputs = torch.where(mask, torch.full_like(tokens, cfg.mask_token % cfg.vocab_size), tokens)
        return inputs, targets


def mlm_batch(cfg: BertConfig) -> MLMBatch:
    return MLMBatch(cfg)


def _bert(name: str, cfg: BertConfig, desc: str) -> ZooEntry:
    return ZooEntry(name, "bert", lambda: Bert(cfg), token_inputs(cfg.seq_len), mlm_batch(cfg),
                    desc, cfg.num_params())


# the catalogue's bert models, as (config, description)
CONFIGS = {n: (e.config, e.description) for n, e in catalogue("bert").items()}

for _name, (_cfg, _desc) in CONFIGS.items():
    register(_bert(_name, _cfg, _desc))
