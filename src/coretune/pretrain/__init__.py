"""Contrastive self-supervised pre-training (SimCLR, MoCo v2, MoCo v3) of any coretune backbone on unlabelled data."""

from .augment import BatchAugment
from .data import PretrainData
from .losses import KeyQueue, moco_infonce, moco_v3_infonce, nt_xent
from .mocov3 import MoCoV3
from .module import (
    PRETRAINED_FILENAME,
    ContrastivePretrainer,
    ExportPretrained,
    MoCoV2,
    SimCLR,
    make_pretrain_trainer,
    pretrain_callbacks,
    pretrain_trainer_defaults,
    snapshot_path,
)

__all__ = [
    "PRETRAINED_FILENAME",
    "BatchAugment",
    "ContrastivePretrainer",
    "ExportPretrained",
    "KeyQueue",
    "MoCoV2",
    "MoCoV3",
    "PretrainData",
    "SimCLR",
    "make_pretrain_trainer",
    "moco_infonce",
    "moco_v3_infonce",
    "nt_xent",
    "pretrain_callbacks",
    "pretrain_trainer_defaults",
    "snapshot_path",
]
