"""A long-tailed fit end to end: `--data.imbalance_ratio` recorded, the training images per class in results.json and
the checkpoint, logit adjustment's priors from them (the objective's, or Core-tuning's ``logit_adjustment``), the
many/medium/few-shot top-1 in the results (test, and validation when the classes fall into several groups) and in
`coretune test`'s file; post-hoc logit adjustment (`--posthoc_adjustment` of `coretune test`, `predict` and `export`)
against the shifted logits computed here, and what it refuses."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from coretune.cli import main
from coretune.engine import read_metrics
from fit_flags import QUIET, TINY_FIT, error
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


def _long_tailed_fit(tmp_path: Path, *objective: str) -> tuple[Path, Path]:
    """(tree, last checkpoint) of a one-epoch fit on a 4-class long-tailed tree (18, 9, 4, 2 training images)."""
    tree = make_image_tree(tmp_path / "data", classes=("a", "b", "c", "d"), per_class=24, val_per_class=3, size=16)
    run = tmp_path / "run"
    main([
        "fit", *TINY_FIT, *QUIET, f"--data.root={tree}", f"--run_dir={run}", *objective,
        "--data.imbalance_ratio=8", "--data.val_fraction=0.25",
    ])  # fmt: skip
    return tree, run / "checkpoints" / "last.ckpt"


def _test_logits(ckpt: Path, folder: Path) -> tuple[torch.Tensor, list[str]]:
    """The checkpoint's float32 class logits of every image under ``folder`` (as its test split reads them) and the
    images' paths, computed here without coretune's commands."""
    from torch.utils.data import DataLoader

    from coretune.data import ImageFileDataset
    from coretune.engine import FineTuner

    model = FineTuner.from_checkpoint(ckpt).eval()
    data = model.trained_data
    transform, draft = model.task.image_transform(data["image_size"], tuple(data["mean"]), tuple(data["std"]))
    images = ImageFileDataset(str(folder), transform, draft_size=draft)
    with torch.inference_mode():
        logits = torch.cat([model(x).float() for x, _ in DataLoader(images, batch_size=64)])
    return logits, list(images.paths)


def test_posthoc_adjustment_scores_and_predicts_the_shifted_logits(tmp_path: Path) -> None:
    # Menon et al.'s post-hoc rule: argmax_y f_y(x) − τ·log π_y, π the training frequencies the checkpoint records
    tree, ckpt = _long_tailed_fit(tmp_path, "--objective=ce")
    logits, paths = _test_logits(ckpt, tree / "val")  # val/ is these fits' test split
    names = ["a", "b", "c", "d"]
    labels = torch.tensor([names.index(Path(p).parent.name) for p in paths])
    prior = torch.tensor([18.0, 9.0, 4.0, 2.0]) / 33
    tau = 2.0
    adjusted = logits - tau * prior.log()
    assert (adjusted.argmax(1) != logits.argmax(1)).any()  # the shift changes some predictions here
    exact = ["--trainer.precision=32-true", "--trainer.accelerator=cpu"]
    out = tmp_path / "adjusted.json"
    main(["test", f"--ckpt_path={ckpt}", f"--data.root={tree}", f"--output={out}", "--posthoc_adjustment=2", *exact])
    results = json.loads(out.read_text())
    assert results["posthoc_adjustment"] == 2.0
    assert results["test"]["top1"] == pytest.approx((adjusted.argmax(1) == labels).float().mean().item())
    main(["test", f"--ckpt_path={ckpt}", f"--data.root={tree}", f"--output={out}", *exact])  # 0: as trained
    plain = json.loads(out.read_text())
    assert "posthoc_adjustment" not in plain
    assert plain["test"]["top1"] == pytest.approx((logits.argmax(1) == labels).float().mean().item())
    csv_path = tmp_path / "adjusted.csv"
    main(["predict", f"--ckpt_path={ckpt}", f"--input={tree / 'val'}", f"--output={csv_path}",
          "--posthoc_adjustment=2", *exact])  # fmt: skip
    rows = {row["path"]: row for row in csv.DictReader(csv_path.open())}
    probs = torch.softmax(adjusted, dim=1)
    for i, path in enumerate(paths):
        assert rows[path]["prediction"] == names[int(adjusted[i].argmax())]
        assert [float(rows[path][f"p_{n}"]) for n in names] == pytest.approx(probs[i].tolist(), abs=1e-5)


def test_export_folds_the_posthoc_adjustment_into_the_classifiers_bias(tmp_path: Path) -> None:
    from coretune.apps.export import load_exported
    from coretune.engine import FineTuner

    _, ckpt = _long_tailed_fit(tmp_path, "--objective=ce")
    x = torch.randn(5, 3, 16, 16)
    with torch.inference_mode():
        logits = FineTuner.from_checkpoint(ckpt).eval()(x).float()
    adjusted = logits - 2.0 * (torch.tensor([18.0, 9.0, 4.0, 2.0]) / 33).log()
    out = tmp_path / "export"
    main(["export", f"--ckpt_path={ckpt}", f"--output={out}", "--posthoc_adjustment=2"])
    net, config = load_exported(out)
    assert config["posthoc_adjustment"] == 2.0 and config["formats"] == ["safetensors", "pt2"]
    program = torch.export.load(str(out / "model.pt2")).module()
    with torch.inference_mode():
        for written in (net(x), program(x)):  # the written files, each read back
            assert written == pytest.approx(adjusted, abs=1e-4)
    plain = tmp_path / "plain"
    main(["export", f"--ckpt_path={ckpt}", f"--output={plain}", "--format=safetensors"])  # 0: as trained
    net, config = load_exported(plain)
    assert config["posthoc_adjustment"] == 0.0
    with torch.inference_mode():
        assert net(x) == pytest.approx(logits, abs=1e-4)
    refused = tmp_path / "refused"
    assert error(["export", f"--ckpt_path={ckpt}", f"--output={refused}", "--posthoc_adjustment=-1"]).startswith(
        "--posthoc_adjustment must be a number >= 0 (got -1.0;"
    )
    assert not refused.exists()


def test_posthoc_adjustment_refuses_what_it_cannot_adjust_in_one_line(tmp_path: Path, capsys) -> None:
    tree, ckpt = _long_tailed_fit(tmp_path, "--objective=logit_adjusted")
    predict = ["predict", f"--ckpt_path={ckpt}", f"--input={tree / 'val'}", f"--output={tmp_path / 'p.csv'}"]
    assert error([*predict, "--posthoc_adjustment=-1"]).startswith(
        "--posthoc_adjustment must be a number >= 0 (got -1.0; 1: Menon et al.'s balanced-error rule"
    )
    with pytest.raises(SystemExit) as parsed:  # the parser's own one line
        main([*predict, "--posthoc_adjustment=nan"])
    assert parsed.value.code == 2 and "--posthoc_adjustment: expected float, got nan" in capsys.readouterr().err
    assert error(["test", f"--ckpt_path={ckpt}", f"--data.root={tree}", "--posthoc_adjustment=-0.5"]).startswith(
        "--posthoc_adjustment must be a number >= 0 (got -0.5;"
    )
    with pytest.warns(UserWarning, match=r"was fine-tuned with logit adjustment \(logit_adjusted\): "
                      r"--posthoc_adjustment 1 adjusts its predictions a second time"):  # fmt: skip
        main([*predict, "--posthoc_adjustment=1"])
    saved = torch.load(ckpt, weights_only=True)
    for counts, problem in [
        (None, "records no training images per class (train_class_counts: a checkpoint from before they were kept"),
        ([18, 9, 4, 0], "class 'd' had no training image, so its prior is 0 and its adjusted logit would be infinite"),
    ]:
        altered = tmp_path / f"altered-{counts is None}.ckpt"
        saved["coretune"]["train_class_counts"] = counts
        torch.save(saved, altered)
        message = error(["test", f"--ckpt_path={altered}", f"--data.root={tree}", "--posthoc_adjustment=1",
                         f"--output={tmp_path / 'x.json'}"])  # fmt: skip
        assert message.startswith(f"checkpoint {altered}") and problem in message
        assert not (tmp_path / "x.json").exists()
        message = error(["export", f"--ckpt_path={altered}", f"--output={tmp_path / 'x'}", "--posthoc_adjustment=1"])
        assert message.startswith(f"checkpoint {altered}") and problem in message
        assert not (tmp_path / "x").exists()
