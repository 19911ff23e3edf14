"""Checkpoint layout ``byol``: BYOL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "byol",
    "BYOL: 'online_network.encoder.' / 'online_encoder.net.' / 'online_backbone.' / 'encoder.' prefixes "
    "(in state_dict, online_network_state_dict or flat); projector, predictor and target network dropped",
)
def byol(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw,
        ("state_dict", "online_network_state_dict", None),
        (
            "module.online_network.encoder.",
            "online_network.encoder.",
            "online_encoder.net.",
            "online_backbone.",
            "encoder.",
        ),
        ("fc", "projector", "projection", "predictor"),
        encoder.body.state_dict().keys(),
    )
