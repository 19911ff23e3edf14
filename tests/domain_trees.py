"""Tiny generated multi-domain trees in DomainBed's layout for tests (tests never read ../shared): the same shapes
(the classes) drawn in a different colour and texture style per domain, as PACS draws the same objects as photos,
art, cartoons and sketches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

SHAPES = ("disc", "square", "triangle")
STYLES = ("art", "cartoon", "photo", "sketch")


def _shape_mask(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A boolean ``(size, size)`` mask of one shape at a random place and size."""
    yy, xx = np.mgrid[0:size, 0:size]
    r = rng.uniform(0.22, 0.35) * size
    cy, cx = rng.uniform(r, size - r, size=2)
    if shape == "disc":
        return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    if shape == "square":
        return (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
    return (yy >= cy - r) & (yy <= cy + r) & (abs(xx - cx) <= (yy - cy + r) / 2)


def draw(shape: str, style: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """One ``(size, size, 3)`` uint8 image of ``shape`` in the domain ``style``: ``photo`` noisy natural colours,
    ``art`` a striped painted texture, ``cartoon`` flat saturated colours, ``sketch`` a dark outline on white."""
    mask = _shape_mask(shape, size, rng)
    yy, xx = np.mgrid[0:size, 0:size]
    if style == "sketch":
        edge = mask ^ np.roll(mask, 1, axis=0) | mask ^ np.roll(mask, 1, axis=1)
        image = np.full((size, size, 3), 245.0)
        image[edge] = 20
        return image.clip(0, 255).astype(np.uint8)
    if style == "cartoon":
        image = np.empty((size, size, 3))
        image[:] = (90, 200, 250)
        image[mask] = (250, 60, 40)
        return image.astype(np.uint8)
    if style == "art":
        stripes = 60 * np.sin((xx + yy) / rng.uniform(1.5, 3.0))[..., None]
        image = np.array([200.0, 170, 110]) + stripes + rng.normal(0, 10, (size, size, 3))
        image[mask] = np.array([90.0, 40, 120]) + stripes[mask] / 2
        return image.clip(0, 255).astype(np.uint8)
    image = np.array([110.0, 140, 90]) + rng.normal(0, 30, (size, size, 3))
    image[mask] = np.array([180.0, 150, 120]) + rng.normal(0, 30, (int(mask.sum()), 3))
    return image.clip(0, 255).astype(np.uint8)


def make_domain_tree(
    root: Path,
    domains: Sequence[str] = STYLES,
    classes: Sequence[str] = SHAPES,
    per_class: int | dict[str, int] = 5,
    size: int = 24,
    seed: int = 0,
) -> Path:
    """``root/<domain>/<class>/<domain>_<class>_<i>.png``: ``per_class`` images of each shape (class) in each domain's
    style (a domain named otherwise than :data:`STYLES` is drawn like ``photo``); ``per_class`` may give a count per
    domain. Returns ``root``."""
    rng = np.random.default_rng(seed)
    for domain in domains:
        n = per_class[domain] if isinstance(per_class, dict) else per_class
        for shape in classes:
            folder = root / domain / shape
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                drawn = draw(shape if shape in SHAPES else SHAPES[len(shape) % 3], domain, size, rng)
                Image.fromarray(drawn).save(folder / f"{domain}_{shape}_{i}.png")
    return root
