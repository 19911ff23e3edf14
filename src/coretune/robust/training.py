r"""Adversarial training (paper §5.4, Appendix C): each training batch is extended with PGD examples built against
the current model, and the objective trains on the clean and adversarial images together.

:class:`AdversarialTraining` holds the settings (``--adversarial.enable true --adversarial.norm linf|l2
--adversarial.eps … --adversarial.steps 10 --adversarial.step_size …``) and builds the batch:
``[x; PGD(x)]`` with the labels ``[y; y]``. The attack is :class:`coretune.robust.attacks.PGD`: random start, projection
onto the ε-ball and ``[0, 1]`` in pixel space, the whole model in eval mode while attacking (BatchNorm uses and
keeps its running statistics), only the images differentiated (the parameters get no gradient from it).

**Contrastive objectives.** The adversarial row ``B + i`` is a positive of its clean source ``i``. With class-label
positives this needs nothing more: the row carries its source's label ``y_i``, so SupCon's mask and Core-tuning's
original-pair mask pair ``i`` with ``B + i`` (both ways), and Core-tuning mines its hard pairs over all ``2B`` rows
(but ``core --objective.miner.original_positives false`` drops the original pairs, and with them this pairing: its only
positives are the generated ones).
Objectives that take ``inputs`` (a second view, e.g. Bi-tuning's keys) get the clean source's inputs for an
adversarial row (:func:`repeat_rows`), so its instance positive is its clean source's key.

Pure torch, below the engine: :class:`coretune.robust.batches.AdversarialBatches`, the training-batch transform
``coretune fit --adversarial.enable true`` installs, calls :meth:`AdversarialTraining.extend` in each training step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .attacks import PGD, Norm, NormalizedModel

__all__ = ["AdversarialTraining", "repeat_rows"]


class AdversarialTraining:
    """The settings of adversarial training, checked when built, and the batch it trains on.

    Args:
        enable: train on clean and PGD images together (off: the settings are checked but unused).
        norm: the threat model's norm, ``"linf"`` or ``"l2"``.
        eps: the radius ε >= 0 in ``[0, 1]`` pixel units (ℓ∞ 8/255 is eight grey levels), a number or a fraction:
            ``--adversarial.eps 8/255`` works.
        steps: PGD steps, >= 1 (the paper's PGD-10).
        step_size: ``α > 0``, a number or a fraction; ``None`` for ``2.5·eps/steps`` (2/255 for ε = 8/255 and 10
            steps).
        random_start: start each attack from a random point of the ε-ball (the issue's and Madry et al.'s).

    Raises:
        ValueError: one line naming the bad setting (``invalid adversarial-training settings: PGD eps …``).
    """

    def __init__(
        self,
        enable: bool = False,
        norm: Norm = "linf",
        eps: float | str = 8 / 255,
        steps: int = 10,
        step_size: float | str | None = None,
        random_start: bool = True,
    ) -> None:
        try:
            self.attack = PGD(norm, eps, steps, step_size, random_start)
        except ValueError as err:
            raise ValueError(f"invalid adversarial-training settings: {err}") from None
        if enable and self.attack.eps == 0:
            raise ValueError(
                "invalid adversarial-training settings: PGD eps 0 leaves every image as it is, so adversarial training "
                f"would be CE-tuning on each batch twice at {steps + 1}× the cost: give eps > 0 (e.g. 8/255), or drop "
                "--adversarial.enable"
            )
        self.enable = enable
        self.norm, self.eps, self.steps = norm, self.attack.eps, steps
        self.step_size = None if step_size is None else self.attack.step_size
        self.random_start = random_start

    def __repr__(self) -> str:
        return f"AdversarialTraining(enable={self.enable}, {self.attack})"

    def hparams(self) -> dict[str, object]:
        """The constructor's arguments, fractions as numbers (for config files and checkpoints)."""
        return {
            "enable": self.enable,
            "norm": self.norm,
            "eps": self.eps,
            "steps": self.steps,
            "step_size": self.step_size,
            "random_start": self.random_start,
        }

    def extend(
        self,
        model: nn.Module,
        images: Tensor,
        labels: Tensor,
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``([x; x_adv], [y; y])``: the clean batch followed by its PGD examples against ``model``.

        Without ``mean``/``std``, ``model`` takes ``[0, 1]`` pixel images and ``images`` are such. With them,
        ``images`` are normalised by ``mean``/``std`` and ``model`` takes normalised images (a coretune model as it
        trains): the attack runs in pixel space on ``images · std + mean`` against ``(x - mean) / std → model``,
        and the adversarial rows come back normalised; the clean rows are ``images`` as given. The model's
        parameters, their ``.grad`` and its BatchNorm statistics and modes are as they were (:class:`PGD`).
        ``generator`` draws the random start (the global RNG when ``None``). The adversarial rows have the images'
        dtype and memory format.
        """
        if mean is None or std is None:
            adv = self.attack(model, images, labels, generator)
        else:
            pixels = NormalizedModel(model, mean, std).to(images.device)
            clean = (images.detach().float() * pixels.std + pixels.mean).clamp(0, 1)  # rounding can leave [0, 1]
            adv = (self.attack(pixels, clean, labels, generator) - pixels.mean) / pixels.std
        adv = adv.to(images.dtype).contiguous(memory_format=_memory_format(images))
        return torch.cat([images, adv]), torch.cat([labels, labels])


def repeat_rows(values: Tensor) -> Tensor:
    """Per-row values of a batch (an objective's ``inputs``, e.g. a second view; domain labels) for
    ``[x; x_adv]``: each adversarial row gets its clean source's, so an instance-contrastive objective makes the
    adversarial row a positive of its source."""
    return torch.cat([values, values])


def _memory_format(images: Tensor) -> torch.memory_format:
    """``channels_last`` for 4-d images stored so, else contiguous."""
    if images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
