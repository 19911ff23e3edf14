"""benchmarks/study_queue.sh: every run the queue asks for is a row of its spec, and the pre-trainings it makes are the
files the strength spec's columns read (a typo there would surface only hours into an unattended queue)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coretune.runs.claim import RunClaim
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
    assert set(SPECS) == {"MEMORY", "ADV", "LR01", "TABLE1", "STRENGTH", "STRENGTH_1PCT"}
    loops = re.findall(r'for obj in ([^;]+); do\s+(fit "\$([A-Z0-9_]+)"|adversarial)', TEXT)
    assert len(loops) == 4
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


def test_the_one_percent_rows_go_to_the_strongest_column_of_the_same_checkpoints() -> None:
    """The queue reads the name ``strength_gain.py evaluate`` prints once every column is scored, and the 1% spec
    lists every column of the 10% spec, with the same arguments, so whichever is the strongest can run."""
    printed = "strongest by kNN top-1{' so far' if unscored else ''}: {strongest}"
    assert printed in (ROOT / "benchmarks" / "strength_gain.py").read_text()
    assert "s/^strongest by kNN top-1: " in TEXT  # the line once every column is scored, not "so far"
    one, ten = (BenchSpec.from_yaml(ROOT / SPECS[k]) for k in ("STRENGTH_1PCT", "STRENGTH"))
    assert one.datasets == ten.datasets
    assert one.objectives == ten.objectives and one.seeds == ten.seeds


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def queue(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A worktree holding the script and the real specs, with stubs for .venv/bin/coretune and .venv/bin/python,
    and MAIN: a checkout on a branch holding the memory study's committed records (the batch-64 rows, seed 0 at 16)."""
    worktree, main = tmp_path / "wt", tmp_path / "main"
    (worktree / "benchmarks").mkdir(parents=True)
    shutil.copy(SCRIPT, worktree / "benchmarks")
    (worktree / "configs" / "bench").mkdir(parents=True)
    for spec in SPECS.values():
        shutil.copy(ROOT / spec, worktree / spec)
    (worktree / ".venv" / "bin").mkdir(parents=True)
    for role in ("coretune", "python"):
        stub = worktree / ".venv" / "bin" / role
        stub.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).parent / "queue_stub.py"}" {role} "$@"\n')
        stub.chmod(0o755)
    memory = "docs/records/cifar10-cpu-10pct-memory"
    shutil.copytree(ROOT / memory, main / memory)
    _git(main.parent, "init", "-q", "-b", "main", str(main))
    _git(main, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(main, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "memory records")
    return worktree, main, tmp_path / "calls.log"


def _run(worktree: Path, main: Path, log: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "QUEUE_STUB_LOG": str(log), "GIT_AUTHOR_NAME": "q", "GIT_AUTHOR_EMAIL": "q@q",
                   "GIT_COMMITTER_NAME": "q", "GIT_COMMITTER_EMAIL": "q@q", **env}  # fmt: skip
    return subprocess.run(
        ["bash", str(worktree / "benchmarks" / "study_queue.sh"), str(main)],
        capture_output=True, text=True, env=environment, timeout=600,
    )  # fmt: skip


def _recorded(main: Path, name: str, file: str = "results.json") -> list[str]:
    """The committed files of a record folder named ``file`` (or, for ``.json``, ending so)."""
    paths = _git(main, "ls-tree", "-r", "--name-only", "HEAD", f"docs/records/{name}").split()
    return [p for p in paths if (p.endswith(file) if file.startswith(".") else Path(p).name == file)]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("flock") is None, reason="needs bash and flock")
