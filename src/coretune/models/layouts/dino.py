"""Checkpoint layout ``dino``: DINO."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "dino",
    "DINO (facebookresearch/dino): 'teacher' (else 'student') with 'backbone.' / 'module.backbone.', head "
    "dropped; or a bare backbone file",
)
def dino(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw,
        ("teacher", "student", None),
        ("module.backbone.", "backbone.", ""),
        ("head", "fc"),
        encoder.body.state_dict().keys(),
    )
