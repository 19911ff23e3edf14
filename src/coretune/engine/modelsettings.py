"""A :class:`~coretune.engine.FineTuner`'s grouped settings and the flat spellings older versions used.

The optimiser's settings are one group, ``optim`` (:class:`~coretune.engine.optim.OptimSettings`: ``--model.optim.lr``),
and so are the options that read the pre-trained weights, ``weights_options`` (:class:`~coretune.models.WeightsOptions`:
``--model.weights_options.format``). Older versions took them as the model's own settings (``--model.lr``,
``--model.weights_format``; ``model: {lr: 0.01}`` in a config file, a checkpoint's hyper-parameters and a run's
``config.yaml``). For one release those still work: :func:`moved_option` names an old option's new spelling (the
CLI rewrites it, with a deprecation line), and :func:`grouped_model_settings` moves a record's flat settings into
their groups, wherever recorded settings are read (checkpoints, ``config.yaml`` on a resume, ``--config`` files).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..models import WeightsOptions, current_backbone_name, current_weights_name
from .optim import OptimSettings

__all__ = ["GROUPS", "MOVED_SETTINGS", "deprecated_option_line", "grouped_model_settings", "moved_option"]

GROUPS = {"optim": OptimSettings, "weights_options": WeightsOptions}
"""The FineTuner's settings that are a group (a dataclass), by name."""

NEVER_FLAT = frozenset({"lora"})
"""Settings of a group that were never the model's own (``optim.lora``): no older spelling to move."""

MOVED_SETTINGS: dict[str, tuple[str, str]] = {
    **{f.name: ("optim", f.name) for f in fields(OptimSettings) if f.name not in NEVER_FLAT},
    "weights_download": ("weights_options", "download"),
    "weights_format": ("weights_options", "format"),
    "weights_allow_cast": ("weights_options", "allow_cast"),
}
"""An older version's flat setting of the model → the group and the name it has there now."""


def moved_option(name: str) -> str | None:
    """The current spelling of the model setting an older version called ``name`` (``lr`` → ``optim.lr``), or
    None for a setting that did not move."""
    return ".".join(MOVED_SETTINGS[name]) if name in MOVED_SETTINGS else None


def deprecated_option_line(command: str, old: str, new: str) -> str:
    """The one stderr line that says the option ``old`` (``--model.lr``) is deprecated for ``new``."""
    return f"coretune {command}: {old} is deprecated and will be removed in the next release: use {new}"


def grouped_model_settings(model: Mapping[str, Any]) -> dict[str, Any]:
    """A FineTuner's settings (a checkpoint's ``hyper_parameters``, ``config.yaml``'s or a ``--config`` file's
    ``model`` entry) as coretune records them now: each flat setting of an older version (``lr: 0.01``,
    ``weights_format: auto``) moved into its group (``optim: {lr: 0.01}``), whose own entries win. A group takes the
    place of its first flat setting, so the other settings keep their order; settings already grouped pass as
    they are. An older spelling of the backbone's or the weights' name (``timm/resnet10t``, ``timm:resnet18.a1_in1k``)
    is written as now (``resnet10t``, ``resnet18.a1_in1k``: :mod:`~coretune.models.hubnames`), silently."""
    grouped: dict[str, Any] = {}
    for key, value in model.items():
        if key in MOVED_SETTINGS:
            group, name = MOVED_SETTINGS[key]
            grouped.setdefault(group, {})
            if isinstance(grouped[group], dict):
                grouped[group].setdefault(name, value)
        elif key in GROUPS and isinstance(value, Mapping) and isinstance(grouped.get(key), dict):
            grouped[key] = {**grouped[key], **value}  # its flat settings came first: the group's own win
        else:
            grouped[key] = dict(value) if key in GROUPS and isinstance(value, Mapping) else value
    if isinstance(grouped.get("backbone"), str):
        grouped["backbone"] = current_backbone_name(grouped["backbone"], warn=False)
    if isinstance(grouped.get("weights"), str):
        grouped["weights"] = str(current_weights_name(grouped["weights"], warn=False))
    return grouped
