"""The built-in model zoo as data: name, family, configuration and description of every model,
importing no torch (`autopar models` reads it; `registry` builds the models from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from autopar.models.configs import BertConfig, GPTConfig, LlamaConfig, MLPConfig, MoEConfig

Config = Union[GPTConfig, LlamaConfig, BertConfig, MLPConfig, MoEConfig]

__all__ = ["CatalogueEntry", "catalogue"]


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    family: str          # gpt | llama | bert | mlp | moe: the class `registry` builds it with
    config: Config
    description: str

    @property
    def params(self) -> int:
        return self.config.num_params()


_GPT2 = dict(vocab_size=50257, seq_len=1024)
_GPT3 = dict(vocab_size=51200, seq_len=2048)

_ENTRIES: list[CatalogueEntry] = [
    *(CatalogueEntry(n, "gpt", GPTConfig(hidden=h, layers=l, heads=a, **_GPT2), d) for n, h, l, a, d in [
        ("gpt2", 768, 12, 12, "GPT-2 small (124M)"), ("gpt2-medium", 1024, 24, 16, "GPT-2 medium (355M)"),
        ("gpt2-large", 1280, 36, 20, "GPT-2 large (774M)"), ("gpt2-xl", 1600, 48, 25, "GPT-2 XL (1.5B)")]),
    *(CatalogueEntry(f"gpt3-{n}", "gpt", GPTConfig(hidden=h, layers=l, heads=a, **_GPT3),
                     f"GPT-3 {n.upper()} (Brown et al. 2020, s=2048, V=51200)")
      for n, h, l, a in [("350m", 1024, 24, 16), ("1.3b", 2048, 24, 16), ("2.7b", 2560, 32, 32),
                         ("6.7b", 4096, 32, 32), ("13b", 5120, 40, 40), ("175b", 12288, 96, 96)]),
    CatalogueEntry("gpt-tiny", "gpt", GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4),
                   "tiny GPT for tests and local runs"),
    CatalogueEntry("gpt-small", "gpt", GPTConfig(vocab_size=1024, seq_len=64, hidden=128, layers=4, heads=4),
                   "small GPT for CPU runs"),
    CatalogueEntry("mlp", "mlp", MLPConfig(1024, 4096, 4), "MLP 1024->4096x3->1024, MSE loss"),
    CatalogueEntry("mlp-tiny", "mlp", MLPConfig(32, 64, 3), "MLP 32->64x2->32, MSE loss"),
    CatalogueEntry("llama2-7b", "llama", LlamaConfig(hidden=4096, layers=32, heads=32, kv_heads=32, ffn_hidden=11008),
                   "Llama 2 7B (s=4096, V=32000, MHA)"),
    CatalogueEntry("llama2-13b", "llama", LlamaConfig(hidden=5120, layers=40, heads=40, kv_heads=40, ffn_hidden=13824),
                   "Llama 2 13B (s=4096, V=32000, MHA)"),
    CatalogueEntry("llama2-70b", "llama", LlamaConfig(hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672),
                   "Llama 2 70B (s=4096, V=32000, GQA 8 KV heads)"),
    CatalogueEntry("llama3-8b", "llama", LlamaConfig(vocab_size=128256, seq_len=8192, hidden=4096, layers=32,
                                                     heads=32, kv_heads=8, ffn_hidden=14336, rope_theta=500000.0),
                   "Llama 3 8B (s=8192, V=128256, GQA 8 KV heads)"),
    CatalogueEntry("llama3-70b", "llama", LlamaConfig(vocab_size=128256, seq_len=8192, hidden=8192, layers=80,
                                                      heads=64, kv_heads=8, ffn_hidden=28672, rope_theta=500000.0),
                   "Llama 3 70B (s=8192, V=128256, GQA 8 KV heads)"),
    CatalogueEntry("llama-tiny", "llama", LlamaConfig(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4,
                                                      kv_heads=2, ffn_hidden=64),
                   "tiny Llama (GQA) for tests and local runs"),
    CatalogueEntry("llama-small", "llama", LlamaConfig(vocab_size=1024, seq_len=64, hidden=128, layers=4, heads=4,
                                                       kv_heads=2, ffn_hidden=352),
                   "small Llama (GQA) for CPU runs"),
    CatalogueEntry("deepseek-moe-16b", "moe", MoEConfig(vocab_size=102400, seq_len=4096),
                   "DeepSeekMoE 16B (Dai et al. 2024: 64 routed experts top-6 + 2 shared, s=4096, V=102400)"),
    CatalogueEntry("moe-tiny", "moe", MoEConfig(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4, kv_heads=2,
                                                num_experts=8, top_k=2, expert_hidden=16, shared_experts=1,
                                                dense_layers=0, aux_loss_coef=0.01),
                   "tiny DeepSeek-style MoE (8 experts top-2 + 1 shared) for tests and local runs"),
    CatalogueEntry("moe-small", "moe", MoEConfig(vocab_size=1024, seq_len=64, hidden=128, layers=4, heads=4,
                                                 kv_heads=2, num_experts=16, top_k=4, expert_hidden=64,
                                                 shared_experts=1, dense_layers=1, dense_hidden=352,
                                                 aux_loss_coef=0.01),
                   "small DeepSeek-style MoE (16 experts top-4 + 1 shared) for CPU runs"),
    CatalogueEntry("bert-base", "bert", BertConfig(), "BERT base (110M, s=512, MLM loss)"),
    CatalogueEntry("bert-large", "bert", BertConfig(hidden=1024, layers=24, heads=16, ffn_hidden=4096),
                   "BERT large (340M, s=512, MLM loss)"),
    CatalogueEntry("bert-tiny", "bert", BertConfig(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4,
                                                   ffn_hidden=64, mask_token=3), "tiny BERT for tests and local runs"),
    CatalogueEntry("bert-small", "bert", BertConfig(vocab_size=1024, seq_len=64, hidden=128, layers=4, heads=4,
                                                    ffn_hidden=512), "small BERT for CPU runs"),
]


def catalogue(family: str | None = None) -> dict[str, CatalogueEntry]:
    """The zoo's entries by name (of one `family` when given), in listing order."""
    return {e.name: e for e in _ENTRIES if family is None or e.family == family}
