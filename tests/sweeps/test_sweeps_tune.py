"""``coretune tune``: an Optuna study over η and α, selected on a validation split, resumable."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import pytest
import yaml

import coretune.sweeps.tune as tune_module
from coretune.cli import main
from coretune.engine import read_metrics
from coretune.runs.claim import RunInUse
from coretune.runs.layout import RunDir
from coretune.sweeps.launch import SweepInterrupted
from coretune.sweeps.tune import TrialFailed, tune
from fit_flags import TINY_FIT
from inprocess_fits import fits_in_process

pytest.importorskip("optuna")


@pytest.fixture
def data_arg(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``--data.root`` of an image folder with an empty train/: enough for tune's up-front path check (the fits are
    faked)."""
    root = tmp_path_factory.mktemp("data")
    (root / "train").mkdir()
    return f"--data.root={root}"


def finish(run_dir: Path, val_top1: list[float]) -> None:
    """A finished run directory as coretune fit leaves it: metrics.csv and results.json with test results."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{epoch},{value}\n" for epoch, value in enumerate(val_top1))
    (run_dir / "metrics.csv").write_text("epoch,val/top1\n" + rows)
    (run_dir / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))


def diverge(run_dir: Path, key: str = "diverged") -> str:
    """A run directory as coretune fit leaves a fit that diverged (or, ``collapsed``, fell to chance): results.json
    records the message and no test results. Returns the message."""
    message = (
        f"the training loss is nan at epoch 2, step 7 in {run_dir.name}: lower the learning rate (--model.optim.lr)"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps({key: message}))
    return message


def point(args: list[str]) -> tuple[float, float]:
    """The (η, α) a trial's fit arguments set."""
    values = dict(a.partition("=")[::2] for a in args if a.startswith("--objective."))
    return float(values["--objective.eta"]), float(values["--objective.alpha"])


def test_refuses_to_select_on_the_test_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--val_fraction must lie in \(0, 1\) \(got 0.0\): tuning selects on a"):
        tune(["--data.root=x"], output=tmp_path, val_fraction=0.0)
    with pytest.raises(SystemExit, match=r"never on the test split"):
        main(["tune", f"--output={tmp_path}", "--val_fraction=0", "--", "--data.root=x"])
    with pytest.raises(ValueError, match=r"^remove --data.val_fraction from the fit arguments"):
        tune(["--data.val_fraction=0"], output=tmp_path)
    with pytest.raises(
        ValueError,
        match=r"^--objective 'ce' declares no hyper-parameter to tune \(an empty search_space\); choose one of "
        r"bi_tuning, bss, ce_con_mixh, core, delta, l2sp, logit_adjusted, manifold_mixup, mm, scl$",
    ):
        tune([], output=tmp_path, objective="ce")
    # a preset whose η defines it, or that mixes nothing (α without effect): the grid would not tune that method
    with pytest.raises(ValueError, match=r"^--objective 'ce_mix' fixes eta at 0.0 \(it defines the method\); choose"):
        tune([], output=tmp_path, objective="ce_mix")
    with pytest.raises(
        ValueError, match=r"^--objective 'ce_con' mixes nothing \(miner null, no manifold_mixup\): alpha would have"
    ):
        tune([], output=tmp_path, objective="ce_con")
    for bad, message in (
        ({"eta": []}, r"^--eta and --alpha need at least one value each \(got eta \[\]"),
        ({"alpha": [float("nan")]}, r"^α must be finite and > 0, η finite and >= 0"),
        ({"sampler": "tpe", "n_trials": 0}, r"^--n_trials must be >= 1 \(got 0\)"),
    ):
        with pytest.raises(ValueError, match=message):
            tune(["--data.root=x"], output=tmp_path, **bad)
    for arg in ("--seed=3", "--seed_everything=3", "--ckpt_path=last"):  # tune sets the seeds; trials resume alone
        with pytest.raises(ValueError, match=rf"^remove {arg.partition('=')[0]} from the fit arguments: "):
            tune([arg], output=tmp_path)
    assert not (tmp_path / "study.db").exists()


