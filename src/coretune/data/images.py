"""Reading image files of any common pixel mode as 8-bit RGB, listing them, and finding unreadable ones."""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from PIL import Image, ImageOps
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..distributed import rank
from .errors import DataError, ImageDecodeError

__all__ = [
    "IMAGE_EXTENSIONS",
    "SkippedImagesWarning",
    "decode_images",
    "find_bad_images",
    "is_image_file",
    "list_image_files",
    "load_rgb",
    "require_folder",
    "to_rgb",
    "warn_skipped",
]

#: File extensions read as images (torchvision's ImageFolder list), matched case-insensitively.
IMAGE_EXTENSIONS: tuple[str, ...] = IMG_EXTENSIONS

# Integer modes holding more than 8 bits per pixel: 16-bit PNG/TIFF open as "I;16*", some readers give "I".
_WIDE_INT_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


class SkippedImagesWarning(UserWarning):
    """Unreadable image files were left out (``on_bad_image="skip"``)."""


def is_image_file(path: str) -> bool:
    """Whether ``path`` names an image by its extension; hidden files (``.x``, macOS ``._x.jpg``) are not."""
    return _is_image_name(os.path.basename(path))


def _is_image_name(name: str) -> bool:
    """:func:`is_image_file` of a file name (no folder): what a listing of a million files calls per file."""
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def list_image_files(folder: str) -> list[str]:
    """Every image file under ``folder``, recursively, sorted (a folder's files, then its sub-folders); hidden files
    and folders are ignored.

    Symbolic links are followed, each real folder once: a link to a folder that contains it (a loop, which would
    read the tree again and again, labelled by the class holding the link) is a :class:`DataError` naming it, and
    a second link to a folder already listed is not read again. Entries that are not regular files (named pipes,
    sockets, devices: opening a pipe blocks until something writes to it) are left out; a broken link is kept,
    so reading it names the problem.

    Raises:
        DataError: a symbolic link loop.
    """
    found: list[str] = []
    listed: set[str] = set()

    def walk(path: str, inside: tuple[str, ...]) -> None:
        # one listing (os.scandir: the file types come with the names, no stat per file), one pass over it
        with os.scandir(path) as listing:
            entries = sorted((e for e in listing if not e.name.startswith(".")), key=_NAME)
        folders = []
        for entry in entries:
            if _is_image_name(entry.name) and _regular_or_broken(entry):
                found.append(entry.path)
            elif entry.is_dir():
                folders.append(entry)
        for entry in folders:
            real = os.path.realpath(entry.path)
            if any(os.path.commonpath([real, folder]) == real for folder in inside):
                raise DataError(
                    f"symbolic link loop: {entry.path} points to {real}, which contains it, so its images would be "
                    "read again and again: remove the link, or point it at a folder that does not contain it"
                )
            if real not in listed:
                listed.add(real)
                walk(entry.path, (*inside, real))

    walk(folder, (os.path.realpath(folder),))
    return found


_NAME = operator.attrgetter("name")


