"""Encoders (torchvision, timm, a small CNN) and safe loading of self-supervised checkpoints into them."""

from .backbones import TIMM_PREFIX, Encoder, SmallCNN, create_backbone, list_backbones, register_backbone
from .checkpoints import (
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
)

__all__ = [
    "TIMM_PREFIX",
    "CheckpointError",
    "Encoder",
    "Extraction",
    "Layout",
    "LoadReport",
    "SmallCNN",
    "UnreadableCheckpointError",
    "create_backbone",
    "extract_backbone_state",
    "list_backbones",
    "list_layouts",
    "load_checkpoint_file",
    "load_pretrained",
    "register_backbone",
    "register_layout",
    "require_checkpoint_file",
]
