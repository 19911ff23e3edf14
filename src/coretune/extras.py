"""Optional dependencies: what each extra of ``pip install 'coretune[EXTRA]'`` brings, and the one-line error a
command gives when the package it needs is not installed.

The core install (torch, torchvision, lightning, jsonargparse, timm, safetensors, rich, pillow, numpy, pyyaml)
fine-tunes, evaluates, predicts and exports; everything else is imported where it is used, through :func:`need`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "installed", "need"]

#: The extra that installs each optional top-level module (pyproject.toml's ``[project.optional-dependencies]``).
EXTRAS: dict[str, str] = {
    "sklearn": "demo",
    "scipy": "bench",
    "matplotlib": "plots",
    "optuna": "tune",
    "sqlalchemy": "tune",
    "submitit": "cluster",
    "psycopg": "tune-postgres",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "onnxscript": "onnx",
    "torchattacks": "robust",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "peft": "peft",
}


class MissingExtra(RuntimeError):
    """A command needs a package of an extra that is not installed; the message names the extra to install."""

    def __init__(self, what: str, module: str, extra: str) -> None:
        self.module, self.extra = module, extra
        super().__init__(f"{what} needs {module}, which is not installed: pip install 'coretune[{extra}]'")


def need(module: str, what: str, extra: str | None = None) -> ModuleType:
    """``module`` imported, or :class:`MissingExtra` saying that ``what`` needs it and naming the extra that installs
    it (``extra``, or the module's in :data:`EXTRAS`)."""
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.partition(".")[0] != top:  # the package is there, one of its own fails
            raise
        raise MissingExtra(what, top, extra or EXTRAS.get(top, top)) from None


def installed(module: str) -> bool:
    """Whether ``module`` (a top-level package) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: blocked
        return False
