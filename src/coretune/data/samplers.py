"""Reproducible shuffling and augmentation: every random draw of a training item depends only on
``(seed, epoch, index)`` (or, for the balanced per-domain batches of domain generalization, on its place in the
epoch), so a run resumed from a checkpoint sees exactly the batches of an uninterrupted one, whatever the number of
loader workers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..distributed import rank, world_size
from .errors import DataError

__all__ = [
    "BalancedDomainSampler",
    "EpochShuffleSampler",
    "ResumableLoader",
    "SameSizeBatches",
    "SeededItems",
    "balanced_train_loader",
    "check_shareable",
    "eval_loader",
    "eval_sampler",
    "item_seed",
    "same_size_batches",
    "same_size_eval_loader",
    "seeded_train_loader",
    "trained_items",
]


def item_seed(seed: int, epoch: int, index: int) -> int:
    """The RNG seed of item ``index`` in ``epoch`` of a run seeded with ``seed``."""
    return ((seed * 1_000_003 + epoch) * 2_147_483_647 + index) % 2**63


class _ResumableSampler(DistributedSampler):
    """A training sampler whose epoch can start after its first items once (a mid-epoch resume,
    :class:`ResumableLoader`). Being a ``DistributedSampler``, Lightning uses it as it is instead of wrapping it in a
    sampler of its own."""

    _skip: tuple[int, int] | None = None  # (epoch, items) to leave out once, after a mid-epoch resume

    def skip_once(self, epoch: int, items: int) -> None:
        """Leave out the first ``items`` keys of ``epoch`` the next time it is iterated (mid-epoch resume)."""
        self._skip = (epoch, items)

    def pending_skip(self) -> int:
        """How many keys the next iteration leaves out (0 unless :meth:`skip_once` named the current epoch)."""
        return self._skip[1] if self._skip is not None and self._skip[0] == self.epoch else 0

    def _take_skip(self) -> int:
        skip, self._skip = self.pending_skip(), None
        return skip

    def __len__(self) -> int:
        return self.num_samples


class EpochShuffleSampler(_ResumableSampler):
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

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        if self.num_replicas > 1:
            order = (order * -(-self.total_size // max(self.n, 1)))[: self.total_size]
            b, w = self.batch_size, self.num_replicas
            order = [i for start in range(self.rank * b, self.total_size, w * b) for i in order[start : start + b]]
        for index in order[self._take_skip() :]:
            yield index, item_seed(self.seed, self.epoch, index)


class BalancedDomainSampler(_ResumableSampler):
    """Training keys in batches that draw an equal share from every training domain (DomainBed's per-domain
    loaders, as one sampler): each run of ``batch_size`` keys holds ``batch_size / D`` items of each of the ``D``
    domains, domain by domain; yields ``(index, item seed)`` keys for :class:`SeededItems`.

    Each domain is read as an endless stream of seeded permutations of its items (permutation ``k`` of domain ``d``
    fixed by ``(seed, d, k)``), so every item of a domain is drawn once before any is drawn again, whatever the
    domains' sizes; an epoch is ``steps_per_epoch`` steps (domain generalization counts steps, not passes over the
    data), and step ``t``'s items are the stream's positions ``t · share · W …`` onwards: they depend on the step
    alone, so a resumed run draws exactly the batches of an uninterrupted one. The item seed of stream position
    ``p`` of domain ``d`` is ``item_seed(seed, d, p)``.

    Data-parallel runs (``num_replicas = W > 1``): at each step rank ``r`` takes the ``r``-th block of ``share``
    positions of every domain's stream, so the ``W`` batches of a step are disjoint and each is balanced; together
    they are the balanced batch of ``W · batch_size`` items a single process would draw with that batch size, with
    the same augmentation draws.

    Args:
        domain_indices: for each training domain, the dataset indices of its items (every domain non-empty).
        batch_size: per-process batch size, a multiple of the number of domains.
        steps_per_epoch: batches per epoch.
        seed: seed of the permutations and (through :func:`item_seed`) of each item's augmentation.
        num_replicas: number of processes ``W``.
        rank: this process's rank in ``[0, W)``.

    Raises:
        DataError: ``batch_size`` is not a multiple of the number of domains, or a domain has no item.
    """

    def __init__(
        self,
        domain_indices: Sequence[Sequence[int]],
        batch_size: int,
        steps_per_epoch: int,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        domains = len(domain_indices)
        if domains < 1 or any(len(indices) == 0 for indices in domain_indices):
            raise DataError(f"every training domain needs items, got {[len(i) for i in domain_indices]} per domain")
        if batch_size < domains or batch_size % domains:
            lower = max(domains, batch_size - batch_size % domains)
            raise DataError(
                f"batch_size {batch_size} does not split equally over the {domains} training domains: use a "
                f"multiple of {domains}, e.g. {lower} or {lower + domains} (DomainBed draws 32 per domain: "
                f"{32 * domains})"
            )
        if steps_per_epoch < 1:
            raise DataError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        size = sum(len(indices) for indices in domain_indices)
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.domain_indices = [np.asarray(indices, dtype=np.int64) for indices in domain_indices]
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self.share = batch_size // domains
        self.num_samples = steps_per_epoch * batch_size
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return itertools.islice(self._keys(), self._take_skip(), None)

    def _keys(self) -> Iterator[tuple[int, int]]:
        cache: dict[tuple[int, int], np.ndarray] = {}  # (domain, permutation number) → permutation

        def item(domain: int, position: int) -> int:
            indices = self.domain_indices[domain]
            key = (domain, position // len(indices))
            if key not in cache:
                cache[key] = np.random.default_rng([self.seed, domain, key[1]]).permutation(indices)
            return int(cache[key][position % len(indices)])

        for step in range(self.epoch * self.steps_per_epoch, (self.epoch + 1) * self.steps_per_epoch):
            start = (step * self.num_replicas + self.rank) * self.share
            for domain in range(len(self.domain_indices)):
                for position in range(start, start + self.share):
                    yield item(domain, position), item_seed(self.seed, domain, position)


class SeededItems(Dataset):
    """Wraps a dataset so that ``ds[(index, seed)]`` runs ``base[index]`` with torch's RNG seeded by ``seed``
    (and restored afterwards): random augmentations become a function of the item seed alone. With ``keep_seed``
    the item is ``(*base[index], seed)``: the seed travels with the batch to the device, whose augmentation draws
    from it (:class:`~coretune.data.device_augment.DeviceAugment`)."""

    def __init__(self, base: Dataset, keep_seed: bool = False) -> None:
        self.base, self.keep_seed = base, keep_seed

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also reseeds CUDA, slowly
            item = self.base[index]
        return (*item, seed) if self.keep_seed else item


class ResumableLoader(DataLoader):
    """A training ``DataLoader`` over an :class:`EpochShuffleSampler` (or :class:`BalancedDomainSampler`) that
    resumes mid-epoch exactly.

    Lightning stores :meth:`state_dict` (the epoch and how many batches of it were handed out) in every
    checkpoint and, when a run restarts from a mid-epoch checkpoint, passes it back to :meth:`load_state_dict`:
    the sampler then leaves out the keys of those batches, so the resumed epoch goes on with the batch that
    would have come next. Batches are counted as they are handed to the training loop, not as workers prefetch.
    """

    sampler: _ResumableSampler
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


def _drops_last(n: int, global_batch: int) -> bool:
    """Whether an epoch of :func:`seeded_train_loader` drops its incomplete last batch: when there are 2 or more."""
    return n > global_batch


def trained_items(n: int, batch_size: int, processes: int = 1) -> int:
    """How many of ``n`` items one epoch of :func:`seeded_train_loader` trains on, over all processes."""
    global_batch = batch_size * processes
    return n // global_batch * global_batch if _drops_last(n, global_batch) else n


def seeded_train_loader(
    dataset: Dataset, batch_size: int, seed: int, keep_seed: bool = False, **loader_options: Any
) -> ResumableLoader:
    """The training loader of the data modules: ``dataset``'s items (augmented by :class:`SeededItems`, each with its
    item seed last with ``keep_seed``) in an order fixed by ``(seed, epoch)``, dealt to the ``torch.distributed``
    processes, resumable mid-epoch; the last incomplete batch is dropped when there are 2 or more batches.
    ``loader_options`` go to the ``DataLoader``."""
    n, processes = len(dataset), world_size()  # type: ignore[arg-type]
    drop_last = _drops_last(n, batch_size * processes)
    sampler = EpochShuffleSampler(n, seed, batch_size, processes, rank(), drop_last)
    return ResumableLoader(
        SeededItems(dataset, keep_seed), batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_options
    )


def balanced_train_loader(
    dataset: Dataset, domain_indices: Sequence[Sequence[int]], batch_size: int, steps_per_epoch: int, seed: int,
    keep_seed: bool = False, **loader_options: Any,
) -> ResumableLoader:  # fmt: skip
    """The training loader of domain generalization: ``steps_per_epoch`` batches per epoch, each with an equal share
    of every training domain (:class:`BalancedDomainSampler`; ``domain_indices`` lists each domain's items of
    ``dataset``), augmented by :class:`SeededItems`, dealt to the ``torch.distributed`` processes, resumable
    mid-epoch. ``loader_options`` go to the ``DataLoader``."""
    sampler = BalancedDomainSampler(domain_indices, batch_size, steps_per_epoch, seed, world_size(), rank())
    return ResumableLoader(SeededItems(dataset, keep_seed), batch_size=batch_size, sampler=sampler, **loader_options)


def eval_loader(dataset: Dataset, batch_size: int, **loader_options: Any) -> DataLoader:
    """An evaluation loader, in dataset order; under ``torch.distributed`` each process reads every W-th item, each
    item once (Lightning's default ``DistributedSampler`` pads the split with repeated items to a multiple of W, so
    accuracies would count up to W − 1 images twice)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=eval_sampler(dataset), **loader_options)


