"""Joint image + mask transforms for semantic segmentation (torchvision v2): DeepLab's random scale and crop for
training, the centre crop (or whole image) for evaluation, and the padding collate of ``(image, mask)`` pairs.

Masks are padded with ``ignore_index`` (left out of the loss and the metrics), images with the mean colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import default_collate
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from .transforms import IMAGENET_MEAN, IMAGENET_STD
from .voc import IGNORE_INDEX

__all__ = [
    "CenterCropPad",
    "EvalMode",
    "RandomScale",
    "pad_collate",
    "segmentation_eval_transform",
    "segmentation_train_transform",
]

EvalMode = Literal["center_crop", "whole"]


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
