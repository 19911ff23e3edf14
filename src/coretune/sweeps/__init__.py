"""Experiments: grids of ``coretune fit`` runs and what is made of them (``coretune bench``, ``tune``, ``compare``).

One module per concern: :mod:`.spec` (the YAML grid and its runs), :mod:`.job` (a run's fit as a typed
:class:`~.job.FitJob`, rendered as a ``coretune fit`` command line only where a process starts), :mod:`.launch`
(each run a ``coretune fit`` subprocess, with run claims and stop signals), :mod:`.records` (a run read back from
its directory), :mod:`.collect` (runs into cells and curves), :mod:`.stats` (means, standard deviations, paired
t-tests), :mod:`.report` (the tables and summary files), :mod:`.plots`, :mod:`.status` (``--status``),
:mod:`.export` (``--export``), and the three commands: :mod:`.bench`, :mod:`.tune` (an Optuna study of an
objective's hyper-parameters, Core-tuning's η and α) with :mod:`.space` (the search space an objective declares),
:mod:`.study` (the study's storage, resumed trials and settings) and :mod:`.trialargs` (the checks of the trials'
fit arguments), and :mod:`.comparison` (which method to use on your data, chosen on a validation split) with
:mod:`.choice` (its paired table, its recommendation and the rule on the validation split's size).
"""

from .collect import CurvePoint, collect_cells, collect_curves
from .export import export_records
from .job import FitArgs, FitJob, FitOption
from .launch import (
    SUBPROCESS_FIT_ARGS,
    EpochBars,
    StopSignal,
    SweepInterrupted,
    SweepReport,
    catch_stop_signals,
    fit_command,
    launch_fit,
    run_sweep,
    visible_gpus,
    worker_envs,
)
from .plots import curves_metric
from .records import RunRecord, final_val_top1, format_duration, run_top1, training_time_left
from .report import write_summary
from .spec import BenchSpec, BenchSpecError, ObjectiveEntry, Run, table_layout
from .stats import Cell, Comparison, compare
from .status import print_status, sweep_time_left
from .tune import TrialFailed

__all__ = [
    "SUBPROCESS_FIT_ARGS",
    "BenchSpec",
    "BenchSpecError",
    "Cell",
    "Comparison",
    "CurvePoint",
    "EpochBars",
    "FitArgs",
    "FitJob",
    "FitOption",
    "ObjectiveEntry",
    "Run",
    "RunRecord",
    "StopSignal",
    "SweepInterrupted",
    "SweepReport",
    "TrialFailed",
    "catch_stop_signals",
    "collect_cells",
    "collect_curves",
    "compare",
    "curves_metric",
    "export_records",
    "final_val_top1",
    "fit_command",
    "format_duration",
    "launch_fit",
    "print_status",
    "run_sweep",
    "run_top1",
    "sweep_time_left",
    "table_layout",
    "training_time_left",
    "visible_gpus",
    "worker_envs",
    "write_summary",
]
