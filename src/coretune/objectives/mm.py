"""M&M: cross-entropy plus a batch-hard triplet loss (Zhan et al., AAAI 2018) as a classification baseline."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["MixAndMatch", "batch_hard_triplet_loss"]


def batch_hard_triplet_loss(features: Tensor, labels: Tensor, margin: float = 0.3) -> Tensor:
    r"""Batch-hard triplet loss on L2-normalised features (Hermans et al., 2017), in float32.

    For anchor ``i`` with ``d_ij = ‖v_i − v_j‖₂`` and ``v = z/‖z‖``:
    ``ℓ_i = max(0, max_{j ≠ i, y_j = y_i} d_ij − min_{y_k ≠ y_i} d_ik + margin)``; the result is the mean over
    anchors having both a positive and a negative, and ``0`` (in the graph) when there is none.
    """
    v = F.normalize(features.float(), dim=1)
    # ‖v_i − v_j‖² = 2 − 2 v_i·v_j for unit vectors; the clamp keeps sqrt's gradient finite at d = 0.
    dist = (2 - 2 * v @ v.T).clamp(min=1e-12).sqrt()
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(labels.numel(), dtype=torch.bool, device=labels.device)
    positives, negatives = same & ~eye, ~same
    hardest_pos = dist.masked_fill(~positives, float("-inf")).amax(dim=1)
    hardest_neg = dist.masked_fill(~negatives, float("inf")).amin(dim=1)
    valid = positives.any(dim=1) & negatives.any(dim=1)
    if not bool(valid.any()):
        return dist.sum() * 0.0
    return F.relu(hardest_pos[valid] - hardest_neg[valid] + margin).mean()


@register("mm", doc="M&M (Zhan et al., 2018): CE + batch-hard triplet loss (margin 0.3) on unit features.")
class MixAndMatch(Objective):
    r"""M&M: cross-entropy plus a batch-hard triplet loss (Zhan et al., 2018), as a classification baseline.

    "Mix-and-Match Tuning for Self-Supervised Semantic Segmentation" (Zhan et al., AAAI 2018), a baseline of
    Core-tuning's Table 1.

    .. math:: \mathcal{L} = CE(G_y(z), y) + \gamma\, \operatorname{mean}_i
              \max\bigl(0,\ \max_{p: y_p = y_i} d_{ip} - \min_{n: y_n \neq y_i} d_{in} + m\bigr)

    M&M's "match" stage trains the features with a triplet loss over class-consistent pairs; here the triplets
    are mined in the batch (hardest positive and hardest negative of each anchor by Euclidean distance ``d``
    of the L2-normalised encoder features, :func:`batch_hard_triplet_loss`); anchors without a positive or a
    negative are skipped. Margin ``m = 0.3``, a usual margin of the batch-hard triplet loss in person
    re-identification (e.g. Luo et al.'s "Bag of Tricks", 2019); weight ``γ = 1``, the plain sum. Neither comes
    from M&M's authors, who give no classification settings, and neither was tuned.

    Differences from the reference code: this is coretune's classification form of M&M's "match" stage, not
    the authors' method, which fine-tunes for segmentation from a graph of class-consistent patch pairs
    sampled across images ("mix" and "match" on patches); no image-classification code of theirs exists.

    Terms: ``ce``, ``triplet``, ``loss``.

    Args:
        margin: triplet margin ``m >= 0``.
        triplet_weight: weight ``γ >= 0`` of the triplet term.
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    #: ``coretune tune``'s grid: the triplet weight γ a decade either side of 1 (coretune's choice: M&M's authors
    #: give no classification setting); the margin stays at 0.3.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"triplet_weight": (0.1, 1.0, 10.0)}

    def __init__(self, margin: float = 0.3, triplet_weight: float = 1.0, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        settings = (("margin", margin), ("triplet_weight", triplet_weight))
        problems = [f"{n} must be >= 0 (got {v})" for n, v in settings if v < 0]
        if problems:
            raise ValueError("invalid M&M settings: " + "; ".join(problems))
        self.margin, self.triplet_weight = margin, triplet_weight

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        logits = self.classifier(features)
        ce = self.cross_entropy(logits, labels)
        triplet = batch_hard_triplet_loss(features, labels, self.margin)
        loss = ce + self.triplet_weight * triplet
        terms = {"ce": ce.detach(), "triplet": triplet.detach(), "loss": loss.detach()}
        return ObjectiveOutput(loss, logits, terms)
