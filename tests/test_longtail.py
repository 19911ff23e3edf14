"""Many/medium/few-shot groups (Liu et al. 2019; Kang et al. 2020's strict bounds) and their top-1, against a slow
per-class loop."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coretune.longtail import SHOT_GROUPS, shot_accuracy, shot_entry, shot_groups


def slow_shot_accuracy(preds: list[int], labels: list[int], train_counts: list[int], many: int, few: int) -> dict:
    """OLTR's shot_acc, written as a loop over the classes present in the evaluation labels."""
    groups: dict[str, list[float]] = {g: [] for g in SHOT_GROUPS}
    for c in sorted(set(labels)):
        rows = [i for i, y in enumerate(labels) if y == c]
        top1 = sum(preds[i] == c for i in rows) / len(rows)
        n = train_counts[c]
        groups["many" if n > many else "few" if n < few else "medium"].append(top1)
    return {g: (sum(v) / len(v) if v else None) for g, v in groups.items()}


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    k=st.integers(2, 8),
    thresholds=st.tuples(st.integers(0, 150), st.integers(0, 150)).map(lambda t: (max(t), min(t))),
)
def test_vectorised_group_top1_equals_the_slow_loop(data: st.DataObject, k: int, thresholds: tuple[int, int]) -> None:
    n = data.draw(st.integers(1, 40))
    labels = data.draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    preds = data.draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    train_counts = data.draw(st.lists(st.integers(0, 300), min_size=k, max_size=k))
    confusion = torch.zeros(k, k, dtype=torch.int64)
    for y, p in zip(labels, preds, strict=True):
        confusion[y, p] += 1
    got = shot_accuracy(confusion, train_counts, thresholds)
    expected = slow_shot_accuracy(preds, labels, train_counts, *thresholds)
    assert got.keys() == expected.keys()
    for group in SHOT_GROUPS:
        assert (got[group] is None) == (expected[group] is None)
        if expected[group] is not None:
            assert got[group] == pytest.approx(expected[group], abs=1e-12)


def test_bounds_are_strict_and_an_empty_group_is_null_in_strict_json() -> None:
    counts = [101, 100, 20, 19, 5000]
    assert shot_groups(counts) == {"many": [0, 4], "medium": [1, 2], "few": [3]}
    # CIFAR-10-LT at R = 100 with 10% of the labels (500 … 5 images): the default bounds and lower ones
    lt10 = [500, 300, 180, 108, 65, 39, 23, 14, 8, 5]
    assert shot_groups(lt10) == {"many": [0, 1, 2, 3], "medium": [4, 5, 6], "few": [7, 8, 9]}
    assert shot_groups(lt10, (50, 10)) == {"many": [0, 1, 2, 3, 4], "medium": [5, 6, 7], "few": [8, 9]}
    confusion = torch.eye(3, dtype=torch.int64) * 4
    entry = shot_entry(confusion, [200, 150, 120], ["a", "b", "c"])
    assert entry["many"] == {"top1": 1.0, "classes": ["a", "b", "c"]}
    assert entry["medium"] == {"top1": None, "classes": []} and entry["few"]["top1"] is None
    assert entry["thresholds"] == {"many_above": 100, "few_below": 20}
    assert entry["train_class_counts"] == {"a": 200, "b": 150, "c": 120}
    json.dumps(entry, allow_nan=False)
    with pytest.raises(ValueError, match=r"^shot thresholds must be \(many, few\) with 0 <= few <= many, got \(5, 9\)"):
        shot_groups([1, 2], (5, 9))
