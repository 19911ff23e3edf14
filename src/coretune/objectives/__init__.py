"""Fine-tuning objectives: one class per method against :class:`Objective`, named in a registry."""

from . import ce, core
from .base import Objective, ObjectiveOutput, available, create, get, register
from .ce import CETuning
from .core import TABLE2_ROWS, CoreTuning

__all__ = [
    "TABLE2_ROWS",
    "CETuning",
    "CoreTuning",
    "Objective",
    "ObjectiveOutput",
    "available",
    "ce",
    "core",
    "create",
    "get",
    "register",
]
