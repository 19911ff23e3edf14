"""Image classification: batches ``(x, y)``; top-1/top-5, per-class accuracy and the confusion matrix."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

__all__ = ["ClassificationTask"]


class ClassificationTask:
    """The default task of :class:`coretune.engine.FineTuner`."""

    name = "classification"

    @staticmethod
    def unpack(batch: Any) -> tuple[Tensor, Tensor]:
        """Images and labels of a batch ``(x, y, ...)``."""
        return batch[0], batch[1]

    @staticmethod
    def train_metrics(num_classes: int) -> MetricCollection:
        return MetricCollection(
            compute_groups=False,
            metrics={
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
            },
        )

    @staticmethod
    def eval_metrics(num_classes: int) -> MetricCollection:
        return MetricCollection(
            compute_groups=False,
            metrics={
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
                "per_class": MulticlassAccuracy(num_classes, top_k=1, average="none"),
                "confusion": MulticlassConfusionMatrix(num_classes),
            },
        )
