"""``coretune bench``: a grid of ``coretune fit`` runs (objectives × data sets × label fractions × seeds) and its
tables of mean ± std top-1 in the layouts of the paper's Table 1 (methods × data sets), Table 2 (the ablation rows)
and its table of various numbers of labeled data (methods × label fractions; ``table4``, numbered Table 5 in the
NeurIPS version).

Every run is an ordinary ``coretune fit`` in its own subprocess (a crash ends that run only; ``workers`` runs go at
once), writing into ``<output>/<dataset>/<objective>/frac<f>/seed<s>``. The sweep is resumable: a run whose
``results.json`` holds test results is skipped, a started one resumes from its ``checkpoints/last.ckpt``, and one
that diverged (``results.json``'s ``diverged``) is a result: listed under the tables, not run again unless
``--retry_diverged``. ``--launcher submitit`` runs the same fits as cluster jobs instead (:mod:`.cluster`).
With ``metric: val`` the tables hold each run's final-epoch top-1 on a validation split carved from the training
set (``--data.val_fraction``), for studies that must not look at the test split.
"""

from __future__ import annotations

import signal
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from ..extras import need
from ..runs.layout import RunDir
from ..runs.outputs import check_folder_output
from .export import export_records
from .launch import SweepInterrupted, run_sweep
from .report import write_summary
from .spec import BenchSpec
from .status import print_status

__all__ = ["main"]


def _parser() -> Any:
    from ..arguments import ArgumentParser

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune bench",
        description="Run a grid of coretune fit runs (objectives × data sets × label fractions × seeds) from a YAML "
        "spec (see configs/bench/), resumably, and tabulate mean ± std top-1 per cell (test; with 'metric: val' the "
        "final epoch's on a validation split) in summary.md, summary.csv, runs.csv, bars.png and "
        "label_fraction.png in the spec's output folder.",
    )
    parser.add_argument("config", type=str, help="The bench spec (YAML).")
    parser.add_argument(
        "--workers",
        type=int | None,
        default=None,
        help="Concurrent fit subprocesses (default: the spec's workers). Use 1 on a 2-core CPU.",
    )
    parser.add_argument(
        "--only_objectives",
        type=list[str] | None,
        default=None,
        help="Run only these objective names of the spec (the tables still cover the whole grid).",
    )
    parser.add_argument("--only_seeds", type=list[int] | None, default=None, help="Run only these seeds of the spec.")
    parser.add_argument(
        "--only_datasets",
        type=list[str] | None,
        default=None,
        help="Run only these data sets (columns) of the spec, e.g. those whose checkpoint is on this machine.",
    )
    parser.add_argument(
        "--logger",
        type=str | None,
        default=None,
        help="Log every run into one place in the output folder: mlflow (one experiment named after the spec, in "
        "OUTPUT/mlruns), tensorboard (OUTPUT/tensorboard), csv (OUTPUT/csv) or wandb (offline, one project). May be "
        "added or changed when a sweep is resumed.",
    )
    parser.add_argument(
        "--launcher.name",
        type=Literal["local", "submitit"],
        default="local",
        help="Where the fits run (spelled --launcher NAME): local (subprocesses of this command, --workers at once) "
        "or submitit (one cluster job a run, a SLURM job array, with the --launcher.* settings below; the same fit "
        "commands in the same run folders).",
    )
    from .cluster import SubmititSettings

    parser.add_class_arguments(SubmititSettings, "launcher", help="--launcher submitit's settings.")
    parser.add_argument("--dry_run", action="store_true", help="Print the fit commands of the unfinished runs.")
    parser.add_argument(
        "--retry_diverged",
        action="store_true",
        help="Run again, from the start, the runs that diverged or collapsed in an earlier sweep (their folders are "
        "moved aside, kept). By default such a run is a result and not run again: with its seed and settings it "
        "diverges again, so retry after changing the code; other settings need a spec entry under a new name.",
    )
    parser.add_argument("--aggregate_only", action="store_true", help="Only (re)write the tables and plots.")
    parser.add_argument(
        "--baseline",
        type=str | None,
        default=None,
        help="The row the tables compare every other row with (differences, paired by seed), instead of the spec's "
        "baseline: e.g. --aggregate_only --baseline at_ce_linf. The tables written say which row it was.",
    )
    parser.add_argument(
        "--status",
        action="store_true",
        help="List every run (of --only_objectives/--only_seeds/--only_datasets if given): finished (its top-1), "
        "running, how far it got, or not started.",
    )
    parser.add_argument(
        "--export",
        type=str | None,
        default=None,
        help="Copy the small files of every finished or diverged run (of --only_objectives/--only_seeds/"
        "--only_datasets if given: config.yaml, fit_args.json, metrics.csv, results.json; no checkpoints) into this "
        "folder, in the output folder's layout; copied back into the output folder, they count as finished (or "
        "diverged) runs. Runs nothing; with --aggregate_only the tables and plots are rewritten first.",
    )
    return parser


