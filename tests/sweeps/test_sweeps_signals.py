"""A sweep stopped by SIGINT or SIGTERM: no further run starts, the running fits save a resumable checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from sweep_helpers import data_root, spec_of

from coretune.cli import main
from coretune.runs.layout import RunDir
from coretune.sweeps import launch_fit, run_sweep
from fit_flags import TINY_FIT


def _fake_fits(monkeypatch: pytest.MonkeyPatch, outcome: dict[int, int]) -> list[int]:
    """Replace the fit subprocess: seed ``s`` exits with ``outcome.get(s, 0)``, writing results.json on 0; a negative
    outcome ``-N`` delivers signal N to this process (as Ctrl+C or a SIGTERM would) and exits ``128 + N``."""
    launched: list[int] = []

    def launch(args: list[str], run_dir: Path, env: object = None, stop: object = None, log_args: object = ()) -> int:
        seed = int(next(a for a in args if a.startswith("--seed=")).split("=")[1])
        launched.append(seed)
        code = outcome.get(seed, 0)
        if code < 0:
            os.kill(os.getpid(), -code)
            time.sleep(0.5)  # the fit finishes its batch and saves last.ckpt
            return 128 - code
        if code == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        return code

    monkeypatch.setattr("coretune.sweeps.launch.launch_fit", launch)
    return launched


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_the_sweep_and_reports_resumable_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: int
) -> None:
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    entries = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": [0, 1, 2, 3]}
    config.write_text(yaml.safe_dump(entries))
    launched = _fake_fits(monkeypatch, {1: -signum})
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        main(["bench", str(config)])
    assert stop.value.code == 128 + signum  # the shell convention, as `coretune fit`
    assert launched == [0, 1]  # no run starts after the signal
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    out, err = capsys.readouterr()
    assert "seed1 interrupted" in out and "failed" not in out
    name = signal.Signals(signum).name
    assert re.search(rf"stopped by {name}: 1 run\(s\) finished, 1 interrupted .*, 2 not started", err)
    assert "Re-run the same command to resume" in err

    launched = _fake_fits(monkeypatch, {})
    main(["bench", str(config)])  # the re-run skips seed 0 and runs the rest
    assert launched == [1, 2, 3]


def test_an_interrupted_fit_is_reported_as_resumable_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1, 2])
    _fake_fits(monkeypatch, {0: 130, 1: 1})  # seed 0 killed on its own (kill -INT <fit pid>), seed 1 crashed
    report = run_sweep(spec)
    assert [r.seed for r in report.interrupted] == [0] and [r.seed for r in report.failed] == [1]
    assert [r.seed for r in report.finished] == [2] and report.signum is None and report.not_started == []


def test_a_fit_killed_by_a_second_signal_is_interrupted_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl+C or SIGTERM ends a fit by the signal's default action (return code -2 / -15), before it saves:
    it resumes from its last epoch's checkpoint, or from the start; it was reported as failed."""
    from rich.console import Console

    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1, 2])
    runs = spec.runs()
    last = RunDir(runs[1].run_dir).last_checkpoint
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")  # seed 1 had saved an epoch
    monkeypatch.setattr(
        "coretune.sweeps.launch.launch_fit",
        lambda args, run_dir, env=None, stop=None, log_args=(): {runs[0].run_dir: -2, runs[1].run_dir: -15}.get(
            Path(run_dir), 1
        ),
    )
    console = Console(record=True, width=300)
    report = run_sweep(spec, console=console)
    assert [r.seed for r in report.interrupted] == [0, 1] and [r.seed for r in report.failed] == [2]
    out = console.export_text()
    assert "seed0 killed by SIGINT after 0 s, before it could save (a second signal); it resumes from its start" in out
    assert f"seed1 killed by SIGTERM after 0 s, before it could save (a second signal); it resumes from {last}" in out
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    config.write_text(yaml.safe_dump({"output": str(tmp_path / "out2"), "datasets": datasets, "objectives": ["ce"]}))
    _fake_fits(monkeypatch, {0: 130})
    with pytest.raises(SystemExit, match=r"of 1 runs, 1 interrupted \(resumable\); re-run the same command"):
        main(["bench", str(config)])


