"""`coretune fit` with 2 DDP processes (gloo, CPU): one run directory, written by rank 0 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from coretune.cli import main
from coretune.engine import read_metrics
from fit_flags import error


@pytest.mark.ddp
def test_two_process_adversarial_fit_writes_one_set_of_outputs_and_trains_on_the_gathered_rows(
    tmp_path: Path,
) -> None:
    # One 2-process fit for both (each DDP fit costs two interpreters): the run directory written by rank 0 only, and
    # adversarial training under DDP. The attack's forward and backward passes run inside training_step on the
    # unwrapped modules: DDP sees one forward and one backward per step, and Core-tuning mines the clean and
    # adversarial rows of both processes. (The plain, non-adversarial DDP fits: the NaN tests below and
    # tests/test_gpu_check.py's DDP row.)
    from image_trees import make_image_tree

    make_image_tree(tmp_path / "data", per_class=8, val_per_class=3, size=16)  # 9 val images: not a multiple of 2
    command = [
        sys.executable, "-m", "coretune.cli", "fit", "--data.root=data", "--data.image_size=16",
        "--data.batch_size=4", "--model.backbone=small_cnn", "--objective=core", "--trainer.max_epochs=2",
        "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu",
        "--trainer.precision=32-true", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--adversarial.enable=true", "--adversarial.eps=8/255", "--adversarial.steps=2",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "All distributed processes registered. Starting with 2 processes" in done.stderr

    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "runs"]  # nothing else, from either rank
    (run_dir,) = (tmp_path / "runs").iterdir()
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert files == [
        ".coretune-fit",  # the marker that lets a later fit resume in this folder
        "checkpoints/best.ckpt",
        "checkpoints/last.ckpt",
        "config.yaml",
        "learning_curve.png",
        "metrics.csv",
        "results.json",
    ]
    rows = read_metrics(run_dir / "metrics.csv")
    # 24 training images, global batch 2 × 4: 3 steps per epoch (one process with batch 4 would take 6)
    assert [(int(r["epoch"]), int(r["step"])) for r in rows] == [(0, 3), (1, 6)]
    assert all(r["train/con"] != "" and r["val/top1"] != "" for r in rows)
    assert all(float(r[k]) > 0 for r in rows for k in ("train/ce", "train/con"))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["epochs"] == 2
    assert results["train_images"] == 2 * 24  # both processes' images, 2 epochs (rank 0's alone would be 24)
    # 5 and 4 images on the two ranks (2 batches and 1), each counted once; a padding sampler would count 10
    assert sum(map(sum, results["test"]["confusion_matrix"])) == 9
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["coretune"]["objective_hparams"]["gather"] is True
    assert ckpt["coretune"]["adversarial"]["enable"] is True


def test_sync_batchnorm_on_cpu_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--trainer.sync_batchnorm true needs GPUs .*drop it when training on CPU"):
        main(["fit", f"--data.root={tmp_path}", "--trainer.accelerator=cpu", "--trainer.sync_batchnorm=true"])


@pytest.mark.parametrize(
    ("strategy", "named"),
    [
        (["--trainer.strategy=ddp_spawn"], "ddp_spawn starts its processes with multiprocessing (spawn)"),
        (
            ["--trainer.strategy=ddp_notebook_find_unused_parameters_true"],
            "ddp_notebook_find_unused_parameters_true starts its processes with multiprocessing (fork)",
        ),
        (
            ["--trainer.strategy=lightning.pytorch.strategies.DDPStrategy", "--trainer.strategy.start_method=fork"],
            "with start_method fork starts its processes with multiprocessing (fork)",
        ),
    ],
    ids=["spawn", "notebook", "class-path"],
)
def test_strategies_that_start_processes_with_multiprocessing_are_refused(
    strategy: list[str], named: str, image_tree: Path, tmp_path: Path
) -> None:
    # ddp_spawn failed with a traceback (it cannot pickle the run); ddp_fork's processes' errors reached the command
    # as a traceback, and a diverged run was not recorded
    for command in ("fit", "pretrain"):
        message = error([command, f"--data.root={image_tree}", "--trainer.accelerator=cpu", "--trainer.devices=2",
                         *strategy, f"--run_dir={tmp_path / command}"])  # fmt: skip
        assert message == (
            f"--trainer.strategy {named}, which coretune's commands do not support (their errors would not reach the "
            "run directory): use --trainer.strategy ddp, the same data-parallel training with one script per process"
        )
        assert not (tmp_path / command).exists()


class _SaveHeads(L.Callback):
    """Each process uses torch's generator its own way before every epoch (as a user's callback may) and saves
    its classifier at the end of training."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.rand(1 + trainer.global_rank)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = {k: v.clone() for k, v in pl_module.objective.classifier.state_dict().items()}
        torch.save(state, Path(self.folder) / f"rank{trainer.global_rank}.pt")


