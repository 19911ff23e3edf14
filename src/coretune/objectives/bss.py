"""BSS: Batch Spectral Shrinkage (Chen et al., NeurIPS 2019)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["BSS"]


@register("bss", doc="BSS (Chen et al., 2019): CE + η × the k smallest squared singular values of the batch.")
class BSS(Objective):
    r"""Batch Spectral Shrinkage, "Catastrophic forgetting meets negative transfer" (Chen et al., NeurIPS'19).

    .. math:: \mathcal{L} = CE(G_y(z), y) + \eta \sum_{i=1}^{k} \sigma_{-i}^2

    where ``σ_{-1} <= σ_{-2} <= …`` are the smallest singular values of the batch feature matrix
    ``Z = [z_1 … z_B]`` (``min(B, d)`` singular values; when ``k`` exceeds that, all are used). Shrinking them
    suppresses the non-transferable spectral components of the features. Defaults ``k = 1``, ``η = 0.001`` are
    the paper's. The SVD runs in float32 (autocast disabled).

    Differences from the reference code (the authors' and tllib's ``BatchSpectralShrinkage``): none in the
    loss; the optimiser and schedule are the engine's.

    Terms: ``ce``, ``bss`` (the unweighted ``Σ σ_{-i}²``), ``loss``.

    Args:
        eta: weight ``η >= 0`` of the spectral penalty.
        k: number ``k >= 1`` of smallest singular values penalised.
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    #: ``coretune tune``'s grid: η a decade either side of the paper's 0.001; ``k`` stays at the paper's 1 (an
    #: integer, which tune does not search: ``--objective.k``).
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"eta": (0.0001, 0.001, 0.01)}

    def __init__(self, eta: float = 0.001, k: int = 1, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        problems = []
        if eta < 0:
            problems.append(f"eta must be >= 0 (got {eta})")
        if k < 1:
            problems.append(f"k must be >= 1 (got {k})")
        if problems:
            raise ValueError("invalid BSS settings: " + "; ".join(problems))
        self.eta, self.k = eta, k

    def spectral_penalty(self, features: Tensor) -> Tensor:
        """``Σ_{i=1..k} σ_{-i}²`` of the ``(B, d)`` feature matrix."""
        with torch.autocast(device_type=features.device.type, enabled=False):
            singular_values = torch.linalg.svdvals(features.float())  # descending
        return singular_values[-min(self.k, singular_values.numel()) :].pow(2).sum()

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        logits = self.classifier(features)
        ce = self.cross_entropy(logits, labels)
        bss = self.spectral_penalty(features)
        loss = ce + self.eta * bss
        return ObjectiveOutput(loss, logits, {"ce": ce.detach(), "bss": bss.detach(), "loss": loss.detach()})
