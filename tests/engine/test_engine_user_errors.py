"""Every error a user can cause, through the `coretune` entry point: one line naming the problem and the fix.

``main`` turns a user error into ``SystemExit("coretune <cmd>: error: <message>")`` (exit status 1, the message
alone on stderr, no traceback); these tests assert the exact message of each case in docs/reliability.md.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from coretune import objectives
from coretune.cli import main
from coretune.data import SkippedImagesWarning, list_image_files
from coretune.engine import FineTuner, NonFiniteLossError, read_metrics, setting_changes
from coretune.models import create_backbone
from coretune.runs.claim import CLAIM_FILE, claim_run, point_claim
from fit_flags import QUIET, error, pretrain_args

SHORT = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cat``/``dog``/``eel``: 12 training and 4 validation images each (36 training images: 4 batches of 8)."""
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("user_errors") / "data")


def copy_tree(tree: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tree, tmp_path / "data"))


def fit_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "fit",
        f"--data.root={root}",
        "--data.image_size=32",
        "--data.batch_size=8",
        "--model.backbone=small_cnn",
        f"--run_dir={run_dir}",
        *QUIET,
        *SHORT,
        *extra,
    ]


def recorded_divergence(run_dir: Path) -> str:
    """What a failed fit's ``results.json`` records as ``diverged`` (the run has no test results)."""
    results = json.loads((run_dir / "results.json").read_text())
    assert "test" not in results, results
    return results["diverged"]


# -- data -----------------------------------------------------------------------------------------------------
def test_a_fit_with_nothing_to_test_on_is_refused_before_training(tmp_path: Path) -> None:
    # one folder of class folders and --data.val_fraction: the fit trained every epoch, then failed in its test
    # ("no test split"), leaving results.json without a test score
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data", per_class=6, val_per_class=0)
    shutil.rmtree(root / "val", ignore_errors=True)
    run = tmp_path / "run"
    assert error(fit_args(root, run, "--data.val_fraction=0.25")) == (
        "no images to test on: --data.val_fraction holds out part of train/ for validation, and coretune fit ends "
        "by scoring a test split (unless --test false), a val/ or test/ folder beside train/ (same class folders); "
        "add one, or pass --data.test_dir"
    )
    assert not run.exists()  # refused before the run directory was kept
    main(fit_args(root, run, "--data.val_fraction=0.25", "--test=false"))  # a fit that ends without a test needs none
    assert json.loads((run / "results.json").read_text())["test"] is None


