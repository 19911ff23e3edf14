"""benchmarks/study_queue.sh: every run the queue asks for is a row of its spec, and the pre-trainings it makes are the
files the strength spec's columns read (a typo there would surface only hours into an unattended queue)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from coretune.sweeps import BenchSpec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "study_queue.sh"
TEXT = SCRIPT.read_text()
SPECS = dict(re.findall(r"^\s*([A-Z0-9_]+)=(configs/bench/\S+\.yaml)$", TEXT, flags=re.M))


def _names(variable: str) -> set[str]:
    return {objective.name for objective in BenchSpec.from_yaml(ROOT / SPECS[variable]).objectives}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_it_needs_the_checkout_that_receives_the_records(tmp_path: Path) -> None:
    """Without MAIN, or with a folder that is not a checkout on a branch, it stops before anything runs."""
    for args in ([], [str(tmp_path)]):
        done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout.count("\n") == 1, done.stdout + done.stderr


def test_every_queued_row_is_in_its_spec() -> None:
    assert set(SPECS) == {"MEMORY", "ADV", "TABLE1", "STRENGTH", "STRENGTH_1PCT"}
    loops = re.findall(r'for obj in ([^;]+); do (fit "\$([A-Z0-9_]+)"|adversarial)', TEXT)
    assert len(loops) == 3
    for objectives, _call, variable in loops:
        spec = variable or "ADV"
        missing = set(objectives.split()) - _names(spec)
        assert not missing, f"{spec} has no rows {missing}"
    for table1_name, memory_name in re.findall(r"(\w+):(\w+)", re.search(r"for pair in ([^;]+);", TEXT)[1]):
        assert table1_name in _names("TABLE1") and memory_name in _names("MEMORY")
    column_rows = re.search(r"strength_column\(\) \{.*?for obj in ([^;]+);", TEXT, flags=re.S)
    assert column_rows is not None
    assert set(column_rows[1].split()) == _names("STRENGTH") == _names("STRENGTH_1PCT")


def test_every_strength_column_is_made_by_the_pretraining_whose_file_it_reads() -> None:
    """Each ``strength_column NAME MAKER`` pre-trains (MAKER) into the folder NAME's weights are read from, and the
    snapshots that pre-training keeps are the files the columns read."""
    made: dict[str, set[str]] = {}
    for maker, directory, snapshots in re.findall(r"^\s*(\w+)\) dir=(\S+) snaps='\[([\d, ]+)\]'", TEXT, flags=re.M):
        made[maker] = {f"{directory}/pretrained-epoch{e.strip()}.pth.tar" for e in snapshots.split(",")}
    assert set(made) == {"simclr", "moco_v2"}
    spec = BenchSpec.from_yaml(ROOT / SPECS["STRENGTH"])
    weights = {
        name: next((arg.split("=", 1)[1] for arg in args if arg.startswith("--model.weights")), None)
        for name, args in spec.datasets.items()
    }
    columns = dict(re.findall(r"^\s*strength_column (\w+) (\S+) \|\|", TEXT, flags=re.M))
    assert set(columns) == set(spec.datasets)
    for name, maker in columns.items():
        if maker == "-":
            assert weights[name] is None or not weights[name].startswith("runs/"), name
        else:
            assert weights[name] in made[maker], name
    assert set().union(*made.values()) == {path for path in weights.values() if path and path.startswith("runs/")}


def test_the_one_percent_rows_wait_for_the_strongest_column() -> None:
    """The queue compares the name ``strength_gain.py evaluate`` prints with the 1% spec's last column."""
    printed = "strongest by kNN top-1{' so far' if unscored else ''}: {strongest}"
    assert printed in (ROOT / "benchmarks" / "strength_gain.py").read_text()
    assert "s/^strongest by kNN top-1: " in TEXT  # the line once every column is scored, not "so far"
    last = list(BenchSpec.from_yaml(ROOT / SPECS["STRENGTH_1PCT"]).datasets)[-1]
    assert last in BenchSpec.from_yaml(ROOT / SPECS["STRENGTH"]).datasets
    listed = subprocess.run(
        ["sed", "-n", r"s/^  \([A-Za-z0-9_]*\): \[.*/\1/p", str(ROOT / SPECS["STRENGTH_1PCT"])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert listed[-1] == last and listed == list(BenchSpec.from_yaml(ROOT / SPECS["STRENGTH_1PCT"]).datasets)