def _regular_or_broken(entry: os.DirEntry[str]) -> bool:
    """A regular file (through links), or a broken link (kept: reading it then says the file is missing)."""
    return entry.is_file() or (entry.is_symlink() and not os.path.exists(entry.path))


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert a decoded image of any mode to 8-bit RGB.

    16-bit (and 32-bit integer) grey levels are scaled by 255/65535 rather than clipped (PIL's ``convert``
    would turn every value above 255 white); float images (mode ``F``) are taken to lie in [0, 1]. Alpha is
    dropped, as torchvision's ImageFolder loader does, so pixels match the pipelines models were trained with.
    """
    if img.mode in _WIDE_INT_MODES:
        grey = np.clip(np.asarray(img, dtype=np.float64), 0, 65535) / 257.0
        img = Image.fromarray(np.rint(grey).astype(np.uint8))
    elif img.mode == "F":
        grey = np.clip(np.asarray(img, dtype=np.float64), 0.0, 1.0) * 255.0
        img = Image.fromarray(np.rint(grey).astype(np.uint8))
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # the palette's transparency entry needs RGBA first (avoids PIL's warning)
    return img.convert("RGB")


_ORIENTATION = 0x0112  # the EXIF tag of how a camera's image is to be turned for display


def load_rgb(path: str, draft_size: int | None = None, orient: bool = True) -> Image.Image:
    """Decode the image file ``path`` fully and return it as 8-bit RGB (see :func:`to_rgb`), turned as its EXIF
    orientation says (a phone photo stored sideways comes out as its owner saw and labelled it); ``orient=False``
    keeps the stored pixels (a segmentation image, whose mask has the stored size).

    ``draft_size`` lets libjpeg decode a JPEG at 1/2, 1/4 or 1/8 scale, choosing the smallest scale whose
    width and height both stay >= ``draft_size`` (PIL draft mode): large photos decode several times faster,
    and a caller that picks ``draft_size`` no smaller than what its transform needs gets the same pixels, up
    to resampling. Other formats ignore it.

    Raises:
        ImageDecodeError: the file is missing, not an image, truncated or otherwise undecodable.
    """
    try:
        with Image.open(path) as img:
            if draft_size is not None and img.format == "JPEG":
                img.draft(None, (draft_size, draft_size))
            img.load()
            tagged = img.format == "TIFF" or "exif" in img.info  # parse no EXIF block where there is none
            if orient and tagged and img.getexif().get(_ORIENTATION, 1) != 1:  # a photo stored sideways, shown upright
                return to_rgb(ImageOps.exif_transpose(img))
            return to_rgb(img)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError … depending on the codec
        raise ImageDecodeError(
            f"cannot decode image {path}: {exc}; fix or remove it, or pass --data.on_bad_image skip", path
        ) from exc


def _decode_problem(path: str) -> str | None:
    try:
        load_rgb(path, draft_size=1)
    except ImageDecodeError as err:
        return str(err.__cause__)
    return None


def find_bad_images(paths: Sequence[str], num_threads: int | None = None) -> list[tuple[str, str]]:
    """The files among ``paths`` that cannot be decoded, as ``(path, reason)`` pairs in input order.

    Every file is fully decoded through :func:`load_rgb` — ``Image.verify()`` is cheaper but checks only PNG
    checksums and passes truncated JPEGs, which then fail mid-epoch. JPEGs are decoded at 1/8 scale (draft
    mode), which still reads every byte, so a scan costs roughly a tenth of an epoch's decoding; PIL releases
    the GIL while decoding, so ``num_threads`` threads (default: CPU count, at most 8) run in parallel.
    """
    problems = _map_threads(_decode_problem, paths, num_threads)
    return [(p, why) for p, why in zip(paths, problems, strict=True) if why is not None]


def decode_images(
    paths: Sequence[str], draft_size: int | None = None, num_threads: int | None = None
) -> list[np.ndarray]:
    """Every file of ``paths`` decoded through :func:`load_rgb` into an ``(H, W, 3)`` uint8 array, in input order,
    on ``num_threads`` threads (default: CPU count, at most 8; PIL releases the GIL while decoding).

    Raises:
        ImageDecodeError: a file cannot be decoded (named, with the fix).
    """
    return _map_threads(lambda path: np.asarray(load_rgb(path, draft_size)), paths, num_threads)


def _map_threads(fn: Callable[[str], Any], paths: Sequence[str], num_threads: int | None) -> list[Any]:
    """``[fn(p) for p in paths]`` on ``num_threads`` threads (default: CPU count, at most 8)."""
    threads = num_threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(fn, paths))


def warn_skipped(bad: Iterable[tuple[str, str]], total: int, show: int = 5) -> None:
    """Issue ONE :class:`SkippedImagesWarning` with the number of skipped files and the first ``show`` (on the
    process of rank 0 only: under ``torch.distributed`` every process reads the same files)."""
    bad = list(bad)
    if not bad or rank() != 0:
        return
    listed = "; ".join(f"{path} ({why})" for path, why in bad[:show])
    more = f"; … and {len(bad) - show} more" if len(bad) > show else ""
    warnings.warn(
        f"skipped {len(bad)} unreadable image file(s) of {total} (on_bad_image='skip'): {listed}{more}",
        SkippedImagesWarning,
        stacklevel=3,
    )


def require_folder(folder: str, what: str) -> None:
    """Raise :class:`DataError` unless ``folder`` is an existing directory (``what`` names it)."""
    if not os.path.isdir(folder):
        kind = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise DataError(f"{what} {folder} {kind}: pass an existing folder")