def test_missing_root(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "nowhere"
    assert error(fit_args(root, tmp_path / "run")) == f"data root {root} does not exist: pass an existing folder"
    assert not (tmp_path / "run").exists()  # the run directory it created is gone: nothing was trained
    assert "GPU available" not in "".join(capfd.readouterr())  # the error comes before Lightning's hardware report


def test_a_run_that_fails_before_training_leaves_no_run_behind_but_keeps_a_folder_it_did_not_make(
    tree: Path, tmp_path: Path
) -> None:
    root = copy_tree(tree, tmp_path)
    for image in (root / "train" / "eel").iterdir():
        image.unlink()
    error(fit_args(root, tmp_path / "run", "--trainer.logger=csv"))  # the logger's folder is made, then setup fails
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    error(fit_args(root, tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_empty_class_folder(tree: Path, tmp_path: Path) -> None:
    root = copy_tree(tree, tmp_path)
    for image in (root / "train" / "eel").iterdir():
        image.unlink()
    message = error(fit_args(root, tmp_path / "run"))
    assert message.startswith(f"class folder(s) ['eel'] in {root / 'train'} contain no image files (.jpg, ")
    assert message.endswith("add images or remove the folder(s)")


def test_no_images(tree: Path, tmp_path: Path) -> None:
    root = copy_tree(tree, tmp_path)
    for image in (root / "val").glob("*/*.png"):
        image.unlink()
    assert re.search(r"val contains no image files .* in its class folders \['cat', 'dog', 'eel'\]", error(
        fit_args(root, tmp_path / "run")
    ))  # fmt: skip


@pytest.mark.parametrize("num_workers", [0, 1])
def test_corrupt_image_names_the_file(tree: Path, tmp_path: Path, num_workers: int) -> None:
    root = copy_tree(tree, tmp_path)
    bad = root / "train" / "dog" / "dog_1.png"
    bad.write_bytes(bad.read_bytes()[:60])
    message = error(fit_args(root, tmp_path / "run", f"--data.num_workers={num_workers}"))
    assert (
        message
        == f"cannot decode image {bad}: image file is truncated; fix or remove it, or pass --data.on_bad_image skip"
    )


def test_skip_bad_images_and_read_grey_rgba_and_16_bit_images(tree: Path, tmp_path: Path) -> None:
    root = copy_tree(tree, tmp_path)
    for i, image in enumerate(sorted((root / "train").glob("*/*.png"))):
        rgb = Image.open(image)
        if i % 3 == 0:
            rgb.convert("L").save(image)
        elif i % 3 == 1:
            rgb.convert("RGBA").save(image)
        else:
            grey16 = np.asarray(rgb.convert("L"), dtype=np.uint16) * 257
            Image.fromarray(grey16).save(image)
    assert {Image.open(p).mode for p in (root / "train").glob("*/*.png")} == {"L", "RGBA", "I;16"}
    bad = root / "val" / "cat" / "cat_0.png"
    bad.write_bytes(b"not an image")
    with pytest.warns(SkippedImagesWarning, match=r"skipped 1 unreadable image file\(s\) of 48 .*cat_0\.png"):
        main(fit_args(root, tmp_path / "run", "--data.on_bad_image=skip"))
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert sum(map(sum, results["test"]["confusion_matrix"])) == 11  # 12 validation images, 1 skipped


def test_a_symlink_loop_in_the_data_tree_is_an_error_naming_it(tree: Path, tmp_path: Path) -> None:
    # `ln -s .. DATA/train/cat/loop` made class cat read the whole training tree, dog's and eel's images included
    root = copy_tree(tree, tmp_path)
    (root / "train" / "cat" / "loop").symlink_to("..")
    assert error(fit_args(root, tmp_path / "run")) == (
        f"symbolic link loop: {root / 'train' / 'cat' / 'loop'} points to {(root / 'train').resolve()}, which "
        "contains it, so its images would be read again and again: remove the link, or point it at a folder that "
        "does not contain it"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_named_pipes_in_the_data_tree_are_skipped(tree: Path, tmp_path: Path) -> None:
    # a FIFO named like an image blocked the loader for ever (open() waits for a writer)
    root = copy_tree(tree, tmp_path)
    for fifo in (root / "train" / "cat" / "pipe.png", root / "val" / "dog" / "pipe.jpg"):
        os.mkfifo(fifo)
    assert [Path(p).name for p in list_image_files(str(root / "val" / "dog"))] == [f"dog_{i}.png" for i in range(4)]
    main(fit_args(root, tmp_path / "run", "--trainer.limit_val_batches=2"))
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert sum(map(sum, results["test"]["confusion_matrix"])) == 12  # the 12 validation images, no pipe
    out = tmp_path / "preds.csv"
    main(["predict", f"--ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", f"--input={root / 'val'}",
          f"--output={out}"])  # fmt: skip
    assert len(list(csv.DictReader(out.open()))) == 12


def test_predict_keeps_its_old_output_when_an_image_is_bad_or_skips_it(tree: Path, tmp_path: Path) -> None:
    ckpt = fine_tuned_checkpoint(tmp_path / "model.ckpt", 3)
    images = Path(shutil.copytree(tree / "val", tmp_path / "images"))
    bad = sorted(images.glob("*/*.png"))[5]
    bad.write_bytes(bad.read_bytes()[:60])  # the 6th of 12 images is truncated
    out = tmp_path / "out" / "preds.csv"
    out.parent.mkdir()
    out.write_text("path,prediction,confidence\nthe previous predictions\n")
    args = ["predict", f"--ckpt_path={ckpt}", f"--input={images}", f"--output={out}", "--data.batch_size=4"]
    assert error(args) == (
        f"cannot decode image {bad}: image file is truncated; fix or remove it, or pass --data.on_bad_image skip"
    )
    # was: a header and the 4 rows before the bad batch
    assert out.read_text() == "path,prediction,confidence\nthe previous predictions\n"
    assert [p.name for p in out.parent.iterdir()] == ["preds.csv"]  # no temporary file left
    for option in ("--data.on_bad_image=skip", "--on_bad_image=skip"):  # the first is what the message says; the
        # second, deprecated, still works
        with pytest.warns(SkippedImagesWarning, match=rf"^skipped 1 unreadable image file\(s\) of 12 .*{bad.name}"):
            main([*args, option])
        rows = list(csv.DictReader(out.open()))
        assert len(rows) == 11 and str(bad) not in {r["path"] for r in rows}


def test_label_fraction_too_small_for_one_image_per_class(tree: Path, tmp_path: Path) -> None:
    message = error(fit_args(tree, tmp_path / "run", "--data.label_fraction=0.01"))
    assert message == (
        "label_fraction 0.01 keeps no image of class 'cat' (12 images) nor of 2 other class(es): raise it to ≥ 0.0417"
    )


def test_class_names_differ_between_train_and_val(tree: Path, tmp_path: Path) -> None:
    root = copy_tree(tree, tmp_path)
    (root / "val" / "eel").rename(root / "val" / "fox")
    message = error(fit_args(root, tmp_path / "run"))
    assert message.startswith(f"class folders of val ({root / 'val'}) differ from train ({root / 'train'}): ")
    assert "missing from val: ['eel']; only in val: ['fox'] — both need the same class sub-folders" in message


# -- batches --------------------------------------------------------------------------------------------------
def test_batches_of_one_train_when_the_backbone_allows_it(tree: Path, tmp_path: Path) -> None:
    main(fit_args(tree, tmp_path / "run", "--data.batch_size=1", "--objective=core"))
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert math.isfinite(float(rows[0]["train/loss"]))


def test_batch_of_one_through_batchnorm_is_a_clear_error(tree: Path, tmp_path: Path) -> None:
    message = error(fit_args(tree, tmp_path / "run", "--data.batch_size=1", "--model.backbone=resnet18"))
    assert message.startswith("a training batch of 1 image cannot pass the backbone's BatchNorm layers")
    assert "use --data.batch_size 2 or more" in message


def test_a_run_directory_another_process_is_running_is_refused_untouched(
    tree: Path, tmp_path: Path, other_process: subprocess.Popen
) -> None:
    # Two fits into one --run_dir (a second terminal; a bench sweep running it) would overwrite each other's
    # checkpoints; a fit on its own claims its run directory, then leaves no claim behind.
    main(fit_args(tree, tmp_path / "run"))
    assert not (tmp_path / "run" / "fit.pid").exists()
    claim_run(tmp_path / "run")
    point_claim(tmp_path / "run", other_process.pid)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    message = error(fit_args(tree, tmp_path / "run"))
    assert message == (
        f"{tmp_path / 'run'} is being run by another process (pid {other_process.pid}): wait for it to finish. If no "
        f"such process runs, delete {tmp_path / 'run' / 'fit.pid'} and try again"
    )
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before
    other_process.kill()  # the other process is gone: its claim is stale
    other_process.wait()
    main(fit_args(tree, tmp_path / "run"))  # its process gone, the stale claim is replaced: the run is tested again


def test_diverging_loss_names_epoch_and_step(tree: Path, tmp_path: Path) -> None:
    message = error(fit_args(tree, tmp_path / "run", "--model.optim.lr=1e30", "--trainer.precision=32-true"))
    assert re.match(r"the training loss is (nan|inf) at epoch 0, step 1 \(batch 1; ce=", message), message
    # in float32 already: the fix does not suggest it
    assert message.endswith(
        "lower the learning rate (--model.optim.lr) or clip the gradients (--trainer.gradient_clip_val 1.0)."
    )
    assert (tmp_path / "run" / "config.yaml").is_file()  # it trained a step: its run directory stays
    assert recorded_divergence(tmp_path / "run") == message  # a result: coretune tune does not run it again


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        (
            "bf16-mixed",
            r"the validation loss is nan at epoch 0, step 3 \(batch 0; 4 of 4 images have non-finite logits\)\. ",
        ),
        (
            "32-true",
            r"the model collapsed at epoch 0, step 3: all 6 validation images get the same logits \(1\.\d+e\+34, "
            r"-1\.\d+e\+34\), so it predicts class 'a' for every image\. ",
        ),
    ],
)
def test_a_diverging_run_whose_training_loss_stays_finite_fails(precision: str, expected: str, tmp_path: Path) -> None:
    # --model.optim.lr 1e6: the training loss stays finite (1e15-1e18) but the model is broken; it used to end with
    # "top-1 50%" (every image predicted as class a) and exit 0
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data", classes=("a", "b"), per_class=6, val_per_class=3, size=16)
    args = ["fit", f"--data.root={root}", "--model.backbone=small_cnn", "--data.image_size=16",
            "--trainer.max_epochs=1", "--data.batch_size=4", "--model.optim.lr=1e6", f"--trainer.precision={precision}",
            f"--run_dir={tmp_path / 'run'}", *QUIET]  # fmt: skip
    message = error(args)
    assert re.match(expected, message), message
    fix = {
        "bf16-mixed": "lower the learning rate (--model.optim.lr), clip the gradients (--trainer.gradient_clip_val "
        "1.0), or train in float32 (--trainer.precision 32-true).",
        "32-true": "lower the learning rate (--model.optim.lr) or clip the gradients (--trainer.gradient_clip_val "
        "1.0).",
    }[precision]
    assert message.endswith(f"Check the pre-trained weights, {fix}")
    assert recorded_divergence(tmp_path / "run") == message


def test_a_diverged_run_whose_logits_still_differ_fails(tmp_path: Path) -> None:
    # --model.optim.lr 1e4, one epoch: finite logits of ~1e15 that differ between images (no collapse), one class
    # predicted for every image; it used to end with "top-1 50%" and exit 0
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data", classes=("a", "b"), per_class=6, val_per_class=3, size=16)
    args = ["fit", f"--data.root={root}", "--model.backbone=small_cnn", "--data.image_size=16",
            "--trainer.max_epochs=1", "--data.batch_size=4", "--model.optim.lr=1e4", "--trainer.precision=32-true",
            f"--run_dir={tmp_path / 'run'}", *QUIET]  # fmt: skip
    message = error(args)
    assert re.match(
        r"the model diverged at epoch 0, step 3: its validation logits reach \d\.\d+e\+\d\d in magnitude \(a trained "
        r"model's stay within ~100\), so its predictions no longer mean anything\. Check the pre-trained weights, "
        r"lower the learning rate",
        message,
    ), message
    assert recorded_divergence(tmp_path / "run") == message


def dead_backbone(path: Path) -> Path:
    """small_cnn weights whose last BatchNorm has zero scale and shift: every image's features are 0."""
    body = create_backbone("small_cnn").body
    state = body.state_dict()
    state["layer4.1.weight"].zero_()
    state["layer4.1.bias"].zero_()
    torch.save(state, path)
    return path


def test_a_model_whose_outputs_do_not_depend_on_the_images_fails(tree: Path, tmp_path: Path) -> None:
    weights = dead_backbone(tmp_path / "dead.pth")
    message = error(fit_args(tree, tmp_path / "run", f"--model.weights={weights}", "--model.freeze_backbone=true"))
    assert re.match(
        r"the model collapsed at epoch 0, step 0: all 8 validation images get the same logits \(-?\d\.\d+, "
        r"-?\d\.\d+, -?\d\.\d+\), so it predicts class '(cat|dog|eel)' for every image\. Check the pre-trained "
        r"weights, lower the learning rate",
        message,
    ), message
    assert recorded_divergence(tmp_path / "run") == message  # at step 0, yet kept: a finding, not an empty run
    main(fit_args(tree, tmp_path / "run"))  # fitted again into it, with working weights: no stale record
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert "test" in results and "diverged" not in results
    # an epoch of identical images is not judged: a blank test set gives one prediction legitimately (a blank
    # training set is refused before training: test_engine_preflight.py)
    blank = copy_tree(tree, tmp_path)
    for image in blank.glob("val/*/*.png"):
        Image.new("RGB", (32, 32), (128, 64, 32)).save(image)
    main(fit_args(blank, tmp_path / "blank"))


def overflowing(state: dict[str, Any]) -> None:
    """Finite weights whose logits overflow to infinity (features of 1e30 through a classifier of 1e38)."""
    state["backbone.body.layer4.1.bias"].fill_(1e30)
    state["objective.classifier.weight"].fill_(1e38)


def test_coretune_test_fails_on_non_finite_or_collapsed_outputs(tree: Path, tmp_path: Path) -> None:
    dead = fine_tuned_checkpoint(tmp_path / "dead.ckpt", 3, lambda s: s["backbone.body.layer4.1.weight"].zero_())
    message = error(command("test", dead, tree, tmp_path))
    assert message.startswith("the model collapsed at epoch 0, step 0: all 12 test images get the same logits (")
    huge = fine_tuned_checkpoint(tmp_path / "huge.ckpt", 3, overflowing)
    assert re.match(
        r"the test loss is nan at epoch 0, step 0 \(batch 0; 12 of 12 images have non-finite logits\)\. Check the ",
        error(command("test", huge, tree, tmp_path)),
    )


def test_a_run_without_last_ckpt_is_not_overwritten_by_a_new_fit(tree: Path, tmp_path: Path) -> None:
    """A finished run copied back without its checkpoints (docs/experiments.md's rsync --exclude checkpoints/), or
    holding best.ckpt alone, was started over silently: its results.json lost its test entry at once, its
    config.yaml and metrics.csv were overwritten. An unfinished one without last.ckpt still starts over (coretune
    bench re-runs such runs)."""
    run = tmp_path / "run"
    main(fit_args(tree, run))
    results = (run / "results.json").read_text()
    shutil.rmtree(run / "checkpoints")
    message = error(fit_args(tree, run, "--model.optim.lr=0.5"))
    assert message == (
        f"{run} holds a run (test results) but no last.ckpt to resume it from: a new fit there would overwrite its "
        "results and metrics. Pass another --run_dir, resume it from one of its checkpoints with --ckpt_path, or "
        "delete that folder to start over"
    )
    assert (run / "results.json").read_text() == results
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "best.ckpt").write_bytes(b"")
    assert "holds a run (test results, checkpoints/best.ckpt) but no last.ckpt" in error(fit_args(tree, run))
    # unfinished, killed between its best and last checkpoints: started over, as coretune bench re-runs it; its new
    # best replaces best.ckpt (not best-v1.ckpt beside the stale one, which domain generalization would test)
    (run / "results.json").unlink()
    main(fit_args(tree, run))
    assert json.loads((run / "results.json").read_text())["test"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]
    assert (run / "checkpoints" / "best.ckpt").stat().st_size > 0
    # a remote checkpoint: Lightning would unpickle it (weights_only=False for http)
    message = error(fit_args(tree, tmp_path / "new", "--ckpt_path=https://example.org/last.ckpt"))
    assert message.startswith("--ckpt_path https://example.org/last.ckpt is a remote file: coretune resumes only")
    assert not (tmp_path / "new").exists()


def test_fit_warns_when_test_images_are_training_files(tree: Path, tmp_path: Path) -> None:
    """A test class folder symlinked to its training folder: the test score is partly a training accuracy (row
    201); coretune eval refuses it (tests/test_evaluation.py). A validation folder's likewise (row 212)."""
    root = copy_tree(tree, tmp_path)
    (root / "test").mkdir()
    (root / "test" / "cat").symlink_to(root / "train" / "cat", target_is_directory=True)
    for name in ("dog", "eel"):
        shutil.copytree(root / "val" / name, root / "test" / name)
    first = sorted((root / "test" / "cat").iterdir())[0]
    with pytest.warns(UserWarning, match=rf"^12 of the 20 test images are training images too \(the same files, e\.g\. "
                      rf"{re.escape(str(first))}\): the test score is partly a training accuracy"):  # fmt: skip
        main(fit_args(root, tmp_path / "run"))
    (root / "test" / "cat").unlink()  # the symlink
    shutil.copytree(root / "val" / "cat", root / "test" / "cat")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(fit_args(root, tmp_path / "run2"))
    assert not [w for w in caught if "are training images too" in str(w.message)]
    # a validation folder of its own (beside test/) holding training files: best.ckpt chosen on training accuracy
    shutil.rmtree(root / "val" / "cat")
    (root / "val" / "cat").symlink_to(root / "train" / "cat", target_is_directory=True)
    first = sorted((root / "val" / "cat").iterdir())[0]
    with pytest.warns(
        UserWarning,
        match=rf"^12 of the 20 validation images are training images too \(the same "
        rf"files, e\.g\. {re.escape(str(first))}\): best\.ckpt is chosen partly on training accuracy",
    ):
        main(fit_args(root, tmp_path / "run3"))  # fmt: skip


def test_the_collapse_watch_compares_images_and_logits_of_one_size() -> None:
    """Whole-image segmentation batches images of one size: an epoch's batches differ in shape, and the watch
    compared each with the epoch's first image (a crash). Each image is now compared with the first of its size;
    sizes alone judge nothing."""
    from coretune.engine.health import OutputWatch as _OutputWatch

    def watched(*batches: tuple[torch.Tensor, torch.Tensor]) -> bool:
        watch = _OutputWatch()
        for x, logits in batches:
            watch.update(x, logits)
        return watch.collapsed()

    small, large = torch.rand(2, 3, 4, 6), torch.rand(3, 3, 8, 10)
    constant = {x.shape[-1]: torch.ones(len(x), 5, *x.shape[-2:]) for x in (small, large)}
    assert watched((small, constant[6]), (large, constant[10]))  # the same logits for every image of a size
    assert not watched((small, torch.rand(2, 5, 4, 6)), (large, torch.rand(3, 5, 8, 10)))  # a working model
    assert not watched((small[:1], constant[6][:1]), (large[:1], constant[10][:1]))  # one image a size: not judged
    # bounded: copies (not views of whole batches) of the first SHAPES sizes' first image and logits; later sizes
    # are judged within their batch
    watch = _OutputWatch()
    for side in range(4, 4 + _OutputWatch.SHAPES + 3):
        x = torch.rand(2, 3, side, side)
        watch.update(x, torch.rand(2, 5, side, side))
    assert len(watch.first) == _OutputWatch.SHAPES and watch.first[(3, 4, 4)][0].untyped_storage().nbytes() == 4 * 48
    late = torch.rand(2, 3, 20, 20)
    assert watched((late, torch.ones(2, 5, 20, 20))) and not watched((late, torch.rand(2, 5, 20, 20)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_features_raise_naming_the_step(bad: float) -> None:
    model = FineTuner(objectives.create("core"), backbone="small_cnn")
    model.build(3)
    model.backbone.forward = lambda x: torch.full((x.shape[0], model.backbone.feature_dim), bad)
    batch = (torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(NonFiniteLossError, match=r"^the training loss is (nan|inf) at epoch 0, step 0 \(batch 7; ce="):
        model.training_step(batch, 7)


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_every_objective_handles_one_class_absent_classes_and_huge_features(name: str) -> None:
    """One-class batches, classes missing from the batch, a batch of 2 and features of magnitude 1e4."""
    torch.manual_seed(0)
    model = FineTuner(objectives.create(name), backbone="small_cnn", channels_last=False)
    model.build(5)
    model.objective.attach_backbone(model.backbone)
    model.objective.observe_class_counts(torch.tensor([50, 20, 5, 2, 1]))  # as a fit does (logit adjustment)
    x = torch.rand(6, 3, 32, 32)
    cases = {
        "one class": (x, torch.zeros(6, dtype=torch.long), 1.0),
        "classes 0 and 1 of 5": (x, torch.tensor([0, 1, 0, 1, 1, 0]), 1.0),
        "batch of 2": (x[:2], torch.tensor([3, 4]), 1.0),
        "huge features": (x, torch.tensor([0, 1, 2, 3, 4, 0]), 1e4),
    }
    for case, (images, labels, scale) in cases.items():
        model.zero_grad()
        features = model.backbone(images) * scale
        out = model.objective(features, labels, inputs=images)
        out.loss.backward()
        assert torch.isfinite(out.loss), (case, out.terms)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), case


# -- checkpoints ----------------------------------------------------------------------------------------------
def test_wrong_architecture_names_both_shapes(tree: Path, tmp_path: Path) -> None:
    weights = tmp_path / "r50.pth"
    torch.save(create_backbone("resnet50").body.state_dict(), weights)
    message = error(fit_args(tree, tmp_path / "run", "--model.backbone=resnet18", f"--model.weights={weights}"))
    assert message.startswith(
        f"checkpoint {weights} (layout 'torchvision') does not fit backbone 'resnet18': checkpoint "
        "layer1.0.conv1.weight (64, 64, 1, 1) vs model (64, 64, 3, 3) (and "
    )
    assert message.endswith("wrong architecture? pass the matching --model.backbone")


def fine_tuned_checkpoint(
    path: Path, num_classes: int, change: Callable[[dict[str, Any]], object] = lambda state: None
) -> Path:
    """A checkpoint as `coretune fit` writes it (model, hyper-parameters and the 'coretune' entry), with ``change``
    applied to its state dict."""
    model = FineTuner(objectives.create("ce"), backbone="small_cnn")
    model.build(num_classes, ["cat", "dog", "eel", *(f"c{i}" for i in range(3, num_classes))][:num_classes])
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    model.on_save_checkpoint(checkpoint)
    checkpoint["coretune"]["data"] = {"image_size": 32, "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    change(checkpoint["state_dict"])
    torch.save(checkpoint, path)
    return path


def test_wrong_number_of_classes(tree: Path, tmp_path: Path) -> None:
    from image_trees import make_image_tree

    four = make_image_tree(tmp_path / "four", classes=("a", "b", "c", "d"), per_class=2, val_per_class=1)
    ckpt = fine_tuned_checkpoint(tmp_path / "three.ckpt", 3)
    assert error(["test", f"--ckpt_path={ckpt}", f"--data.root={four}", "--data.image_size=32"]) == (
        "the model was built for 3 classes but the data has 4: use data with the same classes, or fine-tune a new model"
    )


def truncated(tmp_path: Path) -> Path:
    ckpt = fine_tuned_checkpoint(tmp_path / "full.ckpt", 3)
    path = tmp_path / "truncated.ckpt"
    path.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    return path


class RunsCode:
    """Unpickling this runs ``os.system`` — a checkpoint that executes code when loaded unsafely."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def malicious(tmp_path: Path) -> Path:
    path = tmp_path / "malicious.ckpt"
    torch.save({"state_dict": RunsCode(tmp_path / "pwned")}, path)
    return path


def command(kind: str, ckpt: Path, tree: Path, tmp_path: Path) -> list[str]:
    return {
        "fit": fit_args(tree, tmp_path / "run", f"--model.weights={ckpt}"),
        "test": [
            "test",
            f"--ckpt_path={ckpt}",
            f"--data.root={tree}",
            "--data.image_size=32",
            f"--output={tmp_path / 'test_results.json'}",
        ],
        "predict": ["predict", f"--ckpt_path={ckpt}", f"--input={tree / 'val'}", f"--output={tmp_path / 'p.csv'}"],
        "export": ["export", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'export'}"],
    }[kind]


@pytest.mark.parametrize("kind", ["fit", "test", "predict", "export"])
def test_truncated_checkpoint(kind: str, tree: Path, tmp_path: Path) -> None:
    ckpt = truncated(tmp_path)
    message = error(command(kind, ckpt, tree, tmp_path))
    assert message.startswith(f"cannot read checkpoint {ckpt} (")
    assert message.endswith("the file is truncated or corrupt, or not a PyTorch checkpoint; copy or download it again")


@pytest.mark.parametrize("kind", ["fit", "test", "predict", "export"])
def test_pickle_that_runs_code_is_refused_and_nothing_runs(kind: str, tree: Path, tmp_path: Path) -> None:
    ckpt = malicious(tmp_path)
    torch.load(ckpt, weights_only=False)  # the payload is real: an unsafe load runs it
    assert (tmp_path / "pwned").exists()
    (tmp_path / "pwned").unlink()
    message = error(command(kind, ckpt, tree, tmp_path))
    assert message.startswith(
        f"checkpoint {ckpt} holds Python objects that torch.load(weights_only=True) refuses to unpickle (it stores "
        "posix.system), because unpickling them could run arbitrary code."
    )
    assert not (tmp_path / "pwned").exists()


def test_unknown_layout_lists_the_layouts_tried(tree: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "mystery.pth"
    torch.save({"weights": {"trunk.conv.weight": torch.zeros(3)}}, ckpt)
    message = error(fit_args(tree, tmp_path / "run", f"--model.weights={ckpt}"))
    assert message.startswith(
        f"no tensor of checkpoint {ckpt} matches backbone 'small_cnn'. Layouts tried: torchvision (not applicable"
    )
    assert "Checkpoint starts with [weights: {trunk.conv.weight}]" in message
    assert "force it with --model.weights_options.format (one of torchvision, timm, " in message


def test_integer_weights_are_refused_unless_the_cast_is_forced(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .safetensors whose float tensors were saved as int64 loaded silently ("24/24 tensors loaded") as floats."""
    from safetensors.torch import save_file

    state = create_backbone("small_cnn").body.state_dict()
    floats = [k for k, v in state.items() if v.is_floating_point()]
    weights = tmp_path / "int.safetensors"
    save_file({k: (v * 100).long() if v.is_floating_point() else v for k, v in state.items()}, weights)
    message = error(fit_args(tree, tmp_path / "run", f"--model.weights={weights}"))
    assert message == (
        f"checkpoint {weights} stores {len(floats)} floating-point tensors of backbone 'small_cnn' as int64 (e.g. "
        f"{', '.join(floats[:3])}): integer or quantised weights are not the float weights the model needs. "
        "Dequantise the checkpoint or export its float weights; if the integers are the real values, force the "
        "conversion with --model.weights_options.allow_cast true (allow_cast=True in Python)"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
    cast = "--model.weights_options.allow_cast=true"
    forced = error(fit_args(tree, tmp_path / "run", f"--model.weights={weights}", cast))
    # loaded as asked; 100x the real weights are no model: its logits blow up, which the run reports, not a result
    assert forced.startswith("the model diverged at epoch 0, step 0: its validation logits reach "), forced
    report = f"{len(state)}/{len(state)} tensors loaded, 0 missing, 0 unexpected; cast {len(floats)} non-floating "
    assert report + "tensors to floating point (allow_cast)" in capsys.readouterr().err
    # the option the message names exists wherever weights load: continued pre-training and coretune eval
    eval_args = ["eval", "knn", "--model.backbone=small_cnn", f"--model.weights={weights}", f"--data.root={tree}",
                 "--data.image_size=16", f"--output={tmp_path / 'knn.json'}"]  # fmt: skip
    assert error(eval_args) == message
    main([*eval_args, "--model.weights_options.allow_cast=true"])
    assert report + "tensors to floating point (allow_cast)" in capsys.readouterr().err
    pretrain = pretrain_args(tree / "train", tmp_path / "pre", f"--model.weights={weights}")
    assert error(pretrain) == message
    main([*pretrain, "--model.weights_allow_cast=true"])
    assert report + "tensors to floating point (allow_cast)" in capsys.readouterr().err
    half = tmp_path / "half.safetensors"  # another float precision is converted without a word
    save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, half)
    main(fit_args(tree, tmp_path / "half_run", f"--model.weights={half}"))
    assert f"{len(state)}/{len(state)} tensors loaded, 0 missing, 0 unexpected\n" in capsys.readouterr().err
    recorded = json.loads((tmp_path / "half_run" / "results.json").read_text())["weights_sha256"]
    assert recorded == hashlib.sha256(half.read_bytes()).hexdigest()  # the file the committed record started from


def test_coretune_commands_refuse_a_pre_trained_backbone_checkpoint(tree: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "backbone.pth"
    torch.save(create_backbone("small_cnn").body.state_dict(), ckpt)
    assert error(command("test", ckpt, tree, tmp_path)) == (
        f"{ckpt} is not a coretune fine-tuning checkpoint (no 'coretune' entry): pass a .ckpt written by "
        "`coretune fit` (a pre-trained backbone checkpoint goes to `coretune fit --model.weights`)"
    )


def test_predict_refuses_nan_weights_or_outputs_and_keeps_its_old_output(tree: Path, tmp_path: Path) -> None:
    # a diverged run's checkpoint gave rows like `cat,nan,nan,nan` and exit 0
    nan = fine_tuned_checkpoint(tmp_path / "nan.ckpt", 3, lambda s: s["objective.classifier.weight"].fill_(math.nan))
    out = tmp_path / "p.csv"
    out.write_text("path,prediction,confidence\nthe previous predictions\n")
    assert error(command("predict", nan, tree, tmp_path)) == (
        f"checkpoint {nan} holds NaN or infinite weights (1 of 26 tensors, e.g. objective.classifier.weight): the run "
        "that wrote it diverged; use an earlier checkpoint, or fine-tune again with a lower learning rate "
        "(--model.optim.lr)"
    )
    huge = fine_tuned_checkpoint(tmp_path / "huge.ckpt", 3, overflowing)  # finite weights, infinite logits
    first = sorted((tree / "val").glob("*/*.png"))[0]
    assert error(command("predict", huge, tree, tmp_path)) == (
        f"checkpoint {huge} gives NaN or infinite outputs for {first} (and 11 more of its batch): its weights "
        "overflow; use an earlier checkpoint of the run, or fine-tune again with a lower learning rate "
        "(--model.optim.lr)"
    )
    assert out.read_text() == "path,prediction,confidence\nthe previous predictions\n"


def crafted(ckpt: dict[str, Any], case: str) -> None:
    """Damage the metadata of a fine-tuning checkpoint as ``case`` says."""
    meta, hparams = ckpt["coretune"], ckpt["hyper_parameters"]
    if case == "no objective":
        del meta["objective"]
    elif case == "metadata a string":
        ckpt["coretune"] = "core"
    elif case == "weights to download":
        hparams["backbone_args"] = {"weights": "DEFAULT"}
    elif case == "too few class names":
        meta["class_names"] = meta["class_names"][:2]
    elif case == "a setting of the wrong type":
        hparams["optim"]["lr"] = "fast"
    elif case == "an objective setting out of range":
        ckpt["coretune"] = {**meta, "objective": "core", "objective_hparams": {"eta": -1.0}}


@pytest.mark.parametrize("kind", ["test", "predict", "export"])
@pytest.mark.parametrize(
    ("case", "problem"),
    [
        ("no objective", "its 'coretune' entry names no objective"),
        ("metadata a string", "its 'coretune' entry is a str, not the dict of settings `coretune fit` writes"),
        (
            "weights to download",
            "its backbone_args set ['weights'], which would fetch pre-trained weights (coretune never downloads)",
        ),
        ("too few class names", "its class_names (['cat', 'dog']) are not 3 names, one per class"),
        (
            "a setting of the wrong type",
            "its model settings do not fit FineTuner: Parser key \"optim.lr\": Expected a <class 'float'>. Got value: "
            "fast",
        ),
    ],
)
def test_crafted_checkpoint_metadata_is_refused_before_anything_is_built(
    case: str, problem: str, kind: str, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each used to crash predict (KeyError, AttributeError, an IndexError after half the CSV was written), and
    # backbone_args {weights: DEFAULT} would have asked torchvision for a download
    ckpt = fine_tuned_checkpoint(tmp_path / "crafted.ckpt", 3)
    content = torch.load(ckpt, weights_only=True)
    crafted(content, case)
    torch.save(content, ckpt)
    monkeypatch.setattr("coretune.tasks.base.create_backbone", None)  # nothing may be built
    assert error(command(kind, ckpt, tree, tmp_path)) == (
        f"checkpoint {ckpt} is damaged or was not written by `coretune fit`: {problem}; use another checkpoint of "
        "the run, or fine-tune again"
    )
    assert not (tmp_path / "p.csv").exists() and not (tmp_path / "export").exists()


def test_checkpoint_settings_out_of_range_or_weights_that_do_not_fit_name_the_file(tree: Path, tmp_path: Path) -> None:
    ckpt = fine_tuned_checkpoint(tmp_path / "crafted.ckpt", 3)
    content = torch.load(ckpt, weights_only=True)
    crafted(content, "an objective setting out of range")
    torch.save(content, ckpt)
    assert error(command("predict", ckpt, tree, tmp_path)) == (
        f"checkpoint {ckpt} holds settings coretune refuses: invalid Core-tuning settings: eta must be >= 0 (got -1.0)"
    )
    content = torch.load(fine_tuned_checkpoint(ckpt, 3), weights_only=True)
    del content["state_dict"]["objective.classifier.bias"]
    torch.save(content, ckpt)
    assert error(command("predict", ckpt, tree, tmp_path)) == (
        f"checkpoint {ckpt}: its weights do not fit the model its settings describe (Error(s) in loading state_dict "
        'for FineTuner: Missing key(s) in state_dict: "objective.classifier.bias".): the file is damaged; use the '
        "run's other checkpoint"
    )


# -- resuming a run directory ---------------------------------------------------------------------------------
def snapshot(run: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-epoch run of the tree (copy it before changing it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    main(fit_args(tree, run))
    return run


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.parametrize(
    ("options", "differences"),
    [
        (
            ["--model.optim.lr=0.5", "--seed=3", "--data.batch_size=2"],
            "seed_everything 0 → 3; model.optim.lr 0.01 → 0.5; data.batch_size 8 → 2",
        ),
        (["--model.backbone=resnet18"], "model.backbone small_cnn → resnet18"),
        (
            ["--objective=core"],
            "objective.class_path coretune.objectives.ce.CETuning → coretune.objectives.core.CoreTuning",
        ),
    ],
)
def test_resuming_with_other_settings_is_refused_and_nothing_is_touched(
    tree: Path, finished_run: Path, tmp_path: Path, options: list[str], differences: str
) -> None:
    """Re-running a run directory with other settings resumed the old run (or crashed in load_state_dict for another
    backbone or objective) while config.yaml recorded the new values."""
    run = copy_run(finished_run, tmp_path)
    before = snapshot(run)
    assert error(fit_args(tree, run, *options)) == (
        f"the run in {run} was trained with other settings than these: {differences}. Resuming it from "
        f"{run / 'checkpoints' / 'last.ckpt'} would go on with settings it was not trained with: resume it with its "
        f"own (--config {run / 'config.yaml'} applies them), or start a new run with another --run_dir"
    )
    assert snapshot(run) == before


def test_a_new_run_another_fit_claimed_first_is_left_to_it(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_process: subprocess.Popen
) -> None:
    # two fits of one new run directory start together: both see no directory, the other claims it first; this one
    # is refused, and its clean-up of a run that never trained removed the other's directory, claim and all
    from coretune.engine import runcli as rundir

    run = tmp_path / "run"

    def claimed_first(path: str) -> Any:
        Path(path).mkdir(parents=True)
        claim_run(path)
        point_claim(path, other_process.pid)  # the other fit's claim
        (Path(path) / "config.yaml").write_text("the other fit's\n")
        return real(path)

    real = rundir.fit_claim
    monkeypatch.setattr(rundir, "fit_claim", claimed_first)
    assert f"pid {other_process.pid}" in error(fit_args(tree, run))
    assert (run / "config.yaml").read_text() == "the other fit's\n"
    assert json.loads((run / CLAIM_FILE).read_text())["pid"] == other_process.pid


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # the run was copied: Lightning notes the move
def test_a_resume_may_extend_the_run_and_config_yaml_says_what_ran(
    tree: Path, finished_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = copy_run(finished_run, tmp_path)
    with caplog.at_level("INFO"):
        main(fit_args(tree, run, "--trainer.max_epochs=2", "--data.num_workers=1"))
    assert (
        f"resuming the run in {run} from {run / 'checkpoints' / 'last.ckpt'} with trainer.max_epochs 1 → 2; "
        "data.num_workers 0 → 1 (re-running a command continues its run" in caplog.text
    )
    assert [int(r["epoch"]) for r in read_metrics(run / "metrics.csv")] == [0, 1]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["trainer"]["max_epochs"] == 2 and config["data"]["num_workers"] == 1
    assert config["model"]["optim"]["lr"] == 0.01 and config["data"]["batch_size"] == 8
    main(["fit", f"--config={run / 'config.yaml'}"])  # the fix the refusal names: the run's own settings
    assert [int(r["epoch"]) for r in read_metrics(run / "metrics.csv")] == [0, 1]
    # shortened below what it trained: config.yaml would record 1 epoch of a run that trained 2
    message = error(fit_args(tree, run, "--trainer.max_epochs=1", "--data.num_workers=1"))
    assert "trainer.max_epochs 1 is below the 2 epoch(s) the checkpoint has reached" in message
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_epochs"] == 2


def test_data_normalised_otherwise_than_the_weights_were_trained_is_warned_about(tree: Path, tmp_path: Path) -> None:
    # pre-trained with --data.mean/--data.std of its own, fine-tuned with the ImageNet defaults: inputs on another
    # scale than the backbone learned, which nothing noticed
    from coretune.pretrain import SimCLR

    weights = tmp_path / "pretrained.pth.tar"
    trained = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
    torch.save({**SimCLR(backbone="small_cnn").pretrained_checkpoint(), "normalization": trained}, weights)
    expected = (
        f"--model.weights {weights} were trained on images normalised with mean [0.5,0.5,0.5] and std "
        "[0.25,0.25,0.25], but the data is normalised with mean [0.485,0.456,0.406] and std [0.229,0.224,0.225]: "
        "pass --data.mean [0.5,0.5,0.5] --data.std [0.25,0.25,0.25] to feed the backbone inputs on the scale it learned"
    )
    with pytest.warns(UserWarning) as caught:
        main(fit_args(tree, tmp_path / "run", f"--model.weights={weights}"))
    assert expected in [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(fit_args(tree, tmp_path / "run2", f"--model.weights={weights}", "--data.mean=[0.5,0.5,0.5]",
                      "--data.std=[0.25,0.25,0.25]"))  # fmt: skip
    assert not [w for w in caught if "were trained on images normalised" in str(w.message)]


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_a_resume_accepts_the_same_pretrained_file_moved_and_refuses_another(
    tree: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the user moved their checkpoint folder: the run could not resume ("model.weights A → B" was refused) though
    # the file is the same; its checkpoint now records the file's SHA-256
    weights = tmp_path / "a" / "encoder.pth"
    weights.parent.mkdir()
    from coretune.pretrain import SimCLR

    torch.save(SimCLR(backbone="small_cnn").pretrained_checkpoint(), weights)
    run = tmp_path / "run"
    main(fit_args(tree, run, f"--model.weights={weights}"))
    moved = tmp_path / "b" / "encoder.pth"
    moved.parent.mkdir()
    weights.rename(moved)
    with caplog.at_level("INFO"):
        main(fit_args(tree, run, f"--model.weights={moved}", "--trainer.max_epochs=2"))
    assert f"with trainer.max_epochs 1 → 2; model.weights {weights} → {moved} (re-running" in caplog.text
    assert [int(r["epoch"]) for r in read_metrics(run / "metrics.csv")] == [0, 1]
    other = tmp_path / "c" / "encoder.pth"
    other.parent.mkdir()
    torch.manual_seed(1)
    torch.save(SimCLR(backbone="small_cnn").pretrained_checkpoint(), other)
    before = snapshot(run)
    assert error(fit_args(tree, run, f"--model.weights={other}", "--trainer.max_epochs=3")).startswith(
        f"the run in {run} was trained with other settings than these: model.weights {moved} → {other}."
    )
    assert snapshot(run) == before
    # the same path, another file (the pre-training re-made): L2-SP and DELTA would anchor to the new one
    digests = [hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in (moved, other)]
    shutil.copyfile(other, moved)
    assert error(fit_args(tree, run, f"--model.weights={moved}", "--trainer.max_epochs=3")).startswith(
        f"the run in {run} was trained with other settings than these: model.weights {moved} holds another file "
        f"(SHA-256 {digests[0]}… → {digests[1]}…)."
    )
    assert snapshot(run) == before


def test_setting_changes_tells_the_changes_a_resume_may_make_from_the_others() -> None:
    recorded = {
        "trainer": {"devices": "auto", "max_epochs": 1},
        "model": {"class_path": "coretune.pretrain.SimCLR", "init_args": {"lr": 0.1, "crop": [1, 2]}},
        "objective": {"class_path": "coretune.objectives.CETuning"},
        "ckpt_path": None,
    }
    current = {
        "trainer": {"devices": "auto", "max_epochs": 3},
        "model": {"class_path": "coretune.pretrain.module.SimCLR", "init_args": {"lr": 0.2, "crop": (1, 2)}},
        "objective": {"class_path": "coretune.objectives.ce.CETuning", "init_args": {"new_option": 1}},
        "ckpt_path": "RUN/checkpoints/last.ckpt",
    }
    assert setting_changes(recorded, current) == (["trainer.max_epochs 1 → 3"], ["model.lr 0.1 → 0.2"])
    for old, new, resumable in ((1, [3], True), ("0,1", 2, True), ("auto", 1, False), ([0], [0, 1], False)):
        changes = setting_changes({"trainer": {"devices": old}}, {"trainer": {"devices": new}})
        assert changes == (
            ([f"trainer.devices {old} → {new}"], []) if resumable else ([], [f"trainer.devices {old} → {new}"])
        )
    guard = {"class_path": "coretune.engine.ChanceLevelGuard", "init_args": {"patience": 5, "stop": True}}
    relaxed = {"class_path": guard["class_path"], "init_args": {"patience": 20, "stop": False}}
    # one --trainer.callbacks class is recorded as a mapping, a list (+=) under the one key: both may change
    assert setting_changes({"trainer": {"callbacks": guard}}, {"trainer": {"callbacks": relaxed}}) == (
        ["trainer.callbacks.patience 5 → 20", "trainer.callbacks.stop True → False"],
        [],
    )
    assert setting_changes({"trainer": {"callbacks": [guard]}}, {"trainer": {"callbacks": [relaxed]}})[1] == []


def test_a_data_root_that_gained_a_class_is_refused_on_resume(tree: Path, tmp_path: Path) -> None:
    root = copy_tree(tree, tmp_path)
    run = tmp_path / "run"
    main(fit_args(root, run))
    for split in ("train", "val"):
        shutil.copytree(root / split / "eel", root / split / "fox")
    before = snapshot(run)
    assert error(fit_args(root, run)) == (
        f"checkpoint {run / 'checkpoints' / 'last.ckpt'} holds another model than this run builds: classes: 3 → 4 "
        "(added ['fox']). Resume it with the data and settings it was trained with, or start a new run with another "
        "--run_dir"
    )
    assert snapshot(run) == before  # config.yaml too: it is written once the checkpoint is restored


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_a_truncated_last_ckpt_names_the_file_and_offers_best_ckpt(
    tree: Path, finished_run: Path, tmp_path: Path
) -> None:
    run = copy_run(finished_run, tmp_path)
    last, best = run / "checkpoints" / "last.ckpt", run / "checkpoints" / "best.ckpt"
    last.write_bytes(last.read_bytes()[:3000])
    before = snapshot(run)
    message = error(fit_args(tree, run))
    assert message.startswith(f"cannot resume the run in {run}: its checkpoint {last} is truncated or corrupt (")
    assert message.endswith(
        f"Nothing was changed: resume from its best checkpoint (perhaps an earlier epoch) with --ckpt_path {best}, or "
        "start a new run with another --run_dir"
    )
    assert snapshot(run) == before
    main(fit_args(tree, run, f"--ckpt_path={best}"))  # the fix it offers: best.ckpt, the finished run tested again
    assert last.read_bytes() == before[last]
    best.unlink()
    assert error(fit_args(tree, run)).endswith("Nothing was changed: start a new run with another --run_dir")


@pytest.mark.parametrize("where", ["last.ckpt", "--ckpt_path"])
def test_a_pickle_that_runs_code_on_the_resume_path_is_refused(
    tree: Path, finished_run: Path, tmp_path: Path, where: str
) -> None:
    run = copy_run(finished_run, tmp_path)
    ckpt = malicious(tmp_path)
    if where == "last.ckpt":
        shutil.copy(ckpt, run / "checkpoints" / "last.ckpt")
        ckpt, args = run / "checkpoints" / "last.ckpt", fit_args(tree, run)
    else:
        args = fit_args(tree, tmp_path / "new_run", f"--ckpt_path={ckpt}")
    before = snapshot(run)
    assert error(args).startswith(
        f"checkpoint {ckpt} holds Python objects that torch.load(weights_only=True) refuses to unpickle (it stores "
        "posix.system), because unpickling them could run arbitrary code."
    )
    assert not (tmp_path / "pwned").exists()
    assert snapshot(run) == before


# -- configuration --------------------------------------------------------------------------------------------
def test_unknown_objective_lists_the_registered_names(tree: Path, tmp_path: Path) -> None:
    message = error(fit_args(tree, tmp_path / "run", "--objective", "nosuch"))
    assert message == f"unknown objective 'nosuch'; choose one of: {', '.join(sorted(objectives.available()))}"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--model.task=detection"],
            "invalid model settings: task must be one of classification, segmentation, domain_generalization (got "
            "'detection')",
        ),
        (["--objective=core", "--objective.eta=-0.1"], "invalid Core-tuning settings: eta must be >= 0 (got -0.1)"),
        (["--objective=core", "--objective.alpha=-1"], "invalid Core-tuning settings: alpha must be > 0 (got -1.0)"),
        (
            ["--objective=core", "--objective.temperature=-0.07"],
            "invalid Core-tuning settings: temperature must be > 0 (got -0.07)",
        ),
        (
            ["--objective=ce_mix", "--objective.logit_adjustment=-1"],
            "invalid Core-tuning settings: logit_adjustment must be >= 0 (got -1.0; 1: balanced softmax, 0: none)",
        ),
        (
            ["--objective=core", "--objective.miner.lambda_n=1.5"],
            "invalid hard-pair miner settings: lambda_n must lie in [0, 1] (got 1.5)",
        ),
        (
            ["--objective=core", "--objective.lambda_n=-0.2"],  # the old spelling (deprecated), the same check
            "invalid hard-pair miner settings: lambda_n must lie in [0, 1] (got -0.2)",
        ),
        (
            ["--objective=core", "--objective.memory.size=0"],
            "invalid cross-batch memory settings: size must be >= 1 (got 0); an objective without a memory has memory "
            "null",
        ),
        (
            ["--data.image_size=0"],
            "invalid data option(s): image_size must be >= 1 pixel, got 0 — set valid values (--data.<option>)",
        ),
        (["--model.optim.lr=0"], "invalid model settings: optim.lr must be > 0 (got 0.0)"),
        (["--model.optim.lr=-0.01"], "invalid model settings: optim.lr must be > 0 (got -0.01)"),
        (
            ["--model.output_stride=8"],
            "invalid model settings: output_stride is a segmentation setting that task 'classification' ignores (got "
            "8): drop --task.output_stride, or fit with --task segmentation",
        ),
        (
            ["--model.image_labels=multilabel", "--model.output_stride=8"],
            "invalid model settings: output_stride is a segmentation setting that task 'classification' ignores (got "
            "8): drop --task.output_stride, or fit with --task segmentation; image_labels is a segmentation setting "
            "that task 'classification' ignores (got 'multilabel'): drop --task.image_labels, or fit with --task "
            "segmentation",
        ),
        (
            ["--data.mean=[123.675,116.28,103.53]", "--data.std=[58.395,57.12,57.375]"],  # mmpretrain's 0-255 values
            "invalid data option(s): mean must be in [0, 1] and std in (0, 1] (fractions of the [0, 1] pixel range: "
            "divide values on the 0-255 scale by 255, e.g. 123.675 → 0.485), got (123.675, 116.28, 103.53) and "
            "(58.395, 57.12, 57.375) — set valid values (--data.<option>)",
        ),
    ],
)
def test_bad_configuration_values(options: list[str], expected: str, tree: Path, tmp_path: Path) -> None:
    assert error(fit_args(tree, tmp_path / "run", *options)) == expected


def test_segmentation_settings_are_refused_by_every_other_task_and_their_defaults_pass() -> None:
    for task in ("classification", "domain_generalization"):
        with pytest.raises(ValueError, match=rf"output_stride is a segmentation setting that task '{task}' ignores"):
            FineTuner(backbone="resnet18", task=task, task_settings={"output_stride": 8})
        defaults = {"output_stride": 16, "image_labels": "majority"}
        assert FineTuner(backbone="resnet18", task=task, task_settings=defaults).task.settings == {}
    settings = {"output_stride": 8, "image_labels": "multilabel"}
    model = FineTuner(backbone="resnet18", task="segmentation", task_settings=settings)
    assert (model.task.output_stride, model.task.image_labels) == (8, "multilabel")
    assert FineTuner(backbone="resnet18", task="segmentation").task.settings == defaults
    expected = (
        "invalid model settings: outputstride is not a setting of task 'segmentation' (its settings: output_stride, "
        "image_labels); output_stride must be 16 or 8 (got 4)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        FineTuner(backbone="resnet18", task="segmentation", task_settings={"output_stride": 4, "outputstride": 8})


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            ["--trainer.accumulate_grad_batches=0"],
            "--trainer.accumulate_grad_batches must be a whole number >= 1 (got 0): the number of batches whose "
            "gradients one optimiser step sums (1: step after every batch)",
        ),
        (
            ["--trainer.accelerator=gpu"],
            "--trainer.accelerator gpu is not available on this machine (available: cpu): pass "
            "--trainer.accelerator auto to use the best one there is",
        ),
        (
            ["--trainer.accelerator=mps"],
            "--trainer.accelerator mps is not available on this machine (available: cpu): pass "
            "--trainer.accelerator auto to use the best one there is",
        ),
        (
            ["--trainer.sync_batchnorm=true", "--trainer.accumulate_grad_batches=-2"],
            "--trainer.sync_batchnorm true needs GPUs (torch synchronises batch-norm statistics of CUDA tensors "
            "only): drop it when training on CPU; --trainer.accumulate_grad_batches must be a whole number >= 1 (got "
            "-2): the number of batches whose gradients one optimiser step sums (1: step after every batch)",
        ),
        (
            ["--trainer.devices=0"],
            "invalid trainer settings: `Trainer(devices='0')` value is not a valid input using cpu accelerator.",
        ),
    ],
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the messages name a machine without GPUs")
def test_trainer_options_this_machine_cannot_run_are_one_line(
    options: list[str], expected: str, tree: Path, tmp_path: Path
) -> None:
    """Were a ZeroDivisionError (accumulating over 0 batches) and Lightning's MisconfigurationException."""
    assert error(fit_args(tree, tmp_path / "run", *options)) == expected
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file()]  # nothing written


@pytest.mark.parametrize(
    ("option", "split", "batches", "least"),
    [("limit_train_batches=0.2", "training", 4, 0.25), ("limit_val_batches=0.4", "validation", 2, 0.5),
     ("limit_test_batches=0.3", "test", 2, 0.5)],
)  # fmt: skip
def test_a_batch_fraction_that_keeps_no_batch_is_refused_at_the_start(
    option: str, split: str, batches: int, least: float, tree: Path, tmp_path: Path
) -> None:
    """Was Lightning's MisconfigurationException traceback when the split's loop started: the test split's after
    the whole training. 36 training images in batches of 8 (4, the last incomplete one dropped); 12 validation
    images (the validation and the test split) in 2 batches."""
    name = option.partition("=")[0]
    assert error(fit_args(tree, tmp_path / "run", f"--trainer.{option}")) == (
        f"--trainer.{option} keeps no batch of the {split} split ({option.partition('=')[2]} × {batches} batch(es) "
        f"< 1): pass at least {least}, a whole number of batches (--trainer.{name}=1), or 1.0 for all of them"
    )
    assert not (tmp_path / "run").exists()  # refused before the first step
    main(fit_args(tree, tmp_path / "run", f"--trainer.{name}={least}"))  # the fraction it names keeps one batch
    assert (tmp_path / "run" / "results.json").is_file()


@pytest.mark.filterwarnings("ignore:`ModelCheckpoint\\(monitor='val/top1'\\)` could not find")  # nothing validates
def test_a_run_whose_training_accuracy_collapses_to_chance_fails(tree: Path, tmp_path: Path) -> None:
    # Forced collapse: a dead, frozen backbone gives every image the same features, so the classifier can only
    # learn the class prior. Validation (whose identical-logits check would fire first) is off; the training
    # accuracy stays at chance for 6 epochs (54 steps) and the run must not end looking like a success.
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data", classes=("a", "b", "c"), per_class=6, val_per_class=2, size=16)
    weights = dead_backbone(tmp_path / "dead.pth")
    args = ["fit", f"--data.root={root}", "--model.backbone=small_cnn", f"--model.weights={weights}",
            "--model.freeze_backbone=true", "--data.image_size=16", "--data.batch_size=2", "--trainer.max_epochs=6",
            "--trainer.limit_val_batches=0", f"--run_dir={tmp_path / 'run'}", *QUIET]  # fmt: skip
    message = error(args)
    assert re.fullmatch(
        r"the training top-1 is \d+\.\d% at epoch 6, step 54: chance level \(a model that learned nothing scores "
        r"33\.3% on these labels\), at the end of training: the run collapsed or is not learning, and its training "
        r"loss never fell below that of guessing the class frequencies \(cross-entropy 1\.1\): check that the "
        r"training images hold signal \(not blank or all alike\) and that their labels match them, and the "
        r"pre-trained weights; if they do, clip the gradients \(--trainer\.gradient_clip_val 1\.0\) or lower the "
        r"learning rate \(--model\.optim\.lr\); "
        r"docs/results\.md, section 7\. If it learns slowly on purpose, give it more time with a guard of your own: "
        r"--trainer\.callbacks\+=coretune\.engine\.ChanceLevelGuard --trainer\.callbacks\.min_fraction 0\.5 \(or "
        r"--trainer\.callbacks\.stop false to only warn\)",
        message,
    ), message
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["collapsed"].startswith("the training top-1 is ") and "test" not in results
    assert results["diverged"] == message  # every NonFiniteLossError is recorded, a collapse to chance too


def collapsing_fit(tmp_path: Path, *extra: str) -> list[str]:
    """``coretune fit`` arguments of 6 epochs (9 steps each) whose training accuracy stays at chance: a dead, frozen
    backbone on 3 classes (``test_a_run_whose_training_accuracy_collapses_to_chance_fails``)."""
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data", classes=("a", "b", "c"), per_class=6, val_per_class=2, size=16)
    weights = dead_backbone(tmp_path / "dead.pth")
    return ["fit", f"--data.root={root}", "--model.backbone=small_cnn", f"--model.weights={weights}",
            "--model.freeze_backbone=true", "--data.image_size=16", "--data.batch_size=2", "--trainer.max_epochs=6",
            "--trainer.limit_val_batches=0", f"--run_dir={tmp_path / 'run'}", *QUIET, *extra]  # fmt: skip


OWN_GUARD = "--trainer.callbacks+=coretune.engine.ChanceLevelGuard"


def test_a_guard_passed_in_trainer_callbacks_replaces_the_default_one(tmp_path: Path) -> None:
    """The guard's thresholds are the user's: judged from epoch 2 (min_steps 0, min_fraction 0), 2 epochs at chance
    stop the run at epoch 3 (the default guard would stop it at the end of epoch 6)."""
    own = [OWN_GUARD, "--trainer.callbacks.min_steps=0", "--trainer.callbacks.min_fraction=0",
           "--trainer.callbacks.patience=2"]  # fmt: skip
    with pytest.warns(UserWarning, match=r"at epoch 2, step 18: chance level"):  # the first epoch judged
        message = error(collapsing_fit(tmp_path, *own))
    assert message.startswith("the training top-1 is "), message
    assert " at epoch 3, step 27: chance level " in message and ", for 2 epochs: " in message, message
    assert json.loads((tmp_path / "run" / "results.json").read_text())["collapsed"] in message
    # in the default guard's place, after the run's outputs: the epoch that stopped the run is in metrics.csv
    assert [row["epoch"] for row in read_metrics(tmp_path / "run" / "metrics.csv")] == ["0", "1", "2"]


def test_the_last_of_two_guards_is_the_one(tmp_path: Path) -> None:
    """A run directory's config.yaml that records a guard, and the user's += of another: the last one given wins
    (never two guards, the stricter of which would stop the run)."""
    strict = [OWN_GUARD, "--trainer.callbacks.min_steps=0", "--trainer.callbacks.min_fraction=0",
              "--trainer.callbacks.patience=2"]  # fmt: skip
    with pytest.warns(UserWarning, match=r"at epoch 6, step 54: chance level .*section 7$"):
        message = error(collapsing_fit(tmp_path, *strict, OWN_GUARD, "--trainer.callbacks.stop=false"))
    assert message.startswith("the model collapsed at epoch 6, step 54"), message  # the test's check, not a guard's


def test_a_guard_told_not_to_stop_only_warns(tmp_path: Path) -> None:
    """``stop false``: the guard warns and the run trains to its end (the default guard, which would stop it at
    epoch 6, is gone). This dead model is then caught by the test's own check (identical logits), which is still
    there."""
    with pytest.warns(UserWarning, match=r"the training top-1 is .* at epoch 6, step 54: chance level"):
        message = error(collapsing_fit(tmp_path, OWN_GUARD, "--trainer.callbacks.stop=false"))
    assert message.startswith("the model collapsed at epoch 6, step 54: all 6 test images get the same logits"), message
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert "collapsed" not in results and results["diverged"] == message
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()  # all 6 epochs trained


def test_make_trainer_keeps_one_chance_guard(tmp_path: Path) -> None:
    """The Python API: the caller's guard replaces the default one; without one, the default is there."""
    from coretune.engine import ChanceLevelGuard, make_trainer

    own = ChanceLevelGuard(patience=2, stop=False)
    guards = [c for c in make_trainer(tmp_path, callbacks=[own]).callbacks if isinstance(c, ChanceLevelGuard)]
    assert guards == [own]
    default = [c for c in make_trainer(tmp_path).callbacks if isinstance(c, ChanceLevelGuard)]
    assert len(default) == 1 and default[0].stop and default[0].patience == 5


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("--trainer.callbacks.patience=0", "patience must be a whole number >= 1 (got 0)"),
        ("--trainer.callbacks.min_fraction=1.5", "min_fraction must be a number in [0, 1] (got 1.5)"),
        ("--trainer.callbacks.min_steps=-1", "min_steps must be a whole number >= 0 (got -1)"),
    ],
)
def test_a_guard_with_a_bad_value_is_one_clear_error(tmp_path: Path, option: str, said: str) -> None:
    message = error(collapsing_fit(tmp_path, OWN_GUARD, option))
    assert message == f"ChanceLevelGuard: {said}"
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"patience": True}, "patience must be a whole number >= 1 (got True)"),
        ({"min_steps": 2.5}, "min_steps must be a whole number >= 0 (got 2.5)"),
        ({"min_fraction": "half"}, "min_fraction must be a number in [0, 1] (got 'half')"),
        ({"stop": "no"}, "stop must be true or false (got 'no')"),
    ],
)
def test_a_guard_made_in_python_with_a_bad_value_says_which(settings: dict[str, Any], said: str) -> None:
    from coretune.engine import ChanceLevelGuard

    with pytest.raises(ValueError, match=re.escape(f"ChanceLevelGuard: {said}")):
        ChanceLevelGuard(**settings)
    assert ChanceLevelGuard(patience=np.int64(3)).patience == 3  # any whole number, numpy's too


