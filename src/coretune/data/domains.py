"""Domain generalization data: DomainBed's layout ``ROOT/<domain>/<class>/*``, leave-one-domain-out splits with a
seeded, stratified held-out part of every domain, and balanced per-domain training batches carrying domain labels.

The protocol is DomainBed's (Gulrajani & Lopez-Paz, ICLR 2021), which the paper's experiments (§5.3, Appendix C)
run on: every domain is split once into an ``in`` part (80%) and an ``out`` part (20%, ``holdout_fraction``),
stratified by class and seeded by ``(seed, domain)`` — the same split whichever domain is held out. The training
domains' ``in`` parts train, their ``out`` parts validate (training-domain validation); the unseen (test) domains'
``in`` parts give the reported accuracy and their ``out`` parts are only read to score the oracle's test-domain
validation. Test-domain images never reach training or training-domain validation.

The model-selection rules (:data:`SELECTIONS`) are DomainBed's, by its names: the training-domain validation set
(the default: the checkpoint with the best mean accuracy over the training domains' ``out`` parts), the test-domain
validation set (the oracle: as in DomainBed, the last checkpoint — no early stopping — scored for comparing runs on
the unseen domains' ``out`` parts, which a real deployment does not have), and the last checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from .base import ImageDataModule, label_fraction_rule, rule
from .datasets import LabeledImageDataset, OnBadImage
from .device_augment import AugmentOn, DeviceAugment, fixed_size_transform
from .errors import DataError
from .images import require_folder, warn_skipped
from .loading import NumWorkers, PinMemory
from .samplers import balanced_train_loader
from .splits import stratified_split, stratified_subset
from .transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Views,
    eval_draft_size,
    resize_transform,
    train_draft_size,
    train_transform,
)

__all__ = [
    "SELECTIONS",
    "DomainGeneralizationData",
    "DomainSplit",
    "EvalGroup",
    "GroupedItems",
    "Selection",
    "SelectionRule",
    "read_domains",
    "split_domains",
]

Part = Literal["in", "out"]
SelectionRule = Literal["training_domain_validation", "test_domain_validation", "last_checkpoint"]


@dataclass(frozen=True)
class Selection:
    """A model-selection rule: its ``name`` as DomainBed names it, whether it is an ``oracle`` (it reads the unseen
    domains), the ``checkpoint`` it tests (``best``: by ``val/top1``; ``last``) and the images its score is on."""

    name: str
    oracle: bool
    checkpoint: Literal["best", "last"]
    scored_on: str


SELECTIONS: dict[str, Selection] = {
    "training_domain_validation": Selection(
        "training-domain validation set", False, "best", "the training domains' held-out parts (mean accuracy)"
    ),
    "test_domain_validation": Selection(
        "test-domain validation set (oracle)", True, "last", "the unseen domains' held-out parts (mean accuracy)"
    ),
    "last_checkpoint": Selection("last checkpoint", False, "last", "the training domains' held-out parts"),
}
"""DomainBed's model-selection rules by option value (``--data.selection``)."""


def read_domains(root: str, on_bad_image: OnBadImage = "error") -> dict[str, LabeledImageDataset]:
    """Every domain of a DomainBed tree ``root/<domain>/<class>/<images>``, by sorted domain name, each read as an
    ImageFolder tree (hidden folders ignored; unreadable images skipped with one warning under
    ``on_bad_image="skip"``).

    Raises:
        DataError: ``root`` is missing, holds fewer than 2 domain folders, a domain folder has no class folders,
            or the domains' class folders differ (a domain missing a class).
    """
    require_folder(root, "data root")
    names = domain_folders(root)
    layout = f"expected the DomainBed layout {root}/<domain>/<class>/<images> with 2 or more domains"
    if len(names) < 2:
        held = f"one domain folder ({names[0]!r})" if names else "no domain folder"
        raise DataError(
            f"data root {root} holds {held}: domain generalization trains on some domains and tests on another; "
            f"{layout}"
        )
    for name in names:
        folder = os.path.join(root, name)
        if not any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(folder)):
            raise DataError(
                f"domain folder {folder} has no class folders: {layout} (an ImageFolder tree <class>/<images> "
                "is fine-tuned with --task classification)"
            )
    domains = {
        name: LabeledImageDataset.from_folder(os.path.join(root, name), on_bad_image=on_bad_image) for name in names
    }
    warn_skipped(
        [bad for ds in domains.values() for bad in ds.skipped],
        sum(len(ds) + len(ds.skipped) for ds in domains.values()),
    )
    classes = sorted({c for ds in domains.values() for c in ds.classes})
    for name, ds in domains.items():
        if missing := [c for c in classes if c not in ds.classes]:
            others = [n for n, other in domains.items() if missing[0] in other.classes]
            raise DataError(
                f"domain {name!r} ({os.path.join(root, name)}) is missing class folder(s) {missing} that "
                f"{others[0]!r} has: every domain needs the same class folders (add the images, or remove the "
                "class from every domain)"
            )
    return domains


