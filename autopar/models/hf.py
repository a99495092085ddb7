"""Hugging Face models (optional extra: `pip install autopar[hf]`), built from transformers' config
classes: no download, no weights, on the meta device by default.

A reference is `hf:NAME` or `hf:NAME?key=value&key=value`, where NAME is a family (`gpt2`, `llama`,
`bert`, `opt`, `t5`, `mixtral`, `qwen2_moe`, `qwen3_moe`) or a known checkpoint name (`gpt2-medium`,
`meta-llama/Llama-2-7b-hf`, `bert-base-uncased`, `facebook/opt-1.3b`, `t5-base`,
`mistralai/Mixtral-8x7B-v0.1`, `Qwen/Qwen1.5-MoE-A2.7B`, `Qwen/Qwen3-30B-A3B`, ...: their config
values are written down here), and the query overrides config fields (`hidden_size=256`,
`num_hidden_layers=2`; the generic names work for every family) or the input shape
(`seq_len=128`, and for T5 `decoder_seq_len=64`).

The bundle's model is the transformers class itself (same module tree and FQNs, e.g.
`transformer.h.0`, `model.layers.0`), subclassed only so that `forward(input_ids, labels)` takes
positional token ids and returns the scalar loss, like the zoo models. A causal LM's labels are
next-token targets (shifted in the batch, not in the model) and its tokens' positions are
passed as `position_ids` from `models.positions.token_positions`: context parallelism splits
the sequence into chunks per rank, and each rank's targets and positions are then its own. `batch_fn(step, global
batch, seed)` draws deterministic random token batches. Any `PreTrainedModel` may also be given
to `autopar.capture.capture` directly; its `.loss` is the loss when labels are passed.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import parse_qsl

import torch
import torch.nn as nn

from autopar.models.registry import ModelBundle, _gen
from autopar.schema.errors import PlanError

IGNORE = -100

# family -> (config class, model class, default preset)
_FAMILIES: dict[str, tuple[str, str, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "gpt2"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama-2-7b"),
    "bert": ("BertConfig", "BertForMaskedLM", "bert-base-uncased"),
    "opt": ("OPTConfig", "OPTForCausalLM", "opt-125m"),
    "t5": ("T5Config", "T5ForConditionalGeneration", "t5-small"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral-8x7b"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen1.5-moe-a2.7b"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3-30b-a3b"),
}

_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)
# preset -> (family, config values, default sequence length). Values from the public config.json
# of each checkpoint.
PRESETS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12), 1024),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16), 1024),
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20), 1024),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25), 1024),
    "llama-2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, **_LLAMA2), 4096),
    "llama-2-13b": ("llama", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                  num_attention_heads=40, num_key_value_heads=40, **_LLAMA2), 4096),
    "llama-2-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, **_LLAMA2), 4096),
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, **_LLAMA3), 8192),
    "llama-3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, **_LLAMA3), 8192),
    "bert-base-uncased": ("bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                       intermediate_size=3072, vocab_size=30522), 512),
    "bert-large-uncased": ("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                        intermediate_size=4096, vocab_size=30522), 512),
    "opt-125m": ("opt", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072), 2048),
    "opt-1.3b": ("opt", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192), 2048),
    "opt-6.7b": ("opt", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384), 2048),
    "opt-13b": ("opt", dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480), 2048),
    "opt-30b": ("opt", dict(hidden_size=7168, num_hidden_layers=48, num_attention_heads=56, ffn_dim=28672), 2048),
    "opt-66b": ("opt", dict(hidden_size=9216, num_hidden_layers=64, num_attention_heads=72, ffn_dim=36864), 2048),
    "t5-small": ("t5", dict(d_model=512, d_ff=2048, d_kv=64, num_heads=8, num_layers=6,
                            num_decoder_layers=6, vocab_size=32128), 512),
    "t5-base": ("t5", dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12,
                           num_decoder_layers=12, vocab_size=32128), 512),
    "t5-large": ("t5", dict(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24,
                            num_decoder_layers=24, vocab_size=32128), 512),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000,
                                     max_position_embeddings=32768, rope_theta=1e6), 4096),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 routed experts top-4 (weights not renormalised) and one shared
    # expert behind a sigmoid gate in every layer
    "qwen1.5-moe-a2.7b": ("qwen2_moe", dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                                            shared_expert_intermediate_size=5632, num_hidden_layers=24,
                                            num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                                            num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
                                            vocab_size=151936, max_position_embeddings=8192, rope_theta=1e6,
                                            rms_norm_eps=1e-6, tie_word_embeddings=False), 8192),
    # Qwen/Qwen3-30B-A3B: 128 routed experts top-8 (weights renormalised), no shared expert, GQA
    # 32/4 heads of 128 (q/k RMSNorm), every layer sparse
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=40960,
                                        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False), 4096),
    # Qwen/Qwen3-235B-A22B: the same layer at hidden 4096, 94 layers, 64/4 heads, experts of 1536
    "qwen3-235b-a22b": ("qwen3_moe", dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                          num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                                          head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                          decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=40960,
                                          rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False), 4096),
}
_ALIASES = {"gpt2-small": "gpt2", "llama2-7b": "llama-2-7b", "llama-2-7b-hf": "llama-2-7b",
            "llama-2-13b-hf": "llama-2-13b", "llama-2-70b-hf": "llama-2-70b",
            "meta-llama-3-8b": "llama-3-8b", "meta-llama-3-70b": "llama-3-70b", "llama3-8b": "llama-3-8b",
            "bert-base": "bert-base-uncased", "bert-base-cased": "bert-base-uncased",
            "bert-large": "bert-large-uncased", "mixtral-8x7b-v0.1": "mixtral-8x7b",
            "qwen-moe": "qwen1.5-moe-a2.7b", "qwen2-moe": "qwen1.5-moe-a2.7b",
            "qwen3-moe": "qwen3-30b-a3b",
            "google-t5/t5-small": "t5-small"}

# generic override names -> the family's own field, where the config class lacks an alias
_GENERIC = {"t5": {"num_hidden_layers": "num_layers", "hidden_size": "d_model",
                   "num_attention_heads": "num_heads", "intermediate_size": "d_ff"},
            "gpt2": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head", "max_position_embeddings": "n_positions",
                     "intermediate_size": "n_inner"},
            "opt": {"intermediate_size": "ffn_dim"},
            "bert": {}, "llama": {}, "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise PlanError("hf: models need Hugging Face transformers: pip install autopar[hf]") from None
    return transformers


def families() -> list[str]:
    return list(_FAMILIES)


def _parse(value: str) -> Any:
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return value


def parse_ref(ref: str) -> tuple[str, dict[str, Any]]:
    """"llama?hidden_size=256&num_hidden_layers=2" -> ("llama", {"hidden_size": 256, ...})."""
    name, _, query = ref.strip().partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise PlanError(f"cannot parse the overrides {query!r} of hf:{ref}; write "
                        f"hf:NAME?key=value&key=value") from None
    return name.strip(), {k: _parse(v) for k, v in pairs}


def resolve(name: str) -> tuple[str, dict[str, Any], int]:
    """A family or checkpoint name -> (family, preset config values, default sequence length)."""
    key = name.lower().rsplit("/", 1)[-1]
    key = _ALIASES.get(key, key)
    if key in _FAMILIES:
        key = _FAMILIES[key][2]
    if key in PRESETS:
        return PRESETS[key]
    for fam in _FAMILIES:          # e.g. "opt-2.7b": a family we know, a size we do not
        if key.startswith(fam):
            raise PlanError(f"hf:{name}: no built-in config for that size (autopar never downloads "
                            f"configs); use hf:{fam}?hidden_size=...&num_hidden_layers=... or one of "
                            f"{', '.join(k for k, v in PRESETS.items() if v[0] == fam)}")
    raise PlanError(f"unknown Hugging Face model {name!r}: families are {', '.join(_FAMILIES)}; "
                    f"known checkpoints: {', '.join(PRESETS)} (sizes via hf:NAME?hidden_size=...)")


def make_config(name: str, **overrides: Any) -> tuple[str, Any, int, int]:
    """(family, transformers config, encoder seq len, decoder seq len) for `name` + overrides."""
    tf = _transformers()
    family, values, seq = resolve(name)
    overrides = dict(overrides)
    seq = int(overrides.pop("seq_len", seq))
    dec_seq = int(overrides.pop("decoder_seq_len", seq))
    values = dict(values)
    given = {_GENERIC[family].get(k, k) for k in overrides}     # the family's own field names
    for k, v in overrides.items():
        values[_GENERIC[family].get(k, k)] = v
    if family == "t5":
        if "num_layers" in given and "num_decoder_layers" not in given:
            values["num_decoder_layers"] = values["num_layers"]
        if "d_kv" not in given and {"d_model", "num_heads"} & given:
            values["d_kv"] = values["d_model"] // values["num_heads"]
        values.setdefault("decoder_start_token_id", 0)
        values.setdefault("pad_token_id", 0)
        values.setdefault("eos_token_id", 1)
    else:   # room for the sequence in the position table
        pos_key = "n_positions" if family == "gpt2" else "max_position_embeddings"
        if pos_key not in given and values.get(pos_key, 0) < seq:
            values[pos_key] = max(seq, 2)
    values.update(use_cache=False)
    _check_heads(name, family, values, given)
    cfg_cls = getattr(tf, _FAMILIES[family][0])
    defaults = cfg_cls()
    vocab = int(values.get("vocab_size", getattr(defaults, "vocab_size", 0) or 0))
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        v = values.get(tok, getattr(defaults, tok, None))
        if isinstance(v, int) and vocab and v >= vocab:   # a small test vocabulary
            values[tok] = vocab - 1
    try:
        cfg = cfg_cls(**values)
    except (TypeError, ValueError) as e:
        raise PlanError(f"hf:{name}: invalid config {values}: {e}") from None
    return family, cfg, seq, dec_seq


def _check_heads(name: str, family: str, values: dict[str, Any], given: set[str]) -> None:
    """Attention heads that make a model, before transformers builds it (its own error comes
    late, as a shape mismatch inside attention): with the query heads overridden and not the
    KV heads, a multi-head preset (KV heads = heads) keeps KV heads = heads; the KV heads must
    divide the heads (grouped-query attention), the heads the hidden size."""
    hkey = _GENERIC[family].get("num_attention_heads", "num_attention_heads")
    dkey = _GENERIC[family].get("hidden_size", "hidden_size")
    heads, hidden = values.get(hkey), values.get(dkey)
    kv = values.get("num_key_value_heads")
    if hkey in given and "num_key_value_heads" not in given and kv is not None and isinstance(heads, int):
        preset_heads = resolve(name.split("?")[0])[1].get(hkey)
        if kv == preset_heads:
            values["num_key_value_heads"] = kv = heads
    if isinstance(heads, int) and isinstance(kv, int) and (kv < 1 or heads % kv):
        raise PlanError(f"hf:{name}: num_key_value_heads={kv} does not divide {hkey}={heads}; set "
                        f"num_key_value_heads to a divisor of {heads} (e.g. ?num_key_value_heads={heads})")
    head_dim_set = values.get("head_dim") is not None or family == "t5"
    if isinstance(heads, int) and isinstance(hidden, int) and not head_dim_set and (heads < 1 or hidden % heads):
        raise PlanError(f"hf:{name}: {dkey}={hidden} is not a multiple of {hkey}={heads}; choose heads that divide "
                        f"the hidden size")


# the causal LM classes (`_FAMILIES`): next-token targets, positions they take as position_ids
_CAUSAL_LM = ("ForCausalLM", "LMHeadModel")


@functools.lru_cache(maxsize=None)
def _positional_class(base: type) -> type:
    """`base` (a transformers model class) with forward(input_ids, labels) -> scalar loss."""

    if not base.__name__.endswith(_CAUSAL_LM):
        def forward(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return base.forward(self, input_ids=input_ids, labels=labels, use_cache=False,
                                return_dict=True).loss
    else:
        def forward(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # `labels`: each token's next token (`HFBatch`), given as `shift_labels` so that the
            # loss shifts nothing; the tokens' positions from `token_positions` (a context-
            # parallel rank's chunks: where they are in the whole sequence), with no packed
            # sequences read off their jumps (`eager_attention_masks`)
            from autopar.models.positions import token_positions

            pos = token_positions(input_ids.shape[1], input_ids.device).unsqueeze(0)
            with eager_attention_masks():
                return base.forward(self, input_ids=input_ids, position_ids=pos, labels=labels,
                                    shift_labels=labels, use_cache=False, return_dict=True).loss

    # named after the base class, importable (so picklable) as autopar.models.hf.Positional_<Base>
    return type(base.__name__, (base,), {"forward": forward, "__module__": __name__,
                                         "__qualname__": f"Positional_{base.__name__}",
                                         "__doc__": base.__doc__, "_autopar_positional": True})


def __getattr__(name: str) -> Any:
    """Positional_<transformers class>, made on first use (for unpickling in a fresh process)."""
    if name.startswith("Positional_"):
        base = getattr(_transformers(), name[len("Positional_"):], None)
        if isinstance(base, type):
            return _positional_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_for_capture(model: nn.Module) -> None:
    """Export-friendly settings on a transformers model: no KV cache; mixture-of-experts blocks
    use the grouped-GEMM experts implementation (tokens sorted by expert, one grouped matmul; no
    data-dependent shapes, and FLOPs counted for the routed tokens only) instead of the eager one,
    which loops over the experts that received tokens."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None:
            continue
        if getattr(cfg, "use_cache", False):
            try:
                cfg.use_cache = False
            except Exception:  # noqa: BLE001
                pass
        if hasattr(cfg, "_experts_implementation") and cfg._experts_implementation in (None, "eager"):
            try:
                cfg._experts_implementation = "grouped_mm"
            except Exception:  # noqa: BLE001
                try:
                    cfg._experts_implementation = "batched_mm"
                except Exception:  # noqa: BLE001
                    pass


