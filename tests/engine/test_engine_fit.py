"""`coretune fit` → test → predict → export round trip, and resume/seed reproducibility, on a tiny tree."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml

import coretune
from coretune.apps.export import load_exported
from coretune.cli import main
from coretune.data import ImageClassificationData, ImageFileDataset, SkippedImagesWarning, eval_transform
from coretune.engine import FineTuner, epoch_summary, make_trainer, read_metrics
from coretune.engine.fitcli import _print_run_summary
from coretune.memory import CrossBatchMemory
from coretune.objectives import create
from fit_flags import QUIET, TINY_FIT, StopAfterEpoch


def fit_args(tree: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "fit",
        f"--data.root={tree}",
        "--data.image_size=32",
        "--data.batch_size=8",
        "--model.backbone=small_cnn",
        "--trainer.max_epochs=2",
        f"--run_dir={run_dir}",
        *QUIET,
        *extra,
    ]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("fit")
    tree = make_image_tree(base / "data")
    run_dir = base / "run"
    main(fit_args(tree, run_dir, "--objective", "core", "--objective.eta", "0.5"))
    return tree, run_dir


def test_fit_writes_a_complete_run_directory(fitted: tuple[Path, Path]) -> None:
    _, run_dir = fitted
    for name in (
        "config.yaml",
        "metrics.csv",
        "results.json",
        "learning_curve.png",
        "checkpoints/best.ckpt",
        "checkpoints/last.ckpt",
    ):
        assert (run_dir / name).is_file(), name
    rows = read_metrics(run_dir / "metrics.csv")
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    for key in (
        "lr",
        "train/ce",
        "train/ce_mix",
        "train/con",
        "train/loss",
        "train/top1",
        "train/top5",
        "val/top1",
        "val/top5",
        "val/loss",
    ):
        assert all(r[key] != "" for r in rows), key
    assert float(rows[0]["lr"]) == pytest.approx(0.01)  # cosine schedule starts at the base lr
    # each epoch's wall time includes its validation, which the training time behind images/s leaves out
    results = json.loads((run_dir / "results.json").read_text())
    epoch_times = [float(r["epoch_time_s"]) for r in rows]
    assert all(t > 0 for t in epoch_times)
    assert results["train_time_s"] - 0.02 <= sum(epoch_times) <= results["wall_time_s"] + 0.02
    results = json.loads((run_dir / "results.json").read_text())
    test = results["test"]
    assert set(test["per_class_accuracy"]) == {"cat", "dog", "eel"}
    assert sum(map(sum, test["confusion_matrix"])) == 12  # every val image counted once
    correct = sum(test["confusion_matrix"][i][i] for i in range(3))
    assert test["top1"] == pytest.approx(correct / 12)
    assert test["top5"] == 1.0  # top-5 with 3 classes is always right
    assert results["train_images_per_s"] > 0 and results["wall_time_s"] > 0
    # the process's CPU seconds: all its threads, so at most the thread count × the wall time (and some slack)
    assert 0 < results["cpu_time_s"] <= torch.get_num_threads() * results["wall_time_s"] + 0.5
    assert results["validated_on_test_images"] is True  # the tree has val/ only: it serves both loaders
    last = (run_dir / "checkpoints" / "last.ckpt").read_bytes()  # the final weights, for Table 8's check
    assert results["last_checkpoint_sha256"] == hashlib.sha256(last).hexdigest()
    made = results["provenance"]  # which code and machine: a record says what made it
    assert made["coretune"] == coretune.__version__ and made["threads"] == torch.get_num_threads()
    assert made["torch"] == torch.__version__ and made["host"] and made["cpu"]
    head = subprocess.run(["git", "-C", str(Path(coretune.__file__).parent), "rev-parse", "HEAD"], capture_output=True,
                          text=True)  # fmt: skip
    assert made["commit"] is None if head.returncode else made["commit"].startswith(head.stdout.strip())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["objective"]["class_path"] == "coretune.objectives.core.CoreTuning"
    assert config["objective"]["init_args"]["eta"] == 0.5


def test_the_run_summary_says_when_best_ckpt_was_chosen_on_the_test_images(
    fitted: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, run_dir = fitted
    _print_run_summary(run_dir)
    note = "validation read the test images"
    assert note in capsys.readouterr().out  # no val_fraction, one held-out folder: best.ckpt is test-chosen
    held_out = tmp_path / "held_out"
    main(fit_args(tree, held_out, "--trainer.max_epochs=1", "--data.val_fraction=0.25", "--data.label_fraction=0.9"))
    assert json.loads((held_out / "results.json").read_text())["validated_on_test_images"] is False
    assert note not in capsys.readouterr().out
    # coretune validate of its checkpoint, without the run's config: the checkpoint's label and validation fractions
    # draw the same held-out split again (only its seed came back, and validate scored the test images)
    main(["validate", f"--ckpt_path={held_out / 'checkpoints' / 'last.ckpt'}", f"--data.root={tree}",
          "--data.image_size=32"])  # fmt: skip
    validated = json.loads((held_out / "val_results.json").read_text())
    assert validated["validated_on_test_images"] is False
    assert (validated["data"]["val_fraction"], validated["data"]["label_fraction"]) == (0.25, 0.9)


def test_checkpoint_rebuilds_the_model(fitted: tuple[Path, Path]) -> None:
    _, run_dir = fitted
    model = FineTuner.from_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert model.class_names == ["cat", "dog", "eel"]
    assert model.objective.hparams()["eta"] == 0.5
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, ckpt["state_dict"][key]), key


def test_epoch_summary_shows_loss_and_top1_of_the_row() -> None:
    row = {"epoch": 4, "step": 3905, "lr": 0.01, "epoch_time_s": 402.0, "train/ce": 1.5, "train/loss": 1.23456}
    row |= {"train/top1": 0.45618, "train/top5": 0.9, "val/loss": "", "val/top1": ""}  # an epoch without validation
    assert epoch_summary(row, 20) == "epoch 5 of 20 (step 3905, 6.7 min): train/loss 1.2346, train/top1 45.62%"
    row = {k: str(v) for k, v in row.items()} | {"val/loss": "0.8123", "val/top1": "0.723"}  # as read from the CSV
    expected = "epoch 5 (step 3905, 6.7 min): train/loss 1.2346, train/top1 45.62%, val/loss 0.8123, val/top1 72.30%"
    assert epoch_summary(row, None) == expected


def test_rerunning_the_command_resumes_its_run_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --ckpt_path, a run directory with checkpoints/last.ckpt is resumed, never restarted and overwritten;
    its provenance names the commit it started from, and every commit its sessions ran."""
    from coretune.engine import callbacks
    from image_trees import make_image_tree

    head = ["1111111"]  # the checkout's HEAD, as each session (and the end of each fit) reads it
    real = callbacks.provenance
    monkeypatch.setattr(callbacks, "provenance", lambda: real() | {"commit": head[0]})
    tree, run = make_image_tree(tmp_path / "data"), tmp_path / "run"
    main(fit_args(tree, run, "--trainer.max_epochs=1"))
    assert "commits" not in (made := json.loads((run / "results.json").read_text())["provenance"])
    assert made["commit"] == "1111111"
    (first,) = read_metrics(run / "metrics.csv")
    head[0] = "2222222"  # a commit lands before the run is resumed
    with caplog.at_level(logging.INFO):
        main(fit_args(tree, run))  # the same command for 2 epochs: continues from epoch 1
    made = json.loads((run / "results.json").read_text())["provenance"]
    assert made["commit"] == "1111111" and made["commits"] == ["1111111", "2222222"]
    assert f"Restored all states from the checkpoint at {run / 'checkpoints' / 'last.ckpt'}" in caplog.text
    assert f"resuming the run in {run} from {run / 'checkpoints' / 'last.ckpt'}" in caplog.text
    rows = read_metrics(run / "metrics.csv")
    assert [int(r["epoch"]) for r in rows] == [0, 1] and rows[0] == first
    # no progress bar: the epoch's line in the log, with the values of its metrics.csv row
    assert epoch_summary(rows[1], 2) in caplog.text and "epoch 1 of 2" not in caplog.text
    assert not [w for w in recwarn if "exists and is not empty" in str(w.message)]

    results = json.loads((run / "results.json").read_text())
    main(fit_args(tree, run))  # a finished run: nothing to train, tested again
    assert read_metrics(run / "metrics.csv") == rows
    assert json.loads((run / "results.json").read_text())["test"] == results["test"]


