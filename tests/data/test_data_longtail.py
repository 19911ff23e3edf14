"""Long-tailed training sets (``--data.imbalance_ratio``): Cao et al.'s exponential profile, seeded per class, composed
with the label fraction and the validation split; the test split untouched."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coretune.data import DataError, ImageClassificationData, long_tailed_counts, long_tailed_subset
from image_trees import make_image_tree


def profile_loop(n_max: int, classes: int, ratio: float) -> list[int]:
    """Cao et al. 2019 (LDAM-DRW's CIFAR-LT), written from the formula: n_i = int(n_max · (1/R)^(i / (C − 1)))."""
    out = []
    for i in range(classes):
        exponent = i / (classes - 1) if classes > 1 else 0.0
        out.append(int(n_max * (1.0 / ratio) ** exponent))
    return out


def test_cifar10_lt_counts_are_the_published_profile() -> None:
    # CIFAR-10-LT at R = 100 (12,406 images) and R = 10 (20,431), as LDAM-DRW's IMBALANCECIFAR10 builds them
    assert long_tailed_counts([5000] * 10, 100) == [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]
    assert sum(long_tailed_counts([5000] * 10, 100)) == 12406
    assert long_tailed_counts([5000] * 10, 10) == [5000, 3871, 2997, 2320, 1796, 1391, 1077, 834, 645, 500]
    assert sum(long_tailed_counts([5000] * 10, 10)) == 20431
    assert long_tailed_counts([500] * 100, 100)[-1] == 5  # CIFAR-100-LT's tail


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=12),
    ratio=st.floats(1, 500, allow_nan=False),
)
def test_counts_equal_a_slow_loop_of_the_formula(sizes: list[int], ratio: float) -> None:
    expected = profile_loop(min(sizes), len(sizes), ratio)
    if expected[-1] == 0:
        with pytest.raises(DataError, match=rf"leaves the last class with 0 images .*lower it to ≤ {min(sizes)}$"):
            long_tailed_counts(sizes, ratio)
        return
    assert long_tailed_counts(sizes, ratio) == expected


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(20, 80), min_size=2, max_size=6), seed=st.integers(0, 1000))
def test_subset_keeps_the_profile_is_seeded_and_nests(sizes: list[int], seed: int) -> None:
    labels = np.random.default_rng(7).permutation(np.repeat(np.arange(len(sizes)), sizes)).tolist()
    steep = long_tailed_subset(labels, 10, seed)
    counts = Counter(labels[i] for i in steep)
    assert [counts[c] for c in range(len(sizes))] == profile_loop(min(sizes), len(sizes), 10)
    assert steep == sorted(set(steep)) == long_tailed_subset(labels, 10, seed)
    assert set(steep) <= set(long_tailed_subset(labels, 2, seed))  # a milder ratio keeps the steeper one's images


def test_subset_differs_between_seeds_and_ratio_one_keeps_every_class_at_n_max() -> None:
    labels = np.repeat(np.arange(3), 50).tolist()
    assert long_tailed_subset(labels, 5, seed=0) != long_tailed_subset(labels, 5, seed=1)
    assert long_tailed_subset(labels, 1, seed=0) == list(range(150))


@pytest.mark.parametrize("ratio", [0.5, 0.0, -3.0, float("nan")])
def test_ratio_below_one_is_refused(ratio: float) -> None:
    with pytest.raises(DataError, match=r"^imbalance_ratio must be >= 1 \(1: the classes as they are"):
        long_tailed_counts([10, 10], ratio)


def test_a_class_without_images_is_named() -> None:
    with pytest.raises(DataError, match=r"class 'b' has none; add images to it or remove the class$"):
        long_tailed_subset([0, 0, 2, 2], 2, num_classes=3, class_names=["a", "b", "c"])


def lt_tree(root: Path) -> Path:
    """4 classes of 40 training images and 5 validation images each (8 px)."""
    return make_image_tree(root, classes=("a", "b", "c", "d"), per_class=40, val_per_class=5, size=8)


def test_the_data_module_makes_the_training_set_long_tailed_before_the_fractions(tmp_path: Path) -> None:
    root = lt_tree(tmp_path / "data")
    plain = ImageClassificationData(root=str(root), image_size=8, seed=3)
    lt = ImageClassificationData(root=str(root), image_size=8, seed=3, imbalance_ratio=8)
    # LT first: 40 · 8^(−i/3) = 40, 20, 10, 5; the val/ folder (the test split here) stays balanced
    assert list(lt.class_counts("train").values()) == profile_loop(40, 4, 8) == [40, 20, 10, 5]
    assert lt.class_counts("test") == plain.class_counts("test") == {c: 5 for c in "abcd"}
    assert lt.test_dataset.images == plain.test_dataset.images
    # then the label fraction of the long-tailed set, then validation held out of that, stratified
    both = ImageClassificationData(
        root=str(root), image_size=8, seed=3, imbalance_ratio=8, label_fraction=0.5, val_fraction=0.2
    )
    train, val = list(both.class_counts("train").values()), list(both.class_counts("val").values())
    assert [t + v for t, v in zip(train, val, strict=True)] == [20, 10, 5, 3]  # round-half-up of 40, 20, 10, 5 / 2
    assert val == [4, 2, 1, 1]  # 20% of each, at least one
    assert both.class_counts("test") == {c: 5 for c in "abcd"}  # the val/ folder became the test split, untouched
    assert set(both.train_dataset.images) <= set(lt.train_dataset.images)
    again = ImageClassificationData(
        root=str(root), image_size=8, seed=3, imbalance_ratio=8, label_fraction=0.5, val_fraction=0.2
    )
    assert again.train_dataset is None and again.class_counts("train") == both.class_counts("train")
    assert again.train_dataset.images == both.train_dataset.images  # seeded
    other = ImageClassificationData(root=str(root), image_size=8, seed=4, imbalance_ratio=8)
    assert (
        other.class_counts("train") == lt.class_counts("train")
        and other.train_dataset.images != lt.train_dataset.images
    )


def test_ratio_one_or_null_is_todays_data_and_bad_options_are_one_line(tmp_path: Path) -> None:
    root = lt_tree(tmp_path / "data")
    for ratio in (None, 1, 1.0):
        data = ImageClassificationData(root=str(root), image_size=8, imbalance_ratio=ratio)
        assert data.imbalance_ratio is None and data.class_counts("train") == {c: 40 for c in "abcd"}
    with pytest.raises(
        DataError, match=r"imbalance_ratio must be >= 1 \(1 or null: the classes as they are\), got 0.5"
    ):
        ImageClassificationData(root=str(root), imbalance_ratio=0.5)
    with pytest.raises(DataError, match=r"shot_thresholds must be \[many, few\] with 0 <= few <= many, got \(5, 10\)"):
        ImageClassificationData(root=str(root), shot_thresholds=(5, 10))
    with pytest.raises(DataError, match=r"^imbalance_ratio 50 leaves the last class with 0 images .*lower it to ≤ 40$"):
        ImageClassificationData(root=str(root), image_size=8, imbalance_ratio=50).setup()
    assert "imbalance_ratio" in ImageClassificationData.split_settings  # coretune test/validate redraw the same split
