"""Checkpoint layout ``backbone``: solo-style trainers' ``backbone.`` prefix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "backbone",
    "state_dict (or flat) with 'backbone.' + torchvision/timm keys and a 'projector.' head (solo-style "
    "trainers, the shared simclr_resnet18_in20_64px checkpoint)",
)
def backbone(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw, ("state_dict", "model", None), ("module.backbone.", "backbone."), ("fc",), encoder.body.state_dict().keys()
    )
