"""Exceptions for data a user supplies: each message names the problem and the fix."""

from __future__ import annotations

__all__ = ["DataError", "ImageDecodeError"]


class DataError(ValueError):
    """A data folder, file or data option is unusable; the message says what to change."""


class ImageDecodeError(DataError):
    """An image file cannot be read or decoded; ``path`` is the file.

    Constructible from the message alone, so PyTorch can re-raise it from a DataLoader worker.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path
