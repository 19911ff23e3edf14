"""``coretune compare`` end to end on a tiny tree: 2 methods × 2 seeds on a validation split, resumed, ``--status``,
``--test`` once at the end; and what it refuses before any run (a split too small, options it sets itself, a
budget too small)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coretune.cli import main
from coretune.sweeps import final_val_top1
from coretune.sweeps.comparison import CompareSettings, comparison_spec, split_args
from fit_flags import TINY_FIT, error

#: A comparison of 2 methods × 2 seeds, 1 epoch each, on half of a 3 × 12-image training set (18 validation
#: images: telling methods 40 points apart needs 13).
COMPARE = ["compare", "--methods", "ce,ce_mix", "--seeds=2", "--val_fraction=0.5", "--min_difference=40"]


def test_compare_runs_each_method_and_seed_on_a_validation_split_then_recommends(
    image_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = [*COMPARE, "--workers=2", f"--output={out}", *TINY_FIT, f"--data.root={image_tree}"]
    main(args)
    printed = capsys.readouterr().out
    assert printed.count("✓ data/") == 4 and "final-epoch validation top-1" in printed
    record = json.loads((out / "compare.json").read_text())
    assert record["reference"] == "ce" and record["test"] is None  # the test split not looked at
    rows = {row["method"]: row for row in record["rows"]}
    for method in ("ce", "ce_mix"):
        for seed in (0, 1):
            run = out / "data" / method / "frac1" / f"seed{seed}"
            fit_args = json.loads((run / "fit_args.json").read_text())
            assert "--data.val_fraction=0.5" in fit_args and f"--seed={seed}" in fit_args
            val = 100 * final_val_top1(run / "metrics.csv")
            assert rows[method]["val_top1_pct"][seed] == pytest.approx(val, abs=1e-4)
    assert rows["ce_mix"]["hyperparameters"] == ["alpha"] and rows["ce"]["diff_to_reference_pp"] is None
    choice = record["recommendation"]
    assert choice["method"] in ("ce", "ce_mix") and choice["text"].startswith(f"use {choice['method']}")
    markdown = (out / "compare.md").read_text()
    assert f"**Recommendation**: {choice['text']}" in markdown and "The test split was not looked at" in markdown
    assert "Test top-1 of" not in printed  # no test score shown: the runs' lines are validation scores
    assert (out / ".coretune-compare").is_file() and not (out / ".coretune-bench").exists()
    finished = {run: (run / "results.json").stat().st_mtime_ns for run in out.glob("data/*/frac1/seed*")}

    main([*args, "--test"])  # resumed: every run is finished; the chosen method's test score, once, at the end
    printed = capsys.readouterr().out
    assert "4 runs, 4 finished (skipped), 0 to run" in printed
    assert {run: (run / "results.json").stat().st_mtime_ns for run in finished} == finished
    test = json.loads((out / "compare.json").read_text())["test"]
    chosen = choice["method"]
    assert test["method"] == chosen
    for seed in (0, 1):
        results = json.loads((out / "data" / chosen / "frac1" / f"seed{seed}" / "results.json").read_text())
        assert test["test_top1_pct"][seed] == pytest.approx(100 * results["test"]["top1"], abs=1e-4)
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
