"""Checkpoint layout ``dino``: DINO (ResNets and ViTs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "dino",
    "DINO (facebookresearch/dino, ResNet or ViT): the training checkpoint's 'teacher' (else 'student') with "
    "'backbone.' / 'module.backbone.', its DINOHead ('head.mlp', 'head.last_layer') dropped; or a bare backbone file "
    "(dino_resnet50_pretrain.pth, dino_deitsmall16_pretrain.pth: timm's ViT names, so 'timm' reads it too)",
)
def dino(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw,
        ("teacher", "student", None),
        ("module.backbone.", "backbone.", ""),
        ("head", "fc"),
        encoder.body.state_dict().keys(),
    )
