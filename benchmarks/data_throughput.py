"""Training-loader throughput of ``ImageClassificationData`` (decode + augmentation + collate), in images/s.

    python benchmarks/data_throughput.py                       # 2,000 random 32x32 JPEGs in a temp folder
    python benchmarks/data_throughput.py --folder DATA/cifar10  # an existing ImageFolder root (train/, test/)

Measures one pass over the training loader at ``--image-size`` (64) with batch 64 and 0 and 1 worker
processes, and with ``cache_images`` (every image decoded once at setup, whose time is reported), and compares
the torchvision v2 transform the package uses with the equivalent v1 (``transforms``) pipeline on the same images
in the main process. Target: faster than the ~410 img/s of a ResNet-18 training
step at 64 px on the 2-core development CPU, so loading is not the bottleneck. (A worker process alone only
adds inter-process cost here; in training it overlaps loading with the model step.)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", help="existing ImageFolder root with train/ (default: synthetic JPEGs)")
    parser.add_argument("--images", type=int, default=2000, help="synthetic training images")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-batches", type=int, default=100, help="batches timed per setting")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")

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
