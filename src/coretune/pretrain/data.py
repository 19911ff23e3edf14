"""Unlabelled images for contrastive pre-training, delivered as two augmented views per image."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchvision.transforms import v2

from ..data import IMAGENET_MEAN, IMAGENET_STD, DataError, ImageFileDataset
from ..data.datasets import OnBadImage
from ..data.loading import LoaderSettings, NumWorkers, PinMemory, hardware_of_trainer, is_auto, resolve_loading
from ..data.samplers import EpochShuffleSampler, ResumableLoader, SeededItems
from ..distributed import rank, world_size
from .augment import BatchAugment

__all__ = ["PretrainData"]


class PretrainData(L.LightningDataModule):
    """Every image under ``root`` (recursively; class sub-folders are ignored) as pairs of random views.

    Images are decoded, resized (shorter side) and centre-cropped to ``image_size`` in the loader and batched
    as uint8; after the batch reaches the device, :class:`BatchAugment` draws two independent views of the
    whole batch (SimCLR / MoCo-v2 augmentations), so a training batch is ``(view1, view2)``, both normalised.

    Args:
        root: Folder of training images (an ImageFolder tree works; labels are not used). A fine-tuning root holding
            ``train/`` beside ``val/`` or ``test/`` is refused: pass its ``train/``.
        image_size: Side of the square views in pixels.
        batch_size: Images per batch (each yields two views).
        num_workers: DataLoader worker processes (0 decodes in the main process); auto: min(8, CPU cores per
            process) on CUDA, else 0.
        seed: Seed of the shuffle order.
        on_bad_image: Unreadable files: "error" stops at the first; "skip" leaves them out and warns once.
        crop_scale: Area range of the random resized crop.
        flip_p: Probability of a horizontal flip.
        jitter_p: Probability of colour jitter.
        brightness: Brightness jitter strength.
        contrast: Contrast jitter strength.
        saturation: Saturation jitter strength.
        hue: Hue jitter range (turns, <= 0.5).
        grayscale_p: Probability of a grayscale view.
        mean: Normalisation mean (RGB, fractions of the [0, 1] pixel range); use the same values when fine-tuning.
        std: Normalisation standard deviation (RGB, in (0, 1]).
        cache_images: Decode every image once at setup and keep them in memory (N·3·image_size² bytes): saves
            the decoding in every epoch of small data sets.
        pin_memory: Pin batches in page-locked memory (speeds host-to-GPU copies); auto: on CUDA only.
    """

    def __init__(
        self,
        root: str,
        image_size: int = 64,
        batch_size: int = 256,
        num_workers: NumWorkers = "auto",
        seed: int = 0,
        on_bad_image: OnBadImage = "error",
        crop_scale: tuple[float, float] = (0.2, 1.0),
        flip_p: float = 0.5,
        jitter_p: float = 0.8,
        brightness: float = 0.4,
        contrast: float = 0.4,
        saturation: float = 0.4,
        hue: float = 0.1,
        grayscale_p: float = 0.2,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        cache_images: bool = False,
        pin_memory: PinMemory = "auto",
    ) -> None:
        super().__init__()
        if batch_size < 2:
            raise DataError(f"batch_size must be >= 2 for contrastive pre-training (got {batch_size})")
        if not is_auto(num_workers) and num_workers < 0:
            raise DataError(f"num_workers must be >= 0 or auto (got {num_workers})")
        try:
            self.augment = BatchAugment(
                image_size, crop_scale, flip_p=flip_p, jitter_p=jitter_p, brightness=brightness,
                contrast=contrast, saturation=saturation, hue=hue, grayscale_p=grayscale_p, mean=mean,
                std=std,
            )  # fmt: skip
        except ValueError as err:
            raise DataError(f"{err} — set valid values (--data.<option>)") from None
        self.save_hyperparameters()
        self.root, self.image_size, self.batch_size = root, image_size, batch_size
        self.num_workers, self.seed, self.on_bad_image = num_workers, seed, on_bad_image
        self.mean, self.std, self.cache_images = tuple(mean), tuple(std), cache_images
        self.pin_memory = pin_memory
        self.train_dataset: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        self._check_not_a_fit_root()
        load = v2.Compose(
            [v2.Resize(self.image_size, antialias=True), v2.CenterCrop(self.image_size), v2.PILToTensor()]
        )
        files = ImageFileDataset(self.root, load, draft_size=self.image_size, on_bad_image=self.on_bad_image)
        if len(files) < 2:
            raise DataError(f"{self.root} holds a single image: contrastive pre-training needs at least 2")
        if self.cache_images:
            images = torch.stack([files[i][0] for i in range(len(files))])
            self.train_dataset = TensorDataset(images, torch.arange(len(files)))
        else:
            self.train_dataset = files

    def _check_not_a_fit_root(self) -> None:
        """Refuse a root laid out for ``coretune fit``: every image under it would include the evaluation images."""
        held_out = [f"{name}/" for name in ("val", "test") if os.path.isdir(os.path.join(self.root, name))]
        if held_out and os.path.isdir(os.path.join(self.root, "train")):
            raise DataError(
                f"{self.root} holds train/ beside {' and '.join(held_out)} (the layout coretune fit takes): "
                f"pre-training reads every image under it, so it would learn from the {' and '.join(held_out)} images "
                f"a fine-tuning is scored on; pass --data.root {os.path.join(self.root, 'train')}"
            )

    def train_dataloader(self) -> DataLoader:
        """Shuffled in an order fixed by ``(seed, epoch)`` that resumes mid-epoch exactly, sharded across
        processes under ``torch.distributed``; the last incomplete batch is dropped when there are 2+ batches."""
        self.setup()
        assert self.train_dataset is not None
        n, processes = len(self.train_dataset), world_size()
        drop_last = n > self.batch_size * processes
        return ResumableLoader(
            SeededItems(self.train_dataset),
            batch_size=self.batch_size,
            sampler=EpochShuffleSampler(n, self.seed, self.batch_size, processes, rank(), drop_last),
            drop_last=drop_last,
            **self.loader_settings().options(),
        )

    def loader_settings(self) -> LoaderSettings:
        """``num_workers`` and ``pin_memory`` as given, ``auto`` resolved for the attached trainer's accelerator
        (:func:`~coretune.data.loading.resolve_loading`; ``coretune pretrain`` resolves them before it starts)."""
        cuda, processes = hardware_of_trainer(getattr(self, "trainer", None))
        return resolve_loading(self.num_workers, self.pin_memory, cuda=cuda, processes_per_node=processes)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """``(images uint8, indices)`` → ``(view1, view2)``, augmented on the batch's device. A bare tensor (the
        model summary's example input, a float view already) passes unchanged."""
        if isinstance(batch, Tensor):
            return batch
        images = batch[0]
        self.augment.to(images.device)
        return self.augment(images), self.augment(images)
