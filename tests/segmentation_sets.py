"""A tiny generated PASCAL VOC-layout segmentation set for tests (tests never read ../shared): coloured shapes on
textured backgrounds, so a small model can learn it, with VOC's ignored object borders."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

SHAPE_COLOURS = np.array([(200, 60, 50), (50, 170, 60), (60, 80, 210), (210, 190, 40), (150, 60, 190)])


def shape_scene(
    rng: np.random.Generator, height: int, width: int, num_classes: int, border: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``(image (H, W, 3) uint8, mask (H, W) uint8)``: class 0 is a noisy striped background; 1–2 shapes of
    classes ``1 … K-1`` (class ``k`` is a rectangle, disc or triangle by ``k % 3``, in its own colour) lie on it;
    with ``border`` the one-pixel rim of each shape is 255 (ignored), as in VOC's masks."""
    yy, xx = np.mgrid[0:height, 0:width]
    mask = np.zeros((height, width), dtype=np.uint8)
    grey = 90 + 30 * np.sin(xx / rng.uniform(2, 5) + yy / rng.uniform(2, 5))
    image = np.repeat(grey[..., None], 3, axis=2) + rng.normal(0, 12, (height, width, 3))
    for cls in rng.choice(np.arange(1, num_classes), size=min(2, num_classes - 1), replace=False):
        cy, cx = rng.integers(height // 5, height - height // 5), rng.integers(width // 5, width - width // 5)
        r = rng.integers(min(height, width) // 6, min(height, width) // 3)
        kind = cls % 3
        if kind == 1:
            inside = (abs(yy - cy) <= r) & (abs(xx - cx) <= r * 1.3)
        elif kind == 2:
            inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        else:
            inside = (yy >= cy - r) & (yy <= cy + r) & (abs(xx - cx) <= (yy - cy + r) / 2)
        mask[inside] = cls
        image[inside] = SHAPE_COLOURS[(cls - 1) % len(SHAPE_COLOURS)] + rng.normal(0, 12, (int(inside.sum()), 3))
    if border:
        rim = np.zeros_like(mask, dtype=bool)
        rim[1:] |= mask[1:] != mask[:-1]
        rim[:, 1:] |= mask[:, 1:] != mask[:, :-1]
        mask[rim] = 255
    return image.clip(0, 255).astype(np.uint8), mask


def save_mask(mask: np.ndarray, path: Path, palette: bool) -> None:
    """A mask as a palette PNG (colour ``(255 - k, k, 7k mod 256)`` for index ``k``, so reading colours instead
    of indices would show) or a grey ("L") PNG."""
    img = Image.fromarray(mask, mode="P" if palette else "L")
    if palette:
        k = np.arange(256)
        img.putpalette(np.stack([255 - k, k, 7 * k % 256], axis=1).astype(np.uint8).reshape(-1).tolist())
    img.save(path)


def make_voc_set(
    root: Path,
    splits: dict[str, int] | None = None,
    size: tuple[int, int] = (40, 56),
    num_classes: int = 4,
    seed: int = 0,
    palette: bool = True,
    class_names: Sequence[str] | None = None,
    border: bool = True,
    image_ext: str = ".jpg",
) -> Path:
    """``root/{JPEGImages/<id>.jpg, SegmentationClass/<id>.png, ImageSets/Segmentation/<split>.txt}`` with
    ``splits`` images per split (default 8 train, 4 val) of ``size`` (H, W); ``class_names`` writes
    ``root/classes.txt``; ``image_ext=".png"`` writes the images as CamVid's unpacked set has them. Returns
    ``root``."""
    rng = np.random.default_rng(seed)
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for split, n in (splits or {"train": 8, "val": 4}).items():
        ids = [f"{split}_{i:03d}" for i in range(n)]
        for image_id in ids:
            image, mask = shape_scene(rng, *size, num_classes, border)
            Image.fromarray(image).save(root / "JPEGImages" / f"{image_id}{image_ext}", quality=95)
            save_mask(mask, root / "SegmentationClass" / f"{image_id}.png", palette)
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    if class_names is not None:
        (root / "classes.txt").write_text("\n".join(class_names) + "\n")
    return root