def test_grid_trials_run_fit_on_a_validation_split_and_write_best_yaml(image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "tune"
    finish(out / "trials" / "eta0.1_alpha1", [0.2, 0.0])  # one grid point was finished earlier (resumed)
    main(["tune", f"--output={out}", "--eta", "0.1", "1", "--alpha", "1", "--", f"--data.root={image_tree}", *TINY_FIT])

    real = out / "trials" / "eta1_alpha1"  # the other point ran coretune fit
    config = yaml.safe_load((real / "config.yaml").read_text())
    assert config["data"]["val_fraction"] == 0.2
    assert config["objective"]["init_args"]["eta"] == 1.0 and config["objective"]["init_args"]["alpha"] == 1.0
    assert json.loads((real / "results.json").read_text())["test"]["top1"] >= 0
    real_value = float(read_metrics(real / "metrics.csv")[-1]["val/top1"])

    trials = {r["run_dir"]: r for r in csv.DictReader((out / "trials.csv").open())}
    assert {Path(d).name for d in trials} == {"eta0.1_alpha1", "eta1_alpha1"}
    assert float(trials[str(real)]["final_val_top1"]) == pytest.approx(real_value)
    assert float(trials[str(out / "trials" / "eta0.1_alpha1")]["final_val_top1"]) == 0.0
    best = yaml.safe_load((out / "best.yaml").read_text())["objective"]
    assert best["class_path"] == "coretune.objectives.core.CoreTuning" and best["init_args"]["alpha"] == 1.0
    assert best["init_args"]["eta"] == 1.0 if real_value > 0 else best["init_args"]["eta"] in (0.1, 1.0)  # a tie
    if best["init_args"]["eta"] == 1.0:  # the trial that ran: its fit's own objective settings, every one of them
        assert best == config["objective"]
    assert (out / "study.db").is_file()


def test_resume_keeps_finished_trials_and_retries_failed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    launched: list[str] = []
    broken = {"eta10_alpha0.5"}

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(run_dir.name)
        assert "--data.val_fraction=0.3" in args and "--objective" in args
        if run_dir.name in broken:
            return 1
        finish(run_dir, [0.1, 0.3 if run_dir.name.startswith("eta1_") else 0.6])
        RunDir(run_dir).fit_args.write_text(json.dumps(list(args)))  # as launch_fit records them
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    grid = {"eta": [1.0, 10.0], "alpha": [0.5], "val_fraction": 0.3, "output": tmp_path}
    study = tune([data_arg], objective="ce_con_mixh", **grid)
    assert sorted(launched) == ["eta10_alpha0.5", "eta1_alpha0.5"]
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "FAIL"]
    best_yaml = (tmp_path / "best.yaml").read_text()
    best = yaml.safe_load(best_yaml)["objective"]["init_args"]
    assert best == {"focal": False, "eta": 1.0, "alpha": 0.5}  # the ce_con_mixh preset is kept
    # the failed grid point is named: this best is the best of the others
    assert "# PARTIAL: not finished: eta 10 alpha 0.5 (FAIL); re-run the same command to retry them." in best_yaml

    launched.clear()
    broken.clear()
    study = tune([data_arg], objective="ce_con_mixh", **grid)  # resume: only the failed point runs again
    assert launched == ["eta10_alpha0.5"]
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "COMPLETE", "FAIL"]
    assert yaml.safe_load((tmp_path / "best.yaml").read_text())["objective"]["init_args"]["eta"] == 10.0
    assert "PARTIAL" not in (tmp_path / "best.yaml").read_text()  # every point has a finished trial now

    launched.clear()
    assert len(tune([data_arg], objective="ce_con_mixh", **grid).trials) == 3 and launched == []  # complete
    with pytest.raises(ValueError, match="was run on another grid"):
        tune([data_arg], objective="ce_con_mixh", **{**grid, "alpha": [0.5, 2.0]})
    # another seed (another validation split, another grid order) or validation fraction: not this study
    with pytest.raises(ValueError, match=r"was run with --seed 0 \(now 1\): pass the same, or a new --study_name"):
        tune([data_arg], objective="ce_con_mixh", **grid, seed=1)
    with pytest.raises(ValueError, match=r"was run with --val_fraction 0.3 \(now 0.25\)"):
        tune([data_arg], objective="ce_con_mixh", **{**grid, "val_fraction": 0.25})
    # other fit arguments or another objective: the points still to run would not compare with those that ran
    with pytest.raises(ValueError, match=rf"was run with fit arguments {data_arg} \(now {data_arg} "
                       r"--trainer.max_epochs=9\)"):  # fmt: skip
        tune([data_arg, "--trainer.max_epochs=9"], objective="ce_con_mixh", **grid)
    with pytest.raises(ValueError, match=r"was run with --objective ce_con_mixh \(now core\)"):
        tune([data_arg], objective="core", **grid)
    # a finished trial folder of another study in the same output (a new --study_name, other seed) is no result
    with pytest.raises(ValueError, match=r"trials/eta1_alpha0.5 was started with other fit arguments"):
        tune([data_arg], objective="ce_con_mixh", **grid, seed=1, study_name="other")


