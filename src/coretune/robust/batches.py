"""Adversarial training in the engine: the training-batch transform that ``coretune fit --adversarial.enable true``
installs (:attr:`coretune.engine.FineTuner.batch_transform`)."""

from __future__ import annotations

from typing import Any

from ..tasks import Batch
from .training import AdversarialTraining, repeat_rows

__all__ = ["AdversarialBatches"]


class AdversarialBatches:
    """``Batch(x, y, extras)`` → ``Batch([x; PGD(x)], [y; y], extras repeated)``, PGD against the model as it trains.

    The attack runs against the module itself (its ``forward``: images normalised as the data module yields them →
    logits), never a ``DistributedDataParallel`` wrapper, whose forward readies a gradient all-reduce that the
    attack's images-only backward never completes. It runs inside the training step: under its autocast and after
    its RNG seeding, so the random starts repeat exactly on a resumed run. The images are attacked in pixel space
    with the data module's ``mean`` and ``std`` (:meth:`AdversarialTraining.extend`). With two views (Bi-tuning's
    key view) the first is attacked and the second repeated, so an adversarial row's key is its clean source's.
    """

    def __init__(self, settings: AdversarialTraining) -> None:
        self.settings = settings

    def __call__(self, module: Any, batch: Batch) -> Batch:
        data = module.trainer.datamodule
        two_views = isinstance(batch.inputs, list | tuple)
        query = batch.inputs[0] if two_views else batch.inputs
        images, targets = self.settings.extend(module, query, batch.targets, mean=data.mean, std=data.std)
        inputs = (images, repeat_rows(batch.inputs[1])) if two_views else images
        return Batch(inputs, targets, {key: repeat_rows(value) for key, value in batch.extras.items()})
