"""Encoders (torchvision, timm, a small CNN), safe loading of self-supervised checkpoints into them, and DeepLab-V3
for segmentation.

- :mod:`~.encoder` — the ``Encoder`` a backbone is; :mod:`~.backbones` — the registry of backbones by name;
- :mod:`~.checkpoint_files` — reading checkpoint files safely, weights given by hub name;
- :mod:`~.checkpoints` — layouts (registry, detection) and :func:`load_pretrained` with its report;
- :mod:`~.layouts` — one file per checkpoint layout (how to add one: its docstring);
- :mod:`~.segmentation` — DeepLab-V3.
"""

from . import layouts  # noqa: F401  (importing it registers the built-in checkpoint layouts)
from .backbones import SmallCNN, WeightsOptions, create_backbone, list_backbones, register_backbone
from .checkpoints import (
    HUB_PREFIXES,
    CheckpointError,
    Extraction,
    Layout,
    LoadReport,
    UnreadableCheckpointError,
    extract_backbone_state,
    list_layouts,
    load_checkpoint_file,
    load_pretrained,
    register_layout,
    require_checkpoint_file,
    resolve_weights,
    weights_digest,
)
from .encoder import TIMM_PREFIX, Encoder
from .segmentation import (
    ASPP_RATES_BY_OUTPUT_STRIDE,
    DeepLabV3,
    create_deeplabv3,
    create_dilated_backbone,
    deeplab_head,
    dilate_resnet,
    resnet_feature_map,
)

__all__ = [
    "ASPP_RATES_BY_OUTPUT_STRIDE",
    "HUB_PREFIXES",
    "TIMM_PREFIX",
    "CheckpointError",
    "DeepLabV3",
    "Encoder",
    "Extraction",
    "Layout",
    "LoadReport",
    "SmallCNN",
    "UnreadableCheckpointError",
    "WeightsOptions",
    "create_backbone",
    "create_deeplabv3",
    "create_dilated_backbone",
    "deeplab_head",
    "dilate_resnet",
    "extract_backbone_state",
    "list_backbones",
    "list_layouts",
    "load_checkpoint_file",
    "load_pretrained",
    "register_backbone",
    "register_layout",
    "require_checkpoint_file",
    "resnet_feature_map",
    "resolve_weights",
    "weights_digest",
]
