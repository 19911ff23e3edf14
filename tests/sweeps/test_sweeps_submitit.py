"""``coretune bench --launcher submitit``: the runs as submitit jobs (its LocalExecutor: real processes, no SLURM)
give the runs and tables of the local launcher, a pre-empted job saves, is requeued and resumes, a failing job is
named with its log; the SLURM options reach the ``sbatch`` script (a fake ``sbatch`` records it)."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from coretune.cli import main
from coretune.runs.claim import read_claim
from fit_flags import TINY_FIT, error

pytest.importorskip("submitit")

TESTS = Path(__file__).resolve().parents[1]
SPEC_ARGS = [*TINY_FIT, "--trainer.max_epochs=2", "--trainer.callbacks+=fit_flags.PauseForStopRequest"]
LOCAL_JOBS = ["--launcher", "submitit", "--launcher.cluster", "local", "--launcher.gpus_per_run=0"]
TIMES = ("wall_time_s", "cpu_time_s", "train_time_s", "images_per_s", "train_images_per_s", "run_dir")


def _spec(folder: Path, name: str, tree: Path, **entries: object) -> Path:
    raw = {
        "name": "tiny",
        "output": str(folder / name),
        "base_args": [*SPEC_ARGS, f"--data.root={tree}"],
        "datasets": {"tiny": []},
        "objectives": ["ce", "core"],
        "seeds": [0],
        **entries,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _bench(*args: object) -> subprocess.Popen:
    paths = [p for p in (os.environ.get("PYTHONPATH"), str(TESTS)) if p]  # the fits import fit_flags
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "coretune.cli", "bench", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One spec (2 objectives, 1 seed, 2 epochs) run by both launchers at once, the submitit job of
    ``ce``/seed 0 pre-empted mid-epoch (its warning signal, SIGUSR2, sent to the job's process once its fit paused
    in epoch 2), and a one-run spec whose fit fails, as submitit jobs."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("submitit")
    tree = make_image_tree(base / "data")
    not_weights = base / "not_weights.pth"
    not_weights.write_text("not a checkpoint\n")
    bad = {"objectives": [{"name": "bad", "objective": "ce", "args": [f"--model.weights={not_weights}"]}]}
    specs = {
        "jobs": _spec(base, "jobs", tree),
        "local": _spec(base, "local", tree),
        "bad": _spec(base, "bad", tree, seeds=[0], **bad),
    }
    preempted = base / "jobs" / "tiny" / "ce" / "frac1" / "seed0"
    preempted.mkdir(parents=True)
    (preempted / "pause_here").touch()
    procs = {
        "jobs": _bench(specs["jobs"], *LOCAL_JOBS, "--launcher.cpus_per_run=1"),
        "local": _bench(specs["local"], "--workers=2"),
        "bad": _bench(specs["bad"], *LOCAL_JOBS),
    }
    deadline = time.monotonic() + 600
    while not (preempted / "paused").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    claim = read_claim(preempted)
    assert claim is not None, "the job's fit never reached its pause"
    os.kill(_parent(claim.pid), signal.SIGUSR2)  # the fit's parent: the job's process, which submitit's handler runs
    outputs = {name: proc.communicate(timeout=900)[0] for name, proc in procs.items()}
    codes = {name: proc.returncode for name, proc in procs.items()}
    return {"base": base, "outputs": outputs, "codes": codes, "preempted": preempted}


def _rows(table: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIMES} for row in csv.DictReader(table.open())]


def test_the_jobs_give_the_runs_and_tables_of_the_local_launcher(swept: dict) -> None:
    base, outputs, codes = swept["base"], swept["outputs"], swept["codes"]
    assert codes["jobs"] == codes["local"] == 0, outputs
    assert "2 to run as submitit jobs (local)" in outputs["jobs"] and "submitted 2 job(s)" in outputs["jobs"]
    assert len(re.findall(r"^✓ tiny/\w+/frac1/seed\d: test top-1 ", outputs["jobs"], re.M)) == 2
    jobs, local = base / "jobs", base / "local"
    runs = sorted(p.relative_to(local) for p in local.glob("tiny/*/frac1/seed*"))
    assert len(runs) == 2
    for run in runs:
        assert (jobs / run / "fit_args.json").read_text() == (local / run / "fit_args.json").read_text()
        ours, theirs = (json.loads((root / run / "results.json").read_text()) for root in (jobs, local))
        assert ours["test"] == theirs["test"], run
        record = json.loads((jobs / run / "job.json").read_text())
        assert record["cluster"] == "local" and Path(record["stderr"]).is_file()
    assert _rows(jobs / "runs.csv") == _rows(local / "runs.csv")
    assert (jobs / "summary.csv").read_text() == (local / "summary.csv").read_text()
    # a re-run submits nothing: every run is finished
    main(["bench", str(base / "jobs.yaml"), *LOCAL_JOBS, "--launcher.cpus_per_run=1"])
    assert sorted(p.name for p in (jobs / ".submitit").iterdir() if p.name != "%j") == sorted(
        json.loads((jobs / r / "job.json").read_text())["job_id"] for r in runs
    )


def test_a_preempted_job_saves_is_requeued_and_resumes(swept: dict) -> None:
    run = swept["preempted"]
    log = (run / "log.txt").read_text()
    launches = re.findall(r"^# .*$", log, re.M)
    assert len(launches) == 2 and "--ckpt_path=last" not in launches[0] and launches[1].endswith("--ckpt_path=last")
    assert "coretune fit: stopped by SIGTERM at epoch " in log  # a mid-epoch checkpoint, through the stop file
    assert (run / "paused").exists() and not (run / "pause_here").exists()
    record = json.loads((run / "job.json").read_text())
    job_log = Path(record["stdout"]).read_text() + Path(record["stderr"]).read_text()
    assert "Calling checkpoint method" in job_log and "Requeued job" in job_log
    assert [r["epoch"] for r in csv.DictReader((run / "metrics.csv").open())] == ["0", "1"]


def test_a_failing_job_is_reported_with_its_log(swept: dict) -> None:
    out, log = swept["outputs"]["bad"], swept["base"] / "bad" / "tiny" / "bad" / "frac1" / "seed0" / "log.txt"
    assert swept["codes"]["bad"] == 1
    assert "✗ tiny/bad/frac1/seed0 failed (job " in out and f"see {log}" in out
    assert f"coretune bench: error: of 1 runs, 1 failed (see {log})" in out
    assert "Traceback" not in out


def test_the_slurm_options_reach_the_sbatch_script_and_status_names_the_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sweep_helpers import data_root

    bin_dir, script = tmp_path / "bin", tmp_path / "sbatch_script.sh"
    bin_dir.mkdir()
    fakes = {
        "srun": "exit 0",
        "sbatch": f'cp "$1" {script}\necho "Submitted batch job 4242"',
        "sacct": 'echo "JobID|State|NodeList"; for i in 0 1 2 3; do echo "4242_$i|PENDING|"; done',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    spec = tmp_path / "spec.yaml"
    out = tmp_path / "out"
    spec.write_text(yaml.safe_dump({
        "output": str(out), "base_args": TINY_FIT, "datasets": {"tiny": [f"--data.root={data_root(tmp_path)}"]},
        "objectives": ["ce", "core"], "seeds": [0, 1],
    }))  # fmt: skip
    args = [
        "bench", str(spec), "--launcher", "submitit", "--launcher.partition=gpu", "--launcher.gpus_per_run=2",
        "--launcher.cpus_per_run=8", "--launcher.timeout_min=600", "--launcher.mem_gb=32", "--launcher.account=proj",
        '--launcher.additional={"qos": "high", "constraint": "a100"}', "--launcher.array_parallelism=2",
        "--launcher.wait=false",
    ]  # fmt: skip
    main(args)
    text = script.read_text()
    for line in (
        "--partition=gpu", "--gpus-per-node=2", "--cpus-per-task=8", "--time=600", "--mem=32GB", "--account=proj",
        "--qos=high", "--constraint=a100", "--array=0-3%2", "--signal=USR2@120", "--nodes=1", "--ntasks-per-node=1",
        f"--output={out}/.submitit/%A_%a/%A_%a_0_log.out", "--job-name=coretune-spec",
    ):  # fmt: skip
        assert f"#SBATCH {line}\n" in text, line
    assert "submitit.core._submit" in text and "srun" in text
    records = [json.loads(p.read_text()) for p in sorted(out.glob("tiny/*/frac1/seed*/job.json"))]
    assert sorted(r["job_id"] for r in records) == [f"4242_{i}" for i in range(4)]
    script.unlink()
    capsys.readouterr()
    main(args)  # the jobs are still queued (sacct): nothing is submitted again
    assert not script.exists() and capsys.readouterr().out.count("already submitted, job 4242_") == 4
    main(["bench", str(spec), "--status"])
    assert capsys.readouterr().out.count("(PENDING)") == 4


def test_launcher_settings_are_checked_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sweep_helpers import data_root

    spec = tmp_path / "spec.yaml"
    raw = {
        "output": str(tmp_path / "out"),
        "datasets": {"t": [f"--data.root={data_root(tmp_path)}"]},
        "objectives": ["ce"],
    }
    spec.write_text(yaml.safe_dump(raw))
    assert error(["bench", str(spec), "--launcher.partition=gpu"]).startswith(
        "--launcher.partition is a setting of --launcher submitit"
    )
    with pytest.raises(SystemExit):
        main(["bench", str(spec), "--launcher", "slurm"])
    assert "--launcher.name: expected one of 'local', 'submitit', got slurm" in capsys.readouterr().err
    assert error(["bench", str(spec), "--launcher=submitit", "--launcher.gpus_per_run=-1"]) == (
        "--launcher.gpus_per_run must be an integer >= 0 (got -1)"
    )
    assert "cannot return before them" in error(
        ["bench", str(spec), "--launcher", "submitit", "--launcher.cluster=debug", "--launcher.wait=false"]
    )
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no srun
    assert "no SLURM here (srun is not on the PATH)" in error(["bench", str(spec), "--launcher", "submitit"])


def test_the_documented_slurm_commands_parse() -> None:
    from coretune.sweeps.bench import _launcher, _parser, launcher_args

    text = (TESTS.parent / "docs" / "scaling.md").read_text()
    section = text.partition("## A paper table on a SLURM cluster")[2].partition("\n## ")[0]
    commands = [c for c in re.findall(r"^coretune bench .*?(?<!\\)$", section.replace("\\\n", ""), re.M)]
    assert len(commands) >= 3
    for command in commands:
        words = shlex.split(command, comments=True)[2:]
        _launcher(_parser().parse_args(launcher_args(words)))
