"""A run read back from its directory: its final validation top-1, its metric, its time left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from sweep_helpers import fabricate, spec_of

from coretune.sweeps import (
    BenchSpecError,
    Run,
    collect_cells,
    final_val_top1,
    format_duration,
    training_time_left,
    write_summary,
)
from coretune.sweeps.spec import check_val_split


def test_metric_val_refuses_runs_that_validated_on_the_test_split(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, metric="val", objectives=["ce"])
    fabricate(spec, {("ce", "tiny", 1.0): [0.5]})
    run_dir = spec.runs()[0].run_dir
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"data": {"root": "DATA", "val_fraction": 0.0}}))
    (run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")
    with pytest.raises(BenchSpecError, match=r"metric 'val' needs a validation split .* add --data.val_fraction=0.2"):
        write_summary(spec)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"data": {"root": "DATA", "val_fraction": 0.2}}))
    (run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.9\n1,0.7\n")
    assert "| ce | **70.00 (n=1)** |" in write_summary(spec)[0]  # the last validated epoch, not the test's 50


def test_domain_generalization_runs_hold_out_with_their_own_option() -> None:
    dg = {"model": {"task": "domain_generalization"}, "data": {"holdout_fraction": 0.2}}
    check_val_split(dg, "run a")  # DomainBed's training-domain holdout is the validation split
    message = r"run b validates on its test split \(data.holdout_fraction is not > 0.*--data.holdout_"
    with pytest.raises(BenchSpecError, match=message):
        check_val_split({**dg, "data": {"holdout_fraction": 0.0, "val_fraction": 0.2}}, "run b")
    with pytest.raises(BenchSpecError, match=r"\(data.val_fraction is not > 0.* add --data.val_fraction=0.2"):
        check_val_split({"model": {"task": "segmentation"}, "data": {"holdout_fraction": 0.2}}, "run c")


def test_data_with_a_validation_split_of_its_own_needs_no_holdout(tmp_path: Path, voc_set: Path) -> None:
    """CamVid's val.txt beside test.txt, an image folder's val/ beside test/: validation is not the test split."""
    import shutil

    from image_trees import make_image_tree

    lists = voc_set / "ImageSets" / "Segmentation"
    seg = {"model": {"task": "segmentation"}, "data": {"root": str(voc_set), "val_fraction": 0.0}}
    with pytest.raises(BenchSpecError, match=r"run a validates on its test split"):
        check_val_split(seg, "run a")  # val.txt only: it is also the test split
    shutil.copy(lists / "val.txt", lists / "test.txt")
    check_val_split(seg, "run a")
    tree = make_image_tree(tmp_path / "tree", per_class=2, val_per_class=1, size=8)
    folders = {"data": {"root": str(tree), "val_fraction": 0.0}}
    with pytest.raises(BenchSpecError, match=r"run b validates on its test split"):
        check_val_split(folders, "run b")  # train/ and val/ only
    shutil.copytree(tree / "val", tree / "test")
    check_val_split(folders, "run b")
    # a finished run's results say what it validated on, whatever the data on this machine
    gone = {"data": {"root": str(tmp_path / "elsewhere"), "val_fraction": 0.0}}
    check_val_split(gone, "run c", {"validated_on_test_images": False})
    with pytest.raises(BenchSpecError, match=r"run d validates on its test split"):
        check_val_split(folders, "run d", {"validated_on_test_images": True})


def test_final_val_top1_is_the_last_validated_epoch(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("epoch,val/top1\n0,0.7\n1,0.9\n2,0.8\n3,\n")
    assert final_val_top1(tmp_path / "metrics.csv") == 0.8  # final (not best) validated epoch
    (tmp_path / "metrics.csv").write_text("epoch,val/top1\n0,\n")
    with pytest.raises(ValueError, match="has no val/top1: validation never ran"):
        final_val_top1(tmp_path / "metrics.csv")


@pytest.mark.parametrize("running", [False, True])
@settings(max_examples=40, deadline=None)
@given(
    times=st.lists(st.floats(0.5, 5000), min_size=1, max_size=8),
    extra=st.integers(0, 30),
    since_last=st.floats(0, 20000),
)
def test_training_time_left_is_the_epochs_to_go_at_the_recent_pace(
    tmp_path_factory: pytest.TempPathFactory, running: bool, times: list[float], extra: int, since_last: float
) -> None:
    """Reference: the median of the last three epoch wall times per epoch to go; a running run's current epoch
    has already run for the time since metrics.csv was written, but the epochs after it still take their time."""
    run_dir = tmp_path_factory.mktemp("run")
    total = len(times) + extra
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": total}}))
    rows = "".join(f"{e},{t!r}\n" for e, t in enumerate(times))
    (run_dir / "metrics.csv").write_text("epoch,epoch_time_s\n" + rows)
    now = (run_dir / "metrics.csv").stat().st_mtime + since_last
    left = training_time_left(run_dir, running=running, now=now)
    if extra == 0:
        assert left is None  # the training is over (the test evaluation may still run)
        return
    recent = sorted(times[-3:])
    pace = recent[len(recent) // 2] if len(recent) % 2 else (recent[0] + recent[1]) / 2
    expected = extra * pace
    if running:
        current = max(pace - since_last, 0.0)  # what is left of the epoch in progress
        expected = current + (extra - 1) * pace
    assert left == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_training_time_left_needs_a_timed_epoch_and_a_length(tmp_path: Path) -> None:
    assert training_time_left(tmp_path, running=False) is None  # nothing written yet
    (tmp_path / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")  # written before epoch times were logged
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": 4}}))
    assert training_time_left(tmp_path, running=True) is None
    (tmp_path / "metrics.csv").write_text("epoch,val/top1,epoch_time_s\n0,0.5,90\n")
    assert training_time_left(tmp_path, running=False) == 270
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {}}))
    assert training_time_left(tmp_path, running=False) is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "<1 min"), (29, "<1 min"), (31, "1 min"), (38 * 60, "38 min"), (3569, "59 min"), (3571, "1 h 00 min"),
     (2 * 3600 + 5 * 60, "2 h 05 min"), (30 * 3600, "30 h 00 min")],
)  # fmt: skip
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_runs_of_one_weights_path_that_started_from_different_files_are_refused(tmp_path: Path) -> None:
    """A checkpoint re-made between runs (same --model.weights path, another SHA-256 in results.json): the table
    would pair runs that did not start from one file."""
    from coretune.sweeps import BenchSpecError

    spec = spec_of(tmp_path, objectives=[{"name": "ce", "args": ["--model.weights=ckpt.pth"]}, "core"], seeds=[0, 1])
    fabricate(spec, {("ce", "tiny", 1.0): [0.5, 0.6], ("core", "tiny", 1.0): [0.55, 0.65]})

    def record(run: Run, digest: str | None) -> None:
        results = run.run_dir / "results.json"
        results.write_text(json.dumps({**json.loads(results.read_text()), "weights_sha256": digest}))

    for run in spec.runs():
        record(run, "a" * 64 if run.objective == "ce" else None)
    cells, _ = collect_cells(spec)  # one file: fine (core names no --model.weights: not compared)
    assert cells[("ce", "tiny", 1.0)].values == (50.0, 60.0)
    record(next(r for r in spec.runs() if (r.objective, r.seed) == ("ce", 1)), "b" * 64)
    with pytest.raises(
        BenchSpecError,
        match=r"the runs that name --model.weights ckpt.pth started from 2 different "
        r"files \(aaaaaaaaaaaa… for tiny/ce/frac1/seed0; bbbbbbbbbbbb… for tiny/ce/frac1/seed1\)",
    ):
        collect_cells(spec)  # fmt: skip
    collect_cells(spec, other_args="list")  # --status still lists them
