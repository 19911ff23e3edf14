"""Image classification: batches ``(x, y)``; top-1/top-5, per-class accuracy and the confusion matrix."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from ..data import ImageClassificationData
from .base import Task

__all__ = ["ClassificationTask"]


class ClassificationTask(Task):
    """The default task of :class:`coretune.engine.FineTuner` (``--task classification``): an image folder
    (:class:`~coretune.data.ImageClassificationData`), the objective's linear classifier on the backbone's pooled
    features, top-1 chooses the best checkpoint."""

    name = "classification"
    data_class = ImageClassificationData
    monitor = "top1"
    monitor_label = "top-1"
    summary_keys: ClassVar[tuple[str, ...]] = ("train/loss", "train/top1", "val/loss", "val/top1")
    metric_names: ClassVar[tuple[str, ...]] = ("top1", "top5")
    no_validation_split = "no separate val/ folder and no --data.val_fraction"
    validation_split_fix = "--data.val_fraction 0.1"

    def image_transform(
        self, image_size: int, mean: tuple[float, float, float], std: tuple[float, float, float]
    ) -> tuple[Callable[[Any], Tensor], int]:
        """How this task's test split reads one image, and the draft size to decode it at (the data module's
        ``test_transform``): ``coretune predict`` reads a folder of new images the same way."""
        return self.data_class.test_transform(image_size, mean, std)

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
        }

    def summary_line(self, test: Mapping[str, Any]) -> str:
        return f"top-1 {100 * test['top1']:.2f}%  top-5 {100 * test['top5']:.2f}%"
