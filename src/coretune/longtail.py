"""Long-tail measures: the many-, medium- and few-shot groups of classes by their training images (Liu et al., CVPR
2019, "Large-scale long-tailed recognition in an open world", OLTR) and the top-1 of each group.

A class with more than ``many`` training images is many-shot, one with fewer than ``few`` few-shot, the rest
(``few`` to ``many`` images, both included) medium-shot: the paper's split at 100 and 20 (its code counts 100
images as many-shot and 20 as few-shot; Kang et al. 2020's decoupling code, which most later work reports with,
follows the paper's strict bounds, as here). A group's top-1 is the mean of its classes' top-1 (each class's
correct predictions over its evaluation images), as OLTR's ``shot_acc`` computes it; on a balanced test set it is
the group's share of correct images. A class without an evaluation image is left out of its group's mean; a group
without a scored class has no top-1 (``None``: strict JSON has no NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["DEFAULT_SHOT_THRESHOLDS", "SHOT_GROUPS", "shot_accuracy", "shot_entry", "shot_groups", "shot_masks"]

#: The groups, head to tail.
SHOT_GROUPS = ("many", "medium", "few")
#: ``(many, few)``: Liu et al. 2019's bounds (more than 100 training images: many-shot; fewer than 20: few-shot).
DEFAULT_SHOT_THRESHOLDS = (100, 20)


def shot_masks(train_counts: Sequence[int] | Tensor, thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS) -> Tensor:
    """``(3, K)`` bool: which of the ``K`` classes (training images ``train_counts``) is in each of
    :data:`SHOT_GROUPS`, by ``thresholds`` ``(many, few)``."""
    many, few = int(thresholds[0]), int(thresholds[1])
    if not 0 <= few <= many:
        raise ValueError(f"shot thresholds must be (many, few) with 0 <= few <= many, got {tuple(thresholds)}")
    counts = torch.as_tensor(train_counts, dtype=torch.int64)
    is_many, is_few = counts > many, counts < few
    return torch.stack([is_many, ~is_many & ~is_few, is_few])


def shot_groups(
    train_counts: Sequence[int] | Tensor, thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS
) -> dict[str, list[int]]:
    """The class indices of each of :data:`SHOT_GROUPS` (ascending)."""
    masks = shot_masks(train_counts, thresholds)
    return {group: torch.nonzero(mask).flatten().tolist() for group, mask in zip(SHOT_GROUPS, masks, strict=True)}


def shot_accuracy(
    confusion: Tensor, train_counts: Sequence[int] | Tensor, thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS
) -> dict[str, float | None]:
    """Each group's top-1 (the mean of its classes' top-1) from a ``(K, K)`` confusion matrix (rows: true classes,
    columns: predictions) and the ``K`` classes' training images; ``None`` for a group without a scored class."""
    confusion = confusion.double()
    total, correct = confusion.sum(dim=1), confusion.diagonal()
    scored = total > 0
    top1 = torch.where(scored, correct / total.clamp(min=1), torch.zeros_like(total))
    members = (shot_masks(train_counts, thresholds).to(confusion.device) & scored).double()  # (3, K)
    sizes = members.sum(dim=1)
    means = (members @ top1) / sizes.clamp(min=1)
    return {group: float(m) if n > 0 else None for group, m, n in zip(SHOT_GROUPS, means, sizes, strict=True)}


def shot_entry(
    confusion: Tensor,
    train_counts: Sequence[int],
    class_names: Sequence[str],
    thresholds: Sequence[int] = DEFAULT_SHOT_THRESHOLDS,
) -> dict[str, Any]:
    """``results.json``'s ``shot_groups`` (JSON values): the thresholds, the training images per class, and for each
    group its top-1 (``None`` when it has no scored class) and its classes by name."""
    accuracy = shot_accuracy(confusion, train_counts, thresholds)
    groups = shot_groups(train_counts, thresholds)
    return {
        "thresholds": {"many_above": int(thresholds[0]), "few_below": int(thresholds[1])},
        "train_class_counts": dict(zip(class_names, (int(n) for n in train_counts), strict=True)),
        **{g: {"top1": accuracy[g], "classes": [class_names[c] for c in groups[g]]} for g in SHOT_GROUPS},
    }
