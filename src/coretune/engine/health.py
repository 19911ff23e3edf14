"""Output health: a fine-tuning run that diverged stops with one line instead of ending with the score of a broken
model. A non-finite training loss (:func:`training_blowup` words it; :class:`~coretune.engine.FineTuner` raises it at
the step), and an evaluation epoch whose loss is not finite, whose outputs collapsed (:class:`OutputWatch`) or whose
logits exploded (:data:`LOGIT_LIMIT`): :class:`OutputHealth`, the callback every FineTuner installs
(``configure_callbacks``), raises :class:`NonFiniteLossError` at that epoch's end. Under ``16-mixed`` a gradient
scaler that keeps skipping optimiser steps (inf/NaN gradients at every loss scale) is reported in one line and in
``results.json`` (:class:`GradScalerWatch`, installed the same way).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import lightning as L
import torch
from torch import Tensor

from ..distributed import listed, rank, ranks_where, world_size
from .optim import diverged_fix

__all__ = [
    "LOGIT_LIMIT",
    "GradScalerWatch",
    "NonFiniteLossError",
    "OutputHealth",
    "OutputWatch",
    "grad_scaler_record",
    "training_blowup",
]


class NonFiniteLossError(FloatingPointError):
    """The training loss, or the validation or test loss, became NaN or infinite, or the model's outputs collapsed
    (the same logits for every image of an evaluation epoch)."""


LOGIT_LIMIT = 1e6
"""Logits beyond this magnitude mean a diverged model: a trained classifier's stay within ~100 (a logit gap of 100
is already a probability of 1 - 4e-44), so finite logits of 1e15 after a huge step predict by their sign alone."""


class OutputWatch:
    """Whether an evaluation epoch's logits are all the same row while its images are not all the same image, and
    the largest logit magnitude of the epoch (NaN counted as infinite).

    A classifier whose outputs no longer depend on its input has collapsed (dead or saturated activations after a
    diverging step) and predicts one class for everything, yet ends with a plausible accuracy (the share of that
    class). The rule is exact equality, on 2 or more differing images, so a working model is never flagged: two
    different images giving bit-identical logits does not happen by chance, and an epoch of identical images (a
    blank test set) is never judged. Images are compared within their batch and with the epoch's first image of
    their size, kept (copied) for the first :attr:`SHAPES` sizes only: whole-image segmentation batches images of
    one size, and a data set of hundreds of sizes would otherwise hold an image and its per-pixel logits for each.
    A diverged model whose logits still differ between images shows in their size instead (:data:`LOGIT_LIMIT`).
    Flags are kept as tensors: no device sync per batch.
    """

    SHAPES = 4

    def __init__(self) -> None:
        self.first: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}  # per image shape: its first image, logits
        self.images_differ: Tensor | bool = False
        self.logits_differ: Tensor | bool = False
        self.largest: Tensor | float = 0.0
        self.count = 0
        self.nonfinite: str | None = None  # the epoch's first non-finite loss, described

    def update(self, x: Tensor, logits: Tensor) -> None:
        shape = tuple(x.shape[1:])
        if shape not in self.first and len(self.first) < self.SHAPES:
            self.first[shape] = (x[0].clone(), logits[0].clone())  # copies: a view would keep the whole batch
        image, first = self.first.get(shape, (x[0], logits[0]))  # beyond the kept sizes: within the batch only
        self.images_differ = (x != image).any() | self.images_differ
        self.logits_differ = (logits != first).any() | self.logits_differ
        # NaN counts as infinite: a NaN only on pixels the loss ignores leaves the loss finite (segmentation)
        self.largest = torch.clamp(logits.abs().amax().float().nan_to_num(math.inf, math.inf), min=self.largest)
        self.count += len(x)

    def collapsed(self) -> bool:
        return bool(self.images_differ) and not bool(self.logits_differ)

    @property
    def logits(self) -> Tensor:
        """The epoch's first image's logits (what a collapsed model gives every image of that size)."""
        return next(iter(self.first.values()))[1]


def _fix(trainer: Any) -> str:
    """What to try after a blow-up, for this run's precision (none known outside a Trainer)."""
    return diverged_fix(getattr(trainer, "precision", None))


