"""Semantic-segmentation data in the PASCAL VOC layout (:mod:`~coretune.data.voc`): the dataset of images and
masks, and the LightningDataModule; the joint image + mask transforms are in
:mod:`~coretune.data.segmentation_transforms` (names re-exported here).

Batches are ``(images (B, 3, H, W) float, masks (B, H, W) int64)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors

from .base import ImageDataModule, label_fraction_rule, rule, val_fraction_rule
from .datasets import OnBadImage
from .device_augment import AugmentOn
from .errors import DataError
from .images import find_bad_images, load_rgb, warn_skipped
from .loading import NumWorkers, PinMemory
from .mask_classes import inferred_class_count
from .samplers import eval_sampler, same_size_eval_loader, seeded_train_loader
from .segmentation_transforms import (
    CenterCropPad,
    EvalMode,
    RandomScale,
    pad_collate,
    segmentation_eval_transform,
    segmentation_train_transform,
)
from .splits import stratified_split, stratified_subset
from .transforms import IMAGENET_MEAN, IMAGENET_STD
from .voc import (
    CLASS_NAME_FILES,
    IGNORE_INDEX,
    evaluation_lists,
    image_path,
    list_path,
    mask_classes,
    mask_path,
    read_class_names,
    read_ids,
    read_mask,
    require_layout,
)

__all__ = [
    "CLASS_NAME_FILES",
    "IGNORE_INDEX",
    "CenterCropPad",
    "EvalMode",
    "RandomScale",
    "SegmentationData",
    "SegmentationDataset",
    "pad_collate",
    "read_class_names",
    "read_mask",
    "segmentation_eval_transform",
    "segmentation_train_transform",
]

Split = Literal["train", "val", "test"]


# ------------------------------------------------------------------------------------------------------------
# dataset
# ------------------------------------------------------------------------------------------------------------
class SegmentationDataset(Dataset[tuple[Any, Any]]):
    """Image files with their masks: ``ds[i] -> transform(image, mask)`` (the RGB PIL image and a
    ``tv_tensors.Mask`` of shape (H, W); both as they are without a transform).

    Attributes:
        ids: image ids (file names without extension).
        images, masks: the files of each item.
        classes_present: the distinct mask values of each item (``ignore_index`` included), read at construction.
        skipped: ``(path, reason)`` of items left out as unreadable (``on_bad_image="skip"``).
    """

    def __init__(
        self,
        ids: Sequence[str],
        images: Sequence[str],
        masks: Sequence[str],
        classes_present: Sequence[np.ndarray],
        transform: Callable[[Any, Any], Any] | None = None,
        skipped: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.ids, self.images, self.masks = list(ids), list(images), list(masks)
        self.classes_present = list(classes_present)
        self.transform = transform
        self.skipped = list(skipped)

    @classmethod
    def from_voc(cls, root: str, split: str, *, on_bad_image: OnBadImage = "error") -> SegmentationDataset:
        """The images listed in ``root/ImageSets/Segmentation/<split>.txt``, every mask read once to check it.

        Raises:
            DataError: a missing folder or list file, a listed image or its mask missing, a mask that cannot
                be decoded (``"error"``) or whose size differs from its image's (each named).
        """
        require_layout(root)
        list_file = list_path(root, split)
        ids = read_ids(list_file)
        images = [image_path(root, i, list_file) for i in ids]
        masks = [mask_path(root, i, image) for i, image in zip(ids, images, strict=True)]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            found = list(pool.map(partial(mask_classes, on_bad_image=on_bad_image), images, masks))
        skipped = [(m, why) for m, why in zip(masks, found, strict=True) if isinstance(why, str)]
        if on_bad_image == "skip":
            skipped += find_bad_images(images)
        bad = {path for path, _ in skipped}
        keep = [k for k in range(len(ids)) if images[k] not in bad and masks[k] not in bad]
        if not keep:
            raise DataError(f"no readable image of {list_file} has a readable mask: fix the files it names")
        return cls(
            [ids[k] for k in keep],
            [images[k] for k in keep],
            [masks[k] for k in keep],
            [found[k] for k in keep],  # type: ignore[misc]  # the str entries were skipped
            skipped=skipped,
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image = load_rgb(self.images[index], orient=False)  # its mask has the stored size (checked at set-up)
        mask = tv_tensors.Mask(torch.from_numpy(read_mask(self.masks[index])))
        return self.transform(image, mask) if self.transform is not None else (image, mask)

    def subset(self, indices: Sequence[int]) -> SegmentationDataset:
        """The items ``indices``, in that order, with the same transform."""
        return SegmentationDataset(
            [self.ids[i] for i in indices],
            [self.images[i] for i in indices],
            [self.masks[i] for i in indices],
            [self.classes_present[i] for i in indices],
            self.transform,
            self.skipped,
        )

    def with_transform(self, transform: Callable[[Any, Any], Any] | None) -> SegmentationDataset:
        """The same items with ``transform``."""
        out = self.subset(range(len(self)))
        out.transform = transform
        return out

    def max_class(self, ignore_index: int = IGNORE_INDEX) -> int:
        """The largest mask value other than ``ignore_index`` (-1 when every pixel is ignored)."""
        return max((int(v[v != ignore_index].max()) for v in self.classes_present if (v != ignore_index).any()),
                   default=-1)  # fmt: skip

    def check_classes(self, num_classes: int, ignore_index: int = IGNORE_INDEX) -> None:
        """Raise :class:`DataError` naming the first mask holding a value outside ``[0, num_classes)`` that is not
        ``ignore_index``."""
        for mask, values in zip(self.masks, self.classes_present, strict=True):
            bad = values[(values >= num_classes) & (values != ignore_index)]
            if bad.size:
                raise DataError(
                    f"mask {mask} holds value {int(bad[0])}, out of range for {num_classes} classes "
                    f"(0–{num_classes - 1}, {ignore_index} = ignore): fix the mask, or pass the right "
                    "--data.num_classes (or class-name file)"
                )


# ------------------------------------------------------------------------------------------------------------
# data module
# ------------------------------------------------------------------------------------------------------------
class SegmentationData(ImageDataModule):
    """Semantic-segmentation data in the PASCAL VOC layout (see the module docstring) for fine-tuning.

    Splits: ``train.txt`` trains; with ``val_fraction = 0`` the validation loader reads ``val.txt`` (else
    ``test.txt``) and the test loader ``test.txt`` (else ``val.txt``), as
    :class:`~coretune.data.ImageClassificationData` does with its folders. With ``val_fraction > 0`` a random part
    of the (label-fraction) training images, drawn with ``seed``, is held out for validation, so selection
    (``coretune tune``, ``best.ckpt``) never reads ``val.txt``/``test.txt``, which the test loader reads.
    Every mask is read once at :meth:`setup`, so a bad file stops the run before training, named.

    Classes: ``num_classes`` if given; else the number of names in ``classes.txt`` / ``labelmap.txt``
    (:func:`read_class_names`); else the largest mask value other than ``ignore_index`` (over all splits) + 1, each
    class occurring (:func:`~.mask_classes.inferred_class_count`). Other values ``>= num_classes`` are errors.

    Loaders: training shuffles in an order fixed by ``(seed, epoch)``, draws each crop's augmentation from
    ``(seed, epoch, index)`` and drops the last incomplete batch when there are 2+ batches (DeepLab's ASPP
    pooling branch has BatchNorm on a 1×1 map: it cannot train on a batch of one). Batches are ``(images
    (B, 3, H, W) float, masks (B, H, W) int64)``; an evaluation batch of whole images holds images of one size
    (:func:`~coretune.data.samplers.same_size_eval_loader`), so that no prediction depends on its batch-mates.

    Args:
        root: Data folder in the PASCAL VOC layout (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/).
        image_size: Side of the square crop in pixels (training random crop, evaluation centre crop).
        label_fraction: Fraction of the training images to use, drawn with seed; in (0, 1].
        val_fraction: Fraction of the (label-fraction) training images held out, drawn with seed, as the
            validation split; the val.txt/test.txt images are then the test split only. 0 validates on val.txt.
        seed: Seed of the label-fraction subset, the validation hold-out and the training order and augmentation.
        num_classes: Number of classes (default: from the class-name file, else from the masks).
        ignore_index: Mask value left out of the loss and the metrics.
        scale_range: Range of the training random scale factor (DeepLab's (0.5, 2.0)).
        eval_mode: Evaluation input: "center_crop" (the paper: the central image_size crop, padded) or "whole"
            (each image at its own size).
        on_bad_image: Unreadable image or mask files: "error" stops at the first with its path; "skip" leaves
            them out and warns once.
        augment_on: "loader" only: each mask is cropped and flipped with its image in the loader.
    """

    #: Options that decide what the run's scores read: the label subset and the validation split carved from it, their
    #: seed, and how an image is evaluated (``eval_mode``: whole, or its centre crop). A checkpoint keeps them;
    #: ``coretune test`` and ``validate`` default to them (``FineTuner.trained_data``).
    split_settings: ClassVar[tuple[str, ...]] = ("seed", "label_fraction", "val_fraction", "eval_mode")
    option_checks = (
        "image_size", "batch_size", "eval_batch_size", "num_workers", label_fraction_rule("image"),
        val_fraction_rule("val.txt or test.txt"),
        rule("num_classes", lambda v: v is None or v >= 2, ">= 2 (or unset)"),
        lambda options: _ignore_index_problem(options["ignore_index"], options["num_classes"]),
        rule("scale_range", lambda v: len(v) == 2 and 0 < v[0] <= v[1], "(low, high) with 0 < low <= high"),
        rule("eval_mode", lambda v: v in get_args(EvalMode), "'center_crop' or 'whole'", quote=True),
        "on_bad_image",
        rule("augment_on", lambda v: v == "loader", "'loader' for segmentation (each mask is cropped and flipped with "
             "its image in the loader; device augmentation is for classification data)", quote=True),
    )  # fmt: skip

    def __init__(
        self,
        root: str | None = None,
        image_size: int = 513,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: NumWorkers = "auto",
        label_fraction: float = 1.0,
        val_fraction: float = 0.0,
        seed: int = 0,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        num_classes: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        scale_range: tuple[float, float] = (0.5, 2.0),
        hflip: bool = True,
        eval_mode: EvalMode = "center_crop",
        on_bad_image: OnBadImage = "error",
        pin_memory: PinMemory = "auto",
        augment_on: AugmentOn = "loader",
    ) -> None:
        super().__init__(**{k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self.save_hyperparameters()
        self.val_fraction, self.ignore_index, self.eval_mode = val_fraction, ignore_index, eval_mode
        self.train_transform = segmentation_train_transform(
            image_size, self.mean, self.std, ignore_index, (float(scale_range[0]), float(scale_range[1])), hflip
        )
        self.eval_transform = segmentation_eval_transform(image_size, self.mean, self.std, ignore_index, eval_mode)
        self.train_dataset: SegmentationDataset | None = None
        self.val_dataset: SegmentationDataset | None = None
        self.test_dataset: SegmentationDataset | None = None  # the val dataset itself when there is no test.txt
        self._num_classes = num_classes

    # -- set-up ---------------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """Read the list files and every mask, infer or check the classes, subsample (once)."""
        if self._class_names is not None:
            return
        root, present = self._check_layout()
        splits = {s: SegmentationDataset.from_voc(root, s, on_bad_image=self.on_bad_image)
                  for s in ("train", *present)}  # fmt: skip
        warn_skipped(
            [bad for ds in splits.values() for bad in ds.skipped],
            sum(len(ds) + len(ds.skipped) for ds in splits.values()),
        )
        names = self._resolve_classes(list(splits.values()))
        train = splits["train"]
        if self.label_fraction < 1:
            if self.label_fraction * len(train) < 0.5:
                raise DataError(
                    f"label_fraction {self.label_fraction:g} keeps none of the {len(train)} training images: "
                    f"raise it to ≥ {0.5 / len(train):.4g}"
                )
            train = train.subset(stratified_subset([0] * len(train), self.label_fraction, self.seed))
        val, test = splits.get("val", splits.get("test")), splits.get("test", splits.get("val"))
        assert val is not None and test is not None  # _check_layout found val.txt or test.txt
        if self.val_fraction > 0:
            if len(train) < 2:
                raise DataError(
                    f"val_fraction {self.val_fraction:g} cannot hold out part of {len(train)} training image: both "
                    "training and validation need one; add images to train.txt, or set --data.val_fraction 0"
                )
            fit_idx, val_idx = stratified_split([0] * len(train), self.val_fraction, self.seed, name="val_fraction")
            train, val = train.subset(fit_idx), train.subset(val_idx)
        self._check_trained_classes(train, kept=len(train) < len(splits["train"]))
        self.validates_on_test = val is test
        self.train_dataset = train.with_transform(self.train_transform)
        self.val_dataset = val.with_transform(self.eval_transform)
        self.test_dataset = self.val_dataset if self.validates_on_test else test.with_transform(self.eval_transform)
        self._class_names = names

    def test_files_in_training(self) -> list[str]:
        """The test split's image files that the training split also reads (the same real file: an id in both
        ``train.txt`` and the test list, or a symlinked image), in test order (as
        :meth:`ImageClassificationData.test_files_in_training
        <coretune.data.ImageClassificationData.test_files_in_training>`)."""
        self.setup("test")
        if self.train_dataset is None or self.test_dataset is None:
            return []
        trained = {os.path.realpath(path) for path in self.train_dataset.images}
        return [path for path in self.test_dataset.images if os.path.realpath(path) in trained]

    def check_folders(self) -> None:
        """Check, reading no image, that the VOC-layout folders and list files exist (as
        :meth:`ImageClassificationData.check_folders <coretune.data.ImageClassificationData.check_folders>`)."""
        self._check_layout()

    def separate_validation(self) -> bool:
        """Whether validation reads other images than the test split, reading no image: ``val_fraction`` > 0, or
        both ``val.txt`` and ``test.txt`` listed."""
        return self.val_fraction > 0 or self._check_layout()[1] == ["val", "test"]

    def _check_layout(self) -> tuple[str, list[str]]:
        """``(root, evaluation splits listed: "val" and/or "test")``; :class:`DataError` names what is missing."""
        if self.root is None:
            raise DataError("no data given: pass --data.root, a folder in the PASCAL VOC layout (JPEGImages/, …)")
        return self.root, evaluation_lists(self.root)

    def _resolve_classes(self, splits: list[SegmentationDataset]) -> list[str]:
        """Class names (``num_classes`` of them), checking every mask's values against them."""
        assert self.root is not None
        names = read_class_names(self.root)
        if names is not None and self._num_classes is not None and len(names) != self._num_classes:
            raise DataError(
                f"num_classes is {self._num_classes} but the class-name file in {self.root} lists {len(names)} "
                "classes: pass the matching --data.num_classes or fix the file"
            )
        num_classes = self._num_classes or (len(names) if names else None)
        if num_classes is None:
            num_classes = inferred_class_count(splits, self.ignore_index)
        for ds in splits:
            ds.check_classes(num_classes, self.ignore_index)
        self._num_classes = num_classes
        return names if names is not None else [str(k) for k in range(num_classes)]

    def _check_trained_classes(self, train: SegmentationDataset, kept: bool = False) -> None:
        """Refuse training masks (``kept``: the part ``label_fraction`` and ``val_fraction`` leave to train on)
        that hold fewer than 2 classes besides ``ignore_index``: nothing to segment. The common cause is a binary
        mask saved as 0/255, whose foreground (255) is then the ignored value: every object pixel would be left
        out of the loss and the metrics, and the MIoU would be the background's alone, near 100%."""
        seen = np.unique(np.concatenate(train.classes_present)) if train.classes_present else np.array([], int)
        labelled = [int(v) for v in seen if v != self.ignore_index]
        if len(labelled) >= 2:
            return
        foreground = (
            f"; {self.ignore_index} marks pixels to ignore, so if it is your foreground (a 0/{self.ignore_index} "
            "binary mask), remap it to 1 in the masks"
            if self.ignore_index in seen
            else ""
        )
        part = " (the part --data.label_fraction and --data.val_fraction keep)" if kept else ""
        raise DataError(
            f"the training masks under {self.root}{part} hold {len(labelled)} class(es) besides {self.ignore_index} "
            f"= ignore ({', '.join(map(str, labelled)) or 'none'}): segmentation needs at least 2{foreground}"
        )

    # -- loaders --------------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        """Shuffled in an order fixed by ``(seed, epoch)``; drops the last incomplete batch (2+ batches)."""
        self.setup()
        assert self.train_dataset is not None
        return seeded_train_loader(self.train_dataset, self.batch_size, self.seed, **self._loader_options())

    def _eval_loader(self, dataset: SegmentationDataset) -> DataLoader:  # type: ignore[override]
        """In list order, each image once (every W-th under ``torch.distributed``); in ``eval_mode="whole"`` each
        batch holds images of one size (:func:`same_size_eval_loader`: padded to a batch-mate's size, an image's
        prediction would depend on its batch), else centre crops padded to ``image_size``."""
        collate = partial(pad_collate, ignore_index=self.ignore_index)
        if self.eval_mode == "whole":
            return same_size_eval_loader(
                dataset, dataset.images, self.eval_batch_size, collate, **self._loader_options()
            )
        return DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            sampler=eval_sampler(dataset),
            collate_fn=collate,
            **self._loader_options(),
        )


def _ignore_index_problem(ignore_index: int, num_classes: int | None) -> str | None:
    """``ignore_index`` must be a mask value (at most 255) that no class uses."""
    if 0 <= ignore_index <= 255 and (num_classes is None or ignore_index >= num_classes):
        return None
    return f"ignore_index must be in [num_classes, 255], got {ignore_index}"
