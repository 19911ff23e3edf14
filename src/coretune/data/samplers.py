"""Reproducible shuffling and augmentation: every random draw of a training item depends only on
``(seed, epoch, index)``, so a run resumed from a checkpoint sees exactly the batches of an uninterrupted one,
whatever the number of loader workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..distributed import rank, world_size

__all__ = ["EpochShuffleSampler", "ResumableLoader", "SeededItems", "item_seed", "seeded_train_loader"]


def item_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed of item ``index`` in ``epoch`` of a run seeded with ``seed``."""
    return ((seed * 1_000_003 + epoch) * 2_147_483_647 + index) % 2**63


class EpochShuffleSampler(DistributedSampler):
    """A permutation of ``range(n)`` per epoch, fixed by ``(seed, epoch)``; yields ``(index, item seed)`` keys.

    Lightning calls :meth:`set_epoch` before each epoch's first batch (also after resuming from a checkpoint).
    Pair it with :class:`SeededItems`, which draws each item's augmentation from its item seed.

    Data-parallel runs (``num_replicas = W > 1``): the permutation is cut into blocks of ``batch_size`` dealt
    to the ranks in turn, so step ``t``'s batches of ranks ``0 … W-1``, concatenated in rank order, are the
    block ``t`` of ``W · batch_size`` items a single process would see with that batch size. Every rank gets
    the same number of full batches: with ``drop_last`` the items past the last full global batch are left
    out (as a single process drops its incomplete last batch), otherwise the permutation is padded by
    repeating its start (as :class:`~torch.utils.data.DistributedSampler` does). Being a ``DistributedSampler``,
    Lightning uses it as it is instead of wrapping it in a sampler of its own.

    Args:
        n: number of items.
        seed: seed of the order (and, through :func:`item_seed`, of each item's augmentation).
        batch_size: per-process batch size (only used to deal blocks when ``num_replicas > 1``).
        num_replicas: number of processes ``W``.
        rank: this process's rank in ``[0, W)``.
        drop_last: drop the items past the last full global batch (``W > 1``).
    """

    def __init__(
        self,
        n: int,
        seed: int = 0,
        batch_size: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        super().__init__(range(n), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
        self.n, self.batch_size = n, batch_size
        if num_replicas == 1:
            self.total_size = n
        else:
            block = batch_size * num_replicas
            full = n // block if drop_last and n >= block else -(-n // block)
            self.total_size = full * block
        self.num_samples = self.total_size // num_replicas
        self._skip: tuple[int, int] | None = None  # (epoch, items) to leave out once, after a mid-epoch resume

    def skip_once(self, epoch: int, items: int) -> None:
        """Leave out the first ``items`` keys of ``epoch`` the next time it is iterated (mid-epoch resume)."""
        self._skip = (epoch, items)

    def pending_skip(self) -> int:
        """How many keys the next iteration leaves out (0 unless :meth:`skip_once` named the current epoch)."""
        return self._skip[1] if self._skip is not None and self._skip[0] == self.epoch else 0

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        if self.num_replicas > 1:
            order = (order * -(-self.total_size // max(self.n, 1)))[: self.total_size]
            b, w = self.batch_size, self.num_replicas
            order = [i for start in range(self.rank * b, self.total_size, w * b) for i in order[start : start + b]]
        skip, self._skip = self.pending_skip(), None
        for index in order[skip:]:
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
            torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also reseeds CUDA, slowly
            return self.base[index]


class ResumableLoader(DataLoader):
    """A training ``DataLoader`` over an :class:`EpochShuffleSampler` that resumes mid-epoch exactly.

    Lightning stores :meth:`state_dict` (the epoch and how many batches of it were handed out) in every
    checkpoint and, when a run restarts from a mid-epoch checkpoint, passes it back to :meth:`load_state_dict`:
    the sampler then leaves out the keys of those batches, so the resumed epoch goes on with the batch that
    would have come next. Batches are counted as they are handed to the training loop, not as workers prefetch.
    """

    sampler: EpochShuffleSampler
    _position: tuple[int, int] = (0, 0)  # (epoch, batches handed out in it)

    def __iter__(self) -> Iterator[Any]:  # a generator: runs at the first batch, after Lightning's set_epoch
        epoch = self.sampler.epoch
        done = self.sampler.pending_skip() // self.batch_size
        for batch in super().__iter__():
            done += 1
            self._position = (epoch, done)
            yield batch

    def state_dict(self) -> dict[str, int]:
        epoch, done = self._position
        return {"epoch": self.sampler.epoch, "batches": done if epoch == self.sampler.epoch else 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.skip_once(state["epoch"], state["batches"] * self.batch_size)


def seeded_train_loader(dataset: Dataset, batch_size: int, seed: int, **loader_options: Any) -> ResumableLoader:
    """The training loader of the data modules: ``dataset``'s items (augmented by :class:`SeededItems`) in an
    order fixed by ``(seed, epoch)``, dealt to the ``torch.distributed`` processes, resumable mid-epoch; the last
    incomplete batch is dropped when there are 2 or more batches. ``loader_options`` go to the ``DataLoader``."""
    n, processes = len(dataset), world_size()  # type: ignore[arg-type]
    drop_last = n > batch_size * processes
    sampler = EpochShuffleSampler(n, seed, batch_size, processes, rank(), drop_last)
    return ResumableLoader(
        SeededItems(dataset), batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_options
    )
