"""Passing a signal on to a ``coretune fit`` subprocess through a *stop file* (light: no torch import).

``coretune bench`` and ``coretune tune`` start each fit with the environment variable :data:`STOP_FILE_ENV`
naming a file in its run directory. When the sweep receives SIGINT or SIGTERM it writes the signal's name into
that file (:func:`request_stop`), and the fit's :class:`coretune.engine.StopOnSignal` stops at the next batch end
as if it had received the signal: it saves a resumable ``last.ckpt`` and exits ``128 + signal``. This reaches a fit
whatever sent the signal (``kill <sweep pid>``, a container's SIGTERM to its main process, Ctrl+C at the terminal);
a forwarded *signal* would not do: when the fit got the signal too (Ctrl+C reaches the terminal's whole process
group), a second one would abort its save.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["STOP_FILE_ENV", "request_stop", "requested_signal"]

STOP_FILE_ENV = "CORETUNE_STOP_FILE"
"""Environment variable naming the stop file a fit watches."""


def request_stop(path: str | Path, signum: int) -> None:
    """Ask the fit watching the stop file ``path`` to stop as on signal ``signum`` (written atomically)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(signal.Signals(signum).name + "\n")
    os.replace(tmp, path)


def requested_signal(path: str | Path) -> int | None:
    """The signal the stop file ``path`` asks for (SIGTERM if it names none), or ``None`` when there is none."""
    try:
        name = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    return signal.Signals[name] if name in signal.Signals.__members__ else signal.SIGTERM
