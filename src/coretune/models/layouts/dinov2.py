"""Checkpoint layout ``dinov2``: DINOv2, converted to timm's ViT by timm's own ``checkpoint_filter_fn``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from ..checkpoint_files import CheckpointError
from ..checkpoints import Extraction, check_patch_size, extract_prefixed, register_layout, resized_note
from ..encoder import Encoder

_CHUNKED_BLOCK = re.compile(r"blocks\.\d+\.(\d+\..+)")
"""A block of a model trained with ``block_chunks`` > 0 (``blocks.<chunk>.<block>.…``; the block index is global)."""


@register_layout(
    "dinov2",
    "DINOv2 (facebookresearch/dinov2): a hub state dict (dinov2_vits14 …: LayerScale 'ls1.gamma', 'mask_token', "
    "'register_tokens' for the _reg models) or a teacher_checkpoint.pth ('teacher' with 'backbone.', dino_head and "
    "ibot_head dropped), into timm's vit_*_patch14_dinov2 / vit_*_patch14_reg4_dinov2 through timm's "
    "checkpoint_filter_fn (mask_token dropped, register tokens and SwiGLU renamed)",
)
def dinov2(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    body = encoder.body
    keys = body.state_dict().keys()
    if not isinstance(body, VisionTransformer) or "pos_embed" not in keys:
        return None
    extraction = extract_prefixed(raw, ("teacher", "model", "state_dict", None), ("backbone.", ""), ("head",), keys)
    mask = extraction.state.get("mask_token") if extraction is not None else None
    if extraction is None or mask is None or mask.dim() != 2:  # MAE's mask_token is (1, 1, d): not DINOv2's (1, d)
        return None
    state = {_unchunked(k): v for k, v in extraction.state.items()}
    registers, model_registers = state.get("register_tokens"), int(getattr(body, "num_reg_tokens", 0))
    if registers is not None and not model_registers:
        raise CheckpointError(
            f"this DINOv2 checkpoint has {registers.shape[1]} register tokens but backbone {encoder.name!r} none: "
            "pick timm's DINOv2 model with registers (vit_small_patch14_reg4_dinov2 …)"
        )
    if registers is None and model_registers:
        raise CheckpointError(
            f"this DINOv2 checkpoint has no register tokens but backbone {encoder.name!r} has {model_registers}: "
            "pick timm's DINOv2 model without (vit_small_patch14_dinov2 …)"
        )
    check_patch_size(state, body, "this DINOv2 checkpoint", encoder.name)
    side = _grid_side(state.get("pos_embed"))
    converted = checkpoint_filter_fn(dict(state), body)  # pops mask_token; resizes pos_embed to the body's grid
    resampled = []
    if side is not None and tuple(body.patch_embed.grid_size) != (side, side):
        resampled.append(resized_note(side, body))
    dropped = [*extraction.dropped, extraction.prefix + "mask_token"]
    return Extraction(converted, dropped, extraction.entry, extraction.prefix, resampled=resampled)


def _unchunked(key: str) -> str:
    match = _CHUNKED_BLOCK.fullmatch(key)
    return f"blocks.{match[1]}" if match else key


def _grid_side(pos_embed: Any) -> int | None:
    """The side of the square patch grid of DINOv2's ``pos_embed`` (one class token, no register's)."""
    if pos_embed is None or pos_embed.dim() != 3:
        return None
    side = math.isqrt(pos_embed.shape[1] - 1)
    return side if side * side == pos_embed.shape[1] - 1 else None
