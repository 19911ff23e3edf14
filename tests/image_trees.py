"""Tiny generated ImageFolder trees for tests (tests never read ../shared)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def make_image_tree(
    root: Path,
    classes: tuple[str, ...] = ("cat", "dog", "eel"),
    per_class: int = 12,
    val_per_class: int = 4,
    size: int = 32,
    seed: int = 0,
    palette: np.ndarray | None = None,
    noise: float = 25,
) -> Path:
    """``root/{train,val}/<class>/*.png``: each class a distinct colour (random, or ``palette``'s row: RGB levels
    0-255) + Gaussian noise of ``noise`` levels, so a small CNN can learn it."""
    rng = np.random.default_rng(seed)
    if palette is None:
        palette = rng.integers(40, 215, size=(len(classes), 3))
    for split, n in (("train", per_class), ("val", val_per_class)):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = palette[c] + rng.normal(0, noise, size=(size, size, 3))
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{name}_{i}.png")
    return root


def make_image_folder(root: Path, n: int = 12, size: int = 32, seed: int = 0) -> Path:
    """``root/{a,b}/<i>.png``: ``n`` random-noise RGB images (unlabelled data for pre-training)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root
