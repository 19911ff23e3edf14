"""coretune: fine-tune contrastive self-supervised vision models with Core-tuning and its baselines."""

from importlib.metadata import version

from . import objectives
from .losses import (
    FocalContrastiveLoss,
    contrastive_loss,
    core_positive_mask,
    own_pairs_mask,
    soft_cross_entropy,
    supcon_positive_mask,
)
from .memory import CrossBatchMemory, FeatureMemory
from .mining import HardPairMiner, HardPairs, mine_hard_pairs

__version__ = version("coretune")
"""The installed distribution's version (its metadata, from pyproject.toml), as ``coretune --version`` prints it."""

__all__ = [
    "CrossBatchMemory",
    "FeatureMemory",
    "FocalContrastiveLoss",
    "HardPairMiner",
    "HardPairs",
    "__version__",
    "contrastive_loss",
    "core_positive_mask",
    "mine_hard_pairs",
    "objectives",
    "own_pairs_mask",
    "soft_cross_entropy",
    "supcon_positive_mask",
]