@pytest.mark.ddp
def test_rifle_reinitialises_the_classifier_identically_on_every_process(tmp_path: Path) -> None:
    from coretune.data import ImageClassificationData
    from coretune.engine import FineTuner, make_trainer
    from coretune.objectives import create
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data", per_class=8, val_per_class=2, size=16)
    model = FineTuner(create("rifle"), backbone="small_cnn")  # 3 epochs: re-initialised at epochs 1 and 2
    trainer = make_trainer(
        tmp_path / "run",
        progress=False,
        max_epochs=3,
        strategy="ddp_spawn",
        devices=2,
        accelerator="cpu",
        precision="32-true",
        callbacks=[_SaveHeads(str(tmp_path))],
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=ImageClassificationData(root=str(root), image_size=16, batch_size=4))
    heads = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])  # no silent divergence across processes


POISON = """
import lightning as L


class PoisonOneProcess(L.Callback):
    # process 1 alone gets NaN images: its training batch 1, or its validation batches after the sanity check
    # (one on process 1, two on process 0: a per-batch collective would hang)
    def __init__(self, stage: str) -> None:
        self.stage = stage

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.stage == "training" and trainer.global_rank == 1 and batch_idx == 1:
            batch[0].fill_(float("nan"))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.stage == "validation" and trainer.global_rank == 1 and not trainer.sanity_checking:
            batch[0].fill_(float("nan"))

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.stage == "test" and trainer.global_rank == 1:
            batch[0].fill_(float("nan"))
"""


