"""Paired differences between cells of different ``coretune bench`` specs, from their committed records: a spec's
table compares its own rows only, and some comparisons cross specs (issue 64: the LoRA rows of
``configs/bench/cifar10_cpu_10pct_table4_lora.yaml`` against the full fine-tuning rows of
``configs/bench/cifar10_cpu_10pct_table4.yaml`` on the same ViT column).

    .venv/bin/python benchmarks/paired_records.py \\
        docs/records/cifar10-cpu-10pct-table4/vit_tiny_moco_v3/ce \\
        docs/records/cifar10-cpu-10pct-table4-lora/vit_tiny_moco_v3/lora_ce \\
        docs/records/cifar10-cpu-10pct-table4-lora/vit_tiny_moco_v3/lora_core

Each argument is a cell: a folder whose runs are ``.../seedN/results.json`` (a finished run's test top-1) beside its
``metrics.csv``. The first is the baseline. Printed, as a markdown table: each cell's test top-1, mean ± sample std
over its seeds and the value of each seed; its training top-1 at the last epoch (on augmented images: how well the
recipe fits the training set); and each later cell's difference from the baseline, seed by seed (the seeds both
finished), with the paired t-test of :func:`coretune.sweeps.stats.compare` — the test ``coretune bench`` reports.
Pair only cells whose runs share the label subset, data order and augmentations seed by seed (the same data
arguments and seeds), as those two specs' do.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from coretune.engine import read_metrics
from coretune.sweeps.records import percent, run_top1
from coretune.sweeps.stats import Cell, compare

SEED_DIR = re.compile(r"^seed(\d+)$")


def read_cell(folder: Path) -> tuple[Cell, dict[int, float]]:
    """The finished runs under ``folder``: a :class:`Cell` of test top-1 (%) by seed (:func:`run_top1`, as
    ``coretune bench`` reads it: a run without a test score is left out), and training top-1 (%) at each run's last
    epoch by seed (absent where its ``metrics.csv`` has none)."""
    values: dict[int, float] = {}
    train: dict[int, float] = {}
    for results in sorted(folder.rglob("results.json")):
        run = results.parent
        match = SEED_DIR.match(run.name)
        top1 = run_top1(run) if match else None
        if top1 is None:
            continue  # not a seed's run, or a run that did not finish
        seed = int(match.group(1))
        if seed in values:
            raise SystemExit(f"paired_records: {folder} holds two runs of seed {seed}: name one cell per folder")
        values[seed] = top1
        rows = [r for r in read_metrics(run / "metrics.csv") if r.get("train/top1")]
        if rows and (trained := percent(rows[-1]["train/top1"])) is not None:
            train[seed] = trained
    if not values:
        raise SystemExit(f"paired_records: no finished run (seedN/results.json with test results) under {folder}")
    seeds = tuple(sorted(values))
    return Cell(folder.name, folder.parent.name, math.nan, tuple(values[s] for s in seeds), seeds), train


def _label(folder: Path, root: Path) -> str:
    return str(folder.relative_to(root)) if folder.is_relative_to(root) else str(folder)


def table(folders: list[Path]) -> str:
    """The markdown table described in the module docstring."""
    cells = [read_cell(f) for f in folders]
    root = Path(os.path.commonpath(folders))
    base = cells[0][0]
    lines = [
        f"Cells under {root}; differences from {_label(folders[0], root)}, paired by seed.",
        "",
        "| Cell | test top-1 (%) | per seed | train top-1, last epoch | − baseline (pp), per seed | paired t (p) |",
        "|---|:-:|:-:|:-:|:-:|:-:|",
    ]
    for folder, (cell, train) in zip(folders, cells, strict=True):
        spread = f" ± {cell.std:.2f}" if cell.n >= 2 else ""
        per_seed = " / ".join(f"{v:.2f}" for v in cell.values)
        trained = " / ".join(f"{train[s]:.1f}" if s in train else "–" for s in cell.seeds)
        diff = test = "–"
        if cell is not base:
            c = compare(cell, base)
            if c.paired:
                mean = sum(c.paired) / len(c.paired)
                diff = f"{mean:+.2f}: " + " / ".join(f"{d:+.2f}" for d in c.paired)
                test = "–" if math.isnan(c.paired_t) else f"{c.paired_t:.1f} ({c.paired_p:.3g})"
        lines.append(
            f"| {_label(folder, root)} | {cell.mean:.2f}{spread} | {per_seed} (seeds "
            f"{', '.join(map(str, cell.seeds))}) | {trained} | {diff} | {test} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="+", type=Path, help="cell folders; the first is the baseline")
    args = parser.parse_args(argv)
    missing = [str(c) for c in args.cells if not c.is_dir()]
    if missing:
        raise SystemExit(f"paired_records: not a folder: {', '.join(missing)} (give each cell's records folder)")
    if len(args.cells) < 2:
        raise SystemExit("paired_records: give a baseline cell and at least one cell to compare with it")
    folders = [c.resolve() for c in args.cells]
    print(table(folders))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