def test_test_predict_export_round_trip(fitted: tuple[Path, Path], tmp_path: Path) -> None:
    tree, run_dir = fitted
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    main(
        [
            "test",
            f"--ckpt_path={ckpt}",
            f"--data.root={tree}",
            "--data.image_size=32",
            f"--output={tmp_path / 't.json'}",
        ]
    )
    assert "top1" in json.loads((tmp_path / "t.json").read_text())["test"]

    model = FineTuner.from_checkpoint(ckpt).eval()
    files = ImageFileDataset(str(tree / "val"), eval_transform(32))
    images = torch.stack([files[i][0] for i in range(len(files))])
    with torch.no_grad():
        logits = model(images)
    probs = torch.softmax(logits, dim=1)

    out = tmp_path / "preds.csv"
    main(["predict", f"--ckpt_path={ckpt}", f"--input={tree / 'val'}", f"--output={out}"])
    rows = list(csv.DictReader(out.open()))
    assert [r["path"] for r in rows] == files.paths
    assert [r["prediction"] for r in rows] == [model.class_names[i] for i in probs.argmax(1).tolist()]
    assert torch.allclose(
        torch.tensor([[float(r[f"p_{n}"]) for n in model.class_names] for r in rows]), probs, atol=1e-5
    )
    main(["predict", f"--ckpt_path={ckpt}", f"--input={files.paths[1]}", f"--output={out}"])  # one image file
    (row,) = csv.DictReader(out.open())
    assert row["path"] == files.paths[1] and row["prediction"] == rows[1]["prediction"]
    with pytest.raises(SystemExit, match=r"is a folder: coretune predict writes one file there; give its path$"):
        main(["predict", f"--ckpt_path={ckpt}", f"--input={files.paths[1]}", f"--output={tmp_path}"])  # before work

    main(["export", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'export'}", "--format=safetensors,pt2,torchscript"])
    net, config = load_exported(tmp_path / "export")
    assert config["class_names"] == ["cat", "dog", "eel"] and config["image_size"] == 32
    with torch.no_grad():
        assert torch.allclose(net(images), logits, atol=1e-5)
        scripted = torch.jit.load(str(tmp_path / "export" / "model.torchscript.pt"))
        assert torch.allclose(scripted(images), logits, atol=1e-5)
        program = torch.export.load(tmp_path / "export" / "model.pt2").module()
        assert torch.allclose(program(images), logits, atol=1e-5)
        assert torch.allclose(program(images[:1]), logits[:1], atol=1e-5)  # the batch size is dynamic


def test_coretune_test_writes_its_own_results_and_leaves_the_fits(
    fitted: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `coretune test` on other data used to replace the fit's test results in results.json, under its training fields
    from image_trees import make_image_tree

    _, fitted_run = fitted
    run = Path(shutil.copytree(fitted_run, tmp_path / "run"))
    fit_results = (run / "results.json").read_bytes()
    other = make_image_tree(tmp_path / "other", per_class=2, val_per_class=2, seed=1)
    ckpt = run / "checkpoints" / "best.ckpt"
    main(["test", f"--ckpt_path={ckpt}", f"--data.root={other}", "--data.image_size=32"])
    assert capsys.readouterr().out.endswith(f"test results: {run / 'test_results.json'}\n")
    assert (run / "results.json").read_bytes() == fit_results  # bench and the docs read the fit's test there
    written = json.loads((run / "test_results.json").read_text())
    assert written["checkpoint"] == str(ckpt) and written["data"]["root"] == str(other)
    assert sum(map(sum, written["test"]["confusion_matrix"])) == 6  # the other tree's 3 × 2 validation images
    message = (
        f"--output {run / 'results.json'} is the run file results.json of {run}, which coretune test does not write"
    )
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["test", f"--ckpt_path={ckpt}", f"--data.root={other}", f"--output={run / 'results.json'}"])
    assert (run / "results.json").read_bytes() == fit_results


def test_a_fit_with_test_false_records_no_test_and_its_checkpoint_is_scored_by_coretune_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--test false`` (coretune compare's runs): the fit ends after training, results.json says the test was not
    run, the run counts as finished for sweeps, and ``coretune test`` scores its final checkpoint afterwards."""
    from coretune.engine.fitcli import TEST_SKIPPED
    from coretune.runs.layout import RunDir
    from coretune.sweeps.records import run_top1
    from image_trees import make_image_tree

    tree, run = make_image_tree(tmp_path / "data", per_class=4, val_per_class=2), tmp_path / "run"
    main(fit_args(tree, run, "--trainer.max_epochs=1", "--test=false"))
    assert "test split not scored (--test false): coretune test --ckpt_path" in capsys.readouterr().out
    results = json.loads((run / "results.json").read_text())
    assert results["test"] is None and results["test_skipped"] == TEST_SKIPPED and results["epochs"] == 1
    assert RunDir(run).is_finished() and RunDir(run).test_skipped() == TEST_SKIPPED
    assert run_top1(run, "test") is None  # no test score: a missing value, never read from elsewhere
    assert yaml.safe_load((run / "config.yaml").read_text())["test"] is False
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--config={run / 'config.yaml'}"])
    assert 0 <= json.loads((run / "test_results.json").read_text())["test"]["top1"] <= 1
    main(fit_args(tree, run, "--trainer.max_epochs=1"))  # the same run, now tested: its finished fit scored once
    results = json.loads((run / "results.json").read_text())
    assert "test_skipped" not in results and 0 <= results["test"]["top1"] <= 1 and results["epochs"] == 1


def test_coretune_test_and_validate_score_one_labelled_folder_without_training_data(
    fitted: tuple[Path, Path], tmp_path: Path
) -> None:
    """A new labelled set as class folders, with no train/ beside it: it used to be refused ("no training data
    given", "has no train/ folder")."""
    from image_trees import make_image_tree

    _, fitted_run = fitted
    run = Path(shutil.copytree(fitted_run, tmp_path / "run"))
    ckpt = run / "checkpoints" / "best.ckpt"
    other = make_image_tree(tmp_path / "other", per_class=2, val_per_class=2, seed=1)
    shutil.rmtree(other / "train")  # other/val/<class>/*: 3 × 2 images
    for option in (f"--data.root={other / 'val'}", f"--data.test_dir={other / 'val'}", f"--data.root={other}"):
        (run / "test_results.json").unlink(missing_ok=True)
        main(["test", f"--ckpt_path={ckpt}", option, "--data.image_size=32"])
        written = json.loads((run / "test_results.json").read_text())
        assert written["scored_folder"] == str(other / "val"), option
        assert sum(map(sum, written["test"]["confusion_matrix"])) == 6, option
    main(["validate", f"--ckpt_path={ckpt}", f"--data.root={other / 'val'}", "--data.image_size=32"])
    validated = json.loads((run / "val_results.json").read_text())
    assert validated["scored_folder"] == str(other / "val") and validated["validated_on_test_images"] is None
    assert 0 <= validated["validate"]["top1"] <= 1
    # an unreadable file skipped: the folder (the train and the scored split both) is read and checked once
    (other / "val" / "dog" / "broken.png").write_bytes(b"not an image")
    (run / "test_results.json").unlink()
    with pytest.warns(SkippedImagesWarning, match=r"^skipped 1 unreadable image file\(s\) of 7 .*broken\.png"):
        main(["test", f"--ckpt_path={ckpt}", f"--data.root={other / 'val'}", "--data.on_bad_image=skip"])
    assert sum(map(sum, json.loads((run / "test_results.json").read_text())["test"]["confusion_matrix"])) == 6
    (other / "val" / "cat").rename(other / "val" / "ant")  # other classes than the model's: refused as before
    with pytest.raises(SystemExit, match=r"the data's classes .* are not those checkpoint"):
        main(["test", f"--ckpt_path={ckpt}", f"--data.root={other / 'val'}"])


def _run(
    tree: Path,
    run_dir: Path,
    callbacks: list[L.Callback],
    ckpt_path: str | None = None,
    val_every: int = 1,
    objective: str = "core",
    hparams: dict[str, Any] | None = None,
) -> FineTuner:
    L.seed_everything(3)
    data = ImageClassificationData(root=str(tree), image_size=32, batch_size=8, seed=3)
    model = FineTuner(create(objective, **(hparams or {})), backbone="small_cnn")
    trainer = make_trainer(
        run_dir,
        progress=False,
        max_epochs=3,
        check_val_every_n_epoch=val_every,
        callbacks=callbacks,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model


def _assert_same_state(a: object, b: object, key: str) -> None:
    if isinstance(a, dict):  # an objective's extra state (Bi-tuning's momentum key encoder)
        assert isinstance(b, dict) and set(a) == set(b) and a, key
        for k in a:
            _assert_same_state(a[k], b[k], f"{key}.{k}")
    else:
        assert torch.equal(a, b), key


@pytest.mark.parametrize(
    ("val_every", "objective", "hparams"),
    [
        (1, "core", {}),
        (2, "core", {}),
        (1, "bi_tuning", {}),
        (1, "rifle", {}),
        (1, "core", {"memory": CrossBatchMemory(12, warmup_steps=2)}),
    ],
    ids=[
        "validated-epoch",
        "unvalidated-epoch",
        "bi_tuning-momentum-keys",
        "rifle-reinit-at-the-resumed-epoch",
        "core-cross-batch-memory",
    ],
)
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resuming into it, on purpose
def test_resume_repeats_the_uninterrupted_run(
    image_tree: Path, tmp_path: Path, val_every: int, objective: str, hparams: dict[str, Any]
) -> None:
    """``last.ckpt`` holds the latest epoch even when that epoch ran no validation (check_val_every_n_epoch > 1),
    and the objective's state outside its parameters (Bi-tuning's queues and momentum key encoder, Core-tuning's
    memory and its warm-up count)."""
    kw = {"val_every": val_every, "objective": objective, "hparams": hparams}
    whole = _run(image_tree, tmp_path / "whole", [], **kw)
    _run(image_tree, tmp_path / "cut", [StopAfterEpoch(0)], **kw)
    assert [r["epoch"] for r in read_metrics(tmp_path / "cut" / "metrics.csv")] == ["0"]
    assert torch.load(tmp_path / "cut" / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 0
    if hparams:  # the memory is in use when the run is cut (the resumed run restores it: checked below)
        cut = torch.load(tmp_path / "cut" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        assert int(cut["objective.memory.filled"]) > 0 and int(cut["objective.memory.steps"]) > 2
    resumed = _run(image_tree, tmp_path / "cut", [], ckpt_path="last", **kw)
    for key, value in whole.state_dict().items():
        _assert_same_state(value, resumed.state_dict()[key], key)
    a = read_metrics(tmp_path / "whole" / "metrics.csv")
    b = read_metrics(tmp_path / "cut" / "metrics.csv")
    assert [r["epoch"] for r in b] == ["0", "1", "2"]
    assert [r["train/loss"] for r in a] == [r["train/loss"] for r in b]
    assert [r["val/top1"] for r in a] == [r["val/top1"] for r in b]
    # val/* only on the epochs that validated (Lightning keeps the last values between validations)
    assert [r["val/top1"] != "" for r in a] == [True, True, True] if val_every == 1 else [False, True, False]


#: The first epoch's mean training loss terms of `coretune fit` in float32 (small CNN, the tiny tree, seed 0), pinned
#: at commit f09eabb; commit 99ec041, which made docs/results.md section 3's runs, gives the same. Every draw of a run
#: (label subset, batches, augmentations, mixup weights, pairs) is seeded, so a new use of a random generator, a
#: changed default or seeding moves these: every run's numbers change with them (docs/records/README.md).
FIRST_EPOCH = {
    "ce": {"train/ce": 0.7246658802032471},
    "core": {"train/ce": 0.636803150177002, "train/ce_mix": 0.8659940958023071, "train/con": 2.762336015701294},
}


@pytest.mark.parametrize("objective", sorted(FIRST_EPOCH))
def test_the_first_epochs_losses_are_pinned(objective: str, image_tree: Path, tmp_path: Path) -> None:
    """A seeded fit repeats its first epoch's losses across code changes (to float32 rounding: thread counts)."""
    run_dir = tmp_path / objective
    main([
        "fit", f"--data.root={image_tree}", *TINY_FIT, "--trainer.precision=32-true", "--seed=0",
        "--objective", objective, f"--run_dir={run_dir}", *QUIET,
    ])  # fmt: skip
    row = read_metrics(run_dir / "metrics.csv")[0]
    assert {k: float(row[k]) for k in FIRST_EPOCH[objective]} == pytest.approx(FIRST_EPOCH[objective], rel=1e-5)


def test_bi_tuning_keys_see_a_second_augmented_view(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coretune.objectives import BiTuning

    key_inputs: list[torch.Tensor] = []
    keys = BiTuning.keys
    monkeypatch.setattr(BiTuning, "keys", lambda self, f, inputs: (key_inputs.append(inputs), keys(self, f, inputs))[1])
    model = FineTuner(create("bi_tuning"), backbone="small_cnn")
    queries: list[torch.Tensor] = []
    model.backbone.register_forward_pre_hook(  # deep copies (the key encoder) carry the hook too: skip them
        lambda m, args: queries.append(args[0]) if m is model.backbone and m.training else None
    )
    data = ImageClassificationData(root=str(image_tree), image_size=32, batch_size=8, seed=3)
    trainer = make_trainer(tmp_path, progress=False, max_epochs=1, limit_train_batches=2, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    assert data.train_views == 2 and len(key_inputs) == len(queries) == 2
    for key, query in zip(key_inputs, queries, strict=True):
        assert key.shape == query.shape and not torch.equal(key, query)
    trainer = make_trainer(
        tmp_path / "ce", progress=False, max_epochs=1, limit_train_batches=1, enable_model_summary=False
    )
    trainer.fit(FineTuner(create("ce"), backbone="small_cnn"), datamodule=data)  # the same data module, reused
    assert data.train_views == 1


class _KeepProjector(L.Callback):
    """The projector's parameters when training starts (the key copy starts from them) and after each step."""

    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append([p.detach().clone() for p in pl_module.objective.projector.parameters()])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.seen.append([p.detach().clone() for p in pl_module.objective.projector.parameters()])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_momentum_key_encoder_follows_the_weights_each_optimiser_step_made(
    image_tree: Path, tmp_path: Path, accumulate: int
) -> None:
    # θ_k ← m θ_k + (1 − m) θ_q after each optimiser step, with θ_q the weights that step made (tllib updates at
    # the next forward, before the keys: the same). The update ran in on_before_zero_grad, before backward and
    # step, so it used the previous step's weights and the keys lagged one update.
    m = 0.5
    model = FineTuner(create("bi_tuning", momentum=m), backbone="small_cnn")
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=8, seed=3)
    kept = _KeepProjector()
    trainer = make_trainer(
        tmp_path, progress=False, max_epochs=1, limit_train_batches=2 * accumulate, callbacks=[kept],
        accumulate_grad_batches=accumulate, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    steps = kept.seen[0::accumulate]  # the weights at the start and after each of the 2 optimiser steps
    assert trainer.global_step == 2 and len(steps) == 3
    expected = steps[0]
    for weights in steps[1:]:
        expected = [m * k + (1 - m) * q for k, q in zip(expected, weights, strict=True)]
    key = list(model.objective.key_projector.parameters())
    assert all(torch.allclose(k, e, atol=1e-6) for k, e in zip(key, expected, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(steps[1], steps[2], strict=True))  # the steps moved it


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")  # none needed
def test_a_two_view_objective_needs_a_data_module_that_makes_views(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model = FineTuner(create("bi_tuning"), backbone="small_cnn")
    model.build(3)
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 3, (8,))), batch_size=4)
    trainer = make_trainer(tmp_path, progress=False, max_epochs=1, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"'bi_tuning' needs 2 augmented views .* train_views attribute"):
        trainer.fit(model, train_dataloaders=loader)


@pytest.mark.filterwarnings("ignore:Precision bf16-mixed is not supported by the model summary")
def test_the_model_summary_counts_the_flops_of_one_image_at_the_datas_size(image_tree: Path, tmp_path: Path) -> None:
    from lightning.pytorch.utilities.model_summary import ModelSummary
    from torch.utils.flop_counter import FlopCounterMode

    data = ImageClassificationData(root=str(image_tree), image_size=24, batch_size=8)
    model = FineTuner(create("ce"), backbone="small_cnn")
    trainer = make_trainer(tmp_path, progress=False, max_epochs=1, limit_train_batches=1, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    summary = ModelSummary(model)
    assert summary.in_sizes[summary.layer_names.index("backbone")] == [1, 3, 24, 24]
    with torch.no_grad(), FlopCounterMode(display=False) as reference:
        model.eval()(torch.zeros(1, 3, 24, 24))  # one image through backbone and classifier
    assert summary.total_flops == reference.get_total_flops() > 0


def _step_draws(monkeypatch: pytest.MonkeyPatch, process: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the backbone (as dropout would) and the objective draw from torch's generator in one training step
    of process ``process`` (step 0, seed 0)."""
    import coretune.engine.module as engine_module

    monkeypatch.setattr(engine_module, "rank", lambda: process)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    model = FineTuner(create("ce_mix"), backbone="small_cnn")
    model.build(3)
    draws: dict[str, torch.Tensor] = {}

    def dropout_like(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
        draws.setdefault("backbone", torch.rand(4))

    model.backbone.register_forward_hook(dropout_like)
    forward = model.objective.forward
    model.objective.forward = lambda *a, **k: (draws.setdefault("objective", torch.rand(4)), forward(*a, **k))[1]
    with pytest.warns(UserWarning, match="self.trainer"):  # no Trainer: Lightning skips the logging
        model.training_step((torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])), 0)
    return draws["backbone"], draws["objective"]


def test_processes_share_the_objectives_draws_but_not_the_backbones(monkeypatch: pytest.MonkeyPatch) -> None:
    from coretune.engine.module import step_seed

    backbone0, objective0 = _step_draws(monkeypatch, 0)
    backbone1, objective1 = _step_draws(monkeypatch, 1)
    torch.manual_seed(step_seed(0, 0))
    assert torch.equal(backbone0, torch.rand(4))  # process 0 (and a single process): the step's seed, as before
    assert not torch.equal(backbone0, backbone1)  # dropout masks differ across processes, as their images do
    assert torch.equal(objective0, objective1)  # mixup weights, negatives: the same for the global batch


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_micro_batch_of_an_accumulation_window_draws_its_own_randomness(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accumulate: int
) -> None:
    """The step seed counts micro-batches: with 2 accumulated batches the 4 batches of an epoch are seeded 0, 1, 2, 3
    (mixup weights, random negatives, dropout and PGD's random starts differ between them; they used to repeat
    within a window), exactly as without accumulation."""
    import coretune.engine.module as module

    seeded: list[int] = []
    real = module.step_seed
    monkeypatch.setattr(module, "step_seed", lambda seed, step: seeded.append(step) or real(seed, step))
    model = FineTuner(create("core"), backbone="small_cnn")
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=9)  # 36 images: 4 batches
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert seeded == [0, 1, 2, 3] and trainer.global_step == 4 // accumulate


def test_cpu_time_does_not_grow_while_the_process_waits(tmp_path: Path) -> None:
    """``cpu_time_s`` is the study's CPU budget: a run paused (the study queue's guard stops it while tests run) or
    waiting grows its wall time, not its CPU time; a resume adds the earlier sessions' CPU time."""
    import time

    from coretune.engine import RunArtifacts

    artifacts = RunArtifacts(tmp_path)
    artifacts.on_fit_start(L.Trainer(logger=False, enable_progress_bar=False), L.LightningModule())
    time.sleep(0.5)
    state = artifacts.state_dict()
    assert state["wall_time_s"] >= 0.5 and state["cpu_time_s"] < 0.2
    resumed = RunArtifacts(tmp_path)
    resumed.load_state_dict(state)
    resumed.on_fit_start(L.Trainer(logger=False, enable_progress_bar=False), L.LightningModule())
    assert state["cpu_time_s"] <= resumed.state_dict()["cpu_time_s"] < state["cpu_time_s"] + 0.2
    older = RunArtifacts(tmp_path)  # a checkpoint of code that did not count CPU time: unknown, not a part
    older.load_state_dict({k: v for k, v in state.items() if k != "cpu_time_s"})
    older.on_fit_start(L.Trainer(logger=False, enable_progress_bar=False), L.LightningModule())
    assert older.state_dict()["cpu_time_s"] is None


def test_a_run_records_the_commit_it_started_from_when_head_moves_during_the_fit(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit landing while a run trains does not become the run's: ``commit`` is read when the fit starts, and
    ``commits`` shows that HEAD moved (stop 67's pre-training recorded the commit of its end)."""
    from coretune.engine import callbacks

    heads = iter(["aaaaaaa", "bbbbbbb"])  # at the fit's start, then at its end
    real = callbacks.provenance
    monkeypatch.setattr(callbacks, "provenance", lambda: real() | {"commit": next(heads)})
    main(["fit", f"--data.root={image_tree}", *TINY_FIT, f"--run_dir={tmp_path / 'run'}", *QUIET])
    made = json.loads((tmp_path / "run" / "results.json").read_text())["provenance"]
    assert made["commit"] == "aaaaaaa" and made["commits"] == ["aaaaaaa", "bbbbbbb"]
