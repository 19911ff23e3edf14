"""Stratified subsets and hold-out splits: exact per-class counts, determinism, nesting, error messages."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coretune.data import DataError, stratified_split, stratified_subset

class_sizes = st.lists(st.integers(1, 60), min_size=1, max_size=8)
percent = st.integers(1, 100)


def labels_for(sizes: list[int]) -> list[int]:
    """Labels of a shuffled set with ``sizes[c]`` items of class c (order must not matter)."""
    y = np.repeat(np.arange(len(sizes)), sizes)
    return np.random.default_rng(123).permutation(y).tolist()


def half_up(p: int, n: int) -> int:
    """round(p/100 · n) with halves up, in exact integer arithmetic."""
    return (2 * p * n + 100) // 200


@settings(max_examples=150, deadline=None)
@given(sizes=class_sizes, p=percent, seed=st.integers(0, 2**31))
def test_subset_keeps_rounded_share_of_every_class(sizes: list[int], p: int, seed: int) -> None:
    labels = labels_for(sizes)
    expected = [half_up(p, n) for n in sizes]
    if min(expected) == 0:
        with pytest.raises(DataError, match=rf"^fraction {p / 100:g} keeps no image of class"):
            stratified_subset(labels, p / 100, seed)
        return
    idx = stratified_subset(labels, p / 100, seed)
    counts = Counter(labels[i] for i in idx)
    assert [counts[c] for c in range(len(sizes))] == expected
    assert min(counts.values()) >= 1
    assert idx == sorted(set(idx))
    # proportions kept: each class within half an image of its exact share
    assert all(abs(k - p / 100 * n) <= 0.5 + 1e-9 for k, n in zip(expected, sizes, strict=True))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(10, 60), min_size=2, max_size=6), seed=st.integers(0, 1000))
def test_subset_is_deterministic_and_nested(sizes: list[int], seed: int) -> None:
    labels = labels_for(sizes)
    small = stratified_subset(labels, 0.2, seed)
    assert small == stratified_subset(labels, 0.2, seed)
    assert set(small) <= set(stratified_subset(labels, 0.6, seed))


def test_subset_differs_between_seeds() -> None:
    labels = labels_for([50, 50, 50])
    assert stratified_subset(labels, 0.3, seed=0) != stratified_subset(labels, 0.3, seed=1)


def test_subset_of_one_class_does_not_depend_on_other_classes() -> None:
    a = [0] * 20 + [1] * 30
    b = [0] * 20 + [1] * 45
    pick = stratified_subset(a, 0.5, 7)
    assert [i for i in pick if i < 20] == [i for i in stratified_subset(b, 0.5, 7) if i < 20]


def test_subset_imbalanced_set_keeps_proportions() -> None:
    labels = labels_for([1000, 100, 10])
    counts = Counter(labels[i] for i in stratified_subset(labels, 0.1, 0))
    assert [counts[0], counts[1], counts[2]] == [100, 10, 1]


def test_subset_rounding_halves_up() -> None:
    labels = [0] * 5 + [1] * 7  # 0.5 · 5 = 2.5 → 3; 0.5 · 7 = 3.5 → 4
    counts = Counter(labels[i] for i in stratified_subset(labels, 0.5, 0))
    assert (counts[0], counts[1]) == (3, 4)
    labels = [0] * 10  # 0.35 · 10 is 3.4999999999999996 in floating point: still 4
    assert len(stratified_subset(labels, 0.35, 0)) == 4


def test_subset_full_fraction_keeps_everything() -> None:
    labels = labels_for([3, 4, 5])
    assert stratified_subset(labels, 1.0, 9) == list(range(12))


def test_subset_error_names_class_count_and_minimum() -> None:
    labels = [0] * 500 + [1] * 12 + [2] * 40
    msg = (
        r"^label_fraction 0.01 keeps no image of class 'x' \(12 images\) nor of 1 other class\(es\): "
        r"raise it to ≥ 0.0417$"
    )
    with pytest.raises(DataError, match=msg):
        stratified_subset(labels, 0.01, class_names=["a", "x", "y"], name="label_fraction")
    # the suggested minimum works
    assert Counter(labels[i] for i in stratified_subset(labels, 0.0417, 0))[1] == 1


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_subset_rejects_fraction_outside_unit_interval(fraction: float) -> None:
    with pytest.raises(DataError, match=r"fraction must be in \(0, 1\]"):
        stratified_subset([0, 1], fraction)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 60), min_size=1, max_size=8),
    p=st.integers(1, 99),
    seed=st.integers(0, 10**6),
)
def test_split_is_disjoint_complete_and_stratified(sizes: list[int], p: int, seed: int) -> None:
    labels = labels_for(sizes)
    kept, held = stratified_split(labels, p / 100, seed)
    assert not set(kept) & set(held)
    assert sorted(kept + held) == list(range(len(labels)))
    assert kept == sorted(kept) and held == sorted(held)
    held_counts = Counter(labels[i] for i in held)
    for c, n in enumerate(sizes):
        assert held_counts[c] == min(max(half_up(p, n), 1), n - 1)
    assert (kept, held) == stratified_split(labels, p / 100, seed)


def test_split_differs_between_seeds_and_zero_holds_nothing_out() -> None:
    labels = labels_for([40, 40])
    assert stratified_split(labels, 0.25, 0) != stratified_split(labels, 0.25, 1)
    assert stratified_split(labels, 0.0, 0) == (list(range(80)), [])


def test_split_needs_two_items_per_class() -> None:
    with pytest.raises(DataError, match=r"val_fraction 0.2 cannot hold out images of class 'b': it has 1 image"):
        stratified_split([0, 0, 0, 1], 0.2, class_names=["a", "b"], name="val_fraction")


@pytest.mark.parametrize("fraction", [1.0, -0.5])
def test_split_rejects_fraction_outside_range(fraction: float) -> None:
    with pytest.raises(DataError, match=r"holdout_fraction must be in \[0, 1\)"):
        stratified_split([0, 0, 1, 1], fraction)


def test_each_class_is_grouped_as_a_pass_per_class_would_find_it() -> None:
    """``_per_class`` groups a million labels with one sort; each class's indices, before its shuffle, are those a
    pass over the labels for that class finds, in order, so every subset and split stays as it was."""
    from coretune.data.splits import _per_class

    labels = np.random.default_rng(0).integers(0, 37, 2000)
    labels[labels == 5] = 6  # a class with no items is left out
    grouped = _per_class(labels.tolist(), seed=3, stream=1)
    assert [c for c, _ in grouped] == sorted(set(labels.tolist()))
    for c, shuffled in grouped:
        expected = np.random.default_rng([3, 1, c]).permutation(np.flatnonzero(labels == c))
        assert np.array_equal(shuffled, expected)
    assert _per_class([], seed=0, stream=0) == []
