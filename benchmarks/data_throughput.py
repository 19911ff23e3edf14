"""Training-loader throughput of ``ImageClassificationData`` (decode + augmentation + collate), in images/s.

    python benchmarks/data_throughput.py                       # 2,000 random 32x32 JPEGs in a temp folder
    python benchmarks/data_throughput.py --folder DATA/cifar10  # an existing ImageFolder root (train/, test/)
    python benchmarks/data_throughput.py --crossover            # PIL augmentation vs augmentation on the device

Measures one pass over the training loader at ``--image-size`` (64) with batch 64 and 0 and 1 worker
processes, and with ``cache_images`` (every image decoded once at setup, whose time is reported), and compares
the torchvision v2 transform the package uses with the equivalent v1 (``transforms``) pipeline on the same images
in the main process. Target: faster than the ~410 img/s of a ResNet-18 training
step at 64 px on the 2-core development CPU, so loading is not the bottleneck. (A worker process alone only
adds inter-process cost here; in training it overlaps loading with the model step.)

``--crossover`` times, instead, the training loader with PIL augmentation in the loader (``--data.augment_on
loader``) against decoding to fixed uint8 squares in the loader and augmenting the batch with
:class:`~coretune.data.device_augment.DeviceAugment` in the main process on the device (``--data.augment_on
device``; ``--device cuda`` on a GPU, the CPU here), at ``--sizes`` and ``--workers``, on photo-sized (320x240)
synthetic JPEGs; it also reports the device augmentation alone, on batches already loaded.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
import warnings

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as v1

from coretune.data import ImageClassificationData, load_rgb

RESNET18_STEP_IMG_PER_S = 410.0  # ResNet-18 forward + backward at 64 px, batch 64, this CPU


def make_folder(root: str, n_images: int, n_classes: int = 10, size: int = 32) -> None:
    """A train/ ImageFolder of ``n_images`` random JPEGs (noise decodes slower than photos), a tiny val/."""
    rng = np.random.default_rng(0)
    for split, n in (("train", n_images), ("val", n_classes)):
        for i in range(n):
            folder = os.path.join(root, split, f"class{i % n_classes}")
            os.makedirs(folder, exist_ok=True)
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


def loader_rate(dm: ImageClassificationData, max_batches: int) -> tuple[float, float]:
    """``(steady images/s after the first batch, seconds to the first batch)`` over <= ``max_batches``."""
    start = time.perf_counter()
    it = iter(dm.train_dataloader())
    first = next(it)
    t_first = time.perf_counter() - start
    n, t0 = 0, time.perf_counter()
    for x, _ in itertools.islice(it, max_batches - 1):
        n += x.shape[0]
    assert first[0].dtype == torch.float32
    return n / (time.perf_counter() - t0), t_first


def transform_rates(paths: list[str], dm: ImageClassificationData) -> dict[str, float]:
    """Images/s of decode + each training pipeline on ``paths``, in the main process (no collate)."""
    size = dm.image_size
    legacy = v1.Compose(
        [
            v1.RandomResizedCrop(size),
            v1.RandomHorizontalFlip(),
            v1.ToTensor(),
            v1.Normalize(dm.mean, dm.std),
        ]
    )
    rates = {}
    pipelines = (("decode only", None), ("decode + v2 (used)", dm.train_transform), ("decode + v1", legacy))
    for name, tf in pipelines:
        start = time.perf_counter()
        for p in paths:
            img = load_rgb(p)
            if tf is not None:
                tf(img)
        rates[name] = len(paths) / (time.perf_counter() - start)
    return rates


def make_photos(root: str, n_images: int, n_classes: int = 8) -> None:
    """A train/ ImageFolder of ``n_images`` smooth 320x240 JPEGs (photo-like sizes and decoding cost), a tiny val/."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, 320)[None, :, None] * np.linspace(0, 1, 240)[:, None, None]
    for split, n in (("train", n_images), ("val", n_classes)):
        for i in range(n):
            folder = os.path.join(root, split, f"class{i % n_classes}")
            os.makedirs(folder, exist_ok=True)
            pixels = 255 * ramp * rng.uniform(0.3, 1, 3) + rng.normal(0, 12, (240, 320, 3))
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


