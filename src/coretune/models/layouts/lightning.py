"""Checkpoint layout ``lightning``: a Lightning ``.ckpt`` (coretune's own fine-tuned or pre-training runs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder
from ..errors import CheckpointError
from ..lora import merged_lora_state


@register_layout(
    "lightning",
    "a Lightning .ckpt: state_dict with 'backbone.body.' (coretune), 'model.backbone.', 'backbone.', "
    "'encoder.' or 'model.' prefixes; other modules dropped; a LoRA fine-tuning's LoRA merged into its weights",
)
def lightning(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    if "pytorch-lightning_version" not in raw:
        return None
    raw, merged = _lora_merged(raw)
    prefixes = ("backbone.body.", "model.backbone.", "backbone.", "encoder.", "model.")
    heads = ("fc", "head", *encoder.classifier_names)
    extraction = extract_prefixed(raw, ("state_dict",), prefixes, heads, encoder.body.state_dict().keys())
    if extraction is not None and merged:
        extraction.notes.append(f"LoRA merged into the weights of {merged} layers (W + alpha/r · B A)")
    return extraction


def _lora_merged(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
    """A coretune LoRA fine-tuning's checkpoint (``--model.optim.lora.rank``) with its LoRA layers merged into
    plain weights (:func:`~coretune.models.lora.merged_lora_state`, with the run's ``alpha``), so that it starts
    another fit as any fine-tuned network; ``raw`` itself without LoRA tensors."""
    state = raw.get("state_dict")
    if not isinstance(state, Mapping) or not any(".lora_A." in key for key in state):
        return raw, 0
    lora = ((raw.get("hyper_parameters") or {}).get("optim") or {}).get("lora") or {}
    if "alpha" not in lora:
        raise CheckpointError(
            "the checkpoint holds LoRA tensors but not the run's LoRA settings (hyper_parameters optim.lora.alpha): "
            "export it with coretune export (which merges them) and load the export"
        )
    state, merged = merged_lora_state(dict(state), float(lora["alpha"]))
    return {**raw, "state_dict": state}, merged