def test_the_queue_records_every_run_and_a_new_machine_resumes_from_the_records(queue: tuple[Path, Path, Path]) -> None:
    worktree, main, log = queue
    diverge = "at_core_linf/1/cifar10,delta/0/cifar10,core_noclip/0/cifar10"  # results: recorded, never fitted again
    stub = {"QUEUE_STUB_DIVERGE": diverge, "QUEUE_STUB_STRONGEST": "simclr_e15"}  # its 1% rows: after a pre-training
    done = _run(worktree, main, log, QUEUE_STUB_FAIL="core/2/simclr_e5", **stub)
    assert done.returncode == 1, done.stdout + done.stderr  # the other runs went on; the failure is named at the end
    assert "queue finished, but 1 run(s) or step(s) failed (FAILED lines above): re-run the queue" in done.stdout
    assert "DIVERGED: at_core_linf seed 1 (recorded, not scored)" in done.stdout
    assert len(_recorded(main, "cifar10-cpu-10pct-memory")) == 18
    assert len(_recorded(main, "cifar10-cpu-10pct-adversarial")) == 12
    assert len(_recorded(main, "cifar10-cpu-10pct-adversarial", "robust_results.json")) == 11
    assert len(_recorded(main, "cifar10-cpu-10pct-adversarial", "robust_results_autoattack.json")) == 4  # seed 0
    assert len(_recorded(main, "cifar10-cpu-10pct-adversarial", "robust_results_sanity_linf8.json")) == 3  # ce
    assert len(_recorded(main, "cifar10-cpu-10pct-table1")) == 33  # 27 fitted; ce and core: the memory study's
    assert len(_recorded(main, "cifar10-cpu-10pct-lr01")) == 4  # the clipped run, the collapse, the two 30-epoch runs
    assert "DIVERGED: cifar10-cpu-10pct-lr01 core_noclip seed 0" in done.stdout
    assert len(_recorded(main, "cifar10-cpu-strength")) == 44  # one failed fine-tune: the others went on
    assert len(_recorded(main, "cifar10-cpu-strength-1pct")) == 18
    assert len(_recorded(main, "cifar10-cpu-strength-eval", ".json")) == 10
    assert _recorded(main, "cifar10-cpu-strength-eval", "gains.md")  # the table and the figure, from the records
    both = f"{SPECS['STRENGTH']} {SPECS['STRENGTH_1PCT']}"
    calls = log.read_text().splitlines()
    scores = [c for c in calls if "strength_gain.py evaluate" in c]
    assert scores and all(both in c and "--refuse_stale" in c for c in scores)  # every column's runs checked
    plots = [c for c in calls if "strength_gain.py plot" in c]
    assert plots and all(both in c and "--footnote simclr_in20 (the shared" in c for c in plots)
    assert _git(main, "ls-tree", "--name-only", "HEAD", "docs/img/strength_gain.png").strip()
    pretrainings = [
        p for p in _git(main, "ls-tree", "-r", "--name-only", "HEAD", "docs/records").split() if "-pretrain/" in p
    ]
    assert sorted(pretrainings) == [
        f"docs/records/cifar10-cpu-strength-pretrain/{d}/{f}"
        for d in ("cifar10-moco-r18-32px", "cifar10-simclr-r18-32px")
        for f in ("commit.txt", "metrics.csv", "results.json")
    ]
    assert len([p for p in _recorded(main, "cifar10-cpu-strength-1pct") if "/simclr_e15/" in p]) == 9
    assert _git(main, "status", "--porcelain") == ""  # every record committed
    calls = log.read_text().splitlines()
    assert sum(c.startswith("pretrain --method simclr") for c in calls) == 1
    # a pre-training made before its records were committed (an older queue) is recorded without being made again
    _git(main, "rm", "-rq", "docs/records/cifar10-cpu-strength-pretrain")
    _git(main, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "drop")
    again = _run(worktree, main, log, QUEUE_STUB_FAIL="core/2/simclr_e5", **stub)
    assert again.returncode == 1  # again on this machine: the diverged runs are not fitted, the failed one again
    assert not [c for c in log.read_text().splitlines()[len(calls) :] if "at_core_linf] --only_seeds [1]" in c]
    assert not [c for c in log.read_text().splitlines()[len(calls) :] if c.startswith("pretrain")]
    assert len(_recorded(main, "cifar10-cpu-strength-pretrain")) == 2
    # a new machine: only the committed records; the failed run is the only one fitted again, after a pre-training
    shutil.rmtree(worktree / "runs")
    log.unlink()
    done = _run(worktree, main, log, **stub)
    assert done.returncode == 0 and "queue finished" in done.stdout, done.stdout + done.stderr
    calls = [c for c in log.read_text().splitlines() if "--export" not in c]
    fits = [c for c in calls if c.startswith("bench ")]
    assert fits == ["bench configs/bench/cifar10_cpu_strength.yaml --only_objectives [core] --only_seeds [2] "
                    "--only_datasets [simclr_e5]"]  # fmt: skip
    assert [c.split()[:3] for c in calls if c.startswith("pretrain")] == [["pretrain", "--method", "simclr"]]
    assert len(_recorded(main, "cifar10-cpu-strength")) == 45


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("flock") is None, reason="needs bash and flock")
def test_the_queue_stops_before_table_1_on_a_machine_of_another_precision(queue: tuple[Path, Path, Path]) -> None:
    worktree, main, log = queue
    done = _run(worktree, main, log, QUEUE_STUB_PRECISION="32-true")
    assert (
        done.returncode == 1
        and "stopped before issue 41's runs: coretune's default precision here is '32-true'" in (done.stdout)
    ), done.stdout + done.stderr
    assert len(_recorded(main, "cifar10-cpu-10pct-adversarial")) == 12  # what came before ran
    table1 = _recorded(main, "cifar10-cpu-10pct-table1")  # only the memory study's ce and core, committed
    assert sorted(p.split("/")[4] for p in table1) == ["ce"] * 3 + ["core"] * 3
    assert not [
        c for c in log.read_text().splitlines() if "cifar10_cpu_10pct_table1.yaml --only_objectives [l2sp]" in c
    ]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("flock") is None, reason="needs bash and flock")
def test_the_queue_never_deletes_a_pretraining_a_live_process_holds(queue: tuple[Path, Path, Path]) -> None:
    """A pre-training started by hand with the spec header's command (its --run_dir) and still running is left
    alone: the queue stops, naming it, where it would otherwise start that folder again from nothing."""
    worktree, main, log = queue
    held = worktree / "runs" / "pretrain" / "cifar10-simclr-r18-32px"
    held.mkdir(parents=True)
    claim = RunClaim.of(os.getpid())  # this process stands for the pre-training started by hand
    (held / "fit.pid").write_text(json.dumps({"pid": claim.pid, "host": claim.host, "started": claim.started}))
    (held / "pretrained-epoch5.pth.tar").write_text("epoch 5 of a pre-training started by hand")
    done = _run(worktree, main, log)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"stopped: runs/pretrain/cifar10-simclr-r18-32px is in use by pid {os.getpid()} (its fit.pid)" in done.stdout
    assert (held / "pretrained-epoch5.pth.tar").read_text() == "epoch 5 of a pre-training started by hand"
    assert not [c for c in log.read_text().splitlines() if c.startswith("pretrain --method simclr")]
    # the claim of a process that died, its pid now another's (another start time): stale, the folder made again
    (held / "fit.pid").write_text(json.dumps({"pid": claim.pid, "host": claim.host, "started": 0.0}))
    done = _run(worktree, main, log)
    assert "is in use by" not in done.stdout, done.stdout + done.stderr
    assert [c for c in log.read_text().splitlines() if c.startswith("pretrain --method simclr")]
    assert (held / "pretrained-epoch5.pth.tar").read_text() == "simclr epoch 5"  # the stub's, not the stale one
