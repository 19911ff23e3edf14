"""Encoders (torchvision, timm, a small CNN), safe loading of self-supervised checkpoints into them, DeepLab-V3
for segmentation, and LoRA.

- :mod:`~.encoder` — the ``Encoder`` a backbone is; :mod:`~.backbones` — the backbones by name (:mod:`~.registry`: the
  names registered; :mod:`~.errors`: ``CheckpointError``);
- :mod:`~.hubnames` — backbone and weights names as timm and the Hugging Face hub write them, downloads, old spellings;
- :mod:`~.checkpoint_files` — reading checkpoint files safely, weights given by hub name;
- :mod:`~.checkpoints` — layouts (registry, detection) and :func:`load_pretrained` with its report;
- :mod:`~.layouts` — one file per checkpoint layout (how to add one: its docstring);
- :mod:`~.segmentation` — DeepLab-V3;
- :mod:`~.lora` — LoRA on a backbone through peft (``--model.optim.lora.rank``), merged for export.
"""

from . import layouts  # noqa: F401  (importing it registers the built-in checkpoint layouts)
from .backbones import SmallCNN, WeightsOptions, create_backbone, list_backbones, register_backbone
from .checkpoint_files import is_weights_name
from .checkpoints import (
    HUB_PREFIXES,
    CheckpointError,
    Extraction,
    Layout,
    LoadReport,
    UnreadableCheckpointError,
    check_weights,
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
from .hubnames import HUB_KEYWORD, current_backbone_name, current_weights_name, downloads_allowed, named_weights
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
    "HUB_KEYWORD",
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
    "check_weights",
    "create_backbone",
    "create_deeplabv3",
    "create_dilated_backbone",
    "current_backbone_name",
    "current_weights_name",
    "deeplab_head",
    "dilate_resnet",
    "downloads_allowed",
    "extract_backbone_state",
    "is_weights_name",
    "list_backbones",
    "list_layouts",
    "load_checkpoint_file",
    "load_pretrained",
    "named_weights",
    "register_backbone",
    "register_layout",
    "require_checkpoint_file",
    "resnet_feature_map",
    "resolve_weights",
    "weights_digest",
]