@pytest.mark.parametrize(
    ("top1", "mean_ce", "verdict"),
    [
        (0.060, None, "chance level"),  # within 3σ of 5% on 1,840 images (bound 6.5%)
        (0.078, 2.90, "no better than chance"),  # the issue's top-1, above 3σ; a CE assumed (the issue gives none)
        (0.078, 2.80, None),  # clearly better than guessing the class frequencies: a slow start, not a collapse
        (0.120, 3.00, None),  # more than twice chance: learning, if badly
        (0.078, None, None),  # no logits (a task that returns none): the 3σ rule alone
    ],
)
def test_chance_verdict_catches_the_issues_imagenet20_collapse(
    top1: float, mean_ce: float | None, verdict: str | None
) -> None:
    """Issue 41, part 3: Core-tuning at lr 0.1 on 20 classes sat at 7.8% training top-1 — above the 3σ bound of
    the ~1,850 images an epoch of 10% of ImageNet20 trains on, so the top-1 rule alone let it end as a success."""
    from coretune.engine.callbacks import chance_verdict

    said = chance_verdict(top1, torch.full((20,), 92), mean_ce)
    assert (said is None) if verdict is None else (said is not None and said.startswith(verdict)), said
    if verdict == "no better than chance":
        assert said.endswith("2.9 is at least 95% of that of guessing the class frequencies (3), and a model that "
                             "learned nothing scores 5.0% on these labels")  # fmt: skip


