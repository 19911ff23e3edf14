"""Image classification: batches ``(x, y)``; top-1/top-5, per-class accuracy, the confusion matrix and the top-1 of
the many/medium/few-shot classes (:mod:`coretune.longtail`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from ..data import ImageClassificationData
from ..longtail import shot_accuracy, shot_entry, shot_masks
from .base import Task, register_task

__all__ = ["ClassificationTask", "scored_folder_options"]


def scored_folder_options(command: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """The image-folder data options that score one labelled folder with no training split (``coretune test``:
    ``command`` ``"test"``, ``coretune validate``: ``"validate"``), or None when the options name training data
    (``train_dir``, ``root/train``) or are not an image folder's.

    The folder is ``--data.test_dir`` (``test``) or ``--data.val_dir`` (``validate``), else ``root/test`` or
    ``root/val``, else ``root`` itself when it holds neither (its class folders)."""
    if options.get("dataset", "imagefolder") != "imagefolder" or options.get("train_dir") is not None:
        return None
    root = options.get("root")
    if root is not None and (not os.path.isdir(root) or os.path.isdir(os.path.join(root, "train"))):
        return None  # the data module's own message for a missing root; training data: the usual splits
    split, other = ("test", "val") if command == "test" else ("val", "test")
    folder = options.get(f"{split}_dir") or options.get(f"{other}_dir")
    if folder is None and root is not None:
        candidates = (os.path.join(root, split), os.path.join(root, other))
        folder = next((path for path in candidates if os.path.isdir(path)), root)
    if folder is None:
        return None
    # the training split only lends the class names (never loaded); subsets are off
    return {**options, "root": None, "train_dir": folder, f"{split}_dir": folder, f"{other}_dir": None,
            "label_fraction": 1.0, "val_fraction": 0.0, "imbalance_ratio": None, "cache_images": False}  # fmt: skip


@register_task("classification")
class ClassificationTask(Task):
    """The default task of :class:`coretune.engine.FineTuner` (``--task classification``): an image folder
    (:class:`~coretune.data.ImageClassificationData`), the objective's linear classifier on the backbone's pooled
    features, top-1 chooses the best checkpoint."""

    data_class = ImageClassificationData
    monitor = "top1"
    monitor_label = "top-1"
    summary_keys: ClassVar[tuple[str, ...]] = ("train/loss", "train/top1", "val/loss", "val/top1")
    metric_names: ClassVar[tuple[str, ...]] = ("top1", "top5")
    no_validation_split = "no separate val/ folder and no --data.val_fraction"
    validation_split_fix = "--data.val_fraction 0.1"
    supports_robust_eval = True
    supports_adversarial_training = True

    def scored_folder_options(self, command: str, options: dict[str, Any]) -> dict[str, Any] | None:
        """:func:`scored_folder_options`: one labelled image folder scored without training data."""
        return scored_folder_options(command, options)

    def check_data(self, datamodule: Any, stage: str) -> None:
        """Take the many/medium/few-shot bounds of an :class:`ImageClassificationData` (``shot_thresholds``); other
        data keep the defaults."""
        if isinstance(datamodule, ImageClassificationData):
            self.shot_thresholds = datamodule.shot_thresholds

    def eval_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), targets)

    def train_metrics(self, num_classes: int) -> MetricCollection:
        return MetricCollection(
            compute_groups=False,
            metrics={
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
            },
        )

    def val_metrics(self, num_classes: int) -> MetricCollection:
        """Top-1 and top-5, and the confusion matrix the many/medium/few-shot top-1 are computed from."""
        metrics = self.train_metrics(num_classes)
        metrics.add_metrics({"confusion": MulticlassConfusionMatrix(num_classes)})
        return metrics

    def val_values(self, computed: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Top-1 and top-5; with the training images per class known and the classes in two shot groups or more
        (:attr:`~coretune.tasks.Task.shot_thresholds`), also ``many_top1``, ``medium_top1`` and ``few_top1`` (the
        groups with a scored class)."""
        values = {key: value for key, value in computed.items() if key != "confusion"}
        if "confusion" in computed and self._split_into_groups(computed["confusion"].shape[0]):
            assert self.train_class_counts is not None
            accuracy = shot_accuracy(computed["confusion"], self.train_class_counts, self.shot_thresholds)
            device = computed["confusion"].device
            values |= {f"{g}_top1": torch.tensor(v, device=device) for g, v in accuracy.items() if v is not None}
        return values

    def _split_into_groups(self, num_classes: int) -> bool:
        """Whether the training images of the ``num_classes`` classes are known and put them in more than one shot
        group."""
        counts = self.train_class_counts
        if counts is None or len(counts) != num_classes:
            return False
        return int(shot_masks(counts, self.shot_thresholds).any(dim=1).sum()) > 1

    def test_metrics(self, num_classes: int) -> MetricCollection:
        return MetricCollection(
            compute_groups=False,
            metrics={
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
                "per_class": MulticlassAccuracy(num_classes, top_k=1, average="none"),
                "confusion": MulticlassConfusionMatrix(num_classes),
            },
        )

    def test_results(self, computed: Mapping[str, Tensor], class_names: list[str]) -> dict[str, Any]:
        return {
            "top1": float(computed["top1"]),
            "top5": float(computed["top5"]),
            "per_class_accuracy": dict(zip(class_names, computed["per_class"].tolist(), strict=True)),
            "confusion_matrix": computed["confusion"].tolist(),
            **self._shot_groups(computed["confusion"], class_names),
        }

    def _shot_groups(self, confusion: Tensor, class_names: list[str]) -> dict[str, Any]:
        """``{"shot_groups": …}`` (:func:`~coretune.longtail.shot_entry`: each group's top-1 and classes) when the
        training images per class are known, else nothing."""
        counts = self.train_class_counts
        if counts is None or len(counts) != len(class_names):
            return {}
        return {"shot_groups": shot_entry(confusion, counts, class_names, self.shot_thresholds)}

    def summary_line(self, test: Mapping[str, Any]) -> str:
        return f"top-1 {100 * test['top1']:.2f}%  top-5 {100 * test['top5']:.2f}%"
