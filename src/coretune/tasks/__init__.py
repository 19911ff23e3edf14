"""Tasks: what the data, the network on the backbone, the predictions and their scores are (the task seam,
:mod:`.base`). Classification is the default."""

from .base import Batch, Task
from .classification import ClassificationTask
from .segmentation import SegmentationTask

__all__ = ["DEFAULT_TASK", "TASKS", "Batch", "ClassificationTask", "SegmentationTask", "Task", "get_task"]

DEFAULT_TASK = ClassificationTask.name
"""The task of ``coretune fit`` without ``--task``, and of checkpoints that record none."""

TASKS: dict[str, type[Task]] = {ClassificationTask.name: ClassificationTask, SegmentationTask.name: SegmentationTask}
"""The tasks :class:`coretune.engine.FineTuner` accepts (``task=``, ``coretune fit --task NAME``), by name."""


def get_task(name: str) -> type[Task]:
    """The task class registered as ``name``.

    Raises:
        ValueError: no task has that name (the message lists them).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]
