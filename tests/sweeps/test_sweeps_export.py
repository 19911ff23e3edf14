"""``coretune bench --export``: the records of finished runs, which count when copied back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from sweep_helpers import data_root, fabricate

from coretune.cli import main
from coretune.sweeps import BenchSpec, collect_cells, export_records


def test_export_keeps_the_records_of_finished_runs_which_count_when_copied_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    entries = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2]}
    config.write_text(yaml.safe_dump(entries))
    spec = BenchSpec.from_yaml(config)
    fabricate(spec, {("ce", "d", 1.0): [0.70, 0.72, None]})
    for run in spec.runs()[:2]:
        (run.run_dir / "checkpoints").mkdir()
        (run.run_dir / "checkpoints" / "last.ckpt").write_bytes(b"weights")
        (run.run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n1,0.7\n")
        (run.run_dir / "log.txt").write_text("log\n")
    for name in ("robust_results.json", "robust_results_autoattack.json"):  # coretune eval robust's, kept too
        (spec.runs()[0].run_dir / name).write_text("{}\n")
    unfinished = spec.runs()[2].run_dir
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.csv").write_text("epoch,val/top1\n0,\n")
    records = tmp_path / "records"
    main(["bench", str(config), "--export", str(records)])
    assert "copied the records of 2 finished or diverged run(s)" in capsys.readouterr().out
    kept = sorted(str(p.relative_to(records)) for p in records.rglob("*") if p.is_file())
    assert kept == sorted(
        ["d/ce/frac1/seed0/robust_results.json", "d/ce/frac1/seed0/robust_results_autoattack.json"]
        + [f"d/ce/frac1/seed{s}/{f}" for s in (0, 1) for f in ("metrics.csv", "results.json")]
    )
    # a robustness file moved out of the run (bench refuses it in a table): the next export drops its copy
    (spec.runs()[0].run_dir / "robust_results_autoattack.json").rename(tmp_path / "aside.json")
    (records / "d/ce/frac1/seed0/notes.txt").write_text("mine")  # not a record file: kept
    main(["bench", str(config), "--export", str(records), "--only_seeds=[0]"])
    assert sorted(p.name for p in (records / "d/ce/frac1/seed0").iterdir()) == [
        "metrics.csv", "notes.txt", "results.json", "robust_results.json"
    ]  # fmt: skip
    capsys.readouterr()
    main(["bench", str(config), "--export", str(records), "--only_seeds=[1]"])
    assert "copied the records of 1 finished or diverged run(s)" in capsys.readouterr().out
    assert not (spec.output / "summary.md").exists()  # --export alone runs and writes nothing else
    main(["bench", str(config), "--export", str(records), "--aggregate_only"])  # both, in one command
    out = capsys.readouterr().out
    assert "copied the records of 2 finished or diverged run(s)" in out and "| ce | **71.00 ± 1.41 (n=2)** |" in out
    assert (spec.output / "summary.md").is_file()
    with pytest.raises(ValueError, match="is the spec's output folder"):
        export_records(spec, spec.output)
    shutil.rmtree(spec.output)  # the machine (and its runs/) is gone; the records are back
    shutil.copytree(records, spec.output)
    main(["bench", str(config), "--aggregate_only"])
    assert "| ce | **71.00 ± 1.41 (n=2)** |" in (spec.output / "summary.md").read_text()
    assert [r.status for r in collect_cells(spec)[1]] == ["finished", "finished", "missing"]
