"""A sweep's fit as a typed job: :class:`FitJob` (run directory, objective and its options, the data options the
sweep sets, the seed, the user's fit arguments), rendered as a ``coretune fit`` command line only where a process
starts (:meth:`FitJob.argv`, :meth:`FitJob.command`) or a command is shown (:meth:`FitJob.command_str`).

The user's own fit arguments (a spec's ``base_args``, a data set's or objective row's ``args``, ``coretune tune``'s
arguments after ``--``) are :class:`FitArgs`: parsed once into :class:`FitOption` s (``--name=value``,
``--name value`` or a bare ``--flag``) that keep their spelling, so that :meth:`FitJob.argv` gives back exactly the
list a run records in ``fit_args.json``, while the checks read the options (:meth:`FitArgs.names`,
:meth:`FitArgs.data_paths`, :meth:`FitArgs.value`) instead of matching strings.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..runs.layout import RunDir
from ..runs.outputs import data_paths

__all__ = ["SUBPROCESS_FIT_ARGS", "FitArgs", "FitJob", "FitOption", "current_spelling", "fit_command"]


SUBPROCESS_FIT_ARGS = ("--trainer.enable_progress_bar=false",)
"""What a sweep adds to every ``coretune fit`` it starts (not recorded with the run's arguments)."""


@dataclass(frozen=True)
class FitOption:
    """One fit option as given: ``--name=value`` (``joined``), ``--name value``, a bare ``--name`` (``value`` None),
    or a word that is no option (``name`` empty, the word in ``value``)."""

    name: str
    value: str | None = None
    joined: bool = True

    def argv(self) -> tuple[str, ...]:
        """The option's words, spelled as given."""
        if not self.name:
            return (self.value or "",)
        if self.value is None:
            return (f"--{self.name}",)
        return (f"--{self.name}={self.value}",) if self.joined else (f"--{self.name}", self.value)


@dataclass(frozen=True)
class FitArgs:
    """Fit arguments as options, in their order (:meth:`parse`, :meth:`argv` gives the words back unchanged)."""

    options: tuple[FitOption, ...] = ()

    @classmethod
    def parse(cls, args: Iterable[str]) -> FitArgs:
        """``--name=value``, ``--name value`` (the next word does not start with ``--``) or a bare ``--name``."""
        words, options, i = list(args), [], 0
        while i < len(words):
            word = words[i]
            if not word.startswith("--"):
                options.append(FitOption("", word))
            elif "=" in word:
                name, _, value = word[2:].partition("=")
                options.append(FitOption(name, value))
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                options.append(FitOption(word[2:], words[i + 1], joined=False))
                i += 1
            else:
                options.append(FitOption(word[2:]))
            i += 1
        return cls(tuple(options))

    def __iter__(self) -> Iterator[FitOption]:
        return iter(self.options)

    def __add__(self, other: FitArgs) -> FitArgs:
        return FitArgs(self.options + other.options)

    def argv(self) -> list[str]:
        return [word for option in self.options for word in option.argv()]

    def names(self) -> list[str]:
        """The options' names (``data.root``, ``objective.eta``, ``config``), without words that are no option."""
        return [option.name for option in self.options if option.name]

    def value(self, name: str) -> str | None:
        """The value of the last ``--name`` given with one (the one the parser keeps), or None."""
        found = None
        for option in self.options:
            if option.name == name and option.value is not None:
                found = option.value
        return found

    def section(self, prefix: str) -> list[tuple[str, str | None]]:
        """``(name, value)`` of each option under ``prefix.`` (``data``: ``[("root", DIR), …]``), in order."""
        return [(o.name.removeprefix(f"{prefix}."), o.value) for o in self.options if o.name.startswith(f"{prefix}.")]

    def configs(self) -> list[str]:
        """The ``--config`` files, in order."""
        return [o.value for o in self.options if o.name == "config" and o.value is not None]

    def data_paths(self) -> list[Path]:
        """The existing data paths the ``--data.*`` options name (``--data.root DIR``, ``--data.train_dir=DIR`` …:
        :func:`~coretune.runs.outputs.data_paths`)."""
        found: dict[Path, None] = {}
        for name, value in self.section("data"):
            found |= dict.fromkeys(data_paths({name: value}))
        return list(found)


def current_spelling(args: Iterable[str]) -> list[str]:
    """Fit arguments with each option an older version spelled otherwise renamed as it is spelled now
    (``--model.lr=0.1``: ``--model.optim.lr=0.1``, :func:`~coretune.engine.modelsettings.moved_option`; Core-tuning's
    ``--objective.lambda_n``: ``--objective.miner.lambda_n``, :func:`~coretune.engine.fitcli.current_objective_args`):
    what two argument lists are compared as, so that a run recorded with the old spelling is the same run."""
    from ..engine.fitargs import current_objective_args
    from ..engine.modelsettings import moved_option

    def renamed(option: FitOption) -> FitOption:
        new = moved_option(option.name.removeprefix("model.")) if option.name.startswith("model.") else None
        return option if new is None else replace(option, name=f"model.{new}")

    return FitArgs(tuple(map(renamed, FitArgs.parse(current_objective_args(list(args)))))).argv()


def fit_command(argv: Sequence[str], run_dir: str | Path, resume: bool | None = None) -> list[str]:
    """The ``coretune fit`` subprocess command of a run's arguments; it resumes from ``checkpoints/last.ckpt``
    (``--ckpt_path=last``) when ``resume``, by default when that file is present."""
    run_dir = Path(run_dir)
    cmd = [sys.executable, "-m", "coretune.cli", "fit", *SUBPROCESS_FIT_ARGS, *argv, f"--run_dir={run_dir}"]
    if RunDir(run_dir).last_checkpoint.is_file() if resume is None else resume:
        cmd.append("--ckpt_path=last")
    return cmd


@dataclass(frozen=True)
class FitJob:
    """One ``coretune fit`` of a sweep: its run directory, the user's fit arguments (``fit_args``: a spec's
    ``base_args`` and data set's ``args``; ``coretune tune``'s), the objective (``--objective``) and its options (a
    spec row's ``args``, the hyper-parameters a study chose), the data options the sweep sets itself (``data``: the
    label fraction, a study's validation split) and the seed.

    :meth:`argv` renders the fit arguments once, in the order a run records them in ``fit_args.json``."""

    run_dir: Path
    objective: str
    seed: int
    fit_args: FitArgs = field(default_factory=FitArgs)
    objective_args: FitArgs = field(default_factory=FitArgs)
    data: tuple[tuple[str, Any], ...] = ()

    def options(self) -> FitArgs:
        """Every option of the job (the user's, the objective's, the sweep's data options and seed), in order."""
        sweep = [FitOption(f"data.{name}", f"{value}") for name, value in self.data]
        return (
            self.fit_args
            + FitArgs((FitOption("objective", self.objective, joined=False),))
            + self.objective_args
            + FitArgs((*sweep, FitOption("seed", f"{self.seed}")))
        )

    def argv(self) -> list[str]:
        """The ``coretune fit`` arguments (without ``--run_dir``): the user's, ``--objective NAME``, the objective's
        options, ``--data.NAME=VALUE`` of the sweep's data options and ``--seed=N``."""
        return self.options().argv()

    def command(self, extra: Sequence[str] = (), resume: bool | None = None) -> list[str]:
        """The subprocess command (:func:`fit_command`), then ``extra`` (a sweep's logger arguments)."""
        return [*fit_command(self.argv(), self.run_dir, resume), *extra]

    def command_str(self, extra: Sequence[str] = (), resume: bool | None = None) -> str:
        """:meth:`command` as one shell line (``--dry_run``, ``log.txt``)."""
        return shlex.join(self.command(extra, resume))

    def data_paths(self) -> list[Path]:
        """The existing data paths the job's ``--data.*`` options name."""
        return self.options().data_paths()
