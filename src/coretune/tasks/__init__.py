"""Tasks: what a batch is and how predictions are scored. Classification is the default."""

from .classification import ClassificationTask

__all__ = ["ClassificationTask"]
