"""benchmarks/paired_records.py (issue 64): cells of different specs' records, paired by seed — the mean and std
over seeds, each seed's value, the last epoch's training top-1, and the paired difference with the t-test, checked
against numbers worked out by hand from the records it reads; bad folders are refused in one line."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import ModuleType

import pytest
from scipy.stats import ttest_rel

from benchmark_scripts import load_benchmark


@pytest.fixture
def paired_records(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("paired_records", monkeypatch)


def _record(cell: Path, seed: int, top1: float | None, train: list[float]) -> None:
    run = cell / "frac0.1" / f"seed{seed}"
    run.mkdir(parents=True)
    results = {"test": {"top1": top1}} if top1 is not None else {"val": {"top1": 0.5}}  # None: an unfinished run
    (run / "results.json").write_text(json.dumps(results))
    rows = ["epoch,train/top1,val/top1", *(f"{i},{t},{'' if i < len(train) - 1 else 0.1}" for i, t in enumerate(train))]
    (run / "metrics.csv").write_text("\n".join([*rows, f"{len(train)},,0.5"]) + "\n")  # a validation-only last row


def test_the_table_pairs_the_seeds_both_cells_finished(paired_records: ModuleType, tmp_path: Path, capsys) -> None:
    base, other = tmp_path / "spec_a" / "col" / "ce", tmp_path / "spec_b" / "col" / "lora_ce"
    for seed, (a, b) in enumerate([(0.5158, 0.5504), (0.5045, 0.5443), (0.5040, 0.5415)]):
        _record(base, seed, a, [0.2, 0.395 - seed / 100])
        _record(other, seed, b, [0.3, 0.431])
    _record(other, 3, 0.60, [0.5])  # a seed the baseline lacks: in the cell's mean, not in the pairs
    _record(base, 4, None, [0.1])  # unfinished: left out
    assert paired_records.main([str(base), str(other)]) == 0
    out = capsys.readouterr().out
    a, b = [51.58, 50.45, 50.40], [55.04, 54.43, 54.15, 60.0]
    diffs = [y - x for x, y in zip(a, b[:3], strict=False)]
    test = ttest_rel(b[:3], a)
    base_row = next(line for line in out.splitlines() if line.startswith("| spec_a/col/ce |"))
    row = next(line for line in out.splitlines() if line.startswith("| spec_b/col/lora_ce |"))
    assert f"{statistics.mean(a):.2f} ± {statistics.stdev(a):.2f}" in base_row
    assert "51.58 / 50.45 / 50.40 (seeds 0, 1, 2)" in base_row and "39.5 / 38.5 / 37.5" in base_row
    assert f"| {statistics.mean(b):.2f} ± {statistics.stdev(b):.2f} |" in row and "(seeds 0, 1, 2, 3)" in row
    assert f"{statistics.mean(diffs):+.2f}: " + " / ".join(f"{d:+.2f}" for d in diffs) in row
    assert f"{test.statistic:.1f} ({test.pvalue:.3g})" in row
    assert "43.1 / 43.1 / 43.1 / 50.0" in row


def test_bad_folders_are_refused_in_one_line(paired_records: ModuleType, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"^paired_records: not a folder: .*missing"):
        paired_records.main([str(tmp_path / "missing"), str(empty)])
    with pytest.raises(SystemExit, match=r"^paired_records: give a baseline cell and at least one"):
        paired_records.main([str(empty)])
    with pytest.raises(SystemExit, match=r"^paired_records: no finished run .* under .*empty$"):
        paired_records.main([str(empty), str(empty)])
    twice = tmp_path / "twice"
    _record(twice / "a", 0, 0.5, [0.4])
    _record(twice / "b", 0, 0.5, [0.4])
    with pytest.raises(SystemExit, match=r"holds two runs of seed 0: name one cell per folder"):
        paired_records.main([str(twice), str(twice)])
