"""Checkpoint layout ``timm``: a timm state dict, flat or in the checkpoint timm's train.py writes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "timm",
    "a timm state dict: flat (pytorch_model.bin / model.safetensors) or timm train.py's checkpoint "
    "(state_dict, else model, state_dict_ema, model_ema; 'module.' stripped as timm's clean_state_dict does)",
)
def timm(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    if not encoder.is_timm:
        return None
    entries = ("state_dict", "model", "state_dict_ema", "model_ema", None)
    return extract_prefixed(raw, entries, ("module.", ""), encoder.classifier_names)
