"""Training augmentation on the device (``--data.augment_on device``): the loader decodes each image, resizes it to
a fixed square and hands uint8 tensors over; the batch's random crop, flip, rotation, colour jitter and greyscale
then run where the model runs (:meth:`ImageDataModule.on_after_batch_transfer
<coretune.data.base.ImageDataModule.on_after_batch_transfer>`), with the torchvision v2 transforms of
:func:`~coretune.data.transforms.train_transform`.

torchvision v2 draws one set of random parameters per call and applies it to every image of a batch, so
:class:`DeviceAugment` calls the random steps once per image (a loop of v2 calls on the device), each image under
its own item seed (the seed :class:`~coretune.data.samplers.SeededItems` gives the loader path): the draws of an
image depend on ``(seed, epoch, index)`` alone, as in the loader. Converting to float and normalising run once on
the whole batch.

What differs from the loader path (``--data.augment_on loader``): the random resized crop is drawn on the fixed
square the loader made (:func:`decode_size`: the shorter side resized to ``image_size·256/224`` and the centre
square kept, DomainBed's data the whole image squashed to that square), not on the decoded photo, so the edges
of an oblong photo are never seen and a small crop is upsampled from fewer pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor
from torchvision.transforms import v2

from .transforms import IMAGENET_MEAN, IMAGENET_STD, eval_resize_size, random_steps

__all__ = ["AugmentOn", "DeviceAugment", "decode_size", "fixed_size_transform"]

AugmentOn = Literal["loader", "device"]
"""``--data.augment_on``: where training augmentation runs."""


def decode_size(image_size: int) -> int:
    """Side of the uint8 squares the loader makes for device augmentation: ``round(image_size·256/224)`` (the
    evaluation transform's resize, 256 at 224)."""
    return eval_resize_size(image_size)


def fixed_size_transform(image_size: int, squash: bool = False) -> v2.Compose:
    """PIL RGB image → uint8 tensor ``(3, S, S)``, ``S`` = :func:`decode_size`: the shorter side resized to ``S`` and
    the centre square kept, or (``squash``) the whole image resized to the square."""
    side = decode_size(image_size)
    resize = (
        [v2.Resize((side, side), antialias=True)] if squash else [v2.Resize(side, antialias=True), v2.CenterCrop(side)]
    )
    return v2.Compose([*resize, v2.PILToTensor()])


class DeviceAugment:
    """``(images uint8 (B, 3, S, S), item seeds (B,)) → views``: each a normalised float batch ``(B, 3, size, size)``
    on the images' device, augmented as :func:`~coretune.data.transforms.train_transform` augments one image.

    Image ``i``'s views are drawn one after the other under torch's CPU generator seeded with ``seeds[i]`` (v2 draws
    its parameters there; the pixels are transformed on the device): the same seeds give the same views, on any
    device and in any batch, and two views of an image differ as :class:`~coretune.data.transforms.Views` makes
    them differ.
    """

    def __init__(
        self,
        image_size: int,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        rotation: float = 0.0,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        hflip: bool = True,
        color_jitter: float = 0.0,
        grayscale: float = 0.0,
    ) -> None:
        self.random = v2.Compose(random_steps(image_size, mean, rotation, crop_scale, hflip, color_jitter, grayscale))
        self.mean, self.std = [float(m) for m in mean], [float(s) for s in std]

    def __call__(self, images: Tensor, seeds: Tensor | Sequence[int], views: int = 1) -> tuple[Tensor, ...]:
        if images.dim() != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
            raise ValueError(f"expected a uint8 batch (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        seeds = seeds.tolist() if isinstance(seeds, Tensor) else list(seeds)
        if len(seeds) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(seeds)} seeds")
        drawn: list[list[Tensor]] = [[] for _ in range(views)]
        for image, seed in zip(images, seeds, strict=True):
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(int(seed))  # v2 draws on the CPU generator
                for view in drawn:
                    view.append(self.random(image))
        return tuple(self.normalise(torch.stack(view)) for view in drawn)

    def normalise(self, images: Tensor) -> Tensor:
        """uint8 batch → float in [0, 1] → normalised, as the loader path's ``ToDtype`` and ``Normalize``."""
        return v2.functional.normalize(v2.functional.to_dtype(images, torch.float32, scale=True), self.mean, self.std)

    def __repr__(self) -> str:
        return f"DeviceAugment({self.random!r})"
