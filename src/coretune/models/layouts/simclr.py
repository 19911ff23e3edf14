"""Checkpoint layout ``simclr``: SimCLR v1/v2 converted to PyTorch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "simclr",
    "SimCLR v1/v2 converted to PyTorch (tonylins/simclr-converter): state_dict with torchvision keys; fc dropped",
)
def simclr(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    return extract_prefixed(raw, ("state_dict",), ("",), ("fc",), encoder.body.state_dict().keys())
