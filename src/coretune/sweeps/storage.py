"""Where ``coretune tune`` keeps its Optuna study (``--storage``), and how the workers sharing it notice a dead one.

``--storage`` is an SQLAlchemy URL (``sqlite:///<output>/study.db`` by default, one machine) or, for several
machines, ``postgresql://user:password@host:port/database`` (Optuna's RDB storage through the psycopg driver:
``pip install 'coretune[tune-postgres]'``), or ``journal:PATH``, a journal file on a file system every worker
mounts (Optuna's ``JournalStorage(JournalFileBackend(PATH))``, for clusters with a shared disk and no database
server). A URL is only ever shown with its password masked (``postgresql://user:***@host/db``).

Every storage has Optuna's heartbeat: each running trial records one every ``grace_period / 5`` seconds (at most 60),
and a worker that starts a trial first fails the trials whose heartbeat is older than ``grace_period`` (their worker
died: kill -9, a lost machine) and queues each again with the same point and retry history
(:class:`optuna.storages.RetryHeartbeatStaleTrialCallback`), so a live worker resumes it, in its folder, from its
checkpoint. The RDB storage has it built in; the journal file gets it here (:func:`_journal_with_heartbeat`: the
heartbeat is a system attribute of the trial, and a trial's age is counted from its latest heartbeat or start).
Optuna's RDB storage never takes a trial without a heartbeat for dead, so a worker killed between starting a trial and
its heartbeat thread's first write (milliseconds, but a fit may already run) would leave the trial RUNNING for ever:
here such a trial's age is counted from its start, as the journal's is (:func:`_rdb_with_heartbeat`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..extras import MissingExtra, installed

__all__ = ["JOURNAL_PREFIX", "check_storage", "open_storage", "shown_storage"]

JOURNAL_PREFIX = "journal:"
"""``--storage journal:PATH``: a journal file shared through a file system."""

GRACE_PERIOD_S = 300
"""``--grace_period``'s default: a trial whose heartbeat is older than this is taken as its worker's death."""

_HEARTBEAT_ATTR = "coretune:heartbeat"
"""The system attribute holding a journal trial's latest heartbeat (seconds since the epoch)."""

_CREATE_TRIES = 5
"""How many times a worker opens a new database whose tables another worker is creating at the same moment."""

_MAX_RETRY = 3
"""How many times Optuna's heartbeat queues one trial again before giving it up (a trial that kills its worker)."""


def _url(storage: str) -> Any:
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(storage)
    except sqlalchemy.exc.ArgumentError:
        return None


def shown_storage(storage: str) -> str:
    """``storage`` as messages show it: a URL's password masked (``postgresql://user:***@host/db``)."""
    url = None if storage.startswith(JOURNAL_PREFIX) else _url(storage)
    if url is None or url.password is None:
        return storage
    return re.sub(r"^([\w+.-]+://[^:/@]*:)[^@]*@", r"\1***@", storage, count=1)  # the rest as the user wrote it


def _scrubbed(text: str, storage: str) -> str:
    """``text`` (a driver's error) without the password of ``storage``, however it is spelled."""
    url = None if storage.startswith(JOURNAL_PREFIX) else _url(storage)
    if url is None or not url.password:
        return text
    for spelling in {str(url.password), quote(str(url.password), safe="")}:
        text = text.replace(spelling, "***")
    return text


def check_storage(storage: str) -> None:
    """A ``--storage`` that can be opened: a URL that SQLAlchemy parses, whose SQLite file's folder exists, or a
    ``journal:PATH`` whose folder exists (ValueError naming the fix otherwise); nothing is created."""
    if storage.startswith(JOURNAL_PREFIX):
        path = Path(storage[len(JOURNAL_PREFIX) :])
        if not path.name or path.is_dir():
            raise ValueError(
                f"--storage {storage}: give the journal file's path after journal:, e.g. journal:/shared/tune/study.log"
            )
        if not path.absolute().parent.is_dir():
            raise ValueError(
                f"--storage {storage}: folder {path.absolute().parent} does not exist: create it (on a file system "
                "every worker mounts), or give a journal file in an existing folder"
            )
        return
    url = _url(storage)
    if url is None:
        raise ValueError(
            f"--storage {shown_storage(storage)!r} is not a database URL: give one such as "
            "sqlite:///runs/tune/study.db (a file), postgresql://user:password@host:5432/database (a server) or "
            "journal:/shared/tune/study.log (a file on a shared disk)"
        )
    folder = Path(url.database).parent if url.get_backend_name() == "sqlite" and url.database else None
    if folder is not None and not folder.is_dir():
        raise ValueError(
            f"--storage {storage}: folder {folder} does not exist: create it, or give a database file in an existing "
            "folder"
        )


def _postgres_url(storage: str) -> str:
    """A ``postgresql://`` URL with the driver coretune installs (psycopg 3, else psycopg2, where installed);
    :class:`~coretune.extras.MissingExtra` without either. A URL naming its driver is kept."""
    url = _url(storage)
    if url is None or url.drivername != "postgresql":
        return storage
    for module, driver in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if installed(module):
            return url.set(drivername=f"postgresql+{driver}").render_as_string(hide_password=False)
    raise MissingExtra("coretune tune --storage postgresql://…", "psycopg", "tune-postgres")


