"""``coretune compare --budget``: the comparison's total training, as epochs (``--budget 60``) or as wall-clock time
(``--budget 2h``, ``90m``, ``1h30m``, ``5400s``), and the epochs of each run it gives.

Every run of a comparison trains the same number of epochs (the methods compare paired, seed by seed), a multiple of
the validation interval (``--trainer.check_val_every_n_epoch``, ``v``) so that the final epoch is validated:

- **epochs**: ``E`` total epochs give each of the ``methods × seeds`` runs ``⌊E / (methods × seeds) / v⌋ · v``
  (:func:`epochs_for_total`);
- **time**: ``T`` seconds, with ``t_m`` the measured seconds per epoch of method ``m`` (a timing fit of ``v`` epochs
  of each method, before the comparison, whose wall time ``s`` counts against the budget), give each run
  ``⌊(T − s) / (seeds · Σ_m t_m) / v⌋ · v`` epochs: the runs one after another (``--workers`` running several at
  once finishes sooner; each fit's process start-up, seconds of imports and data set-up, is not counted)
  (:func:`epochs_for_time`).

A budget that gives a run less than ``v`` epochs is refused in one line naming the budget it needs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..runs.layout import RunDir

__all__ = ["Budget", "epochs_for_time", "epochs_for_total", "format_time", "measured_epoch_seconds", "parse_budget"]

_TIME = re.compile(r"(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m(?:in)?)?(?:(?P<s>\d+(?:\.\d+)?)s)?")


@dataclass(frozen=True)
class Budget:
    """A comparison's budget as given (``text``): total epochs (``epochs``) or wall-clock seconds (``seconds``)."""

    text: str
    epochs: int | None = None
    seconds: float | None = None


def parse_budget(text: str | None) -> Budget | None:
    """``--budget``'s value: an integer is total epochs, ``2h`` / ``90m`` / ``1h30m`` / ``45min`` / ``5400s`` is
    wall-clock time; None for None. ValueError (one line, the forms it takes) for anything else or a budget of
    nothing."""
    if text is None:
        return None
    word = str(text).strip().lower().replace(" ", "")
    forms = "give total epochs (an integer, e.g. 60) or wall-clock time (e.g. 2h, 90m, 1h30m, 5400s)"
    if re.fullmatch(r"[+-]?\d+", word):
        if int(word) < 1:
            raise ValueError(f"--budget must be >= 1 epoch (got {text}): {forms}")
        return Budget(str(text), epochs=int(word))
    match = _TIME.fullmatch(word)
    if not word or match is None or not any(match.groupdict().values()):
        raise ValueError(f"--budget {text}: {forms}")
    hours, minutes, seconds = (float(match.group(unit) or 0) for unit in "hms")
    total = 3600 * hours + 60 * minutes + seconds
    if total <= 0:
        raise ValueError(f"--budget {text} is no time: {forms}")
    return Budget(str(text), seconds=total)


def format_time(seconds: float) -> str:
    """A budget's spelling of ``seconds``, rounded up to the minute: ``"45m"``, ``"2h"``, ``"1h05m"``."""
    minutes = max(1, math.ceil(seconds / 60 - 1e-9))
    hours, rest = divmod(minutes, 60)
    if not hours:
        return f"{rest}m"
    return f"{hours}h" if not rest else f"{hours}h{rest:02d}m"


def epochs_for_total(budget: int, methods: int, seeds: int, every: int = 1) -> int:
    """Each run's epochs under a budget of ``budget`` total epochs (see the module); ValueError (one line, the budget
    needed) below ``every``."""
    runs = methods * seeds
    epochs = budget // runs // every * every
    if epochs < 1:
        raise ValueError(
            f"--budget {budget} gives each of the {runs} runs ({methods} methods × {seeds} seeds) less than {every} "
            f"epoch(s), the validation interval: give --budget {runs * every} or more, or fewer --methods or --seeds"
        )
    return epochs


def epochs_for_time(
    budget: Budget, per_epoch: Mapping[str, float], seeds: int, every: int = 1, spent: float = 0.0
) -> int:
    """Each run's epochs under the wall-clock ``budget`` (see the module): ``per_epoch`` the measured seconds per
    epoch of each method, ``spent`` the seconds the timing took; ValueError (one line, the budget needed) below
    ``every``."""
    assert budget.seconds is not None
    one_epoch_each = seeds * sum(per_epoch.values())  # an epoch of every run, one after another
    epochs = int(max(0.0, budget.seconds - spent) // one_epoch_each) // every * every if one_epoch_each > 0 else 0
    if epochs < 1:
        measured = ", ".join(f"{m} {t:.1f} s" for m, t in per_epoch.items())
        runs = len(per_epoch) * seeds
        raise ValueError(
            f"--budget {budget.text} gives each of the {runs} runs ({len(per_epoch)} methods × {seeds} seeds) less "
            f"than {every} epoch(s) (measured per epoch: {measured}; the timing took {spent:.0f} s): give --budget "
            f"{format_time(spent + every * one_epoch_each)} or more, or fewer --methods or --seeds"
        )
    return epochs


def measured_epoch_seconds(run_dir: str | Path) -> tuple[float, float]:
    """The mean seconds per epoch of a finished timing fit (``epoch_time_s`` of its ``metrics.csv`` rows: training
    and validation) and its wall time (``results.json``'s ``wall_time_s``); ValueError when it has none."""
    from ..engine import read_metrics

    run = RunDir(run_dir)
    times = [float(row["epoch_time_s"]) for row in read_metrics(run.metrics) if row.get("epoch_time_s")]
    wall = run.read_results().get("wall_time_s")
    if not times or wall is None:
        raise ValueError(
            f"the timing fit in {run.path} recorded no epoch time: delete that folder and run the comparison again"
        )
    return sum(times) / len(times), float(wall)
