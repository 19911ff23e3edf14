"""Run claims: a sweep's fit holds its run directory, and sweeps of one spec share its runs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from sweep_helpers import data_root, spec_of

from coretune.cli import main
from coretune.runs.claim import claim_run, point_claim
from coretune.runs.layout import RunDir
from coretune.sweeps import BenchSpec, launch, launch_fit, run_sweep


def test_launch_fit_claims_the_run_for_its_fit_until_it_exits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --status tells a running fit from an interrupted one, and a second sweep skips it, by RUN/fit.pid: the fit's
    # claim while it runs, gone after.
    script = (
        "import json, os, sys, time; from pathlib import Path; claim = Path(sys.argv[1]) / 'fit.pid'\n"
        "deadline = time.monotonic() + 30\n"
        "while json.loads(claim.read_text())['pid'] != os.getpid() and time.monotonic() < deadline: time.sleep(0.02)\n"
        "print('claimed', json.loads(claim.read_text())['pid'] == os.getpid())"
    )
    command = [sys.executable, "-c", script]
    monkeypatch.setattr("coretune.sweeps.launch.fit_command", lambda args, run_dir: [*command, str(run_dir)])
    assert launch_fit([], tmp_path / "run") == 0
    assert "claimed True" in (tmp_path / "run" / "log.txt").read_text()
    assert not (tmp_path / "run" / "fit.pid").exists()


def _finishing_fit(monkeypatch: pytest.MonkeyPatch, launches: Path, seconds: float = 0.0) -> None:
    """Stand in for the fit subprocess: it sleeps ``seconds``, appends its run directory to ``launches`` and writes
    finished results."""
    script = (
        "import json, sys, time; from pathlib import Path; run = Path(sys.argv[1]); time.sleep(float(sys.argv[2]))\n"
        "with open(sys.argv[3], 'a') as f: f.write(f'{run}\\n')\n"
        "(run / 'results.json').write_text(json.dumps({'test': {'top1': 0.5}}))"
    )
    monkeypatch.setattr(
        "coretune.sweeps.launch.fit_command",
        lambda args, run_dir: [sys.executable, "-c", script, str(run_dir), str(seconds), str(launches)],
    )


def test_a_sweep_skips_the_runs_another_process_is_running(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    other_process: subprocess.Popen,
) -> None:
    # A second `coretune bench` of the same spec (another terminal, another machine) must not train a run twice.
    monkeypatch.setenv("COLUMNS", "200")
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    config.write_text(
        yaml.safe_dump(
            {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2]}
        )
    )
    spec = BenchSpec.from_yaml(config)
    _finishing_fit(monkeypatch, tmp_path / "launches.txt")
    busy = spec.runs()[1].run_dir
    busy.mkdir(parents=True)
    claim_run(busy)
    point_claim(busy, other_process.pid)
    main(["bench", str(config)])
    out = capsys.readouterr().out
    assert re.search(
        rf"↷ d/ce/frac1/seed1 skipped: .*seed1 is being run by another process \(pid {other_process.pid}\)", out
    )
    assert "1 run(s) skipped: another process is running them" in out
    assert "▶ d/ce/frac1/seed1" not in out  # no "started" line for a run this sweep did not start
    assert "▶ d/ce/frac1/seed0 started" in out and "▶ d/ce/frac1/seed2 started" in out
    assert sorted(os.listdir(busy)) == ["fit.pid"]  # nothing of the other process's run touched
    assert (tmp_path / "launches.txt").read_text().split() == [str(r.run_dir) for r in spec.subset(seeds=[0, 2]).runs()]
    main(["bench", str(config), "--status"])
    assert re.search(r"│ 1 +│ +│ running, 0 epochs done", capsys.readouterr().out)
    other_process.kill()  # the other process is gone: its claim is stale
    other_process.wait()
    main(["bench", str(config)])  # the other process is gone (killed: its claim is stale): this sweep runs seed 1
    assert (tmp_path / "launches.txt").read_text().split()[2:] == [str(busy)]
    assert RunDir(busy).is_finished() and not (busy / "fit.pid").exists()


def test_two_sweeps_of_one_spec_share_its_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each run is trained once, by whichever sweep claims it first; the other skips it.
    spec = spec_of(tmp_path, objectives=["ce", "core"], seeds=[0, 1])
    _finishing_fit(monkeypatch, tmp_path / "launches.txt", seconds=0.3)
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda _: run_sweep(spec, workers=2, console=Console(file=io.StringIO())), range(2)))
    launched = (tmp_path / "launches.txt").read_text().split()
    assert sorted(launched) == sorted(str(r.run_dir) for r in spec.runs())  # each run once
    assert all(not (r.failed or r.interrupted or r.not_started) for r in reports)
    assert all(RunDir(r.run_dir).is_finished() and not (r.run_dir / "fit.pid").exists() for r in spec.runs())


def test_a_run_another_sweep_finished_before_the_claim_is_not_this_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the other sweep finished seed 0 between this sweep's listing and its claim: it was printed "✓ … (0 s)" and
    # counted among the runs this sweep finished
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0])
    real = launch.claimed

    @contextlib.contextmanager
    def finished_meanwhile(run_dir: Path) -> Iterator[None]:
        (Path(run_dir) / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        with real(run_dir):
            yield

    monkeypatch.setattr(launch, "claimed", finished_meanwhile)
    monkeypatch.setattr(launch, "fit_command", lambda args, run_dir: pytest.fail("no fit starts"))
    console = Console(record=True, width=200)
    report = run_sweep(spec, console=console)
    assert report.finished == [] and report.skipped == spec.runs()
    assert "↷ tiny/ce/frac1/seed0: finished by another process" in console.export_text()
    assert launch_fit([], spec.runs()[0].run_dir) is None  # no fit, and no exit code