def test_tied_trials_choose_the_earliest_and_best_yaml_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    """Optuna's best_trial picks among equal values in storage order; ties are common on small validation splits."""

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        finish(run_dir, [0.1, 0.6])  # every point: 0.6
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    study = tune([data_arg], eta=[1.0, 10.0], alpha=[0.5], val_fraction=0.3, output=tmp_path)
    first = min(study.trials, key=lambda t: t.number)
    best_yaml = (tmp_path / "best.yaml").read_text()
    assert yaml.safe_load(best_yaml)["objective"]["init_args"]["eta"] == first.params["eta"]
    other = 10 if first.params["eta"] == 1.0 else 1
    assert (
        f"# TIE: eta {first.params['eta']:g} alpha 0.5 (the earliest trial, chosen) and eta {other} alpha 0.5 reach "
        "the same value." in best_yaml
    )


def test_a_grid_point_another_worker_runs_fails_its_trial_and_the_study_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    # Workers sharing a study may draw the same grid point; its run directory is claimed by the first (runclaim).
    busy = {"eta10_alpha1"}

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        if run_dir.name in busy:
            raise RunInUse(f"{run_dir} is being run by another process (pid 4242 on node7): wait for it to finish")
        finish(run_dir, [0.5])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    grid = {"eta": [1.0, 10.0], "alpha": [1.0], "output": tmp_path}
    study = tune([data_arg], **grid)
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "FAIL"]
    assert (tmp_path / "best.yaml").is_file()
    busy.clear()  # the other worker is done (here: gone); a rerun retries the point
    study = tune([data_arg], **grid)
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "COMPLETE", "FAIL"]


@pytest.mark.parametrize("signum", [0, signal.SIGINT, signal.SIGTERM], ids=["keyboard-interrupt", "sigint", "sigterm"])
def test_a_signal_marks_the_trial_failed_and_a_rerun_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], data_arg: str, signum: int
) -> None:
    launched: list[str] = []

    def interrupted_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(run_dir.name)
        if not signum:  # a second Ctrl+C while the fit saves: launch_fit re-raises it once the fit has exited
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)  # tune's handler records it; launch_fit asks the fit to save, which exits:
        return 128 + signum

    monkeypatch.setattr(tune_module, "launch_fit", interrupted_fit)
    cmd = ["tune", f"--output={tmp_path}", "--eta", "1", "--alpha", "0.5", "2", "--", data_arg]
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        main(cmd)
    assert stop.value.code == 128 + (signum or signal.SIGINT) and len(launched) == 1  # no trial starts after it
    assert f"study stopped by {signal.Signals(signum or signal.SIGINT).name}" in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(run_dir.name)
        finish(run_dir, [0.5])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    launched.clear()
    main(cmd)  # the interrupted grid point runs again, then the rest
    assert sorted(launched) == ["eta1_alpha0.5", "eta1_alpha2"]


