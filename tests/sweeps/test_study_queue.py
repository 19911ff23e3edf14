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
SPECS = dict(re.findall(r"^([A-Z0-9]+)=(configs/bench/\S+\.yaml)$", TEXT, flags=re.M))


def _names(variable: str) -> set[str]:
    return {objective.name for objective in BenchSpec.from_yaml(ROOT / SPECS[variable]).objectives}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_queued_row_is_in_its_spec() -> None:
    assert set(SPECS) == {"MEMORY", "ADV", "TABLE1", "STRENGTH"}
    loops = re.findall(r'for obj in ([^;]+); do (fit "\$(\w+)"|adversarial)', TEXT)
    assert len(loops) == 4
    for objectives, call, variable in loops:
        spec = variable or "ADV"
        assert call.startswith("fit") or call == "adversarial"
        missing = set(objectives.split()) - _names(spec)
        assert not missing, f"{spec} has no rows {missing}"
    for table1_name, memory_name in re.findall(r"(\w+):(\w+)", re.search(r"for pair in ([^;]+);", TEXT)[1]):
        assert table1_name in _names("TABLE1") and memory_name in _names("MEMORY")


def test_the_pretrainings_write_what_the_strength_columns_read() -> None:
    written = set()
    for directory, snapshots in re.findall(r"^pretrain \w+ (\S+) '\[([\d, ]+)\]'", TEXT, flags=re.M):
        written |= {f"{directory}/pretrained-epoch{e.strip()}.pth.tar" for e in snapshots.split(",")}
    spec = BenchSpec.from_yaml(ROOT / SPECS["STRENGTH"])
    read = {
        arg.split("=", 1)[1] for args in spec.datasets.values() for arg in args if arg.startswith("--model.weights")
    }
    assert {path for path in read if path.startswith("runs/")} == written
