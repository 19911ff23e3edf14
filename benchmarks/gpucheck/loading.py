"""The loader alone and the DDP fit, on a folder of JPEGs the check writes itself (nothing is downloaded).

:func:`make_jpeg_folder` writes ``distinct`` smooth random pictures (low-resolution noise enlarged, plus grain: JPEG
sizes and decoding costs near photographs', where pure noise decodes slower) and hard-links them to ``images``
training files in 10 class folders, and one validation image per class. :func:`loader_rate` times
:class:`~coretune.data.ImageClassificationData`'s training loader with ``num_workers`` and ``pin_memory`` ``auto``
(decode, random-resized crop, flip, normalise, collate, pinning): the images/s the GPU could be fed.
:func:`ddp_fit` runs ``coretune fit`` with 2 processes and Core-tuning's global hard-pair mining
(``--objective.gather true``) on the folder, and reads the run's ``results.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from coretune.data import ImageClassificationData

CLASSES = 10


def smooth_picture(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A random picture with a photograph's mix of smooth areas and grain."""
    coarse = rng.integers(0, 256, (max(2, height // 32), max(2, width // 32), 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    grain = rng.integers(-12, 13, image.shape, dtype=np.int16)
    return Image.fromarray(np.clip(image + grain, 0, 255).astype(np.uint8))


def make_jpeg_folder(root: Path, images: int, size: tuple[int, int], distinct: int = 64) -> dict[str, Any]:
    """``root/train/class<k>/`` with ``images`` JPEGs (``distinct`` pictures, hard-linked) and ``root/val/``;
    returns what was written."""
    rng = np.random.default_rng(0)
    sources = root / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(min(distinct, images)):
        path = sources / f"{index:04d}.jpg"
        smooth_picture(rng, *size).save(path, quality=90)
        paths.append(path)
    for split, count in (("train", images), ("val", CLASSES)):
        for index in range(count):
            folder = root / split / f"class{index % CLASSES}"
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / f"{index:05d}.jpg"
            try:
                os.link(paths[index % len(paths)], target)
            except OSError:  # a file system without hard links
                target.write_bytes(paths[index % len(paths)].read_bytes())
    mean_kb = sum(p.stat().st_size for p in paths) / len(paths) / 1024
    return {
        "train_images": images,
        "distinct_pictures": len(paths),
        "size": list(size),
        "mean_jpeg_kib": round(mean_kb),
    }


def loader_rate(root: Path, image_size: int, batch_size: int, batches: int) -> dict[str, Any]:
    """Images/s of the training loader with ``num_workers auto``: the first round of batches (one per worker: the
    workers' start) is not timed, then ``batches`` batches are."""
    data = ImageClassificationData(root=str(root), image_size=image_size, batch_size=batch_size)
    data.setup("fit")
    settings = data.loader_settings()
    skip = max(1, settings.num_workers)
    loader = iter(data.train_dataloader())
    for _ in range(skip):
        next(loader)
    start, images = time.perf_counter(), 0
    for x, _ in itertools.islice(loader, batches):
        images += x.shape[0]
    seconds = time.perf_counter() - start
    del loader
    if images < batches * batch_size:
        raise RuntimeError(f"the folder gave {images} images, fewer than the {batches} × {batch_size} asked for")
    return {
        "images_per_s": round(images / seconds, 1),
        "num_workers": settings.num_workers,
        "pin_memory": settings.pin_memory,
        "image_size": image_size,
        "batch_size": batch_size,
        "timed_batches": batches,
    }


def ddp_fit(
    root: Path, run_dir: Path, backbone: str, image_size: int, batch_size: int, steps: int, accelerator: str
) -> dict[str, Any]:
    """``coretune fit`` with 2 processes (``--trainer.strategy ddp``) and Core-tuning mining the global batch;
    ``batch_size`` per process. Returns its training images/s (both processes') and how it ended."""
    command = [
        sys.executable,
        "-m",
        "coretune.cli",
        "fit",
        f"--data.root={root}",
        f"--data.image_size={image_size}",
        f"--data.batch_size={batch_size}",
        f"--model.backbone={backbone}",
        "--objective=core",
        "--objective.gather=true",
        "--trainer.max_epochs=1",
        f"--trainer.limit_train_batches={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.limit_test_batches=1",
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        f"--trainer.accelerator={accelerator}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--run_dir={run_dir}",
    ]
    if accelerator == "cpu":
        command.append("--trainer.precision=32-true")  # gloo on a CPU without bf16 kernels for every layer
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    result: dict[str, Any] = {
        "processes": 2,
        "global_mining": True,
        "backbone": backbone,
        "batch_size_per_process": batch_size,
        "steps": steps,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return result | {"status": f"error: exit {done.returncode}: {lines[-1] if lines else 'no output'}"}
    registered = "Starting with 2 processes" in done.stderr
    results = json.loads((run_dir / "results.json").read_text())
    status = "ok" if registered else "error: the log does not show 2 registered processes"
    return result | {"status": status, "images_per_s": results.get("train_images_per_s")}
