"""Weight initialisation shared by the zoo models: the runtime's deterministic rule
(autopar.runtime.materialize) in eager form, so a model built directly on a real device starts
like a materialised one: normal(0, 0.02) for matrices and embeddings, zeros for biases, ones for
normalisation weights. On the meta device it costs nothing."""

from __future__ import annotations

import torch.nn as nn


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if p.is_meta:
                continue
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, std)
            elif name == "weight" and ("norm" in type(mod).__name__.lower() or isinstance(mod, nn.LayerNorm)):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)
