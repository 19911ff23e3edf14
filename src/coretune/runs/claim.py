"""A run directory's *claim*: which process is running it, so that two sweeps (or fits) never train one run at once.

``coretune bench`` and ``coretune tune`` launch each fit through :func:`coretune.sweeps.launch.launch_fit`, which first
claims the run directory (:func:`claim_run`): it atomically creates :data:`CLAIM_FILE` holding the claiming
process's id, host name and start time, then points the claim at the fit it starts, and removes it when the fit has
exited. A second sweep over the same spec (another terminal, another machine on a shared file system) finds a live
claim and skips that run instead of training it a second time into the same checkpoints. A ``coretune fit`` started
on its own claims its run directory too (:func:`fit_claim`), and refuses one that a live sweep or fit is running.

A claim is live while its process runs: same host, same pid *and* the same process start time (a pid reused by an
unrelated process after a killed sweep does not count). A claim from another host cannot be checked from here: the
processes holding a claim refresh its file's modification time every :data:`HEARTBEAT_S` (:func:`claimed`,
:func:`fit_claim`), and another host's claim is live while it was refreshed within :data:`STALE_AFTER_S` — so the
run of a machine that died is taken over by another sweep a quarter of an hour later. A stale claim is replaced.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CLAIM_FILE",
    "HEARTBEAT_S",
    "STALE_AFTER_S",
    "RunClaim",
    "RunInUse",
    "claim_run",
    "claimed",
    "fit_claim",
    "heartbeat",
    "live_claim",
    "point_claim",
    "release_claim",
]

CLAIM_FILE = "fit.pid"
"""A run directory's claim (JSON: ``pid``, ``host``, ``started``), present while a sweep's or a fit's process runs
there."""

HEARTBEAT_S = 60.0
"""How often the processes holding a claim refresh its file's modification time."""
STALE_AFTER_S = 15 * 60.0
"""Another host's claim not refreshed for this long is stale: that machine died or lost the shared file system.
Far above :data:`HEARTBEAT_S`, so that a busy file server or clocks a few minutes apart do not end a live claim."""

_SAME_PROCESS_S = 1.0
"""Start times this close belong to the same process (a pid is not reused within a second)."""
_SETTLE_S = 0.2
"""How long a new claim waits before checking that it is still its own (:func:`claim_run`)."""


class RunInUse(RuntimeError):
    """The run directory is claimed by another live process (:data:`CLAIM_FILE`)."""


_EXITED = ("Z", "X", "x")
"""The states of ``/proc/PID/stat`` of a process that has exited: zombie, dead."""


def process_started(pid: int) -> float:
    """When process ``pid`` of this host started (seconds since the epoch); ``ProcessLookupError`` when none runs,
    ``PermissionError`` when it runs but may not be inspected. Read from ``/proc`` on Linux (as psutil does), where a
    zombie (a killed fit whose parent died too, left for an init that has not reaped it yet, or never will in a
    container whose process 1 reaps nothing) runs no more: its claim is stale. Elsewhere
    only whether the process exists is known (POSIX: signal 0) and the start time is 0: a pid reused after a killed
    sweep then counts as its claim's process; on Windows, where signal 0 would interrupt the process, a claim's
    process always counts as running (the refusal names the claim file to delete)."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/stat").is_file():
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after the command name, which may hold spaces
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        if fields[0] in _EXITED:
            raise ProcessLookupError(pid)
        return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    if os.name == "nt":
        raise PermissionError(pid)
    os.kill(pid, 0)  # raises ProcessLookupError or PermissionError
    return 0.0


def _boot_time() -> float:
    """This Linux host's boot time (seconds since the epoch), ``btime`` of ``/proc/stat``."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError("/proc/stat has no btime line")


