"""SCL: cross-entropy plus supervised contrastive learning on encoder features (Gunel et al., ICLR 2021)."""

from __future__ import annotations

from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from ..distributed import gather_batch
from ..losses import contrastive_loss, supcon_positive_mask
from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["SCL"]


@register("scl", doc="SCL (Gunel et al., 2021): (1−λ)·CE + λ·SupCon on the L2-normalised encoder features.")
class SCL(Objective):
    r"""SCL: cross-entropy plus supervised contrastive loss on the normalised features (Gunel et al., 2021).

    "Supervised contrastive learning for pre-trained language model fine-tuning" (Gunel et al., ICLR 2021).

    .. math:: \mathcal{L} = (1 - \lambda)\, CE(G_y(z), y) + \lambda\, \mathcal{L}_{SCL},\quad
              \mathcal{L}_{SCL} = \operatorname{mean}_i \frac{-1}{|P_i|} \sum_{j \in P_i}
              \log \frac{\exp(\Phi_i \cdot \Phi_j / \tau)}{\sum_{k \neq i} \exp(\Phi_i \cdot \Phi_k / \tau)}

    with ``Φ = z/‖z‖`` the L2-normalised encoder features (no projection head, as in the paper) and ``P_i``
    the other samples of the batch with label ``y_i`` (:func:`coretune.losses.contrastive_loss` with
    :func:`~coretune.losses.supcon_positive_mask`). Defaults ``λ = 0.9``, ``τ = 0.3`` are the paper's best
    setting. Core-tuning's paper lists an "SCL" row in its Table 1 whose numbers are those of its Table 2's
    "CE + L_con" row (``ce_con``: a projection head, τ 0.07, weight η); this class is Gunel et al.'s own form.

    Differences from the paper (Gunel et al. release no image code): the per-anchor terms are averaged over
    the anchors with at least one positive (:func:`~coretune.losses.contrastive_loss`), as the cross-entropy is
    averaged over the batch, where the paper's formula sums them over the batch. The paper's λ therefore weighs
    the contrastive term against the cross-entropy ``B`` times (about) less here: at ``B = 64`` and ``λ = 0.9``
    the ratio is 9 : 1 instead of 576 : 1. No ``λ`` reproduces the paper's ratio at the same learning rate (the
    ``λ ≈ 0.998`` that would also shrinks the gradient ~58×); the averaged form, that of the supervised contrastive
    loss's reference code, is kept.

    Terms: ``ce``, ``scl``, ``loss``.

    Args:
        lam: trade-off ``λ ∈ [0, 1]``.
        temperature: ``τ > 0``.
        gather: under DDP, compute the loss on the batch gathered from every process (the contrast then spans
            the global batch, :func:`coretune.distributed.gather_batch`); ``False`` keeps it per process.
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    #: ``coretune tune``'s grid: the paper's sweep, λ ∈ {0.1, 0.3, 0.5, 0.7, 0.9} and τ ∈ {0.1, 0.3, 0.5, 0.7}, less
    #: its λ = 1.0 (no cross-entropy: the new classifier would never train).
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {
        "lam": (0.1, 0.3, 0.5, 0.7, 0.9),
        "temperature": (0.1, 0.3, 0.5, 0.7),
    }

    def __init__(
        self, lam: float = 0.9, temperature: float = 0.3, gather: bool = True, label_smoothing: float = 0.0
    ) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        problems = []
        if not 0.0 <= lam <= 1.0:
            problems.append(f"lam must lie in [0, 1] (got {lam})")
        if temperature <= 0:
            problems.append(f"temperature must be > 0 (got {temperature})")
        if problems:
            raise ValueError("invalid SCL settings: " + "; ".join(problems))
        self.lam, self.temperature, self.gather = lam, temperature, gather

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        features, labels, rows = gather_batch(features, labels) if self.gathers else (features, labels, slice(None))
        logits = self.classifier(features)
        ce = self.cross_entropy(logits, labels)
        unit = F.normalize(features.float(), dim=1)
        scl = contrastive_loss(unit, supcon_positive_mask(labels), self.temperature)
        loss = (1 - self.lam) * ce + self.lam * scl
        return ObjectiveOutput(loss, logits[rows], {"ce": ce.detach(), "scl": scl.detach(), "loss": loss.detach()})
