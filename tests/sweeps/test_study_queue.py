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
    loops = re.findall(r'for obj in ([^;]+); do (fit "\$(\w+)"|adversarial)', TEXT)
    assert len(loops) == 5
    for objectives, call, variable in loops:
        spec = variable or "ADV"
        assert call.startswith("fit") or call == "adversarial"
        missing = set(objectives.split()) - _names(spec)
        assert not missing, f"{spec} has no rows {missing}"
    for table1_name, memory_name in re.findall(r"(\w+):(\w+)", re.search(r"for pair in ([^;]+);", TEXT)[1]):
        assert table1_name in _names("TABLE1") and memory_name in _names("MEMORY")


def test_the_pretrainings_write_what_the_strength_columns_read() -> None:
    written = set()
    for directory, snapshots in re.findall(r"^\s*pretrain \w+ (\S+) '\[([\d, ]+)\]'", TEXT, flags=re.M):
        written |= {f"{directory}/pretrained-epoch{e.strip()}.pth.tar" for e in snapshots.split(",")}
    spec = BenchSpec.from_yaml(ROOT / SPECS["STRENGTH"])
    read = {
        arg.split("=", 1)[1] for args in spec.datasets.values() for arg in args if arg.startswith("--model.weights")
    }
    assert {path for path in read if path.startswith("runs/")} == written


def test_the_one_percent_rows_wait_for_the_strongest_column() -> None:
    """The queue compares the name ``strength_gain.py evaluate`` prints with the 1% spec's last column."""
    printed = re.search(
        r"strongest by kNN top-1: \{strongest\}", (ROOT / "benchmarks" / "strength_gain.py").read_text()
    )
    assert printed is not None and "s/^strongest by kNN top-1: " in TEXT
    last = list(BenchSpec.from_yaml(ROOT / SPECS["STRENGTH_1PCT"]).datasets)[-1]
    assert last in BenchSpec.from_yaml(ROOT / SPECS["STRENGTH"]).datasets
    listed = subprocess.run(
        ["sed", "-n", r"s/^  \([A-Za-z0-9_]*\): \[.*/\1/p", str(ROOT / SPECS["STRENGTH_1PCT"])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert listed[-1] == last and listed == list(BenchSpec.from_yaml(ROOT / SPECS["STRENGTH_1PCT"]).datasets)
