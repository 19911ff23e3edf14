"""A long-tailed fit end to end: `--data.imbalance_ratio` recorded, the training images per class in results.json and
the checkpoint, logit adjustment's priors from them (the objective's, or Core-tuning's ``logit_adjustment``), the
many/medium/few-shot top-1 in the results (test, and validation when the classes fall into several groups) and in
`coretune test`'s file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from coretune.cli import main
from coretune.engine import read_metrics
from fit_flags import QUIET, TINY_FIT
from image_trees import make_image_tree


@pytest.mark.parametrize(
    "objective",
    [
        ["--objective=logit_adjusted"],
        ["--objective=core", "--objective.logit_adjustment=1"],
        ["--objective=ce_mix", "--objective.logit_adjustment=1"],  # the LT spec's ce_mix_la row
    ],
    ids=["logit_adjusted", "core-adjusted", "ce_mix-adjusted"],
)
def test_a_long_tailed_fit_records_its_counts_and_scores_each_shot_group(tmp_path: Path, objective: list[str]) -> None:
    tree = make_image_tree(tmp_path / "data", classes=("a", "b", "c", "d"), per_class=24, val_per_class=3, size=16)
    run = tmp_path / "run"
    main([
        "fit", *TINY_FIT, *QUIET, f"--data.root={tree}", f"--run_dir={run}", *objective,
        "--data.imbalance_ratio=8", "--data.val_fraction=0.25", "--data.shot_thresholds=[12, 4]",
    ])  # fmt: skip
    # 24 · 8^(−i/3) = 24, 12, 6, 3 long-tailed, then a quarter of each held out for validation: 6, 3, 2 (1.5 up), 1
    train = {"a": 18, "b": 9, "c": 4, "d": 2}
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["imbalance_ratio"] == 8
    results = json.loads((run / "results.json").read_text())
    assert results["train_class_counts"] == train
    groups = results["test"]["shot_groups"]
    assert groups["thresholds"] == {"many_above": 12, "few_below": 4} and groups["train_class_counts"] == train
    assert [groups[g]["classes"] for g in ("many", "medium", "few")] == [["a"], ["b", "c"], ["d"]]
    per_class = results["test"]["per_class_accuracy"]  # the balanced val/ folder (3 images a class) is the test split
    assert groups["many"]["top1"] == pytest.approx(per_class["a"])
    assert groups["medium"]["top1"] == pytest.approx((per_class["b"] + per_class["c"]) / 2)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["coretune"]["train_class_counts"] == list(train.values())
    prior = torch.tensor(list(train.values()), dtype=torch.float64) / sum(train.values())
    assert ckpt["state_dict"]["objective.log_prior"].double() == pytest.approx(prior.log(), abs=1e-6)
    row = read_metrics(run / "metrics.csv")[-1]  # validation scores each group (several groups here)
    assert all(math.isfinite(float(row[f"val/{g}_top1"])) for g in ("many", "medium", "few"))
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={tree}"])
    tested = json.loads((run / "test_results.json").read_text())
    assert tested["data"]["imbalance_ratio"] == 8  # the checkpoint's split settings
    assert tested["test"]["shot_groups"]["many"] == groups["many"]