def holds_runs(folder: Path) -> bool:
    """Whether ``folder`` is a sweep's output (or records exported from one) made before sweeps marked their
    folders: its run directories (``<dataset>/<objective>/frac<f>/seed<k>``) or its summary."""
    return any(folder.glob("summary.*")) or any(path.is_dir() for path in folder.glob("*/*/frac*/seed*"))


def _data_read(spec: BenchSpec) -> list[Path]:
    """The data folders and files the spec's fits read (the paths among their ``--data.*`` options)."""
    return list(dict.fromkeys(path for run in spec.runs() for path in run.job.data_paths()))


def launcher_args(args: list[str]) -> list[str]:
    """``--launcher NAME`` (or ``--launcher=NAME``) spelled as the option it sets, ``--launcher.name=NAME``; a
    ``--launcher`` followed by a file (a YAML of the ``--launcher.*`` settings) is left as it is."""
    out, i = [], 0
    while i < len(args):
        word = args[i]
        if word == "--launcher" and i + 1 < len(args) and not _settings_file(args[i + 1]):
            out.append(f"--launcher.name={args[i + 1]}")
            i += 2
            continue
        if word.startswith("--launcher=") and not _settings_file(word.partition("=")[2]):
            word = f"--launcher.name={word.partition('=')[2]}"
        out.append(word)
        i += 1
    return out


def _settings_file(value: str) -> bool:
    return value.startswith(("{", "--")) or Path(value).is_file()


def _launcher(cfg: Any) -> Any:
    """The ``SubmititSettings`` of ``--launcher submitit``, else None; a ``--launcher.*`` setting given with the
    local launcher is refused (it would be ignored)."""
    from .cluster import SubmititSettings

    given = {f.name: getattr(cfg.launcher, f.name) for f in fields(SubmititSettings)}
    if cfg.launcher.name == "submitit":
        return SubmititSettings(**given)
    default = SubmititSettings()
    if changed := [name for name, value in given.items() if value != getattr(default, name)]:
        raise ValueError(
            f"--launcher.{changed[0]} is a setting of --launcher submitit, but the runs go to the local launcher: "
            "add --launcher submitit (or leave the setting out)"
        )
    return None


