"""The PASCAL VOC segmentation layout on disk: its folders, list files, image and mask paths, masks and class-name
files (what :class:`~coretune.data.SegmentationDataset` reads).

The layout (VOC 2012, and what ``unpack.py camvid`` writes)::

    ROOT/JPEGImages/<id>.jpg                 # any image extension; .jpg first (CamVid's are .png)
    ROOT/SegmentationClass/<id>.png          # one class index per pixel: grey ("L") or palette ("P") PNG
    ROOT/ImageSets/Segmentation/train.txt    # one <id> per line; val.txt and/or test.txt beside it
    ROOT/classes.txt or ROOT/labelmap.txt    # optional class names (see :func:`read_class_names`)

A palette PNG is read as its indices (VOC's masks are palette PNGs whose colours are only for viewing); the
value ``IGNORE_INDEX`` (255: VOC's object borders, CamVid's void) is left out of the loss and the metrics.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
from PIL import Image

from .datasets import OnBadImage
from .errors import DataError
from .images import IMAGE_EXTENSIONS, require_folder

__all__ = [
    "CLASS_NAME_FILES",
    "IGNORE_INDEX",
    "IMAGES",
    "LISTS",
    "MASKS",
    "evaluation_lists",
    "image_path",
    "list_path",
    "mask_classes",
    "mask_path",
    "read_class_names",
    "read_ids",
    "read_mask",
    "require_layout",
]

IGNORE_INDEX = 255
"""Mask value left out of the loss and the metrics (VOC's object borders, CamVid's void)."""

CLASS_NAME_FILES = ("classes.txt", "labelmap.txt")
"""Class-name files looked for in the data root, in this order (see :func:`read_class_names`)."""

IMAGES, MASKS, LISTS = "JPEGImages", "SegmentationClass", os.path.join("ImageSets", "Segmentation")
"""The layout's folders under the data root: images, masks and list files."""
_MASK_MODES = frozenset({"L", "P", "1", "I", "I;16", "I;16L", "I;16B", "I;16N"})


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


def require_layout(root: str) -> None:
    """Raise :class:`DataError` unless ``root`` holds the three folders of the VOC layout."""
    require_folder(root, "data root")
    for sub in (IMAGES, MASKS, LISTS):
        if not os.path.isdir(os.path.join(root, sub)):
            raise DataError(
                f"data root {root} has no {sub}/ folder: expected the PASCAL VOC layout {IMAGES}/<id>.jpg, "
                f"{MASKS}/<id>.png and {LISTS}/{{train,val}}.txt"
            )


def read_ids(list_file: str) -> list[str]:
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


def image_path(root: str, image_id: str, list_file: str) -> str:
    """``root/JPEGImages/<id>.<ext>``, ``.jpg`` first, then any image extension."""
    stem = os.path.join(root, IMAGES, image_id)
    for ext in (".jpg", *IMAGE_EXTENSIONS):
        if os.path.isfile(stem + ext):
            return stem + ext
    raise DataError(
        f"list file {list_file} names image {image_id!r}, but {stem}.jpg (or another image extension) does not "
        "exist: add the image or remove the line"
    )


def mask_path(root: str, image_id: str, image: str) -> str:
    path = os.path.join(root, MASKS, image_id + ".png")
    if not os.path.isfile(path):
        raise DataError(f"image {image} has no mask: expected {path} (remove the image's id from the list file)")
    return path


def mask_classes(image: str, mask: str, on_bad_image: OnBadImage) -> np.ndarray | str:
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


def list_path(root: str, split: str, named: str | None = None) -> str:
    """``root/ImageSets/Segmentation/<split>.txt``, which must exist: :class:`DataError` otherwise (the message calls
    its images the ``named`` ones, by default the ``split`` ones)."""
    path = os.path.join(root, LISTS, f"{split}.txt")
    if not os.path.isfile(path):
        raise DataError(f"list file {path} does not exist: write the {named or split} image ids there, one a line")
    return path


def evaluation_lists(root: str) -> list[str]:
    """The evaluation splits ``root`` lists (``"val"`` and/or ``"test"``), reading no image, after checking the
    layout and ``train.txt``: :class:`DataError` names what is missing."""
    require_layout(root)
    list_path(root, "train", "training")
    lists = os.path.join(root, LISTS)
    present = [s for s in ("val", "test") if os.path.isfile(os.path.join(lists, f"{s}.txt"))]
    if not present:
        raise DataError(f"{lists} has neither val.txt nor test.txt: list the evaluation image ids in one")
    return present
