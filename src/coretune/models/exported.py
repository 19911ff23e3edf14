"""The classifier ``coretune export`` writes for a classification checkpoint: backbone and linear classifier."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["ExportedClassifier"]


class ExportedClassifier(nn.Module):
    """A fine-tuned backbone and its classifier ``G_y``: images → class logits."""

    def __init__(self, backbone: nn.Module, classifier: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone
        self.classifier = classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.backbone(x))
