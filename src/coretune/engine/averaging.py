r"""Weight averaging of a fine-tuning run: an exponential moving average of the weights (EMA), stochastic weight
averaging over the last epochs (SWA) or the simple moving average of every step's weights from a step on (SMA, ERM++'s),
``coretune fit --averaging.*`` (:class:`Averaging`), run by the
:class:`AveragedWeights` callback, Lightning's :class:`~lightning.pytorch.callbacks.WeightAveraging` (which keeps a
:class:`torch.optim.swa_utils.AveragedModel` of the whole model: backbone, task head and objective heads).

**EMA** (``--averaging.ema_decay d``; timm's ``--model-ema-decay``, MAE's and DINO's fine-tuning recipes): after each
optimiser step ``k`` (not each micro-batch of an accumulation window)

.. math:: \bar\theta_1 = \theta_1, \qquad \bar\theta_k = d\,\bar\theta_{k-1} + (1 - d)\,\theta_k,

over the parameters and the floating-point buffers (BatchNorm's running statistics), as timm's ``ModelEmaV3``
without its warm-up; integer buffers (BatchNorm's batch counter, a memory's fill count) are copied, as ``ModelEmaV3``
does.

**SWA** (``--averaging.swa_start s``; Izmailov et al., UAI 2018, eq. 2 and Algorithm 1): the equal average of the
weights at the end of each epoch from epoch ``s`` on (0-based; ``s < 1``: that fraction of ``--trainer.max_epochs``,
as Lightning's ``swa_epoch_start``),

.. math:: \bar\theta_n = \bar\theta_{n-1} + \frac{\theta_{e_n} - \bar\theta_{n-1}}{n},

then the averaged network's BatchNorm statistics recomputed with one pass over the training images
(:func:`torch.optim.swa_utils.update_bn`; the paper's §3.2: the average of weights has no running statistics of its
own), after every epoch averaged, so each validation, checkpoint and the final model has them. With
``--averaging.swa_lr`` every step from epoch ``s`` on runs at that constant rate (the paper's constant SWA schedule;
the heads' rate, the other parameter groups keep their ratio to it) instead of the ``--model.optim.schedule``.

**SMA** (``--averaging.sma_start_step s``; DomainBed's ``ErmPlusPlusMovingAvg``, ERM++'s average with ``s`` = 600):
from optimiser step ``s`` on, the equal average of the weights after every optimiser step, buffers included,

.. math:: \bar\theta_t = \frac{1}{t - s + 2} \sum_{k = s - 1}^{t} \theta_k \quad (t \ge s), \qquad
    \bar\theta_t = \bar\theta_{t-1} + \frac{\theta_t - \bar\theta_{t-1}}{t - s + 2},

where :math:`\theta_k` is the model after optimiser step ``k`` (:math:`\theta_0`: before the first); as in
DomainBed, whose average at its step ``sma_start_iter`` pairs that step's weights with the previous step's copy, the
first average (step ``s``) holds :math:`\theta_{s-1}` and :math:`\theta_s`. Floating-point buffers (BatchNorm's
running statistics) are averaged like the parameters, integer ones copied (DomainBed keeps its own counter). Then,
as DomainBed's ``ERMPlusPlus.update`` does (its ``freeze_bn`` False, the default), the step's training batch passes
through the averaged network in training mode, without gradients, so each BatchNorm layer's running statistics move
toward the averaged network's own statistics of that batch (the layer's momentum, 0.1 by default):
:math:`\bar\mu \leftarrow (1 - m)\,\bar\mu + m\,\mu_{\text{batch}}(\bar\theta_t)`, and the next average starts
from these (``--averaging.sma_bn_pass false``: the plain mean of the trained network's statistics). The pass runs
under the run's precision, with the random state forked (dropout or drop path in the pass leave the run's draws as
they were). Before step ``s`` the trained weights stand in (DomainBed: a copy of them).

With any of them, validation and the checkpoints hold the averaged weights (a checkpoint's ``state_dict``: what
``coretune test``, ``predict`` and ``export`` read; the trained ones are its ``current_model_state``, which a resume
continues from), the model ends the fit with them, and ``results.json`` records ``averaging`` (which weights the
test scored). Before the first average (SWA or SMA before its start) the trained weights stand in.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_swa_multi_avg_fn, update_bn

from .callbacks import update_results

__all__ = ["AveragedWeights", "Averaging", "ema_multi_avg_fn", "recompute_batch_norm", "sma_multi_avg_fn"]


@dataclass(frozen=True)
class Averaging:
    """``coretune fit --averaging.<x>``: which average of the weights a run validates, checkpoints and ends with
    (default: none, the trained weights).

    Args:
        ema_decay: an exponential moving average of the weights with this decay in (0, 1), updated after each
            optimiser step (0.9998 is timm's ImageNet value; a short CPU run wants 0.99–0.999: the average spans
            about 1/(1 - d) steps).
        swa_start: stochastic weight averaging from this epoch on (0-based): a whole number of epochs, or below 1
            a fraction of --trainer.max_epochs (0.75: the last quarter); BatchNorm statistics recomputed.
        swa_lr: with ``swa_start``, the heads' constant learning rate from the start (the other parameter groups
            keep their ratio to it); None keeps the --model.optim.schedule.
        sma_start_step: the equal average of the weights after every optimiser step from this step on (>= 1),
            buffers included: DomainBed's ERM++ average (``sma_start_iter`` 600; its first average, at this step,
            also holds the previous step's weights).
        sma_bn_pass: with ``sma_start_step``, pass each step's training batch through the averaged network in
            training mode after the average (DomainBed's ERM++, its ``freeze_bn`` False): BatchNorm statistics of
            the averaged weights; False keeps the plain mean of the trained network's statistics.

    Raises:
        ValueError: one line naming the bad setting.
    """

    ema_decay: float | None = None
    swa_start: float | None = None
    swa_lr: float | None = None
    sma_start_step: int | None = None
    sma_bn_pass: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            problems.append(f"ema_decay must lie in (0, 1) (got {self.ema_decay}), e.g. 0.999")
        if self.swa_start is not None and (self.swa_start < 0 or (self.swa_start >= 1 and self.swa_start % 1)):
            problems.append(
                f"swa_start must be a whole number of epochs >= 1 or a fraction of the epochs in [0, 1) "
                f"(got {self.swa_start})"
            )
        if self.swa_lr is not None and self.swa_start is None:
            problems.append("swa_lr needs swa_start (the epoch SWA starts from), e.g. --averaging.swa_start 0.75")
        if self.swa_lr is not None and not self.swa_lr > 0:
            problems.append(f"swa_lr must be > 0 (got {self.swa_lr})")
        sma = self.sma_start_step
        if sma is not None and (isinstance(sma, bool) or not isinstance(sma, int) or sma < 1):
            problems.append(f"sma_start_step must be an optimiser step >= 1 (got {sma!r}), e.g. 600 (ERM++'s)")
        if not isinstance(self.sma_bn_pass, bool):
            problems.append(f"sma_bn_pass must be true or false (got {self.sma_bn_pass!r})")
        elif not self.sma_bn_pass and sma is None:
            problems.append(
                "sma_bn_pass false needs sma_start_step (the BatchNorm pass is part of the SMA average), e.g. "
                "--averaging.sma_start_step 600"
            )
        chosen = [k for k in ("ema_decay", "swa_start", "sma_start_step") if getattr(self, k) is not None]
        if len(chosen) > 1:
            problems.append(f"{' and '.join(chosen)} are {len(chosen)} averages: choose one")
        if problems:
            raise ValueError("invalid weight-averaging settings (--averaging.*): " + "; ".join(problems))

    @property
    def kind(self) -> str | None:
        """``"ema"``, ``"swa"``, ``"sma"`` or None (off)."""
        if self.ema_decay is not None:
            return "ema"
        return "swa" if self.swa_start is not None else "sma" if self.sma_start_step is not None else None

    def start_epoch(self, max_epochs: int | None) -> int:
        """The 0-based epoch SWA starts averaging at, in a run of ``max_epochs``.

        Raises:
            ValueError: a fraction without a number of epochs, or a start at or beyond the last epoch.
        """
        assert self.swa_start is not None
        start = self.swa_start
        if start < 1:
            if max_epochs is None or max_epochs < 1:
                raise ValueError(
                    f"--averaging.swa_start {start} is a fraction of --trainer.max_epochs, which this run does not "
                    "set: set it, or give swa_start as a whole number of epochs"
                )
            return int(start * max_epochs)
        if max_epochs is not None and max_epochs >= 1 and start >= max_epochs:
            raise ValueError(
                f"--averaging.swa_start {int(start)} is at or after the run's last epoch (--trainer.max_epochs "
                f"{max_epochs}: epochs 0 to {max_epochs - 1}), so nothing would be averaged: start earlier, e.g. "
                "--averaging.swa_start 0.75"
            )
        return int(start)

    def callback(self) -> AveragedWeights | None:
        """The callback that runs these settings (None: off)."""
        return None if self.kind is None else AveragedWeights(self)


def ema_multi_avg_fn(decay: float) -> Any:
    """``AveragedModel``'s ``multi_avg_fn`` of EMA with ``decay``: :func:`torch.optim.swa_utils.get_ema_multi_avg_fn`
    (``torch._foreach_lerp_``) for floating-point tensors; integer ones (BatchNorm's ``num_batches_tracked``) are
    copied, as timm's ``ModelEmaV3`` does, instead of torch's rounded ``d·a + (1 - d)·b``."""
    return _counters_copied(get_ema_multi_avg_fn(decay))


def sma_multi_avg_fn() -> Any:
    """``AveragedModel``'s ``multi_avg_fn`` of the equal average (SMA): :func:`torch.optim.swa_utils.
    get_swa_multi_avg_fn` (``a + (b - a) / (n + 1)``) for floating-point tensors; integer ones (BatchNorm's
    ``num_batches_tracked``, which torch's would divide) are copied."""
    return _counters_copied(get_swa_multi_avg_fn())


def _counters_copied(lerp: Any) -> Any:
    """``lerp`` (a ``multi_avg_fn``) on floating-point tensors; integer ones are copied from the current model."""

    @torch.no_grad()
    def update(averaged: list[Tensor], current: list[Tensor], n_averaged: Tensor) -> None:
        if torch.is_floating_point(averaged[0]) or torch.is_complex(averaged[0]):
            lerp(averaged, current, n_averaged)
        else:
            for a, c in zip(averaged, current, strict=True):
                a.copy_(c)

    return update


def _has_running_statistics(model: torch.nn.Module) -> bool:
    """Whether a BatchNorm-like layer of ``model`` keeps running statistics (a ViT has none: no pass needed)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats for m in model.modules())


def _images(task: Any, batch: Any) -> Tensor:
    """A training batch's images, as the network takes them (a two-view batch: its first view)."""
    inputs = task.unpack(batch).inputs
    return inputs[0] if isinstance(inputs, list | tuple) else inputs


def recompute_batch_norm(model: Any, loader: Iterable[Any], device: torch.device) -> None:
    """``model``'s (a FineTuner's) BatchNorm statistics from one pass over ``loader``'s training batches (their
    training transform, as ``update_bn`` and the SWA paper do; a two-view batch: its first view) on ``device``:
    :func:`torch.optim.swa_utils.update_bn`, the run's random state left as it was (a resumed run repeats it)."""
    task = model.task

    def images() -> Iterator[Tensor]:
        for batch in loader:
            yield _images(task, batch)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        update_bn(images(), model, device=device)


class AveragedWeights(WeightAveraging):
    """Lightning's :class:`~lightning.pytorch.callbacks.WeightAveraging` set up by :class:`Averaging` (EMA, SWA or SMA;
    the maths in the module docstring), made to fit coretune's fits:

    * the averaged copy is made once the model is built (its heads exist only after ``FineTuner.setup``, which
      Lightning calls after the callbacks' ``setup``);
    * a resumed fit restores the averaged and the trained weights exactly (``trainer.test(ckpt_path=…)`` after
      the fit keeps the checkpoint's averaged weights, which Lightning's would replace by its trained ones);
    * before the first average the trained weights are validated and checkpointed (not the initial ones);
    * SWA averages at each epoch's last optimiser step (so that epoch's validation sees it) and recomputes the
      average's BatchNorm statistics on the training images there.
    """

    def __init__(self, settings: Averaging) -> None:
        if settings.kind is None:
            raise ValueError(
                "AveragedWeights needs an average: Averaging(ema_decay=…), Averaging(swa_start=…) or "
                "Averaging(sma_start_step=…)"
            )
        kind = settings.kind
        options: dict[str, Any] = (
            {"multi_avg_fn": ema_multi_avg_fn(settings.ema_decay)}
            if kind == "ema"
            else {"multi_avg_fn": sma_multi_avg_fn()}
            if kind == "sma"
            else {}
        )
        # SWA's buffers follow the trained model, then its BatchNorm statistics are recomputed (update_bn)
        super().__init__(use_buffers=kind != "swa", **options)
        self.settings = settings
        self._start: int | None = None  # SWA's first epoch, once the run's length is known
        self._latest_update_epoch = -1
        self._swapped = False
        self._loaded_entry: dict[str, Any] | None = None  # the averaging entry of the checkpoint a test loaded
        self._resumed_state: dict[str, Any] | None = None  # the average a resumed fit restores at its start
        # SMA: whether the averaged network has BatchNorm statistics to pass batches for (found once, at its first)
        self._bn_pass: bool | None = None if settings.kind == "sma" and settings.sma_bn_pass else False
        self._ended = False

    # -- set-up -----------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._average_model = None  # made by _ensure, once the model's heads exist
        self._ended = False  # the model holds the average (the fit's end)
        if self.settings.kind == "swa":
            self._start = self.settings.start_epoch(trainer.max_epochs)
            if trainer.datamodule is None:
                raise ValueError(
                    "--averaging.swa_start recomputes BatchNorm statistics on the training images of the data "
                    "module: fit with a data module (trainer.fit(model, datamodule=…))"
                )

    def _ensure(self, pl_module: L.LightningModule) -> AveragedModel:
        if self._average_model is None:
            self._average_model = AveragedModel(
                model=pl_module, device=self._device or pl_module.device, use_buffers=self._use_buffers, **self._kwargs
            )
        return self._average_model

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        averaged = self._ensure(pl_module)
        if self._resumed_state is not None:
            averaged.load_state_dict(self._resumed_state)
            self._resumed_state = None

    @property
    def n_averaged(self) -> int:
        """How many weights the average holds (0: none yet, the trained weights stand in)."""
        return 0 if self._average_model is None else int(self._average_model.n_averaged)

    def entry(self) -> dict[str, Any]:
        """What the weights a checkpoint or the model holds now are: ``weights`` (``ema``, ``swa``, ``sma``, or
        ``trained`` before the first average), the settings, and the number of steps (EMA: updates, SMA: the weights
        of ``steps_averaged`` steps) or epochs (SWA) averaged."""
        kind = self.settings.kind
        settings = {k: v for k, v in asdict(self.settings).items() if v is not None}
        if kind != "sma":
            del settings["sma_bn_pass"]
        counted = {"ema": "updates", "swa": "epochs_averaged", "sma": "steps_averaged"}
        counted = {counted[kind]: self.n_averaged}
        extra = {"start_epoch": self._start, "batch_norm": "recomputed on the training images"} if kind == "swa" else {}
        return {"weights": kind if self.n_averaged else "trained", **settings, **counted, **extra}

    # -- averaging --------------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.settings.sma_start_step == 1 and trainer.global_step == 0 and not self.n_averaged:
            self._ensure(pl_module).update_parameters(pl_module)  # SMA from step 1: the initial weights, theta_0
        lr = self.settings.swa_lr
        if lr is None or self._start is None or trainer.current_epoch < self._start:
            return
        for optimizer in trainer.optimizers:  # after the schedule's step: the constant SWA rate, group ratios kept
            groups = optimizer.param_groups
            top = max(g.get("initial_lr", g["lr"]) for g in groups)
            for group in groups:
                group["lr"] = lr * group.get("initial_lr", group["lr"]) / top

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step <= self._latest_update_step:  # no optimiser step (inside an accumulation window)
            return
        averaged = self._ensure(pl_module)
        kind = self.settings.kind
        if kind == "ema" or (kind == "sma" and trainer.global_step >= self.settings.sma_start_step - 1):
            averaged.update_parameters(pl_module)
            self._latest_update_step = trainer.global_step
            if self._bn_pass is None:
                self._bn_pass = _has_running_statistics(averaged.module)
            if self._bn_pass:
                self._batch_norm_pass(trainer, averaged.module, batch)
        elif (
            kind == "swa"
            and trainer.is_last_batch
            and (self._start or 0) <= trainer.current_epoch
            and self._new_epoch(trainer)
        ):
            averaged.update_parameters(pl_module)
            self._latest_update_step = trainer.global_step
            self._latest_update_epoch = trainer.current_epoch
            self._recompute_batch_norm(trainer, pl_module)

    @staticmethod
    def _batch_norm_pass(trainer: L.Trainer, averaged: Any, batch: Any) -> None:
        """DomainBed's ERM++ pass of the step's batch through the averaged network (a FineTuner) in training mode,
        without gradients, under the run's precision and with the random state forked: its BatchNorm running
        statistics move toward the averaged weights' statistics of the batch."""
        inputs = _images(averaged.task, batch)
        device = inputs.device
        was_training = averaged.training
        averaged.train()
        try:
            with (
                torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
                torch.no_grad(),
                trainer.precision_plugin.forward_context(),
            ):
                averaged(inputs)
        finally:
            averaged.train(was_training)

    def _new_epoch(self, trainer: L.Trainer) -> bool:
        """Whether this epoch is not yet in the SWA average (a run resumed at its end has it)."""
        return trainer.current_epoch > self._latest_update_epoch

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: SWA averages at the epoch's last step (Lightning's would here, after that epoch's validation)."""

    def _recompute_batch_norm(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The averaged network's BatchNorm statistics from one pass over the training images."""
        recompute_batch_norm(self._ensure(pl_module).module, trainer.datamodule.train_dataloader(), pl_module.device)

    # -- validation, the end of the fit -------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.n_averaged and not self._swapped:
            self._swap_models(pl_module)
            self._swapped = True

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._swapped:
            self._swap_models(pl_module)
            self._swapped = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_with_average(pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A fit resumed from the checkpoint of a finished run trains nothing (no ``on_train_end``): its model, the
        trained weights the checkpoint restored, ends with the average too."""
        self._end_with_average(pl_module)

    def _end_with_average(self, pl_module: L.LightningModule) -> None:
        if self._average_model is not None and not self._ended:
            if self.n_averaged:
                self._copy_average_to_current(pl_module)
            pl_module.averaging = self.entry()  # type: ignore[assignment]
            self._ended = True

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``results.json``'s ``averaging``: the settings, and which weights the test scored (``weights``): those
        of the checkpoint it loaded, else the model's own."""
        if not trainer.is_global_zero:
            return
        tested = self._loaded_entry if trainer.ckpt_path is not None else None
        update_results(trainer.default_root_dir, averaging=tested or getattr(pl_module, "averaging", None))

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]
        self._latest_update_epoch = state_dict.get("latest_update_epoch", -1)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """``state_dict``: the averaged weights (the trained ones before the first average), ``current_model_state``
        the trained ones, ``averaging_state`` the count; the model's ``averaging`` entry, which its own hook (after
        this one) writes into the checkpoint's ``coretune`` entry."""
        if self._average_model is None:
            return
        current = checkpoint["state_dict"]
        if self.n_averaged:
            super().on_save_checkpoint(trainer, pl_module, checkpoint)
            # an objective's extra state (not a tensor: Bi-tuning's queues) is the trained model's, never averaged
            checkpoint["state_dict"] = {
                k: (v if isinstance(current.get(k), Tensor) else current.get(k, v))
                for k, v in checkpoint["state_dict"].items()
            }
        else:
            checkpoint["current_model_state"] = current
            checkpoint["averaging_state"] = {"n_averaged": self._average_model.n_averaged.detach().clone()}
        pl_module.averaging = self.entry()  # type: ignore[assignment]

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Resuming a fit: the averaged and the trained weights as they were. Testing a checkpoint: nothing (its
        ``state_dict``, the averaged weights, is what is scored)."""
        self._loaded_entry = (checkpoint.get("coretune") or {}).get("averaging")
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if "current_model_state" not in checkpoint or "averaging_state" not in checkpoint:
            raise ValueError(
                f"checkpoint {trainer.ckpt_path} was written without weight averaging, so it has no average to "
                "continue: resume it without --averaging.*, or start a new run with another --run_dir"
            )
        state = {"module." + k: v for k, v in checkpoint["state_dict"].items()} | checkpoint["averaging_state"]
        current = checkpoint["current_model_state"]
        # an objective's extra state (not a tensor) is saved once, the trained model's
        state |= {"module." + k: v for k, v in current.items() if not isinstance(v, Tensor)}
        pl_module.load_state_dict(current)
        # loaded into the averaged copy at fit start, once the model is on its device (the copy is made there)
        self._resumed_state = state

    def _swap_models(self, pl_module: L.LightningModule) -> None:
        averaged = self._ensure(pl_module)
        mine = itertools.chain(averaged.module.parameters(), averaged.module.buffers())
        theirs = itertools.chain(pl_module.parameters(), pl_module.buffers())
        for a, b in zip(mine, theirs, strict=True):
            swap = a.data.clone()
            a.data.copy_(b.data)
            b.data.copy_(swap)
