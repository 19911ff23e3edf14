"""Reproducible shuffling and augmentation: every random draw of a training item depends only on
``(seed, epoch, index)``, so a run resumed from a checkpoint sees exactly the batches of an uninterrupted one,
whatever the number of loader workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["EpochShuffleSampler", "SeededItems", "item_seed"]


def item_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed of item ``index`` in ``epoch`` of a run seeded with ``seed``."""
    return ((seed * 1_000_003 + epoch) * 2_147_483_647 + index) % 2**63


class EpochShuffleSampler(Sampler[tuple[int, int]]):
    """A permutation of ``range(n)`` per epoch, fixed by ``(seed, epoch)``; yields ``(index, item seed)`` keys.

    Lightning calls :meth:`set_epoch` before each epoch's first batch (also after resuming from a checkpoint).
    Pair it with :class:`SeededItems`, which draws each item's augmentation from its item seed.
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        for index in torch.randperm(self.n, generator=generator).tolist():
            yield index, item_seed(self.seed, self.epoch, index)


class SeededItems(Dataset):
    """Wraps a dataset so that ``ds[(index, seed)]`` runs ``base[index]`` with torch's RNG seeded by ``seed``
    (and restored afterwards): random augmentations become a function of the item seed alone."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.base[index]