@pytest.mark.parametrize(
    ("top1", "mean_ce", "collapsed"),
    [  # docs/benchmarks.md, "Why Core-tuning collapses at lr 0.1": train top-1 and CE of the last 20 of 60 steps
        (0.115, 2.28, True),  # core: collapsed
        (0.135, 2.22, True),  # core_fp32: collapsed
        (0.105, 2.32, True),  # ce_mix: collapsed
        (0.152, 2.31, True),  # core_warmup: collapsed
        (0.219, 2.38, False),  # ce: damaged, but learning
        (0.330, 2.06, False),  # core_clip
        (0.319, 2.19, False),  # core_lr001
    ],
)
def test_chance_verdict_on_the_measured_lr_01_runs(top1: float, mean_ce: float, collapsed: bool) -> None:
    """CIFAR-10 at 10% of the labels: an epoch of 4,864 images over 10 classes (3σ bound 11.4%)."""
    from coretune.engine.callbacks import chance_verdict

    counts = torch.tensor([480, 490, 486, 500, 470, 495, 488, 485, 490, 480])
    assert (chance_verdict(top1, counts, mean_ce) is not None) == collapsed


def test_chance_verdict_with_unbalanced_labels() -> None:
    """The floor is the largest class's share, the entropy below ln K (here H = 1.2275)."""
    from coretune.engine.callbacks import chance_verdict

    skewed = torch.tensor([600, 100, 100, 100, 100, 0])  # an absent class counts in K, not in H
    assert chance_verdict(0.62, skewed, None) is not None and chance_verdict(0.70, skewed, None) is None
    assert chance_verdict(0.70, skewed, 1.17) is not None and chance_verdict(0.70, skewed, 1.16) is None
    assert chance_verdict(0.85, skewed, 5.0) is None  # past halfway from the floor (60%) to 100%: learning


