"""``coretune compare`` end to end on a tiny tree: 2 methods × 2 seeds on a validation split under a wall-clock
budget (its timing fits stood in for), resumed, ``--status``, no run testing and ``--test`` scoring the chosen
method's runs once at the end; the budget's forms and arithmetic; and what it refuses before any run (a split too
small, options it sets itself, a budget too small)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coretune.cli import main
from coretune.runs.layout import RunDir
from coretune.sweeps import comparison, final_val_top1
from coretune.sweeps.budget import (
    Budget,
    epochs_for_time,
    epochs_for_total,
    format_time,
    measured_epoch_seconds,
    parse_budget,
)
from coretune.sweeps.comparison import CompareSettings, comparison_spec, split_args
from fit_flags import TINY_FIT, error

#: A comparison of 2 methods × 2 seeds, 1 epoch each, on half of a 3 × 12-image training set (18 validation
#: images: telling methods 40 points apart needs 13).
COMPARE = ["compare", "--methods", "ce,ce_mix", "--seeds=2", "--val_fraction=0.5", "--min_difference=40"]

#: The seconds per epoch and wall time the stand-in timing fits record (:func:`timed`).
TIMED = {"ce": (1000.0, 60.0), "ce_mix": (700.0, 40.0)}


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The timing fits of a wall-clock ``--budget`` stood in for: each writes the files a finished ``coretune fit
    --test false`` of one epoch leaves (``metrics.csv``'s ``epoch_time_s``, ``results.json``), at :data:`TIMED`'s
    pace; the labels of the runs each call timed."""
    calls: list[list[str]] = []

    def run_timing_fits(spec: comparison.BenchSpec, console: object) -> None:
        calls.append([run.label for run in spec.runs()])
        for run in spec.runs():
            per_epoch, wall = TIMED[run.objective]
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "metrics.csv").write_text(f"epoch,step,epoch_time_s\n0,3,{per_epoch}\n")
            results = {"test": None, "test_skipped": "--test false", "wall_time_s": wall, "epochs": 1}
            (run.run_dir / "results.json").write_text(json.dumps(results))

    monkeypatch.setattr(comparison, "_run_timing_fits", run_timing_fits)
    return calls


def test_compare_runs_each_method_and_seed_on_a_validation_split_then_recommends(
    image_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], timed: list[list[str]]
) -> None:
    out = tmp_path / "out"
    fit = [arg for arg in TINY_FIT if not arg.startswith("--trainer.max_epochs")]
    args = [*COMPARE, "--workers=2", "--budget=1h", f"--output={out}", *fit, f"--data.root={image_tree}"]
    main(args)
    printed = capsys.readouterr().out
    assert timed == [["timing/ce/frac1/seed0", "timing/ce_mix/frac1/seed0"]]
    # (3600 s − 100 s of timing) // (2 seeds × 1700 s per epoch of both methods) = 1 epoch per run
    assert "--budget 1h: measured ce 1000.0 s/epoch, ce_mix 700.0 s/epoch (timing fits: 100 s) → 1 epoch(s) per " in (
        " ".join(printed.split())
    )
    assert printed.count("✓ data/") == 4 and "final-epoch validation top-1" in printed
    record = json.loads((out / "compare.json").read_text())
    assert record["reference"] == "ce" and record["test"] is None  # the test split not looked at
    settings = record["settings"]
    assert settings["budget"] == "1h" and settings["budget_seconds"] == 3600 and settings["epochs_per_run"] == 1
    assert settings["timing"]["seconds_per_epoch"] == {"ce": 1000.0, "ce_mix": 700.0}
    rows = {row["method"]: row for row in record["rows"]}
    for method in ("ce", "ce_mix"):
        for seed in (0, 1):
            run = out / "data" / method / "frac1" / f"seed{seed}"
            fit_args = json.loads((run / "fit_args.json").read_text())
            assert "--data.val_fraction=0.5" in fit_args and f"--seed={seed}" in fit_args
            assert "--trainer.max_epochs=1" in fit_args and "--test=false" in fit_args
            val = 100 * final_val_top1(run / "metrics.csv")
            assert rows[method]["val_top1_pct"][seed] == pytest.approx(val, abs=1e-4)
            # no run scored the test split: no test metric anywhere in its folder
            results = json.loads((run / "results.json").read_text())
            assert results["test"] is None and results["test_skipped"] and RunDir(run).is_finished()
            assert not (run / "test_results.json").exists() and "test/" not in (run / "metrics.csv").read_text()
    assert rows["ce_mix"]["hyperparameters"] == ["alpha"] and rows["ce"]["diff_to_reference_pp"] is None
    choice = record["recommendation"]
    assert choice["method"] in ("ce", "ce_mix") and choice["text"].startswith(f"use {choice['method']}")
    markdown = (out / "compare.md").read_text()
    assert f"**Recommendation**: {choice['text']}" in markdown and "The test split was not looked at" in markdown
    assert "Test top-1 of" not in printed  # no test score shown: the runs' lines are validation scores
    assert (out / ".coretune-compare").is_file() and not (out / ".coretune-bench").exists()
    finished = {run: (run / "results.json").stat().st_mtime_ns for run in out.glob("data/*/frac1/seed*")}

    main([*args, "--test"])  # resumed: every run is finished; the chosen method's runs tested, once, at the end
    printed = capsys.readouterr().out
    assert "4 runs, 4 finished (skipped), 0 to run" in printed and len(timed) == 2  # the timing read, not re-run
    assert {run: (run / "results.json").stat().st_mtime_ns for run in finished} == finished
    test = json.loads((out / "compare.json").read_text())["test"]
    chosen = choice["method"]
    assert test["method"] == chosen
    for method in ("ce", "ce_mix"):
        for seed in (0, 1):
            run = out / "data" / method / "frac1" / f"seed{seed}"
            assert (run / "test_results.json").is_file() == (method == chosen)  # only the chosen method's runs
            if method == chosen:
                scored = json.loads((run / "test_results.json").read_text())
                assert scored["checkpoint"] == str(run / "checkpoints" / "last.ckpt")
                assert test["test_top1_pct"][seed] == pytest.approx(100 * scored["test"]["top1"], abs=1e-4)
    assert f"Test top-1 of {chosen} (the chosen method" in printed

    main([*args, "--status"])
    status = " ".join(capsys.readouterr().out.split())
    assert "compare: 4 of 4 runs finished" in status
    assert f"ce_mix │ 100% │ 1 │ {rows['ce_mix']['val_top1_pct'][1]:.2f}" in status  # seed 1's validation score