def test_a_diverged_grid_point_is_a_result_that_no_rerun_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], data_arg: str
) -> None:
    launched: list[str] = []
    messages: dict[str, str] = {}
    broken = {"eta1_alpha2"}

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(run_dir.name)
        if run_dir.name == "eta10_alpha1":
            messages[run_dir.name] = diverge(run_dir)
        elif run_dir.name == "eta10_alpha2":  # ChanceLevelGuard's own record
            messages[run_dir.name] = diverge(run_dir, "collapsed")
        elif run_dir.name in broken:  # a crash: no record, retried
            return 1
        else:
            finish(run_dir, [0.5])
            return 0
        return 1

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    grid = {"eta": [1.0, 10.0], "alpha": [1.0, 2.0], "output": tmp_path}
    study = tune([data_arg], **grid)
    assert sorted(launched) == ["eta10_alpha1", "eta10_alpha2", "eta1_alpha1", "eta1_alpha2"]
    diverged = {Path(t.user_attrs["run_dir"]).name: t.user_attrs.get("diverged") for t in study.trials}
    assert diverged == {**messages, "eta1_alpha1": None, "eta1_alpha2": None}
    best = (tmp_path / "best.yaml").read_text()
    assert f"# DIVERGED: eta 10 alpha 1: {messages['eta10_alpha1']}\n# DIVERGED: eta 10 alpha 2: " in best
    # a diverged point is finished: PARTIAL names only the point a re-run retries
    assert "# PARTIAL: not finished: eta 1 alpha 2 (FAIL); re-run the same command to retry them." in best
    assert f"coretune tune: DIVERGED: eta 10 alpha 1: {messages['eta10_alpha1']}" in capsys.readouterr().out

    launched.clear()
    broken.clear()
    study = tune([data_arg], **grid)  # only the crashed point runs again; the diverged ones are not relaunched
    assert launched == ["eta1_alpha2"]
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "COMPLETE", "FAIL", "FAIL", "FAIL"]
    rows = {Path(r["run_dir"]).name: r for r in csv.DictReader((tmp_path / "trials.csv").open()) if r["failure"]}
    assert {name: (r["state"], r["failure"]) for name, r in rows.items()} == {
        name: ("FAIL", f"diverged: {message}") for name, message in messages.items()
    }
    best = (tmp_path / "best.yaml").read_text()
    assert "# DIVERGED: eta 10 alpha 1: " in best and "# DIVERGED: eta 10 alpha 2: " in best
    assert "PARTIAL" not in best  # every other point finished
    launched.clear()
    assert len(tune([data_arg], **grid).trials) == 5 and launched == []


def test_a_study_whose_every_trial_diverged_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    launched: list[str] = []

    def diverging_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(run_dir.name)
        diverge(run_dir)
        return 1

    monkeypatch.setattr(tune_module, "launch_fit", diverging_fit)
    diverge(tmp_path / "trials" / "eta1_alpha1")  # its fit diverged before the tune process that ran it was killed
    grid = {"eta": [1.0, 10.0], "alpha": [1.0], "output": tmp_path}
    expected = (
        rf"^every trial of study 'coretune' diverged \(eta 1 alpha 1, eta 10 alpha 1; each fit's message is in the "
        rf"failure column of {tmp_path}/trials.csv\): lower the learning rate \(--model.optim.lr\) or clip the "
        r"gradients \(--trainer.gradient_clip_val 1.0\) in the fit arguments, and tune into a new --output$"
    )
    with pytest.raises(TrialFailed, match=expected):
        tune([data_arg], **grid)
    assert launched == ["eta10_alpha1"]  # a fit that recorded its divergence is not relaunched
    launched.clear()
    with pytest.raises(TrialFailed, match=expected):
        tune([data_arg], **grid)
    assert launched == []


