"""Checkpoint layout ``moco_v3``: MoCo v3."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "moco_v3",
    "MoCo v3 (facebookresearch/moco-v3): state_dict with 'module.base_encoder.'; fc/head projector, "
    "predictor and momentum_encoder dropped",
)
def moco_v3(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw,
        ("state_dict",),
        ("module.base_encoder.", "base_encoder."),
        ("fc", "head"),
        encoder.body.state_dict().keys(),
    )
