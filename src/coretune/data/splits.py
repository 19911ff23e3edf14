"""Stratified, seeded subsets and hold-out splits of a labelled set.

Both helpers work class by class: each class ``c`` is shuffled by its own generator seeded with ``(seed, c)``,
so a class's choice does not depend on the other classes, the same seed always gives the same indices, and for
a fixed seed a smaller fraction's subset is contained in a larger one's (a prefix of the same permutation) — a
label-fraction sweep (the paper's semi-supervised settings) nests. Per-class counts are rounded to the nearest
integer with halves rounded up (2.5 → 3), so every class keeps its share to within half an image and a
class-imbalanced set keeps its proportions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import DataError

__all__ = ["stratified_split", "stratified_subset"]

_SUBSET_STREAM, _SPLIT_STREAM = 0, 1  # independent random streams for the two helpers


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
