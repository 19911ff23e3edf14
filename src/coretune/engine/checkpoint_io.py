"""Checkpoint (and other file) writes that never leave a half-written file: write to a temporary file, fsync, then
rename."""

from __future__ import annotations

import os
from typing import Any, BinaryIO

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..runs.atomic import atomic_write

__all__ = ["AtomicCheckpointIO", "atomic_torch_save", "atomic_write", "with_atomic_io"]


class _KeepWriteError:
    """A binary file that keeps the ``OSError`` its ``write`` raised: torch's writer swallows it and reports a failed
    write (a full disk) only as ``RuntimeError: [enforce fail at inline_container.cc:…] unexpected pos …``."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then ``os.replace``: the old file survives any failure.
    A failed write raises its own ``OSError`` (``ENOSPC`` for a full disk), not torch's ``RuntimeError``."""
    with atomic_write(path, "wb") as f:
        writer = _KeepWriteError(f)
        try:
            torch.save(obj, writer)
        except RuntimeError as err:
            if writer.error is None:
                raise
            raise writer.error from err


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