def training_blowup(model: Any, out: Any, z: Tensor, batch_idx: int, failed: list[int]) -> str:
    """The message of a non-finite training loss ``out.loss`` of ``model`` (a FineTuner) on the processes
    ``failed``, from this process's view. Every process calls it (one more collective under DDP with a gathering
    objective)."""
    when = f"at epoch {model.current_epoch}, step {model.global_step}"
    origin = ""
    # a gathering objective's loss is the gathered batch's: one process's non-finite features make them all NaN
    gathered = world_size() > 1 and model.task.gathers(model.objective)
    if gathered and (sources := ranks_where(not bool(torch.isfinite(z).all()), z.device)):
        origin = f"; the non-finite features come from process {listed(sources)}"
    if rank() in failed:
        terms = ", ".join(f"{k}={float(v):.4g}" for k, v in out.terms.items())
        where = f" on process {rank()}" if world_size() > 1 else ""
        what = f"the training loss is {float(out.loss.detach())}{where} {when} (batch {batch_idx}; {terms}{origin})"
    else:
        what = f"the training loss is not finite on process {listed(failed)} {when} (batch {batch_idx}{origin})"
    return f"{what}. Check the images for NaN/Inf, {_fix(model._trainer)}"


class OutputHealth(L.Callback):
    """Raise :class:`NonFiniteLossError` at the end of a validation or test epoch that had a non-finite loss (on any
    process), whose outputs collapsed (on every process: :class:`OutputWatch`) or whose logits exploded (on any
    process: :data:`LOGIT_LIMIT`).

    Reads what the module's ``validation_step`` and ``test_step`` return: ``{"images", "logits", "loss"}`` (the
    batch's images, the model's logits and the batch's loss). Each batch is only remembered: the verdict is taken at the
    epoch's end, where every process decides together (under DDP the processes may hold different numbers of
    evaluation batches, so no per-batch collective).
    """

    def __init__(self) -> None:
        self.watch: OutputWatch | None = None  # the current evaluation epoch's outputs

    def _remember(self, stage: str, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not isinstance(outputs, dict) or "logits" not in outputs:
            return
        x, logits, loss = outputs["images"], outputs["logits"], outputs["loss"]
        if batch_idx == 0 or self.watch is None:
            self.watch = OutputWatch()
        if self.watch.nonfinite is None and not torch.isfinite(loss):
            self.watch.nonfinite = (
                f"the {stage} loss is {float(loss)}{f' on process {rank()}' if world_size() > 1 else ''} at epoch "
                f"{pl_module.current_epoch}, step {pl_module.global_step} (batch {batch_idx}; "
                f"{int((~torch.isfinite(logits)).any(dim=1).sum())} of {len(logits)} images have non-finite logits)"
            )
        self.watch.update(x, logits.detach())

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._remember("validation", pl_module, outputs, batch, batch_idx)

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._remember("test", pl_module, outputs, batch, batch_idx)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer, pl_module, "validation")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer, pl_module, "test")

    def check(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        """The ``stage`` epoch's verdict (every process calls it: collectives)."""
        watch, self.watch = self.watch, None
        epoch, step, fix = pl_module.current_epoch, pl_module.global_step, _fix(trainer)
        nonfinite = watch.nonfinite if watch is not None else None
        if failed := ranks_where(nonfinite is not None, pl_module.device):
            what = nonfinite or (
                f"the {stage} loss is not finite on process {listed(failed)} at epoch {epoch}, step {step} (that "
                "process's error names the batch)"
            )
            raise NonFiniteLossError(f"{what}. Check the pre-trained weights, {fix}")
        # over every process's images: some differ and no logits differ (a process may have judged nothing: its
        # images all of different sizes, or none); every process decides alike and raises together
        strategy = trainer.strategy
        images_differ = strategy.reduce_boolean_decision(watch is not None and bool(watch.images_differ), all=False)
        logits_differ = strategy.reduce_boolean_decision(watch is not None and bool(watch.logits_differ), all=False)
        if images_differ and not logits_differ:
            seen = ""
            if watch is not None and watch.first:
                scores = watch.logits.float().reshape(len(watch.logits), -1).mean(1)  # (K,) also per-pixel logits
                row = ", ".join(f"{v:.4g}" for v in scores.tolist()[:5])
                names = pl_module.class_names
                name = names[int(scores.argmax())] if names else "?"
                more = ", …" if len(watch.logits) > 5 else ""
                seen = f" ({row}{more}), so it predicts class {name!r} for every image"
            count = f"all {watch.count} " if watch is not None and world_size() == 1 else "all "
            raise NonFiniteLossError(
                f"the model collapsed at epoch {epoch}, step {step}: {count}{stage} images get the same logits{seen}. "
                f"Check the pre-trained weights, {fix}"
            )
        mine = torch.as_tensor(0.0 if watch is None else watch.largest, dtype=torch.float32, device=pl_module.device)
        largest = float(strategy.reduce(mine, reduce_op="max"))  # over every process's epoch
        if largest > LOGIT_LIMIT:
            reach = "are not finite" if math.isinf(largest) else f"reach {largest:.3g} in magnitude"
            raise NonFiniteLossError(
                f"the model diverged at epoch {epoch}, step {step}: its {stage} logits {reach} (a trained model's "
                f"stay within ~100), so its predictions no longer mean anything. Check the pre-trained weights, {fix}"
            )


class GradScalerWatch(L.Callback):
    """Counts the optimiser steps the gradient scaler of a ``16-mixed`` run skipped, and reports a run of them.

    The scaler multiplies the loss by its scale before backward; a step whose gradients then hold inf or NaN is
    skipped and the scale halved (a step is skipped exactly when the scale drops). A few skips at the start are
    normal: the scale starts at 2^16 and comes down to what the gradients allow. ``streak`` (default 20) skipped
    steps in a row mean the gradients are inf or NaN at every scale (down to 2^16 / 2^20 < 0.1), so the model no
    longer trains: one line says so on stderr (once per such run of skips), and :meth:`record` (``results.json``'s
    ``grad_scaler``) counts the skipped steps, the longest run of them and the last scale. Without a scaler
    (``32-true``, ``bf16-mixed``) it does nothing.
    """

    def __init__(self, streak: int = 20) -> None:
        if streak < 1:
            raise ValueError(f"streak must be >= 1 (got {streak})")
        self.streak = streak
        self.skipped = 0  # the fit's skipped steps (every session of a resumed run)
        self.longest = 0  # the longest run of skipped steps in a row
        self.current = 0  # the skipped steps in a row until now
        self.scale: float | None = None  # the scale after the last optimiser step
        self._step = -1

    @staticmethod
    def _scaler(trainer: L.Trainer) -> Any:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (scaler := self._scaler(trainer)) is not None:
            self.scale = float(scaler.get_scale())  # its initial scale (restored on a resume): the first step counts
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        scaler = self._scaler(trainer)
        if scaler is None or trainer.global_step == self._step:
            return  # no scaler, or no optimiser step since the last batch (gradient accumulation)
        self._step = trainer.global_step
        scale = float(scaler.get_scale())  # the scaler's step already synchronised (its inf check)
        if self.scale is not None and scale < self.scale:
            self.skipped += 1
            self.current += 1
            self.longest = max(self.longest, self.current)
            if self.current == self.streak and trainer.is_global_zero:
                print(
                    f"coretune: the 16-mixed gradient scaler skipped the last {self.current} optimiser steps in a "
                    f"row (epoch {trainer.current_epoch}, step {trainer.global_step}): the gradients are inf or NaN "
                    f"at every loss scale (now {scale:.3g}), so the model is not training; check the images for "
                    "NaN/Inf, lower the learning rate (--model.optim.lr), or train in bf16-mixed or 32-true "
                    "(--trainer.precision)",
                    file=sys.stderr,
                )
        elif self.scale is not None:
            self.current = 0
        self.scale = scale

    def record(self) -> dict[str, Any] | None:
        """``{"skipped_steps", "longest_skipped_run", "scale"}``, or None when no scaler was seen."""
        if self.scale is None:
            return None
        return {"skipped_steps": self.skipped, "longest_skipped_run": self.longest, "scale": self.scale}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "longest": self.longest, "current": self.current, "scale": self.scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped, self.longest = state_dict.get("skipped", 0), state_dict.get("longest", 0)
        self.current, self.scale = state_dict.get("current", 0), state_dict.get("scale")


def grad_scaler_record(trainer: L.Trainer) -> dict[str, Any] | None:
    """The :class:`GradScalerWatch`'s record of ``trainer``'s fit (None: no watch, or no scaler)."""
    watches = [c for c in trainer.callbacks if isinstance(c, GradScalerWatch)]
    return watches[-1].record() if watches else None
