"""Checkpoint layout ``pycontrast``: PyContrast (InsDis, PIRL, CMC, InfoMin)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "pycontrast",
    "PyContrast (InsDis/PIRL/CMC/InfoMin): 'model' (else 'model_ema') with 'module.encoder.'; head, fc and "
    "memory banks dropped",
)
def pycontrast(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(
        raw, ("model", "model_ema"), ("module.encoder.", "encoder."), ("fc",), encoder.body.state_dict().keys()
    )