def test_the_guard_reads_the_classifiers_cross_entropy_from_the_training_steps(tree: Path, tmp_path: Path) -> None:
    """The logits training_step returns reach the guard: its epoch mean is the logged train/ce of CE-tuning."""
    import lightning as L

    from coretune.data import ImageClassificationData
    from coretune.engine import ChanceLevelGuard

    guard = ChanceLevelGuard(tmp_path / "run")
    model = FineTuner(objectives.create("ce"), backbone="small_cnn")
    trainer = L.Trainer(
        default_root_dir=tmp_path / "run", max_epochs=1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[guard],
    )  # fmt: skip
    trainer.fit(model, datamodule=ImageClassificationData(root=str(tree), image_size=16, batch_size=8))
    assert guard._ce_rows == int(guard._counts.sum()) > 0
    assert guard._ce_sum / guard._ce_rows == pytest.approx(float(trainer.callback_metrics["train/ce"]), rel=1e-4)


def test_under_adversarial_training_the_guard_counts_the_rows_train_top1_scores(tree: Path, tmp_path: Path) -> None:
    """Clean + adversarial rows (2B a batch): the labels the chance floor's 3σ bound counts are the rows train/top1
    and the mean cross-entropy cover (it counted the B clean labels: a bound √2 too wide)."""
    import lightning as L

    from coretune.data import ImageClassificationData
    from coretune.engine import ChanceLevelGuard
    from coretune.robust.training import AdversarialTraining

    guard = ChanceLevelGuard(tmp_path / "run")
    adversarial = AdversarialTraining(enable=True, steps=1)
    model = FineTuner(objectives.create("ce"), backbone="small_cnn", adversarial=adversarial)
    trainer = L.Trainer(
        default_root_dir=tmp_path / "run", max_epochs=1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[guard],
    )  # fmt: skip
    data = ImageClassificationData(root=str(tree), image_size=16, batch_size=8)
    trainer.fit(model, datamodule=data)
    assert guard._ce_rows == int(guard._counts.sum()) == 2 * 8 * trainer.global_step  # full batches of 8


