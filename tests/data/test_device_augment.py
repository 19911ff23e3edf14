"""``--data.augment_on device``: the loader hands fixed uint8 squares and item seeds over, and the training
augmentation (torchvision v2, one call per image under its item seed) runs on the batch where the model runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coretune.cli import main
from coretune.data import DataError, ImageClassificationData
from coretune.data.device_augment import DeviceAugment, decode_size, fixed_size_transform
from coretune.data.domains import DomainGeneralizationData
from coretune.data.samplers import item_seed
from coretune.data.segmentation import SegmentationData
from coretune.data.transforms import train_transform
from coretune.engine import read_metrics


def images(batch: int = 4, side: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_views_are_normalised_float_batches_of_the_image_size() -> None:
    views = DeviceAugment(24, rotation=10, color_jitter=0.3, grayscale=0.5)(images(), [1, 2, 3, 4], views=2)
    assert len(views) == 2
    for view in views:
        assert view.shape == (4, 3, 24, 24) and view.dtype == torch.float32


def test_each_image_draws_its_own_augmentation_from_its_seed() -> None:
    one = images(1)
    same = one.expand(6, -1, -1, -1).contiguous()
    (out,) = DeviceAugment(24)(same, list(range(6)))
    # the same image under 6 seeds: 6 different crops (v2 alone would crop a batch once)
    assert len({out[i].sum().item() for i in range(6)}) == 6
    (again,) = DeviceAugment(24)(same, [0, 0, 0, 0, 0, 0])
    assert all(torch.equal(again[0], again[i]) for i in range(6))


def test_a_seed_gives_the_same_views_in_any_batch() -> None:
    batch = images(3)
    augment = DeviceAugment(20, color_jitter=0.3, grayscale=0.3)
    first = augment(batch, [7, 8, 9], views=2)
    assert all(torch.equal(a, b) for a, b in zip(first, augment(batch, [7, 8, 9], views=2), strict=True))
    alone = augment(batch[1:2], [8], views=2)  # its batch-mates do not change an image's draws
    assert all(torch.equal(view[1:2], single) for view, single in zip(first, alone, strict=True))


def test_two_views_of_an_image_differ() -> None:
    first, second = DeviceAugment(24)(images(4), [1, 2, 3, 4], views=2)
    assert all(not torch.equal(first[i], second[i]) for i in range(4))


def test_without_random_change_it_equals_the_loader_path_pixel_for_pixel() -> None:
    """The identity augmentation (the whole square, no flip) normalises as the PIL path's ToDtype + Normalize."""
    side, mean, std = 28, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    pixels = images(1, side)[0]
    pil = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    loader = train_transform(side, mean, std, crop_scale=(1.0, 1.0), hflip=False)(pil)
    (device,) = DeviceAugment(side, mean, std, crop_scale=(1.0, 1.0), hflip=False)(pixels[None], [5])
    torch.testing.assert_close(device[0], loader, rtol=0, atol=1e-6)


def test_a_batch_that_is_not_uint8_images_is_refused() -> None:
    with pytest.raises(ValueError, match="uint8"):
        DeviceAugment(8)(images().float(), [1, 2, 3, 4])
    with pytest.raises(ValueError, match="4 images but 3 seeds"):
        DeviceAugment(8)(images(), [1, 2, 3])


def test_the_fixed_square_keeps_the_centre_or_squashes() -> None:
    wide = Image.fromarray(np.zeros((20, 40, 3), dtype=np.uint8))
    assert decode_size(224) == 256
    assert fixed_size_transform(14)(wide).shape == (3, 16, 16)
    assert fixed_size_transform(14, squash=True)(wide).dtype == torch.uint8


def test_the_classification_loader_hands_squares_and_seeds_and_the_hook_augments(image_tree: Path) -> None:
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=4, augment_on="device", seed=3)
    data.train_views = 2
    raw, labels, seeds = next(iter(data.train_dataloader()))
    assert raw.dtype == torch.uint8 and raw.shape == (4, 3, 18, 18)  # decode_size(16)
    sampler = data.train_dataloader().sampler
    sampler.set_epoch(0)
    assert seeds.tolist() == [item_seed(3, 0, i) for i, _ in list(iter(sampler))[:4]]
    (first, second), out_labels = data.on_after_batch_transfer([raw, labels, seeds], 0)
    assert first.shape == second.shape == (4, 3, 16, 16) and first.dtype == torch.float32
    assert torch.equal(out_labels, labels) and not torch.equal(first, second)
    val = next(iter(data.val_dataloader()))
    assert data.on_after_batch_transfer(val, 0) is val  # evaluation batches pass unchanged


def test_domain_batches_keep_their_domain_labels(tmp_path: Path) -> None:
    from domain_trees import make_domain_tree

    tree = make_domain_tree(tmp_path / "dg", per_class=2)
    data = DomainGeneralizationData(
        root=str(tree), test_domains="photo", image_size=16, batch_size=6, steps_per_epoch=1, augment_on="device"
    )
    batch = next(iter(data.train_dataloader()))
    out, labels, domains = data.on_after_batch_transfer(batch, 0)
    assert out.shape == (6, 3, 16, 16) and out.dtype == torch.float32
    assert torch.equal(domains, batch[2]) and torch.equal(labels, batch[1])


def test_an_unknown_place_and_segmentation_on_the_device_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"augment_on must be 'loader' or 'device', got 'gpu'"):
        ImageClassificationData(root=str(tmp_path), augment_on="gpu")  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"augment_on must be 'loader' for segmentation .*got 'device'") as err:
        SegmentationData(root=str(tmp_path), augment_on="device")
    with pytest.raises(DataError, match=r"auto_augment 'trivial' runs in the loader on PIL images: use "):
        ImageClassificationData(root=str(tmp_path), augment_on="device", auto_augment="trivial")
    assert "\n" not in str(err.value)


def test_a_two_view_method_fits_with_augmentation_on_the_device(tmp_path: Path) -> None:
    from image_trees import make_image_tree

    tree = make_image_tree(tmp_path / "data", per_class=4, val_per_class=2, size=16)
    run_dir = tmp_path / "run"
    main([
        "fit", f"--data.root={tree}", "--data.image_size=16", "--data.batch_size=6", "--model.backbone=small_cnn",
        "--objective", "bi_tuning", "--trainer.max_epochs=1", f"--run_dir={run_dir}", "--data.augment_on=device",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    ])  # fmt: skip
    rows = read_metrics(run_dir / "metrics.csv")
    assert len(rows) == 1 and math.isfinite(float(rows[0]["train/loss"]))
    assert 0.0 <= json.loads((run_dir / "results.json").read_text())["test"]["top1"] <= 1.0
    assert "augment_on: device" in (run_dir / "config.yaml").read_text()
