"""Checkpoint layout ``sequential``: a backbone saved as ``nn.Sequential`` of the model's children."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder


@register_layout(
    "sequential",
    "a backbone saved as nn.Sequential(*list(model.children())[:-1]) (sthalles/PyTorch-BYOL's "
    "online_network_state_dict, many tutorials): keys '0.' … 'N.' are the model's children in order "
    "(ResNet: 0 conv1, 1 bn1, 4-7 layer1-4), under 'encoder.' / 'online_network.encoder.' / 'features.' / "
    "'backbone.' or flat; the rest (projection heads) dropped",
)
def sequential(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    entries = ("online_network_state_dict", "state_dict", "model", None)
    prefixes = ("module.online_network.encoder.", "online_network.encoder.", "encoder.", "features.", "backbone.", "")
    extraction = extract_prefixed(raw, entries, prefixes, ())
    if extraction is None:
        return None
    children = [name for name, _ in encoder.body.named_children()]
    state, dropped = {}, list(extraction.dropped)
    for key, value in extraction.state.items():
        index, _, rest = key.partition(".")
        if index.isdigit() and int(index) < len(children) and rest:
            state[f"{children[int(index)]}.{rest}"] = value
        else:
            dropped.append(extraction.prefix + key)
    return Extraction(state, dropped, extraction.entry, extraction.prefix) if state else None
