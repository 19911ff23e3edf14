"""``coretune tune`` workers sharing one study: real processes on a real PostgreSQL server (``pgserver``, from PyPI:
the server's binaries in a wheel, a throw-away database per test) and on a journal file. The trials' fits are
stand-ins (``tune_worker.py``): what is tested is the workers' sharing, not the fits."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import coretune.sweeps.tune as tune_module
from coretune.cli import main

optuna = pytest.importorskip("optuna")

WORKER = Path(__file__).with_name("tune_worker.py")
PASSWORD = "s3cret-Pa55word"
GRID = ["--eta", "0.1", "1", "--alpha", "1", "10"]  # four points


@pytest.fixture(scope="module")
def postgres() -> Iterator[tuple[object, str]]:
    """A PostgreSQL server on a Unix socket, with password authentication for the user ``tuner``; yields the server
    and the socket's folder. Its data lives outside pytest's folders: as root, pgserver runs the server as another
    user, who cannot enter those."""
    pgserver = pytest.importorskip(
        "pgserver",
        reason="no pgserver, the PostgreSQL server in a wheel of the dev extra (Python <= 3.12): pip install pgserver",
    )
    pytest.importorskip("psycopg", reason="pip install 'coretune[tune-postgres]' for PostgreSQL's driver")
    folder = tempfile.TemporaryDirectory(prefix="coretune-pg-", ignore_cleanup_errors=True)
    server = pgserver.get_server(Path(folder.name) / "data", cleanup_mode="stop")
    server.psql(f"CREATE ROLE tuner LOGIN PASSWORD '{PASSWORD}';")
    hba = server.pgdata / "pg_hba.conf"  # pgserver trusts every local user: ask tuner for its password
    hba.write_text("local all postgres trust\nlocal all all scram-sha-256\n")
    server.psql("SELECT pg_reload_conf();")
    yield server, server.get_uri().partition("host=")[2]
    from pgserver._commands import pg_ctl

    pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=server.pgdata, user=server.system_user)  # its data is thrown away
    server.cleanup()
    folder.cleanup()


@pytest.fixture
def database(postgres: tuple[object, str]) -> str:
    """A new database owned by ``tuner``: its URL, with the password."""
    server, socket_dir = postgres
    name = f"tune_{uuid.uuid4().hex[:12]}"
    server.psql(f"CREATE DATABASE {name} OWNER tuner;")
    return f"postgresql://tuner:{PASSWORD}@/{name}?host={socket_dir}"


@pytest.fixture
def data_arg(tmp_path: Path) -> str:
    (tmp_path / "data" / "train").mkdir(parents=True)
    return f"--data.root={tmp_path / 'data'}"


def start(log: Path, args: list[str], **env: str) -> subprocess.Popen[str]:
    """A worker in its own process group (killing the group kills it and its fit, as a machine that dies)."""
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(log), *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def exited(workers: list[subprocess.Popen[str]]) -> str:
    """What the workers that exited (or, none exited, all of them) printed."""
    done = [w for w in workers if w.poll() is not None] or workers
    return "\n".join(w.communicate(timeout=30)[0] for w in done)


def finished(worker: subprocess.Popen[str]) -> str:
    out, _ = worker.communicate(timeout=120)
    assert worker.returncode == 0, out
    return out


def launches(log: Path) -> list[tuple[int, str, str]]:
    return [(int(p), folder, how) for p, folder, how in (line.split() for line in log.read_text().splitlines())]


def storage_of(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return f"journal:{tmp_path / 'study.log'}" if kind == "journal" else request.getfixturevalue("database")


def study_of(storage: str) -> object:
    if storage.startswith("journal:"):
        backend = optuna.storages.journal.JournalFileBackend(storage.partition(":")[2])
        return optuna.load_study(study_name="coretune", storage=optuna.storages.JournalStorage(backend))
    return optuna.load_study(study_name="coretune", storage=storage.replace("postgresql:", "postgresql+psycopg:"))


@pytest.mark.parametrize("kind", ["postgres", "journal"])
def test_two_workers_share_a_grid_and_run_each_point_once(
    kind: str, tmp_path: Path, data_arg: str, request: pytest.FixtureRequest
) -> None:
    storage, log, go = storage_of(kind, tmp_path, request), tmp_path / "launches.log", tmp_path / "go"
    args = [f"--output={tmp_path / 'out'}", f"--storage={storage}", *GRID, "--", data_arg]
    workers = [start(log, args, TUNE_STUB_WAIT=str(go)) for _ in range(2)]
    deadline = time.monotonic() + 90
    while len({pid for pid, _, _ in (launches(log) if log.exists() else [])}) < 2:  # both run a fit at once
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), exited(workers)
        time.sleep(0.1)
    go.touch()
    for worker in workers:
        finished(worker)
    ran = launches(log)
    assert sorted(folder for _, folder, _ in ran) == sorted(
        f"eta{e}_alpha{a}" for e in ("0.1", "1") for a in ("1", "10")
    )  # every point once: none lost, none run twice
    assert {pid for pid, _, _ in ran} == {w.pid for w in workers} and {how for _, _, how in ran} == {"fresh"}
    trials = study_of(storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert sorted(t.system_attrs["grid_id"] for t in trials) == [0, 1, 2, 3]


def test_the_trial_of_a_worker_killed_mid_fit_is_resumed_by_the_other(
    database: str, tmp_path: Path, data_arg: str
) -> None:
    storage, log, go = database, tmp_path / "launches.log", tmp_path / "go"
    args = [f"--output={tmp_path / 'out'}", f"--storage={storage}", "--grace_period=2", *GRID, "--", data_arg]
    doomed = start(log, args, TUNE_STUB_HANG="1")
    other = start(log, args, TUNE_STUB_WAIT=str(go), TUNE_STUB_SLEEP="1.5")
    deadline = time.monotonic() + 90
    while not (log.exists() and any(how == "hang" for _, _, how in launches(log))):
        assert time.monotonic() < deadline and doomed.poll() is None, exited([doomed, other])
        time.sleep(0.1)
    os.killpg(doomed.pid, signal.SIGKILL)  # the worker and its fit, mid-trial: its trial stays RUNNING
    doomed.wait()
    go.touch()  # the other worker's fits take 1.5 s each: the killed trial's heartbeat is stale 2 s after the kill
    out = finished(other)
    ran = launches(log)
    (killed,) = [folder for _, folder, how in ran if how == "hang"]
    assert [(pid, how) for pid, folder, how in ran if folder == killed] == [(doomed.pid, "hang"), (other.pid, "resume")]
    assert sorted(folder for _, folder, how in ran if how == "fresh") == sorted(
        f"eta{e}_alpha{a}" for e in ("0.1", "1") for a in ("1", "10") if f"eta{e}_alpha{a}" != killed
    )
    trials = study_of(storage).get_trials()
    assert sorted(t.state.name for t in trials) == ["COMPLETE"] * 4 + ["FAIL"]  # the killed trial, and its retry
    assert "PARTIAL" not in out and "PARTIAL" not in (tmp_path / "out" / "best.yaml").read_text()


def test_a_wrong_password_is_one_line_without_the_password(
    database: str, tmp_path: Path, data_arg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[object] = []
    monkeypatch.setattr(tune_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    wrong = database.replace(PASSWORD, "not-the-Pa55word")
    with pytest.raises(SystemExit) as info:
        main(["tune", f"--output={tmp_path / 'out'}", f"--storage={wrong}", "--", data_arg])
    message = str(info.value.code)
    shown = wrong.replace("not-the-Pa55word", "***")  # the URL as given, its password masked
    assert message.startswith(f"coretune tune: error: cannot open the study storage --storage {shown} (")
    assert 'password authentication failed for user "tuner"' in message and "\n" not in message
    assert message.endswith("): check the user name and password in the URL")
    assert "not-the-Pa55word" not in message and launched == []
    with pytest.raises(SystemExit) as info:  # no server there: one line too, within the connection timeout
        main(
            [
                "tune",
                f"--output={tmp_path / 'out'}",
                f"--storage=postgresql://tuner:{PASSWORD}@127.0.0.1:9/db",
                "--",
                data_arg,
            ]
        )
    message = str(info.value.code)
    assert message.startswith("coretune tune: error: cannot open the study storage --storage "
                              "postgresql://tuner:***@127.0.0.1:9/db (")  # fmt: skip
    assert PASSWORD not in message and "\n" not in message and launched == []


def test_a_journal_trial_without_a_heartbeat_for_the_grace_period_is_queued_again(tmp_path: Path) -> None:
    """The journal file gets the heartbeat Optuna gives its RDB storage only (the killed-worker test runs on
    PostgreSQL): a running trial whose heartbeat stopped is failed once, by one worker, and queued with its point."""
    from coretune.sweeps.storage import open_storage
    from coretune.sweeps.study import fail_stale

    storage = f"journal:{tmp_path / 'study.log'}"
    workers = [open_storage(optuna, storage, grace_period=1)[0] for _ in range(2)]
    assert workers[0].get_heartbeat_interval() == 1
    studies = [optuna.create_study(study_name="s", storage=workers[0])]
    studies.append(optuna.load_study(study_name="s", storage=workers[1]))
    alive, dead = studies[0].ask(), studies[0].ask()
    for trial in (alive, dead):
        trial.suggest_float("eta", 0.1, 10.0, log=True)
    workers[0].record_heartbeat(dead._trial_id)
    time.sleep(0.6)
    workers[0].record_heartbeat(alive._trial_id)
    assert workers[1]._get_stale_trial_ids(studies[1]._study_id) == []
    time.sleep(0.6)  # dead's last heartbeat is 1.2 s old, alive's 0.6 s
    assert workers[1]._get_stale_trial_ids(studies[1]._study_id) == [dead._trial_id]
    for study in studies:  # both workers look: one fails it and queues it again
        fail_stale(optuna, study)
    trials = studies[0].get_trials()
    assert [t.state.name for t in trials] == ["RUNNING", "FAIL", "WAITING"]
    assert trials[2].params == trials[1].params and trials[2].system_attrs["retry_history"] == [1]


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "journal"])
def test_a_trial_whose_worker_died_before_its_first_heartbeat_is_queued_again(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A worker killed between starting a trial and its heartbeat thread's first write (the killed-worker test hit it
    under load): Optuna's RDB storage skips a trial without a heartbeat, so the trial would stay RUNNING for ever and
    its point never run. Its age counts from its start, on every storage."""
    from coretune.sweeps.storage import open_storage
    from coretune.sweeps.study import fail_stale

    storage = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else storage_of(kind, tmp_path, request)
    workers = [open_storage(optuna, storage, grace_period=1)[0] for _ in range(2)]
    studies = [optuna.create_study(study_name="s", storage=workers[0])]
    studies.append(optuna.load_study(study_name="s", storage=workers[1]))
    silent = studies[0].ask()  # its worker dies now: no heartbeat was ever recorded
    silent.suggest_float("eta", 0.1, 10.0, log=True)
    beating = studies[0].ask()
    beating.suggest_float("eta", 0.1, 10.0, log=True)
    workers[0].record_heartbeat(beating._trial_id)
    assert workers[1]._get_stale_trial_ids(studies[1]._study_id) == []  # younger than the grace period
    time.sleep(0.7)
    workers[0].record_heartbeat(beating._trial_id)
    time.sleep(0.6)  # silent started 1.3 s ago; beating's heartbeat is 0.6 s old
    assert workers[1]._get_stale_trial_ids(studies[1]._study_id) == [silent._trial_id]
    fail_stale(optuna, studies[1])
    trials = studies[0].get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "RUNNING", "WAITING"]
    assert trials[2].params == trials[0].params and trials[2].system_attrs["retry_history"] == [0]