@pytest.mark.parametrize(("min_fraction", "first"), [(0.1, 2), (0.5, 3)])
def test_chance_level_warns_once_then_stops_after_patience_epochs(
    tree: Path, tmp_path: Path, min_fraction: float, first: int
) -> None:
    """4 steps an epoch, 6 epochs: checked from the second epoch and, with min_fraction 0.5, from step 12 on (the
    run's first half, ending with epoch 3, is a start, not a collapse)."""
    import lightning as L

    from coretune.data import ImageClassificationData
    from coretune.engine import ChanceLevelGuard

    weights = dead_backbone(tmp_path / "dead.pth")
    model = FineTuner(objectives.create("ce"), backbone="small_cnn", weights=str(weights), freeze_backbone=True)
    data = ImageClassificationData(root=str(tree), image_size=16, batch_size=8)
    trainer = L.Trainer(
        default_root_dir=tmp_path / "run", max_epochs=6, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ChanceLevelGuard(tmp_path / "run", min_steps=0, patience=2, min_fraction=min_fraction)],
    )  # fmt: skip
    warned = rf"the training top-1 is \d+\.\d% at epoch {first}, step {4 * first}: chance level"
    stopped = rf"at epoch {first + 1}, step {4 * first + 4}: chance level .*, for 2 epochs: the run collapsed"
    with pytest.warns(UserWarning, match=warned) as seen, pytest.raises(NonFiniteLossError, match=stopped):
        trainer.fit(model, datamodule=data)
    assert sum("chance level" in str(w.message) for w in seen) == 1  # warned once, at the first epoch at chance
    assert f"epoch {first + 1}" in json.loads((tmp_path / "run" / "results.json").read_text())["collapsed"]


