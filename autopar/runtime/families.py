"""Model families: how a zoo model's layers chain and where its loss comes from, for pipeline
stages cut by module (`StageCore`). A model with no family is cut from its trace
(`graph_stages`) or, with tensor parallelism, from its exported program (`intra_op.pipeline_chunks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from autopar.runtime.vocab_loss import VocabParallelLoss
from autopar.schema.errors import PlanError


@dataclass
class Family:
    """How a model decomposes into layers for pipelining: `between(fqn, x)` is applied after a
    layer (e.g. an activation), `loss(output, *targets)` ends the last stage."""

    loss: Callable[..., torch.Tensor]
    between: Callable[[str, torch.Tensor, bool], torch.Tensor] = lambda fqn, x, last: x
    num_inputs: int = 1


def family_of(model: nn.Module) -> Family:
    from autopar.models.gpt import GPT
    from autopar.models.mlp import MLP

    if isinstance(model, GPT):
        return Family(loss=lambda logits, tgt: F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten()))
    if isinstance(model, MLP):
        return Family(loss=lambda out, y: F.mse_loss(out, y),
                      between=lambda fqn, x, last: x if last else F.relu(x))
    fn = getattr(model, "pipeline_loss", None)
    if callable(fn):
        return Family(loss=fn)
    raise PlanError(f"cannot cut {type(model).__name__} into pipeline stages: autopar knows the layer "
                    f"chaining and loss of the zoo GPT and MLP; give the model a "
                    f"`pipeline_loss(output, *targets)` method, or plan it without pipelining (pp=1)")


def stage_loss(family: Family, out: Any, *targets: Any) -> torch.Tensor:
    """The family's loss on a last pipeline stage's output, as a plain tensor. Logits a
    vocabulary-parallel head left sharded over the classes (a DTensor) are read in place: a
    cross-entropy on them runs vocabulary-parallel (`vocab_loss`), with no all-gather."""
    if not isinstance(out, DTensor):
        return _compact(family.loss(out, *targets))
    try:
        with VocabParallelLoss():
            loss = family.loss(out, *targets)
    except Exception as e:  # noqa: BLE001 - a user's loss that cannot take a DTensor
        raise PlanError(f"the model's pipeline loss failed on vocabulary-sharded logits (a DTensor "
                        f"{tuple(out.shape)}, {out.placements}): {type(e).__name__}: {e}; make it "
                        f"work on DTensors, or plan the output layer replicated") from e
    return _compact(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def _compact(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, or a copy of it where its storage is larger than its value: torch.pipelining keeps
    every micro-batch's loss until the step ends, and some losses are a scalar view of their
    elementwise buffer (CPU's mse_loss: 8 KiB behind a 4-byte loss, torch 2.13)."""
    if isinstance(loss, torch.Tensor) and loss.untyped_storage().nbytes() > loss.numel() * loss.element_size():
        return loss.clone()
    return loss


def get_submodule(root: nn.Module, fqn: str) -> nn.Module:
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        raise PlanError(f"the plan names layer {fqn!r}, which the model does not have") from None


class StageCore(nn.Module):
    """The layers of one pipeline chunk, kept at their original FQNs (so parameter names, plan
    placements and checkpoint keys match the full model), run in order."""

    def __init__(self, root: nn.Module, layers: Sequence[str], family: Family, is_last: bool) -> None:
        super().__init__()
        self.order = list(layers)
        self.family = family
        self.is_last = is_last
        self._mods: list[nn.Module] = []
        for fqn in self.order:
            mod = get_submodule(root, fqn)
            parent: nn.Module = self
            parts = fqn.split(".")
            for part in parts[:-1]:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(parts[-1], mod)
            self._mods.append(mod)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.order)
        for i, (fqn, mod) in enumerate(zip(self.order, self._mods)):
            x = mod(x)
            x = self.family.between(fqn, x, self.is_last and i == n - 1)
        return x