@dataclass(frozen=True)
class EvalGroup:
    """A part of one domain that is evaluated on its own: ``role`` ``"test"`` (an unseen domain) or ``"train"`` (a
    training domain), ``part`` ``"in"`` (80%) or ``"out"`` (the held-out 20%)."""

    domain: str
    role: Literal["test", "train"]
    part: Part

    @property
    def key(self) -> str:
        """``photo`` (an unseen domain's ``in`` part, its reported accuracy), ``photo/out`` (its held-out part,
        the oracle's validation) or ``art_painting/out`` (a training domain's held-out part)."""
        return self.domain if self.part == "in" else f"{self.domain}/out"


@dataclass(frozen=True)
class DomainSplit:
    """One leave-domains-out split: every domain's ``in`` and ``out`` item indices (into ``domains[name]``)."""

    domains: dict[str, LabeledImageDataset]
    test_domains: tuple[str, ...]
    parts: dict[str, dict[Part, list[int]]]

    @property
    def train_domains(self) -> tuple[str, ...]:
        return tuple(name for name in self.domains if name not in self.test_domains)

    def files(self, domain: str, part: Part) -> list[str]:
        """The image files of one part of a domain (empty for in-memory images)."""
        paths = self.domains[domain].paths or []
        return [paths[i] for i in self.parts[domain][part]] if paths else []


def split_domains(
    domains: dict[str, LabeledImageDataset],
    test_domains: Sequence[str],
    holdout_fraction: float = 0.2,
    seed: int = 0,
    label_fraction: float = 1.0,
) -> DomainSplit:
    """Split every domain into ``in`` and ``out`` parts: ``out`` a stratified ``holdout_fraction`` of each class,
    seeded by ``(seed, domain's place among all domains)``, so a domain's parts do not depend on which domain is held
    out. With ``label_fraction < 1`` a training domain's ``in`` part keeps a stratified, seeded fraction of each class.

    Raises:
        DataError: an unknown or repeated test domain, no test domain, no training domain left, a fraction out of
            range, or a class too small to split.
    """
    names = list(domains)
    if not test_domains:
        raise DataError(f"no test domain given: pass --data.test_domains with one or more of {names}")
    if unknown := [d for d in test_domains if d not in domains]:
        raise DataError(f"unknown test domain(s) {unknown}: the domains under the data root are {names}")
    if len(set(test_domains)) != len(test_domains):
        raise DataError(f"test_domains names a domain twice: {list(test_domains)}")
    if len(test_domains) == len(names):
        raise DataError(
            f"test_domains {list(test_domains)} holds out every domain, leaving none to train on: hold out fewer"
        )
    if not 0 < holdout_fraction < 1:
        raise DataError(
            f"holdout_fraction must be in (0, 1) (DomainBed's 0.2: each domain's part kept for model selection), "
            f"got {holdout_fraction}"
        )
    parts: dict[str, dict[Part, list[int]]] = {}
    for k, (name, ds) in enumerate(domains.items()):
        domain_seed = int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
        kept, held = stratified_split(
            ds.targets, holdout_fraction, domain_seed, class_names=ds.classes,
            name=f"holdout_fraction (domain {name!r})",
        )  # fmt: skip
        if label_fraction < 1 and name not in test_domains:
            subset = stratified_subset(
                [ds.targets[i] for i in kept], label_fraction, domain_seed, class_names=ds.classes,
                name=f"label_fraction (domain {name!r})",
            )  # fmt: skip
            kept = [kept[i] for i in subset]
        parts[name] = {"in": kept, "out": held}
    return DomainSplit(domains, tuple(test_domains), parts)