def test_a_collapse_the_guard_cannot_record_still_raises_the_collapse(tree: Path, tmp_path: Path) -> None:
    # an OSError from the record (a full disk) would have replaced the collapse on rank 0 alone, leaving the other
    # DDP processes, which raise the collapse, waiting for it at RunArtifacts' barrier
    import lightning as L

    from coretune.data import ImageClassificationData
    from coretune.engine import ChanceLevelGuard

    weights = dead_backbone(tmp_path / "dead.pth")
    model = FineTuner(objectives.create("ce"), backbone="small_cnn", weights=str(weights), freeze_backbone=True)
    (tmp_path / "run" / "results.json").mkdir(parents=True)  # unwritable as a file
    trainer = L.Trainer(
        default_root_dir=tmp_path / "run", max_epochs=3, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ChanceLevelGuard(tmp_path / "run", min_steps=0, patience=1, min_fraction=0)],
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"the run collapsed .* \(not recorded in results\.json: \[Errno"):
        trainer.fit(model, datamodule=ImageClassificationData(root=str(tree), image_size=16, batch_size=8))


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        (["--objective.memory.size=32"], True),  # 36 training images in batches of 8: an epoch trains 32 rows
        (["--objective.memory.size=31"], False),
        (["--objective.memory.size=32", "--adversarial.enable=true", "--adversarial.steps=1"], False),  # 64 rows
    ],
    ids=["an-epoch", "less", "adversarial-rows-double-an-epoch"],
)
def test_a_memory_that_holds_an_epoch_is_warned_about(
    tree: Path, tmp_path: Path, extra: list[str], warned: bool
) -> None:
    """Issue 40: with a memory of an epoch's rows, half the anchors or more meet their own earlier feature."""
    args = fit_args(tree, tmp_path / "run", "--objective=core", *extra, "--objective.memory.warmup_steps=0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        main(args)
    messages = [str(w.message) for w in seen if "cross-batch memory's size" in str(w.message)]
    expected = (
        "the cross-batch memory's size 32 holds an epoch's 32 training rows or more: half the anchors or more meet "
        "their own earlier feature in the memory (an easy positive; all of them from 64 rows). Half an epoch, "
        "--objective.memory.size 16, keeps it to about one anchor in eight"
    )
    assert messages == ([expected] if warned else [])


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--model.optim.optimizer=adam", "--model.optim.momentum=0.5"],
            "--model.optim.momentum has no effect with --model.optim.optimizer adam (they are SGD's): use "
            "--model.optim.optimizer sgd, or drop it",
        ),
        (
            ["--model.optim.optimizer=adamw", "--model.optim.nesterov=true"],
            "--model.optim.nesterov has no effect with --model.optim.optimizer adamw (they are SGD's): use "
            "--model.optim.optimizer sgd, or drop it",
        ),
        (
            ["--model.freeze_backbone=true", "--model.optim.backbone_lr=0.1"],
            "--model.optim.backbone_lr has no effect with --model.freeze_backbone true (the backbone does not train): "
            "drop it, or let the backbone train",
        ),
        (
            ["--model.weights_options.format=moco", "--model.weights_options.allow_cast=true"],
            "--model.weights_options.format, --model.weights_options.allow_cast have no effect without --model.weights "
            "(a random initialisation reads no file): pass the pre-trained weights with --model.weights, or drop them",
        ),
    ],
    ids=["momentum-adam", "nesterov-adamw", "backbone_lr-frozen", "weights-options-without-weights"],
)
def test_an_option_that_acts_only_behind_a_switch_is_refused_without_it(
    tree: Path, tmp_path: Path, extra: list[str], expected: str
) -> None:
    """Given without the option they depend on, these changed nothing and the run trained as if they were not there
    (issue 60, principle 6); coretune bench's check of a run's arguments refuses them alike."""
    from coretune.engine import FitArgsError, resolved_fit_config

    run = tmp_path / "run"
    assert error(fit_args(tree, run, *extra)) == expected
    assert not run.exists() or not list(run.iterdir())
    with pytest.raises(FitArgsError) as info:
        resolved_fit_config(fit_args(tree, run, *extra)[1:])
    assert str(info.value) == expected
