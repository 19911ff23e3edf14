"""Fixtures for the objective tests: a tiny two-stage CNN backbone with a ``stages()`` method."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn


class TinyBackbone(nn.Sequential):
    """Two conv–BN–ReLU stages (``3 → 4`` channels at 8×8, ``4 → d`` at 4×4) then global average pooling."""

    def __init__(self, feature_dim: int = 16) -> None:
        d = feature_dim
        super().__init__(
            nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
            nn.Sequential(nn.Conv2d(4, d, 3, stride=2, padding=1), nn.BatchNorm2d(d), nn.ReLU()),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )

    def stages(self) -> list[nn.Module]:
        return [self[0], self[1]]


@pytest.fixture
def tiny_backbone() -> Callable[..., TinyBackbone]:
    """Factory of seeded :class:`TinyBackbone` instances: ``tiny_backbone(feature_dim=16, seed=0)``."""

    def make(feature_dim: int = 16, seed: int = 0) -> TinyBackbone:
        torch.manual_seed(seed)
        return TinyBackbone(feature_dim)

    return make