def main(args: list[str]) -> None:
    from rich.console import Console

    cfg = _parser().parse_args(launcher_args(args))
    launcher = _launcher(cfg)
    spec = BenchSpec.from_yaml(cfg.config)
    if cfg.baseline is not None:
        spec = spec.compared_with(cfg.baseline)
    if cfg.workers is not None and cfg.workers < 1:
        raise ValueError(f"--workers must be >= 1 (got {cfg.workers})")
    console = Console()
    subset = spec.subset(cfg.only_objectives, cfg.only_seeds, cfg.only_datasets)
    if cfg.status:
        print_status(subset, console, whole=spec)
        return
    for module in ("scipy", "matplotlib"):  # the report's paired t-tests and figures, before any run
        need(module, "coretune bench", "bench")
    reads, data = [("the spec", cfg.config)], _data_read(spec)
    if cfg.export is not None:
        check_folder_output(cfg.export, "bench", option="--export", reads=reads, data=data, ours=holds_runs)
    elif not cfg.dry_run:
        check_folder_output(spec.output, "bench", option="the spec's output", reads=reads, data=data, ours=holds_runs)
    if cfg.export is not None:
        if cfg.aggregate_only:
            _print_summary(spec, console)
        written = export_records(subset, cfg.export)
        console.print(
            f"copied the records of {len(written)} finished or diverged run(s) to {cfg.export}", highlight=False
        )
        return
    report = None
    if not cfg.aggregate_only:
        try:
            if launcher is not None:
                from .cluster import submit_sweep

                report = submit_sweep(subset, launcher, console, cfg.dry_run, cfg.logger, cfg.retry_diverged)
            else:
                report = run_sweep(
                    subset,
                    workers=cfg.workers,
                    dry_run=cfg.dry_run,
                    console=console,
                    logger=cfg.logger,
                    retry_diverged=cfg.retry_diverged,
                )
        except KeyboardInterrupt:  # a second Ctrl+C (the first only sets run_sweep's stop): no traceback
            raise SweepInterrupted(
                signal.SIGINT,
                "sweep aborted by a second SIGINT: the running fits were asked to stop (one that could not save "
                "resumes from its last saved epoch). Re-run the same command to resume: finished runs are skipped",
            ) from None
        if cfg.dry_run:
            return
    _print_summary(spec, console)
    if report is not None and report.signum is not None:
        counts = (
            f"{len(report.finished)} run(s) finished, {len(report.interrupted)} interrupted with a resumable "
            f"checkpoint, {len(report.not_started)} not started"
            + (f", {len(report.failed)} failed" if report.failed else "")
            + (f", {len(report.diverged)} diverged" if report.diverged else "")
            + (f", {len(report.in_use)} run by another process" if report.in_use else "")
        )
        raise SweepInterrupted(
            report.signum,
            f"sweep stopped by {signal.Signals(report.signum).name}: {counts}. Re-run the same command to resume: "
            "finished runs are skipped, interrupted ones continue from checkpoints/last.ckpt"
            + (", diverged ones are not run again" if report.diverged else ""),
        )
    if report is not None and report.queued:
        console.print(
            f"{len(report.queued)} run(s) queued or running as cluster jobs (`--status` shows them; re-run the same "
            "command once they finish to write the tables with them: finished runs are skipped)",
            highlight=False,
        )
    if report is not None and report.in_use:
        console.print(
            f"{len(report.in_use)} run(s) skipped: another process is running them (`--status` shows how far they "
            "got; `--aggregate_only` updates the tables once they finish)",
            highlight=False,
        )
    if report is not None and (report.failed or report.interrupted or report.diverged):
        logs = "; ".join(str(RunDir(run.run_dir).log) for run in report.failed)
        parts = [f"{len(report.failed)} failed (see {logs})"] if report.failed else []
        if report.interrupted:
            parts.append(f"{len(report.interrupted)} interrupted (resumable)")
        if report.diverged:
            parts.append(
                f"{len(report.diverged)} diverged (listed under the tables; each message is in its results.json)"
            )
        runs = sum(map(len, (report.failed, report.interrupted, report.diverged, report.finished, report.skipped)))
        runs += len(report.in_use)
        again = (
            ("fix the cause and " if report.failed else "") + "re-run the same command to run them again"
            if report.failed or report.interrupted
            else ""
        )
        if report.diverged:
            fix = (
                "the same settings diverge again, so add a spec entry under a new name with a lower learning rate or "
                "gradient clipping (--trainer.gradient_clip_val 1.0); after a code change, --retry_diverged runs them "
                "again from the start"
            )
            again = f"{again}; for the diverged runs: {fix}" if again else f"for the diverged runs: {fix}"
        listed = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
        raise RuntimeError(f"of {runs} runs, {listed}; {again}")


def _print_summary(spec: BenchSpec, console: Any) -> None:
    """Rewrite the spec's tables and plots (:func:`write_summary`) and show them."""
    markdown, paths = write_summary(spec)
    console.print(markdown, highlight=False, markup=False, soft_wrap=True)
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)
