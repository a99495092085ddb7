"""Models written independently of autopar's zoo, as a user would write them (MODULE:FACTORY
references, `tests.user_models:nanogpt`): autopar knows nothing of their layer chaining or loss.

`NanoGPT` follows nanoGPT: pre-LayerNorm blocks, one fused qkv Linear whose output is split
into [q; k; v] blocks, a head computed as `x @ tok.weight.t()` with the embedding's weight (no
output module), cross-entropy at the end of `forward(idx, targets)`.

`SeparateGPT` is the same model with separate q, k and v projections and an `nn.Linear` head
tied to the embedding.

`llama_repeat_kv` is the zoo's llama-tiny with its grouped-query attention written as much code
writes it: K and V repeated over the query heads before SDPA (`autopar.models.llama.
RepeatKVAttention`).

`GatedLM` hands each layer, besides the hidden states, two tensors made once before the first:
a gate computed from the embeddings (floating, it needs a gradient) and a boolean mask of the
tokens to keep (no gradient), as models passing an attention mask or rotary tables do.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.llama import RepeatKVAttention
from autopar.models.registry import token_batch

VOCAB, SEQ, HIDDEN, HEADS = 128, 16, 32, 4


class SelfAttention(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(h)
        self.attn = SelfAttention(h, heads)
        self.ln_2 = nn.LayerNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, layers: int = 4, vocab: int = VOCAB, seq: int = SEQ, h: int = HIDDEN,
                 heads: int = HEADS) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.h = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class SeparateAttention(nn.Module):
    """Attention with separate q, k and v projections (as Llama and most newer code write it)."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class SeparateBlock(Block):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__(h, heads)
        self.attn = SeparateAttention(h, heads)


class SeparateGPT(NanoGPT):
    """NanoGPT's model written another way: separate q/k/v projections and an `nn.Linear` head
    tied to the embedding."""

    def __init__(self, layers: int = 4, vocab: int = VOCAB, seq: int = SEQ, h: int = HIDDEN,
                 heads: int = HEADS) -> None:
        super().__init__(layers, vocab, seq, h, heads)
        self.h = nn.ModuleList(SeparateBlock(h, heads) for _ in range(layers))
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())



def _two_token_inputs(cls, *args, **kwargs):
    """`cls(*args, **kwargs)` built on meta by the MODULE:FACTORY contract, for a model taking
    (token ids, targets) as two separate tensors."""
    with torch.device("meta"):
        model = cls(*args, **kwargs)
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x.clone()), token_batch(VOCAB, SEQ)

def nanogpt(layers: int = 4):
    """(model on meta, example inputs, batch function): the MODULE:FACTORY contract."""
    with torch.device("meta"):
        model = NanoGPT(layers)
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x), token_batch(VOCAB, SEQ)


class GatedLayer(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x))) * gate * keep.unsqueeze(-1)


class GatedLM(nn.Module):
    def __init__(self, layers: int = 4, vocab: int = VOCAB, h: int = HIDDEN) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(GatedLayer(h) for _ in range(layers))
        self.out = nn.Linear(h, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        gate = torch.sigmoid(x.mean(dim=-1, keepdim=True))
        keep = idx != 0
        for layer in self.layers:
            x = layer(x, gate, keep)
        return F.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


def gated_lm(layers: int = 4):
    """`GatedLM` for the MODULE:FACTORY contract."""
    return _two_token_inputs(GatedLM, layers)


def wide_vocab_lm():
    """`GatedLM` of one layer over 8192 classes: logits far larger than anything else, so a
    tensor-parallel plan splits the output layer and its loss over the vocabulary."""
    with torch.device("meta"):
        model = GatedLM(1, vocab=8192)
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x.clone()), token_batch(8192, SEQ)


def wide_nanogpt(layers: int = 4):
    """`NanoGPT` over 4096 tokens: its shared embedding (wte, 128 Ki parameters) outweighs the
    four blocks together (50 Ki), so which stage holds it gathered when decides the peak
    (benchmarks/verify_memory_cases.py's `widenano` cases)."""
    with torch.device("meta"):
        model = NanoGPT(layers, vocab=4096)
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x), token_batch(4096, SEQ)


