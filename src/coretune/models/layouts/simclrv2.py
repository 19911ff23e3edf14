"""Checkpoint layout ``simclrv2``: SimCLR v2 converted by Separius/SimCLRv2-Pytorch (a TF-style ResNet's names)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..checkpoint_files import CheckpointError
from ..checkpoints import Extraction, extract_prefixed, register_layout
from ..encoder import Encoder

_TF_RESNET_BLOCK = re.compile(r"net\.([1-4])\.blocks\.(\d+)\.(.+)")
_TF_RESNET_PROJECTION = {"projection.shortcut.": "downsample.0.", "projection.bn.0.": "downsample.1."}


def _tf_resnet_name(key: str) -> str | None:
    """The torchvision name of a TF-style ResNet tensor (SimCLRv2 converter: ``net.0`` stem = conv, BN-ReLU;
    ``net.1``–``net.4`` stages of bottleneck blocks whose ``net`` is conv, BN-ReLU, conv, BN-ReLU, conv, BN and
    whose ``projection`` is the shortcut conv and its BN), or None."""
    if key == "net.0.0.weight":
        return "conv1.weight"
    if key.startswith("net.0.1.0."):
        return "bn1." + key.removeprefix("net.0.1.0.")
    block = _TF_RESNET_BLOCK.fullmatch(key)
    if block is None:
        return None
    stage, index, rest = block.groups()
    base = f"layer{stage}.{index}."
    for old, new in _TF_RESNET_PROJECTION.items():
        if rest.startswith(old):
            return base + new + rest.removeprefix(old)
    if (conv := re.fullmatch(r"net\.([024])\.weight", rest)) is not None:
        return f"{base}conv{int(conv[1]) // 2 + 1}.weight"
    if (bn := re.fullmatch(r"net\.([135])\.0\.(.+)", rest)) is not None:
        return f"{base}bn{(int(bn[1]) + 1) // 2}.{bn[2]}"
    return None


@register_layout(
    "simclrv2",
    "SimCLR v2 converted by Separius/SimCLRv2-Pytorch (r50_1x_sk0.pth …): 'resnet' with a TF-style ResNet's "
    "names ('net.0' stem, 'net.1'-'net.4' stages of 'blocks.N.net.K' and 'blocks.N.projection'), mapped to "
    "torchvision's; fc and the 'head' projector dropped. Only sk0 models (no selective kernels) and width 1x "
    "have a torchvision/timm ResNet to load into",
)
def simclrv2(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    extraction = extract_prefixed(raw, ("resnet", "state_dict", None), ("module.", ""), ("fc",))
    if extraction is None or not any(k.startswith("net.1.blocks.") for k in extraction.state):
        return None
    if any(".mixing_conv." in k or k.startswith("net.0.2.") for k in extraction.state):
        raise CheckpointError(
            "this SimCLR v2 checkpoint has selective kernels (an sk1 model: 'mixing_conv' tensors, a 3-conv stem), "
            "which no torchvision or timm ResNet has: use the sk0 checkpoint of the same depth (r50_1x_sk0, …)"
        )
    state, dropped = {}, list(extraction.dropped)
    for key, value in extraction.state.items():
        name = _tf_resnet_name(key)
        if name is None:
            dropped.append(extraction.prefix + key)
        else:
            state[name] = value
    return Extraction(state, dropped, extraction.entry, extraction.prefix) if state else None
