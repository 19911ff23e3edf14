"""Checkpoint layout ``lightning``: a Lightning ``.ckpt`` (coretune's own fine-tuned or pre-training runs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "lightning",
    "a Lightning .ckpt: state_dict with 'backbone.body.' (coretune), 'model.backbone.', 'backbone.', "
    "'encoder.' or 'model.' prefixes; other modules dropped",
)
def lightning(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    if "pytorch-lightning_version" not in raw:
        return None
    prefixes = ("backbone.body.", "model.backbone.", "backbone.", "encoder.", "model.")
    heads = ("fc", "head", *encoder.classifier_names)
    return extract_prefixed(raw, ("state_dict",), prefixes, heads, encoder.body.state_dict().keys())
