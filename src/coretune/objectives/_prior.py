"""The class prior of the training split, for the objectives that correct their cross-entropy by it (logit
adjustment, Menon et al. 2021): :class:`ClassPrior`, a mixin kept beside the objectives that use it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ClassPrior"]


class ClassPrior(nn.Module):
    """Mixin of an :class:`~coretune.objectives.base.Objective`: the log class prior ``log π`` as the buffer
    ``log_prior`` (kept in checkpoints), ``π = counts / Σ counts`` from :meth:`observe_class_counts` (which ``coretune
    fit`` calls with the training split's images per class). Call :meth:`build_prior` from ``build_heads`` (a lazily
    built objective takes counts observed before it), :meth:`require_prior` before the loss; the logit-adjusted
    cross-entropy is the cross-entropy of :meth:`prior_adjusted` logits, ``logits + τ · log_prior``."""

    num_classes: int | None
    _priors_known: bool = False
    _pending_counts: Tensor | None = None

    def build_prior(self, num_classes: int) -> None:
        """Register ``log_prior`` ``(num_classes,)`` (zeros until counts are observed)."""
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
        if not hasattr(self, "log_prior"):  # an objective that corrects nothing (τ = 0 of Core-tuning)
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

    def require_prior(self) -> None:
        """Refuse a loss before the priors are known (no :meth:`observe_class_counts`, no checkpoint's).

        Raises:
            RuntimeError: no priors yet.
        """
        if not self._priors_known:
            raise RuntimeError(
                "logit adjustment has no class priors: call objective.observe_class_counts(training images per class) "
                "before training (coretune fit does it from the training split)"
            )

    def prior_adjusted(self, logits: Tensor, tau: float) -> Tensor:
        """``logits + τ · log π`` in float32; ``logits`` as they are at ``τ = 0`` (no prior needed then)."""
        if tau == 0:
            return logits
        return logits.float() + tau * self.log_prior.float()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if f"{prefix}log_prior" in state_dict:  # a checkpoint's priors (a resumed run, coretune test)
            self._priors_known = True
