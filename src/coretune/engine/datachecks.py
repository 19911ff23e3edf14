"""The data module checks of a fine-tuning run, made once at its set-up (:func:`check_data`, which
:meth:`coretune.engine.FineTuner.setup` calls for every stage): what the task needs of the data, splits shared under
DDP, ``--trainer.limit_<split>_batches`` that keep no batch or leave groups out, adversarial training's
normalisation, blank training images, and warnings for a cross-batch memory of an epoch, other normalisation than the
pre-trained weights', test or validation images that are training images, and the objective's views.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from ..data import TaskData, check_shareable, trained_items
from ..data.transforms import other_normalisation
from ..distributed import world_size
from ..robust.batches import AdversarialBatches
from .preflight import check_images_vary

__all__ = ["check_batch_limits", "check_data"]

_LIMITED_SPLITS = {"fit": ("train", "val", "test"), "validate": ("val",), "test": ("test",)}
"""The splits whose ``--trainer.limit_<split>_batches`` each stage checks (``coretune fit`` tests at its end)."""
_SPLIT_NAMES = {"train": "training", "val": "validation", "test": "test"}
_SPLIT_MEMBERS: dict[str, Callable[[TaskData], tuple[Callable[[], Any], Any]]] = {
    "train": lambda data: (data.train_dataloader, data.train_dataset),
    "val": lambda data: (data.val_dataloader, data.val_dataset),
    "test": lambda data: (data.test_dataloader, data.test_dataset),
}
"""A split's loader and dataset (None before ``setup``, or no such split) by its name."""


def check_data(model: Any, datamodule: TaskData | None, stage: str) -> None:
    """Check ``datamodule`` (``None``: the trainer has none) for ``model`` (a FineTuner) at the start of ``stage``
    (``fit``, ``validate``, ``test``, ``predict``): refuse what cannot run, warn about what would mislead, and set
    the data module's ``train_views`` to the objective's.

    Raises:
        ValueError: one line naming the problem and its fix.
    """
    if datamodule is not None:
        model.task.check_data(datamodule, stage)
    if datamodule is not None:
        if stage == "fit":  # at the start, not at the final test (shared under DDP)
            for split, dataset in (("validation", datamodule.val_dataset), ("test", datamodule.test_dataset)):
                if dataset is not None:
                    check_shareable(dataset, split)
        check_batch_limits(model, datamodule, _LIMITED_SPLITS.get(stage, ()))
    if stage != "fit":
        return
    if isinstance(model.batch_transform, AdversarialBatches) and datamodule is None:
        raise ValueError(
            "adversarial training attacks images in pixel space and needs the data module's normalisation "
            "(its mean and std): fit with a data module, e.g. coretune's ImageClassificationData"
        )
    views = model.objective.input_views
    if views > 1 and (datamodule is None or not datamodule.makes_views):
        raise ValueError(
            f"objective {model.objective.name!r} needs {views} augmented views of each training image "
            "(forward's inputs are a second view): use coretune's ImageClassificationData, or a data "
            "module with makes_views = True whose batches, with its train_views attribute at 2, are "
            "((view_1, view_2), labels)"
        )
    if datamodule is None:
        return
    check_images_vary(datamodule.train_dataset)
    _warn_memory_spans_epoch(model, datamodule)
    _warn_other_normalization(model, datamodule)
    _warn_test_in_training(datamodule)
    datamodule.train_views = views  # also back to 1 when a data module is reused for another method


