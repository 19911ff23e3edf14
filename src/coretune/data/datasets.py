"""Map-style datasets: labelled images (ImageFolder trees, on-disk CIFAR) and unlabelled image files."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.datasets import CIFAR10, CIFAR100

from .errors import DataError
from .images import (
    IMAGE_EXTENSIONS,
    decode_images,
    find_bad_images,
    list_image_files,
    load_rgb,
    require_folder,
    warn_skipped,
)
from .transforms import eval_draft_size, eval_transform

__all__ = ["ImageFileDataset", "LabeledImageDataset", "check_cifar_root", "load_cifar"]

Transform = Callable[[Image.Image], Any]
OnBadImage = Literal["error", "skip"]

_CIFAR_FILES = {
    "cifar10": (CIFAR10, "cifar-10-batches-py", "data_batch_1 … data_batch_5, test_batch, batches.meta",
                "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"),
    "cifar100": (CIFAR100, "cifar-100-python", "train, test, meta",
                 "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"),
}  # fmt: skip


class LabeledImageDataset(Dataset[tuple[Tensor, int]]):
    """Images with integer labels, decoded and transformed on access: ``ds[i] -> (transform(image), label)``.

    Args:
        images: image file paths, an ``(N, H, W, 3)`` uint8 array (CIFAR's in-memory pixels), or a list of
            ``(H, W, 3)`` uint8 arrays of different sizes (decoded files, :meth:`decoded`).
        targets: the class index of each image.
        classes: class names; index ``k`` names label ``k``.
        transform: applied to the RGB PIL image (none: the PIL image itself is returned).
        draft_size: JPEG draft size passed to :func:`~coretune.data.images.load_rgb` (file paths only).
    """

    def __init__(
        self,
        images: Sequence[str] | Sequence[np.ndarray] | np.ndarray,
        targets: Sequence[int],
        classes: Sequence[str],
        transform: Transform | None = None,
        draft_size: int | None = None,
    ) -> None:
        if len(images) != len(targets):
            raise ValueError(f"{len(images)} images but {len(targets)} targets")
        self.images = images
        self.targets = [int(t) for t in targets]
        self.classes = list(classes)
        self.transform = transform
        self.draft_size = draft_size
        self.skipped: list[tuple[str, str]] = []  # unreadable files left out by from_folder(on_bad_image="skip")

    @classmethod
    def from_folder(cls, folder: str, *, on_bad_image: OnBadImage = "error") -> LabeledImageDataset:
        """Scan an ImageFolder tree ``folder/<class>/**/<image>``; classes are the sorted sub-folder names.

        With ``on_bad_image="skip"`` every file is decoded once (:func:`~.images.find_bad_images`) and the
        unreadable ones are left out, listed in ``.skipped`` as ``(path, reason)`` (the caller warns). Hidden
        files and folders are ignored.

        Raises:
            DataError: the folder is missing, has no class sub-folders, no image at all, or an empty class.
        """
        require_folder(folder, "image folder")
        classes = sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise DataError(
                f"{folder} has no class sub-folders: expected the ImageFolder layout "
                f"{folder}/<class name>/<image files>"
            )
        paths: list[str] = []
        targets: list[int] = []
        for k, name in enumerate(classes):
            files = list_image_files(os.path.join(folder, name))
            paths += files
            targets += [k] * len(files)
        skipped = find_bad_images(paths) if on_bad_image == "skip" and paths else []
        if skipped:
            bad = {p for p, _ in skipped}
            keep = [i for i, p in enumerate(paths) if p not in bad]
            paths, targets = [paths[i] for i in keep], [targets[i] for i in keep]
        exts = ", ".join(IMAGE_EXTENSIONS)
        readable = f"readable (skipped {len(skipped)} unreadable, e.g. {skipped[0][0]}) " if skipped else ""
        if not paths:
            raise DataError(
                f"{folder} contains no {readable}image files ({exts}) in its class folders "
                f"{_preview(classes)}: put the images in {folder}/<class name>/"
            )
        counts = np.bincount(targets, minlength=len(classes))
        empty = [c for c, n in zip(classes, counts, strict=True) if n == 0]
        if empty:
            raise DataError(
                f"class folder(s) {_preview(empty)} in {folder} contain no {readable}image files ({exts}): "
                "add images or remove the folder(s)"
            )
        ds = cls(paths, targets, classes)
        ds.skipped = skipped
        return ds

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        item = self.images[index]
        if isinstance(item, (str, os.PathLike)):
            img = load_rgb(item, self.draft_size)
        else:
            img = Image.fromarray(np.asarray(item, dtype=np.uint8))
        return (self.transform(img) if self.transform else img), self.targets[index]

    def subset(self, indices: Sequence[int]) -> LabeledImageDataset:
        """A dataset of the items at ``indices`` (same classes, transform and draft size)."""
        if isinstance(self.images, np.ndarray):
            images: Sequence[str] | Sequence[np.ndarray] | np.ndarray = self.images[np.asarray(indices, dtype=np.int64)]
        else:
            images = [self.images[i] for i in indices]
        return LabeledImageDataset(
            images, [self.targets[i] for i in indices], self.classes, self.transform, self.draft_size
        )

    def with_transform(self, transform: Transform | None, draft_size: int | None = None) -> LabeledImageDataset:
        """The same items with another transform (shares the image list; no copy)."""
        return LabeledImageDataset(self.images, self.targets, self.classes, transform, draft_size)

    def decoded(self, num_threads: int | None = None) -> LabeledImageDataset:
        """The same items with every image file decoded once, into memory (8-bit RGB at this dataset's draft size,
        the pixels an access would decode): epochs then read no file and skip JPEG/PNG decoding, a large part of a
        CPU training step for small images. Costs N·H·W·3 bytes (CIFAR-10's 60,000 images of 32 px: 184 MB).
        ``num_threads`` decoders (default: CPU count, at most 8) run in parallel, PIL releasing the GIL. In-memory
        datasets are returned as they are.

        Raises:
            ImageDecodeError: a file cannot be decoded (named, with the fix).
        """
        paths = self.paths
        if paths is None:
            return self
        arrays = decode_images(paths, self.draft_size, num_threads)
        same_size = len({a.shape for a in arrays}) == 1
        images = np.stack(arrays) if arrays and same_size else arrays
        return LabeledImageDataset(images, self.targets, self.classes, self.transform, self.draft_size)

    def class_counts(self) -> dict[str, int]:
        """Number of images of each class, in class-index order (for logging and class-imbalance handling)."""
        counts = np.bincount(self.targets, minlength=len(self.classes))
        return dict(zip(self.classes, counts.tolist(), strict=True))

    @property
    def paths(self) -> list[str] | None:
        """The image file paths, or None for in-memory images."""
        if isinstance(self.images, np.ndarray) or any(isinstance(item, np.ndarray) for item in self.images[:1]):
            return None
        return list(self.images)


def load_cifar(root: str, name: Literal["cifar10", "cifar100"], train: bool) -> LabeledImageDataset:
    """CIFAR-10/100 from torchvision's on-disk ``python`` version under ``root``; never downloads.

    Raises:
        DataError: the files are missing or fail torchvision's checksum, saying where to put them.
    """
    try:
        ds = _CIFAR_FILES[name][0](root, train=train, download=False)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted. You can use download=True …"
        raise _cifar_missing(root, name, "not found or corrupted") from exc
    return LabeledImageDataset(ds.data, ds.targets, ds.classes)


def check_cifar_root(root: str, name: Literal["cifar10", "cifar100"]) -> None:
    """Raise :class:`DataError` unless ``root`` holds CIFAR's extracted folder; reads no file (a cheap check before a
    sweep; :func:`load_cifar` verifies the checksums)."""
    if not os.path.isdir(os.path.join(root, _CIFAR_FILES[name][1])):
        raise _cifar_missing(root, name, "not found")


def _cifar_missing(root: str, name: Literal["cifar10", "cifar100"], problem: str) -> DataError:
    _, subdir, files, url = _CIFAR_FILES[name]
    return DataError(
        f"{name} data {problem} under {root}: expected {os.path.join(root, subdir)}/ "
        f"holding {files} — extract {url} into {root} (coretune never downloads), or point --data.root "
        "at the folder that contains it"
    )


class ImageFileDataset(Dataset[tuple[Any, int]]):
    """Every image file under ``folder`` (recursively, sorted, no labels), or the one image file ``folder`` names:
    ``ds[i] -> (transform(image), i)``.

    ``ds.paths[i]`` is the file of item ``i``, so predictions can be written next to their file names.

    Args:
        folder: the folder to list, or one image file.
        transform: applied to the RGB PIL image; default: the evaluation transform at 224 px, ImageNet
            mean/std.
        draft_size: JPEG draft size (see :func:`~coretune.data.images.load_rgb`); with the default transform,
            default: the one matching it.
        on_bad_image: ``"error"`` raises on the first unreadable file; ``"skip"`` decodes every file now,
            leaves the unreadable ones out and warns once.
        orient: turn each image as its EXIF orientation says (``False``: the stored pixels, as segmentation
            models are trained and their masks written).

    Raises:
        DataError: the folder is missing or holds no image file.
    """

    def __init__(
        self,
        folder: str,
        transform: Transform | None = None,
        *,
        draft_size: int | None = None,
        on_bad_image: OnBadImage = "error",
        orient: bool = True,
    ) -> None:
        if os.path.isfile(folder) and folder.lower().endswith(IMAGE_EXTENSIONS):
            paths = [folder]
        else:
            require_folder(folder, "image folder")
            paths = list_image_files(folder)
        self.skipped = find_bad_images(paths) if on_bad_image == "skip" and paths else []
        if self.skipped:
            warn_skipped(self.skipped, len(paths))
            bad = {p for p, _ in self.skipped}
            paths = [p for p in paths if p not in bad]
        if not paths:
            raise DataError(
                f"{folder} contains no {'readable ' if self.skipped else ''}image files "
                f"({', '.join(IMAGE_EXTENSIONS)}): point it at a folder of images"
            )
        self.paths = paths
        if transform is None:
            transform, draft_size = eval_transform(224), draft_size or eval_draft_size(224)
        self.transform = transform
        self.draft_size = draft_size
        self.orient = orient

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.transform(load_rgb(self.paths[index], self.draft_size, self.orient)), index


def _preview(names: Sequence[str], show: int = 10) -> str:
    """``['a', 'b', …] (+N more)`` for messages."""
    head = ", ".join(repr(n) for n in names[:show])
    return f"[{head}{f', … (+{len(names) - show} more)' if len(names) > show else ''}]"
