"""A sweep's fit as a typed job (:mod:`coretune.sweeps.job`): the ``coretune fit`` arguments it renders are those a
run records in ``fit_args.json``, word for word, and its checks read options instead of matching strings."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from sweep_helpers import spec_of

from coretune.sweeps.job import FitArgs, FitJob, FitOption, fit_command

USER_ARGS = [
    ["--trainer.max_epochs=2"],
    ["--data.root", "DATA", "--trainer.max_epochs", "3"],  # separate values
    ["--config", "base.yaml", "--config=more.yaml", "--data.root=DATA", "--trainer.fast_dev_run"],  # config files
    ["--data.val_fraction=0.2", "--model.weights", "w.ckpt", "--model.weights=x.ckpt", "--data.root=a=b"],
]


@pytest.mark.parametrize("args", USER_ARGS)
def test_fit_args_round_trip_word_for_word(args: list[str]) -> None:
    assert FitArgs.parse(args).argv() == args


def test_fit_args_are_read_as_options(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    root = str(tmp_path / "data")
    options = FitArgs.parse(["--config", "a.yaml", "--data.root", root, "--config=b.yaml", "--data.train_dir=nowhere"])
    assert options.configs() == ["a.yaml", "b.yaml"]
    assert options.names() == ["config", "data.root", "config", "data.train_dir"]
    assert options.section("data") == [("root", root), ("train_dir", "nowhere")]
    assert options.data_paths() == [tmp_path / "data"]  # existing paths only
    assert FitArgs.parse(["--model.weights", "a", "--model.weights=b"]).value("model.weights") == "b"  # the last
    assert list(FitArgs.parse(["--trainer.fast_dev_run", "--seed=1"])) == [
        FitOption("trainer.fast_dev_run"),
        FitOption("seed", "1"),
    ]


@pytest.mark.parametrize(
    "objectives",
    [
        ["ce", "core"],  # registered names (presets)
        [{"name": "core_eta1", "objective": "core", "args": ["--objective.eta=1"]}],
        [{"name": "bss_k2", "objective": "bss", "args": ["--objective.k", "2", "--config=obj.yaml"]}],
    ],
)
@pytest.mark.parametrize("args", USER_ARGS)
def test_spec_jobs_render_the_arguments_runs_record(tmp_path: Path, objectives: list, args: list[str]) -> None:
    """``FitJob.argv`` is the list today's ``fit_args.json`` files hold: base_args, the data set's args,
    ``--objective NAME``, the row's args, the label fraction and the seed, in that order and spelling."""
    spec = spec_of(tmp_path, base_args=args, objectives=objectives, label_fractions=[0.1, 1.0], seeds=[0, 2])
    entries = {e.name: e for e in spec.objectives}
    for run in spec.runs():
        entry = entries[run.objective]
        expected = [
            *spec.base_args,
            *spec.datasets[run.dataset],
            "--objective",
            entry.objective,
            *entry.args,
            f"--data.label_fraction={run.label_fraction}",
            f"--seed={run.seed}",
        ]
        assert run.job.argv() == expected and run.args == tuple(expected)
        assert run.job.objective == entry.objective and run.job.seed == run.seed
        assert run.job.data == (("label_fraction", run.label_fraction),)
        assert FitArgs.parse(expected).argv() == expected


def test_a_study_job_renders_its_chosen_values_holdout_and_seed(tmp_path: Path) -> None:
    job = FitJob(
        run_dir=tmp_path / "trial",
        objective="core",
        seed=3,
        fit_args=FitArgs.parse(["--data.root", "D", "--trainer.max_epochs=2"]),
        objective_args=FitArgs((FitOption("objective.eta", "0.1"), FitOption("objective.alpha", "10.0"))),
        data=(("val_fraction", 0.2),),
    )
    argv = ["--data.root", "D", "--trainer.max_epochs=2", "--objective", "core"]
    argv += ["--objective.eta=0.1", "--objective.alpha=10.0", "--data.val_fraction=0.2", "--seed=3"]
    assert job.argv() == argv
    command = [sys.executable, "-m", "coretune.cli", "fit", "--trainer.enable_progress_bar=false", *argv]
    assert job.command() == [*command, f"--run_dir={tmp_path / 'trial'}"] == fit_command(argv, job.run_dir)
    (tmp_path / "trial" / "checkpoints").mkdir(parents=True)
    (tmp_path / "trial" / "checkpoints" / "last.ckpt").touch()
    assert job.command(["--logger=x"])[-2:] == ["--ckpt_path=last", "--logger=x"]  # a started run resumes
    assert "--ckpt_path=last" not in job.command(resume=False)  # a run that diverged starts over
    assert shlex.split(job.command_str()) == job.command()
    assert hash(job) == hash(FitJob(**{f: getattr(job, f) for f in job.__dataclass_fields__}))  # a dict key
