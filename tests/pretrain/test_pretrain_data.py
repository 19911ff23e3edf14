"""PretrainData: every image under the folder, decoded once when cached, delivered as two augmented views."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coretune.data import DataError
from coretune.pretrain import PretrainData


def _images(root: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / ("cats" if i % 2 else "dogs/nested")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def test_views_of_cached_and_uncached_images_agree(tmp_path: Path) -> None:
    root = _images(tmp_path / "images", 6)
    cached, lazy = PretrainData(str(root), 12, batch_size=4, cache_images=True), PretrainData(str(root), 12)
    cached.setup()
    lazy.setup()
    assert len(cached.train_dataset) == len(lazy.train_dataset) == 6  # recursive, class folders ignored
    for i in range(6):
        image = lazy.train_dataset[i][0]
        assert image.dtype == torch.uint8 and image.shape == (3, 12, 12)
        assert torch.equal(cached.train_dataset[i][0], image)
    batch = next(iter(cached.train_dataloader()))
    assert batch[0].shape == (4, 3, 12, 12)  # drop_last: 6 images give one full batch of 4
    view1, view2 = cached.on_after_batch_transfer(batch, 0)
    assert view1.shape == view2.shape == (4, 3, 12, 12) and view1.dtype == torch.float32
    assert not torch.equal(view1, view2)


def test_unusable_data_raises_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="batch_size must be >= 2 for contrastive pre-training"):
        PretrainData(str(tmp_path), batch_size=1)
    with pytest.raises(DataError, match=r"crop_scale must satisfy .* set valid values \(--data.<option>\)"):
        PretrainData(str(tmp_path), crop_scale=(0.0, 1.0))
    with pytest.raises(DataError, match=r"mean and std need 3 values \(R, G, B\), got \(0\.5, 0\.5\) and \(0\.229"):
        PretrainData(str(tmp_path), mean=(0.5, 0.5))  # type: ignore[arg-type]  # was torch's RuntimeError from view
    with pytest.raises(DataError, match="holds a single image"):
        PretrainData(str(_images(tmp_path / "one", 1))).setup()
    with pytest.raises(DataError, match="does not exist"):
        PretrainData(str(tmp_path / "missing")).setup()
