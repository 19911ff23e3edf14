"""Robust accuracy of a classifier under PGD or AutoAttack, for several threat models (paper §5.4, Table 8).

:func:`robust_accuracy` reports the clean top-1 accuracy and, for each ``(norm, ε)`` threat model, the share of
images the model still classifies correctly after the attack. Three attacks measure it:

- ``"pgd"`` — coretune's own :class:`~coretune.attacks.PGD` (random start, ``steps`` steps);
- ``"torchattacks-pgd"`` — torchattacks' ``PGD`` / ``PGDL2`` with the same step size and random start, the
  referee for the first (the two agree within noise; ``tests/test_robustness.py`` checks it);
- ``"autoattack"`` — torchattacks' standard AutoAttack (APGD-CE, APGD-T, FAB-T, Square; Croce & Hein, 2020),
  parameter-free, so ``steps`` and ``step_size`` do not apply. It runs locally; nothing is downloaded.

The paper reports robust accuracies of 69–75% at ℓ∞ 8/255 on CIFAR-10, where PGD adversarial training in the
literature reaches about 50%: its attack was probably weak. Report what a strong attack (AutoAttack) measures;
an undefended model's robust accuracy at ℓ∞ 8/255 should be near 0.

The model takes ``[0, 1]`` pixel images (wrap a coretune model in :class:`~coretune.attacks.NormalizedModel`)
and the loader yields unnormalised ``(images, labels, ...)`` batches, e.g. with
``eval_transform(size, mean=(0, 0, 0), std=(1, 1, 1))``. torchattacks is the optional extra ``robust``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from .attacks import PGD, Norm, check_pixel_images, eval_mode

__all__ = ["ATTACKS", "PAPER_THREAT_MODELS", "RobustnessReport", "ThreatResult", "format_threat", "robust_accuracy"]

Attack = Literal["pgd", "torchattacks-pgd", "autoattack"]
ATTACKS: tuple[str, ...] = get_args(Attack)

PAPER_THREAT_MODELS: tuple[tuple[Norm, float], ...] = (
    ("l2", 0.5),
    ("l2", 1.5),
    ("l2", 2.5),
    ("linf", 2 / 255),
    ("linf", 4 / 255),
    ("linf", 8 / 255),
)
"""The paper's six threat models (Table 8): ℓ2 at ε ∈ {0.5, 1.5, 2.5} and ℓ∞ at ε ∈ {2, 4, 8}/255."""

AttackFn = Callable[[Tensor, Tensor], Tensor]


def format_threat(norm: str, eps: float) -> str:
    """``"ℓ∞ 8/255"``, ``"ℓ2 0.5"``: ℓ∞ radii that are whole grey levels are written over 255."""
    if norm == "linf":
        levels = Fraction(eps * 255).limit_denominator(1000)
        if levels.denominator == 1 and abs(float(levels) - eps * 255) < 1e-6:
            return f"ℓ∞ {levels.numerator}/255"
        return f"ℓ∞ {eps:g}"
    return f"ℓ2 {eps:g}"


@dataclass
class ThreatResult:
    """Robust top-1 accuracy in [0, 1] under one threat model."""

    norm: str
    eps: float
    accuracy: float
    step_size: float | None = None


@dataclass
class RobustnessReport:
    """Outcome of :func:`robust_accuracy`; ``to_json`` / ``from_json`` round-trip it.

    ``steps`` (and each result's ``step_size``) are ``None`` for AutoAttack, which sets its own.
    """

    attack: str
    num_images: int
    clean_accuracy: float
    results: list[ThreatResult]
    steps: int | None = None
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> RobustnessReport:
        values = json.loads(text)
        values["results"] = [ThreatResult(**r) for r in values["results"]]
        return cls(**values)

    def lines(self) -> list[str]:
        """One line per accuracy, for a terminal: ``clean 97.20%``, ``ℓ∞ 8/255 3.10%``."""
        width = max((len(format_threat(r.norm, r.eps)) for r in self.results), default=5)
        return [f"{'clean':<{width}}  {self.clean_accuracy:6.2%}"] + [
            f"{format_threat(r.norm, r.eps):<{width}}  {r.accuracy:6.2%}" for r in self.results
        ]


def _import_torchattacks() -> Any:
    try:
        import torchattacks
    except ImportError:
        raise RuntimeError(
            "this attack needs torchattacks: pip install 'coretune[robust]' (or pip install torchattacks)"
        ) from None
    return torchattacks