def separate_gpt(layers: int = 4):
    """`SeparateGPT` by the MODULE:FACTORY contract."""
    with torch.device("meta"):
        model = SeparateGPT(layers)
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x), token_batch(VOCAB, SEQ)


class MixerBlock(Block):
    """`Block` whose attention module is called `mixer` (a name no runtime could guess)."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__(h, heads)
        del self.attn
        self.mixer = SelfAttention(h, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RenamedGPT(NanoGPT):
    """NanoGPT with its blocks in a `ModuleDict` under names (`blocks.first`, ...) and the
    attention module of each called `mixer`: recomputation must find what to checkpoint from
    the ops, not from the names."""

    NAMES = ("first", "second", "third", "fourth")

    def __init__(self) -> None:
        super().__init__(layers=1)
        del self.h
        self.blocks = nn.ModuleDict({n: MixerBlock(HIDDEN, HEADS) for n in self.NAMES})

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks.values():
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def renamed_gpt():
    """`RenamedGPT` by the MODULE:FACTORY contract."""
    with torch.device("meta"):
        model = RenamedGPT()
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x), token_batch(VOCAB, SEQ)


class EagerAttention(SelfAttention):
    """nanoGPT's attention without flash: the core spelled out (scores, scale, causal mask,
    softmax, product with V): selective recomputation re-runs that run of ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (h // self.heads) ** 0.5)
        att = torch.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, s, h))


class EagerBlock(Block):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__(h, heads)
        self.attn = EagerAttention(h, heads)


def eager_gpt(layers: int = 2):
    """NanoGPT with `EagerAttention` by the MODULE:FACTORY contract."""
    with torch.device("meta"):
        model = NanoGPT(layers)
        model.h = nn.ModuleList(EagerBlock(HIDDEN, HEADS) for _ in range(layers))
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x), token_batch(VOCAB, SEQ)


def llama_repeat_kv():
    """The zoo's llama-tiny (4 query heads, 2 key/value heads) on CPU with `RepeatKVAttention`."""
    from autopar.models.registry import ModelBundle, build_model

    b = build_model("llama-tiny", device="cpu")
    for block in b.model.layers:
        block.attn.__class__ = RepeatKVAttention
    return ModelBundle("tests.user_models:llama_repeat_kv", b.model, b.example_inputs, b.batch_fn,
                       "llama-tiny, K and V repeated before SDPA")



class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: rounds in the forward, passes the gradient through unchanged
    in the backward (autograd through `round` would give zero). Saves nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return torch.round(x * 4.0) / 4.0

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g


class SquashSTE(torch.autograd.Function):
    """`tanh` in the forward with a backward of its own choosing (the derivative of x/(1+|x|),
    not tanh's): saves its input, as Hugging Face BLOOM's `GeLUFunction` does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        return g / (1 + x.abs()) ** 2


class STEBlock(Block):
    """`Block` whose MLP's activation is `RoundSTE` then `SquashSTE`: custom autograd Functions,
    whose backward is not the autograd of their forward's ops."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__(h, heads)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        up = SquashSTE.apply(RoundSTE.apply(self.mlp[0](self.ln_2(x))))
        return x + self.mlp[1](up)


def ste_gpt(layers: int = 4):
    """NanoGPT with `STEBlock`s (custom autograd Functions in every MLP) by the MODULE:FACTORY
    contract."""
    with torch.device("meta"):
        model = NanoGPT(layers)
        model.h = nn.ModuleList(STEBlock(HIDDEN, HEADS) for _ in range(layers))
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (x, x), token_batch(VOCAB, SEQ)


