"""Semantic-segmentation data in the PASCAL VOC layout, and joint image + mask transforms (torchvision v2).

The layout (VOC 2012, and what ``unpack.py camvid`` writes)::

    ROOT/JPEGImages/<id>.jpg                 # any image extension; .jpg first (CamVid's are .png)
    ROOT/SegmentationClass/<id>.png          # one class index per pixel: grey ("L") or palette ("P") PNG
    ROOT/ImageSets/Segmentation/train.txt    # one <id> per line; val.txt and/or test.txt beside it
    ROOT/classes.txt or ROOT/labelmap.txt    # optional class names (see :func:`read_class_names`)

A palette PNG is read as its indices (VOC's masks are palette PNGs whose colours are only for viewing); the
value ``ignore_index`` (255: VOC's object borders, CamVid's void) is left out of the loss and the metrics.

Batches are ``(images (B, 3, H, W) float, masks (B, H, W) int64)``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar, Literal, get_args

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from .datasets import OnBadImage
from .errors import DataError
from .images import IMAGE_EXTENSIONS, find_bad_images, load_rgb, require_folder, warn_skipped
from .mask_classes import inferred_class_count
from .samplers import eval_sampler, same_size_eval_loader, seeded_train_loader
from .splits import stratified_split, stratified_subset
from .transforms import IMAGENET_MEAN, IMAGENET_STD, normalisation_problems

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

IGNORE_INDEX = 255
"""Mask value left out of the loss and the metrics (VOC's object borders, CamVid's void)."""

CLASS_NAME_FILES = ("classes.txt", "labelmap.txt")
"""Class-name files looked for in the data root, in this order (see :func:`read_class_names`)."""

EvalMode = Literal["center_crop", "whole"]
Split = Literal["train", "val", "test"]

_IMAGES, _MASKS, _LISTS = "JPEGImages", "SegmentationClass", os.path.join("ImageSets", "Segmentation")
_MASK_MODES = frozenset({"L", "P", "1", "I", "I;16", "I;16L", "I;16B", "I;16N"})


# ------------------------------------------------------------------------------------------------------------
# joint transforms
# ------------------------------------------------------------------------------------------------------------
class RandomScale(v2.Transform):
    """Resize the image and its mask by one factor drawn uniformly from ``scale_range`` (DeepLab's random scale).

    torchvision's ``RandomResize`` and ``ScaleJitter`` draw a target *size* shared by all images (or relative to
    a fixed target), not a factor of each image's own size, hence this small v2 transform. Images are resized
    bilinearly (antialiased), masks by ``NEAREST_EXACT``: nearest neighbour with pixel-centre alignment, the
    same geometry as the bilinear resize (plain ``NEAREST`` is shifted by up to half a source pixel).
    """

    def __init__(self, scale_range: tuple[float, float] = (0.5, 2.0)) -> None:
        super().__init__()
        if not 0 < scale_range[0] <= scale_range[1]:
            raise ValueError(f"scale_range must be (low, high) with 0 < low <= high, got {scale_range}")
        self.scale_range = (float(scale_range[0]), float(scale_range[1]))

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        height, width = v2.query_size(flat_inputs)
        scale = float(torch.empty(()).uniform_(*self.scale_range))
        return {"size": [max(1, round(height * scale)), max(1, round(width * scale))]}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        nearest = isinstance(inpt, tv_tensors.Mask)
        mode = v2.InterpolationMode.NEAREST_EXACT if nearest else v2.InterpolationMode.BILINEAR
        return self._call_kernel(F.resize, inpt, params["size"], interpolation=mode, antialias=not nearest)


class CenterCropPad(v2.RandomCrop):
    """The central ``size`` crop, padding first where the image is smaller, with a fill per input type (like
    ``RandomCrop``'s ``fill={tv_tensors.Image: …, tv_tensors.Mask: 255}``); ``v2.CenterCrop`` pads every
    input with 0, which would label a mask's padding as class 0."""

    def __init__(self, size: int | Sequence[int], fill: dict[type | str, Any]) -> None:
        super().__init__(size, pad_if_needed=True, fill=fill)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        params = super().make_params(flat_inputs)
        height, width = v2.query_size(flat_inputs)
        left, top, right, bottom = params["padding"]
        padded_h, padded_w = height + top + bottom, width + left + right
        params["top"], params["left"] = (padded_h - self.size[0]) // 2, (padded_w - self.size[1]) // 2
        params["needs_crop"] = (padded_h, padded_w) != tuple(self.size)
        return params


def _fill(mean: Sequence[float], ignore_index: int) -> dict[type | str, Any]:
    """Padding values: the mean colour for images (0 after normalisation), ``ignore_index`` for masks."""
    return {tv_tensors.Image: tuple(round(255 * m) for m in mean), tv_tensors.Mask: ignore_index, "others": 0}


def _to_tensors(mean: Sequence[float], std: Sequence[float]) -> list[v2.Transform]:
    return [
        v2.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64, "others": None}, scale=True),
        v2.Normalize(list(mean), list(std)),
    ]