class GroupedItems(Dataset):
    """Items of several labelled datasets, each with its group: ``ds[i] -> (image, label, group)``.

    The group is the domain index for training batches (what objectives receive as domain labels) and the
    :class:`EvalGroup` index for evaluation batches. ``paths`` lists the image files in item order.
    """

    def __init__(self, parts: Sequence[tuple[LabeledImageDataset, int]]) -> None:
        self.parts = [ds for ds, _ in parts]
        self.part_groups = [group for _, group in parts]
        self.groups = [group for ds, group in parts for _ in range(len(ds))]
        self.starts = np.cumsum([0] + [len(ds) for ds in self.parts])

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        image, label = self.parts[part][index - int(self.starts[part])]
        return image, label, self.groups[index]

    @property
    def paths(self) -> list[str]:
        return [p for ds in self.parts for p in ds.paths or []]

    @property
    def targets(self) -> list[int]:
        """The class label of each item, in item order (the training images per class, logit adjustment's priors)."""
        return [t for ds in self.parts for t in ds.targets]

    def group_indices(self) -> list[list[int]]:
        """The item indices of each part, in part order (the balanced sampler's per-domain items)."""
        return [list(range(int(a), int(b))) for a, b in zip(self.starts[:-1], self.starts[1:], strict=True)]


