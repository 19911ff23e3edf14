"""Manifold mixup of the encoder features (Verma et al., ICML 2019)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..mining import beta_draws, representable
from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["ManifoldMixup"]


@register("manifold_mixup", doc="Manifold mixup (Verma et al., 2019): soft-label CE on mixed features.")
class ManifoldMixup(Objective):
    r"""Manifold mixup at the encoder output: soft-label CE on mixed features (Verma et al., 2019).

    "Manifold Mixup: Better Representations by Interpolating Hidden States" (Verma et al., ICML 2019).

    .. math:: \lambda \sim \mathrm{Beta}(\alpha, \alpha),\quad \pi = \text{random permutation},\quad
              \mathcal{L} = \text{soft-CE}\bigl(G_y(\lambda z + (1-\lambda) z_\pi),\
              \lambda e(y) + (1-\lambda) e(y_\pi)\bigr)

    One ``λ`` per batch and a random pairing of the batch, as in the paper's code. The loss is on the mixed
    rows only (the paper replaces the standard loss by the mixed one). For CE on the originals plus mixup, use
    ``ce_mix`` (Core-tuning's Table 2 row 3). ``α = 2.0`` is the paper's setting for manifold mixup. Draws come
    from :attr:`generator` when set (else torch's global RNG).

    Differences from the reference code (the authors' ``manifold_mixup`` repository):

    - mixing happens at the layer feeding the classifier only, where the authors draw the layer at random for each
      batch (the input or one of the first residual stages, ``k ∈ {0, 1, 2}``): the encoder is outside the
      objective;
    - the loss is the cross-entropy with the mixed (soft) labels, where the authors' ``supervised/main.py`` trains
      with ``BCELoss(softmax(logits), mixed one-hot labels)`` (a binary cross-entropy per class on the softmax
      outputs, averaged over classes and rows): another loss, with other gradients, for the same targets;
    - it fine-tunes a pre-trained encoder with the engine's optimiser and schedule (``--model.*``), where the
      paper trains from a random initialisation (SGD, lr 0.1, step decay).

    Terms: ``ce_mix``, ``loss``.

    Args:
        alpha: Beta concentration ``α > 0``.
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    #: ``coretune tune``'s grid: the Beta concentration α a decade either side of the paper's 2.0 (from mostly
    #: unmixed rows at 0.2 to mixes near half-and-half at 20).
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"alpha": (0.2, 2.0, 20.0)}

    def __init__(self, alpha: float = 2.0, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        if alpha <= 0:
            raise ValueError(f"invalid manifold mixup settings: alpha must be > 0 (got {alpha})")
        self.alpha = alpha
        self.generator: torch.Generator | None = None

    def mix(self, features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Mixed features, soft targets, the permutation ``π`` and ``λ`` (a 0-d tensor)."""
        b = features.shape[0]
        perm = torch.randperm(b, generator=self.generator, device="cpu").to(features.device)
        lam = representable(beta_draws(1, self.alpha, self.generator, features.device)[0], features.dtype)
        onehot = F.one_hot(labels, self.num_classes).float()
        lam_f = lam.to(features.dtype)
        mixed = lam_f * features + (1 - lam_f) * features[perm]
        return mixed, lam * onehot + (1 - lam) * onehot[perm], perm, lam

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        b = features.shape[0]
        mixed, targets, _, _ = self.mix(features, labels)
        all_logits = self.classifier(torch.cat([features, mixed]))
        loss = self.soft_cross_entropy(all_logits[b:], targets)
        return ObjectiveOutput(loss, all_logits[:b], {"ce_mix": loss.detach(), "loss": loss.detach()})