@contextlib.contextmanager
def eager_attention_masks() -> Iterator[None]:
    """Within it, transformers builds attention masks under torch.export as it does in eager mode.

    Exporting, transformers always materialises the causal mask (`masking_utils` refuses to drop
    it while `is_torchdynamo_exporting()`, because an exported model could later be fed padded
    batches). In eager mode, with no padding mask, it passes none and SDPA runs `is_causal=True`,
    grouped-query attention without repeating keys and values (`use_gqa_in_sdpa`). autopar's
    batches carry no padding, so the eager program is the one to capture: the one a data-parallel
    run executes, and the cheaper one for the op-by-op executor (no mask tensor, no repeated
    keys and values). A no-op when transformers is not loaded or its masking module lacks these
    functions (another version: the mask is then captured as transformers exports it)."""
    import sys

    mu = sys.modules.get("transformers.masking_utils")
    # what masking_utils asks: exporting (keep the mask), packed sequences (a tensor under
    # tracing, which cannot look at the position ids' values: autopar's are not packed)
    patches = {"is_torchdynamo_exporting": lambda: False, "find_packed_sequence_indices": lambda position_ids: None}
    if mu is None or not all(hasattr(mu, k) for k in patches):
        yield
        return
    saved = {k: getattr(mu, k) for k in patches}
    for k, f in patches.items():
        setattr(mu, k, f)
    try:
        yield
    finally:
        for k, f in saved.items():
            setattr(mu, k, f)


