"""The registry of coretune's own backbone names (``register_backbone`` fills it): its own module so that the name
rules (:mod:`~coretune.models.hubnames`) read it without importing the backbones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["REGISTRY"]

REGISTRY: dict[str, Callable[..., Any]] = {}
"""Registered backbone name → factory returning an :class:`~coretune.models.Encoder`."""
