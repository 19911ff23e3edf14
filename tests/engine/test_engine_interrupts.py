"""SIGTERM / SIGINT during `coretune fit`: an atomic, resumable checkpoint, one message, and an exact resume.

A helper callback (``tests/signal_helper.py``, passed with ``--trainer.callbacks+=``) sends the real signal to its
own process after a fixed optimizer step, so the interruption point is deterministic; the process then has to
handle an actual OS signal arriving in the middle of a batch.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from coretune.cli import main
from coretune.data.samplers import EpochShuffleSampler, ResumableLoader, SeededItems
from coretune.engine import read_metrics
from coretune.runs import atomic as atomicfile
from coretune.runs.layout import RunDir
from coretune.runs.stopfile import STOP_FILE_ENV
from fit_flags import QUIET

SRC = Path(__file__).resolve().parents[2] / "src"
TESTS = Path(__file__).resolve().parents[1]  # holds signal_helper.py


def fit_args(tree: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "fit",
        f"--data.root={tree}",
        "--data.image_size=32",
        "--data.batch_size=8",  # 36 training images: 4 batches per epoch
        "--model.backbone=small_cnn",
        "--objective=core",
        "--trainer.max_epochs=2",
        "--seed=5",
        f"--run_dir={run_dir}",
        *QUIET,
        *extra,
    ]


def signal_args(signum: int, step: int) -> list[str]:
    return [
        "--trainer.callbacks+=signal_helper.SendSignal",
        f"--trainer.callbacks.signum={int(signum)}",
        f"--trainer.callbacks.step={step}",
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The tiny tree, the helper module's folder and an uninterrupted 2-epoch run."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("interrupts")
    tree = make_image_tree(base / "data")
    whole = base / "whole"
    main(fit_args(tree, whole))
    return tree, TESTS, whole


@pytest.fixture
def helper_on_path(setup: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(setup[1]))


EARLIER_MORE_S = 1000.0
"""What :func:`saved_cpu_time` adds to the saved CPU and train times of the sessions before a resume."""


def saved_cpu_time(run_dir: Path, more: float = EARLIER_MORE_S) -> float:
    """The CPU seconds the sessions before a resume counted (RunArtifacts' state in ``last.ckpt``), raised by
    ``more`` in the file, as their train time is, so that a resumed run which forgot them cannot pass for one that
    counted them (whatever the load of the machine: no ratio of two runs' times)."""
    path = run_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(path, weights_only=True)
    state = next(state for state in saved["callbacks"].values() if "cpu_time_s" in state)
    state["cpu_time_s"] += more
    state["train_time_s"] += more
    torch.save(saved, path)
    return state["cpu_time_s"]


def resume(args: list[str]) -> float:
    """Runs ``coretune fit`` in this process; returns the CPU seconds it took."""
    start = time.process_time()
    main(args)
    return time.process_time() - start


def assert_same_run(whole: Path, resumed: Path, earlier_cpu: float, last_cpu: float) -> None:
    """Same weights, the same metrics.csv (every logged value of every epoch but its wall time) and the same test
    results; the resumed run's CPU time counts the interrupted session's (``earlier_cpu``) and at most the last
    session's (``last_cpu``) on top."""
    a = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"]) == (1, 8)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    logged = [
        [{k: v for k, v in r.items() if k != "epoch_time_s"} for r in read_metrics(run / "metrics.csv")]
        for run in (whole, resumed)
    ]
    assert logged[0] == logged[1]  # every value but the wall times
    results = [json.loads((run / "results.json").read_text()) for run in (whole, resumed)]
    assert results[0]["test"] == results[1]["test"]
    # the times and images count every session, not the resumed one alone (metrics.csv holds epoch 0's first)
    assert results[0]["train_images"] == results[1]["train_images"] == 2 * 4 * 8  # 2 epochs of 4 batches of 8
    for result, run in zip(results, (whole, resumed), strict=True):
        epoch_times = [float(r["epoch_time_s"]) for r in read_metrics(run / "metrics.csv")]
        assert sum(epoch_times) <= result["wall_time_s"] + 0.02
    assert results[1]["train_time_s"] > EARLIER_MORE_S  # was the last session's 1 to 6 batches of 8 alone
    # every session's CPU time too (not a ratio to the uninterrupted run: its first fit in this process also paid
    # for warming up the plotting libraries): the earlier sessions' (raised by saved_cpu_time) and the last one's
    assert earlier_cpu <= results[1]["cpu_time_s"] <= earlier_cpu + last_cpu + 0.01


def checkpoint_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_sigterm_mid_epoch_in_a_real_process_saves_and_resumes_exactly(
    setup: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    tree, helper, whole = setup
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(helper), str(SRC), os.environ.get("PYTHONPATH", "")])}
    args = fit_args(tree, run, *signal_args(signal.SIGTERM, 6))  # epoch 1, after its 2nd batch of 4
    proc = subprocess.run(
        [sys.executable, "-m", "coretune.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )
    ckpt = run / "checkpoints" / "last.ckpt"
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "Traceback" not in proc.stderr and "weights_only" not in proc.stderr + proc.stdout  # no stray log line
    assert (
        f"coretune fit: stopped by SIGTERM at epoch 1, step 6; saved a resumable checkpoint to {ckpt}. Resume by "
        f"running the same command with --run_dir {run}: it continues from this checkpoint"
    ) in proc.stderr
    assert checkpoint_files(run) == ["best.ckpt", "last.ckpt"]  # no temporary file left behind
    saved = torch.load(ckpt, weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (1, 6)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "batches": 2}]
    assert [r["epoch"] for r in read_metrics(run / "metrics.csv")] == ["0"]

    earlier = saved_cpu_time(run)
    last = resume(fit_args(tree, run))  # what the message says: the same command (without the test's signal) resumes
    assert_same_run(whole, run, earlier, last)


@pytest.mark.parametrize(("first", "second"), [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT)])
def test_a_second_signal_stops_a_process_whose_batch_never_ends_at_once(
    setup: tuple[Path, Path, Path], tmp_path: Path, first: signal.Signals, second: signal.Signals
) -> None:
    # a loader blocked for ever (a named pipe in the data) kept the first signal waiting for the batch end, and
    # Lightning's own SIGTERM handler, put back for the second, only set a flag too
    tree, helper, _ = setup
    hang = tmp_path / "hanging"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(helper), str(SRC), os.environ.get("PYTHONPATH", "")])}
    args = fit_args(tree, tmp_path / "run", *signal_args(first, 1), f"--trainer.callbacks.hang_file={hang}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "coretune.cli", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not hang.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hang.exists(), "the process did not reach its hanging batch"
        time.sleep(1)
        assert proc.poll() is None  # the first signal waits for the batch end, which never comes
        proc.send_signal(second)
        assert proc.wait(timeout=20) == -second  # ended by the signal itself: the shell shows 128 + signum
    finally:
        proc.kill()
        stderr = proc.communicate()[1].decode()
    assert (
        f"coretune: {first.name} received: stopping at the next batch end with a resumable checkpoint (send SIGTERM "
        "or SIGINT again to stop at once)"
    ) in stderr
    assert (
        f"coretune: second signal ({second.name}): stopping at once; the last complete checkpoint is intact" in stderr
    )
    assert "Traceback" not in stderr


@pytest.mark.usefixtures("helper_on_path")
def test_sigint_mid_epoch_exits_130_and_resumes_exactly(
    setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, _, whole = setup
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as info:
        main(fit_args(tree, run, *signal_args(signal.SIGINT, 2)))  # epoch 0, after its 2nd batch
    assert info.value.code == 128 + signal.SIGINT
    assert "coretune fit: stopped by SIGINT at epoch 0, step 2; saved a resumable checkpoint" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) == before  # the handlers are put back
    assert not (run / "metrics.csv").exists()  # no epoch finished
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2

    earlier = saved_cpu_time(run)
    assert_same_run(whole, run, earlier, resume(fit_args(tree, run, "--ckpt_path=last")))


@pytest.mark.usefixtures("helper_on_path")
@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # the run was copied: Lightning notes the move
def test_an_extended_run_stopped_before_its_end_is_not_finished_with_its_old_score(
    setup: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    # a finished 2-epoch run, extended to 3 and stopped in epoch 2: its results.json kept the 2-epoch test score,
    # so a sweep counted it finished and tabled that score beside a checkpoint of another epoch
    tree, _, whole = setup
    run = Path(shutil.copytree(whole, tmp_path / "run"))
    with pytest.raises(SystemExit):
        main(fit_args(tree, run, "--trainer.max_epochs=3", *signal_args(signal.SIGINT, 10)))  # epoch 2, batch 2
    assert "test" not in json.loads((run / "results.json").read_text())
    assert not RunDir(run).is_finished()
    main(fit_args(tree, run, "--trainer.max_epochs=3"))
    results = json.loads((run / "results.json").read_text())
    assert RunDir(run).is_finished() and results["epochs"] == 3


@pytest.mark.usefixtures("helper_on_path")
def test_a_stop_file_request_stops_like_its_signal_and_resumes_exactly(
    setup: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # what `coretune bench` does when only it got the signal: the fit itself receives none
    tree, _, whole = setup
    run, stop_file = tmp_path / "run", tmp_path / "stop_request"
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_file))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    request = [*signal_args(signal.SIGINT, 5), "--trainer.callbacks.stop_file=true"]  # epoch 1, after its 1st batch
    with pytest.raises(SystemExit) as info:
        main(fit_args(tree, run, *request))
    assert info.value.code == 128 + signal.SIGINT  # the signal the file names
    assert "coretune fit: stopped by SIGINT at epoch 1, step 5; saved a resumable checkpoint" in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5

    stop_file.unlink()  # as coretune bench does before it resumes a run
    earlier = saved_cpu_time(run)
    assert_same_run(whole, run, earlier, resume(fit_args(tree, run, "--ckpt_path=last")))


@pytest.mark.usefixtures("helper_on_path")
def test_signal_in_an_epochs_last_batch_stops_after_the_epoch(
    setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, _, _ = setup
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(fit_args(tree, run, *signal_args(signal.SIGTERM, 4), "--trainer.max_epochs=3"))
    assert info.value.code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after epoch 0 (step 4); saved a resumable checkpoint" in capsys.readouterr().err
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (0, 4)
    assert [r["epoch"] for r in read_metrics(run / "metrics.csv")] == ["0"]
    assert "test" not in json.loads((run / "results.json").read_text())  # stopped: no test phase


class _FullDisk:
    """A checkpoint file on a disk that fills up after ``room`` bytes: ``write`` raises ``OSError(ENOSPC)``, as a
    real full disk does (torch's writer then reports ``RuntimeError: … unexpected pos …``)."""

    def __init__(self, file: object, room: int) -> None:
        self.file, self.room = file, room

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()  # type: ignore[attr-defined]

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.file.write(data[: self.room])  # type: ignore[attr-defined]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.file, name)


@pytest.mark.parametrize("failing", ["torch.save", "file.write"])
def test_failed_checkpoint_write_keeps_the_previous_one(
    setup: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The disk fills up at epoch 1's checkpoint writes: ``torch.save`` raising ``OSError(ENOSPC)``, or the file's
    ``write`` raising it inside torch's real writer, which turns it into a ``RuntimeError`` (``[enforce fail at
    inline_container.cc:672] unexpected pos``)."""
    tree, _, _ = setup
    run = tmp_path / "run"
    real_save, calls = torch.save, []

    def disk_full(obj: object, f: object, *args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) > 2:  # epoch 0 writes best.ckpt and last.ckpt; epoch 1's writes fail half-way
            f.write(b"partial")  # type: ignore[attr-defined]
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    def filling_disk(path: Path, *args: object, **kwargs: object) -> object:
        checkpoint = ".ckpt" in Path(path).name  # not config.yaml or results.json, which atomic_write writes too
        calls.extend([1] if checkpoint else [])
        file = open(path, *args, **kwargs)  # noqa: SIM115 - returned to atomic_write's with block
        return _FullDisk(file, room=1000) if checkpoint and len(calls) > 2 else file

    if failing == "torch.save":
        monkeypatch.setattr(torch, "save", disk_full)
    else:
        monkeypatch.setattr(atomicfile, "open", filling_disk, raising=False)  # atomic_write's open
    with pytest.raises(SystemExit) as info:
        main(fit_args(tree, run))
    message = str(info.value.code)
    assert message.startswith("coretune fit: error: [Errno 28] No space left on device")
    assert message.endswith(
        "free disk space, then run the same command again to resume (the last complete checkpoint is intact)"
    )
    assert "\n" not in message
    monkeypatch.undo()
    assert checkpoint_files(run) == ["best.ckpt", "last.ckpt"]  # the temporary file was removed
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (0, 4)


def batches(loader: ResumableLoader) -> list[list[int]]:
    return [b[0].tolist() for b in loader]


def test_resumable_loader_skips_the_batches_already_seen() -> None:
    dataset = SeededItems(TensorDataset(torch.arange(10)))

    def loader() -> ResumableLoader:
        return ResumableLoader(dataset, batch_size=3, sampler=EpochShuffleSampler(10, seed=1), drop_last=True)

    whole = loader()
    whole.sampler.set_epoch(2)
    epoch2 = batches(whole)
    cut = loader()
    cut.sampler.set_epoch(2)
    it = iter(cut)
    seen = [next(it)[0].tolist()]
    assert cut.state_dict() == {"epoch": 2, "batches": 1}

    resumed = loader()
    resumed.load_state_dict(cut.state_dict())
    resumed.sampler.set_epoch(2)  # Lightning sets the epoch after restoring the state
    assert seen + batches(resumed) == epoch2
    assert resumed.state_dict() == {"epoch": 2, "batches": 3}
    resumed.sampler.set_epoch(3)  # the skip applied once, to its own epoch only
    assert len(batches(resumed)) == 3 and resumed.state_dict() == {"epoch": 3, "batches": 3}

    stale = loader()
    stale.load_state_dict({"epoch": 1, "batches": 2})
    stale.sampler.set_epoch(2)
    assert batches(stale) == epoch2
