"""Run directory claims: one live process per run directory, stale claims replaced, atomic under contention."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coretune.runs import claim as runclaim
from coretune.runs.claim import (
    CLAIM_FILE,
    RunClaim,
    RunInUse,
    claim_run,
    claimed,
    fit_claim,
    live_claim,
    point_claim,
    read_claim,
    release_claim,
)


def write_claim(run_dir: Path, pid: int, host: str | None = None, started: float = 0.0) -> None:
    record = {"pid": pid, "host": host or socket.gethostname(), "started": started}
    (run_dir / CLAIM_FILE).write_text(json.dumps(record))


def test_a_claim_names_this_process_and_holds_the_run_until_released(tmp_path: Path) -> None:
    claim_run(tmp_path)
    mine = read_claim(tmp_path)
    assert mine == RunClaim.of(os.getpid()) and mine.local and live_claim(tmp_path) == mine
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, which is gone
    with pytest.raises(RunInUse, match=rf"being run by another process \(pid {os.getpid()}\).*delete .*fit\.pid"):
        claim_run(tmp_path)
    release_claim(tmp_path)
    assert read_claim(tmp_path) is None
    claim_run(tmp_path)  # free again


def test_the_claim_follows_the_fit_and_lapses_when_it_exits(tmp_path: Path, other_process: subprocess.Popen) -> None:
    claim_run(tmp_path)
    point_claim(tmp_path, other_process.pid)
    assert live_claim(tmp_path) == RunClaim.of(other_process.pid)
    with pytest.raises(RunInUse, match=f"pid {other_process.pid}"):
        claim_run(tmp_path)
    release_claim(tmp_path)  # the sweep lets go (a second Ctrl+C), but its fit still runs: the claim stays
    assert live_claim(tmp_path) == RunClaim.of(other_process.pid)
    other_process.kill()
    other_process.wait()
    assert read_claim(tmp_path) is not None and live_claim(tmp_path) is None  # stale: a killed sweep left it
    claim_run(tmp_path)  # replaced
    assert read_claim(tmp_path) == RunClaim.of(os.getpid())


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="a zombie is told from /proc")
def test_a_killed_fit_left_as_a_zombie_holds_no_claim(tmp_path: Path) -> None:
    """A fit killed with its sweep (kill -9 of the process group) is a zombie until process 1 reaps it, which a
    container's may never do: its /proc entry stays, but it runs no more (the killed-worker test's flake under load)."""
    claim_run(tmp_path)
    fit = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    point_claim(tmp_path, fit.pid)
    assert live_claim(tmp_path) == RunClaim.of(fit.pid)
    release_claim(tmp_path)
    fit.kill()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{fit.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":  # not reaped: no wait()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert read_claim(tmp_path) is not None and live_claim(tmp_path) is None
        claim_run(tmp_path)  # the zombie's claim is replaced
        assert read_claim(tmp_path) == RunClaim.of(os.getpid())
    finally:
        fit.wait()


def test_claimed_holds_the_run_for_the_block(tmp_path: Path) -> None:
    with pytest.raises(KeyError), claimed(tmp_path):
        assert live_claim(tmp_path) == RunClaim.of(os.getpid())
        raise KeyError  # released on errors too
    assert read_claim(tmp_path) is None


def test_pointing_at_a_fit_that_already_exited_keeps_the_sweeps_claim(tmp_path: Path) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    claim_run(tmp_path)
    point_claim(tmp_path, ended.pid)
    assert read_claim(tmp_path) == RunClaim.of(os.getpid())


@pytest.mark.parametrize(
    "record",
    [
        "reused pid",  # this pid, but another start time: a pid reused by an unrelated process
        "not json",
        '{"pid": 1}',
        "",
    ],
)
def test_stale_or_unreadable_claims_are_replaced(tmp_path: Path, record: str) -> None:
    if record == "reused pid":
        write_claim(tmp_path, os.getpid(), started=RunClaim.of(os.getpid()).started - 3600)
    else:
        (tmp_path / CLAIM_FILE).write_text(record)
    assert live_claim(tmp_path) is None
    claim_run(tmp_path)
    assert read_claim(tmp_path) == RunClaim.of(os.getpid())


def test_another_hosts_claim_is_live_while_refreshed(tmp_path: Path) -> None:
    write_claim(tmp_path, 4242, host="node7")
    claim = live_claim(tmp_path)
    assert claim is not None and not claim.local and claim.where() == "pid 4242 on node7"
    with pytest.raises(RunInUse, match=r"pid 4242 on node7.* lapses 15 minutes after that host stops refreshing"):
        claim_run(tmp_path)
    last = time.time() - runclaim.STALE_AFTER_S + 30  # refreshed 14½ minutes ago: still live
    os.utime(tmp_path / CLAIM_FILE, (last, last))
    assert live_claim(tmp_path) == claim
    last -= 60  # 15½ minutes: node7 died or lost the file system; its run is taken over
    os.utime(tmp_path / CLAIM_FILE, (last, last))
    assert live_claim(tmp_path) is None
    claim_run(tmp_path)
    assert live_claim(tmp_path) == RunClaim.of(os.getpid())


def test_holders_refresh_the_claim_until_they_release_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runclaim, "HEARTBEAT_S", 0.05)
    path, old = tmp_path / CLAIM_FILE, time.time() - 3600

    def refreshed_while_held() -> bool:
        os.utime(path, (old, old))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and path.stat().st_mtime == old:
            time.sleep(0.02)
        return path.stat().st_mtime > old

    with claimed(tmp_path):  # a sweep's claim
        assert refreshed_while_held()
        with fit_claim(tmp_path):  # the fit it runs (here: the same process) refreshes it as well
            assert refreshed_while_held()
    assert not path.exists()  # released: the heartbeat stopped with it
    write_claim(tmp_path, 4242, host="node7")
    os.utime(path, (old, old))
    with runclaim.heartbeat(tmp_path):  # never refreshes another host's claim
        time.sleep(0.3)
    assert path.stat().st_mtime == old


def _contend(run_dir: str, ready: object, done: object, results: object) -> None:
    ready.wait()  # all start claiming together
    try:
        claim_run(run_dir)
        results.put("claimed")
    except RunInUse:
        results.put("in use")
    done.wait()  # the winner stays alive until everyone has tried


def test_a_claim_replaced_while_it_settles_is_given_up(
    tmp_path: Path, other_process: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process that judged the same stale claim replaced ours in the same instant: it goes on, we do not.
    monkeypatch.setattr(
        "coretune.runs.claim.time.sleep",
        lambda s: write_claim(tmp_path, other_process.pid, started=RunClaim.of(other_process.pid).started),
    )
    with pytest.raises(RunInUse, match=f"pid {other_process.pid}"):
        claim_run(tmp_path)
    assert live_claim(tmp_path) == RunClaim.of(other_process.pid)


@pytest.mark.parametrize("stale", [False, True], ids=["no-claim", "stale-claim"])
def test_of_processes_claiming_at_once_exactly_one_wins(tmp_path: Path, stale: bool) -> None:
    if stale:  # all find the claim of a killed sweep and replace it at once
        write_claim(tmp_path, 4242, started=0.0)
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    n = 6
    ready, done, results = ctx.Barrier(n), ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), ready, done, results)) for _ in range(n)]
    for proc in procs:
        proc.start()
    outcomes = sorted(results.get(timeout=60) for _ in range(n))
    for proc in procs:
        proc.join(timeout=60)
    assert outcomes == ["claimed"] + ["in use"] * (n - 1)


def test_a_fit_claims_its_run_unless_its_sweep_holds_it(tmp_path: Path, other_process: subprocess.Popen) -> None:
    with fit_claim(tmp_path / "run"):  # on its own: claims (creating the directory), releases after
        assert live_claim(tmp_path / "run") == RunClaim.of(os.getpid())
    assert read_claim(tmp_path / "run") is None
    claim_run(tmp_path)  # a sweep's claim pointed at this process (the fit it started)
    with fit_claim(tmp_path):
        pass
    assert live_claim(tmp_path) == RunClaim.of(os.getpid())  # the sweep's, for the sweep to release
    child = (  # the module alone: a fit's claim check, without importing torch
        "import importlib.util as u, sys; spec = u.spec_from_file_location('runclaim', sys.argv[2]); "
        "m = sys.modules['runclaim'] = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "with m.fit_claim(sys.argv[1]): print('ran')"
    )
    command = [sys.executable, "-c", child, str(tmp_path), runclaim.__file__]
    ran = subprocess.run(command, capture_output=True, text=True, check=True)
    assert ran.stdout == "ran\n"  # a fit whose claim still names its sweep (its parent) runs under it
    assert live_claim(tmp_path) == RunClaim.of(os.getpid())
    release_claim(tmp_path)
    claim_run(tmp_path)
    point_claim(tmp_path, other_process.pid)  # another fit runs it
    with pytest.raises(RunInUse, match=f"pid {other_process.pid}"), fit_claim(tmp_path):
        pass
    assert live_claim(tmp_path) == RunClaim.of(other_process.pid)