class ReusedLM(nn.Module):
    """A layer module called twice, before and after another (weight sharing across depth, as
    ALBERT-style models do): under ZeRO-3 the first layer's run of ops holds the second's."""

    def __init__(self, vocab: int = VOCAB, h: int = HIDDEN) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 2 * h), nn.GELU(),
                                                  nn.Linear(2 * h, h)) for _ in range(3))
        self.out = nn.Linear(h, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i in (0, 1, 0, 2):
            x = x + self.layers[i](x)
        return F.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


def reused_lm():
    """`ReusedLM` by the MODULE:FACTORY contract."""
    return _two_token_inputs(ReusedLM)


class CrossBlock(Block):
    """A decoder block: causal self-attention, then attention over the encoder's output
    (`memory`, read by every decoder block: tensors made in one layer and read by layers that
    do not follow it) through separate key and value projections, then the MLP."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__(h, heads)
        self.ln_x = nn.LayerNorm(h)
        self.q = nn.Linear(h, h)
        self.k = nn.Linear(h, h)
        self.v = nn.Linear(h, h)
        self.o = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x = x + self.attn(self.ln_1(x))
        q, k, v = (t.view(b, s, self.attn.heads, h // self.attn.heads).transpose(1, 2)
                   for t in (self.q(self.ln_x(x)), self.k(memory), self.v(memory)))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(y.transpose(1, 2).contiguous().view(b, s, h))
        return x + self.mlp(self.ln_2(x))


class EncoderDecoderLM(nn.Module):
    """One encoder block and decoder blocks that each attend over its output, as T5 or the
    original Transformer do (written by a user: the head is the embedding's weight,
    `x @ wte.weight.t()`, so the last layer decides that weight's layout)."""

    def __init__(self, decoder_layers: int = 3, vocab: int = VOCAB, seq: int = SEQ, h: int = HIDDEN,
                 heads: int = HEADS) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.encoder = Block(h, heads)
        self.ln_m = nn.LayerNorm(h)
        self.decoder = nn.ModuleList(CrossBlock(h, heads) for _ in range(decoder_layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        memory = self.ln_m(self.encoder(x))
        for block in self.decoder:
            x = block(x, memory)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def encoder_decoder_lm(decoder_layers: int = 3):
    """`EncoderDecoderLM` by the MODULE:FACTORY contract."""
    return _two_token_inputs(EncoderDecoderLM, decoder_layers)


class Seq2SeqLayer(nn.Module):
    """A residual MLP layer."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


class CrossLayer(Seq2SeqLayer):
    """A decoder layer that also reads the encoder's output, as a cross-attention would."""

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return super().forward(x + memory)


class SharedEmbeddingSeq2Seq(nn.Module):
    """An encoder-decoder whose one embedding is read three times, as T5's is: by the encoder
    (the source tokens), by the decoder (the targets shifted right: it starts in the middle of
    the model) and as the head's weight. Planned pp 2 with 2 chunks per rank, the encoder's
    and the decoder's embeddings fall on different ranks and the decoder's embedding and the
    head on one rank's two chunks: that rank holds two copies of the tied weight."""

    def __init__(self, layers: int = 2, vocab: int = VOCAB, h: int = HIDDEN) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, h)
        self.encoder = nn.ModuleList(Seq2SeqLayer(h) for _ in range(layers))
        self.decoder = nn.ModuleList(CrossLayer(h) for _ in range(layers))
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, src: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.shared(src)
        for layer in self.encoder:
            x = layer(x)
        # the decoder's inputs, the targets shifted right, embedded with the same weight
        y = F.embedding(F.pad(targets[:, :-1], (1, 0)), self.shared.weight)
        for layer in self.decoder:
            y = layer(y, x)
        return F.cross_entropy(self.head(y).flatten(0, 1).float(), targets.flatten())


def shared_seq2seq(layers: int = 2):
    """`SharedEmbeddingSeq2Seq` by the MODULE:FACTORY contract."""
    return _two_token_inputs(SharedEmbeddingSeq2Seq, layers)


class _Stack(nn.Module):
    """A T5-style stack: its own name for the shared embedding, layers, a final norm outside
    the layer list."""

    def __init__(self, embed: Optional[nn.Embedding], layers: nn.ModuleList, h: int) -> None:
        super().__init__()
        if embed is not None:
            self.embed_tokens = embed
        self.block = layers
        self.final_norm = nn.LayerNorm(h)


class Scale(nn.Module):
    """x * weight (a learnt per-feature gain)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class AliasedEmbeddingSeq2Seq(nn.Module):
    """An encoder-decoder holding ONE embedding module under three attribute names, as Hugging
    Face T5 does (`shared`, `encoder.embed_tokens`, `decoder.embed_tokens` are one module), each
    stack calling it as a module (from different pipeline chunks) and ending in a final norm
    outside its layer list; the head is tied to the embedding. A second tied weight, the
    gain of `in_scale` and `out_scale` (after the encoder's embedding, before the head), is held by
    other stages than the embedding under pp >= 3. `direct`: the stacks hold no second name for it and
    both call `shared` itself (one module called from two pipeline chunks); `tied_head`: the
    head's weight is the embedding's."""

    def __init__(self, layers: int = 2, vocab: int = VOCAB, h: int = HIDDEN, direct: bool = False,
                 tied_head: bool = True) -> None:
        super().__init__()
        self.direct = direct
        self.shared = nn.Embedding(vocab, h)
        embed = None if direct else self.shared
        self.encoder = _Stack(embed, nn.ModuleList(Seq2SeqLayer(h) for _ in range(layers)), h)
        self.decoder = _Stack(embed, nn.ModuleList(CrossLayer(h) for _ in range(layers)), h)
        self.in_scale = Scale(h)
        self.out_scale = Scale(h)
        self.out_scale.weight = self.in_scale.weight
        self.head = nn.Linear(h, vocab, bias=False)
        if tied_head:
            self.head.weight = self.shared.weight

    def forward(self, src: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = (self.shared if self.direct else self.encoder.embed_tokens)(src)
        x = self.in_scale(x)
        for layer in self.encoder.block:
            x = layer(x)
        x = self.encoder.final_norm(x)
        y = (self.shared if self.direct else self.decoder.embed_tokens)(F.pad(targets[:, :-1], (1, 0)))
        for layer in self.decoder.block:
            y = layer(y, x)
        y = self.out_scale(self.decoder.final_norm(y))
        return F.cross_entropy(self.head(y).flatten(0, 1).float(), targets.flatten())


def aliased_seq2seq(layers: int = 2, direct: bool = False, tied_head: bool = True):
    """`AliasedEmbeddingSeq2Seq` by the MODULE:FACTORY contract."""
    return _two_token_inputs(AliasedEmbeddingSeq2Seq, layers, direct=direct, tied_head=tied_head)


def direct_seq2seq(layers: int = 2):
    """`AliasedEmbeddingSeq2Seq` whose stacks both call `shared` itself."""
    return aliased_seq2seq(layers, direct=True)


def untied_seq2seq(layers: int = 2):
    """`direct_seq2seq` with a head of its own: the embedding is tied only by being called twice."""
    return aliased_seq2seq(layers, direct=True, tied_head=False)


class TopGainLM(nn.Module):
    """Parameters read only in the model's own forward, held by no submodule: `gain`, read after
    the embedding and again before the head (by the first and the last pipeline stage: a weight
    two stages share), and `log_scale`, read by the head's logits only (by the last stage). Both
    enter as `1 + gain` and `exp(log_scale)` (as Gemma's norms and CLIP's logit scale do), so
    the zero autopar initialises a vector or scalar with is the identity."""

    def __init__(self, layers: int = 4, vocab: int = VOCAB, h: int = HIDDEN) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.gain = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(Seq2SeqLayer(h) for _ in range(layers))
        self.out = nn.Linear(h, vocab)
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) * (1 + self.gain)
        for layer in self.layers:
            x = layer(x)
        logits = self.out(x * (1 + self.gain)) * self.log_scale.exp()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def top_gain_lm(layers: int = 4):
    """`TopGainLM` by the MODULE:FACTORY contract."""
    return _two_token_inputs(TopGainLM, layers)
