"""Optimisers and learning-rate schedules of the paper (Appendix C): SGD + Nesterov, cosine or linear decay; Adam
with exponential decay (domain generalization); DeepLab's poly decay for segmentation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from ..models.lora import LoRASettings

__all__ = [
    "EXPONENTIAL_FINAL_FACTOR",
    "LR_OPTION",
    "SCHEDULE_OPTION",
    "OptimSettings",
    "OptimizerName",
    "Schedule",
    "build_optimizer",
    "build_schedule",
    "diverged_fix",
    "layer_decay_groups",
    "lp_ft_factor",
    "lr_factor",
    "optimizer_problems",
    "resume_schedule",
    "schedule_steps",
    "unbounded_schedule_problem",
]

OptimizerName = Literal["sgd", "adam", "adamw"]
Schedule = Literal["cosine", "linear", "poly", "constant", "exponential"]

POLY_POWER = 0.9
"""The exponent of the poly schedule (DeepLab: ``(1 - step / total) ** 0.9``)."""

#: Where the ``exponential`` schedule ends, as a fraction of the base lr: Appendix C decays domain generalization's
#: Adam lr "via the exponential learning rate decay" without a rate, so the lr falls tenfold over the run.
EXPONENTIAL_FINAL_FACTOR = 0.1


def optimizer_problems(lr: float, weight_decay: float, momentum: float, warmup_epochs: float) -> list[str]:
    """What is wrong with these optimiser settings (one sentence each; empty when they are valid): those a
    pre-training run shares with :meth:`OptimSettings.problems`."""
    checks = (
        (lr > 0, f"lr must be > 0 (got {lr})"),
        (weight_decay >= 0, f"weight_decay must be >= 0 (got {weight_decay})"),
        (0 <= momentum < 1, f"momentum must lie in [0, 1) (got {momentum})"),
        (warmup_epochs >= 0, f"warmup_epochs must be >= 0 (got {warmup_epochs})"),
    )
    return [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class OptimSettings:
    """The optimiser and learning-rate schedule of a fine-tuning run (paper Appendix C: SGD with Nesterov momentum,
    cosine decay): ``coretune fit --model.optim.<x>``, ``model: {optim: {lr: 0.01}}`` in a config file,
    ``FineTuner(optim=OptimSettings(lr=0.01))`` in Python.

    Args:
        optimizer: ``sgd`` (Nesterov momentum, the paper's), ``adam`` (domain generalisation) or ``adamw``.
        lr: learning rate of the new heads, and of the backbone unless ``backbone_lr`` is given.
        backbone_lr: separate learning rate of the pre-trained backbone.
        momentum: SGD momentum.
        nesterov: Nesterov momentum for SGD.
        weight_decay: weight decay of every parameter group (objectives whose reference code trains without it,
            L2-SP and DELTA, replace it: ``Objective.optimizer_weight_decay``).
        schedule: per-step learning-rate decay: ``cosine`` (paper default), ``linear`` (ImageNet20), ``poly``
            (DeepLab's ``(1 - step / total) ** 0.9``, segmentation), ``constant`` or ``exponential`` (to a tenth
            over the run: domain generalisation's Adam).
        warmup_epochs: linear warm-up length in epochs (may be fractional); with ``lp_epochs``, of the fine-tuning
            phase.
        lp_epochs: LP-FT (Kumar et al., ICLR 2022): the first ``lp_epochs`` epochs of the run train the objective's
            heads only, on the frozen backbone in evaluation mode (a linear probe), and the rest fine-tunes from
            them, with the schedule started afresh (:func:`lp_ft_factor`); 0 (default): no linear-probing phase.
        lp_lr: the heads' learning rate during the linear-probing phase (default: ``lr``).
        train_blocks: surgical fine-tuning (Lee et al., ICLR 2023): the backbone's blocks that train, the rest
            frozen (``layer1``, ``stem,layer1``, ``blocks.0-3``; :mod:`coretune.models.blocks`); the heads always
            train. ``None`` (default): the whole backbone trains.
        ftp: FTP (Tian et al., NeurIPS 2023): after each step, project every backbone tensor to within a learned
            distance of its pre-trained value (:mod:`coretune.engine.ftp`).
        ftp_k: FTP's gradient-annealing factor ``k`` in [0, 1] (the authors' default 1: none).
        layer_decay: layer-wise learning-rate decay (BEiT, MAE, timm's ``--layer-decay``) in (0, 1]: the backbone's
            layer ``i`` of ``L`` (timm's ``group_matcher`` grouping, layers counted as BEiT, MAE and iBOT count
            them: the stem 0, each block ``1..L-2``, the final norm ``L-1``) trains at
            ``backbone lr × layer_decay ** (L - 1 - i)``, built by timm's ``param_groups_layer_decay``, which also
            exempts 1-D tensors (biases, norms) and the model's ``no_weight_decay()`` (position embedding, class
            token) from weight decay; the objective's heads (the task's classifier, a projection head) train at
            ``lr`` × 1.0, the top group's scale, their 1-D tensors without weight decay too. ``None`` (default):
            off, one backbone group and one head group, every tensor with weight decay. For timm models and the
            torchvision ResNets (timm's ResNet grouping).
        lora: LoRA on the backbone (:class:`~coretune.models.lora.LoRASettings`, ``--model.optim.lora.rank 8``): only
            its low-rank weights train in the backbone; off by default (rank 0).
        plateau_patience: decay every learning rate tenfold after more than this many validations in a row without
            a lower validation loss (torch's ``ReduceLROnPlateau``, DomainBed's ERM++: 1), on top of ``schedule``
            (:mod:`coretune.engine.plateau`); None (default): off. Needs a validation split that is not the test
            split.
        plateau_stop: with ``plateau_patience``, end the run at the epoch of this many decays (DomainBed's ERM++
            ``train_autolr.py``: 3); None (default): the run's length.
    """

    optimizer: OptimizerName = "sgd"
    lr: float = 0.01
    backbone_lr: float | None = None
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 1e-4
    schedule: Schedule = "cosine"
    warmup_epochs: float = 0.0
    layer_decay: float | None = None
    lp_epochs: int = 0
    lp_lr: float | None = None
    train_blocks: str | None = None
    ftp: bool = False
    ftp_k: float = 1.0
    lora: LoRASettings = LoRASettings()  # noqa: RUF009  (frozen: never changed)
    plateau_patience: int | None = None
    plateau_stop: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # a checkpoint's settings: the group as a dict
            object.__setattr__(self, "lora", LoRASettings(**self.lora))

    def problems(self) -> list[str]:
        """What is wrong with these settings (one sentence each, naming the setting and its valid values; empty
        when they are valid)."""
        problems = []
        if self.optimizer not in get_args(OptimizerName):
            problems.append(f"optimizer must be one of {', '.join(get_args(OptimizerName))} (got {self.optimizer!r})")
        problems += optimizer_problems(self.lr, self.weight_decay, self.momentum, self.warmup_epochs)
        if self.backbone_lr is not None and self.backbone_lr < 0:
            problems.append(f"backbone_lr must be >= 0 (got {self.backbone_lr})")
        if self.schedule not in get_args(Schedule):
            problems.append(f"schedule must be one of {', '.join(get_args(Schedule))} (got {self.schedule!r})")
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            problems.append(f"layer_decay must lie in (0, 1] (got {self.layer_decay}; 0.75 is DINO's and iBOT's ViT-S)")
        if self.lp_epochs < 0:
            problems.append(f"lp_epochs must be >= 0 (got {self.lp_epochs})")
        if self.lp_lr is not None and self.lp_lr <= 0:
            problems.append(f"lp_lr must be > 0 (got {self.lp_lr})")
        if self.lp_lr is not None and self.lp_epochs == 0:
            problems.append("lp_lr is the linear-probing phase's learning rate: give lp_epochs > 0 too, or drop lp_lr")
        if self.train_blocks is not None and not self.train_blocks.strip():
            problems.append("train_blocks is empty: name the backbone's blocks that train (e.g. layer1), or drop it")
        if not 0 <= self.ftp_k <= 1:
            problems.append(f"ftp_k must lie in [0, 1] (got {self.ftp_k})")
        elif self.ftp_k != 1.0 and not self.ftp:
            problems.append("ftp_k is FTP's gradient annealing: give ftp true too, or drop ftp_k")
        return problems + self._plateau_problems() + self.lora.problems()

    def _plateau_problems(self) -> list[str]:
        patience, stop = self.plateau_patience, self.plateau_stop
        problems = []
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 0):
            problems.append(f"plateau_patience must be an int >= 0 (got {patience!r}), e.g. 1 (ERM++'s)")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or stop < 1):
            problems.append(f"plateau_stop must be an int >= 1 (got {stop!r}), e.g. 3 (ERM++'s)")
        elif stop is not None and patience is None:
            problems.append("plateau_stop counts plateau decays: give plateau_patience too (e.g. 1), or drop it")
        return problems

    @property
    def backbone_rate(self) -> float:
        """The backbone's learning rate: ``backbone_lr``, else ``lr``."""
        return self.lr if self.backbone_lr is None else self.backbone_lr


def build_optimizer(
    groups: Iterable[tuple[list[nn.Parameter], float] | dict[str, Any]],
    name: OptimizerName = "sgd",
    momentum: float = 0.9,
    nesterov: bool = True,
    weight_decay: float = 1e-4,
) -> torch.optim.Optimizer:
    """An optimiser over ``(params, lr)`` groups, or torch's group dicts (``{"params", "lr", "weight_decay"}``, a
    group's own ``weight_decay`` overriding ``weight_decay``); empty groups are dropped."""
    param_groups = [
        dict(group) if isinstance(group, dict) else {"params": group[0], "lr": group[1]} for group in groups
    ]
    param_groups = [group for group in param_groups if group["params"]]
    if name == "sgd":
        return torch.optim.SGD(
            param_groups, momentum=momentum, nesterov=nesterov and momentum > 0, weight_decay=weight_decay
        )
    if name == "adam":
        return torch.optim.Adam(param_groups, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(param_groups, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose 'sgd', 'adam' or 'adamw'")


class _Named:
    """What timm's ``param_groups_layer_decay`` reads of a model: its ``named_parameters`` and ``group_matcher``."""

    def __init__(self, module: nn.Module, matcher: dict[str, Any]) -> None:
        self.named_parameters, self._matcher = module.named_parameters, matcher

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return self._matcher


_MERGED = (99999,)
"""timm's ``MATCH_PREV_GROUP``: a matcher entry with this suffix joins the group before it."""

_OWN_LAYER = (99998,)
"""The suffix that makes such an entry a layer of its own, after every block."""


def _own_top_layers(matcher: dict[str, Any]) -> dict[str, Any]:
    """``matcher`` with each entry that timm merges into the group before it (a ViT's final ``norm`` into its last
    block: ``MATCH_PREV_GROUP``) made a layer of its own above the blocks, as BEiT, MAE and iBOT count layers:
    their published decays (0.65, 0.75) then mean what they meant (the last block at ``decay ** 1``; timm's
    grouping would put it at 1.0, every backbone rate ``1 / decay`` higher)."""

    def own(spec: Any) -> Any:
        if isinstance(spec, (list, tuple)):
            return [(pattern, _OWN_LAYER if tuple(suffix or ()) == _MERGED else suffix) for pattern, suffix in spec]
        return spec

    return {name: own(spec) for name, spec in matcher.items()}


def layer_decay_groups(
    body: nn.Module,
    matcher: dict[str, Any],
    layer_decay: float,
    lr: float,
    weight_decay: float,
    no_weight_decay: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """The parameter groups of ``body`` (its trainable tensors) with layer-wise learning-rate decay: timm's
    ``param_groups_layer_decay`` over ``matcher`` (timm's ``group_matcher(coarse=False)`` patterns of the body; a
    final norm a layer of its own, :func:`_own_top_layers`): layer ``i`` of ``L`` at ``decay ** (L - 1 - i)``,
    each group's ``lr_scale`` turned into its ``lr`` (``lr × lr_scale``), as torch optimisers take it: a schedule
    (``LambdaLR``) then multiplies each group's own rate. 1-D tensors and the ``no_weight_decay`` names get no
    weight decay (timm's rule); the others ``weight_decay``."""
    from timm.optim import param_groups_layer_decay

    groups = param_groups_layer_decay(
        _Named(body, _own_top_layers(matcher)),  # type: ignore[arg-type]  (all it reads)
        weight_decay=weight_decay,
        no_weight_decay_list=tuple(no_weight_decay),
        layer_decay=layer_decay,
    )
    return [
        {"params": group["params"], "lr": lr * group["lr_scale"], "weight_decay": group["weight_decay"]}
        for group in groups
    ]


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


SCHEDULE_OPTION = "--model.optim.schedule"
"""The option of ``coretune fit`` that sets the schedule (``coretune pretrain``'s is ``--model.schedule``)."""

LR_OPTION = "--model.optim.lr"
"""The option of ``coretune fit`` that sets the learning rate (``coretune pretrain``'s is ``--model.lr``)."""


def unbounded_schedule_problem(schedule: str, option: str = SCHEDULE_OPTION) -> str | None:
    """Why a run without an epoch or step limit cannot follow ``schedule`` (the rest of a sentence that names the
    options that leave it unbounded, with the fixes; ``option``: the command's schedule option), or None for a
    schedule that needs no length (``constant``)."""
    if schedule == "constant":
        return None
    return (
        f"and no --trainer.max_steps give the {schedule} learning-rate schedule no length to decay over: pass "
        "--trainer.max_steps N (the run and its schedule end after N optimiser steps), a number of epochs "
        f"(--trainer.max_epochs N), or {option} constant"
    )


def schedule_steps(
    trainer: Any, warmup_epochs: float, schedule: Schedule, option: str = SCHEDULE_OPTION
) -> tuple[int, int]:
    """The optimiser steps of a Lightning ``trainer``'s run (the schedule's length) and of its warm-up,
    ``warmup_epochs`` × the steps of one epoch of its training loader (not of the run's length over its epochs: a
    ``max_steps`` that ends the run early, or an unbounded ``max_epochs -1``, leaves an epoch's steps as they are).

    Raises:
        ValueError: the run has no length (``max_epochs -1`` without ``max_steps``) and ``schedule`` needs one.
    """
    total = trainer.estimated_stepping_batches  # inf: max_epochs -1 without max_steps
    if not math.isfinite(total) or total < 0:
        if (problem := unbounded_schedule_problem(schedule, option)) is not None:
            raise ValueError(f"--trainer.max_epochs {trainer.max_epochs} (no epoch limit) {problem}")
        total = 0  # a constant schedule never reads it
    if trainer.train_dataloader is None:  # max_epochs -1: Lightning knows the length without the loader
        trainer.fit_loop.setup_data()
    batches = trainer.num_training_batches
    per_epoch = (
        math.ceil(batches / max(1, trainer.accumulate_grad_batches))
        if math.isfinite(batches)
        else total / max(1, trainer.max_epochs or 1)  # an iterable loader of unknown length
    )
    return int(total), round(warmup_epochs * per_epoch)


def lp_ft_factor(
    step: int, total_steps: int, schedule: Schedule, warmup_steps: int, lp_steps: int, lp_scale: float = 1.0
) -> float:
    """Multiplier of the base lr at ``step`` of an LP-FT run (Kumar et al., ICLR 2022) whose first ``lp_steps``
    steps are the linear-probing phase: there ``lp_scale`` (``lp_lr / lr``) × ``schedule`` over those steps, without
    warm-up; then ``schedule`` afresh over the remaining ``total_steps - lp_steps`` steps, after ``warmup_steps`` of
    warm-up, as the paper's fine-tuning starts its own schedule from the probe. ``lp_steps`` 0: :func:`lr_factor`."""
    if step < lp_steps:
        return lp_scale * lr_factor(step, lp_steps, schedule)
    return lr_factor(step - lp_steps, max(0, total_steps - lp_steps), schedule, warmup_steps)


def build_schedule(
    optimizer: torch.optim.Optimizer,
    trainer: Any,
    warmup_epochs: float,
    schedule: Schedule,
    option: str = SCHEDULE_OPTION,
    lp_epochs: int = 0,
    lp_scale: float = 1.0,
    scale: Callable[[], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-step ``LambdaLR`` of ``schedule`` over a Lightning ``trainer``'s run, after a linear warm-up of
    ``warmup_epochs`` (:func:`schedule_steps`, which raises ``ValueError`` for a run without a length, naming the
    schedule's ``option``); with ``lp_epochs``, LP-FT's two phases (:func:`lp_ft_factor`); with ``scale``, each
    step's factor times ``scale()`` (a plateau decay's, :mod:`coretune.engine.plateau`)."""
    total, warmup = schedule_steps(trainer, warmup_epochs, schedule, option)
    scaled = scale or (lambda: 1.0)
    if lp_epochs == 0:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total, schedule, warmup) * scaled()
        )
    _, lp_steps = schedule_steps(trainer, lp_epochs, schedule, option)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lp_ft_factor(step, total, schedule, warmup, lp_steps, lp_scale) * scaled()
    )


def resume_schedule(trainer: Any) -> None:
    """Set the learning rate of each group a ``LambdaLR`` of ``trainer`` schedules to the schedule's value at the
    step the scheduler has reached. A resumed run restores its optimiser's last learning rate, of the schedule it
    was saved with; a run extended (a larger ``--trainer.max_epochs``) has a stretched schedule, whose value the
    first step after the resume must use (the restored one of a finished run is the old schedule's end: 0)."""
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            continue
        step = scheduler.last_epoch
        lrs = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs  # what get_last_lr() reports


def diverged_fix(precision: str | None, lr_option: str = LR_OPTION) -> str:
    """What to try when a run's loss or outputs blew up, for a run at Lightning ``precision`` (``"bf16-mixed"``,
    ``"32-true"``, …): a smaller step (``lr_option``: the command's learning-rate option) or clipped gradients
    (docs/results.md, section 7), and float32 when the run is not already in it."""
    fix = f"lower the learning rate ({lr_option}), clip the gradients (--trainer.gradient_clip_val 1.0)"
    if str(precision).startswith(("32", "64")):
        return fix.replace(", clip", " or clip") + "."
    return f"{fix}, or train in float32 (--trainer.precision 32-true)."