def segmentation_train_transform(
    crop_size: int,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    ignore_index: int = IGNORE_INDEX,
    scale_range: tuple[float, float] = (0.5, 2.0),
    hflip: bool = True,
) -> v2.Compose:
    """``(PIL image, Mask (H, W))`` → ``(float (3, crop, crop), int64 (crop, crop))``, DeepLab's training pipeline.

    Random scale by a factor in ``scale_range`` (:class:`RandomScale`), a random ``crop_size`` crop padded
    where the scaled image is smaller (image with the mean colour, mask with ``ignore_index``), a horizontal flip
    if ``hflip``, then the image scaled to [0, 1] and normalised.
    """
    steps: list[v2.Transform] = [
        v2.ToImage(),
        RandomScale(scale_range),
        v2.RandomCrop(crop_size, pad_if_needed=True, fill=_fill(mean, ignore_index)),
    ]
    if hflip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps + _to_tensors(mean, std))


def segmentation_eval_transform(
    crop_size: int,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    ignore_index: int = IGNORE_INDEX,
    mode: EvalMode = "center_crop",
) -> v2.Compose:
    """``(PIL image, Mask)`` → normalised ``(image, int64 mask)`` for evaluation.

    ``"center_crop"`` (the paper): the central ``crop_size`` crop, padded where the image is smaller (mask with
    ``ignore_index``); at VOC's 513 px every image (≤ 500 px) is whole, padded. ``"whole"``: the image at its
    own size (an evaluation loader batches images of one size together, :func:`same_size_eval_loader`).
    """
    steps: list[v2.Transform] = [v2.ToImage()]
    if mode == "center_crop":
        steps.append(CenterCropPad(crop_size, _fill(mean, ignore_index)))
    return v2.Compose(steps + _to_tensors(mean, std))


