"""Logit adjustment (Menon et al., ICLR 2021) — balanced softmax (Ren et al., NeurIPS 2020) at τ = 1."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["LogitAdjusted"]


@register(
    "logit_adjusted",
    doc="Logit adjustment (Menon et al., 2021): CE on logits + τ·log(class prior); τ = 1 is balanced softmax.",
)
class LogitAdjusted(Objective):
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
    offered. The priors are a buffer of the objective, kept in its checkpoints.

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
        self._priors_known = False
        self._pending_counts: Tensor | None = None

    def build_heads(self, feature_dim: int, num_classes: int) -> None:
        self.register_buffer("log_prior", torch.zeros(num_classes))
        if self._pending_counts is not None:  # observed before a lazily built objective's first call
            counts, self._pending_counts = self._pending_counts, None
            self.observe_class_counts(counts)

    def observe_class_counts(self, counts: Tensor) -> None:
        """Set the class priors ``π = counts / Σ counts`` from the training images per class ``(K,)``.

        Raises:
            ValueError: ``counts`` is not one count per class, or a class has no training image (its prior would be
                0 and its adjustment −∞).
        """
        counts = torch.as_tensor(counts).reshape(-1)
        if self.num_classes is None:  # a lazily built objective: applied when its heads are built
            self._pending_counts = counts.clone()
            return
        if counts.numel() != self.num_classes:
            raise ValueError(
                f"logit adjustment got {counts.numel()} class counts for {self.num_classes} classes: pass the training "
                "images of every class, in class-index order"
            )
        if (empty := torch.nonzero(counts <= 0).flatten()).numel():
            raise ValueError(
                f"logit adjustment needs training images of every class: class {int(empty[0])} has none (its prior "
                "would be 0 and its logit −∞); add images of it, or fine-tune with another objective"
            )
        prior = counts.double() / counts.double().sum()
        self.log_prior.copy_(prior.log().to(self.log_prior))
        self._priors_known = True

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if f"{prefix}log_prior" in state_dict:  # a checkpoint's priors (a resumed run, coretune test)
            self._priors_known = True

    def adjusted_logits(self, logits: Tensor) -> Tensor:
        """``logits + τ · log π`` (float32)."""
        return logits.float() + self.tau * self.log_prior.float()

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        if not self._priors_known:
            raise RuntimeError(
                "logit adjustment has no class priors: call objective.observe_class_counts(training images per class) "
                "before training (coretune fit does it from the training split)"
            )
        logits = self.classifier(features)
        ce = self.cross_entropy(self.adjusted_logits(logits), labels)
        return ObjectiveOutput(ce, logits, {"ce": ce.detach(), "loss": ce.detach()})
