"""Hugging Face models that are not causal LMs, built from tiny configs and wrapped as a user
would (the loss read off the model's output, FQNs under `m.`): BERT for masked LM
(bidirectional attention, tied decoder), T5 for conditional generation (encoder-decoder:
cross-attention, relative position bias, the decoder's inputs shifted from the labels inside
the model) and ViT for image classification (a convolution patch embedding, a class token, a
pooled head). Each is a MODULE:FACTORY reference, `tests.hf_other_tasks:<name>`;
`benchmarks/layout_matrix.py --other-tasks` runs every layout of each. Dropout is off, so that
losses compare with one process."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

VOCAB, SEQ, IMAGE, CLASSES = 128, 16, 16, 10
NAMES = ("bert", "t5", "vit")


class HFTaskModel(nn.Module):
    """A Hugging Face model called with the keywords its task takes, its loss returned."""

    def __init__(self, model: nn.Module, inputs: str) -> None:
        super().__init__()
        self.m, self.inputs = model, inputs

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        extra: dict[str, Any] = {"use_cache": False} if self.m.config.is_encoder_decoder else {}
        return self.m(**{self.inputs: x}, labels=labels, **extra).loss


def _tokens(step: int, global_batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return (torch.randint(0, VOCAB, (global_batch_size, SEQ), generator=g),
            torch.randint(0, VOCAB, (global_batch_size, SEQ), generator=g))


def _images(step: int, global_batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return (torch.randn(global_batch_size, 3, IMAGE, IMAGE, generator=g),
            torch.randint(0, CLASSES, (global_batch_size,), generator=g))


def build(name: str) -> tuple[nn.Module, tuple, Callable]:
    """(model on meta, example inputs, batch function) of `name`."""
    import transformers

    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        make, inputs, batch = transformers.BertForMaskedLM, "input_ids", _tokens
    elif name == "t5":
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                    num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                    pad_token_id=0)
        make, inputs, batch = transformers.T5ForConditionalGeneration, "input_ids", _tokens
    elif name == "vit":
        cfg = transformers.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=64,
                                     num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES)
        make, inputs, batch = transformers.ViTForImageClassification, "pixel_values", _images
    else:
        raise AttributeError(name)
    with torch.device("meta"):
        model = HFTaskModel(make(cfg), inputs)
    if name == "vit":
        example = (torch.zeros(1, 3, IMAGE, IMAGE, device="meta"), torch.zeros(1, dtype=torch.long, device="meta"))
    else:
        x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
        example = (x, x.clone())
    return model, example, batch


def __getattr__(name: str) -> Callable:
    """`tests.hf_other_tasks:<name>`: the factory of that model."""
    if name in NAMES:
        return lambda: build(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