def pad_collate(batch: Sequence[tuple[Tensor, Tensor]], ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Stack ``(image, mask)`` pairs of different sizes: pad each at the bottom and right to the batch's largest
    height and width (images with 0 = the mean colour after normalisation, masks with ``ignore_index``)."""
    height = max(image.shape[-2] for image, _ in batch)
    width = max(image.shape[-1] for image, _ in batch)
    padded = []
    for image, mask in batch:
        padding = [0, 0, width - image.shape[-1], height - image.shape[-2]]
        padded.append((F.pad_image(image, padding, fill=0), F.pad_mask(mask, padding, fill=ignore_index)))
    return default_collate(padded)


# ------------------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------------------
def read_mask(path: str) -> np.ndarray:
    """The class indices of mask file ``path`` as an ``(H, W)`` array (uint8, or int64 for 16-bit masks).

    Grey (``L``), palette (``P``: the indices, not the colours), 1-bit and 16-bit integer images are accepted.

    Raises:
        DataError: the file cannot be decoded, or is a colour image (RGB masks need converting to indices).
    """
    try:
        with Image.open(path) as img:
            img.load()
            mode = img.mode
            pixels = np.array(img)  # a writable copy (torch.from_numpy warns on read-only arrays)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError … depending on the codec
        raise DataError(f"cannot decode mask {path}: {exc}; fix or remove it (and its line in the list files)") from exc
    if mode not in _MASK_MODES:
        raise DataError(
            f"mask {path} is a {mode} image: masks hold one class index per pixel (grey 'L' or palette 'P' PNG); "
            "convert colour masks to class indices"
        )
    if pixels.dtype == np.uint8:
        return pixels
    return pixels.astype(np.uint8 if pixels.dtype == bool else np.int64)


def read_class_names(root: str) -> list[str] | None:
    """Class names from ``root/classes.txt`` (one name per line, as ``unpack.py camvid`` writes) or, failing that,
    ``root/labelmap.txt`` (CVAT's VOC export: ``name:r,g,b:parts:actions`` lines, ``#`` comments); None if neither.

    Line ``k`` names class ``k``; blank lines are skipped.
    """
    for name in CLASS_NAME_FILES:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        return [line.split(":", 1)[0].strip() for line in lines] if name == "labelmap.txt" else lines
    return None


def _require_layout(root: str) -> None:
    """Raise :class:`DataError` unless ``root`` holds the three folders of the VOC layout."""
    require_folder(root, "data root")
    for sub in (_IMAGES, _MASKS, _LISTS):
        if not os.path.isdir(os.path.join(root, sub)):
            raise DataError(
                f"data root {root} has no {sub}/ folder: expected the PASCAL VOC layout {_IMAGES}/<id>.jpg, "
                f"{_MASKS}/<id>.png and {_LISTS}/{{train,val}}.txt"
            )


def _read_ids(list_file: str) -> list[str]:
    """The image ids of ``list_file``, one a line; :class:`DataError` for none, or for an id listed twice (lists
    joined naively, as VOC's and SBD's: the image would count twice an epoch and, with ``val_fraction``, could be
    trained on and validated on)."""
    with open(list_file, encoding="utf-8") as f:
        ids = [line.split()[0] for line in f if line.strip()]
    if not ids:
        raise DataError(f"list file {list_file} names no image: put one image id (file name without extension) a line")
    if repeats := len(ids) - len(set(ids)):
        first = next(i for i, n in Counter(ids).items() if n > 1)
        raise DataError(
            f"list file {list_file} names image {first!r} more than once ({repeats} repeated line(s)): "
            "list each image once (sort -u), or a repeat counts twice an epoch and may land in both the fitted and "
            "the held-out part"
        )
    return ids


def _image_path(root: str, image_id: str, list_file: str) -> str:
    """``root/JPEGImages/<id>.<ext>``, ``.jpg`` first, then any image extension."""
    stem = os.path.join(root, _IMAGES, image_id)
    for ext in (".jpg", *IMAGE_EXTENSIONS):
        if os.path.isfile(stem + ext):
            return stem + ext
    raise DataError(
        f"list file {list_file} names image {image_id!r}, but {stem}.jpg (or another image extension) does not "
        "exist: add the image or remove the line"
    )


def _mask_path(root: str, image_id: str, image: str) -> str:
    path = os.path.join(root, _MASKS, image_id + ".png")
    if not os.path.isfile(path):
        raise DataError(f"image {image} has no mask: expected {path} (remove the image's id from the list file)")
    return path


def _mask_classes(image: str, mask: str, on_bad_image: OnBadImage) -> np.ndarray | str:
    """The distinct values of ``mask`` after checking it has the size of ``image``; with ``on_bad_image="skip"``
    the reason (a string) when the mask cannot be decoded (images are checked by ``find_bad_images``)."""
    try:
        values = read_mask(mask)
    except DataError as err:
        if on_bad_image == "skip" and isinstance(err.__cause__, Exception):
            return str(err.__cause__)
        raise
    try:
        with Image.open(image) as img:  # reads the header only
            width, height = img.size
    except Exception:  # an undecodable image: load_rgb names it at its first access, find_bad_images skips it
        return np.unique(values)
    if values.shape != (height, width):
        raise DataError(
            f"mask {mask} is {values.shape[1]}×{values.shape[0]} px but its image {image} is {width}×{height}: "
            "a mask must have its image's size"
        )
    return np.unique(values)


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
        _require_layout(root)
        list_file = os.path.join(root, _LISTS, f"{split}.txt")
        if not os.path.isfile(list_file):
            raise DataError(f"list file {list_file} does not exist: write the {split} image ids there, one a line")
        ids = _read_ids(list_file)
        images = [_image_path(root, i, list_file) for i in ids]
        masks = [_mask_path(root, i, image) for i, image in zip(ids, images, strict=True)]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            found = list(pool.map(partial(_mask_classes, on_bad_image=on_bad_image), images, masks))
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
class SegmentationData(L.LightningDataModule):
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
        batch_size: Training batch size.
        eval_batch_size: Validation/test batch size (default: batch_size).
        num_workers: DataLoader worker processes (0 loads in the main process).
        label_fraction: Fraction of the training images to use, drawn with seed; in (0, 1].
        val_fraction: Fraction of the (label-fraction) training images held out, drawn with seed, as the
            validation split; the val.txt/test.txt images are then the test split only. 0 validates on val.txt.
        seed: Seed of the label-fraction subset, the validation hold-out and the training order and augmentation.
        mean: Per-channel normalisation mean (RGB, in [0, 1]) of the pre-trained model.
        std: Per-channel normalisation standard deviation (RGB) of the pre-trained model.
        num_classes: Number of classes (default: from the class-name file, else from the masks).
        ignore_index: Mask value left out of the loss and the metrics.
        scale_range: Range of the training random scale factor (DeepLab's (0.5, 2.0)).
        hflip: Random horizontal flips in training augmentation.
        eval_mode: Evaluation input: "center_crop" (the paper: the central image_size crop, padded) or "whole"
            (each image at its own size).
        on_bad_image: Unreadable image or mask files: "error" stops at the first with its path; "skip" leaves
            them out and warns once.
        pin_memory: Pin batches in page-locked memory (speeds host-to-GPU copies).
    """

    #: Options that decide what the run's scores read: the label subset and the validation split carved from it, their
    #: seed, and how an image is evaluated (``eval_mode``: whole, or its centre crop). A checkpoint keeps them;
    #: ``coretune test`` and ``validate`` default to them (``FineTuner.trained_data``).
    split_settings: ClassVar[tuple[str, ...]] = ("seed", "label_fraction", "val_fraction", "eval_mode")

    def __init__(
        self,
        root: str | None = None,
        image_size: int = 513,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
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
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        checks = [
            (image_size >= 1, f"image_size must be >= 1 pixel, got {image_size}"),
            (batch_size >= 1, f"batch_size must be >= 1, got {batch_size}"),
            (eval_batch_size is None or eval_batch_size >= 1,
             f"eval_batch_size must be >= 1 (or unset to use batch_size), got {eval_batch_size}"),
            (num_workers >= 0, f"num_workers must be >= 0, got {num_workers}"),
            (0 < label_fraction <= 1, f"label_fraction must be in (0, 1] (1 uses every image), got {label_fraction}"),
            (0 <= val_fraction < 1,
             f"val_fraction must be in [0, 1) (0 validates on val.txt or test.txt), got {val_fraction}"),
            (num_classes is None or num_classes >= 2, f"num_classes must be >= 2 (or unset), got {num_classes}"),
            (0 <= ignore_index <= 255 and (num_classes is None or ignore_index >= num_classes),
             f"ignore_index must be in [num_classes, 255], got {ignore_index}"),
            (len(scale_range) == 2 and 0 < scale_range[0] <= scale_range[1],
             f"scale_range must be (low, high) with 0 < low <= high, got {scale_range}"),
            (eval_mode in get_args(EvalMode), f"eval_mode must be 'center_crop' or 'whole', got {eval_mode!r}"),
            (on_bad_image in get_args(OnBadImage), f"on_bad_image must be 'error' or 'skip', got {on_bad_image!r}"),
        ]  # fmt: skip
        problems = [message for ok, message in checks if not ok] + normalisation_problems(mean, std)
        if problems:
            raise DataError(f"invalid data option(s): {'; '.join(problems)} — set valid values (--data.<option>)")
        self.save_hyperparameters()
        self.root = root
        self.image_size, self.batch_size, self.num_workers = image_size, batch_size, num_workers
        self.eval_batch_size = eval_batch_size or batch_size
        self.label_fraction, self.val_fraction, self.seed = label_fraction, val_fraction, seed
        self.mean, self.std = tuple(mean), tuple(std)
        self.ignore_index, self.on_bad_image, self.pin_memory = ignore_index, on_bad_image, pin_memory
        self.eval_mode = eval_mode
        self.train_transform = segmentation_train_transform(
            image_size, self.mean, self.std, ignore_index, (float(scale_range[0]), float(scale_range[1])), hflip
        )
        self.eval_transform = segmentation_eval_transform(image_size, self.mean, self.std, ignore_index, eval_mode)
        self.validates_on_test = False
        self.train_dataset: SegmentationDataset | None = None
        self.val_dataset: SegmentationDataset | None = None
        self.test_dataset: SegmentationDataset | None = None  # the val dataset itself when there is no test.txt
        self._num_classes = num_classes
        self._class_names: list[str] | None = None

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
        _require_layout(self.root)
        lists = os.path.join(self.root, _LISTS)
        train = os.path.join(lists, "train.txt")
        if not os.path.isfile(train):
            raise DataError(f"list file {train} does not exist: write the training image ids there, one a line")
        present = [s for s in ("val", "test") if os.path.isfile(os.path.join(lists, f"{s}.txt"))]
        if not present:
            raise DataError(f"{lists} has neither val.txt nor test.txt: list the evaluation image ids in one")
        return self.root, present

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

    # -- what the data is -----------------------------------------------------------------------------------
    @property
    def class_names(self) -> list[str]:
        """Class names in label order (from the class-name file, else ``"0"``, ``"1"``, …)."""
        if self._class_names is None:
            self.setup()
        assert self._class_names is not None
        return self._class_names

    @property
    def num_classes(self) -> int:
        """Number of classes (mask values ``0 … num_classes - 1``)."""
        return len(self.class_names)

    # -- loaders --------------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        """Shuffled in an order fixed by ``(seed, epoch)``; drops the last incomplete batch (2+ batches)."""
        self.setup()
        assert self.train_dataset is not None
        return seeded_train_loader(self.train_dataset, self.batch_size, self.seed, **self._loader_options())

    def val_dataloader(self) -> DataLoader:
        """The validation split in list order."""
        self.setup()
        assert self.val_dataset is not None
        return self._eval_loader(self.val_dataset)

    def test_dataloader(self) -> DataLoader:
        """The test split in list order."""
        self.setup()
        assert self.test_dataset is not None
        return self._eval_loader(self.test_dataset)

    def _eval_loader(self, dataset: SegmentationDataset) -> DataLoader:
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

    def _loader_options(self) -> dict[str, object]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.num_workers > 0,
        }
