"""Checkpoint layout ``swav``: SwAV, DeepCluster-v2, SeLa-v2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "swav",
    "SwAV / DeepCluster-v2 / SeLa-v2 (facebookresearch/swav): flat or state_dict, 'module.' prefix; "
    "projection_head and prototypes dropped",
)
def swav(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw,
        ("state_dict", None),
        ("module.", ""),
        ("projection_head", "prototypes", "fc"),
        encoder.body.state_dict().keys(),
    )
