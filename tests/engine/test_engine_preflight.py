"""What a run checks before its first optimiser step (docs/reliability.md, principles 3 and 8): a training length of
nothing or of no end, and training images without signal, are refused with one line before any training; a fit that
stopped before its first step reports no result; the chance guard names the data when the loss never moved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from coretune.cli import main
from coretune.engine import read_metrics
from fit_flags import QUIET, error, pretrain_args
from image_trees import make_image_folder, make_image_tree

SMALL = ["--model.backbone=small_cnn", "--data.image_size=16", "--data.batch_size=8", *QUIET]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_tree(tmp_path_factory.mktemp("preflight") / "data", size=24)


def fit_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["fit", f"--data.root={root}", *SMALL, f"--run_dir={run_dir}", *extra]


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


UNTRAINED = "runs no optimiser step, so the run would record its untrained model as a result"


@pytest.mark.parametrize(
    ("option", "fix"),
    [
        ("--trainer.max_epochs=0", "pass --trainer.max_epochs 1 or more"),
        ("--trainer.max_steps=0", "pass --trainer.max_steps 1 or more (-1: no step limit)"),
        ("--trainer.limit_train_batches=0", "pass a number of batches >= 1 or a fraction in (0, 1] (1.0: every batch)"),
    ],
)
def test_a_fit_that_would_train_nothing_is_refused_before_training(
    option: str, fix: str, tree: Path, tmp_path: Path
) -> None:
    # --trainer.max_epochs 0 exited 0 with "top-1 22.22% … (None train images/s)": a results.json of the untrained
    # model, pointing at a metrics.csv and learning_curve.png that did not exist
    name, _, value = option.removeprefix("--").partition("=")
    assert error(fit_args(tree, tmp_path / "run", option)) == f"--{name} {value} {UNTRAINED}: {fix}"
    assert not (tmp_path / "run").exists()
    mine = tmp_path / "mine"  # a folder of the user's: untouched
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    before = snapshot(mine)
    error(fit_args(tree, mine, option))
    assert snapshot(mine) == before


def test_a_pretraining_that_would_train_nothing_is_refused_before_training(tmp_path: Path) -> None:
    images = make_image_folder(tmp_path / "images")
    message = error(pretrain_args(images, tmp_path / "run", "--trainer.max_epochs=0"))
    assert message == f"--trainer.max_epochs 0 {UNTRAINED}: pass --trainer.max_epochs 1 or more"
    assert not (tmp_path / "run").exists()


UNBOUNDED = (
    "and no --trainer.max_steps give the cosine learning-rate schedule no length to decay over: pass "
    "--trainer.max_steps N (the run and its schedule end after N optimiser steps), a number of epochs "
    "(--trainer.max_epochs N), or --model.optim.schedule constant"
)


@pytest.mark.parametrize(
    ("options", "what"),
    [
        (["--trainer.max_epochs=-1"], "--trainer.max_epochs -1 (no epoch limit)"),
        (["--trainer.max_time=00:00:01:00"], "--trainer.max_time without --trainer.max_epochs (no epoch limit)"),
    ],
)
def test_a_run_without_end_under_a_decaying_schedule_is_refused_naming_max_steps(
    options: list[str], what: str, tree: Path, tmp_path: Path
) -> None:
    # fit --trainer.max_epochs -1: "OverflowError: cannot convert float infinity to integer" from the schedule's
    # length (and its warm-up's); pre-training computed them alike
    assert error(fit_args(tree, tmp_path / "run", *options)) == f"{what} {UNBOUNDED}"
    assert not (tmp_path / "run").exists()
    if "max_epochs" in options[0]:  # pre-training's default is a number of epochs
        images = make_image_folder(tmp_path / "images")
        pretraining = UNBOUNDED.replace("--model.optim.schedule", "--model.schedule")  # its own option
        assert error(pretrain_args(images, tmp_path / "pre", *options)) == f"{what} {pretraining}"
        assert not (tmp_path / "pre").exists()


def test_an_unbounded_run_with_max_steps_trains_with_warm_up_of_its_epochs(tree: Path, tmp_path: Path) -> None:
    """max_epochs -1 with max_steps: the schedule is max_steps long, and --model.optim.warmup_epochs counts the loader's
    steps per epoch (36 images, batches of 8: 4), not max_steps (which made a 1-epoch warm-up the whole run)."""
    run = tmp_path / "run"
    main(fit_args(tree, run, "--trainer.max_epochs=-1", "--trainer.max_steps=6", "--model.optim.warmup_epochs=1"))
    rows = read_metrics(run / "metrics.csv")
    assert [(r["epoch"], r["step"]) for r in rows] == [("0", "4"), ("1", "6")]
    assert float(rows[0]["lr"]) == pytest.approx(0.01 / 4)  # warm-up step 1 of 4
    assert float(rows[1]["lr"]) == pytest.approx(0.01)  # the decay's start: step 4 of 6
    assert "test" in json.loads((run / "results.json").read_text())


def test_a_fit_stopped_before_its_first_step_reports_no_result(tree: Path, tmp_path: Path) -> None:
    """The last line of defence: a fit that ran no optimiser step (here a callback stops it at its start) is not
    tested, and its new run directory is removed."""
    run = tmp_path / "run"
    message = error(fit_args(tree, run, "--trainer.max_epochs=1", "--trainer.callbacks+=fit_flags.StopBeforeTraining"))
    assert message == (
        "this fit ran no optimiser step, so there is no trained model to test (the untrained one would be recorded "
        "as its result): let it train, e.g. --trainer.max_epochs 1 or more"
    )
    assert not run.exists()


def one_colour_tree(root: Path, colour: tuple[int, int, int] = (128, 128, 128)) -> Path:
    """2 classes of 12 training and 4 validation images, every one of them ``colour`` alone."""
    return make_image_tree(root, classes=("a", "b"), palette=np.array([colour, colour]), noise=0, size=24)


@pytest.mark.parametrize("cache", ["false", "true"])
def test_training_images_of_one_colour_are_refused_before_training(cache: str, tmp_path: Path) -> None:
    # 2 epochs exited 0 with top-1 50% and no warning; 30 epochs: the chance guard blamed the learning rate
    root = one_colour_tree(tmp_path / "data")
    before = snapshot(root)
    run = tmp_path / "run"
    where = f" under {root / 'train'}" if cache == "false" else ""  # decoded into memory: no file names
    assert error(fit_args(root, run, "--trainer.max_epochs=2", f"--data.cache_images={cache}")) == (
        f"the 24 images of the training split{where} are all one colour, RGB (128, 128, 128): their pixel standard "
        "deviation is 0, so they hold no signal to learn from: check that the files were written right (not blank), "
        "or point --data.root at the real images"
    )
    assert not run.exists() and snapshot(root) == before


def test_pretraining_images_of_one_colour_are_refused_before_training(tmp_path: Path) -> None:
    root = one_colour_tree(tmp_path / "data", (0, 0, 0)) / "train"
    assert error(pretrain_args(root, tmp_path / "run")) == (
        f"the 24 images of the training split under {root} are all one colour, RGB (0, 0, 0): their pixel standard "
        "deviation is 0, so they hold no signal to learn from: check that the files were written right (not blank), "
        "or point --data.root at the real images"
    )
    assert not (tmp_path / "run").exists()


def test_images_of_one_colour_each_are_not_refused(tmp_path: Path) -> None:
    """One colour per class is signal (the colour tells the class): only a split all of one colour is refused."""
    root = make_image_tree(tmp_path / "data", classes=("a", "b"), palette=np.array([[20, 20, 20], [230, 230, 230]]),
                           noise=0, size=24)  # fmt: skip
    main(fit_args(root, tmp_path / "run", "--trainer.max_epochs=1"))
    assert "test" in json.loads((tmp_path / "run" / "results.json").read_text())


@pytest.mark.filterwarnings("ignore:`ModelCheckpoint\\(monitor='val/top1'\\)` could not find")  # nothing validates
def test_the_chance_guard_names_the_data_when_the_training_loss_never_fell(tmp_path: Path) -> None:
    """The same images in both class folders: labels that do not depend on the images, nothing to learn. The guard
    stops the run and names the data (and the weights) before the learning rate, which was all it named."""
    root = make_image_tree(tmp_path / "data", classes=("a", "b"), per_class=8, val_per_class=2, size=16)
    for split in ("train", "val"):
        shutil.rmtree(root / split / "b")
        shutil.copytree(root / split / "a", root / split / "b")
    guard = ["--trainer.callbacks+=coretune.engine.ChanceLevelGuard", "--trainer.callbacks.min_steps=0",
             "--trainer.callbacks.min_fraction=0", "--trainer.callbacks.patience=2"]  # fmt: skip
    args = fit_args(root, tmp_path / "run", "--data.batch_size=4", "--trainer.max_epochs=6",
                    "--trainer.limit_val_batches=0", *guard)  # fmt: skip
    with pytest.warns(UserWarning, match="chance level"):
        message = error(args)
    assert message.startswith("the training top-1 is "), message
    assert (
        ": the run collapsed or is not learning, and its training loss never fell below that of guessing the class "
        "frequencies (cross-entropy 0.693): check that the training images hold signal (not blank or all alike) and "
        "that their labels match them, and the pre-trained weights; if they do, clip the gradients "
        "(--trainer.gradient_clip_val 1.0) or lower the learning rate (--model.optim.lr); docs/results.md, section 7. "
        "If"
    ) in message, message
    assert "collapsed" in json.loads((tmp_path / "run" / "results.json").read_text())
