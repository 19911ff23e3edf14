"""Checkpoint writes that never leave a half-written file: write to a temporary file, fsync, then rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "atomic_torch_save", "with_atomic_io"]


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then ``os.replace``: the old file survives any failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO whose saves are atomic (temporary file + rename)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        atomic_torch_save(checkpoint, path)


def with_atomic_io(plugins: Any) -> list[Any]:
    """A Trainer's ``plugins`` (``None``, one or a list) plus :class:`AtomicCheckpointIO`. The CLIs add it when
    they instantiate the trainer rather than as a default: jsonargparse cannot write an instance into the saved
    ``config.yaml`` (it warned "Unable to serialize instance")."""
    plugins = plugins or []
    return [*(plugins if isinstance(plugins, list) else [plugins]), AtomicCheckpointIO()]
