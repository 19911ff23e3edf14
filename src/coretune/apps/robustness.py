"""Robust accuracy of a classifier under PGD or AutoAttack, for several threat models (paper §5.4, Table 8).

:func:`robust_accuracy` reports the clean top-1 accuracy and, for each ``(norm, ε)`` threat model, the share of
images the model still classifies correctly after the attack. Three attacks measure it:

- ``"pgd"`` — coretune's own :class:`~coretune.robust.attacks.PGD` (random start, ``steps`` steps);
- ``"torchattacks-pgd"`` — torchattacks' ``PGD`` / ``PGDL2`` with the same step size and random start, the
  referee for the first (the two agree within noise; ``tests/test_robustness.py`` checks it);
- ``"autoattack"`` — standard AutoAttack (Croce & Hein, 2020): APGD-CE and APGD-T (9 target classes) of 100
  iterations, FAB-T (9 targets, 100 iterations) and Square (5,000 queries), chained from torchattacks' attacks at
  the reference code's settings (:func:`standard_autoattack`), parameter-free, so ``steps`` and ``step_size`` do
  not apply. It runs locally; nothing is downloaded. (Until stop 50 this was ``torchattacks.AutoAttack``, whose
  APGD, APGD-T and FAB run 10 iterations, the library's defaults: a weaker attack than standard AutoAttack, so
  robust accuracies scored with it are upper bounds; those records have no ``implementation`` entry. The reference
  ``autoattack`` package that torchattacks' wheel ships no longer imports with this torch.)

The paper reports robust accuracies of 69–75% at ℓ∞ 8/255 on CIFAR-10, where PGD adversarial training in the
literature reaches about 50%: its attack was probably weak. Report what a strong attack (AutoAttack) measures;
an undefended model's robust accuracy at ℓ∞ 8/255 should be near 0.

The model takes ``[0, 1]`` pixel images (wrap a coretune model in :class:`~coretune.robust.attacks.NormalizedModel`)
and the loader yields unnormalised ``(images, labels, ...)`` batches, e.g. with
``eval_transform(size, mean=(0, 0, 0), std=(1, 1, 1))``. torchattacks is the optional extra ``robust``.

``coretune eval robust`` (:func:`evaluate_robust`) does this for a fine-tuned checkpoint: its test split at the
image size it was trained with, unnormalised, and the model wrapped in ``NormalizedModel`` with its normalisation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, Subset

from ..arguments import ArgumentParser
from ..data import ImageClassificationData
from ..engine import FineTuner, atomic_write
from ..extras import need
from ..models import weights_digest
from ..robust.attacks import PGD, Norm, NormalizedModel, check_pixel_images, eval_mode, pixel_radius
from ..runs.atomic import strict_json
from ..runs.config import add_config_argument, config_files, parse_with_config
from ..runs.outputs import data_paths
from .devices import add_trainer_arguments, placement_of
from .scoring import check_classes, results_output, written_by
from .vocabulary import translate

__all__ = [
    "ATTACKS",
    "PAPER_THREAT_MODELS",
    "RobustnessReport",
    "ThreatResult",
    "check_settings",
    "evaluate_robust",
    "format_threat",
    "parse_threat",
    "robust_accuracy",
    "robust_parser",
    "sample_loader",
]

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
    implementation: str | None = None  # AutoAttack's (AUTOATTACK); None in records before stop 50 (torchattacks')

    def to_json(self) -> str:
        return strict_json(asdict(self), indent=2, ensure_ascii=False)

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
    return need("torchattacks", "this attack")


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: Any, images: Tensor) -> Tensor:
        return images.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class _ContiguousInputGradient(nn.Module):
    """``model`` whose inputs get a contiguous gradient: torchattacks' ``PGDL2`` ``.view``s it, which fails for the
    channels-last gradient of a channels-last model (coretune's CNNs). It takes ``model``'s mode: torchattacks
    gives an attacked model back the mode it found it in, with ``train()`` or ``eval()``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.train(model.training)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(_ContiguousGradient.apply(images))


AUTOATTACK = "standard AutoAttack: APGD-CE, APGD-T, FAB-T of 100 iterations (9 targets), Square of 5000 queries"
"""What ``RobustnessReport.implementation`` records for ``attack="autoattack"``."""


def check_autoattack_classes(num_classes: int) -> None:
    """Raise ``ValueError`` for a model of fewer than 4 classes: APGD-T's targeted DLR loss reads the 3rd and 4th
    largest logits."""
    if num_classes < 4:
        raise ValueError(
            f"AutoAttack needs a model of 4 or more classes (its targeted attacks' DLR loss), this one has "
            f"{num_classes}: use --attack pgd"
        )


def standard_autoattack(torchattacks: Any, model: nn.Module, norm: str, eps: float, num_classes: int, seed: int) -> Any:
    """Standard AutoAttack (Croce & Hein, 2020; the reference code's ``version="standard"``) from torchattacks'
    attacks: APGD-CE, then APGD-T and FAB-T over the ``min(9, num_classes - 1)`` most likely other classes, each of
    100 iterations and one restart, then Square of 5,000 queries (no rescaled schedule), each on the images the
    ones before left correctly classified. ``torchattacks.AutoAttack`` builds the same chain with the library's
    default 10 iterations, ``num_classes - 1`` targets and Square's rescaled schedule (its ``p`` falls twice as
    fast).

    Raises:
        ValueError: fewer than 4 classes (the targeted DLR loss needs them).
    """
    ta, norm = torchattacks, {"linf": "Linf", "l2": "L2"}[norm]
    check_autoattack_classes(num_classes)
    common = {"norm": norm, "eps": eps, "n_restarts": 1, "seed": seed}
    attacks = [
        ta.APGD(model, steps=100, loss="ce", **common),
        ta.APGDT(model, steps=100, n_classes=num_classes, **common),
        ta.FAB(model, steps=100, multi_targeted=True, n_classes=num_classes, **common),
        ta.Square(model, n_queries=5000, resc_schedule=False, **common),
    ]
    attacks[1].n_target_classes = attacks[2].n_target_classes = min(9, num_classes - 1)
    return ta.MultiAttack(attacks)


def _library_attack(
    torchattacks: Any, attack: str, model: nn.Module, pgd: PGD, num_classes: int, seed: int
) -> AttackFn:
    """The library attack for ``pgd``'s threat model: the reference standard AutoAttack, or torchattacks' PGD with
    ``pgd``'s step size and random start."""
    model = _ContiguousInputGradient(model)
    if attack == "autoattack":
        return standard_autoattack(torchattacks, model, pgd.norm, pgd.eps, num_classes, seed)
    cls = torchattacks.PGD if pgd.norm == "linf" else torchattacks.PGDL2
    return cls(model, eps=pgd.eps, alpha=pgd.step_size, steps=pgd.steps, random_start=pgd.random_start)


def check_settings(
    attack: str,
    threat_models: Sequence[tuple[str, float]],
    steps: int = 10,
    step_size: float | None = None,
    max_images: int | None = None,
) -> list[PGD]:
    """The PGD of each threat model, once every setting of :func:`robust_accuracy` is checked (one-line
    ``ValueError``s; a torchattacks attack also needs torchattacks installed, a ``RuntimeError`` naming the extra)."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}: choose one of {', '.join(ATTACKS)}")
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be >= 1 (or None for every image), got {max_images}")
    pgds = [PGD(norm, eps, steps, step_size) for norm, eps in threat_models]  # type: ignore[arg-type]
    if attack != "pgd":
        _import_torchattacks()
    return pgds


@contextmanager
def _drawing_from(generator: torch.Generator) -> Iterator[None]:
    """The global RNG of ``generator``'s device draws what ``generator`` would (torchattacks draws its random starts
    from it), and ``generator`` advances by what was drawn."""
    device = generator.device
    if device.type == "cuda":
        get_state = partial(torch.cuda.get_rng_state, device)
        set_state = partial(torch.cuda.set_rng_state, device=device)
    else:
        get_state, set_state = torch.get_rng_state, torch.set_rng_state
    set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(get_state())


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
        steps: of both PGDs; AutoAttack ignores it.
        step_size: of both PGDs (``None``: ``2.5·ε/steps``); AutoAttack ignores it.
        device: where to run (default: the model's device); the model is moved there.
        seed: seeds the random starts (and AutoAttack's), so a run is reproducible; both PGDs draw the same starts.
        max_images: stop after this many images (``None``: the whole loader).
    """
    pgds = check_settings(attack, threat_models, steps, step_size, max_images)
    torchattacks = None if attack == "pgd" else _import_torchattacks()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device)
    generators = [torch.Generator(device).manual_seed(seed) for _ in pgds]
    library_attacks: list[AttackFn] = []
    seen = clean = 0
    robust = [0] * len(pgds)
    with eval_mode(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # AutoAttack draws from the global RNG too
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
                if torchattacks is None:
                    adv = p(model, x, y, generators[i])
                else:
                    with _drawing_from(generators[i]):  # the same random starts as coretune's PGD
                        adv = library_attacks[i](x, y)
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
        implementation=AUTOATTACK if auto else None,
    )


