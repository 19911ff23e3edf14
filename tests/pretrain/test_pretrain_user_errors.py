"""`coretune pretrain` with bad inputs and interruptions: one clear line each (docs/reliability.md, Pre-training)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from coretune.cli import main
from coretune.engine import read_metrics
from coretune.pretrain import PRETRAINED_FILENAME
from coretune.runs.claim import claim_run, point_claim
from fit_flags import pretrain_args
from image_trees import make_image_folder

IMAGES = lambda tmp: make_image_folder(tmp / "data")  # noqa: E731 — a parametrize entry like the lambdas below


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("pretrain") / "images")


def _one_image(root: Path) -> Path:
    (root / "a").mkdir(parents=True)
    Image.new("RGB", (32, 32)).save(root / "a" / "x.png")
    return root


def _corrupt(root: Path) -> Path:
    make_image_folder(root)
    (root / "a" / "1.png").write_bytes(b"not a png")
    return root


def _fit_root(root: Path, *held_out: str) -> Path:
    """``root/{train,<held_out>…}/{a,b}/*.png``: a root laid out for ``coretune fit``."""
    for split in ("train", *held_out):
        make_image_folder(root / split, n=2)
    return root


@pytest.mark.parametrize(
    ("make_root", "extra", "message"),
    [
        (lambda t: t / "missing", [], r"image folder .*missing does not exist: pass an existing folder$"),
        (lambda t: (t / "empty").mkdir() or t / "empty", [], r"empty contains no image files \(.*point it at a folder"),
        (lambda t: _one_image(t / "one"), [], r"one holds a single image: contrastive pre-training needs at least 2$"),
        (lambda t: _corrupt(t / "bad"), [], r"cannot decode image .*1\.png.* pass --data\.on_bad_image skip$"),
        (lambda t: _fit_root(t / "fit", "test"), [], r"^coretune pretrain: error: \S+/fit holds train/ beside "
         r"test/ \(the layout coretune fit takes\): pre-training reads every image under it, so it would learn from "
         r"the test/ images a fine-tuning is scored on; pass --data\.root \S+/fit/train$"),
        (lambda t: _fit_root(t / "fit", "val", "test"), [], r"/fit holds train/ beside val/ and test/ .* learn from "
         r"the val/ and test/ images a fine-tuning is scored on; pass --data\.root \S+/fit/train$"),
        (IMAGES, ["--data.batch_size=1"], r"batch_size must be >= 2 for contrastive pre-training \(got 1\)$"),
        (IMAGES, ["--data.crop_scale=[0.9,0.2]"], r"invalid augmentation settings: crop_scale must satisfy .*"),
        (IMAGES, ["--data.std=[0,1,1]"], r"invalid augmentation settings: std values must be > 0, got \(0\.0, 1\.0, "
         r"1\.0\) — set valid values \(--data\.<option>\)$"),
        (IMAGES, ["--data.mean=[123.675,116.28,103.53]", "--data.std=[58.395,57.12,57.375]"],
         r"invalid augmentation settings: mean must be in \[0, 1\] and std in \(0, 1\] \(fractions of the \[0, 1\] "
         r"pixel range: divide values on the 0-255 scale by 255, e\.g\. 123\.675 → 0\.485\), got \(123\.675, 116\.28, "
         r"103\.53\) and \(58\.395, 57\.12, 57\.375\) — set valid values \(--data\.<option>\)$"),
        (IMAGES, ["--method", "byol"], r"unknown pre-training method 'byol': choose one of simclr, moco_v2, moco_v3$"),
        (IMAGES, ["--model.temperature=0"], r"^coretune pretrain: error: invalid simclr settings: temperature must"),
        (IMAGES, ["--model.weights=nope.pth"], r"error: checkpoint nope\.pth does not exist: check the path given as"),
        (IMAGES, ["--model.backbone=resnet999"], r"error: unknown backbone 'resnet999': choose one of .*timm"),
        (IMAGES, ["--method=moco_v2", "--model.queue_size=64"], r"queue_size 64 exceeds the 12 training images"),
        (IMAGES, ["--method=moco_v2", "--model.queue_size=8", "--data.batch_size=8"], r"error: MoCo's --model\."
         r"bn_splits 8 cuts each batch of 8 images \(--data\.batch_size 8\) into sub-batches of fewer than 2 images "
         r"for the key encoder, whose batch-norm statistics are then meaningless \(Shuffle BN needs 2 or more per "
         r"sub-batch\): pass --model\.bn_splits 4 or fewer \(1: no Shuffle BN\)$"),
        (lambda t: make_image_folder(t / "data", n=16), ["--method=moco_v2", "--model.queue_size=8"],
         r"bn_splits 8 cuts each batch of 4 images \(--data\.batch_size 4\) .*: pass --data\.batch_size 16 or more, "
         r"or --model\.bn_splits 2 or fewer \(1: no Shuffle BN\)$"),
        (IMAGES, ["--method=moco_v2", "--model.queue_size=8", "--data.batch_size=32", "--model.bn_splits=7"],
         r"bn_splits 7 cuts each batch of 12 images \(all 12 images: --data\.batch_size 32 exceeds them\) .*: pass "
         r"--model\.bn_splits 6 or fewer \(1: no Shuffle BN\)$"),
        (IMAGES, ["--snapshot_epochs=[1,3]"], r"--snapshot_epochs \[1, 3\]: \[3\] never end in this run; give epoch "
         r"counts from 1 to --trainer.max_epochs \(1\)$"),
        (IMAGES, ["--method=moco_v2", "--model.queue_size=8", "--model.bn_splits=2", "--trainer.precision=bf16-true"],
         r"MoCo's key encoder moves by \(1 − key_momentum\) of its distance to the query encoder each step, which "
         r"--trainer\.precision bf16-true \(half-precision weights\) rounds away: use bf16-mixed or 16-mixed"),
    ],
    ids=[
        "missing-folder", "empty-folder", "one-image", "corrupt-image", "fit-root-with-test",
        "fit-root-with-val-and-test", "batch-of-1", "bad-augmentation", "std-0", "mean-std-0-255", "unknown-method",
        "bad-temperature", "missing-init-weights", "unknown-backbone", "queue-too-long", "bn-splits-of-one-image",
        "bn-splits-beyond-the-batch", "bn-splits-beyond-all-images", "snapshot-beyond-the-run", "moco-half-weights",
    ],
)  # fmt: skip
def test_user_errors_are_one_line(make_root: object, extra: list[str], message: str, tmp_path: Path) -> None:
    root = make_root(tmp_path)  # type: ignore[operator]
    with pytest.raises(SystemExit) as stop:
        main(pretrain_args(root, tmp_path / "run", *extra))
    text = str(stop.value.code)
    assert text.startswith("coretune pretrain: error: ") and "\n" not in text, text
    assert re.search(message, text), text


def test_a_distributed_batch_larger_than_the_images_is_refused(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 processes × batch 8 > 12 images: the sampler would pad the order with repeats, each image among its own
    # negatives (one process takes one batch of all 12 instead)
    import coretune.pretrain.module as pretrain_module

    monkeypatch.setattr(pretrain_module, "world_size", lambda: 2)
    with pytest.raises(SystemExit) as stop:
        main(pretrain_args(images, tmp_path / "run", "--data.batch_size=8"))
    assert str(stop.value.code) == (
        "coretune pretrain: error: 12 training images fill less than one global batch of 2 processes × "
        "--data.batch_size 8, so batches would repeat images, each image's views then among its own negatives: pass "
        "--data.batch_size 6 or less"
    )


def test_moco_follows_the_query_encoder_once_per_optimiser_step(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``accumulate_grad_batches 2`` the query encoder changes every second batch: the key encoder's momentum
    update follows each optimiser step once (it followed every batch: momentum 0.99² per step)."""
    from coretune.pretrain import MoCoV2, PretrainData, make_pretrain_trainer

    updates = []
    model = MoCoV2(backbone="small_cnn", proj_dim=16, queue_size=8, bn_splits=2)
    update = model._momentum_update
    monkeypatch.setattr(model, "_momentum_update", lambda: updates.append(model.global_step) or update())
    trainer = make_pretrain_trainer(
        tmp_path / "run", max_epochs=2, accumulate_grad_batches=2, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=PretrainData(str(images), image_size=16, batch_size=4))  # 3 batches an epoch
    assert updates == list(range(trainer.global_step)) and trainer.global_step == 4


def test_a_run_directory_another_process_is_running_is_refused(
    images: Path, tmp_path: Path, other_process: subprocess.Popen
) -> None:
    (tmp_path / "run").mkdir()
    claim_run(tmp_path / "run")
    point_claim(tmp_path / "run", other_process.pid)
    with pytest.raises(SystemExit) as stop:
        main(pretrain_args(images, tmp_path / "run"))
    assert str(stop.value.code).startswith(
        f"coretune pretrain: error: {tmp_path / 'run'} is being run by another process (pid {other_process.pid})"
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["fit.pid"]  # nothing written


def test_corrupt_images_can_be_skipped(tmp_path: Path) -> None:
    root = _corrupt(tmp_path / "bad")
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable image file\(s\) of 12"):
        main(pretrain_args(root, tmp_path / "run", "--data.on_bad_image=skip"))
    assert (tmp_path / "run" / PRETRAINED_FILENAME).is_file()


def test_non_finite_loss_stops_with_the_step(images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import coretune.pretrain.module as module

    monkeypatch.setattr(module, "global_nt_xent", lambda z1, z2, t: (z1.sum() + z2.sum()) * float("nan"))
    with pytest.raises(SystemExit, match=r"^coretune pretrain: error: .*(NaN|nan).* epoch 0, step 0") as error:
        main(pretrain_args(images, tmp_path / "run"))
    recorded = json.loads((tmp_path / "run" / "results.json").read_text())["diverged"]  # kept, even at step 0
    assert str(error.value.code).endswith(recorded)


def test_ctrl_c_saves_a_resumable_checkpoint_and_the_rerun_continues(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    args = pretrain_args(images, run, "--trainer.max_epochs=2")
    stop_at = ["--trainer.callbacks+=signal_helper.SendSignal", f"--trainer.callbacks.signum={int(signal.SIGINT)}"]
    with pytest.raises(SystemExit) as stop:
        main([*args, *stop_at, "--trainer.callbacks.step=4"])  # epoch 1, after its first batch
    assert stop.value.code == 128 + signal.SIGINT
    ckpt = run / "checkpoints" / "last.ckpt"
    assert f"stopped by SIGINT at epoch 1, step 4; saved a resumable checkpoint to {ckpt}" in capsys.readouterr().err
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4
    main(args)  # the same command: resumes from checkpoints/last.ckpt
    assert torch.load(run / PRETRAINED_FILENAME, weights_only=True)["epoch"] == 2
    assert [(r["epoch"], r["step"]) for r in read_metrics(run / "metrics.csv")] == [("0", "3"), ("1", "6")]