def test_a_validation_split_too_small_is_refused_before_any_run(image_tree: Path, tmp_path: Path) -> None:
    args = ["compare", f"--output={tmp_path / 'out'}", *TINY_FIT, f"--data.root={image_tree}"]
    message = error(args)
    assert message.startswith("the validation split holds 6 images (2 per class, --val_fraction 0.2 of 36 training")
    assert "which needs 800 images, 267 per class of 3" in message and "--min_difference 57.8" in message
    assert not (tmp_path / "out" / "data").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--objective.eta=1"], "remove --objective.eta from the fit arguments: the methods are --methods"),
        (["--data.val_fraction=0.3"], "remove --data.val_fraction from the fit arguments: the validation split is"),
        (["--seed=3"], "remove --seed from the fit arguments: the seeds are 0 … --seeds − 1"),
        (["--methods=ce,nope"], "--methods: unknown method 'nope'; the methods are bi_tuning, bss, ce"),
        (["--methods=ce"], "--methods ce: give two or more different methods"),
        (["--seeds=1"], "--seeds must be >= 2 (got 1): the methods are compared seed by seed"),
        (["--val_fraction=0"], "--val_fraction must lie in (0, 1) (got 0.0)"),
        (["--budget=3", "--seeds=2"], "--budget 3 gives each of the 6 runs (3 methods × 2 seeds) less than 1 epoch"),
        (["--budget=2x"], "--budget 2x: give total epochs (an integer, e.g. 60) or wall-clock time (e.g. 2h, 90m"),
        (["--budget=0"], "--budget must be >= 1 epoch (got 0)"),
        (["--budget=12", "--trainer.max_epochs=2"], "remove --trainer.max_epochs from the fit arguments, or drop"),
        (["--task=segmentation"], "coretune compare compares classification fits"),
    ],
)
def test_compare_refuses_settings_it_cannot_compare_with(
    image_tree: Path, tmp_path: Path, extra: list[str], message: str
) -> None:
    args = ["compare", f"--output={tmp_path / 'out'}", f"--data.root={image_tree}", "--model.backbone=small_cnn"]
    assert error([*args, *extra]).startswith(message)
    assert not (tmp_path / "out").exists()


def test_the_budget_shares_its_epochs_among_the_runs(image_tree: Path, tmp_path: Path) -> None:
    from coretune.sweeps.comparison import _epochs

    settings = CompareSettings(methods=("ce", "core"), seeds=3, budget=40, output=tmp_path)
    assert _epochs(settings, {"trainer": {"check_val_every_n_epoch": 1}}) == 6  # 40 // 6 runs
    assert _epochs(settings, {"trainer": {"check_val_every_n_epoch": 4}}) == 4  # the final epoch validated
    assert _epochs(CompareSettings(methods=("ce", "core")), {}) is None  # the fit arguments' epochs
    spec = comparison_spec(settings, 0.1, epochs=6)
    run = spec.runs()[0]
    argv = run.job.argv()
    assert argv[-4:] == ["--objective", "ce", "--data.label_fraction=0.1", "--seed=0"]
    assert argv.index("--data.val_fraction=0.2") < argv.index("--objective")  # after the user's --config files
    assert "--trainer.max_epochs=6" in argv and spec.metric == "val" and spec.baseline == "ce"
    assert [r.label for r in spec.runs()][:2] == ["data/ce/frac0.1/seed0", "data/core/frac0.1/seed0"]


