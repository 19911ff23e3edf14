"""Helpers of the sweep tests: a spec over an empty data folder, and finished runs fabricated in it."""

from __future__ import annotations

import json
from pathlib import Path

from coretune.sweeps import BenchSpec


def data_root(tmp_path: Path) -> Path:
    """An image-folder root with empty train/ and test/: enough for the sweep's up-front path check (fits are faked)."""
    for split in ("train", "test"):
        (tmp_path / "data" / split).mkdir(parents=True, exist_ok=True)
    return tmp_path / "data"


def spec_of(tmp_path: Path, **entries: object) -> BenchSpec:
    datasets = {"tiny": [f"--data.root={data_root(tmp_path)}"]}
    raw = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce", "core"]}
    return BenchSpec.from_dict({**raw, **entries})


def fabricate(spec: BenchSpec, top1: dict[tuple[str, str, float], list[float | None]]) -> None:
    """Finished runs with the given test top-1 (fractions) per (objective, dataset, fraction), by seed order."""
    for run in spec.runs():
        value = top1[(run.objective, run.dataset, run.label_fraction)][spec.seeds.index(run.seed)]
        if value is None:
            continue
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "results.json").write_text(json.dumps({"test": {"top1": value, "top5": 1.0}, "epochs": 3}))
