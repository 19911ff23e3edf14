"""Table 5's layout (class-imbalanced fine-tuning): top-1 over all classes and over the many/medium/few-shot classes
per method and imbalance ratio, from each run's shot_groups; configs/bench/cifar10_cpu_lt.yaml's grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coretune.cli import main
from coretune.data import long_tailed_counts
from coretune.longtail import shot_groups
from coretune.sweeps import BenchSpec
from coretune.sweeps.measures import collect_measures, shot_measures

LT = Path(__file__).resolve().parents[2] / "configs" / "bench" / "cifar10_cpu_lt.yaml"


def test_the_lt_spec_expands_to_six_methods_two_ratios_three_seeds() -> None:
    spec = BenchSpec.from_yaml(LT)
    runs = spec.runs()
    methods = ("ce", "ce_mix", "core", "logit_adjusted", "core_la", "ce_mix_la")
    assert spec.table == "table5" and len(runs) == 2 * 6 * 3
    assert {(r.dataset, r.objective) for r in runs} == {
        (d, o) for d in ("cifar10_lt100", "cifar10_lt10") for o in methods
    }
    for run in runs:  # logit-adjusted cross-entropies (τ = 1) inside Core-tuning and inside ce_mix, their settings kept
        if run.objective == "core_la":
            assert run.job.objective == "core" and "--objective.logit_adjustment=1.0" in run.args, run.args
            assert {"--objective.eta=0.1", "--objective.alpha=10"} <= set(run.args)
        if run.objective == "ce_mix_la":  # core_la without the contrastive term
            assert run.job.objective == "ce_mix" and "--objective.logit_adjustment=1.0" in run.args, run.args
            assert "--objective.alpha=10" in run.args and "--objective.eta=0.1" not in run.args
    for run in runs:
        assert f"--data.imbalance_ratio={run.dataset.removeprefix('cifar10_lt')}" in run.args
        assert "--model.weights=../shared/checkpoints/simclr_resnet18_in20_64px.pth.tar" in run.args
        assert {"--data.image_size=32", "--data.shot_thresholds=[1500,200]", "--trainer.max_epochs=30"} <= set(run.args)
    # the header's numbers: 12,406 and 20,431 images; at R = 100 the groups are 3 / 4 / 3 classes, at R = 10 5 / 5 / 0
    assert sum(long_tailed_counts([5000] * 10, 100)) == 12406 and sum(long_tailed_counts([5000] * 10, 10)) == 20431
    sizes = {
        r: [len(g) for g in shot_groups(long_tailed_counts([5000] * 10, r), (1500, 200)).values()] for r in (100, 10)
    }
    assert sizes == {100: [3, 4, 3], 10: [5, 5, 0]}


def fake_test(top1: float, many: float, medium: float, few: float | None) -> dict:
    groups = {"thresholds": {"many_above": 1500, "few_below": 200}, "train_class_counts": {}}
    groups |= {g: {"top1": v, "classes": [] if v is None else ["x"]} for g, v in zip(
        ("many", "medium", "few"), (many, medium, few), strict=True)}  # fmt: skip
    return {"top1": top1, "shot_groups": groups}


def test_table5_tabulates_top1_and_each_shot_group_an_empty_group_left_out(tmp_path: Path) -> None:
    raw = yaml.safe_load(LT.read_text())
    spec_file = tmp_path / "lt.yaml"
    spec_file.write_text(yaml.safe_dump({**raw, "output": str(tmp_path / "out"), "seeds": [0, 1]}))
    spec = BenchSpec.from_yaml(spec_file)
    for run in spec.runs():
        few = None if run.dataset == "cifar10_lt10" else 0.2 + 0.01 * run.seed
        test = fake_test(0.5 + 0.01 * run.seed, 0.8, 0.4, few)
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "results.json").write_text(json.dumps({"test": test, "epochs": 30}))
    cells, measures = collect_measures(spec, shot_measures, (("top1", "top-1"),))
    assert measures == [
        ("top1", "top-1"),
        ("many-shot (>1500)", "many-shot (>1500)"),
        ("medium-shot (200-1500)", "medium-shot (200-1500)"),
        ("few-shot (<200)", "few-shot (<200)"),
    ]
    assert cells[("core", "cifar10_lt100", 1.0, "top1")].values == pytest.approx((50.0, 51.0))
    assert cells[("ce", "cifar10_lt100", 1.0, "few-shot (<200)")].values == pytest.approx((20.0, 21.0))
    assert cells[("ce", "cifar10_lt10", 1.0, "few-shot (<200)")].values == ()  # an empty group: no value, never 0
    main(["bench", str(spec_file), "--aggregate_only"])
    markdown = (spec.output / "summary.md").read_text()
    assert "cifar10_lt100 many-shot (>1500)" in markdown and "cifar10_lt10 top-1" in markdown


def test_table5_refuses_runs_without_shot_groups_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(Exception, match=r"table5 tabulates the many/medium/few-shot top-1 of each run, but .* has no "):
        shot_measures(run_dir, {"top1": 0.5})
