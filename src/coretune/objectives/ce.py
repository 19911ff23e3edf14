"""CE-tuning: fine-tune the encoder and a new linear classifier with cross-entropy (the paper's baseline).

SL-CE-tuning (Table 1) is this objective started from supervised pre-trained weights.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["CETuning"]


@register("ce", doc="CE-tuning: cross-entropy on a new linear classifier (SL-CE-tuning with supervised weights).")
class CETuning(Objective):
    """CE-tuning: ``L = CE(G_y(z), y)``; for dense prediction, pixel-wise (the task computes it)."""

    dense = True
    #: None: cross-entropy has no hyper-parameter for ``coretune tune`` to choose.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {}

    def __init__(self, label_smoothing: float = 0.0) -> None:
        """Args:
        label_smoothing: label smoothing of the cross-entropy (:attr:`Objective.label_smoothing`), in [0, 1)."""
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        logits = self.classifier(features)
        loss = self.cross_entropy(logits, labels)
        return ObjectiveOutput(loss, logits, {"ce": loss.detach(), "loss": loss.detach()})
