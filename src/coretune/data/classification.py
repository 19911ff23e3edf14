"""The image-classification LightningDataModule: folders or CIFAR on disk → seeded, stratified loaders."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, get_args

from torch import Tensor
from torch.utils.data import DataLoader

from .base import ImageDataModule, label_fraction_rule, rule, val_fraction_rule
from .datasets import ImageFileDataset, LabeledImageDataset, OnBadImage, check_cifar_root, load_cifar
from .device_augment import AugmentOn, DeviceAugment, fixed_size_transform
from .errors import DataError
from .images import require_folder, warn_skipped
from .loading import NumWorkers, PinMemory
from .samplers import seeded_train_loader
from .splits import long_tailed_subset, stratified_split, stratified_subset
from .transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Views,
    auto_augment_problem,
    eval_draft_size,
    eval_transform,
    train_draft_size,
    train_transform,
)

__all__ = ["DatasetName", "ImageClassificationData", "Split"]

DatasetName = Literal["imagefolder", "cifar10", "cifar100"]
Split = Literal["train", "val", "test"]


class ImageClassificationData(ImageDataModule):
    """Image-classification data for fine-tuning: an ImageFolder tree, or CIFAR-10/100 on disk.

    Folders (``dataset="imagefolder"``): ``root/train/<class>/<images>`` plus ``root/val/`` and/or
    ``root/test/`` with the same class folders (``train_dir``/``val_dir``/``test_dir`` override each). Classes
    are the sorted sub-folder names. Images of any mode (grey, RGBA, palette, 16-bit) are read as 8-bit RGB.

    Splits: with ``val_fraction = 0`` the validation loader reads ``val/`` (else ``test/``) and the test
    loader reads ``test/`` (else ``val/``) — the usual protocol when a data set has one held-out split. With
    ``val_fraction > 0`` a stratified part of the (label-fraction) training set is held out for validation,
    so hyper-parameter selection never sees the held-out folder, which becomes the test loader. The
    ``label_fraction`` subset is drawn first: validation then comes from the labels one really has.

    Class imbalance (``imbalance_ratio`` R > 1): the training set is first made long-tailed (CIFAR-10-LT's
    exponential profile, :func:`~coretune.data.splits.long_tailed_counts`), then the label fraction is drawn from it
    per class (10% of the labels of CIFAR-10-LT), then the validation split is held out of that, stratified, so it is
    long-tailed too (a class keeps at least one image on each side). The test split, and a val/ folder of its own,
    stay as they are: balanced for CIFAR.

    Loaders: training shuffles in an order fixed by ``(seed, epoch)`` and augments each image with draws fixed
    by ``(seed, epoch, index)`` (the same batches every run, resumed or not); it drops the last incomplete
    batch when the training set is larger than one batch, since contrastive terms over a tiny trailing batch
    have almost no pairs; evaluation loaders keep every image, in file order. With ``augment_on="device"`` the
    training loader's items are fixed uint8 squares with their item seeds, augmented on the device
    (:mod:`coretune.data.device_augment`).

    ``train_views`` (default 1) is how many independently augmented views of each training image a batch
    holds: with 2 a batch is ``((view_1, view_2), labels)``. The fine-tuning engine sets it from the objective
    (:attr:`coretune.objectives.Objective.input_views`: Bi-tuning's momentum keys use a second view).

    After :meth:`setup`: ``num_classes``, ``class_names``, ``train_dataset``, ``val_dataset``,
    ``test_dataset`` (:class:`LabeledImageDataset`; ``test_dataset`` may be None), :meth:`class_counts` and
    ``validates_on_test`` (True when the validation and test loaders read the same images: a checkpoint or
    setting chosen on ``val/top1`` is then chosen on the test set).
    ``num_classes`` and ``class_names`` run :meth:`setup` when read before it (to size a classifier).

    Args:
        root: Data folder with train/ and val/ or test/ ImageFolder sub-trees; for CIFAR, the folder
            holding cifar-10-batches-py/ or cifar-100-python/.
        train_dir: Training ImageFolder tree, instead of root/train.
        val_dir: Validation ImageFolder tree, instead of root/val.
        test_dir: Test ImageFolder tree, instead of root/test.
        dataset: Source format: imagefolder, or torchvision's CIFAR-10/100 python files (never downloaded).
        image_size: Side of the square network input in pixels (train random-resized crop, eval centre crop).
        label_fraction: Fraction of training labels to use, drawn per class with seed (semi-supervised
            settings); in (0, 1].
        val_fraction: Fraction of the training set held out, per class, as the validation split; the val/test
            folder then becomes the test split. In [0, 1).
        seed: Seed of the long-tailed and label-fraction subsets, the validation hold-out and the training shuffle
            order.
        imbalance_ratio: Make the training set long-tailed: class i of C keeps ⌊n_max · (1/R)^(i/(C−1))⌋ images
            (Cao et al. 2019's CIFAR-10-LT, classes in index order; n_max: the smallest class's count, 5,000 on
            CIFAR-10), drawn per class with seed, before label_fraction and val_fraction; the test split stays as it
            is. null or 1 (default): the classes as they are; 100 and 10: the usual CIFAR-LT ratios.
        shot_thresholds: (many, few): a class with more than many training images is many-shot, one with fewer than
            few few-shot, the rest medium-shot (Liu et al. 2019's 100 and 20); results.json's test entry reports
            the top-1 of each group and its classes, and validation logs it when the classes fall into two groups or
            more. Lower them for a small long-tailed set (CIFAR-10-LT at 10% of the labels: e.g. [50, 10]).
        rotation: Maximum random rotation in degrees added to training augmentation (0: none).
        crop_scale: Range of the image area the training random-resized crop covers (the paper's (0.08, 1.0);
            raise the lower end for small or centred images, e.g. (0.5, 1.0)).
        hflip: Random horizontal flips in training augmentation (turn off for digits, text, …).
        auto_augment: An automatic augmentation policy added to the training augmentation (validation and test
            images are never augmented): timm's RandAugment string (rand-m9-mstd0.5: 2 operations of magnitude 9,
            noise std 0.5; rand-m9-mstd0.5-inc1, the ViT fine-tuning recipes' of DeiT, BEiT, iBOT and MAE) or
            trivial (torchvision's TrivialAugmentWide); its draws are seeded per image like the rest. null
            (default): none.
        cache_images: Decode every image file once at setup and keep the pixels in memory (N·H·W·3 bytes: 184 MB
            for CIFAR-10's 60,000 images of 32 px), instead of decoding each image at every access: the same
            pixels and results; the training loader alone runs 1.8x faster on CIFAR-10 at 64 px, but a whole
            ResNet-18 step on 2 CPU cores gains nothing measurable (docs/benchmarks.md): for slow storage or
            images whose decoding dominates.
    """

    #: Options that drew the run's splits (the long-tailed and label subsets and the validation split carved from them,
    #: and their seed), and the bounds of the shot groups of its classes. A checkpoint keeps them; ``coretune test``
    #: and ``validate`` default to them (``FineTuner.trained_data``).
    split_settings: ClassVar[tuple[str, ...]] = (
        "seed", "label_fraction", "val_fraction", "imbalance_ratio", "shot_thresholds",
    )  # fmt: skip
    #: ``train_views`` > 1 makes batches of independently augmented views (``((view_1, view_2), labels, ...)``).
    makes_views: ClassVar[bool] = True
    option_checks = (
        rule("dataset", lambda v: v in get_args(DatasetName), f"one of {list(get_args(DatasetName))}", quote=True),
        "on_bad_image", "image_size", "batch_size", "eval_batch_size", "num_workers", label_fraction_rule("label"),
        val_fraction_rule("the val/ or test/ folder"),
        rule("rotation", lambda v: 0 <= v <= 180, "in [0, 180] degrees (0: none)"),
        "crop_scale", "augment_on",
        lambda options: auto_augment_problem(options.get("auto_augment")),
        lambda options: _device_auto_augment_problem(options.get("augment_on"), options.get("auto_augment")),
        rule("imbalance_ratio", lambda v: v is None or v >= 1, ">= 1 (1 or null: the classes as they are)"),
        rule("shot_thresholds", lambda v: len(v) == 2 and 0 <= v[1] <= v[0], "[many, few] with 0 <= few <= many"),
    )  # fmt: skip

    def __init__(
        self,
        root: str | None = None,
        train_dir: str | None = None,
        val_dir: str | None = None,
        test_dir: str | None = None,
        dataset: DatasetName = "imagefolder",
        image_size: int = 224,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: NumWorkers = "auto",
        label_fraction: float = 1.0,
        val_fraction: float = 0.0,
        seed: int = 0,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        rotation: float = 0.0,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        hflip: bool = True,
        on_bad_image: OnBadImage = "error",
        pin_memory: PinMemory = "auto",
        cache_images: bool = False,
        augment_on: AugmentOn = "loader",
        auto_augment: str | None = None,
        imbalance_ratio: float | None = None,
        shot_thresholds: tuple[int, int] = (100, 20),
    ) -> None:
        super().__init__(**{k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self.save_hyperparameters()
        self.train_dir, self.val_dir, self.test_dir = train_dir, val_dir, test_dir
        self.dataset, self.val_fraction, self.rotation = dataset, val_fraction, rotation
        self.cache_images = cache_images
        self.crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.auto_augment = auto_augment
        self.imbalance_ratio = None if imbalance_ratio is None or imbalance_ratio == 1 else float(imbalance_ratio)
        self.shot_thresholds = (int(shot_thresholds[0]), int(shot_thresholds[1]))
        self.train_transform = train_transform(
            image_size, self.mean, self.std, rotation, self.crop_scale, hflip, auto_augment=auto_augment
        )
        self.eval_transform, self.eval_draft = self.test_transform(image_size, self.mean, self.std)
        if augment_on == "device":
            self.device_augment = DeviceAugment(image_size, self.mean, self.std, rotation, self.crop_scale, hflip)
        self.train_dataset: LabeledImageDataset | None = None
        self.val_dataset: LabeledImageDataset | None = None
        self.test_dataset: LabeledImageDataset | None = None
        self._train_files: LabeledImageDataset | None = None
        self._test_files: LabeledImageDataset | None = None
        self._val_files: LabeledImageDataset | None = None

    # -- set-up ---------------------------------------------------------------------------------------------
    @staticmethod
    def test_transform(
        image_size: int, mean: Sequence[float], std: Sequence[float]
    ) -> tuple[Callable[[Any], Tensor], int]:
        """How the validation and test splits (and ``coretune predict``) read one image: resize, centre crop and
        normalise; with the JPEG draft size to decode it at."""
        return eval_transform(image_size, tuple(mean), tuple(std)), eval_draft_size(image_size)

    def setup(self, stage: str | None = None) -> None:
        """Read the splits, subsample and split them (once: later calls, for any stage, do nothing). With
        ``cache_images``, decode the splits ``stage`` reads (``"test"``: the test split only; ``"validate"``: the
        validation split; ``"fit"`` or None: all three) — a module set up for one stage and then used for another
        reads the other splits' files as it goes."""
        if self._class_names is not None:
            return
        train, held_val, held_test = self._read_splits()
        names = train.classes
        if self.imbalance_ratio is not None:
            keep = long_tailed_subset(
                train.targets, self.imbalance_ratio, self.seed, num_classes=len(names), class_names=names
            )
            train = train.subset(keep)
        if self.label_fraction < 1:
            keep = stratified_subset(
                train.targets, self.label_fraction, self.seed, class_names=names, name="label_fraction"
            )
            train = train.subset(keep)
        if self.val_fraction > 0:
            fit_idx, val_idx = stratified_split(
                train.targets, self.val_fraction, self.seed, class_names=names, name="val_fraction"
            )
            val: LabeledImageDataset | None = train.subset(val_idx)
            train, test = train.subset(fit_idx), _first(held_test, held_val)
        else:
            val, test = _first(held_val, held_test), _first(held_test, held_val)
        self.validates_on_test = val is not None and val is test
        # the items before any transform or decoding (train_as_evaluated, test_files_in_training)
        self._train_files, self._test_files = train, test
        self._val_files = val if self.val_fraction == 0 and not self.validates_on_test else None  # a folder of its own
        self.train_dataset = (
            train.with_transform(fixed_size_transform(self.image_size), self.eval_draft)
            if self.device_augment is not None
            else train.with_transform(self.train_transform, train_draft_size(self.image_size, self.crop_scale))
        )
        self.val_dataset = val.with_transform(self.eval_transform, self.eval_draft) if val is not None else None
        self.test_dataset = test.with_transform(self.eval_transform, self.eval_draft) if test is not None else None
        reads = {"test": ("test",), "validate": ("val",), "predict": ()}.get(stage or "fit", ("train", "val", "test"))
        if self.cache_images:  # after with_transform: decoded at each split's draft size, as an access would
            if "train" in reads:
                self.train_dataset = self.train_dataset.decoded()
            if self.val_dataset is not None and ("val" in reads or (self.validates_on_test and "test" in reads)):
                self.val_dataset = self.val_dataset.decoded()
            if self.validates_on_test:  # one folder, one transform: decoded once
                self.test_dataset = self.val_dataset
            elif self.test_dataset is not None and "test" in reads:
                self.test_dataset = self.test_dataset.decoded()
        self._class_names = list(names)

    def train_as_evaluated(self) -> LabeledImageDataset:
        """The training split's items read as the evaluation splits read theirs (the evaluation transform at its
        draft size; decoded into memory with ``cache_images``, at that size and not the training crops'), for
        frozen-feature scoring (``coretune eval``'s kNN bank and probe training set, after ``setup("test")``, which
        decodes no training image)."""
        self.setup("test")
        assert self._train_files is not None
        items = self._train_files.with_transform(self.eval_transform, self.eval_draft)
        return items.decoded() if self.cache_images else items

    def test_files_in_training(self) -> list[str]:
        """The test split's image files that the training split also reads (the same file in the same real folder:
        a class folder symlinked into train/, a test folder inside it; a file symlinked alone is not followed, to
        keep this cheap on a million images), in test order; none for in-memory data."""
        self.setup("test")
        return _shared_files(self._test_files, self._train_files)

    def val_files_in_training(self) -> list[str]:
        """:meth:`test_files_in_training` for a validation folder of its own (``val/`` beside a ``test/``): the
        images that would choose ``best.ckpt`` on training accuracy; none when validation is carved from the
        training images (``val_fraction``) or is the test split."""
        self.setup("test")
        return _shared_files(self._val_files, self._train_files)

    def check_folders(self) -> None:
        """Check, reading no image, that the configured data folders exist (``coretune bench`` and ``tune`` call it
        before their first run, so a wrong path fails at once). Raises :class:`DataError` naming the path and fix."""
        if self.dataset == "imagefolder":
            self._folders()
            return
        self._check_cifar_options()
        check_cifar_root(self.root, self.dataset)

    def separate_validation(self) -> bool:
        """Whether validation reads other images than the test split, reading no image: ``val_fraction`` > 0, or
        both a validation and a test folder (not the same one). CIFAR has only a test split."""
        if self.val_fraction > 0:
            return True
        if self.dataset != "imagefolder":
            return False
        _, val_dir, test_dir = self._folders()
        return val_dir is not None and test_dir is not None and os.path.realpath(val_dir) != os.path.realpath(test_dir)

    def has_test_split(self) -> bool:
        """Whether there are images to test on, reading no image: a val/ or test/ folder (or ``val_dir`` /
        ``test_dir``), or CIFAR's test set; with ``val_fraction`` > 0 and neither, only validation has images."""
        if self.dataset != "imagefolder":
            return True
        _, val_dir, test_dir = self._folders()
        return val_dir is not None or test_dir is not None

    def tests_on_training_folder(self) -> bool:
        """Whether the test split reads the training folder itself (``--data.test_dir`` naming it, or a ``val_dir``
        that does when there is no test folder), reading no image: allowed for a fit (its score on them is a
        training accuracy), refused by ``coretune eval``, whose kNN bank would hold every query."""
        if self.dataset != "imagefolder":
            return False
        train_dir, val_dir, test_dir = self._folders()
        scored = test_dir if test_dir is not None else val_dir
        return scored is not None and os.path.realpath(scored) == os.path.realpath(train_dir)

    def require_test_split(self, why: str) -> None:
        """Raise :class:`DataError` when there are no images to test on (:meth:`has_test_split`), reading no image:
        ``why`` says what needs them, and the message ends with the folder to add."""
        if not self.has_test_split():
            raise DataError(
                f"{why} a val/ or test/ folder beside train/ (same class folders); add one, or pass --data.test_dir"
            )

    def _check_cifar_options(self) -> None:
        if self.root is None:
            raise DataError(f"dataset={self.dataset} needs --data.root: the folder holding its python files")
        if self.train_dir or self.val_dir or self.test_dir:
            raise DataError(
                "train_dir/val_dir/test_dir apply to dataset=imagefolder only; for "
                f"{self.dataset} pass --data.root alone"
            )

    def _read_splits(
        self,
    ) -> tuple[LabeledImageDataset, LabeledImageDataset | None, LabeledImageDataset | None]:
        """``(train, val or None, test or None)`` before subsetting, checked for matching classes."""
        if self.dataset != "imagefolder":
            self._check_cifar_options()
            return (
                load_cifar(self.root, self.dataset, train=True),
                None,
                load_cifar(self.root, self.dataset, train=False),
            )
        train_dir, val_dir, test_dir = self._folders()
        # one folder given as two splits (val and test: validates_on_test; train and test: a scored folder) is
        # read, and its images checked, once: the same images
        loaded: dict[str, LabeledImageDataset] = {}
        splits: dict[str, LabeledImageDataset] = {}
        for split, folder in (("train", train_dir), ("val", val_dir), ("test", test_dir)):
            if folder is not None:
                key = os.path.realpath(folder)
                if key not in loaded:
                    loaded[key] = LabeledImageDataset.from_folder(folder, on_bad_image=self.on_bad_image)
                splits[split] = loaded[key]
        warn_skipped(
            [bad for ds in loaded.values() for bad in ds.skipped],
            sum(len(ds) + len(ds.skipped) for ds in loaded.values()),
        )
        train = splits["train"]
        for split, folder in (("val", val_dir), ("test", test_dir)):
            if split in splits and splits[split].classes != train.classes:
                raise DataError(_class_mismatch(train.classes, splits[split].classes, train_dir, folder, split))
        return train, splits.get("val"), splits.get("test")

    def _folders(self) -> tuple[str, str | None, str | None]:
        """Resolve ``(train_dir, val_dir, test_dir)`` from ``root`` and the explicit overrides."""
        if self.root is None and self.train_dir is None:
            raise DataError(
                "no training data given: pass --data.root (a folder with train/ and val/ or test/) or --data.train_dir"
            )
        if self.root is not None:
            require_folder(self.root, "data root")

        def pick(explicit: str | None, sub: str) -> str | None:
            if explicit is not None:
                require_folder(explicit, f"{sub}_dir")
                return explicit
            candidate = os.path.join(self.root, sub) if self.root is not None else None
            return candidate if candidate is not None and os.path.isdir(candidate) else None

        train_dir = pick(self.train_dir, "train")
        if train_dir is None:
            raise DataError(
                f"data root {self.root} has no train/ folder: expected {self.root}/train/<class>/<images> "
                f"and {self.root}/val/ or {self.root}/test/ alike (or pass --data.train_dir)"
            )
        val_dir, test_dir = pick(self.val_dir, "val"), pick(self.test_dir, "test")
        if val_dir is None and test_dir is None and self.val_fraction == 0:
            where = f"data root {self.root} has neither val/ nor test/" if self.root else "no val_dir or test_dir"
            raise DataError(
                f"{where}: add one (same class folders as train/), or pass --data.val_dir or --data.test_dir "
                "(--data.val_fraction holds out part of the training set for validation; a fit still tests on one)"
            )
        return train_dir, val_dir, test_dir

    # -- what the data is -----------------------------------------------------------------------------------
    def class_counts(self, split: Split = "train") -> dict[str, int]:
        """Images per class in ``split`` after subsetting (empty dict when there is no such split)."""
        self.setup()
        ds = {"train": self.train_dataset, "val": self.val_dataset, "test": self.test_dataset}[split]
        return ds.class_counts() if ds is not None else {}

    # -- loaders --------------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        """Shuffled in an order fixed by ``(seed, epoch)``; drops the last incomplete batch (2+ batches).

        Under ``torch.distributed`` each process reads its share of every global batch of ``batch_size ×
        world size`` items (:class:`EpochShuffleSampler`), so the global batches are those of one process with
        that batch size.
        """
        self.setup()
        assert self.train_dataset is not None
        dataset, on_device = self.train_dataset, self.device_augment is not None
        if self.train_views > 1 and not on_device:  # on the device, the views are drawn there
            draft = train_draft_size(self.image_size, self.crop_scale)
            dataset = dataset.with_transform(Views(self.train_transform, self.train_views), draft)
        return seeded_train_loader(dataset, self.batch_size, self.seed, on_device, **self._loader_options())

    def test_dataloader(self) -> DataLoader:
        """The test split in order: the val/test folder or CIFAR's test set."""
        self.setup()
        if self.test_dataset is None:
            raise DataError(
                "no test split: with val_fraction > 0 the test loader reads the val/ or test/ folder, and "
                "there is none — add one or pass --data.test_dir"
            )
        return super().test_dataloader()

    def predict_loader(self, folder: str) -> DataLoader:
        """Unlabelled images under ``folder``, evaluation transform; batches are ``(images, indices)``.

        The dataset (``loader.dataset``, an :class:`ImageFileDataset`) lists the files in ``.paths``.
        """
        ds = ImageFileDataset(
            folder,
            self.eval_transform,
            draft_size=self.eval_draft,
            on_bad_image=self.on_bad_image,
        )
        return self._eval_loader(ds)


def _class_mismatch(train: list[str], other: list[str], train_dir: str, folder: str | None, split: str) -> str:
    only_train = sorted(set(train) - set(other))
    only_other = sorted(set(other) - set(train))
    parts = []
    if only_train:
        parts.append(f"missing from {split}: {only_train}")
    if only_other:
        parts.append(f"only in {split}: {only_other}")
    return (
        f"class folders of {split} ({folder}) differ from train ({train_dir}): {'; '.join(parts)} — both "
        "need the same class sub-folders (rename, add or remove folders)"
    )


def _shared_files(scored: LabeledImageDataset | None, train: LabeledImageDataset | None) -> list[str]:
    """The files of ``scored`` that ``train`` reads too (the same name in the same real folder), in order."""
    if train is None or scored is None or train.paths is None or scored.paths is None:
        return []
    folders: dict[str, str] = {}

    def real(path: str) -> tuple[str, str]:
        folder, _, name = path.rpartition(os.sep)
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        return folders[folder], name

    scored_real = [real(path) for path in scored.paths]
    scored_folders = {folder for folder, _ in scored_real}
    # only the training files in a scored folder are kept (usually none: no set of a million training paths)
    trained = {pair for path in train.paths if (pair := real(path))[0] in scored_folders}
    return [path for path, pair in zip(scored.paths, scored_real, strict=True) if pair in trained]


def _first(*datasets: LabeledImageDataset | None) -> LabeledImageDataset | None:
    return next((d for d in datasets if d is not None), None)


def _device_auto_augment_problem(augment_on: object, auto_augment: object) -> str | None:
    """Why ``--data.auto_augment`` cannot go with ``--data.augment_on device`` (RandAugment/TrivialAugment run on
    PIL images in the loader), or None."""
    if augment_on == "device" and auto_augment is not None:
        return (
            f"auto_augment {auto_augment!r} runs in the loader on PIL images: use --data.augment_on loader with it, "
            "or drop --data.auto_augment to augment on the device"
        )
    return None
