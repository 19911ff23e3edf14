"""`coretune fit` with 2 DDP processes (gloo, CPU): one run directory, written by rank 0 only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coretune.cli import main
from coretune.engine import read_metrics


@pytest.mark.ddp
def test_two_process_fit_writes_one_set_of_outputs(tmp_path: Path) -> None:
    from image_trees import make_image_tree

    make_image_tree(tmp_path / "data", per_class=8, val_per_class=3, size=16)  # 9 val images: not a multiple of 2
    command = [
        sys.executable,
        "-m",
        "coretune.cli",
        "fit",
        "--data.root=data",
        "--data.image_size=16",
        "--data.batch_size=4",
        "--model.backbone=small_cnn",
        "--objective=core",
        "--trainer.max_epochs=2",
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "All distributed processes registered. Starting with 2 processes" in done.stderr

    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "runs"]  # nothing else, from either rank
    (run_dir,) = (tmp_path / "runs").iterdir()
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert files == [
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
    results = json.loads((run_dir / "results.json").read_text())
    assert results["epochs"] == 2
    # 5 and 4 images on the two ranks (2 batches and 1), each counted once; a padding sampler would count 10
    assert sum(map(sum, results["test"]["confusion_matrix"])) == 9
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["coretune"]["objective_hparams"]["gather"] is True


def test_sync_batchnorm_on_cpu_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--trainer.sync_batchnorm true needs GPUs .*drop it when training on CPU"):
        main(["fit", f"--data.root={tmp_path}", "--trainer.accelerator=cpu", "--trainer.sync_batchnorm=true"])
