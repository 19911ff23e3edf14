"""Fine-tuning objectives: one class per method against :class:`Objective`, named in a registry."""

from . import bi_tuning, bss, ce, core, delta, erm_pp, l2sp, logit_adjusted, manifold_mixup, mm, rifle, scl
from .base import (
    Objective,
    ObjectiveOutput,
    available,
    create,
    get,
    plain_setting,
    preset_name,
    register,
    registered_class,
    upgrade_objective_config,
)
from .bi_tuning import BiTuning
from .bss import BSS
from .ce import CETuning
from .core import TABLE2_ROWS, CoreTuning, dense_contrastive_loss
from .delta import DELTA, channel_attention
from .erm_pp import ERMPlusPlus
from .l2sp import L2SP
from .logit_adjusted import LogitAdjusted
from .manifold_mixup import ManifoldMixup
from .mm import MixAndMatch, batch_hard_triplet_loss
from .rifle import RIFLE
from .scl import SCL

__all__ = [
    "BSS",
    "DELTA",
    "L2SP",
    "RIFLE",
    "SCL",
    "TABLE2_ROWS",
    "BiTuning",
    "CETuning",
    "CoreTuning",
    "ERMPlusPlus",
    "LogitAdjusted",
    "ManifoldMixup",
    "MixAndMatch",
    "Objective",
    "ObjectiveOutput",
    "available",
    "batch_hard_triplet_loss",
    "bi_tuning",
    "bss",
    "ce",
    "channel_attention",
    "core",
    "create",
    "delta",
    "dense_contrastive_loss",
    "erm_pp",
    "get",
    "l2sp",
    "logit_adjusted",
    "manifold_mixup",
    "mm",
    "plain_setting",
    "preset_name",
    "register",
    "registered_class",
    "rifle",
    "scl",
    "upgrade_objective_config",
]