class DomainGeneralizationData(ImageDataModule):
    """Leave-domains-out data for domain generalization, in DomainBed's layout ``root/<domain>/<class>/<images>``.

    Every domain is split into an ``in`` part and a held-out ``out`` part (:func:`split_domains`). Training reads
    the training domains' ``in`` parts in balanced batches: every step draws ``batch_size / D`` images from each of
    the ``D`` training domains (:class:`~.samplers.BalancedDomainSampler`; DomainBed draws 32 per domain, so the
    paper's "batch size 32" is ``batch_size = 32 · D``), and an epoch is ``steps_per_epoch`` steps: validation runs
    after each. Batches are ``(images, labels, domains)``, ``domains`` indexing :attr:`domain_names` (every
    domain, sorted), so objectives can use the domain labels.

    Validation reads each training domain's ``out`` part (batches ``(images, labels, group)``, ``group`` indexing
    :attr:`val_groups`); test reads each unseen domain's ``in`` part (the reported accuracy) and ``out`` part (the
    oracle's validation) and each training domain's ``out`` part (:attr:`test_groups`).

    Augmentation is DomainBed's: a random resized crop of 70-100% of the image, flips, colour jitter 0.3 and random
    greyscale (p 0.1) for training; evaluation resizes the whole image to ``image_size``.

    Args:
        root: The DomainBed tree: root/<domain>/<class>/<images>, every domain with the same class folders.
        test_domains: The unseen domain(s), held out of training and of training-domain validation (a name,
            "a,b", or a list).
        holdout_fraction: Fraction of each domain, per class, held out as its "out" part (model selection).
        image_size: Side of the square network input in pixels.
        batch_size: Training images per step, split equally over the training domains (a multiple of their number).
        steps_per_epoch: Training steps per epoch; validation (model selection) runs after each epoch.
        label_fraction: Fraction of each training domain's labels to use, drawn per class with seed; in (0, 1].
        seed: Seed of the domains' splits, the label-fraction subsets and the training batches.
        crop_scale: Range of the image area the training random-resized crop covers (DomainBed's (0.7, 1.0)).
        color_jitter: Strength of the random brightness, contrast, saturation and hue changes (0: none).
        grayscale: Probability of turning a training image grey (0: never).
        cache_images: Decode every image file once at setup and keep the pixels in memory (each at the size its
            split reads: training crops' or evaluation's).
        selection: Model selection, as DomainBed names it: training_domain_validation (the checkpoint with the best
            mean accuracy on the training domains' held-out parts), test_domain_validation (the oracle: the last
            checkpoint, scored on the unseen domains' held-out parts; marked as an oracle in every output) or
            last_checkpoint.
    """

    #: Options that drew the run's splits and chose its checkpoint (each domain's in/out parts, the rule). A
    #: checkpoint keeps them; ``coretune test`` and ``validate`` default to them (``FineTuner.trained_data``).
    split_settings: ClassVar[tuple[str, ...]] = ("seed", "test_domains", "holdout_fraction", "selection")
    #: ``train_views`` > 1 makes batches of independently augmented views (``((view_1, view_2), labels, ...)``).
    makes_views: ClassVar[bool] = True
    option_checks = (
        "on_bad_image",
        rule("selection", lambda v: v in SELECTIONS, f"one of {list(SELECTIONS)}", quote=True),
        "image_size", "batch_size", "eval_batch_size",
        rule("steps_per_epoch", lambda v: v >= 1, ">= 1"),
        "num_workers", label_fraction_rule("label"), "crop_scale",
        rule("color_jitter", lambda v: v >= 0, ">= 0 (0: none)"),
        rule("grayscale", lambda v: 0 <= v <= 1, "a probability in [0, 1]"), "augment_on",
    )  # fmt: skip

    def __init__(
        self,
        root: str | None = None,
        test_domains: str | list[str] | None = None,
        holdout_fraction: float = 0.2,
        image_size: int = 224,
        batch_size: int = 96,
        eval_batch_size: int | None = None,
        steps_per_epoch: int = 250,
        num_workers: NumWorkers = "auto",
        label_fraction: float = 1.0,
        seed: int = 0,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        crop_scale: tuple[float, float] = (0.7, 1.0),
        hflip: bool = True,
        color_jitter: float = 0.3,
        grayscale: float = 0.1,
        on_bad_image: OnBadImage = "error",
        pin_memory: PinMemory = "auto",
        cache_images: bool = False,
        selection: SelectionRule = "training_domain_validation",
        augment_on: AugmentOn = "loader",
    ) -> None:
        super().__init__(**{k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self.save_hyperparameters()
        self.test_domains, self.holdout_fraction = domain_list(test_domains), holdout_fraction
        self.steps_per_epoch, self.cache_images = steps_per_epoch, cache_images
        self.crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.selection = selection
        self.train_transform = train_transform(
            image_size, self.mean, self.std, crop_scale=self.crop_scale, hflip=hflip, color_jitter=color_jitter,
            grayscale=grayscale,
        )  # fmt: skip
        self.eval_transform, self.eval_draft = self.test_transform(image_size, self.mean, self.std)
        if augment_on == "device":
            self.device_augment = DeviceAugment(
                image_size, self.mean, self.std, crop_scale=self.crop_scale, hflip=hflip, color_jitter=color_jitter,
                grayscale=grayscale,
            )  # fmt: skip
        # validates_on_test stays False: model selection never reads the unseen domains' images
        self.split: DomainSplit | None = None
        self.train_dataset: GroupedItems | None = None
        self.val_dataset: GroupedItems | None = None
        self.test_dataset: GroupedItems | None = None
        self.val_groups: list[EvalGroup] = []
        self.test_groups: list[EvalGroup] = []

    # -- set-up ---------------------------------------------------------------------------------------------
    @staticmethod
    def test_transform(
        image_size: int, mean: Sequence[float], std: Sequence[float]
    ) -> tuple[Callable[[Any], Tensor], int]:
        """How the evaluation groups (and ``coretune predict``) read one image: the whole image resized to a square,
        no crop (DomainBed's evaluation, Appendix C: "test images are resized"), decoded at ``image_size``."""
        return resize_transform(image_size, tuple(mean), tuple(std)), image_size

    def setup(self, stage: str | None = None) -> None:
        """Read the domains and split them (once: later calls, for any stage, do nothing)."""
        if self.split is not None:
            return
        domains = read_domains(self._root(), self.on_bad_image)
        split = split_domains(domains, self.test_domains, self.holdout_fraction, self.seed, self.label_fraction)
        names = list(domains)
        decoded: dict[tuple[str, Part, int], LabeledImageDataset] = {}

        def part(name: str, which: Part, transform: Any, draft: int) -> LabeledImageDataset:
            items = domains[name].subset(split.parts[name][which])
            if self.cache_images:  # each part decoded once, at the draft size its reads use (training or evaluation)
                if (name, which, draft) not in decoded:
                    decoded[(name, which, draft)] = items.with_transform(None, draft).decoded()
                items = decoded[(name, which, draft)]
            return items.with_transform(transform, draft)

        if self.device_augment is not None:  # fixed squares, the whole image as DomainBed's evaluation reads it
            train_reads: Any = fixed_size_transform(self.image_size, squash=True)
            draft = eval_draft_size(self.image_size)
        else:
            train_reads, draft = self.train_transform, self._train_draft()
        self.train_dataset = GroupedItems(
            [(part(d, "in", train_reads, draft), names.index(d)) for d in split.train_domains]
        )
        self.val_groups = [EvalGroup(d, "train", "out") for d in split.train_domains]
        self.test_groups = [
            *(EvalGroup(d, "test", "in") for d in split.test_domains),
            *(EvalGroup(d, "test", "out") for d in split.test_domains),
            *self.val_groups,
        ]
        self.val_dataset = self._eval_items(self.val_groups, part)
        self.test_dataset = self._eval_items(self.test_groups, part)
        self.split = split

    def _eval_items(self, groups: list[EvalGroup], part: Any) -> GroupedItems:
        transform, draft = self.eval_transform, self.eval_draft
        return GroupedItems([(part(g.domain, g.part, transform, draft), k) for k, g in enumerate(groups)])

    def _train_draft(self) -> int:
        return train_draft_size(self.image_size, self.crop_scale)

    def _root(self) -> str:
        if self.root is None:
            raise DataError("no data given: pass --data.root, a DomainBed tree <root>/<domain>/<class>/<images>")
        return self.root

    def check_folders(self) -> None:
        """Check, reading no image, that the data root exists and names the test domains (``coretune bench`` and
        ``tune`` call it before their first run). Raises :class:`DataError` naming the path and fix."""
        root = self._root()
        require_folder(root, "data root")
        names = domain_folders(root)
        if unknown := [d for d in self.test_domains if d not in names]:
            raise DataError(f"unknown test domain(s) {unknown}: the domains under the data root are {names}")

    def separate_validation(self) -> bool:
        """Whether validation reads other images than the test split: the training domains' held-out parts
        (``holdout_fraction`` > 0); the unseen domains are never validated on."""
        return self.holdout_fraction > 0

    # -- what the data is -----------------------------------------------------------------------------------
    @property
    def domain_names(self) -> list[str]:
        """Every domain, sorted: training batches' domain labels index it."""
        self.setup()
        assert self.split is not None
        return list(self.split.domains)

    @property
    def class_names(self) -> list[str]:
        """Class names in label order (sorted folder names, the same in every domain)."""
        self.setup()
        assert self.split is not None
        return next(iter(self.split.domains.values())).classes

    # -- loaders --------------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        """``steps_per_epoch`` balanced batches ``(images, labels, domains)``, fixed by ``(seed, step)``."""
        self.setup()
        assert self.train_dataset is not None
        dataset, on_device = self.train_dataset, self.device_augment is not None
        if self.train_views > 1 and not on_device:  # on the device, the views are drawn there
            views = Views(self.train_transform, self.train_views)
            parts = zip(dataset.parts, dataset.part_groups, strict=True)
            dataset = GroupedItems([(ds.with_transform(views, ds.draft_size), group) for ds, group in parts])
        return balanced_train_loader(
            dataset, dataset.group_indices(), self.batch_size, self.steps_per_epoch, self.seed, on_device,
            **self._loader_options(),
        )  # fmt: skip


def domain_folders(root: str) -> list[str]:
    """The domain folders of a DomainBed tree ``root`` (its sub-folders but hidden ones), sorted: the domains."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def domain_list(value: str | Sequence[str] | None) -> list[str]:
    """``"photo"``, ``"art_painting,sketch"`` or a list, as a list of names (None: empty)."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(v).strip() for v in items if str(v).strip()]
