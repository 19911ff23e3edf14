"""The momentum (key) encoder update of MoCo (He et al., CVPR 2020, eq. 2), used by ``coretune pretrain``'s MoCo v2
and MoCo v3 and by the Bi-tuning objective: one function, so the three follow the same rule."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["momentum_update"]


@torch.no_grad()
def momentum_update(online: nn.Module, target: nn.Module, momentum: float) -> None:
    """``θ_k ← m θ_k + (1 − m) θ_q`` over the matching parameters of ``online`` (``θ_q``) and ``target`` (``θ_k``),
    in place (buffers are not touched); ``online``'s are moved to ``target``'s device first.

    Raises:
        ValueError: the two modules have different numbers of parameters.
    """
    for p_q, p_k in zip(online.parameters(), target.parameters(), strict=True):
        p_k.mul_(momentum).add_(p_q.detach().to(p_k.device), alpha=1 - momentum)