def test_an_interrupted_tpe_trial_resumes_in_its_folder_with_its_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    launched: list[tuple[str, tuple[float, float]]] = []

    def interrupted_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append((run_dir.name, point(args)))
        os.kill(os.getpid(), signal.SIGINT)  # as in test_a_signal_marks_the_trial_failed_and_a_rerun_resumes_it
        return 128 + signal.SIGINT

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append((run_dir.name, point(args)))
        finish(run_dir, [0.5])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", interrupted_fit)
    tpe = {"output": tmp_path, "sampler": "tpe"}
    with pytest.raises(SweepInterrupted):
        tune([data_arg], n_trials=1, **tpe)
    (interrupted,) = launched
    assert interrupted[0] == "trial0000"

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    launched.clear()
    study = tune([data_arg], n_trials=1, **tpe)
    assert launched == [interrupted]  # the same folder (its last.ckpt) and point
    first, retried = study.trials
    assert (first.state.name, first.user_attrs["interrupted"]) == ("FAIL", {"signal": "SIGINT", "trial": 0})
    assert retried.state.name == "COMPLETE" and retried.user_attrs["run_dir"] == str(tmp_path / "trials/trial0000")
    assert "interrupted" not in retried.user_attrs
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert [r["failure"] for r in rows] == ["interrupted by SIGINT", ""]

    launched.clear()
    monkeypatch.setattr(tune_module, "launch_fit", lambda args, run_dir, **_: launched.append((run_dir.name, ())) or 1)
    study = tune([data_arg], n_trials=2, **tpe)  # one more trial: the interrupted one, retried once, is done
    assert launched == [("trial0002", ())] and study.trials[2].state.name == "FAIL"  # crashed: TPE moves on
    with pytest.raises(ValueError, match=r"was run with --eta/--alpha \[\[0.1, 10.0\], \[0.1, 10.0\]\] "
                       r"\(now \[\[0.1, 1.0\], \[0.1, 10.0\]\]\)"):  # fmt: skip
        tune([data_arg], n_trials=3, eta=[0.1, 1.0], **tpe)  # other ranges: TPE's trials would not compare

    # a trial Optuna's heartbeat retries (its process was killed with kill -9) is named after the original too
    import optuna

    with pytest.warns(optuna.exceptions.ExperimentalWarning):
        optuna.storages.RetryHeartbeatStaleTrialCallback()(study, study.trials[2])
    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    launched.clear()
    study = tune([data_arg], n_trials=2, **tpe)
    assert launched == [("trial0002", (study.trials[2].params["eta"], study.trials[2].params["alpha"]))]
    assert study.trials[3].state.name == "COMPLETE"

    # a second copy of trial 0 (two workers resuming at once both queued it; or Optuna's heartbeat copied it, with
    # its interruption mark): its point is finished (trial 1), so it fails as a duplicate without a fit, is not
    # counted, and the copied mark, which names trial 0, does not queue it again
    with pytest.warns(optuna.exceptions.ExperimentalWarning):
        optuna.storages.RetryHeartbeatStaleTrialCallback()(study, study.trials[0])
    launched.clear()
    study = tune([data_arg], n_trials=3, **tpe)
    copy = study.trials[4]
    assert copy.state.name == "FAIL" and copy.user_attrs["interrupted"] == {"signal": "SIGINT", "trial": 0}
    assert launched == []  # this call's one attempt was the duplicate, as a crashed trial's is
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert rows[4]["failure"] == "duplicate of trial 1, which finished trial 0's point"
    study = tune([data_arg], n_trials=3, **tpe)  # the copied mark queues nothing: the third trial is a new point
    assert [name for name, _ in launched] == ["trial0005"] and len(study.trials) == 6


def test_tpe_workers_sharing_a_study_run_distinct_start_up_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    launched: list[tuple[str, tuple[float, float]]] = []
    tpe = {"output": tmp_path, "sampler": "tpe", "n_trials": 4}

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append((run_dir.name, point(args)))
        if len(launched) == 1:  # while the first worker's first fit runs, a second worker joins the study
            tune([data_arg], **tpe)
        finish(run_dir, [0.5])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    study = tune([data_arg], **tpe)
    # the joiner ran trials 1 to 3 and stopped: the first worker's running trial makes the fourth of --n_trials 4
    assert [name for name, _ in launched] == [f"trial{n:04d}" for n in range(4)]
    points = [(t.params["eta"], t.params["alpha"]) for t in study.trials]
    assert len(set(points)) == len(points) == 4  # no two workers ran the same start-up point
    assert sorted(points) == sorted(p for _, p in launched)

    # the creator queued the start-up points, drawn from its seed: the joiner popped them (fixed parameters)
    queued = tune_module._startup_points({"eta": [0.1, 10.0], "alpha": [0.1, 10.0]}, 4, 0)
    assert [t.system_attrs.get("fixed_params") for t in study.trials[:4]] == queued

    # one worker with a given seed runs the same points every time
    def single(output: Path) -> list[tuple[float, float]]:
        return [
            (t.params["eta"], t.params["alpha"])
            for t in tune([data_arg], output=output, sampler="tpe", n_trials=3).trials
        ]

    assert single(tmp_path / "one") == single(tmp_path / "two")
    assert all(0.1 <= eta <= 10 and 0.1 <= alpha <= 10 for eta, alpha in single(tmp_path / "three"))


def test_tpe_workers_that_pass_the_n_trials_check_at_once_run_n_trials_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    """Every worker's ``tpe_left`` says yes (as two workers checking at the same moment both see one trial left): the
    trials started after ``--n_trials`` others fail as surplus without a fit, and the study holds n_trials results."""
    launched: list[str] = []
    tpe = {"output": tmp_path, "sampler": "tpe", "n_trials": 2}

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(run_dir.name)
        if len(launched) == 1:  # while the first worker's first fit runs, a second worker joins the study
            tune([data_arg], **tpe)
        finish(run_dir, [0.5])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    monkeypatch.setattr(tune_module, "tpe_left", lambda study, target: True)
    study = tune([data_arg], **tpe)
    assert launched == ["trial0000", "trial0001"]
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE", "FAIL", "FAIL"]
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert [r["failure"] for r in rows[2:]] == ["surplus: 2 trials of --n_trials 2 started before it"] * 2
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == ["trial0000", "trial0001"]