@dataclass(frozen=True)
class RunClaim:
    """Process ``pid`` on ``host``, started at ``started`` (seconds since the epoch, as :func:`process_started`
    reports it); ``refreshed``: the claim file's modification time when it was read (the holder's last heartbeat)."""

    pid: int
    host: str
    started: float
    refreshed: float = field(default=0.0, compare=False)

    @classmethod
    def of(cls, pid: int) -> RunClaim:
        """The claim of process ``pid`` of this host (it must be running)."""
        return cls(pid, socket.gethostname(), process_started(pid))

    @property
    def local(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """Whether the claiming process still runs; for another host's claim, whether it was refreshed within
        :data:`STALE_AFTER_S`."""
        if not self.local:
            return time.time() - self.refreshed < STALE_AFTER_S
        try:
            return abs(process_started(self.pid) - self.started) < _SAME_PROCESS_S
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, owned by another user
            return True

    def where(self) -> str:
        """``"pid 123"``, or ``"pid 123 on node7"`` for another host."""
        return f"pid {self.pid}" + ("" if self.local else f" on {self.host}")


def read_claim(run_dir: str | Path) -> RunClaim | None:
    """The claim recorded in ``run_dir``, live or not; None without one (or an unreadable file: treated as stale)."""
    path = Path(run_dir) / CLAIM_FILE
    try:
        raw, refreshed = json.loads(path.read_text()), path.stat().st_mtime
        return RunClaim(int(raw["pid"]), str(raw["host"]), float(raw["started"]), refreshed)
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None


def live_claim(run_dir: str | Path) -> RunClaim | None:
    """The claim on ``run_dir`` if its process still runs, else None (no claim, or a stale one)."""
    claim = read_claim(run_dir)
    return claim if claim is not None and claim.alive() else None


def _umask() -> int:
    """The process's umask, from ``/proc/self/status`` (this module also runs alone, loaded by path, so not
    ``coretune.runs.atomic.new_file_mode``; without ``/proc`` the claim keeps ``0o600``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise ValueError("no Umask line")


def _write(path: Path, claim: RunClaim, exclusive: bool) -> bool:
    """Write ``claim`` to ``path`` complete or not at all: a temporary file, then hard-linked into place when
    ``exclusive`` (fails if ``path`` exists: returns False) or renamed over it otherwise."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name + ".", suffix=".tmp", delete=False) as f:
        with suppress(OSError, ValueError):  # readable as a plain open's file, not NamedTemporaryFile's 0o600
            os.fchmod(f.fileno(), 0o666 & ~_umask())
        f.write(json.dumps({"pid": claim.pid, "host": claim.host, "started": claim.started}, allow_nan=False) + "\n")
    tmp = Path(f.name)
    try:
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: an exclusive create (a reader may see it half-written)
            try:
                with path.open("x") as out:
                    out.write(tmp.read_text())
            except FileExistsError:
                return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


def claim_run(run_dir: str | Path) -> None:
    """Claim ``run_dir`` (which must exist) for this process; a stale claim is replaced.

    Raises :class:`RunInUse` when a live process holds it. A new claim is checked again after
    :data:`_SETTLE_S`: two processes that found the same stale claim at the same moment may both replace it,
    and then only the one whose claim stayed goes on.
    """
    path = Path(run_dir) / CLAIM_FILE
    mine = RunClaim.of(os.getpid())
    for _ in range(2):
        if _write(path, mine, exclusive=True):
            time.sleep(_SETTLE_S)
            if read_claim(run_dir) == mine:
                return
            break
        if live_claim(run_dir) is not None:
            break
        path.unlink(missing_ok=True)  # stale: the process that claimed it is gone
    holder = live_claim(run_dir)
    lapses = (
        f" (it lapses {STALE_AFTER_S / 60:g} minutes after that host stops refreshing it)"
        if holder is not None and not holder.local
        else ""
    )
    raise RunInUse(
        f"{run_dir} is being run by another process ({holder.where() if holder else 'claimed concurrently'}): "
        f"wait for it to finish. If no such process runs, delete {path} and try again{lapses}"
    )


def point_claim(run_dir: str | Path, pid: int) -> None:
    """Move this process's claim on ``run_dir`` to the fit it started (process ``pid``; if that has already exited,
    the claim stays with this process until :func:`release_claim`)."""
    try:
        claim = RunClaim.of(pid)
    except ProcessLookupError:
        return
    _write(Path(run_dir) / CLAIM_FILE, claim, exclusive=False)


def release_claim(run_dir: str | Path) -> None:
    """Remove this process's claim on ``run_dir``, unless it names another live process: a fit that outlives its
    sweep (a second Ctrl+C aborted the sweep, not the fit) keeps it."""
    claim = live_claim(run_dir)
    if claim is None or claim.pid == os.getpid():
        (Path(run_dir) / CLAIM_FILE).unlink(missing_ok=True)


@contextmanager
def fit_claim(run_dir: str | Path) -> Iterator[None]:
    """A fit's hold on its run directory (created if missing) for the block: a fit started by a sweep runs under
    the sweep's claim (pointed at it, or still naming the sweep: its parent), which the sweep releases; a fit
    started on its own claims the directory (:class:`RunInUse` if another live process holds it) and releases it."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    holder = live_claim(run_dir)
    if holder is not None and holder.local and holder.pid in (os.getpid(), os.getppid()):
        with heartbeat(run_dir):
            yield
        return
    with claimed(run_dir):
        yield


@contextmanager
def claimed(run_dir: str | Path) -> Iterator[None]:
    """:func:`claim_run` on entry (raises :class:`RunInUse`), :func:`release_claim` on exit."""
    claim_run(run_dir)
    try:
        with heartbeat(run_dir):
            yield
    finally:
        release_claim(run_dir)


@contextmanager
def heartbeat(run_dir: str | Path) -> Iterator[None]:
    """Refresh the modification time of ``run_dir``'s claim every :data:`HEARTBEAT_S` for the block (a daemon
    thread), while the claim is this host's: other hosts see the claim live (:meth:`RunClaim.alive`)."""
    path, stop = Path(run_dir) / CLAIM_FILE, threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            claim = read_claim(run_dir)
            if claim is not None and claim.local:
                with suppress(FileNotFoundError):  # released in between
                    os.utime(path)

    thread = threading.Thread(target=beat, name=f"claim heartbeat {run_dir}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
