"""Checkpoint layout ``simsiam``: SimSiam."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "simsiam",
    "SimSiam (facebookresearch/simsiam): state_dict with 'module.encoder.'; its fc projector and the predictor dropped",
)
def simsiam(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw, ("state_dict",), ("module.encoder.", "encoder."), ("fc",), encoder.body.state_dict().keys()
    )
