"""``coretune bench --aggregate_only`` on the committed run records (docs/records) prints and writes exactly the
tables captured in tests/golden/: a refactoring of the sweep code changes no number, line or file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from coretune.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
#: record folder (docs/records/<name>) → its bench spec
RECORDS = {
    "cifar10-cpu-100pct-e20": "cifar10_cpu_100pct_e20.yaml",
    "cifar10-cpu-10pct-epochs-val": "cifar10_cpu_10pct_epochs_val.yaml",
    "cifar10-cpu-1pct": "cifar10_cpu_1pct.yaml",
}
#: the files --aggregate_only writes that are text (the plots are left out)
WRITTEN = ("summary.md", "summary.csv", "runs.csv", "curves.csv")


def aggregate(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Path | None = None
) -> dict[str, str]:
    """The printed output and written tables of ``bench SPEC --aggregate_only`` over a copy of the records (with
    the file ``damage`` of the copy cut in half), with the temporary output folder written as ``<output>``."""
    output = tmp_path / "out"
    shutil.copytree(ROOT / "docs" / "records" / name, output)
    if damage is not None:
        damage.write_text(damage.read_text()[: len(damage.read_text()) // 2])
    spec = yaml.safe_load((ROOT / "configs" / "bench" / RECORDS[name]).read_text())
    spec_file = tmp_path / RECORDS[name]
    spec_file.write_text(yaml.safe_dump({**spec, "output": str(output)}))
    main(["bench", str(spec_file), "--aggregate_only"])
    texts = {"stdout.txt": capsys.readouterr().out}
    texts.update({file: (output / file).read_text() for file in WRITTEN if (output / file).is_file()})
    return {file: text.replace(str(output), "<output>") for file, text in texts.items()}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_aggregate_only_on_the_records_prints_the_golden_tables(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = aggregate(name, tmp_path, capsys)
    golden = GOLDEN / name
    assert sorted(texts) == sorted(p.name for p in golden.iterdir())
    for file, text in texts.items():
        assert text == (golden / file).read_text(), f"{name}/{file} differs from the golden copy"


def test_a_damaged_record_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "out" / "cifar10" / "core" / "frac0.01" / "seed1" / "results.json"
    with pytest.raises(SystemExit) as info:
        aggregate("cifar10-cpu-1pct", tmp_path, capsys, damage=damaged)
    assert str(info.value.code).startswith(f"coretune bench: error: {damaged} is not valid JSON (")
