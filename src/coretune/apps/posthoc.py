"""Post-hoc logit adjustment of a fine-tuned classifier (Menon et al., ICLR 2021, "Long-tail learning via logit
adjustment": the post-hoc logit-adjusted rule, beside the logit-adjusted loss that ``logit_adjusted`` trains with).

A classifier fine-tuned on class-imbalanced data predicts the head classes too often: the softmax of its logits
``f_y(x)`` estimates the training distribution's ``P(y | x)``, which carries the prior ``π_y``. Predicting
``argmax_y f_y(x) − τ · log π_y`` instead (τ = 1: the rule that minimises the balanced error when the softmax is
exact) removes the prior after training: no retraining, one number. ``coretune test``, ``validate`` and ``predict``
take it as ``--posthoc_adjustment τ``, and ``coretune export`` folds it into the classifier's bias; ``π`` is the
training split's class frequencies, which every ``coretune fit`` checkpoint records (``train_class_counts``). On
long-tailed CIFAR-10 (``docs/results.md`` section 15b) it gave a CE-tuned model 12.5 of the 12.8 points that training
with the logit-adjusted loss gave.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["POSTHOC_HELP", "add_posthoc_argument", "check_posthoc_adjustment", "posthoc_shift"]

POSTHOC_HELP = (
    "Post-hoc logit adjustment (Menon et al. 2021): predict argmax_y f_y(x) - TAU * log(pi_y), pi the class "
    "frequencies of the checkpoint's training split, for a classifier fine-tuned on class-imbalanced data without "
    "logit adjustment (1: the balanced-error rule; 0, the default: the logits as trained)."
)


def add_posthoc_argument(parser: Any) -> None:
    """Give ``parser`` the ``--posthoc_adjustment TAU`` option (default 0: none)."""
    parser.add_argument("--posthoc_adjustment", type=float, default=0.0, help=POSTHOC_HELP)


def check_posthoc_adjustment(tau: Any) -> None:
    """Refuse a value that is not a finite number >= 0, before anything is read.

    Raises:
        ValueError: the one-line problem and its fix.
    """
    if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau) or tau < 0:
        raise ValueError(
            f"--posthoc_adjustment must be a number >= 0 (got {tau!r}; 1: Menon et al.'s balanced-error rule, "
            "0: the logits as trained)"
        )


def posthoc_shift(model: Any, tau: float, ckpt_path: str | Path) -> Tensor | None:
    """``−τ · log π`` ``(K,)`` in float32 for the fine-tuned ``model`` (a FineTuner loaded from ``ckpt_path``), to
    add to its class logits (:attr:`FineTuner.logit_shift`); None at τ = 0. Warns when the checkpoint was fine-tuned
    with logit adjustment already (its objective keeps a ``log_prior``): its predictions would be adjusted twice.

    Raises:
        ValueError: τ is not a number >= 0; the checkpoint is not a classifier's, records no training images per
            class, or has a class without any (its prior is 0: its logit would become +∞).
    """
    check_posthoc_adjustment(tau)
    if tau == 0:
        return None
    if model.task.prediction_kind != "classes":
        raise ValueError(
            f"--posthoc_adjustment applies to classifiers; checkpoint {ckpt_path} is a {model.task.name} model "
            "(its logits are per pixel): drop --posthoc_adjustment"
        )
    counts, names = model.train_class_counts, model.class_names
    if counts is None:
        raise ValueError(
            f"checkpoint {ckpt_path} records no training images per class (train_class_counts: a checkpoint from "
            "before they were kept, or not written by coretune fit): post-hoc logit adjustment needs them; drop "
            "--posthoc_adjustment"
        )
    if empty := [i for i, n in enumerate(counts) if n <= 0]:
        name = names[empty[0]] if names else str(empty[0])
        raise ValueError(
            f"checkpoint {ckpt_path}: class {name!r} had no training image, so its prior is 0 and its adjusted logit "
            "would be infinite: drop --posthoc_adjustment (or fine-tune with images of every class)"
        )
    if hasattr(model.objective, "log_prior"):  # logit_adjusted, or core / ce_mix with logit_adjustment > 0
        warnings.warn(
            f"checkpoint {ckpt_path} was fine-tuned with logit adjustment ({model.objective.registered_name}): "
            f"--posthoc_adjustment {tau:g} adjusts its predictions a second time",
            UserWarning,
            stacklevel=2,
        )
    prior = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    return (-tau * prior.log()).float()
