"""SimCLR / MoCo-v2 augmentations applied to a whole batch tensor at once (no per-image PIL work).

Every image of the batch draws its own crop, flip, colour jitter and grayscale, as torchvision's
``RandomResizedCrop → RandomHorizontalFlip → RandomApply(ColorJitter, p) → RandomGrayscale`` would per image
(SimCLR, Chen et al. 2020, Appendix A; MoCo v2 "aug+", Chen et al. 2020), but vectorised over the batch so
that a CPU keeps up at 32–64 px. Differences from torchvision, by design: the crop box is continuous (not
rounded to pixels) and resampled with :func:`torchvision.ops.roi_align` (bilinear; a crop larger than the
output averages ``⌈crop / output⌉²`` samples per pixel); the jitter operations run in a fixed order (brightness,
contrast, saturation, hue) and the hue shift is a rotation of the chroma plane in YIQ space, a close linear
approximation of HSV hue rotation. Gaussian blur is omitted (SimCLR drops it for CIFAR-sized images).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torchvision.ops import roi_align

from ..data.transforms import normalisation_problems

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "BatchAugment"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_GRAY = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale
_RGB_TO_YIQ = ((0.299, 0.587, 0.114), (0.596, -0.274, -0.322), (0.211, -0.523, 0.312))


class BatchAugment(nn.Module):
    """Random views of a batch: ``forward(x (B, 3, H, W), uint8 or float in [0, 1]) -> (B, 3, S, S)``.

    Args:
        image_size: output side ``S``.
        crop_scale: range of the crop area, a fraction of the image (torchvision ``RandomResizedCrop.scale``).
        crop_ratio: range of the crop aspect ratio.
        flip_p: probability of a horizontal flip.
        jitter_p: probability of applying colour jitter to an image.
        brightness / contrast / saturation: jitter strengths; factors are drawn from ``[1 - s, 1 + s]``.
        hue: hue shift range ``[-hue, hue]`` in turns (``<= 0.5``).
        grayscale_p: probability of converting an image to grayscale (kept 3-channel).
        mean / std: per-channel normalisation applied last (fractions of the [0, 1] pixel range).
    """

    def __init__(
        self,
        image_size: int,
        crop_scale: tuple[float, float] = (0.2, 1.0),
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        jitter_p: float = 0.8,
        brightness: float = 0.4,
        contrast: float = 0.4,
        saturation: float = 0.4,
        hue: float = 0.1,
        grayscale_p: float = 0.2,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        super().__init__()
        problems = []
        if image_size < 1:
            problems.append(f"image_size must be >= 1 (got {image_size})")
        if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            problems.append(f"crop_scale must satisfy 0 < min <= max <= 1 (got {tuple(crop_scale)})")
        if not 0 < crop_ratio[0] <= crop_ratio[1]:
            problems.append(f"crop_ratio must satisfy 0 < min <= max (got {tuple(crop_ratio)})")
        for name, p in (("flip_p", flip_p), ("jitter_p", jitter_p), ("grayscale_p", grayscale_p)):
            if not 0 <= p <= 1:
                problems.append(f"{name} must lie in [0, 1] (got {p})")
        for name, s in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
            if not 0 <= s <= 1:
                problems.append(f"{name} must lie in [0, 1] (got {s})")
        if not 0 <= hue <= 0.5:
            problems.append(f"hue must lie in [0, 0.5] (got {hue})")
        problems += normalisation_problems(mean, std)
        if problems:
            raise ValueError("invalid augmentation settings: " + "; ".join(problems))
        self.image_size = image_size
        self.crop_scale = tuple(crop_scale)
        self.crop_ratio = tuple(crop_ratio)
        self.flip_p, self.jitter_p, self.grayscale_p = flip_p, jitter_p, grayscale_p
        self.brightness, self.contrast, self.saturation, self.hue = brightness, contrast, saturation, hue
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("gray", torch.tensor(_GRAY).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("rgb_to_yiq", torch.tensor(_RGB_TO_YIQ), persistent=False)

    def crop_boxes(self, batch: int, height: int, width: int, device: torch.device) -> Tensor:
        """``(B, 4)`` boxes ``x0, y0, x1, y1`` drawn as ``RandomResizedCrop.get_params`` (10 tries, else the
        whole image), in pixel coordinates."""
        tries = 10
        area = height * width * torch.empty(batch, tries, device=device).uniform_(*self.crop_scale)
        log_ratio = torch.empty(batch, tries, device=device).uniform_(*(math.log(r) for r in self.crop_ratio))
        ratio = log_ratio.exp()
        w, h = (area * ratio).sqrt(), (area / ratio).sqrt()
        ok = (w <= width) & (h <= height)
        first = ok.float().argmax(dim=1, keepdim=True)
        found = ok.any(dim=1)
        w = torch.where(found, w.gather(1, first).squeeze(1), torch.full_like(found, width, dtype=w.dtype))
        h = torch.where(found, h.gather(1, first).squeeze(1), torch.full_like(found, height, dtype=h.dtype))
        x0 = torch.rand(batch, device=device) * (width - w)
        y0 = torch.rand(batch, device=device) * (height - h)
        return torch.stack([x0, y0, x0 + w, y0 + h], dim=1)

    def _factors(self, batch: int, strength: float, device: torch.device) -> Tensor:
        return torch.empty(batch, 1, 1, 1, device=device).uniform_(1 - strength, 1 + strength)

    def _luma(self, x: Tensor) -> Tensor:
        return (x * self.gray).sum(dim=1, keepdim=True)

    def color_jitter(self, x: Tensor) -> Tensor:
        """Per-image brightness, contrast, saturation and hue (YIQ rotation), each clamped to [0, 1]."""
        b, device = x.shape[0], x.device
        if self.brightness > 0:
            x = (x * self._factors(b, self.brightness, device)).clamp(0, 1)
        if self.contrast > 0:
            mean = self._luma(x).mean(dim=(2, 3), keepdim=True)
            x = torch.lerp(mean, x, self._factors(b, self.contrast, device)).clamp(0, 1)
        if self.saturation > 0:
            x = torch.lerp(self._luma(x), x, self._factors(b, self.saturation, device)).clamp(0, 1)
        if self.hue > 0:
            angle = torch.empty(b, device=device).uniform_(-self.hue, self.hue) * 2 * math.pi
            cos, sin = angle.cos(), angle.sin()
            rotation = torch.zeros(b, 3, 3, device=device)
            rotation[:, 0, 0] = 1
            rotation[:, 1, 1], rotation[:, 1, 2], rotation[:, 2, 1], rotation[:, 2, 2] = cos, -sin, sin, cos
            to_yiq = self.rgb_to_yiq
            transform = torch.linalg.inv(to_yiq) @ rotation @ to_yiq  # (B, 3, 3) in RGB
            x = torch.einsum("bij,bjhw->bihw", transform, x).clamp(0, 1)
        return x

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"expected a batch of RGB images (B, 3, H, W), got shape {tuple(x.shape)}")
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        b, _, height, width = x.shape
        device = x.device
        boxes = self.crop_boxes(b, height, width, device)
        rois = torch.cat([torch.arange(b, device=device, dtype=x.dtype)[:, None], boxes], dim=1)
        size = (self.image_size, self.image_size)
        x = roi_align(x, rois, size, spatial_scale=1.0, sampling_ratio=0, aligned=True)
        flip = torch.rand(b, 1, 1, 1, device=device) < self.flip_p
        x = torch.where(flip, x.flip(3), x)
        jitter = torch.rand(b, 1, 1, 1, device=device) < self.jitter_p
        if jitter.any():
            x = torch.where(jitter, self.color_jitter(x), x)
        gray = torch.rand(b, 1, 1, 1, device=device) < self.grayscale_p
        x = torch.where(gray, self._luma(x).expand_as(x), x)
        return (x - self.mean) / self.std
