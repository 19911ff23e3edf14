"""`coretune demo --fast`: digits → SimCLR → CE-tuning and Core-tuning through the real engine, end to end."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from coretune.apps.demo import _adopt_earlier_demo, write_digits
from coretune.cli import main
from coretune.models import create_backbone, load_pretrained


def test_write_digits_is_a_stratified_image_folder_and_idempotent(tmp_path: Path) -> None:
    root = write_digits(tmp_path / "data")
    train = sorted(root.glob("train/*/*.png"))
    test = sorted(root.glob("test/*/*.png"))
    counts = np.bincount(load_digits().target)
    assert len(train) + len(test) == 1797
    assert len(test) == sum(math.floor(0.2 * n + 0.5) for n in counts) == 359  # 20% of each class, rounded
    assert sorted(p.name for p in (root / "train").iterdir()) == [str(d) for d in range(10)]
    stamp = train[0].stat().st_mtime_ns
    write_digits(tmp_path / "data")
    assert train[0].stat().st_mtime_ns == stamp  # a complete tree is kept


def test_the_demo_remakes_only_folders_it_made(tmp_path: Path) -> None:
    """``--output runs`` removed runs/data and runs/pretrain (the study's pre-trainings) to write its own: a folder
    without the demo's marker is now refused and kept."""
    theirs = tmp_path / "runs" / "data"
    (theirs / "cifar10").mkdir(parents=True)
    (theirs / "cifar10" / "keep.png").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"data exists and was not made by coretune demo \(it has no \.coretune-demo"):
        write_digits(theirs)
    assert (theirs / "cifar10" / "keep.png").read_bytes() == b"x"
    ours = write_digits(tmp_path / "demo" / "data", per_class=5)
    assert (ours / ".coretune-demo").is_file()
    write_digits(ours, per_class=6)  # other arguments: its own folder, remade
    assert len(list(ours.glob("*/*/*.png"))) == 60 and (ours / ".coretune-demo").is_file()
    # a folder of other runs as --output: refused whole, before anything is written (issue 60)
    with pytest.raises(SystemExit, match=r"^coretune demo: error: --output .*runs holds files coretune demo did not"):
        (tmp_path / "runs" / "pretrain").mkdir()
        (tmp_path / "runs" / "pretrain" / "run").mkdir()
        (tmp_path / "runs" / "data").rename(tmp_path / "other")  # the data step passes; pretrain/ is refused
        main(["demo", "--output", str(tmp_path / "runs"), "--fast", "--no_progress"])
    assert (tmp_path / "runs" / "pretrain" / "run").is_dir()


def test_fast_demo_runs_the_whole_pipeline(tmp_path: Path, capsys) -> None:
    output = tmp_path / "demo"
    main(["demo", "--output", str(output), "--fast", "--no_progress"])
    summary = json.loads((output / "summary.json").read_text())
    assert summary["settings"]["seeds"] == 2 and summary["settings"]["finetune_epochs"] == 2
    assert [m["name"] for m in summary["methods"]] == ["CE-tuning", "Core-tuning"]
    for method in summary["methods"]:
        assert len(method["top1"]) == 2 and all(0.0 <= a <= 1.0 for a in method["top1"])
        for run_dir, top1 in zip(method["run_dirs"], method["top1"], strict=True):
            results = json.loads((Path(run_dir) / "results.json").read_text())
            assert results["test"]["top1"] == top1  # the reported number is the engine's test result
            assert (Path(run_dir) / "metrics.csv").is_file() and (Path(run_dir) / "learning_curve.png").is_file()
    assert 0.0 <= summary["knn_random"] <= 1.0 and 0.0 <= summary["knn_pretrained"] <= 1.0
    weights = Path(summary["pretrain_dir"]) / "pretrained.pth.tar"
    report = load_pretrained(create_backbone("small_cnn", verbose=False), weights)
    assert report.layout == "backbone" and len(report.loaded) == report.total
    markdown = (output / "summary.md").read_text()
    assert "| CE-tuning |" in markdown and "| Core-tuning |" in markdown
    # the difference, paired by seed as bench reads it: the same test in summary.json, summary.md and the terminal
    ce, core = (m["top1"] for m in summary["methods"])
    paired = summary["paired_difference"]
    assert paired["n"] == 2 and paired["difference"] == pytest.approx(sum(core) / 2 - sum(ce) / 2)
    assert paired["beyond_noise"] == (paired["p"] < 0.05)
    line = re.search(
        r"Core-tuning − CE-tuning: [+-]\d+\.\d\d points, paired over 2 seed\(s\) \(.*\): "
        r"(within|beyond) the seeds' noise",
        markdown,
    )
    assert line is not None
    out = capsys.readouterr().out
    assert line.group(0) in " ".join(out.split())  # rich wraps it
    assert "Core-tuning" in out and str(output / "summary.md") in out.replace("\n", "")
    # an output written before the demo marked its folders: adopted (make demo re-runs over it after an upgrade)
    for marker in output.rglob(".coretune-demo"):
        marker.unlink()
    (output / "finetune" / "my-run").mkdir()  # a user's own folder there: not the demo's to delete later
    _adopt_earlier_demo(output)
    marked = sorted(p.parent.relative_to(output).as_posix() for p in output.rglob(".coretune-demo"))
    assert marked == ["data", "finetune/ce-seed0", "finetune/ce-seed1", "finetune/core-seed0", "finetune/core-seed1",
                      "pretrain"]  # fmt: skip