def build_hf(name: str, *, batch_size: int = 1, device: str | torch.device = "meta",
             **overrides: Any) -> ModelBundle:
    """A transformers model from its config class (no download), with example inputs and a batch
    function. `name` may carry `?key=value&...` overrides; keyword overrides win over them."""
    tf = _transformers()
    base_name, query = parse_ref(name)
    query.update(overrides)
    family, cfg, seq, dec_seq = make_config(base_name, **query)
    base_cls = getattr(tf, _FAMILIES[family][1])
    cls = _positional_class(base_cls)
    attn = "eager" if family == "t5" else "sdpa"
    try:
        cfg._attn_implementation = attn
    except Exception:  # noqa: BLE001
        pass
    from autopar.models.empty import buffers_to_meta, empty_weights

    on_meta = torch.device(device).type == "meta"
    # on meta: weights empty, buffers (rotary inv_freq, position ids) computed and remembered, so
    # the runtime restores their values when it materialises the model
    with empty_weights() if on_meta else torch.device(device):
        try:
            model = cls(cfg)
        except Exception as e:  # noqa: BLE001
            raise PlanError(f"hf:{name}: cannot build {base_cls.__name__} from its config: "
                            f"{type(e).__name__}: {e}") from None
    if on_meta:
        buffers_to_meta(model)
    prepare_for_capture(model)
    if family == "gpt2" and getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"    # GPT2LMHeadModel's name does not say which loss
    model.train()
    vocab = int(cfg.vocab_size)
    dec = dec_seq if family == "t5" else seq
    inputs = (torch.zeros(batch_size, seq, dtype=torch.long, device=device),
              torch.zeros(batch_size, dec, dtype=torch.long, device=device))
    batch_fn = _batch_fn(family, vocab, seq, dec)
    desc = (f"Hugging Face {base_cls.__name__} ({base_name}"
            + (f", {', '.join(f'{k}={v}' for k, v in query.items())}" if query else "") + ")")
    ref = "hf:" + name
    return ModelBundle(ref, model, inputs, batch_fn, desc,
                       extra={"family": family, "config": cfg, "seq_len": seq, "decoder_seq_len": dec})