def open_storage(optuna: Any, storage: str, grace_period: int = GRACE_PERIOD_S) -> tuple[Any, Any]:
    """The study's storage, with Optuna's heartbeat (a trial whose heartbeat is older than ``grace_period`` seconds
    is failed and queued again), and the callback that queues a failed trial again (same point, retry history kept).
    ValueError naming the storage, its password masked, and the fix for one that cannot be opened or reached."""
    interval = max(1, min(60, grace_period // 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        stale = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=_MAX_RETRY)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)
    if storage.startswith(JOURNAL_PREFIX):
        path = storage[len(JOURNAL_PREFIX) :]
        try:
            backend = optuna.storages.journal.JournalFileBackend(path)
            return _journal_with_heartbeat(optuna)(backend, interval, grace_period, stale), retry
        except OSError as err:
            raise ValueError(
                f"cannot open the study journal --storage {storage} ({err.strerror or err}): give a journal file in a "
                "writable folder every worker mounts"
            ) from None
    import sqlalchemy

    url = _postgres_url(storage)
    postgres = url.startswith("postgresql")
    # a server that does not answer is an error within seconds, not the operating system's minutes of TCP retries
    connect = {"connect_timeout": 10} if postgres and "connect_timeout" not in url else {}
    try:
        for attempt in range(_CREATE_TRIES):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    db = _rdb_with_heartbeat(optuna)(
                        url,
                        engine_kwargs={"pool_pre_ping": True, "connect_args": connect} if postgres else None,
                        heartbeat_interval=interval,
                        grace_period=grace_period,
                        heartbeat_stale_trial_callback=stale,
                    )
                break
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as err:
                # workers started at once on a new database all create Optuna's tables: one wins, the others
                # find them on their next try
                racing = "already exists" in str(err) or "duplicate key" in str(err)
                if not racing or attempt == _CREATE_TRIES - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
    except (ImportError, sqlalchemy.exc.SQLAlchemyError) as err:
        reason = _scrubbed(_first_line(err), storage)
        refused = "password" in reason or "authentication" in reason
        fix = (
            "check the user name and password in the URL"
            if refused
            else "check the URL, that its database server runs and that its driver is installed"
        )
        raise ValueError(
            f"cannot open the study storage --storage {shown_storage(storage)} ({reason}): {fix}"
        ) from None
    return db, retry


def _first_line(err: BaseException) -> str:
    """The first line of a driver's error, without SQLAlchemy's ``(psycopg.OperationalError)`` prefix."""
    text = str(getattr(err, "orig", None) or err).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


@functools.cache
def _journal_with_heartbeat(optuna: Any) -> type:
    """Optuna's ``JournalStorage`` with the heartbeat its RDB storage has (Optuna gives the journal none)."""
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    class JournalWithHeartbeat(optuna.storages.JournalStorage, BaseHeartbeat):  # type: ignore[misc,name-defined]
        def __init__(self, backend: Any, interval: int, grace_period: int, callback: Any) -> None:
            super().__init__(backend)
            self._interval, self._grace_period, self._callback = interval, grace_period, callback

        def record_heartbeat(self, trial_id: int) -> None:
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # another worker took it for dead
                self.set_trial_system_attr(trial_id, _HEARTBEAT_ATTR, time.time())

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now = time.time()
            stale = []
            for trial in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                started = trial.datetime_start.timestamp() if trial.datetime_start else now
                if now - max(started, trial.system_attrs.get(_HEARTBEAT_ATTR, 0.0)) > self._grace_period:
                    stale.append(trial._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int:
            return self._interval

        def get_heartbeat_stale_trial_callback(self) -> Any:
            return self._callback

    return JournalWithHeartbeat


@functools.cache
def _rdb_with_heartbeat(optuna: Any) -> type:
    """Optuna's ``RDBStorage`` whose stale trials also include the RUNNING ones that never recorded a heartbeat and
    started more than ``grace_period`` seconds ago (Optuna's skips them). A trial's start is the clock of the worker
    that started it (Optuna writes ``datetime.now()``): workers' clocks must agree within the grace period."""
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from optuna.trial import TrialState

    class RDBWithHeartbeat(optuna.storages.RDBStorage):  # type: ignore[misc,name-defined]
        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            return [*super()._get_stale_trial_ids(study_id), *self._silent_since_start(study_id)]

        def _silent_since_start(self, study_id: int) -> list[int]:
            running = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
            with _create_scoped_session(self.scoped_session) as session:
                beating = {
                    trial
                    for (trial,) in session.query(models.TrialHeartbeatModel.trial_id).filter(
                        models.TrialHeartbeatModel.trial_id.in_([t._trial_id for t in running])
                    )
                }
            now = datetime.now()  # a FrozenTrial's datetime_start is naive local time
            grace = self.grace_period if self.grace_period is not None else 2 * self.heartbeat_interval
            return [
                t._trial_id
                for t in running
                if t._trial_id not in beating
                and t.datetime_start is not None
                and (now - t.datetime_start).total_seconds() > grace
            ]

    return RDBWithHeartbeat
