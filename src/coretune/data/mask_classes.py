"""The number of classes a segmentation set's masks imply, within limits (``SegmentationData`` without
``num_classes`` or a class-name file): classes ``0 … the largest mask value``, provided that every one of them
occurs in some mask and that none reaches the ignored value.

Without these checks one stray pixel of value 37 in masks of classes 0–4 made a silent 38-class model (33 classes
that never occur, each an untrainable output and a NaN IoU), and 16-bit masks whose ignored pixels are 65535 made a
65536-class model whose confusion matrix alone needs 34 GB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import DataError

__all__ = ["inferred_class_count", "value_ranges"]


def value_ranges(values: Sequence[int]) -> str:
    """Sorted whole numbers as ranges: ``[5, 6, 7, 9]`` → ``"5–7, 9"``."""
    parts: list[str] = []
    start = previous = None
    for value in [*sorted(values), None]:
        if value is not None and previous is not None and value == previous + 1:
            previous = value
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}–{previous}")
        start = previous = value
    return ", ".join(parts)


def inferred_class_count(splits: Sequence[Any], ignore_index: int) -> int:
    """The number of classes the masks of ``splits`` (``SegmentationDataset``s: each mask file and its distinct
    values, ``masks`` and ``classes_present``) imply: the largest value other than ``ignore_index``, plus 1.

    Raises:
        DataError: naming the first mask file and its value, when a value exceeds ``ignore_index`` (it would make
            more classes than the ignored value allows, e.g. 65536 for a 16-bit mask's 65535), or when values
            between 0 and the largest occur in no mask (a stray value, or classes the masks do not hold: the count
            must then be given); or when no mask holds a labelled pixel.
    """
    masks = [mask for split in splits for mask in split.masks]
    labelled = [v[v != ignore_index] for split in splits for v in split.classes_present]
    for mask, present in zip(masks, labelled, strict=True):
        if present.size and (above := int(present.max())) > ignore_index:
            raise DataError(
                f"mask {mask} holds value {above}, above the ignored value {ignore_index}: inferred from the masks, "
                f"the classes would be 0–{above} ({above + 1} classes, when class indices must stay below "
                f"{ignore_index}). If {above} marks pixels to ignore, remap it to {ignore_index} in the masks; "
                "else fix the mask, or give the classes (--data.num_classes, or a classes.txt)"
            )
    seen = np.unique(np.concatenate(labelled)) if labelled else np.array([], dtype=np.int64)
    if not seen.size:
        return 0  # every pixel ignored: the training-mask check names it
    largest = int(seen[-1])
    missing = np.setdiff1d(np.arange(largest + 1), seen)
    if missing.size:
        stray = int(seen[seen > missing[0]][0])  # the first value beyond the first class that never occurs
        mask = next(m for m, present in zip(masks, labelled, strict=True) if (present == stray).any())
        raise DataError(
            f"mask {mask} holds value {stray}, but no mask holds {value_ranges(missing.tolist())}: inferred from the "
            f"masks, the classes would be 0–{largest}, {missing.size} of which never occur. If {stray} is a stray "
            f"value, fix the mask; else give the classes: --data.num_classes {largest + 1} (or a classes.txt naming "
            "them)"
        )
    return largest + 1
