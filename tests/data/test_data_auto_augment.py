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