def pipeline_rate(dm: ImageClassificationData, device: str, max_batches: int) -> tuple[float, float, float]:
    """``(images/s of the whole pipeline, of the loader alone, of the augmentation on the device alone (0 with
    augment_on loader))`` after the first batch, over <= ``max_batches``: one pass, the augmentation timed apart."""
    it = iter(dm.train_dataloader())
    next(it)
    n, spent, t0 = 0, 0.0, time.perf_counter()
    for batch in itertools.islice(it, max_batches - 1):
        batch = [part.to(device, non_blocking=True) for part in batch]
        start = time.perf_counter()
        images = dm.on_after_batch_transfer(batch, 0)[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        spent += time.perf_counter() - start
        assert images.dtype == torch.float32
        n += images.shape[0]
    total = time.perf_counter() - t0
    return n / total, n / (total - spent), (n / spent if dm.device_augment is not None else 0.0)


def crossover(args: argparse.Namespace) -> None:
    """Loader images/s with PIL augmentation vs decode-only loader + device augmentation, per size and workers."""
    with tempfile.TemporaryDirectory() as root:
        make_photos(root, args.images)
        print(f"{args.images} synthetic 320x240 JPEGs, batch {args.batch_size}, <= {args.max_batches} batches each, "
              f"device augmentation on {args.device}, {torch.get_num_threads()} torch threads, load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
        print(f"{'size':>5} {'workers':>8} {'PIL in loader':>14} {'decode-only loader':>19} {'device aug alone':>17} "
              f"{'decode + device aug':>20}  (images/s)")  # fmt: skip
        for size, workers in itertools.product(args.sizes, args.workers):
            rates = []
            for where in ("loader", "device"):
                dm = ImageClassificationData(root=root, image_size=size, batch_size=args.batch_size,
                                             num_workers=workers, pin_memory=args.device.startswith("cuda"),
                                             augment_on=where)  # fmt: skip
                rates.append(pipeline_rate(dm, args.device, args.max_batches))
            (pil, _, _), (both, decode, alone) = rates
            print(f"{size:>5} {workers:>8} {pil:>14.0f} {decode:>19.0f} {alone:>17.0f} {both:>20.0f}")
        print(f"load average after: {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", help="existing ImageFolder root with train/ (default: synthetic JPEGs)")
    parser.add_argument("--images", type=int, default=2000, help="synthetic training images")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-batches", type=int, default=100, help="batches timed per setting")
    parser.add_argument("--crossover", action="store_true", help="PIL augmentation vs augmentation on the device")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224], help="image sizes (--crossover)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="loader workers (--crossover)")
    parser.add_argument("--device", default="cpu", help="where device augmentation runs (--crossover)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    if args.crossover:
        crossover(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        root = args.folder
        if root is None:
            root = tmp
            t = time.perf_counter()
            make_folder(root, args.images)
            print(f"wrote {args.images} random 32x32 JPEGs in {time.perf_counter() - t:.1f} s")
        rows = []
        for workers, cache in ((0, False), (1, False), (0, True)):
            dm = ImageClassificationData(
                root=root,
                image_size=args.image_size,
                batch_size=args.batch_size,
                num_workers=workers,
                cache_images=cache,
            )
            start = time.perf_counter()
            dm.setup()
            setup = time.perf_counter() - start
            rate, first = loader_rate(dm, args.max_batches)
            rows.append((workers, cache, setup, rate, first))
            if not cache:
                n_train, paths = len(dm.train_dataset), dm.train_dataset.paths
        per_image = transform_rates(paths[:1000], dm)

    print(
        f"\ntrain loader over {n_train} images (<= {args.max_batches} batches timed), "
        f"image_size {args.image_size}, batch {args.batch_size}:"
    )
    header = f"{'workers':>8} {'cache':>6} {'setup (s)':>10} {'img/s':>8} {'first batch (s)':>16}"
    print(f"{header} {'vs ResNet-18 step':>18}")
    for workers, cache, setup, rate, first in rows:
        ratio = rate / RESNET18_STEP_IMG_PER_S
        print(f"{workers:>8} {cache!s:>6} {setup:>10.2f} {rate:>8.0f} {first:>16.2f} {ratio:>17.1f}x")
    print("\nper image, main process, no collate:")
    for name, rate in per_image.items():
        print(f"{name:>20} {rate:>8.0f} img/s")
    slowest = min(rate for *_, rate, _ in rows)
    verdict = "not the bottleneck" if slowest > RESNET18_STEP_IMG_PER_S else "THE BOTTLENECK"
    print(f"\nloading is {verdict} of a ResNet-18 step at ~{RESNET18_STEP_IMG_PER_S:.0f} img/s")


if __name__ == "__main__":
    main()
