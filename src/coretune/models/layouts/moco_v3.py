"""Checkpoint layout ``moco_v3``: MoCo v3 (ResNets and ViTs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..checkpoint_files import CheckpointError
from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder

VIT_HEADS = {"vit_small": 12, "vit_base": 12, "vit_conv_small": 12, "vit_conv_base": 12}
"""Attention heads of MoCo v3's ViTs (its ``vits.py``): its ViT-Small has 12, timm's and DeiT's 6."""


@register_layout(
    "moco_v3",
    "MoCo v3 (facebookresearch/moco-v3, ResNet or ViT): state_dict with 'module.base_encoder.'; fc/head projector, "
    "predictor and momentum_encoder dropped. Its ViTs subclass timm's VisionTransformer (timm's names); its "
    "ViT-Small has 12 heads (--model.backbone_args '{num_heads: 12}' on timm's vit_small_patch16_224, checked "
    "against the checkpoint's 'arch')",
)
def moco_v3(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    extraction = extract_prefixed(
        raw,
        ("state_dict",),
        ("module.base_encoder.", "base_encoder."),
        ("fc", "head"),
        encoder.body.state_dict().keys(),
    )
    arch = raw.get("arch")
    heads = VIT_HEADS.get(arch) if isinstance(arch, str) else None
    blocks = getattr(encoder.body, "blocks", None)
    first = next(iter(blocks), None) if isinstance(blocks, (nn.Sequential, nn.ModuleList)) else None
    ours = getattr(getattr(first, "attn", None), "num_heads", None)
    if extraction is not None and heads is not None and ours is not None and ours != heads:
        raise CheckpointError(
            f"this MoCo v3 checkpoint's {arch} has {heads} attention heads but backbone {encoder.name!r} has "
            f"{ours}: its weights would load and compute another attention; build the backbone with "
            f"--model.backbone_args '{{num_heads: {heads}}}' (num_heads={heads} in Python)"
        )
    return extraction