def test_the_scaling_page_commands_parse() -> None:
    """docs/scaling.md's "One study, many workers": each ``coretune tune`` command's options parse, and its fit
    arguments are ones tune accepts."""
    from coretune.sweeps.job import FitArgs
    from coretune.sweeps.storage import JOURNAL_PREFIX
    from coretune.sweeps.trialargs import check_fit_args

    page = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    section = page.split("## One study, many workers", 1)[1].split("\n## ", 1)[0]
    script = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line) for line in script.splitlines() if line.startswith("coretune tune ")]
    storages = []
    for words in commands:
        split = words.index("--")
        cfg = tune_module._parser().parse_args(words[2:split])
        check_fit_args(FitArgs.parse(words[split + 1 :]))
        storages.append(cfg.storage)
    assert storages == [
        "postgresql://tuner@db.example.org:5432/cifar10_tune",
        f"{JOURNAL_PREFIX}/shared/tune/cifar10.journal",
    ]


def test_a_point_another_worker_runs_is_left_to_it_and_named_partial(
    tmp_path: Path, data_arg: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In one process, standing for two: a worker leaves the point another runs to it (no trial started for it),
    a retry queued for that point fails as a duplicate without a fit, and the outputs name it ``RUNNING``."""
    launched: list[str] = []

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(run_dir.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")
        (run_dir / "results.json").write_text('{"test": {"top1": 0.5}}')
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    grid = {"eta": [0.1, 1.0], "alpha": [1.0]}
    other = optuna.create_study(study_name="coretune", storage=storage, direction="maximize",
                                sampler=optuna.samplers.GridSampler(grid, seed=0))  # fmt: skip
    running = other.ask()  # trial 0: the other worker's, on grid point 0
    point = {name: running.suggest_float(name, v[0], v[-1], log=True) for name, v in grid.items()}
    other.set_user_attr("ready", True)
    tune_module.tune([data_arg], output=tmp_path / "out", storage=storage, **grid)
    assert launched == [f"eta{1.0 if point['eta'] == 0.1 else 0.1:g}_alpha1"]  # only the point no one runs
    best = (tmp_path / "out" / "best.yaml").read_text()
    assert f"# PARTIAL: not finished: eta {point['eta']:g} alpha 1 (RUNNING); re-run the same command to retry them " \
           "(a RUNNING point runs in another worker, or its worker died" in best  # fmt: skip
    with pytest.warns(optuna.exceptions.ExperimentalWarning):  # both workers queued a retry of a trial: one copy runs
        optuna.storages.RetryHeartbeatStaleTrialCallback()(other, other.trials[0])
    launched.clear()
    study = tune_module.tune([data_arg], output=tmp_path / "out", storage=storage, **grid)
    assert launched == [] and study.trials[-1].user_attrs["duplicate"] == (
        "duplicate of trial 0, which runs or finished its point"
    )
    assert "duplicate of trial 0" in (tmp_path / "out" / "trials.csv").read_text()


def test_storage_urls_are_shown_without_their_password_and_checked_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coretune.extras import MissingExtra
    from coretune.sweeps import storage as storage_module

    shown = storage_module.shown_storage
    assert (
        shown("postgresql://tuner:p%40ss/w@db:5432/t?sslmode=require")
        == "postgresql://tuner:***@db:5432/t?sslmode=require"
    )
    assert shown("postgresql+psycopg2://tuner:pw@/t?host=/run/pg") == "postgresql+psycopg2://tuner:***@/t?host=/run/pg"
    for kept in ("postgresql://tuner@db/t", "sqlite:///runs/study.db", "journal:/shared/a:b@c.log"):
        assert shown(kept) == kept
    missing = tmp_path / "missing" / "study.journal"
    with pytest.raises(ValueError, match=f"^--storage journal:{missing}: folder {missing.parent} does not exist: "):
        storage_module.check_storage(f"journal:{missing}")
    with pytest.raises(ValueError, match="give the journal file's path after journal:"):
        storage_module.check_storage(f"journal:{tmp_path}")
    monkeypatch.setattr(storage_module, "installed", lambda module: False)  # neither psycopg nor psycopg2
    with pytest.raises(MissingExtra, match=r"pip install 'coretune\[tune-postgres\]'"):
        storage_module.open_storage(optuna, "postgresql://tuner:pw@db/t")


def test_a_joining_worker_waits_for_the_creator_to_set_the_study_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Workers started at once: the one that created the study records its settings and queues its start-up points,
    then marks it ready; the others wait for that (a creator killed meanwhile: a minute at most)."""
    import threading

    from coretune.sweeps import study as study_module

    study = optuna.create_study()
    study.enqueue_trial({"eta": 1.0})  # the creator is queueing its points
    threading.Timer(0.5, lambda: study.set_user_attr(study_module.READY, True)).start()
    began = time.monotonic()
    study_module.await_creator(study)
    assert 0.4 < time.monotonic() - began < 5
    monkeypatch.setattr(study_module, "_CREATOR_WAIT_S", 2.2)  # a creator that died before it was ready
    began = time.monotonic()
    study_module.await_creator(optuna.create_study())
    assert 2.1 < time.monotonic() - began < 6
    assert "waiting (up to a minute) for the process that created study" in capsys.readouterr().out
    older = optuna.create_study()
    older.ask()  # a study with a trial started, made before READY: no wait
    began = time.monotonic()
    study_module.await_creator(older)
    assert time.monotonic() - began < 1