def check_shareable(dataset: Dataset, split: str = "evaluation") -> None:
    """Under ``torch.distributed``, refuse an evaluation split with fewer items than there are processes: each
    process reads every W-th item (:func:`eval_sampler`), and a process without any would skip the evaluation epoch
    while the others wait for it at the epoch's end, for ever.

    Raises:
        DataError: naming the split, its size and the fix.
    """
    if (processes := world_size()) > 1 and (items := len(dataset)) < processes:  # type: ignore[arg-type]
        raise DataError(
            f"the {split} split holds {items} image(s), fewer than the {processes} processes that share it (each "
            f"needs at least one): run at most {items} processes (--trainer.devices × --trainer.num_nodes), or use a "
            "larger split"
        )


def eval_sampler(dataset: Dataset) -> UnrepeatedDistributedSampler | None:
    """Under ``torch.distributed``, every W-th item of ``dataset`` for this process, each item once (``None`` in a
    single process); :func:`check_shareable` first."""
    if world_size() == 1:
        return None
    check_shareable(dataset)
    return UnrepeatedDistributedSampler(dataset, num_replicas=world_size(), rank=rank(), shuffle=False)


def same_size_batches(paths: Sequence[str], batch_size: int) -> list[list[int]]:
    """Batches of the indices of ``paths``, each of images of one width and height (read from the file headers,
    in order of first appearance), at most ``batch_size`` long: a segmentation model predicts each image at its
    own size, and images of one size can share a forward pass. A file whose header cannot be read is a batch of
    its own (reading it then raises the usual error, or it was left out by ``on_bad_image="skip"``)."""
    groups: dict[object, list[int]] = {}
    for i, path in enumerate(paths):
        try:
            with Image.open(path) as img:
                key: object = img.size
        except Exception:  # any unreadable header: the dataset names the problem when it decodes it
            key = ("unreadable", i)
        groups.setdefault(key, []).append(i)
    return [group[i : i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


class SameSizeBatches(DistributedSampler):
    """An evaluation sampler of whole batches: this process's every W-th item (each item once, as
    :func:`eval_sampler`), grouped into batches of images of one size (:func:`same_size_batches`). Being a
    ``DistributedSampler``, Lightning uses it as it is."""

    def __init__(self, paths: Sequence[str], batch_size: int) -> None:
        super().__init__(range(len(paths)), num_replicas=world_size(), rank=rank(), shuffle=False)  # type: ignore[arg-type]
        mine = list(range(len(paths)))[self.rank :: self.num_replicas]
        self.batches = [[mine[i] for i in batch] for batch in same_size_batches([paths[i] for i in mine], batch_size)]

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _Batches(Dataset):
    """``ds[indices]``: ``collate`` of the base dataset's items ``indices`` (a loader over :class:`SameSizeBatches`
    with ``batch_size=None``)."""

    def __init__(self, base: Dataset, collate: Any) -> None:
        self.base, self.collate = base, collate

    def __getitem__(self, indices: list[int] | int) -> Any:  # type: ignore[override]
        # one index: Lightning's --trainer.overfit_batches replaces the sampler by a SequentialSampler of items
        return self.collate([self.base[i] for i in ([indices] if isinstance(indices, int) else indices)])

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]


def same_size_eval_loader(
    dataset: Dataset, paths: Sequence[str], batch_size: int, collate: Any, **loader_options: Any
) -> DataLoader:
    """An evaluation loader whose batches hold images of one size (``paths``: each item's image file), so that no
    image is padded to a batch-mate's size and its prediction does not depend on its batch: in dataset order
    within each size, each item once, every W-th item under ``torch.distributed`` (:func:`check_shareable`
    first)."""
    check_shareable(dataset)
    sampler = SameSizeBatches(paths, batch_size)
    return DataLoader(_Batches(dataset, collate), batch_size=None, sampler=sampler, **loader_options)
