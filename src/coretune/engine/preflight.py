"""Checks a run makes before its first optimiser step, so that a run that cannot train, or cannot learn, is refused
with one line instead of ending in a result of an untrained model: a training length of nothing or of no end
(:func:`training_length_problems`), a fit whose steps end before the validation that chooses its tested checkpoint
(:func:`check_validates_before_max_steps`), and a training split whose images are all one colour
(:func:`check_images_vary`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch import Tensor
from torch.utils.data import TensorDataset

from ..data import ImageFileDataset, LabeledImageDataset, SegmentationDataset, TaskData, load_rgb
from .optim import SCHEDULE_OPTION, unbounded_schedule_problem

__all__ = [
    "check_images_vary",
    "check_validates_before_max_steps",
    "single_colour",
    "steps_before_first_validation",
    "training_length_problems",
]


def training_length_problems(
    trainer: Mapping[str, Any], schedule: str | None = None, schedule_option: str = SCHEDULE_OPTION
) -> list[str]:
    """What makes the ``--trainer.*`` options ``trainer`` (a parsed configuration) train nothing, or without end
    under a learning-rate ``schedule`` that decays over the run's length (one sentence with its fix each; empty when
    the run has a length): ``max_epochs 0``, ``max_steps 0`` or ``limit_train_batches 0`` (no optimiser step: the run
    would record its untrained model as the result), and ``max_epochs -1`` (or ``max_time`` alone) without
    ``max_steps`` (Lightning trains without end; the schedule, set by ``schedule_option``, has no length)."""
    max_epochs, max_steps = trainer.get("max_epochs"), trainer.get("max_steps", -1)
    limit = trainer.get("limit_train_batches")
    untrained = "runs no optimiser step, so the run would record its untrained model as a result"
    problems = []
    if max_epochs == 0:
        problems.append(f"--trainer.max_epochs 0 {untrained}: pass --trainer.max_epochs 1 or more")
    if max_steps == 0:
        problems.append(f"--trainer.max_steps 0 {untrained}: pass --trainer.max_steps 1 or more (-1: no step limit)")
    if limit is not None and not isinstance(limit, bool) and limit == 0:
        problems.append(
            f"--trainer.limit_train_batches {limit} {untrained}: pass a number of batches >= 1 or a fraction in "
            "(0, 1] (1.0: every batch)"
        )
    no_epoch_limit = max_epochs == -1 or (max_epochs is None and trainer.get("max_time") is not None)
    problem = unbounded_schedule_problem(schedule or "cosine", schedule_option)
    if no_epoch_limit and max_steps in (-1, None) and problem:
        what = "--trainer.max_epochs -1 (no epoch limit)" if max_epochs == -1 else (
            "--trainer.max_time without --trainer.max_epochs (no epoch limit)"
        )  # fmt: skip
        problems.append(f"{what} {problem}")
    return problems


# -- validation before the last step --------------------------------------------------------------------------
def steps_before_first_validation(trainer: Any, datamodule: TaskData) -> int | None:
    """The optimiser steps a fit of ``trainer`` takes before its first validation, from the data module's training
    batches per epoch (its ``steps_per_epoch`` when it has one, else its training loader's length); None when it
    cannot tell (an iterable loader) or does not validate by batches and epochs."""
    batches = datamodule.steps_per_epoch
    if not isinstance(batches, int):
        try:
            batches = len(datamodule.train_dataloader())
        except (TypeError, NotImplementedError):  # an iterable dataset
            return None
    limit = trainer.limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    accumulate = max(1, trainer.accumulate_grad_batches)
    per_epoch = math.ceil(batches / accumulate)
    every, interval = trainer.check_val_every_n_epoch, trainer.val_check_interval
    if isinstance(interval, float):  # a fraction of an epoch, in the epochs check_val_every_n_epoch names
        return (max(1, every or 1) - 1) * per_epoch + math.ceil(max(1, int(batches * interval)) / accumulate)
    if every is None:  # every `interval` batches, counted over the run
        return math.ceil(interval / accumulate)
    return (every - 1) * per_epoch + math.ceil(min(interval, batches) / accumulate)


def check_validates_before_max_steps(trainer: Any, datamodule: TaskData, selection_hint: str, best: str) -> None:
    """Refuse, before training, a fit that tests the checkpoint validation chooses (``best``, by ``selection_hint``)
    but whose ``--trainer.max_steps`` ends it before its first validation: no validation would ever choose it (the
    fit trained, then failed looking for it).

    Raises:
        ValueError: naming the steps it takes and needs, and the fixes.
    """
    max_steps = trainer.max_steps
    if max_steps is None or max_steps < 0 or trainer.limit_val_batches == 0:
        return
    first = steps_before_first_validation(trainer, datamodule)
    if first is not None and max_steps < first:
        raise ValueError(
            f"--trainer.max_steps {max_steps} ends this fit before its first validation, after {first} optimiser "
            f"steps, so no validation would choose the {best} it ends by testing ({selection_hint}): pass "
            f"--trainer.max_steps {first} or more, or test the last weights (--data.selection last_checkpoint)"
        )


# -- images with signal ---------------------------------------------------------------------------------------
def _pixels(dataset: Any) -> Iterator[np.ndarray] | None:
    """The ``(H, W, C)`` uint8 pixels of each image of one of coretune's datasets, as decoded before any transform
    (the training crops' draft size), lazily; None for a dataset of another kind."""
    if isinstance(dataset, LabeledImageDataset):
        raw = dataset.with_transform(None, dataset.draft_size)
        return (np.asarray(raw[i][0]) for i in range(len(raw)))
    if isinstance(dataset, SegmentationDataset):
        return (np.asarray(load_rgb(path, orient=False)) for path in dataset.images)
    if isinstance(dataset, ImageFileDataset):
        return (np.asarray(load_rgb(path, dataset.draft_size, dataset.orient)) for path in dataset.paths)
    if isinstance(dataset, TensorDataset) and isinstance(images := dataset.tensors[0], Tensor) and images.dim() == 4:
        return (image.permute(1, 2, 0).numpy() for image in images)  # (N, C, H, W) uint8: pre-training's cache
    return None


def _files(dataset: Any) -> list[str]:
    parts = getattr(dataset, "parts", None) or [dataset]
    files = [getattr(part, "paths", None) or getattr(part, "images", None) for part in parts]
    return [str(f) for found in files if isinstance(found, list) for f in found if isinstance(f, str | os.PathLike)]


def single_colour(dataset: Any) -> tuple[int, ...] | None:
    """The one colour every pixel of every image of ``dataset`` has (a split without signal: its pixel standard
    deviation is 0), else None; also None for datasets of other kinds than coretune's (their items unknown). Reads
    images until two pixels differ: the first image of a photo, every image only when they are all alike."""
    colour: np.ndarray | None = None
    for part in getattr(dataset, "parts", None) or [dataset]:
        images = _pixels(part)
        if images is None:
            return None
        for pixels in images:
            flat = pixels.reshape(-1, pixels.shape[-1]) if pixels.ndim == 3 else pixels.reshape(-1, 1)
            colour = flat[0] if colour is None else colour
            if flat.shape[-1] != colour.shape[-1] or (flat != colour).any():
                return None
    return None if colour is None else tuple(int(v) for v in colour)


def check_images_vary(train_dataset: Any) -> None:
    """Refuse, before training, a training split (``train_dataset``, a data module's; None: none yet) whose images
    are all one colour: its normalisation statistics are degenerate (pixel standard deviation 0), so a model learns
    nothing from it (a fit on it ended at chance with no warning, or with the chance guard blaming the learning
    rate). A blank validation or test split is not refused: identical images legitimately get one prediction.

    Raises:
        ValueError: naming the split, its images' colour and the statistic.
    """
    if train_dataset is None or (colour := single_colour(train_dataset)) is None:
        return
    files = _files(train_dataset)
    where = f" under {os.path.commonpath([os.path.dirname(f) for f in files])}" if files else ""
    raise ValueError(
        f"the {len(train_dataset)} images of the training split{where} are all one colour, {_colour(colour)}: "
        "their pixel standard deviation is 0, so they hold no signal to learn from: check that the files "
        "were written right (not blank), or point --data.root at the real images"
    )


def _colour(values: tuple[int, ...]) -> str:
    return f"RGB ({', '.join(map(str, values))})" if len(values) == 3 else f"value {values[0]}"