@pytest.mark.ddp
@pytest.mark.parametrize(
    ("stage", "objective", "process_0", "process_1"),
    [
        (
            "training",
            "ce",
            "the training loss is not finite on process 1 at epoch 0, step 1 (batch 1). Check the images",
            "the training loss is nan on process 1 at epoch 0, step 1 (batch 1; ce=nan, loss=nan). Check",
        ),
        (  # Core-tuning mines the gathered batch: process 1's NaN features make both processes' losses NaN
            "training",
            "core",
            "the training loss is nan on process 0 at epoch 0, step 1 (batch 1; ce=nan, ce_mix=nan, con=nan, loss=nan; "
            "the non-finite features come from process 1). Check the images",
            "the training loss is nan on process 1 at epoch 0, step 1 (batch 1; ce=nan, ce_mix=nan, con=nan, loss=nan; "
            "the non-finite features come from process 1). Check",
        ),
        (
            "validation",
            "ce",
            "the validation loss is not finite on process 1 at epoch 0, step 3 (that process's error names the "
            "batch). Check the pre-trained weights",
            "the validation loss is nan on process 1 at epoch 0, step 3 (batch 0; 4 of 4 images have non-finite "
            "logits). Check",
        ),
        (  # the final test of the fit: rank 0 records it, the run is a result that a sweep does not run again
            "test",
            "ce",
            "the test loss is not finite on process 1 at epoch 1, step 3 (that process's error names the batch). "
            "Check the pre-trained weights",
            "the test loss is nan on process 1 at epoch 1, step 3 (batch 0; 4 of 4 images have non-finite logits). "
            "Check",
        ),
    ],
    ids=["training", "training-gathered", "validation", "test"],
)
def test_a_loss_that_is_nan_on_one_process_stops_every_process_and_rank_0_records_it(
    stage: str, objective: str, process_0: str, process_1: str, tmp_path: Path
) -> None:
    # each process checks its own loss; when only process 1 raised, process 0 was killed without recording the
    # divergence, and a sweep ran the fit again as if it had been interrupted
    from coretune.runs.layout import RunDir
    from image_trees import make_image_tree

    make_image_tree(tmp_path / "data", per_class=8, val_per_class=3, size=16)
    (tmp_path / "poison.py").write_text(POISON)
    command = [
        sys.executable, "-m", "coretune.cli", "fit", "--data.root=data", "--data.image_size=16",
        "--data.batch_size=4", "--model.backbone=small_cnn", f"--objective={objective}", "--trainer.max_epochs=1",
        "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu",
        "--trainer.precision=32-true", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.callbacks+=poison.PoisonOneProcess", f"--trainer.callbacks.stage={stage}", "--run_dir=run",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    recorded = RunDir(tmp_path / "run").divergence() or ""
    assert recorded.startswith(process_0), done.stderr[-3000:]
    # both processes end with their one line: process 1 waits for process 0, which Lightning's launcher would kill
    # as soon as it saw process 1 exit
    errors = [line for line in done.stderr.splitlines() if line.startswith("coretune fit: error: ")]
    assert len(errors) == 2 and f"coretune fit: error: {recorded}" in errors, done.stderr[-3000:]
    assert any(line.startswith(f"coretune fit: error: {process_1}") for line in errors), errors


def refused_ddp_fit(tmp_path: Path, devices: int, *options: str) -> subprocess.CompletedProcess:
    """A 1-epoch CE fit of ``tmp_path/data`` (16 px, batches of 2) on ``devices`` gloo processes, checked to exit 1."""
    command = [
        sys.executable, "-m", "coretune.cli", "fit", "--data.root=data", "--data.image_size=16", *options,
        "--data.batch_size=2", "--model.backbone=small_cnn", "--objective=ce", "--trainer.max_epochs=1",
        "--trainer.strategy=ddp", f"--trainer.devices={devices}", "--trainer.accelerator=cpu",
        "--trainer.precision=32-true", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--run_dir=run",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    return done


@pytest.mark.ddp
def test_an_evaluation_split_smaller_than_the_processes_is_refused_at_the_start(tmp_path: Path) -> None:
    # a test split of 2 images for 3 processes (the validation split is large enough): the third process had no
    # batch, and the others waited for it at the end of the final test, for ever, after the whole training
    from image_trees import make_image_tree

    make_image_tree(tmp_path / "data", classes=("cat", "dog"), per_class=8, val_per_class=1, size=16)
    done = refused_ddp_fit(tmp_path, 3, "--data.val_fraction=0.5")
    expected = (
        "coretune fit: error: the test split holds 2 image(s), fewer than the 3 processes that share it (each needs "
        "at least one): run at most 2 processes (--trainer.devices × --trainer.num_nodes), or use a larger split"
    )
    # each process says it once; their lines may interleave on the shared stderr
    assert done.stderr.count("coretune fit: error: ") == done.stderr.count(expected) == 3, done.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # refused before the first step


@pytest.mark.ddp
def test_a_batch_fraction_that_keeps_no_batch_on_one_process_is_refused_by_every_process(tmp_path: Path) -> None:
    # 5 test images for 2 processes in batches of 2: 2 batches on process 0 and 1 on process 1, so half of them is
    # 1 batch and 0 batches. Lightning refused it on process 1 alone, after the whole training, with a traceback.
    from image_trees import make_image_tree

    make_image_tree(tmp_path / "data", classes=tuple("abcde"), per_class=4, val_per_class=1, size=16)
    done = refused_ddp_fit(tmp_path, 2, "--trainer.limit_test_batches=0.5")
    expected = (
        "coretune fit: error: --trainer.limit_test_batches=0.5 keeps no batch of the test split (0.5 × 1 batch(es) on "
        "the process with the fewest < 1): pass a whole number of batches "
        "(--trainer.limit_test_batches=1), or 1.0 for all of them"
    )
    assert done.stderr.count("coretune fit: error: ") == done.stderr.count(expected) == 2, done.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # refused before the first step