def test_refuses_fit_arguments_that_leave_the_final_epoch_unvalidated(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked on the resolved fit configuration before the first trial: no trial scores an earlier epoch."""
    launched: list[object] = []
    monkeypatch.setattr(tune_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    fit_args = [*TINY_FIT, f"--data.root={image_tree}", "--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=2"]
    with pytest.raises(
        ValueError,
        match=r"^coretune tune scores each trial by its final epoch's validation top-1, but it trains 3 epochs and "
        r"validates every 2: make --trainer.max_epochs a multiple of --trainer.check_val_every_n_epoch$",
    ):
        tune(fit_args, output=tmp_path, eta=[1.0], alpha=[1.0])
    assert launched == [] and not (tmp_path / "study.db").exists()
    # part of the validation split, or a checkpoint to resume every trial from: refused the same way
    base = [*TINY_FIT, f"--data.root={image_tree}"]
    (tmp_path / "resume.yaml").write_text(f"ckpt_path: {tmp_path / 'x.ckpt'}\n")  # in a config: not the flag
    for extra, match in [
        ("--trainer.limit_val_batches=0.5", r"^--trainer\.limit_val_batches=0\.5 would score each trial on part"),
        ("--trainer.limit_val_batches=1", r"^--trainer\.limit_val_batches=1 would score each trial on part"),
        (f"--config={tmp_path / 'resume.yaml'}", r"^the fit arguments set ckpt_path .*x\.ckpt: each trial is a new"),
    ]:
        with pytest.raises(ValueError, match=match):
            tune([*base, extra], output=tmp_path, eta=[1.0], alpha=[1.0])
    assert launched == [] and not (tmp_path / "study.db").exists()


def test_refuses_fit_arguments_fit_would_refuse(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typo in the fit arguments is found before the first trial, not by every trial failing."""
    launched: list[object] = []
    monkeypatch.setattr(tune_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    fit_args = [*TINY_FIT, f"--data.root={image_tree}", "--trainer.max_epocs=3"]
    with pytest.raises(
        ValueError,
        match=r"^coretune fit would refuse the trial arguments: unrecognized arguments: --trainer.max_epocs=3\. Fix",
    ):
        tune(fit_args, output=tmp_path, eta=[1.0], alpha=[1.0])
    assert launched == [] and not (tmp_path / "study.db").exists()


def test_refuses_a_missing_data_folder_or_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    """Paths are checked before the first trial (nothing is read): a typo does not fail every trial in turn."""
    launched: list[object] = []
    monkeypatch.setattr(tune_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=rf"^coretune fit would refuse the trial arguments: data root {missing} does"):
        tune([f"--data.root={missing}"], output=tmp_path / "out", eta=[1.0], alpha=[1.0])
    with pytest.raises(ValueError, match=rf"refuse the trial arguments: checkpoint {missing} does not exist: check"):
        tune([data_arg, f"--model.weights={missing}"], output=tmp_path / "out", eta=[1.0], alpha=[1.0])
    assert launched == [] and not (tmp_path / "out" / "study.db").exists()


@pytest.mark.parametrize(
    ("storage", "expected"),
    [
        (
            "sqlite:///{tmp}/nonexistent/dir/x.db",
            "--storage sqlite:///{tmp}/nonexistent/dir/x.db: folder {tmp}/nonexistent/dir does not exist: create it, "
            "or give a database file in an existing folder",
        ),
        (
            "study.db",
            "--storage 'study.db' is not a database URL: give one such as sqlite:///runs/tune/study.db (a file), "
            "postgresql://user:password@host:5432/database (a server) or journal:/shared/tune/study.log (a file on a "
            "shared disk)",
        ),
        (
            "foo://host/db",
            "cannot open the study storage --storage foo://host/db (Can't load plugin: sqlalchemy.dialects:foo): "
            "check the URL, that its database server runs and that its driver is installed",
        ),
    ],
)
def test_a_storage_that_cannot_be_opened_is_one_line_before_any_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str, storage: str, expected: str
) -> None:
    launched: list[object] = []
    monkeypatch.setattr(tune_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["tune", f"--output={out}", f"--storage={storage.format(tmp=tmp_path)}", "--", data_arg, *TINY_FIT])
    assert str(info.value.code) == "coretune tune: error: " + expected.format(tmp=tmp_path)
    assert launched == [] and not (tmp_path / "nonexistent").exists()


def test_a_fit_that_never_validated_fails_its_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    def unvalidated_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        finish(run_dir, [])  # results.json, but no val/top1 (e.g. max_epochs not a multiple of the val interval)
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", unvalidated_fit)
    with pytest.raises(TrialFailed, match="no trial of study 'coretune' finished"):  # failed trial, not a crash
        tune([data_arg], output=tmp_path, eta=[1.0], alpha=[1.0])


def test_tpe_sampler_stops_at_n_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str) -> None:
    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        eta = float(next(a for a in args if a.startswith("--objective.eta=")).partition("=")[2])
        finish(run_dir, [1 / (1 + abs(eta - 1))])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    study = tune([data_arg], output=tmp_path, sampler="tpe", n_trials=3)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert all(0.1 <= t.params["eta"] <= 10 and 0.1 <= t.params["alpha"] <= 10 for t in study.trials)
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == ["trial0000", "trial0001", "trial0002"]
    assert len(tune([data_arg], output=tmp_path, sampler="tpe", n_trials=4).trials) == 4  # resumed: one more


