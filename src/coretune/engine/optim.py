"""Optimisers and learning-rate schedules of the paper (Appendix C): SGD + Nesterov, cosine or linear decay; Adam
with exponential decay (domain generalization); DeepLab's poly decay for segmentation."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

__all__ = ["EXPONENTIAL_FINAL_FACTOR", "Schedule", "build_optimizer", "diverged_fix", "lr_factor", "optimizer_problems"]

OptimizerName = Literal["sgd", "adam", "adamw"]
Schedule = Literal["cosine", "linear", "poly", "constant", "exponential"]

POLY_POWER = 0.9
"""The exponent of the poly schedule (DeepLab: ``(1 - step / total) ** 0.9``)."""

#: Where the ``exponential`` schedule ends, as a fraction of the base lr: Appendix C decays domain generalization's
#: Adam lr "via the exponential learning rate decay" without a rate, so the lr falls tenfold over the run.
EXPONENTIAL_FINAL_FACTOR = 0.1


def optimizer_problems(lr: float, weight_decay: float, momentum: float, warmup_epochs: float) -> list[str]:
    """What is wrong with these optimiser settings (one sentence each; empty when they are valid)."""
    checks = (
        (lr > 0, f"lr must be > 0 (got {lr})"),
        (weight_decay >= 0, f"weight_decay must be >= 0 (got {weight_decay})"),
        (0 <= momentum < 1, f"momentum must lie in [0, 1) (got {momentum})"),
        (warmup_epochs >= 0, f"warmup_epochs must be >= 0 (got {warmup_epochs})"),
    )
    return [message for ok, message in checks if not ok]


def build_optimizer(
    groups: Iterable[tuple[list[nn.Parameter], float]],
    name: OptimizerName = "sgd",
    momentum: float = 0.9,
    nesterov: bool = True,
    weight_decay: float = 1e-4,
) -> torch.optim.Optimizer:
    """An optimiser over ``(params, lr)`` groups; empty groups are dropped."""
    param_groups = [{"params": params, "lr": lr} for params, lr in groups if params]
    if name == "sgd":
        return torch.optim.SGD(
            param_groups, momentum=momentum, nesterov=nesterov and momentum > 0, weight_decay=weight_decay
        )
    if name == "adam":
        return torch.optim.Adam(param_groups, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(param_groups, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose 'sgd', 'adam' or 'adamw'")


def lr_factor(step: int, total_steps: int, schedule: Schedule = "cosine", warmup_steps: int = 0) -> float:
    """Multiplier of the base lr at ``step``: linear warm-up, then cosine (default), linear or poly
    (``(1 - progress) ** 0.9``, DeepLab's) decay to 0, constant, or exponential decay
    ``EXPONENTIAL_FINAL_FACTOR ** progress`` (a constant rate per step, ending at a tenth)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "poly":
        return (1.0 - progress) ** POLY_POWER
    if schedule == "exponential":
        return EXPONENTIAL_FINAL_FACTOR**progress
    raise ValueError(f"unknown schedule {schedule!r}; choose 'cosine', 'linear', 'poly', 'constant' or 'exponential'")


def diverged_fix(precision: str | None) -> str:
    """What to try when a run's loss or outputs blew up, for a run at Lightning ``precision`` (``"bf16-mixed"``,
    ``"32-true"``, …): a smaller step or clipped gradients (docs/results.md, section 7), and float32 when the run is
    not already in it."""
    fix = "lower the learning rate (--model.lr), clip the gradients (--trainer.gradient_clip_val 1.0)"
    if str(precision).startswith(("32", "64")):
        return fix.replace(", clip", " or clip") + "."
    return f"{fix}, or train in float32 (--trainer.precision 32-true)."
