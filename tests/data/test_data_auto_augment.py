"""``--data.auto_augment``: timm's RandAugment (``rand-m9-mstd0.5``) or TrivialAugmentWide on the training images
only, seeded per image like the rest of the augmentation."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from coretune.data import ImageClassificationData
from coretune.data.errors import DataError
from coretune.data.transforms import auto_augment_problem


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("auto_augment"), per_class=3, val_per_class=1)


def loaders(root: Path, auto_augment: str | None) -> list[torch.Tensor]:
    dm = ImageClassificationData(root=str(root), image_size=16, batch_size=9, num_workers=0, auto_augment=auto_augment)
    return [next(iter(loader))[0] for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader())]


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5", "trivial"])
def test_auto_augment_changes_the_training_images_only_and_is_seeded(root: Path, policy: str) -> None:
    plain_train, plain_val, plain_test = loaders(root, None)
    train, val, test = loaders(root, policy)
    assert not torch.equal(train, plain_train)  # the policy ran on the training images
    assert torch.equal(val, plain_val) and torch.equal(test, plain_test)  # never on the held-out ones
    again, _, _ = loaders(root, policy)
    assert torch.equal(train, again)  # the same draws in every run (per image: (seed, epoch, index))
    python_state, numpy_state = random.getstate(), np.random.get_state()[1].copy()
    loaders(root, policy)  # Python's and NumPy's global RNGs (RandAugment's) are left as they were
    assert random.getstate() == python_state and (np.random.get_state()[1] == numpy_state).all()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("rand-q9", r"auto_augment 'rand-q9' is no RandAugment string timm reads"),
        ("autoaugment", r"auto_augment 'autoaugment' is unknown: use rand-m9-mstd0.5, .*, trivial"),
    ],
)
def test_a_bad_auto_augment_is_refused_before_any_work(tmp_path: Path, value: str, message: str) -> None:
    assert auto_augment_problem(None) is None and auto_augment_problem("rand-m9-mstd0.5-inc1") is None
    with pytest.raises(DataError, match=message) as info:
        ImageClassificationData(root=str(tmp_path / "absent"), auto_augment=value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bits", range(9))
def test_posterize_keeps_the_top_bits_of_each_channel_for_every_count_timm_draws(bits: int) -> None:
    """``bits`` most significant bits kept (a slow loop over the pixels); 0 bits: a black image, as Pillow before 13
    gave it (13 refuses 0, which ``rand-…-inc1`` draws at magnitude 10)."""
    from PIL import Image, ImageOps

    from coretune.data.transforms import posterize_any_bits

    pixels = np.random.default_rng(bits).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    kept = np.asarray(posterize_any_bits(image, bits))
    expected = pixels & (0xFF ^ (2 ** (8 - bits) - 1)) if bits < 8 else pixels
    assert (kept == expected).all()
    if bits >= 1:
        assert (kept == np.asarray(ImageOps.posterize(image, bits))).all()


def test_mae_randaugment_at_magnitude_10_posterizes_to_0_bits_without_error() -> None:
    """MAE's ``rand-m9-mstd0.5-inc1`` reaches magnitude 10 (the noise's upper clip) in ~2% of its draws, where
    timm's increasing posterize keeps 0 bits: every such draw runs (here forced: magnitude 10, posterize only)."""
    from PIL import Image

    from coretune.data.transforms import auto_augment_transform

    transform = auto_augment_transform("rand-m10-n1-inc1", 32)
    posterize = [op for op in transform.transform.ops if op.name == "PosterizeIncreasing"]
    assert len(posterize) == 1
    posterize[0].prob = 1.0
    transform.transform.ops = posterize
    image = Image.fromarray(np.full((32, 32, 3), 200, dtype=np.uint8))
    assert (np.asarray(transform(image)) == 0).all()  # 4 - int(10 / 10 * 4) = 0 bits: black