def test_repeats_average_fits_over_seeds_and_splits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str
) -> None:
    launched: list[str] = []
    broken = {"eta10_alpha1/seed4"}

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        name = f"{run_dir.parent.name}/{run_dir.name}"
        launched.append(name)
        seed = int(next(a for a in args if a.startswith("--seed=")).partition("=")[2])
        assert run_dir.name == f"seed{seed}"
        if name in broken:
            return 1
        eta = float(next(a for a in args if a.startswith("--objective.eta=")).partition("=")[2])
        # η = 10 wins on seed 3's split by luck and loses on the mean over both splits
        finish(run_dir, [{(1.0, 3): 0.5, (1.0, 4): 0.7, (10.0, 3): 0.8, (10.0, 4): 0.2}[eta, seed]])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    grid = {"eta": [1.0, 10.0], "alpha": [1.0], "seed": 3, "output": tmp_path}
    study = tune([data_arg], repeats=2, **grid)
    assert sorted(launched) == ["eta10_alpha1/seed3", "eta10_alpha1/seed4", "eta1_alpha1/seed3", "eta1_alpha1/seed4"]
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "FAIL"]

    launched.clear()
    broken.clear()
    study = tune([data_arg], repeats=2, **grid)  # resume: only the failed fit of the failed point runs
    assert launched == ["eta10_alpha1/seed4"]
    values = {t.params["eta"]: t.value for t in study.trials if t.state.name == "COMPLETE"}
    assert values == pytest.approx({1.0: 0.6, 10.0: 0.5})
    best = (tmp_path / "best.yaml").read_text()
    assert yaml.safe_load(best)["objective"]["init_args"]["eta"] == 1.0
    assert "val/top1 = 0.6000 on a 0.2 validation split of the training set, mean of 2 seeds and splits" in best
    rows = {r["run_dir"]: r for r in csv.DictReader((tmp_path / "trials.csv").open()) if r["state"] == "COMPLETE"}
    assert rows[str(tmp_path / "trials" / "eta10_alpha1")]["final_val_top1_per_seed"] == "0.8000 0.2000"

    launched.clear()
    cli = ["tune", f"--output={tmp_path}", "--eta", "1", "10", "--alpha", "1", "--seed", "3"]
    main([*cli, "--repeats", "2", "--", data_arg])  # the CLI passes --repeats: nothing left to run
    assert launched == []
    with pytest.raises(SystemExit, match=r"scores trials over 2 fit\(s\) \(--repeats\), not 1"):
        main([*cli, "--", data_arg])
    with pytest.raises(ValueError, match=r"scores trials over 2 fit\(s\) \(--repeats\), not 1: pass the same"):
        tune([data_arg], **grid)
    with pytest.raises(ValueError, match=r"^--repeats must be >= 1 \(got 0\)"):
        tune([data_arg], repeats=0, **grid)


