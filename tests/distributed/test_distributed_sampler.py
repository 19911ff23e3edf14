"""The training sampler under data parallelism: rank shards of the same seeded, epoch-dependent order."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, DistributedSampler

from coretune.data import ImageClassificationData, SegmentationData
from coretune.data import samplers as samplers_module
from coretune.data.errors import DataError
from coretune.data.samplers import EpochShuffleSampler, check_shareable, eval_loader, item_seed


def _order(seed: int, epoch: int, n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def _shards(n: int, seed: int, batch_size: int, world: int, epoch: int, drop_last: bool) -> list[list[int]]:
    shards = []
    for rank in range(world):
        sampler = EpochShuffleSampler(n, seed, batch_size, world, rank, drop_last)
        sampler.set_epoch(epoch)
        keys = list(sampler)
        assert len(keys) == len(sampler)
        assert all(s == item_seed(seed, epoch, i) for i, s in keys)
        shards.append([i for i, _ in keys])
    return shards


def test_one_process_keeps_the_seeded_permutation() -> None:
    sampler = EpochShuffleSampler(10, seed=3)
    sampler.set_epoch(2)
    assert list(sampler) == [(i, item_seed(3, 2, i)) for i in _order(3, 2, 10)]
    assert len(sampler) == 10


def test_global_batches_are_the_single_process_batches() -> None:
    n, b, world = 23, 3, 2
    shards = _shards(n, seed=5, batch_size=b, world=world, epoch=1, drop_last=True)
    assert [len(s) for s in shards] == [9, 9]  # 3 full global batches of 6; the last 5 items are dropped
    assert not set(shards[0]) & set(shards[1])
    order = _order(5, 1, n)
    for step in range(3):
        global_batch = [i for shard in shards for i in shard[step * b : (step + 1) * b]]
        assert global_batch == order[step * b * world : (step + 1) * b * world]


def test_padding_covers_every_item_with_equal_shares() -> None:
    n, b, world = 20, 3, 2
    shards = _shards(n, seed=0, batch_size=b, world=world, epoch=0, drop_last=False)
    assert [len(s) for s in shards] == [12, 12]  # padded to 4 full global batches of 6
    assert set(shards[0]) | set(shards[1]) == set(range(n))
    padded = _order(0, 0, n) + _order(0, 0, n)[:4]
    assert sorted(shards[0] + shards[1]) == sorted(padded)


def test_the_order_changes_with_the_epoch_and_repeats_with_it() -> None:
    first = _shards(40, seed=1, batch_size=4, world=2, epoch=0, drop_last=True)
    again = _shards(40, seed=1, batch_size=4, world=2, epoch=0, drop_last=True)
    second = _shards(40, seed=1, batch_size=4, world=2, epoch=1, drop_last=True)
    assert first == again and first[0] != second[0] and first[1] != second[1]


def test_bad_rank_and_batch_size_are_rejected() -> None:
    with pytest.raises(ValueError, match="rank"):
        EpochShuffleSampler(10, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        EpochShuffleSampler(10, batch_size=0)


def test_lightning_uses_the_sampler_unwrapped() -> None:
    loader = DataLoader(range(8), sampler=EpochShuffleSampler(8, 0, 2, 2, 0, True), batch_size=2)
    assert isinstance(loader.sampler, DistributedSampler)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    assert trainer._data_connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING) is loader


def test_rank_loaders_of_the_datamodule_split_the_single_process_batches(
    image_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def batches(world: int, rank: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        monkeypatch.setattr(samplers_module, "world_size", lambda: world)
        monkeypatch.setattr(samplers_module, "rank", lambda: rank)
        data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=batch_size, seed=4)
        loader = data.train_dataloader()
        loader.sampler.set_epoch(1)
        return list(loader)

    single = batches(1, 0, 8)  # 36 images: 4 batches of 8
    rank0, rank1 = batches(2, 0, 4), batches(2, 1, 4)
    assert len(single) == len(rank0) == len(rank1) == 4
    for (x, y), (x0, y0), (x1, y1) in zip(single, rank0, rank1, strict=True):
        assert torch.equal(torch.cat([y0, y1]), y)
        assert torch.equal(torch.cat([x0, x1]), x)  # same images, same augmentation draws


def test_evaluation_splits_smaller_than_the_processes_are_refused(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a process without evaluation items skipped the epoch while the others waited for it at its end
    from segmentation_sets import make_voc_set

    monkeypatch.setattr(samplers_module, "world_size", lambda: 3)
    monkeypatch.setattr(samplers_module, "rank", lambda: 2)
    assert [[b.tolist() for b in eval_loader(list(range(n)), 4)] for n in (3, 7)] == [[[2]], [[2, 5]]]
    fix = r" that share it \(each needs at least one\): run at most 2 processes \(--trainer\.devices × --trainer\."
    with pytest.raises(DataError, match=r"^the evaluation split holds 2 image\(s\), fewer than the 3 processes" + fix):
        eval_loader(list(range(2)), 4)
    check_shareable(list(range(3)), "test")
    with pytest.raises(DataError, match=r"^the test split holds 2 image\(s\), fewer than the 3 processes that share"):
        check_shareable(list(range(2)), "test")
    root = make_voc_set(tmp_path / "voc", {"train": 4, "val": 2})
    for mode in ("center_crop", "whole"):  # whole images: batches of one size, the same check
        with pytest.raises(DataError, match=r"^the evaluation split holds 2 image\(s\)"):
            SegmentationData(root=str(root), image_size=16, batch_size=2, eval_mode=mode).val_dataloader()
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=2)  # 12 val images
    monkeypatch.setattr(samplers_module, "world_size", lambda: 13)
    with pytest.raises(DataError, match=r"^the evaluation split holds 12 image\(s\), fewer than the 13 processes"):
        data.val_dataloader()
