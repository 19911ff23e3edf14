"""Stratified, seeded subsets and hold-out splits of a labelled set.

Both helpers work class by class: each class ``c`` is shuffled by its own generator seeded with ``(seed, c)``,
so a class's choice does not depend on the other classes, the same seed always gives the same indices, and for
a fixed seed a smaller fraction's subset is contained in a larger one's (a prefix of the same permutation) — a
label-fraction sweep (the paper's semi-supervised settings) nests. Per-class counts are rounded to the nearest
integer with halves rounded up (2.5 → 3), so every class keeps its share to within half an image and a
class-imbalanced set keeps its proportions.

:func:`long_tailed_subset` makes a balanced set long-tailed by the exponential profile of Cao et al. (NeurIPS 2019,
LDAM-DRW; CIFAR-10/100-LT): :func:`long_tailed_counts`, then which images of each class stay is seeded the same way
(its own stream), so for a fixed seed a milder ratio's subset contains a steeper one's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import DataError

__all__ = ["long_tailed_counts", "long_tailed_subset", "stratified_split", "stratified_subset"]

_SUBSET_STREAM, _SPLIT_STREAM, _LONG_TAIL_STREAM = 0, 1, 2  # independent random streams for the three helpers


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5 + 1e-9)  # the epsilon absorbs float error, e.g. 0.35 * 10 = 3.4999999999999996


def _per_class(labels: Sequence[int] | np.ndarray, seed: int, stream: int) -> list[tuple[int, np.ndarray]]:
    """``(class, its indices in a seeded random order)`` for every class present, classes ascending."""
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    # one stable sort groups each class's indices, ascending (as np.flatnonzero(y == c) lists them), in O(n log n)
    # instead of a pass over every label for each class (ImageNet: 1,000 passes over 1.28 M labels)
    order = np.argsort(y, kind="stable")
    grouped = y[order]
    starts = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1]))) if len(y) else order
    classes = grouped[starts]
    ends = [*starts[1:].tolist(), len(y)][: len(starts)]
    return [
        (c, np.random.default_rng([seed, stream, c]).permutation(order[start:end]))
        for c, start, end in zip(classes.tolist(), starts.tolist(), ends, strict=True)
    ]


def _class_name(c: int, class_names: Sequence[str] | None) -> str:
    return repr(class_names[c]) if class_names is not None else str(c)


def stratified_subset(
    labels: Sequence[int] | np.ndarray,
    fraction: float,
    seed: int = 0,
    *,
    class_names: Sequence[str] | None = None,
    name: str = "fraction",
) -> list[int]:
    """Sorted indices of a stratified random subset: ``round(fraction · n_c)`` items of each class ``c``.

    Every class keeps at least one item: when the rounded count of some class is 0 this raises instead of
    silently dropping the class or over-sampling it. ``class_names`` and ``name`` (the option's name) only
    make the error messages clearer.

    Raises:
        DataError: ``fraction`` is not in (0, 1], or it keeps no item of some class.
    """
    if not 0 < fraction <= 1:
        raise DataError(f"{name} must be in (0, 1] (1 keeps every image), got {fraction}")
    kept: list[int] = []
    starved: list[tuple[int, int]] = []  # (n_c, c) of classes that would keep nothing
    for c, order in _per_class(labels, seed, _SUBSET_STREAM):
        k = _round_half_up(fraction * len(order))
        if k == 0:
            starved.append((len(order), c))
        kept.extend(order[:k].tolist())
    if starved:
        n, c = min(starved)
        others = f" nor of {len(starved) - 1} other class(es)" if len(starved) > 1 else ""
        need = math.ceil(0.5 / n * 1e4) / 1e4  # fraction · n >= 0.5 rounds to 1; rounded up to 4 decimals
        raise DataError(
            f"{name} {fraction:g} keeps no image of class {_class_name(c, class_names)} ({n} images)"
            f"{others}: raise it to ≥ {need:g}"
        )
    return sorted(kept)


def stratified_split(
    labels: Sequence[int] | np.ndarray,
    holdout_fraction: float,
    seed: int = 0,
    *,
    class_names: Sequence[str] | None = None,
    name: str = "holdout_fraction",
) -> tuple[list[int], list[int]]:
    """Sorted ``(kept, held_out)`` indices, holding out ``round(holdout_fraction · n_c)`` of each class ``c``.

    With ``holdout_fraction > 0`` every class has at least one item on each side (its hold-out count is
    clamped to ``[1, n_c - 1]``), so a validation split carved out of a training set sees every class;
    ``holdout_fraction == 0`` holds nothing out.

    Raises:
        DataError: ``holdout_fraction`` is not in [0, 1), or a class has fewer than 2 items to split.
    """
    if not 0 <= holdout_fraction < 1:
        raise DataError(f"{name} must be in [0, 1) (0 holds nothing out), got {holdout_fraction}")
    y = np.asarray(labels).reshape(-1)
    if holdout_fraction == 0:
        return list(range(len(y))), []
    kept: list[int] = []
    held: list[int] = []
    for c, order in _per_class(y, seed, _SPLIT_STREAM):
        n = len(order)
        if n < 2:
            raise DataError(
                f"{name} {holdout_fraction:g} cannot hold out images of class {_class_name(c, class_names)}: "
                f"it has {n} image, and both splits need one; add images to it, or set {name} to 0 and "
                "use a separate validation folder"
            )
        k = min(max(_round_half_up(holdout_fraction * n), 1), n - 1)
        held.extend(order[:k].tolist())
        kept.extend(order[k:].tolist())
    return sorted(kept), sorted(held)


def long_tailed_counts(available: Sequence[int], ratio: float) -> list[int]:
    """Images per class of the exponential long-tailed profile with imbalance ``ratio`` (Cao et al. 2019, LDAM-DRW's
    CIFAR-LT): class ``i`` of ``C`` (in class-index order) keeps ``n_i = ⌊n_max · (1/ratio)^(i/(C−1))⌋`` images, from
    ``n_max`` for class 0 down to ``⌊n_max / ratio⌋`` for the last. ``n_max`` is the smallest class's count in
    ``available`` (the images per class of a balanced set such as CIFAR's 5,000, as in Cao et al.; on an uneven
    folder every class can then give its share, and the head-to-tail ratio is ``ratio`` exactly). One class keeps
    ``n_max``.

    Raises:
        DataError: ``ratio`` < 1, or the profile leaves a class with no image (``n_max < ratio``).
    """
    if not ratio >= 1:
        raise DataError(f"imbalance_ratio must be >= 1 (1: the classes as they are; 100: CIFAR-10-LT's), got {ratio}")
    if not available:
        return []
    n_max, last = min(available), len(available) - 1
    counts = [int(n_max * (1 / ratio) ** (i / last)) if last else n_max for i in range(len(available))]
    if counts[-1] == 0:
        raise DataError(
            f"imbalance_ratio {ratio:g} leaves the last class with 0 images ({n_max} images per class at most, "
            f"⌊{n_max} / {ratio:g}⌋ = 0): lower it to ≤ {n_max}"
        )
    return counts


def long_tailed_subset(
    labels: Sequence[int] | np.ndarray,
    ratio: float,
    seed: int = 0,
    *,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
) -> list[int]:
    """Sorted indices of a long-tailed subset: :func:`long_tailed_counts` images of each class (class-index order),
    drawn per class with ``seed`` (its own stream, apart from :func:`stratified_subset`'s and
    :func:`stratified_split`'s). ``num_classes`` (default: the largest label + 1) counts a class without any item.

    Raises:
        DataError: as :func:`long_tailed_counts`, or a class has no item at all.
    """
    per_class = dict(_per_class(labels, seed, _LONG_TAIL_STREAM))
    k = num_classes if num_classes is not None else max(per_class, default=-1) + 1
    if absent := [c for c in range(k) if c not in per_class]:
        raise DataError(
            f"imbalance_ratio needs images of every class: class {_class_name(absent[0], class_names)} has none; "
            "add images to it or remove the class"
        )
    counts = long_tailed_counts([len(per_class[c]) for c in range(k)], ratio)
    return sorted(i for c, n in enumerate(counts) for i in per_class[c][:n].tolist())