def test_segmentation_is_tuned_by_validation_miou_on_training_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: tune follows the task. Each trial holds out part of train.txt (--data.val_fraction) and is scored by
    its final val/miou; val.txt is the test split, which selection never reads."""
    from segmentation_sets import make_voc_set

    fits_in_process(monkeypatch)  # the trials' task and scores, not their processes (grid trials: real ones)

    root = make_voc_set(tmp_path / "voc", {"train": 10, "val": 2}, size=(32, 40))
    out = tmp_path / "tune"
    seg = ["--task", "segmentation", "--model.backbone=resnet18", "--model.weights=null", f"--data.root={root}"]
    main(["tune", f"--output={out}", "--eta", "0.1", "1", "--alpha", "1", "--val_fraction=0.3", "--", *seg,
          "--data.image_size=32", "--data.batch_size=4", *TINY_FIT[3:]])  # fmt: skip
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE"] and "final_val_top1" not in rows[0]
    for row in rows:
        run = Path(row["run_dir"])
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["model"]["task"] == "segmentation" and config["data"]["val_fraction"] == 0.3
        assert float(row["final_val_miou"]) == pytest.approx(float(read_metrics(run / "metrics.csv")[-1]["val/miou"]))
        assert "miou" in json.loads((run / "results.json").read_text())["test"]  # tested on val.txt
    best = (out / "best.yaml").read_text()
    assert "# selected by the final-epoch val/miou = " in best and "val_fraction 0)." in best
    assert "(final val MIoU " in capsys.readouterr().out.replace("\n", " ")


def test_domain_generalization_trials_validate_on_the_training_domains_held_out_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DomainGeneralizationData has no val_fraction: its validation split is each training domain's held-out part
    (--data.holdout_fraction), which tune sets; a study stays with the task it started with."""
    from domain_trees import make_domain_tree

    launched: list[list[str]] = []

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(args)
        finish(run_dir, [0.5])
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    tree = make_domain_tree(tmp_path / "tree", size=16)
    dg = ["--task", "domain_generalization", f"--data.root={tree}", "--data.test_domains=photo", *TINY_FIT]
    tune(dg, output=tmp_path / "out", eta=[1.0], alpha=[1.0], val_fraction=0.3)
    (args,) = launched
    assert "--data.holdout_fraction=0.3" in args and not any(a.startswith("--data.val_fraction") for a in args)
    assert "holding out holdout_fraction for validation" in (tmp_path / "out" / "best.yaml").read_text()
    with pytest.raises(ValueError, match=r"^remove --data.holdout_fraction from the fit arguments: the validation"):
        tune([*dg, "--data.holdout_fraction=0.1"], output=tmp_path / "out", eta=[1.0], alpha=[1.0])
    with pytest.raises(
        ValueError,
        match=r"^study 'coretune' scores fits of --task domain_generalization, not classification: pass a new",
    ):
        tune([f"--data.train_dir={tree / 'photo'}", *TINY_FIT], output=tmp_path / "out", eta=[1.0], alpha=[1.0])


def test_an_objective_the_task_refuses_is_one_line_before_any_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from segmentation_sets import make_voc_set

    launched: list[object] = []
    monkeypatch.setattr(tune_module, "launch_fit", lambda *a, **k: launched.append(a) or 0)
    root = make_voc_set(tmp_path / "voc")
    with pytest.raises(SystemExit) as info:
        main(["tune", f"--output={tmp_path / 'out'}", "--objective=ce_mix", "--", "--task=segmentation",
              f"--data.root={root}"])  # fmt: skip
    # ce_mix (which segmentation also refuses) is refused by tune itself now: its η = 0 defines it
    assert str(info.value.code) == (
        "coretune tune: error: --objective 'ce_mix' fixes eta at 0.0 (it defines the method); choose one of "
        "bi_tuning, bss, ce_con_mixh, core, delta, l2sp, logit_adjusted, manifold_mixup, mm, scl"
    )
    assert launched == [] and not (tmp_path / "out").exists()


def test_adversarial_trials_say_that_they_are_chosen_by_clean_accuracy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_arg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tune_module, "launch_fit", lambda args, run_dir, **_: finish(run_dir, [0.5]) or 0)
    tune([data_arg, "--adversarial.enable=true"], output=tmp_path, eta=[1.0], alpha=[1.0])
    note = "the trials train adversarially (--adversarial.enable true) but are scored by their clean validation score"
    assert note in capsys.readouterr().out and note in (tmp_path / "best.yaml").read_text()
    tune([data_arg], output=tmp_path / "clean", eta=[1.0], alpha=[1.0])
    assert "adversarially" not in (tmp_path / "clean" / "best.yaml").read_text()
