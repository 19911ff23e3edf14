r"""Learning-rate decay on a validation plateau (``coretune fit --model.optim.plateau_patience P``), as DomainBed's
ERM++ finds its schedule (``domainbed/scripts/train_autolr.py`` with ``ERMPlusPlus.set_lr``).

After each validation the run's validation loss ``val/loss`` (of the averaged weights when ``--averaging.*`` is on:
DomainBed's ``network_sma``) goes through torch's :class:`~torch.optim.lr_scheduler.ReduceLROnPlateau` rule with
DomainBed's settings (mode ``min``, ``patience`` P, factor 0.1, relative threshold 1e-4, no cooldown): after more
than P validations in a row without a relative improvement of 1e-4 on the best loss, a factor ``s`` (1 at the start)
is multiplied by 0.1. Every learning rate of the run is the step schedule's (``--model.optim.schedule``, warm-up,
LP-FT) times ``s``:

.. math:: \eta_g(t) = \eta_g \, \lambda(t) \, s_t, \qquad s_t = 0.1^{\,d_t},

``d_t`` the decays so far, applied from the step after the validation that decided it. With
``--model.optim.plateau_stop N`` the run ends at the end of the epoch whose validation made the ``N``-th decay, as
``train_autolr.py`` ends its first run at the third change of its learning rate (it sets the rate to 0 and stops).

The rule is torch's own, run on a one-parameter optimiser whose learning rate is ``s`` (its state and the decays are
checkpointed with the callback's state: a resumed run goes on with them). ``results.json`` records ``plateau``
(:meth:`PlateauDecay.entry`): the settings, the decays, the final factor and whether the stop ended the run.

The validations during an objective's head-only warm-up (ERM++'s ``linear_steps``: an objective whose
``warming_up`` is true) do not count, as DomainBed's ``ERMPlusPlus.set_lr`` reads the loss only once
``global_iter > linear_steps``; ``results.json``'s ``plateau.skipped_warmup`` counts them.

Differences from DomainBed: its rule reads the held-out loss every ``checkpoint_freq`` steps, here at every
validation of the run (``--trainer.check_val_every_n_epoch``, ``val_check_interval``); its second run (the schedule
found, replayed on all the data) is not automated.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from .optim import resume_schedule

__all__ = ["PLATEAU_FACTOR", "PLATEAU_MONITOR", "PlateauDecay"]

#: The factor of each decay (torch's and DomainBed's ReduceLROnPlateau default).
PLATEAU_FACTOR = 0.1
#: The logged value the rule watches.
PLATEAU_MONITOR = "val/loss"


class PlateauDecay(L.Callback):
    """The plateau factor ``s`` of a fine-tuning run (the maths in the module docstring): :attr:`scale` multiplies
    the step schedule (``FineTuner.configure_optimizers`` reads it), :meth:`on_validation_end` updates it.

    Args:
        patience: validations without improvement tolerated before a decay (ReduceLROnPlateau's ``patience``;
            DomainBed's ERM++: 1).
        stop: end the run at the epoch of this many decays (DomainBed's ``train_autolr.py``: 3); None: never.
    """

    def __init__(self, patience: int, stop: int | None = None) -> None:
        self.patience, self.stop = patience, stop
        self._holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # its lr is the factor
        self.rule = ReduceLROnPlateau(self._holder, mode="min", factor=PLATEAU_FACTOR, patience=patience)
        self.decays = 0
        self.stopped = False
        self.skipped_warmup = 0

    @property
    def state_key(self) -> str:
        return "PlateauDecay"

    @property
    def scale(self) -> float:
        """``s``: the product of the decays so far (1.0 before the first)."""
        return float(self._holder.param_groups[0]["lr"])

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if getattr(getattr(pl_module, "objective", None), "warming_up", False):
            self.skipped_warmup += 1  # DomainBed's set_lr: no plateau step before global_iter > linear_steps
            return
        loss = self.monitored(trainer)
        if loss is None or not math.isfinite(loss):
            return  # a non-finite loss is the health checks' to report, not a plateau
        before = self.scale
        self.rule.step(loss)
        if self.scale < before:
            self.decays += 1
            resume_schedule(trainer)  # the next step runs at the decayed rate
        if self.stop is not None and self.decays >= self.stop and not self.stopped:
            self.stopped = True
            trainer.should_stop = True

    @staticmethod
    def monitored(trainer: L.Trainer) -> float | None:
        """The validation loss just logged (None when this validation logged none)."""
        value = trainer.callback_metrics.get(PLATEAU_MONITOR)
        return None if value is None else float(value)

    def entry(self) -> dict[str, Any]:
        """``results.json``'s ``plateau``."""
        return {
            "patience": self.patience,
            "stop": self.stop,
            "factor": PLATEAU_FACTOR,
            "monitor": PLATEAU_MONITOR,
            "decays": self.decays,
            "lr_scale": self.scale,
            "stopped": self.stopped,
            "skipped_warmup": self.skipped_warmup,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule.state_dict(),
            "scale": self.scale,
            "decays": self.decays,
            "stopped": self.stopped,
            "skipped_warmup": self.skipped_warmup,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rule.load_state_dict(state_dict["rule"])
        self._holder.param_groups[0]["lr"] = state_dict["scale"]  # the rule's state holds all but its optimiser's
        self.decays, self.stopped = state_dict["decays"], state_dict["stopped"]
        self.skipped_warmup = state_dict.get("skipped_warmup", 0)  # absent from checkpoints before it was counted
