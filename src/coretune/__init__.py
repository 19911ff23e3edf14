"""coretune: fine-tune contrastive self-supervised vision models with Core-tuning and its baselines."""

from . import objectives
from .losses import contrastive_loss, core_positive_mask, own_pairs_mask, soft_cross_entropy, supcon_positive_mask
from .memory import FeatureMemory
from .mining import HardPairs, mine_hard_pairs

__version__ = "0.1.0"

__all__ = [
    "FeatureMemory",
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
