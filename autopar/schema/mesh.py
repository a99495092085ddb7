"""A logical device mesh for the intra-op ILP (Alpa §4): its shape and per-axis alpha-beta costs."""

from __future__ import annotations

import math
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autopar.schema.cluster import DeviceSpec, LinkSpec


class LogicalMesh(BaseModel):
    """`shape[i]` devices along axis i; a collective on axis i costs alpha[i] + bytes * beta[i] per
    step of its algorithm. Without `device`, compute is free and heavy ops must split their work
    along every axis of size > 1 (Alpa's convention); with it, compute is costed."""

    model_config = ConfigDict(extra="forbid")

    shape: tuple[int, ...] = Field(min_length=1)
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    device: Optional[DeviceSpec] = None
    # per axis, the link class its collectives run on where that class carries measured timings
    # (`LinkSpec.measured`, `cost_models.communication.measured_time`), else None: alpha-beta
    links: Optional[tuple[Optional[LinkSpec], ...]] = None

    @model_validator(mode="after")
    def _check(self) -> "LogicalMesh":
        if any(s < 1 for s in self.shape):
            raise ValueError(f"shape: every axis must be >= 1, got {self.shape}")
        if len(self.alpha) != len(self.shape) or len(self.beta) != len(self.shape):
            raise ValueError(f"alpha and beta need one value per mesh axis ({len(self.shape)}), "
                             f"got {len(self.alpha)} and {len(self.beta)}")
        if self.links is not None and len(self.links) != len(self.shape):
            raise ValueError(f"links need one entry per mesh axis ({len(self.shape)}), got {len(self.links)}")
        if any(a < 0 for a in self.alpha) or any(b < 0 for b in self.beta):
            raise ValueError("alpha and beta must be >= 0")
        return self

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)