def test_compare_options_are_told_from_fit_arguments() -> None:
    own, fit = split_args(["--methods", "ce,core", "--data.root", "D", "--test", "--seeds=2", "--config", "c.yaml"])
    assert own == ["--methods", "ce,core", "--test", "--seeds=2"] and fit == ["--data.root", "D", "--config", "c.yaml"]


@pytest.mark.parametrize(
    ("text", "budget"),
    [
        ("60", Budget("60", epochs=60)),
        ("2h", Budget("2h", seconds=7200)),
        ("90m", Budget("90m", seconds=5400)),
        ("1h30m", Budget("1h30m", seconds=5400)),
        ("45min", Budget("45min", seconds=2700)),
        ("5400s", Budget("5400s", seconds=5400)),
        ("1.5h", Budget("1.5h", seconds=5400)),
        (None, None),
    ],
)
def test_the_budget_is_epochs_or_wall_clock_time(text: str | None, budget: Budget | None) -> None:
    assert parse_budget(text) == budget


@pytest.mark.parametrize("text", ["h", "2x", "0m", "-3", "2h3", "m30", ""])
def test_a_budget_of_another_form_or_of_nothing_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--budget .*(give total epochs|>= 1 epoch)") as info:
        parse_budget(text)
    assert "\n" not in str(info.value)


def test_a_wall_clock_budget_gives_each_run_the_epochs_that_fit_its_time() -> None:
    """``⌊(T − s) / (seeds · Σ_m t_m) / v⌋ · v``, checked against the loop that adds epochs while they fit."""
    per_epoch = {"ce": 30.0, "ce_mix": 35.0, "core": 55.0}  # 120 s for one epoch of each method

    def slow(seconds: float, seeds: int, every: int, spent: float) -> int:
        epochs, used = 0, spent
        while used + every * seeds * sum(per_epoch.values()) <= seconds:
            epochs, used = epochs + every, used + every * seeds * sum(per_epoch.values())
        return epochs

    for seconds, seeds, every, spent in [(7200, 3, 1, 0), (7200, 3, 1, 130), (7200, 2, 4, 130), (3600, 5, 2, 0)]:
        got = epochs_for_time(Budget("t", seconds=seconds), per_epoch, seeds, every, spent)
        assert got == slow(seconds, seeds, every, spent) > 0
    assert epochs_for_time(Budget("2h", seconds=7200), per_epoch, 3, 1, 130) == 19  # 7070 // 360
    with pytest.raises(ValueError) as info:
        epochs_for_time(Budget("7m", seconds=420), per_epoch, 3, 1, 130)  # 130 s spent, 290 left: no 360 s epoch
    assert (
        str(info.value)
        == (
            "--budget 7m gives each of the 9 runs (3 methods × 3 seeds) less than 1 epoch(s) (measured per epoch: ce "
            "30.0 s, ce_mix 35.0 s, core 55.0 s; the timing took 130 s): give --budget 9m or more, or fewer --methods "
            "or --seeds"
        )
        and epochs_for_time(Budget("9m", seconds=540), per_epoch, 3, 1, 130) == 1
    )
    assert [format_time(s) for s in (1, 60, 61, 3600, 3660, 5400)] == ["1m", "1m", "2m", "1h", "1h01m", "1h30m"]
    assert epochs_for_total(40, 2, 3) == 6 and epochs_for_total(40, 2, 3, every=4) == 4


def test_the_seconds_per_epoch_are_read_from_a_finished_timing_fit(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("epoch,step,epoch_time_s\n0,3,12.5\n1,6,11.5\n")
    (tmp_path / "results.json").write_text(json.dumps({"wall_time_s": 30.25, "test": None}))
    assert measured_epoch_seconds(tmp_path) == (12.0, 30.25)
    (tmp_path / "metrics.csv").unlink()
    with pytest.raises(ValueError, match="recorded no epoch time: delete that folder"):
        measured_epoch_seconds(tmp_path)


def test_a_wall_clock_budget_too_small_is_refused_after_timing_before_any_run(
    image_tree: Path, tmp_path: Path, timed: list[list[str]]
) -> None:
    out = tmp_path / "out"
    message = error(
        [*COMPARE, "--budget=30m", f"--output={out}", f"--data.root={image_tree}", "--model.backbone=small_cnn"]
    )
    assert message.startswith("--budget 30m gives each of the 4 runs (2 methods × 2 seeds) less than 1 epoch(s)")
    assert "(measured per epoch: ce 1000.0 s, ce_mix 700.0 s; the timing took 100 s): give --budget 59m" in message
    assert timed and not (out / "data").exists()


def test_a_dry_run_under_a_wall_clock_budget_lists_the_timing_fits_first(
    image_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    main(
        [
            *COMPARE,
            "--budget=2h",
            "--dry_run",
            f"--output={out}",
            f"--data.root={image_tree}",
            "--model.backbone=small_cnn",
        ]
    )
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.count(" fit ") == 2 and "--trainer.max_epochs=1 --test=false --objective ce " in printed
    assert "--budget 2h sets each run's epochs once these timing fits (1 epoch(s) of each method) have run" in printed
    assert not out.exists()
