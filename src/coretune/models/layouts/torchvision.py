"""Checkpoint layout ``torchvision``: a plain state dict of a torchvision-style model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout("torchvision", "a plain state dict of a torchvision-style model (torch.save(model.state_dict()))")
def torchvision(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    if encoder.is_timm:
        return None
    return extract_prefixed(raw, (None,), ("",), encoder.classifier_names)
