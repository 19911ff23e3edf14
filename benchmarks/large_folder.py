"""Indexing an ImageNet-sized ``--data.root``: time and memory of what ``coretune fit`` does to list a folder tree
before it reads any image (issue 62).

    .venv/bin/python benchmarks/large_folder.py                   # 1.28 M training files, 1,000 classes
    .venv/bin/python benchmarks/large_folder.py --files 100000    # scaled down
    .venv/bin/python benchmarks/large_folder.py --profile         # and the hot spots (cProfile) of the set-up

It generates ``root/train/<class>/<file>.JPEG`` (``--files`` spread over ``--classes`` folders) and ``root/val/``
(``--val-per-class`` files a class, ImageNet's 50) of *empty* files in a temporary folder (or ``--root``): indexing
opens no file, so their content does not matter. It checks the free inodes and space first. Then it times, each
stage on its own and then together as a fit runs them:

* ``scan train/``: :meth:`LabeledImageDataset.from_folder` of the training folder (class discovery, listing);
* ``setup (fit)``: the data module's ``setup("fit")`` (both folders listed, class lists compared, the
  ``--data.label_fraction`` subset and ``--data.val_fraction`` hold-out drawn);
* ``shared files``: the checks that no test or validation image is a training image
  (``test_files_in_training``, ``val_files_in_training``: fit's data checks run them);
* ``train loader``: the training loader and its sampler's length, and ``class_counts``.

Times are wall seconds, the median of ``--repeats`` runs, with the directory entries in the kernel's cache (the
tree was just written; a cold cache adds the disk's reads, which no code change removes). Peak memory is the
Python allocations' peak during the stage (``tracemalloc``, in a separate pass: it slows the code) and what the
result holds afterwards, plus the process's maximum resident set size at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import resource
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coretune.data import ImageClassificationData, LabeledImageDataset


def check_room(where: Path, files: int) -> None:
    """Refuse a tree that would take more than half the free inodes (or a directory block per class beyond the
    free space)."""
    stat = os.statvfs(where)
    if stat.f_files and files > stat.f_favail // 2:
        raise SystemExit(f"{files} files need more than half of the {stat.f_favail} free inodes of {where}: "
                         "pass fewer --files")  # fmt: skip
    needed = files * 64  # directory entries, about 64 bytes each
    if needed > stat.f_bavail * stat.f_frsize // 2:
        raise SystemExit(f"the tree needs about {needed >> 20} MiB of directory entries: free space on {where}")


def make_tree(root: Path, files: int, classes: int, val_per_class: int) -> float:
    """Write the tree of empty files; the seconds it took."""
    start = time.perf_counter()
    for split, count in (("train", files), ("val", val_per_class * classes)):
        for k in range(classes):
            folder = root / split / f"n{k:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            share = count // classes + (1 if k < count % classes else 0)
            for i in range(share):
                os.close(os.open(folder / f"n{k:08d}_{i}.JPEG", os.O_CREAT | os.O_WRONLY, 0o644))
    return time.perf_counter() - start


def stages(root: Path, label_fraction: float, val_fraction: float) -> dict[str, Callable[[], Any]]:
    """The stages timed, each a function from scratch (no state shared between calls)."""

    def data() -> ImageClassificationData:
        return ImageClassificationData(str(root), image_size=32, batch_size=256, label_fraction=label_fraction,
                                       val_fraction=val_fraction, num_workers=0, pin_memory=False)  # fmt: skip

    def setup() -> ImageClassificationData:
        dm = data()
        dm.setup("fit")
        return dm

    def shared() -> tuple[list[str], list[str]]:
        dm = setup()
        return dm.test_files_in_training(), dm.val_files_in_training()

    def loader() -> int:
        dm = setup()
        dm.class_counts("train")
        return len(dm.train_dataloader())

    def everything() -> int:
        dm = setup()
        dm.test_files_in_training(), dm.val_files_in_training(), dm.class_counts("train")
        return len(dm.train_dataloader())

    return {
        "scan train/": lambda: LabeledImageDataset.from_folder(str(root / "train")),
        "setup (fit)": setup,
        "setup + shared files": shared,
        "setup + train loader": loader,
        "all of the above": everything,
    }


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times)


def peak_memory(fn: Callable[[], Any]) -> tuple[float, float]:
    """The Python allocations' peak during ``fn`` and what its result still holds, in MiB."""
    gc.collect()
    tracemalloc.start()
    result = fn()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del result
    return peak / 2**20, held / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=1_280_000, help="training files (ImageNet: 1.28 M)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--val-per-class", type=int, default=50)
    parser.add_argument("--label-fraction", type=float, default=0.1)
    parser.add_argument("--val-fraction", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None, help="an existing tree to index (default: generated)")
    parser.add_argument("--keep", action="store_true", help="keep the generated tree (printed)")
    parser.add_argument("--profile", action="store_true", help="also print the set-up's hot spots (cProfile)")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    args = parser.parse_args()

    made = args.root is None
    root = Path(tempfile.mkdtemp(prefix="large_folder_")) if made else args.root
    try:
        if made:
            check_room(root, args.files + args.classes * (args.val_per_class + 2))
            seconds = make_tree(root, args.files, args.classes, args.val_per_class)
            print(f"tree: {args.files} training + {args.classes * args.val_per_class} val files, {args.classes} "
                  f"classes, in {root} (written in {seconds:.1f} s)")  # fmt: skip
        runs = stages(root, args.label_fraction, args.val_fraction)
        print(f"label_fraction {args.label_fraction}, val_fraction {args.val_fraction}; median of {args.repeats}")
        print(f"{'stage':<24}{'time (s)':>10}{'peak (MiB)':>12}{'held (MiB)':>12}")
        for name, fn in runs.items():
            seconds = timed(fn, args.repeats)
            peak, held = (float("nan"), float("nan")) if args.no_memory else peak_memory(fn)
            print(f"{name:<24}{seconds:>10.2f}{peak:>12.0f}{held:>12.0f}")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"max resident set size of the process: {rss:.0f} MiB")
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(runs["all of the above"])
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    finally:
        if made and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif made:
            print(f"kept: {root}")


if __name__ == "__main__":
    main()
