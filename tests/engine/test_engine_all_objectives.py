"""Every registered objective trains through `coretune fit` on a tiny tree (issue 5's smoke run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from coretune import objectives
from coretune.cli import main
from coretune.engine import read_metrics


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("objectives") / "data", per_class=8, val_per_class=2, size=16)


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_objective_fits_through_the_cli(name: str, tree: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / name
    main([
        "fit", f"--data.root={tree}", "--data.image_size=16", "--data.batch_size=8", "--model.backbone=small_cnn",
        "--objective", name, "--trainer.max_epochs=2", f"--run_dir={run_dir}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    ])  # fmt: skip
    rows = read_metrics(run_dir / "metrics.csv")
    assert len(rows) == 2
    assert all(math.isfinite(float(r["train/loss"])) for r in rows)
    assert 0.0 <= json.loads((run_dir / "results.json").read_text())["test"]["top1"] <= 1.0
    if name == "delta":  # its channel attention was computed at the start (not left uniform)
        state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        assert bool(state["objective.attention_ready"])
        attention = [v for k, v in state.items() if k.startswith("objective.") and "attention" in k and v.dim() == 1]
        assert attention and not all(torch.allclose(a, a.mean().expand_as(a)) for a in attention)
