"""Every JSON file the commands write is strict JSON (no ``NaN``/``Infinity`` tokens, which Python's ``json``
writes by default and most other parsers refuse): a representative set of runs, every ``*.json`` they leave read
back with a parser that refuses those tokens. An undefined score is ``null`` (docs/reliability.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from coretune.cli import main
from coretune.runs.atomic import finite_or_none, strict_json
from coretune.runs.layout import RunDir
from coretune.sweeps import BenchSpec
from fit_flags import QUIET, TINY_FIT
from image_trees import make_image_tree
from segmentation_sets import make_voc_set, save_mask


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"{name} in a JSON file: not strict JSON")


def strict_files(folder: Path, but: set[Path]) -> dict[Path, object]:
    """Every ``*.json`` under ``folder`` but those of ``but``, parsed strictly."""
    return {
        path: json.loads(path.read_text(), parse_constant=_refuse_constant)
        for path in folder.rglob("*.json")
        if path not in but
    }


def test_strict_json_writes_non_finite_floats_as_null() -> None:
    value = {"miou": math.nan, "best": -math.inf, "per": [1.0, math.inf, (math.nan,)], "n": 3, "ok": True}
    text = strict_json(value, sort_keys=True)
    assert json.loads(text, parse_constant=_refuse_constant) == {
        "best": None, "miou": None, "n": 3, "ok": True, "per": [1.0, None, [None]],
    }  # fmt: skip
    assert finite_or_none("NaN") == "NaN"  # text stays text


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_json_a_representative_set_of_commands_writes_is_strict(tmp_path: Path) -> None:
    tree = make_image_tree(tmp_path / "data", per_class=6, val_per_class=2, size=16)
    run = tmp_path / "fit"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={tree}", f"--run_dir={run}"])
    ckpt = RunDir(run).last_checkpoint
    main(["test", f"--ckpt_path={ckpt}", f"--config={RunDir(run).config}"])
    main(["validate", f"--ckpt_path={ckpt}", f"--config={RunDir(run).config}"])
    main(["eval", "knn", f"--model.weights={ckpt}", "--model.backbone=small_cnn", f"--data.root={tree}",
          "--data.image_size=16", "--k=3", f"--output={tmp_path / 'knn.json'}"])  # fmt: skip
    # segmentation whose evaluation masks are all ignored: undefined scores, NaN and -Infinity before
    voc = make_voc_set(tmp_path / "voc", {"train": 8, "val": 4})
    for mask in (voc / "SegmentationClass").glob("val_*.png"):
        save_mask(np.full((40, 56), 255, dtype=np.uint8), mask, palette=True)
    main(["fit", "--task=segmentation", "--model.backbone=resnet18", "--model.weights=null", f"--data.root={voc}",
          f"--run_dir={tmp_path / 'seg'}", "--data.image_size=32", "--data.batch_size=4", "--trainer.max_epochs=1",
          "--trainer.precision=32-true", *QUIET])  # fmt: skip
    # Table 6 aggregated over fabricated runs, one of which recorded undefined scores (NaN: an older run's)
    spec_file = tmp_path / "bench.yaml"
    spec_file.write_text(yaml.safe_dump({
        "output": str(tmp_path / "bench"), "table": "table6", "objectives": ["ce", "core"], "seeds": [0, 1],
        "datasets": {"voc": ["--task=segmentation", f"--data.root={voc}"]},
    }))  # fmt: skip
    for k, bench_run in enumerate(BenchSpec.from_yaml(spec_file).runs()):
        bench_run.run_dir.mkdir(parents=True)
        (bench_run.run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"task": "segmentation"}}))
        score = "NaN" if (bench_run.objective, bench_run.seed) == ("ce", 1) else str(0.5 + 0.1 * k)
        test = ", ".join(f'"{key}": {score}' for key in ("mpa", "fwiou", "miou"))
        (bench_run.run_dir / "results.json").write_text(f'{{"test": {{{test}}}, "epochs": 3}}')
    main(["bench", str(spec_file), "--aggregate_only"])
    fabricated = {r.run_dir / "results.json" for r in BenchSpec.from_yaml(spec_file).runs()}

    written = strict_files(tmp_path, but=fabricated)
    assert {path.relative_to(tmp_path).as_posix() for path in written} >= {
        "fit/results.json", "fit/test_results.json", "fit/val_results.json", "knn.json", "seg/results.json",
        "bench/summary.json",
    }  # fmt: skip
    seg = written[tmp_path / "seg" / "results.json"]
    assert isinstance(seg, dict) and seg["best_val_miou"] is None and seg["test"]["miou"] is None
    summary = written[tmp_path / "bench" / "summary.json"]
    assert isinstance(summary, dict)
    assert summary["rows"][0]["columns"]["MIoU"]["n"] == 1  # CE's seed 1 (NaN) is missing, not averaged
