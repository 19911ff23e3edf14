"""Heads that objectives own: the classifier ``G_y`` and the projection head ``G_c`` (paper §4.1)."""

from __future__ import annotations

from torch import nn

__all__ = ["ProjectionHead"]


class ProjectionHead(nn.Sequential):
    """MLP ``G_c``: ``depth`` linear layers with ReLU between them, ``in_dim → … → out_dim``.

    Depth 2 (the paper's default, Appendix C) is ``Linear(d, d) – ReLU – Linear(d, out_dim)``; hidden layers keep
    width ``d`` (Appendix E analyses depth 1–3 and output dimension).
    """

    def __init__(self, in_dim: int, out_dim: int = 256, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"projection depth must be >= 1, got {depth}")
        layers: list[nn.Module] = []
        for _ in range(depth - 1):
            layers += [nn.Linear(in_dim, in_dim), nn.ReLU(inplace=True)]
        layers.append(nn.Linear(in_dim, out_dim))
        super().__init__(*layers)
