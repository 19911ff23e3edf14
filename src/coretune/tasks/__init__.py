"""Tasks: what a batch is and how predictions are scored. Classification is the default."""

from .classification import ClassificationTask

__all__ = ["TASKS", "ClassificationTask"]

TASKS: dict[str, type[ClassificationTask]] = {ClassificationTask.name: ClassificationTask}
"""The tasks :class:`coretune.engine.FineTuner` accepts (``task=`` / ``--model.task``), by name."""