def check_batch_limits(model: Any, datamodule: TaskData, splits: tuple[str, ...]) -> None:
    """Refuse, at the start, a limit of a task's validation or test batches that would leave groups out
    (:attr:`~coretune.tasks.Task.scores_every_group`: domain generalization), and a fraction
    ``--trainer.limit_<split>_batches`` in (0, 1) that keeps no batch of a split on the process with the fewest
    (Lightning refuses it with a traceback when that split's loop starts: the test split's after the whole
    training, and under DDP on that process alone while the others wait).

    Raises:
        ValueError: naming the option, the split's batches and the smallest fraction that keeps one.
    """
    trainer = model.trainer
    for split in splits:
        limit = getattr(trainer, f"limit_{split}_batches", 1.0)
        # all batches, or none (the split off); an int is a number of batches: 1 is one batch
        whole = (isinstance(limit, float) and limit == 1.0) or limit == 0
        if model.task.scores_every_group and split in ("val", "test") and not whole:
            raise ValueError(
                f"--trainer.limit_{split}_batches={limit}: {model.task.name} scores each domain on all its images, "
                f"and the {_SPLIT_NAMES[split]} loader reads one domain after another, so part of it would leave "
                "whole domains out of the score: pass 1.0 (all batches)"
            )
        loader, dataset = _SPLIT_MEMBERS[split](datamodule)
        if not isinstance(limit, float) or not 0 < limit < 1 or dataset is None:
            continue
        built = loader()
        if not isinstance(built, DataLoader) or not hasattr(built.dataset, "__len__"):
            continue  # several loaders (checked by Lightning one by one), or an iterable dataset
        batches = len(built)
        mine = torch.tensor(float(batches), device=trainer.strategy.root_device)
        fewest = int(trainer.strategy.reduce(mine, reduce_op="min"))
        if fewest > 0 and int(fewest * limit) == 0:
            least = math.ceil(100 / fewest) / 100
            where = " on the process with the fewest" if world_size() > 1 else ""
            fix = f"at least {least}, " if least < 1 else ""
            raise ValueError(
                f"--trainer.limit_{split}_batches={limit} keeps no batch of the {_SPLIT_NAMES[split]} split "
                f"({limit} × {fewest} batch(es){where} < 1): pass {fix}a whole number of batches "
                f"(--trainer.limit_{split}_batches=1), or 1.0 for all of them"
            )


def _warn_other_normalization(model: Any, datamodule: TaskData) -> None:
    """Warn when the data is normalised otherwise than the pre-trained weights were trained with (their
    checkpoint or timm name says how: :func:`coretune.models.normalization_of`; :func:`other_normalisation`)."""
    trained = getattr(model.backbone, "pretrained_normalization", None)
    if (why := other_normalisation(trained, datamodule.mean, datamodule.std, model.hparams.weights)) is not None:
        rank_zero_warn(why)


def _warn_test_in_training(datamodule: TaskData) -> None:
    """Warn when test images are training images too (``test_files_in_training``: a test folder inside the
    training folder, a class folder symlinked into it): the test score is then partly a training accuracy; and
    when a validation folder's are (``val_files_in_training``): ``best.ckpt`` is then chosen on them."""
    for shared, dataset, name, consequence in (
        (datamodule.test_files_in_training(), datamodule.test_dataset, "test",
         "the test score is partly a training accuracy"),
        (datamodule.val_files_in_training(), datamodule.val_dataset, "validation",
         "best.ckpt is chosen partly on training accuracy"),
    ):  # fmt: skip
        if shared:
            scored = len(dataset if dataset is not None else shared)
            rank_zero_warn(
                f"{len(shared)} of the {scored} {name} images are training images too (the same files, e.g. "
                f"{shared[0]}): {consequence}; keep the {name} images out of the training folder (a symlink "
                "into it counts)"
            )


def _warn_memory_spans_epoch(model: Any, datamodule: TaskData) -> None:
    """Warn when a cross-batch memory holds an epoch of rows (issue 40): the images come back in a fresh order
    each epoch, so half the anchors or more then meet their own earlier feature among the memory's positives,
    an easy positive that only looks like more data (every anchor from two epochs' rows)."""
    size = model.objective.memory_size
    train, batch = datamodule.train_dataset, datamodule.batch_size
    if not size or train is None or not batch:
        return
    rows = trained_items(len(train), batch, world_size())
    rows *= 2 if isinstance(model.batch_transform, AdversarialBatches) else 1
    if size >= rows:
        rank_zero_warn(
            f"the cross-batch memory's size {size} holds an epoch's {rows} training rows or more: half the anchors or "
            f"more meet their own earlier feature in the memory (an easy positive; all of them from {2 * rows} rows). "
            f"Half an epoch, --objective.memory.size {rows // 2}, keeps it to about one anchor in eight"
        )
