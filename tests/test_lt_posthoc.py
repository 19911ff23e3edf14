"""benchmarks/lt_posthoc.py (issue 65): post-hoc logit adjustment of the long-tailed runs — the shifted top-1 against
a loop over images written from Menon et al.'s rule (predict ``argmax_y f_y(x) − δ log π_y``), the per-class halves,
the cross-fitted choice of δ finding the bias put into synthetic logits, and the script end to end on two tiny
long-tailed fits: its δ = 0 top-1 is each run's test top-1, the record is strict JSON, and a stale cache, an existing
``--out`` and a missing folder are refused in one line."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmark_scripts import BENCHMARKS, load_benchmark
from coretune.cli import main as coretune
from fit_flags import QUIET, TINY_FIT
from image_trees import make_image_tree


@pytest.fixture
def posthoc(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("lt_posthoc", monkeypatch)


def _slow_top1(logits: np.ndarray, labels: np.ndarray, log_prior: np.ndarray, delta: float) -> float:
    """Menon et al.'s post-hoc rule, one image and one class at a time."""
    hits = 0
    for row, label in zip(logits.tolist(), labels.tolist(), strict=True):
        scores = [row[y] - delta * log_prior[y] for y in range(len(row))]
        hits += max(range(len(row)), key=lambda y: scores[y]) == label  # the first of equal scores, as argmax
    return 100.0 * hits / len(labels)


@functools.cache
def _module() -> ModuleType:
    """The script as a module, read once (hypothesis runs a test many times, beyond a function-scoped fixture)."""
    spec = importlib.util.spec_from_file_location("lt_posthoc_once", BENCHMARKS / "lt_posthoc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    k=st.integers(2, 7),
    seed=st.integers(0, 2**16),
    deltas=st.lists(st.floats(-3, 3, allow_nan=False), min_size=1, max_size=5),
)
def test_the_shifted_top1_is_menons_rule_image_by_image(n: int, k: int, seed: int, deltas: list[float]) -> None:
    posthoc = _module()
    rng = np.random.default_rng(seed)
    logits, labels = rng.normal(size=(n, k)), rng.integers(0, k, size=n)
    counts = rng.integers(1, 5000, size=k).astype(float)
    log_prior = np.log(counts / counts.sum())
    got = posthoc.adjusted_top1(logits, labels, log_prior, deltas)
    assert got.tolist() == pytest.approx([_slow_top1(logits, labels, log_prior, d) for d in deltas])


def test_the_halves_split_each_class_alternately(posthoc: ModuleType) -> None:
    labels = np.array([2, 0, 0, 1, 0, 2, 1, 0, 0, 2, 1])
    first, second = posthoc.halves(labels)
    assert sorted([*first, *second]) == list(range(len(labels))) and not set(first) & set(second)
    assert first.tolist() == [0, 1, 3, 4, 8, 9, 10]  # each class's 1st, 3rd, 5th … image
    for c in range(3):
        assert abs(int((labels[first] == c).sum()) - int((labels[second] == c).sum())) <= 1


def test_the_cross_fitted_shift_finds_the_bias_put_into_the_logits(posthoc: ModuleType) -> None:
    # a balanced test set whose logits carry β · log π on top of the evidence: the best shift is δ = β
    rng = np.random.default_rng(0)
    counts = np.floor(5000 * 0.01 ** (np.arange(10) / 9))
    labels = np.repeat(np.arange(10), 400)
    beta = 0.8
    logits = 2.0 * np.eye(10)[labels] + beta * np.log(counts / counts.sum()) + rng.normal(size=(len(labels), 10))
    groups = {"many": [0, 1, 2], "medium": [3, 4, 5, 6], "few": [7, 8, 9]}
    result = posthoc.analyse_run(logits, labels, counts, groups)
    assert result["delta0"]["top1"] == pytest.approx(100 * (logits.argmax(1) == labels).mean())
    zero = posthoc.GRID.index(0.0)
    for group, classes in groups.items():  # a group's top-1 is over its classes' images
        keep = np.isin(labels, classes)
        assert result["sweep"][group][zero] == pytest.approx(100 * (logits[keep].argmax(1) == labels[keep]).mean())
    assert abs(result["best_on_test"]["delta"] - beta) <= 0.3
    assert all(abs(d - beta) <= 0.3 for d in result["cross_fitted"]["deltas"])
    assert result["cross_fitted"]["top1"] > result["delta0"]["top1"] + 10  # the tail was predicted away
    assert result["cross_fitted"]["few"] > result["delta0"]["few"] + 30
    assert result["delta1"]["few"] > result["delta0"]["few"]


def test_the_script_end_to_end_on_two_tiny_long_tailed_fits(posthoc: ModuleType, tmp_path: Path, capsys) -> None:
    tree = make_image_tree(tmp_path / "data", classes=("a", "b", "c", "d"), per_class=24, val_per_class=3, size=16)
    runs = tmp_path / "runs"
    for method, args in [("ce", ["--objective=ce"]), ("logit_adjusted", ["--objective=logit_adjusted"])]:
        coretune([
            "fit", *TINY_FIT, *QUIET, *args, f"--data.root={tree}", f"--run_dir={runs / method / 'frac1' / 'seed0'}",
            "--data.imbalance_ratio=8", "--data.val_fraction=0.25", "--data.shot_thresholds=[12, 4]",
        ])  # fmt: skip
    cache, out = tmp_path / "cache", tmp_path / "record.json"
    args = [str(runs), f"--cache={cache}", f"--out={out}"]
    assert posthoc.main([*args, f"--test={tree / 'val'}", "--logits"]) == 0  # val/ is these fits' test split
    printed = capsys.readouterr().out
    assert "| ce (1) |" in printed and "| logit_adjusted − ce | cross-fitted |" in printed
    record = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the record"))
    assert set(record["analyses"]) == {"ce/seed0", "logit_adjusted/seed0"}
    for method in ("ce", "logit_adjusted"):
        run = runs / method / "frac1" / "seed0"
        analysis, results = record["analyses"][f"{method}/seed0"], json.loads((run / "results.json").read_text())
        assert analysis["delta0"]["top1"] == pytest.approx(100 * results["test"]["top1"], abs=0.1)
        digest = hashlib.sha256((run / "checkpoints" / "best.ckpt").read_bytes()).hexdigest()
        assert analysis["checkpoint_sha256"] == digest and (cache / f"{method}-seed0.npz").is_file()
        assert len(analysis["sweep"]["top1"]) == len(posthoc.GRID)
    with pytest.raises(SystemExit, match=r"^lt_posthoc: .*record.json exists: give another --out"):
        posthoc.main(args)
    cached = dict(np.load(cache / "ce-seed0.npz"))
    hits = cached["logits"].argmax(1) == cached["labels"]
    cached["logits"] = np.eye(4, dtype=np.float32)[(cached["labels"] + hits.all()) % 4] * 5  # another top-1
    np.savez(cache / "ce-seed0.npz", **cached)
    with pytest.raises(SystemExit, match=r"^lt_posthoc: .*ce/frac1/seed0: top-1 .* not the run's test"):
        posthoc.main([str(runs), f"--cache={cache}"])
    with pytest.raises(SystemExit, match=r"^lt_posthoc: not a folder: .*missing"):
        posthoc.main([str(tmp_path / "missing"), f"--cache={cache}"])
    with pytest.raises(SystemExit, match=r"^lt_posthoc: --logits needs --test"):
        posthoc.main([str(runs), f"--cache={cache}", "--logits"])
