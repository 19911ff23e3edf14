r"""ERM++'s head-only warm-up (Teterwak et al., "ERM++: An Improved Baseline for Domain Generalization"; DomainBed's
``ERMPlusPlus``), as an objective.

DomainBed's ``ERMPlusPlus`` (``domainbed/algorithms.py``, with ``ErmPlusPlusMovingAvg`` in ``domainbed/lib/misc.py``)
is ERM on the pooled training domains with three additions:

1. **head-only warm-up** — while ``global_iter <= linear_steps`` (500) only the linear classifier steps (its own
   Adam, ``linear_lr``); the network stays in training mode, so BatchNorm statistics follow the data;
2. **weight averaging** — from iteration ``sma_start_iter`` (600) the evaluated network is the simple moving
   average of every step's weights and buffers, :math:`\bar w_n = (n\, \bar w_{n-1} + w_t) / (n + 1)`;
3. **the longer schedule** — ``scripts/train_autolr.py``: a first run lowers Adam's lr by ReduceLROnPlateau
   (patience 1) on the averaged network's validation loss and stops after three changes; a second run replays
   that schedule.

This objective is part 1, exactly: the loss is :math:`CE(G_y(z), y)` with ``z`` detached from the backbone during
the first ``linear_steps + 1`` optimiser steps (DomainBed's ``global_iter > linear_steps`` test, ``global_iter``
counting the updates made), so the backbone receives no gradient and no optimiser step then (an optimiser skips a
parameter without a gradient: no weight decay either) while its BatchNorm statistics follow the batches, as in
DomainBed. The step count is a buffer (``steps``): checkpoints keep it, a resumed run goes on with it.

Part 2 is the engine's (it changes the evaluated network, not the loss): ``--averaging.sma_start_step 600``
(:mod:`coretune.engine.averaging`, SMA: DomainBed's moving average of every step's weights and buffers, which
validation, the checkpoints and the test use). ``configs/dg/erm_pp.yaml`` is ERM++ as one recipe: this objective, that
average, DomainBed's ERM++ hyper-parameters (Adam at a constant 5e-5, no weight decay, 32 images per training
domain) and part 3's longer training as a step count (20,000 steps, 4x DomainBed's 5,001; the authors' repository
trains long, chooses the step count on the held-out 20% and retrains on all the data, which is not automated here).
Part 3's plateau decay is the engine's too (``--model.optim.plateau_patience 1 --model.optim.plateau_stop 3``,
:mod:`coretune.engine.plateau`, in the recipe): ``train_autolr.py``'s first run, ReduceLROnPlateau on the averaged
network's held-out loss, stopped at the third change; its second run, that schedule replayed on all the data, is not
automated.

Differences from DomainBed: one optimiser (the run's) rather than a second Adam for the warm-up, so the
classifier's warm-up lr is ``--model.optim.lr`` (DomainBed's ``linear_lr`` defaults to 5e-5, its ``lr`` too) and its
Adam moments carry over into the full training; a non-linear classifier (``nonlinear_classifier``, off in
DomainBed) and LARS (off) are not offered.

Under DDP the warm-up leaves the backbone without gradients, which DDP waits for: use ``--trainer.strategy
ddp_find_unused_parameters_true``.

Terms: ``ce``, ``loss``, ``warmup`` (1 while the backbone is held, else 0).

Args:
    linear_steps: the optimiser steps of head-only warm-up after the first (DomainBed's ``linear_steps``, 500).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["ERMPlusPlus"]


@register("erm_pp", doc="ERM++ (Teterwak et al.; DomainBed's ERMPlusPlus): CE after a head-only warm-up.")
class ERMPlusPlus(Objective):
    """ERM++'s head-only warm-up: cross-entropy, the backbone held for the first ``linear_steps + 1`` optimiser
    steps (see the module docstring for the maths and for what of DomainBed's ``ERMPlusPlus`` is here)."""

    #: None that ``coretune tune`` searches: DomainBed fixes ``linear_steps`` at 500 in its hyper-parameter registry
    #: (``lambda r: 500``), and it is an integer (tune proposes floats); pass ``--objective.linear_steps``.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {}

    def __init__(self, linear_steps: int = 500, label_smoothing: float = 0.0) -> None:
        """Args:
        linear_steps: the optimiser steps of head-only warm-up after the first (DomainBed's ``linear_steps``).
        label_smoothing: label smoothing of the cross-entropy (:attr:`Objective.label_smoothing`), in [0, 1)."""
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        if isinstance(linear_steps, bool) or not isinstance(linear_steps, int) or linear_steps < 0:
            raise ValueError(f"invalid ERM++ settings: linear_steps must be an int >= 0 (got {linear_steps!r})")
        self.linear_steps = linear_steps
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    @property
    def warming_up(self) -> bool:
        """Whether the next optimiser step is a head-only one (DomainBed: ``not global_iter > linear_steps``)."""
        return int(self.steps) <= self.linear_steps

    def on_after_optimizer_step(self) -> None:
        """Count the optimiser step (DomainBed's ``global_iter += 1`` after each update)."""
        self.steps += 1

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        warming_up = self.warming_up
        logits = self.classifier(features.detach() if warming_up else features)
        loss = self.cross_entropy(logits, labels)
        held = torch.tensor(float(warming_up), device=loss.device)
        terms = {"ce": loss.detach(), "loss": loss.detach(), "warmup": held}
        return ObjectiveOutput(loss, logits, terms)
