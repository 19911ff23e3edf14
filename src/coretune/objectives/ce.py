"""CE-tuning: fine-tune the encoder and a new linear classifier with cross-entropy (the paper's baseline).

SL-CE-tuning (Table 1) is this objective started from supervised pre-trained weights.
"""

from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from .base import Objective, ObjectiveOutput, register

__all__ = ["CETuning"]


@register("ce", doc="CE-tuning: cross-entropy on a new linear classifier (SL-CE-tuning with supervised weights).")
class CETuning(Objective):
    """CE-tuning: ``L = CE(G_y(z), y)``; for dense prediction, pixel-wise (the task computes it)."""

    dense = True
    #: None: cross-entropy has no hyper-parameter for ``coretune tune`` to choose.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {}

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        logits = self.classifier(features)
        loss = F.cross_entropy(logits.float(), labels)
        return ObjectiveOutput(loss, logits, {"ce": loss.detach(), "loss": loss.detach()})