def parse_threat(text: str) -> tuple[str, float]:
    """``"linf:8/255"`` → ``("linf", 0.0313…)``, ``"l2:0.5"`` → ``("l2", 0.5)``: a threat model as the command
    line writes it, ``NORM:EPS`` with ε a number or a fraction (the norm and ε are checked by :class:`PGD`)."""
    norm, colon, eps = text.partition(":")
    try:
        radius = pixel_radius(eps)
    except ValueError:
        radius = None
    if not colon or radius is None:
        raise ValueError(f"threat model {text!r} is not NORM:EPS: write e.g. linf:8/255 or l2:0.5")
    return norm.strip(), radius


def _threat_text(norm: str, eps: float) -> str:
    """The command line's ``NORM:EPS`` of a threat model (``linf:8/255``)."""
    label = format_threat(norm, eps).partition(" ")[2]
    return f"{norm}:{label}"


def robust_parser() -> ArgumentParser:
    """The command line of ``coretune eval robust``."""
    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune eval robust",
        description="Clean and robust top-1 accuracy of a fine-tuned checkpoint on the test split, under PGD and "
        "AutoAttack, for several threat models (paper §5.4, Table 8). The images are attacked in [0, 1] pixel "
        "space at the image size the checkpoint was trained with; the model applies its own normalisation. Writes "
        "robust_results.json in the checkpoint's run directory (or --output).",
    )
    add_config_argument(parser)
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt written by coretune fit.")
    parser.add_class_arguments(ImageClassificationData, "data")
    parser.add_argument(
        "--attack",
        type=list[str] | str,
        default=["pgd", "torchattacks-pgd"],
        help="The attacks, each reported: pgd (coretune's PGD), torchattacks-pgd (torchattacks' PGD / PGDL2, the "
        "referee) and autoattack (standard AutoAttack at the reference code's settings, parameter-free; slow on a "
        "CPU: see --max_images). E.g. --attack autoattack or --attack '[pgd, autoattack]'.",
    )
    parser.add_argument(
        "--threat_models",
        type=list[str] | str,
        default=[_threat_text(norm, eps) for norm, eps in PAPER_THREAT_MODELS],
        help="NORM:EPS pairs, NORM linf or l2, EPS in [0, 1] pixel units (a number or a fraction); default the "
        "paper's six, e.g. --threat_models '[linf:4/255, l2:0.5]'.",
    )
    parser.add_argument("--steps", type=int, default=10, help="PGD steps (both PGDs; AutoAttack sets its own).")
    parser.add_argument(
        "--step_size",
        type=float | str | None,
        default=None,
        help="PGD step size in pixel units, a number or a fraction (e.g. 2/255; default 2.5·eps/steps).",
    )
    parser.add_argument(
        "--max_images",
        type=int | None,
        default=None,
        help="Score N test images drawn at random with --seed (the same images for every checkpoint; spread over "
        "the classes, which the first N of a class-sorted folder are not). N at least the test set's size scores "
        "and records the whole test set, as without --max_images.",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seeds the random starts (and AutoAttack's).")
    add_trainer_arguments(parser, what="the model and the attacks")
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help="JSON file to write (default: robust_results.json in the checkpoint's run directory).",
    )
    return parser


def evaluate_robust(args: Sequence[str]) -> Path:
    """Run ``coretune eval robust`` with ``args``: print clean and robust accuracy per attack and threat model, and
    write them (with the checkpoint, the data and the attack settings) to a JSON file, which is returned.

    Every setting is checked, and torchattacks imported when an attack needs it, before the checkpoint is read."""

    def check(cfg: Any) -> None:
        cfg.attack, cfg.threat_models = _listed(cfg.attack), _listed(cfg.threat_models)
        if cfg.step_size is not None:  # "2/255" → 0.00784…, so the results file records a number
            cfg.step_size = pixel_radius(cfg.step_size, "step_size")
        threats = [parse_threat(t) for t in cfg.threat_models]
        if not cfg.attack:
            raise ValueError(f"--attack names no attack: choose one or more of {', '.join(ATTACKS)}")
        for attack in cfg.attack:
            check_settings(attack, threats, cfg.steps, cfg.step_size, cfg.max_images)

    args = translate("eval robust", args, prog="coretune eval")
    parser = robust_parser()
    cfg = parse_with_config(parser, args)
    check(cfg)
    place = placement_of(cfg, "eval")
    ckpt, results = Path(cfg.ckpt_path).resolve(), attrgetter("robust_results")
    reads = [("the checkpoint", cfg.ckpt_path), *(("a --config file", path) for path in config_files(args))]
    ours = written_by("checkpoint", "data", "reports")
    results_output(cfg.output, ckpt, results, "eval robust", reads=reads, ours=ours)  # before the checkpoint is read
    model = FineTuner.from_checkpoint(cfg.ckpt_path)
    if not model.task.supports_robust_eval:
        raise ValueError(
            f"coretune eval robust scores classifiers: checkpoint {cfg.ckpt_path} is a {model.task.name} model"
        )
    parser.set_defaults({f"data.{key}": value for key, value in model.trained_data.items()})
    # the checkpoint's settings as defaults: the command line still wins
    cfg = parse_with_config(parser, args, task=model.task.name, checkpoint=cfg.ckpt_path)
    check(cfg)
    output = results_output(
        cfg.output, ckpt, results, "eval robust", reads=reads, data=data_paths(cfg.data.as_dict()), ours=ours
    )
    if "autoattack" in cfg.attack:  # before any attack runs: a PGD listed first would run for hours, then stop
        check_autoattack_classes(model.num_classes or 0)
    options = cfg.data.as_dict()
    options = model.task.scored_folder_options("test", options) or options  # one labelled folder needs no training data
    data = ImageClassificationData(**{**options, "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)})
    data.setup("test")  # with cache_images: the test split decoded, no training image
    check_classes(model, data, cfg.ckpt_path)
    loader = data.test_dataloader()
    if cfg.max_images is not None and cfg.max_images >= len(loader.dataset):  # type: ignore[arg-type]
        cfg.max_images = None  # every test image: recorded as the whole test set, as Table 8 tabulates it
    if cfg.max_images is not None:
        loader = sample_loader(loader, cfg.max_images, cfg.seed)
    place = placement_of(cfg, "eval")
    # the loader's images are unnormalised; bf16-mixed / 16-mixed: the model runs under autocast, the attack in float32
    pixels = place.wrap(NormalizedModel(model, cfg.data.mean, cfg.data.std))
    threats = [parse_threat(t) for t in cfg.threat_models]
    reports = [
        robust_accuracy(
            pixels,
            loader,
            threats,  # type: ignore[arg-type]
            attack=attack,
            steps=cfg.steps,
            step_size=cfg.step_size,
            device=place.device,
            seed=cfg.seed,
            max_images=cfg.max_images,
        )
        for attack in cfg.attack
    ]
    results = {
        "checkpoint": str(Path(cfg.ckpt_path).resolve()),
        "checkpoint_sha256": weights_digest(cfg.ckpt_path),  # a run's file tells which of its weights it scored
        "data": cfg.data.as_dict(),
        "split": "test",
        "sample": None if cfg.max_images is None else {"max_images": cfg.max_images, "seed": cfg.seed},
        # how the model was trained: its adversarial settings, "enable": false for a clean fit (None: recorded before
        # the option)
        "adversarial_training": model.checkpoint_info.get("adversarial"),
        "reports": [asdict(report) for report in reports],
    }
    with atomic_write(output) as f:
        f.write(strict_json(results, indent=2, ensure_ascii=False) + "\n")
    print(f"{cfg.ckpt_path}: {reports[0].num_images} test images, seed {cfg.seed}")
    print("\n".join(comparison_lines(reports)))
    print(f"robust results: {output}")
    return output


def sample_loader(loader: DataLoader, n: int, seed: int) -> DataLoader:
    """A loader like ``loader`` (batch size, collate function, workers) over ``n`` of its images drawn at random
    with ``seed``, in the data set's order: the same images for every model scored with that seed, each class in
    its share on average (the first ``n`` images of a class-sorted ImageFolder are one class's). ``loader`` itself
    when it holds no more than ``n``. Needs a map-style data set batched by ``batch_size`` (``ValueError``)."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or loader.batch_size is None:
        raise ValueError("sample_loader needs a loader of a map-style data set with a batch_size (no batch_sampler)")
    if n >= len(dataset):  # type: ignore[arg-type]
        return loader
    picked = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:n]  # type: ignore[arg-type]
    return DataLoader(
        Subset(dataset, picked.sort().values.tolist()),
        batch_size=loader.batch_size,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
    )


def _listed(values: str | list[str]) -> list[str]:
    """An option that takes one value or a list, as a list."""
    return [values] if isinstance(values, str) else values


def comparison_lines(reports: Sequence[RobustnessReport]) -> list[str]:
    """The reports of several attacks on the same threat models side by side, one line per accuracy under a header
    naming each attack (``pgd-10``, ``torchattacks-pgd-10``, ``autoattack``)."""
    labels = ["clean"] + [format_threat(r.norm, r.eps) for r in reports[0].results]
    names = [f"{r.attack}-{r.steps}" if r.steps else r.attack for r in reports]
    columns = [[r.clean_accuracy] + [t.accuracy for t in r.results] for r in reports]
    width = max(map(len, labels))
    widths = [max(len(name), 7) for name in names]
    header = " " * width + "".join(f"  {name:>{w}}" for name, w in zip(names, widths, strict=True))
    return [header.rstrip()] + [
        f"{label:<{width}}" + "".join(f"  {column[i]:>{w}.2%}" for column, w in zip(columns, widths, strict=True))
        for i, label in enumerate(labels)
    ]
