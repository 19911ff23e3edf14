""":class:`CheckpointError`: its own module so that every module of :mod:`coretune.models` raises it without importing
the others."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the encoder; the message names cause and fix."""
