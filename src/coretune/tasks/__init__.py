"""Tasks: what the data, the network on the backbone, the predictions and their scores are (the task seam,
:mod:`.base`), each registered by name (:func:`register_task`). Classification is the default."""

# registered in this order, the order TASKS lists them in
from .base import TASKS, Batch, Task, get_task, moved_task_settings, register_task  # noqa: I001
from .classification import ClassificationTask
from .segmentation import SegmentationTask
from .domain_generalization import DomainGeneralizationTask

__all__ = [
    "DEFAULT_TASK",
    "TASKS",
    "Batch",
    "ClassificationTask",
    "DomainGeneralizationTask",
    "SegmentationTask",
    "Task",
    "get_task",
    "moved_task_settings",
    "register_task",
]

DEFAULT_TASK = ClassificationTask.name
"""The task of ``coretune fit`` without ``--task``, and of checkpoints that record none."""