def _stand_in_fit(signum: int) -> str:
    """A stand-in ``coretune fit``: it sends ``signum`` to its parent only (``kill <bench pid>``), ignores signals
    itself, and once its stop file appears "saves" and exits ``128 +`` the signal the file names."""
    return (
        "import os, signal, sys, time; from pathlib import Path; "
        "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]; "
        f"os.kill(os.getppid(), {int(signum)}); stop = Path(os.environ['CORETUNE_STOP_FILE']); "
        "deadline = time.monotonic() + 60\n"
        "while not stop.exists() and time.monotonic() < deadline: time.sleep(0.05)\n"
        "name = stop.read_text().strip() if stop.exists() else 'never asked'; print('saved, stopped by', name); "
        "sys.exit(128 + signal.Signals[name] if stop.exists() else 1)"
    )


def test_launch_fit_asks_an_interrupted_fit_to_save_instead_of_killing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl+C (here: SIGINT to this process only) while launch_fit waits, without a sweep's handlers (the Python API):
    # the fit is asked through its stop file to save, and is awaited; subprocess.run would SIGKILL it 0.25 s later.
    monkeypatch.setattr(
        "coretune.sweeps.launch.fit_command", lambda args, run_dir: [sys.executable, "-c", _stand_in_fit(2)]
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stop_request").write_text("SIGTERM\n")  # an earlier sweep's request is not this one's
    # Python's own Ctrl+C handler: a shell starts background jobs (`make test &`, nohup) with SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch_fit([], tmp_path / "run")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "saved, stopped by SIGINT" in (tmp_path / "run" / "log.txt").read_text()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["kill-int", "sigterm"])
def test_a_signal_to_the_sweep_alone_reaches_the_running_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: int
) -> None:
    # `kill <bench pid>` or a container's SIGTERM to its main process: the fit gets no signal of its own, the sweep
    # passes it on, so the fit stops within a moment instead of running to its end.
    spec = spec_of(tmp_path, objectives=["ce"], seeds=[0, 1, 2])
    script = _stand_in_fit(signum)
    monkeypatch.setattr("coretune.sweeps.launch.fit_command", lambda args, run_dir: [sys.executable, "-c", script])
    start = time.monotonic()
    report = run_sweep(spec)
    assert time.monotonic() - start < 30
    assert report.signum == signum and [r.seed for r in report.interrupted] == [0]
    assert [r.seed for r in report.not_started] == [1, 2] and report.failed == []
    name = signal.Signals(signum).name
    assert f"saved, stopped by {name}" in (report.interrupted[0].run_dir / "log.txt").read_text()
    assert f"{name}: no further run starts" in capsys.readouterr().out


def test_sigterm_to_a_real_bench_process_alone_stops_its_real_fit_resumably(image_tree: Path, tmp_path: Path) -> None:
    # The real thing: `coretune bench` in its own process, a real `coretune fit` that would train for 1,000 epochs,
    # and SIGTERM to the bench's pid only (as a container or `kill` sends it): the fit gets no signal of its own.
    config = tmp_path / "bench.yaml"
    run_dir = tmp_path / "out" / "tiny" / "ce" / "frac1" / "seed0"
    entries = {
        "output": str(tmp_path / "out"),
        "base_args": [*TINY_FIT, "--trainer.max_epochs=1000", "--trainer.enable_progress_bar=false"],
        "datasets": {"tiny": [f"--data.root={image_tree}"]},
        "objectives": ["ce"],
    }
    config.write_text(yaml.safe_dump(entries))
    cmd = [sys.executable, "-m", "coretune.cli", "bench", str(config)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.csv").is_file() and time.monotonic() < deadline:  # the fit is training
            time.sleep(0.2)
        os.kill(bench.pid, signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
    finally:  # whatever happened, leave no fit training for 1,000 epochs
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
    assert bench.returncode == 128 + signal.SIGTERM, err
    assert "sweep stopped by SIGTERM: 0 run(s) finished, 1 interrupted with a resumable checkpoint" in err
    assert "coretune fit: stopped by SIGTERM" in (run_dir / "log.txt").read_text()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and not RunDir(run_dir).is_finished()  # no test results


def test_a_second_ctrl_c_ends_bench_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the first Ctrl+C only asks the running fits to save; a second reaches the sweep as KeyboardInterrupt, which
    # ended `coretune bench` with a traceback
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("coretune.sweeps.bench.run_sweep", interrupted)
    config = tmp_path / "bench.yaml"
    spec = spec_of(tmp_path, objectives=["ce"])
    config.write_text(yaml.safe_dump({"output": str(spec.output), "datasets": {"tiny": list(spec.datasets["tiny"])},
                                      "objectives": ["ce"]}))  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(["bench", str(config)])
    assert info.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err == (
        "coretune bench: sweep aborted by a second SIGINT: the running fits were asked to stop (one that could not "
        "save resumes from its last saved epoch). Re-run the same command to resume: finished runs are skipped\n"
    )