@dataclass(frozen=True)
class HFBatch:
    """Deterministic random token batches by (step, seed): causal LMs get labels = each token's
    next token (shifted here, not in the model, so that a context-parallel rank's chunks carry
    their own targets), BERT 15% masked positions, T5 random targets. A picklable callable."""

    family: str
    vocab: int
    seq: int
    dec_seq: int

    def __call__(self, step: int, global_batch_size: int, seed: int = 0) -> tuple:
        g = _gen(step, seed)
        ids = torch.randint(0, self.vocab, (global_batch_size, self.seq), generator=g)
        if self.family == "bert":
            mask = torch.rand(global_batch_size, self.seq, generator=g) < 0.15
            mask[:, 0] = True
            labels = torch.where(mask, ids, torch.full_like(ids, IGNORE))
            ids = torch.where(mask, torch.full_like(ids, min(103, self.vocab - 1)), ids)
            return ids, labels
        if self.family == "t5":
            return ids, torch.randint(0, self.vocab, (global_batch_size, self.dec_seq), generator=g)
        # each token's next one, the last without (the model shifts nothing: `_positional_class`)
        return ids, torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)


def _batch_fn(family: str, vocab: int, seq: int, dec_seq: int) -> HFBatch:
    return HFBatch(family, vocab, seq, dec_seq)


def num_params(model: nn.Module) -> int:
    """Parameters counted once (tied ones once)."""
    return sum(p.numel() for p in model.parameters())


def is_hf_model(model: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)

