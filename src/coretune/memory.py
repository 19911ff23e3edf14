"""A cross-batch feature memory: a FIFO queue of past features and their labels (XBM, Wang et al., CVPR 2020)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["CrossBatchMemory", "FeatureMemory"]


@dataclass(frozen=True)
class CrossBatchMemory:
    """The settings of an objective's cross-batch memory (Core-tuning's ``memory``): a :class:`FeatureMemory` of the
    last ``size`` training samples' features, read and written only after ``warmup_steps`` training steps (XBM
    starts its memory once the features drift slowly).

    Args:
        size: rows ``N >= 1`` of the memory (an objective without a memory has none: ``memory: null``).
        warmup_steps: training steps (one per batch) before the memory is used and filled (XBM's 1,000 by default).
    """

    size: int
    warmup_steps: int = 1000

    def __post_init__(self) -> None:
        problems = []
        if self.size < 1:
            problems.append(f"size must be >= 1 (got {self.size}); an objective without a memory has memory null")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0 (got {self.warmup_steps})")
        if problems:
            raise ValueError("invalid cross-batch memory settings: " + "; ".join(problems))


class FeatureMemory(nn.Module):
    """The last ``size`` feature rows written to it, with their labels, oldest overwritten first.

    Everything is a buffer (``features`` ``(size, dim)``, ``labels`` ``(size,)``, the write position ``ptr``, the
    fill count ``filled`` and ``steps``, the training steps its owner has counted for a warm-up), so the memory is
    saved in checkpoints and restored on resume, and moves with its module. Rows are kept detached and in
    slot order: row ``j`` of a write of ``n`` rows goes to slot ``(ptr + j) % size``, and only the last ``size``
    rows of a write larger than the memory are kept.
    """

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        if size < 1 or dim < 1:
            raise ValueError(f"a feature memory needs size >= 1 and dim >= 1, got {size} and {dim}")
        self.size = size
        self.register_buffer("features", torch.zeros(size, dim))
        self.register_buffer("labels", torch.zeros(size, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def __len__(self) -> int:
        return int(self.filled)

    def rows(self) -> tuple[Tensor, Tensor]:
        """``(features (n, dim), labels (n,))`` of the ``n`` filled slots, in slot order: views, without gradient,
        that the next :meth:`push` overwrites (no copy of the memory each step)."""
        n = len(self)
        return self.features[:n], self.labels[:n]

    @torch.no_grad()
    def push(self, features: Tensor, labels: Tensor) -> None:
        """Write ``features`` ``(n, dim)`` (detached, cast to the memory's dtype) and their ``labels``, FIFO."""
        n = features.shape[0]
        keep = min(n, self.size)
        slots = (self.ptr + torch.arange(n - keep, n, device=self.ptr.device)) % self.size
        self.features[slots] = features[n - keep :].detach().to(self.features.dtype)
        self.labels[slots] = labels.reshape(-1)[n - keep :].to(self.labels.device, torch.long)
        self.ptr.copy_((self.ptr + n) % self.size)
        self.filled.copy_((self.filled + n).clamp(max=self.size))
