"""A plain MLP regression model: forward(x, y) returns the MSE loss."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int = 1024, hidden: int = 4096, layers: int = 4, bias: bool = False) -> None:
        super().__init__()
        dims = [dim] + [hidden] * (layers - 1) + [dim]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.mse_loss(x, y)
