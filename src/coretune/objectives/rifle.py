"""RIFLE: periodic re-initialisation of the classifier during fine-tuning (Li et al., ICML 2020)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["RIFLE"]


@register("rifle", doc="RIFLE (Li et al., 2020): CE, re-initialising the classifier at evenly spaced epochs.")
class RIFLE(Objective):
    r"""RIFLE: cross-entropy, re-initialising the classifier a few times during training (Li et al., 2020).

    "RIFLE: Backpropagation in depth for deep transfer learning through Re-Initializing the Fully-connected
    LayEr" (Li et al., ICML 2020).

    The loss is plain cross-entropy; the new classifier is re-initialised (``nn.Linear.reset_parameters``) at
    the start of the epochs

    .. math:: e_k = \left\lfloor \frac{k\, p\, T}{n + 1} \right\rfloor, \quad k = 1, \dots, n

    for ``T`` training epochs, ``n = reinit_times`` and ``p = reinit_fraction`` (epoch 0 and duplicates
    dropped, see :meth:`schedule`). With ``p = 1`` this splits training into ``n + 1`` periods of equal
    length, as the authors' ``train.py`` does (``fc_layer.reset_parameters()`` every ``T/(n+1)`` epochs; e.g.
    epochs 10, 20, 30 of 40 for ``n = 3``); ``p < 1`` confines the re-initialisations to the first ``p`` of
    training. The authors' own command (``run.sh``) uses ``--fc_reinit_times=1`` (``n = 1``: one
    re-initialisation, half-way); the default ``n = 3`` gives 4 periods, the largest number the Paddle port of
    the authors tries (2–4 periods, best reported per dataset).

    Differences from the reference code (the authors' ``train.py``): the classifier's optimiser state (momentum)
    is cleared at each re-initialisation, where ``train.py`` keeps it; the optional cyclic learning rate of the
    classifier (``--fc_lr_util cyclic``, off in ``run.sh``) is not implemented (the engine's schedule drives
    every layer); the optimiser, batch size and schedule are the engine's (``--model.*``, ``--data.batch_size``),
    not ``train.py``'s (SGD with plain momentum 0.9, batch 32, a cosine decay stepped per epoch).

    After a re-initialisation the optimiser's state for the classifier (momentum, Adam moments) is stale:
    :attr:`needs_optimizer_reset` becomes ``True``, and the engine should call :meth:`reset_optimizer_state`
    with its optimiser (which clears the flag); :attr:`reinitialized_at` lists the epochs when it happened.

    Terms: ``ce``, ``loss``.

    Args:
        reinit_times: number ``n >= 0`` of re-initialisations (0 is CE-tuning).
        reinit_fraction: fraction ``p ∈ (0, 1]`` of the training over which they are spread.
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    #: None that ``coretune tune`` searches: RIFLE's hyper-parameter, the number of re-initialisations ``n`` (the
    #: authors try 2–4 periods, n ∈ {1, 2, 3}), is an integer and tune proposes floats; pass
    #: ``--objective.reinit_times`` to a fit (or a bench spec) instead.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {}

    def __init__(self, reinit_times: int = 3, reinit_fraction: float = 1.0, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        problems = []
        if reinit_times < 0:
            problems.append(f"reinit_times must be >= 0 (got {reinit_times})")
        if not 0.0 < reinit_fraction <= 1.0:
            problems.append(f"reinit_fraction must lie in (0, 1] (got {reinit_fraction})")
        if problems:
            raise ValueError("invalid RIFLE settings: " + "; ".join(problems))
        self.reinit_times, self.reinit_fraction = reinit_times, reinit_fraction
        self.reinitialized_at: list[int] = []
        self.needs_optimizer_reset = False

    def schedule(self, max_epochs: int) -> list[int]:
        """The 0-based epochs at whose start the classifier is re-initialised, for ``max_epochs`` epochs."""
        n, p = self.reinit_times, self.reinit_fraction
        epochs = {int(k * p * max_epochs // (n + 1)) for k in range(1, n + 1)}
        return sorted(e for e in epochs if 0 < e < max_epochs)

    def on_train_epoch_start(self, epoch: int, max_epochs: int) -> None:
        """Re-initialise the classifier if ``epoch`` is scheduled (see the class docstring)."""
        self._check_built()
        if epoch in self.schedule(max_epochs):
            self.classifier.reset_parameters()
            self.reinitialized_at.append(epoch)
            self.needs_optimizer_reset = True

    def reset_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop ``optimizer``'s per-parameter state (momentum buffers …) of the classifier's parameters."""
        for p in self.classifier.parameters():
            optimizer.state.pop(p, None)
        self.needs_optimizer_reset = False

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        logits = self.classifier(features)
        ce = self.cross_entropy(logits, labels)
        return ObjectiveOutput(ce, logits, {"ce": ce.detach(), "loss": ce.detach()})
