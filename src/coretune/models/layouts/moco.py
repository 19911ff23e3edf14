"""Checkpoint layout ``moco``: MoCo v1/v2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "moco",
    "MoCo v1/v2 (facebookresearch/moco): state_dict with 'module.encoder_q.'; fc MLP head, encoder_k and queue dropped",
)
def moco(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw, ("state_dict",), ("module.encoder_q.", "encoder_q."), ("fc",), encoder.body.state_dict().keys()
    )
