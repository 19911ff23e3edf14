"""Logit adjustment (Menon et al., ICLR 2021) — balanced softmax (Ren et al., NeurIPS 2020) at τ = 1."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._prior import ClassPrior
from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["LogitAdjusted"]


@register(
    "logit_adjusted",
    doc="Logit adjustment (Menon et al., 2021): CE on logits + τ·log(class prior); τ = 1 is balanced softmax.",
)
class LogitAdjusted(ClassPrior, Objective):
    r"""The logit-adjusted loss of "Long-tail learning via logit adjustment" (Menon et al., ICLR 2021, eq. 10):

    .. math:: \ell(y, f(x)) = -\log \frac{e^{f_y(x) + \tau \log \pi_y}}{\sum_{y'} e^{f_{y'}(x) + \tau \log \pi_{y'}}}

    the cross-entropy of the classifier's logits shifted by ``τ · log π``, where ``π_y`` is class ``y``'s share of
    the training images (the class prior, counted from the training split: :meth:`observe_class_counts`, which
    ``coretune fit`` calls). Equivalently (eq. 11), a margin loss ``log[1 + Σ_{y'≠y} (π_{y'}/π_y)^τ e^{f_{y'} − f_y}]``:
    a rare label must beat a frequent one by a larger margin. Evaluation and prediction read the plain logits
    ``f(x)``, which then estimate the balanced (class-prior-free) posterior: the paper's Bayes-optimal classifier of
    the balanced error. At ``τ = 1`` this is the balanced softmax of Ren et al. (NeurIPS 2020, "Balanced meta-softmax
    for long-tailed visual recognition"), whose softmax is weighted by the class counts ``n_y ∝ π_y``.

    Differences from the reference code (google-research ``logit_adjustment``): none in the loss (its
    ``base_probs`` are these priors, and it adds ``τ · log(base_probs)`` to the logits); the optimiser and schedule
    are the engine's. The paper's post-hoc variant (train with CE, predict ``argmax f_y − τ log π_y``) is not
    offered. The priors are a buffer of the objective, kept in its checkpoints (:class:`ClassPrior`). Core-tuning
    takes the same adjustment in both its cross-entropies: ``--objective.logit_adjustment τ`` of ``core`` and its
    presets (``ce_mix`` …).

    Terms: ``ce`` (the adjusted cross-entropy), ``loss``.

    Args:
        tau: the adjustment's scale ``τ >= 0`` (1: the paper's default and balanced softmax; 0: plain CE).
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    #: ``coretune tune``'s grid: the paper's τ = 1 and a factor of 2 either side (its Figure 3 sweeps τ in [0, 2.5]).
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"tau": (0.5, 1.0, 2.0)}
    needs_class_counts: ClassVar[bool] = True

    def __init__(self, tau: float = 1.0, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not tau >= 0:
            raise ValueError(f"invalid logit adjustment settings: tau must be >= 0 (got {tau!r}; 1: balanced softmax)")
        self.tau = float(tau)

    def build_heads(self, feature_dim: int, num_classes: int) -> None:
        self.build_prior(num_classes)

    def adjusted_logits(self, logits: Tensor) -> Tensor:
        """``logits + τ · log π`` (float32)."""
        return self.prior_adjusted(logits, self.tau).float()

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        self.require_prior()
        logits = self.classifier(features)
        ce = self.cross_entropy(self.adjusted_logits(logits), labels)
        return ObjectiveOutput(ce, logits, {"ce": ce.detach(), "loss": ce.detach()})
