"""Model factories used by tests/test_models.py as `MODULE:FACTORY` references (no tests here).

pytest puts tests/ on sys.path, so these resolve as `test_models_factory:two`, etc."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return F.mse_loss(x, y)


def _inputs(b: int = 4) -> tuple:
    return torch.zeros(b, 8), torch.zeros(b, 8)


def two():
    return Tiny(), _inputs()


def three():
    def batch_fn(step: int, global_batch_size: int, seed: int = 0) -> tuple:
        g = torch.Generator().manual_seed(step * 7 + seed)
        return torch.randn(global_batch_size, 8, generator=g), torch.randn(global_batch_size, 8, generator=g)
    return Tiny(), _inputs(), batch_fn


def wrong_type():
    return "not a model"


def wrong_arity():
    return (Tiny(),)


not_callable = 42