def _library_attack(
    torchattacks: Any, attack: str, model: nn.Module, pgd: PGD, num_classes: int, seed: int
) -> AttackFn:
    """torchattacks' attack for ``pgd``'s threat model (and, for PGD, its step size and random start)."""
    if attack == "autoattack":
        norm = {"linf": "Linf", "l2": "L2"}[pgd.norm]
        return torchattacks.AutoAttack(
            model, norm=norm, eps=pgd.eps, version="standard", n_classes=num_classes, seed=seed
        )
    cls = torchattacks.PGD if pgd.norm == "linf" else torchattacks.PGDL2
    return cls(model, eps=pgd.eps, alpha=pgd.step_size, steps=pgd.steps, random_start=pgd.random_start)


def robust_accuracy(
    model: nn.Module,
    loader: Iterable[Any],
    threat_models: Sequence[tuple[Norm, float]] = PAPER_THREAT_MODELS,
    *,
    attack: Attack = "pgd",
    steps: int = 10,
    step_size: float | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    max_images: int | None = None,
) -> RobustnessReport:
    """Clean and robust top-1 accuracy of ``model`` on the ``(images, labels, ...)`` batches of ``loader``.

    An image counts as robust under a threat model if the model classifies it correctly both clean and after
    the attack (as AutoAttack counts; only the correctly classified images are attacked), so robust accuracy
    never exceeds clean accuracy. The model runs in eval mode and gets its modes back afterwards.

    Args:
        model: takes ``[0, 1]`` pixel images ``(N, C, H, W)`` and returns logits.
        loader: batches of unnormalised images in ``[0, 1]`` and integer labels.
        threat_models: ``(norm, ε)`` pairs, ``norm`` ``"linf"`` or ``"l2"``, ε in pixel units; default the paper's six.
        attack: ``"pgd"``, ``"torchattacks-pgd"`` or ``"autoattack"`` (see the module docstring).
        steps / step_size: of both PGDs (``step_size`` ``None``: ``2.5·ε/steps``); AutoAttack ignores them.
        device: where to run (default: the model's device); the model is moved there.
        seed: seeds the random starts (and AutoAttack's), so a run is reproducible.
        max_images: stop after this many images (``None``: the whole loader).
    """
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}: choose one of {', '.join(ATTACKS)}")
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be >= 1 (or None for every image), got {max_images}")
    pgds = [PGD(norm, eps, steps, step_size) for norm, eps in threat_models]  # validates every setting first
    torchattacks = None if attack == "pgd" else _import_torchattacks()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device)
    generators = [torch.Generator(device).manual_seed(seed) for _ in pgds]
    library_attacks: list[AttackFn] = []
    seen = clean = 0
    robust = [0] * len(pgds)
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # torchattacks draws its random starts from the global RNG
        for batch in loader:
            images = batch[0].to(device)
            check_pixel_images(images, "robust_accuracy")  # torchattacks would silently clip normalised images
            labels = torch.as_tensor(batch[1]).long().to(device)
            if max_images is not None:
                images, labels = images[: max_images - seen], labels[: max_images - seen]
            with torch.no_grad():
                logits = model(images)
            if torchattacks is not None and not library_attacks:
                library_attacks = [_library_attack(torchattacks, attack, model, p, logits.shape[1], seed) for p in pgds]
            correct = logits.argmax(dim=1) == labels
            seen, clean = seen + len(labels), clean + int(correct.sum())
            x, y = images[correct], labels[correct]
            for i, p in enumerate(pgds):
                if not len(y):
                    continue
                adv = p(model, x, y, generators[i]) if torchattacks is None else library_attacks[i](x, y)
                with torch.no_grad():
                    robust[i] += int((model(adv).argmax(dim=1) == y).sum())
            if max_images is not None and seen >= max_images:
                break
    if not seen:
        raise ValueError("robust_accuracy got an empty loader: the split holds no images")
    auto = attack == "autoattack"
    return RobustnessReport(
        attack=attack,
        num_images=seen,
        clean_accuracy=clean / seen,
        results=[
            ThreatResult(p.norm, p.eps, r / seen, None if auto else p.step_size)
            for p, r in zip(pgds, robust, strict=True)
        ],
        steps=None if auto else steps,
        seed=seed,
    )
