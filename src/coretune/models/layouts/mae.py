"""Checkpoint layout ``mae``: MAE (masked autoencoders), its ViT encoder."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder

DECODER = ("decoder_embed", "decoder_blocks", "decoder_norm", "decoder_pred", "decoder_pos_embed", "mask_token")
"""MAE's decoder (``models_mae.py``), dropped: only the encoder is fine-tuned."""

NORMS = ("norm.weight", "norm.bias")
FC_NORMS = ("fc_norm.weight", "fc_norm.bias")


@register_layout(
    "mae",
    "MAE (facebookresearch/mae): 'model' with timm's ViT names; the decoder (decoder_*, mask_token) and a "
    "fine-tuned head dropped. A timm ViT with token pooling (the default) loads the final 'norm' (the CLS token is "
    "the feature, MAE's --cls_token and linear probe); with --model.backbone_args '{global_pool: avg}' (MAE's "
    "fine-tuning default) the pre-trained 'norm' is dropped and a fresh 'fc_norm' normalises the mean of the patch "
    "tokens, as main_finetune.py does",
)
def mae(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    keys = encoder.body.state_dict().keys()
    if not encoder.is_timm or "pos_embed" not in keys:
        return None
    extraction = extract_prefixed(raw, ("model",), ("",), (*DECODER, "head"), keys)
    if extraction is None:
        return None
    pooled = set(FC_NORMS) <= keys and not set(NORMS) & keys  # timm's global_pool='avg': fc_norm, no norm
    if pooled and not set(FC_NORMS) & extraction.state.keys() and set(NORMS) <= extraction.state.keys():
        for key in NORMS:
            del extraction.state[key]
        extraction.dropped += list(NORMS)
        extraction.fresh = FC_NORMS
        extraction.notes.append(
            "norm dropped and fc_norm left at its initial values for the pooled patch tokens (MAE's global-pool "
            "fine-tuning)"
        )
    return extraction
