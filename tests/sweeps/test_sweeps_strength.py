"""benchmarks/strength_gain.py (issue 41, part 2): the frozen-feature scores of each checkpoint column of a bench
spec, and each method's paired gain over CE-tuning against the checkpoint's kNN top-1."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import yaml
from sweep_helpers import data_root, fabricate

from benchmark_scripts import load_benchmark
from coretune.sweeps import BenchSpec

ROOT = Path(__file__).resolve().parents[2]
# per (objective, checkpoint): test top-1 of seeds 0 1 2 (fractions); core − ce per seed on "strong": +2, +3, +4
TOP1 = {
    ("ce", "weak"): [0.50, 0.52, 0.54],
    ("ce_mix", "weak"): [0.49, 0.52, 0.56],
    ("core", "weak"): [0.50, 0.51, None],  # seed 2 unfinished: 2 pairs
    ("ce", "strong"): [0.80, 0.80, 0.80],
    ("ce_mix", "strong"): [0.81, 0.82, 0.83],
    ("core", "strong"): [0.82, 0.83, 0.84],
}


@pytest.fixture
def strength(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("strength_gain", monkeypatch)


def _spec(tmp_path: Path, name: str = "strength", fraction: float = 0.1, strong: str = "strong.pth") -> BenchSpec:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "output": str(tmp_path / name),
        "base_args": [f"--data.root={data_root(tmp_path)}", "--data.image_size=32", "--model.weights=base.pth"],
        "datasets": {"weak": ["--model.weights=null"], "strong": [f"--model.weights={strong}"]},
        "objectives": ["ce", "ce_mix", "core"], "label_fractions": [fraction], "seeds": [0, 1, 2],
    }, sort_keys=False))  # fmt: skip
    return BenchSpec.from_yaml(path)


def test_evaluate_scores_each_checkpoint_once_with_its_weights_or_none(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(strength, "coretune", calls.append)
    spec, out = _spec(tmp_path), tmp_path / "eval"
    strength.evaluate([spec], out)
    data = [f"--data.root={tmp_path / 'data'}", "--data.image_size=32", "--data.batch_size=256"]
    seeded = "--seed=0"  # the random initialisation: the same network on every call
    assert calls == [
        # null weights: a random initialisation
        ["eval", "knn", "--model.backbone=resnet18", *data, seeded, f"--output={out / 'weak-knn.json'}"],
        ["eval", "linear", "--model.backbone=resnet18", *data, seeded, f"--output={out / 'weak-linear.json'}"],
        ["eval", "knn", "--model.backbone=resnet18", "--model.weights=strong.pth", *data, seeded,
         f"--output={out / 'strong-knn.json'}"],
        ["eval", "linear", "--model.backbone=resnet18", "--model.weights=strong.pth", *data, seeded,
         f"--output={out / 'strong-linear.json'}"],
    ]  # fmt: skip
    out.mkdir()
    for name, top1 in (("weak-knn", 0.2), ("weak-linear", 0.3), ("strong-knn", 0.6)):
        (out / f"{name}.json").write_text(json.dumps({"top1": top1, "seed": 0}))
    calls.clear()
    strength.evaluate([spec], out)  # resumes: only the missing file
    assert [c[1] for c in calls] == ["linear"] and calls[0][-1] == f"--output={out / 'strong-linear.json'}"
    capsys.readouterr()
    (out / "strong-knn.json").unlink()
    calls.clear()
    strength.evaluate([spec], out, columns=["weak"])  # only the column on this machine: the other is not named
    assert calls == [] and capsys.readouterr().out.endswith(
        "strongest by kNN top-1 so far: weak (20.00%); kNN top-1 of each: weak 20.00; not scored yet: strong\n"
    )
    (out / "strong-knn.json").write_text(json.dumps({"top1": 0.6, "seed": 0}))
    strength.evaluate([spec], out, columns=["weak"])
    # and names the strongest by kNN, the 1% spec's last column
    assert capsys.readouterr().out.endswith(
        "strongest by kNN top-1: strong (60.00%); kNN top-1 of each: weak 20.00, strong 60.00\n"
    )


def test_a_column_of_two_specs_is_scored_once_and_the_strongest_named_once(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(strength, "coretune", calls.append)
    specs, out = [_spec(tmp_path), _spec(tmp_path, "strength_1pct", 0.01)], tmp_path / "eval"
    strength.evaluate(specs, out)
    assert [(c[1], c[-1].rsplit("/", 1)[-1]) for c in calls] == [
        ("knn", "weak-knn.json"), ("linear", "weak-linear.json"), ("knn", "strong-knn.json"),
        ("linear", "strong-linear.json"),
    ]  # fmt: skip
    out.mkdir()
    for name, top1 in (("weak", 0.2), ("strong", 0.6)):
        (out / f"{name}-knn.json").write_text(json.dumps({"top1": top1, "seed": 0}))
    capsys.readouterr()
    strength.evaluate(specs, out, columns=["strong"])
    assert capsys.readouterr().out.count("strongest by kNN top-1") == 1  # the queue reads one line
    # a column that reads another checkpoint in the second spec is refused, nothing scored
    calls.clear()
    with pytest.raises(strength.BenchSpecError, match=r"column strong reads .*strong\.pth.* and .*other\.pth"):
        strength.evaluate([specs[0], _spec(tmp_path, "other", 0.01, "other.pth")], out)
    assert calls == []


def test_refuse_stale_stops_when_a_finished_run_fine_tuned_another_file(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Scores moved aside after a re-made checkpoint, one column's runs forgotten: the queue must stop before it
    scores the new file and fine-tunes the missing seeds beside runs of the old one."""
    monkeypatch.chdir(tmp_path)
    calls: list[list[str]] = []
    monkeypatch.setattr(strength, "coretune", calls.append)
    spec, out = _spec(tmp_path), tmp_path / "eval"
    (tmp_path / "strong.pth").write_bytes(b"epoch 15 of a second pre-training")
    fabricate(spec, {(o, d, 0.1): v for (o, d), v in TOP1.items()})
    run = next(r for r in spec.runs() if (r.dataset, r.objective, r.seed) == ("strong", "core", 1))
    results = run.run_dir / "results.json"
    results.write_text(json.dumps({**json.loads(results.read_text()), "weights_sha256": "b" * 64}))
    with pytest.raises(SystemExit, match=r"strong/core/frac0\.1/seed1 fine-tuned another file \(SHA-256 b{64}\)"):
        strength.evaluate([spec], out, refuse_stale=True)
    assert calls == [] and not out.exists()
    strength.evaluate([spec], out)  # by hand, without --refuse_stale: scored, and the run named to re-run
    assert len(calls) == 4 and "seed1 fine-tuned another file (SHA-256 bbbb" in capsys.readouterr().out
    today = hashlib.sha256((tmp_path / "strong.pth").read_bytes()).hexdigest()
    results.write_text(json.dumps({**json.loads(results.read_text()), "weights_sha256": today}))
    assert strength.runs_from_another_file([spec], strength.columns_of([spec])) == []


def test_evaluate_refuses_an_unknown_column_in_one_line(
    strength: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _spec(tmp_path)
    with pytest.raises(SystemExit):
        strength.main(["evaluate", str(tmp_path / "strength.yaml"), "--only_datasets", "medium"])
    assert "medium not in the spec" in capsys.readouterr().err


def test_a_checkpoint_remade_after_scoring_is_scored_again_and_refused_by_plot(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the spec's strong.pth is relative: here
    spec, out = _spec(tmp_path), tmp_path / "eval"
    weights = tmp_path / "strong.pth"
    weights.write_bytes(b"epoch 15 of a first pre-training")
    out.mkdir()
    scored = hashlib.sha256(weights.read_bytes()).hexdigest()
    for name in ("weak-knn", "weak-linear", "strong-knn", "strong-linear"):
        (out / f"{name}.json").write_text(
            json.dumps({"top1": 0.5, "weights_sha256": None if "weak" in name else scored, "seed": 0})
        )
    calls: list[list[str]] = []
    monkeypatch.setattr(strength, "coretune", calls.append)
    strength.evaluate([spec], out)
    assert calls == []  # the same file: kept
    strength.gains([spec], out)
    weights.write_bytes(b"epoch 15 of a second pre-training")  # re-made: the old kNN no longer describes it
    kept = {p.name: p.read_text() for p in out.iterdir()}
    with pytest.raises(SystemExit, match=r"re-made since scored.*strong: .*strong-knn\.json scored another file"):
        strength.evaluate([spec], out, refuse_stale=True)  # the queue's way: stop, overwrite nothing
    assert calls == [] and {p.name: p.read_text() for p in out.iterdir()} == kept
    strength.evaluate([spec], out)
    assert [(c[1], c[-1]) for c in calls] == [
        ("knn", f"--output={out / 'strong-knn.json'}"),
        ("linear", f"--output={out / 'strong-linear.json'}"),
    ]
    with pytest.raises(SystemExit, match=rf"{out / 'strong-knn.json'} scored another file than today's strong.pth"):
        strength.gains([spec], out)
    # a random initialisation scored before --seed (each call drew another network) is scored again
    calls.clear()
    (out / "weak-linear.json").write_text(json.dumps({"top1": 0.5, "weights_sha256": None}))
    strength.evaluate([spec], out)
    assert [(c[1], c[-1]) for c in calls[:2]] == [
        ("knn", f"--output={out / 'weak-knn.json'}"),
        ("linear", f"--output={out / 'weak-linear.json'}"),
    ]


def test_gains_are_paired_by_seed_and_core_is_also_compared_with_ce_mix(strength: ModuleType, tmp_path: Path) -> None:
    spec, out = _spec(tmp_path), tmp_path / "eval"
    fabricate(spec, {(o, d, 0.1): v for (o, d), v in TOP1.items()})
    out.mkdir()
    for name, knn in (("weak", 0.2), ("strong", 0.6)):
        (out / f"{name}-knn.json").write_text(json.dumps({"top1": knn, "seed": 0}))
    (out / "strong-linear.json").write_text(json.dumps({"top1": 0.7, "seed": 0}))
    rows = {(r.checkpoint, r.method): r for r in strength.gains([spec], out)}
    strong = rows[("strong", "core")]
    assert (strong.knn, strong.linear, strong.top1, strong.baseline_top1) == pytest.approx((60, 70, 83, 80))
    assert (strong.gain.mean, strong.gain.std, strong.gain.pairs) == pytest.approx((3.0, 1.0, 3))
    assert (strong.beyond_mix.mean, strong.beyond_mix.pairs) == pytest.approx((1.0, 3))
    assert strong.beyond_mix.std == pytest.approx(0.0, abs=1e-9)
    weak = rows[("weak", "core")]  # seeds 0 and 1 only: 0 and −1 pp, and both means over those two seeds
    assert (weak.gain.mean, weak.gain.pairs) == pytest.approx((-0.5, 2)) and math.isnan(weak.linear)
    assert (weak.top1, weak.baseline_top1) == pytest.approx((50.5, 51.0))
    assert rows[("weak", "ce_mix")].beyond_mix is None
    table = strength.markdown(list(rows.values()))
    lines = table.splitlines()
    assert lines[2].startswith("| 10% | weak | 20.00 | – | 52.00 | ce_mix |")  # weakest (kNN) first
    # p: the paired t-test, t = 3 / (1 / √3) on 2 degrees of freedom; no p for differences without spread
    row = "| 10% | strong | 60.00 | 70.00 | 80.00 | core | 83.00 | +3.00 ± 1.00 (n=3, p = 0.035) | +1.00 ± 0.00 (n=3) |"
    assert row in lines
    png = strength.figure(list(rows.values()), tmp_path / "img" / "gain.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a record that names the file it fine-tuned (results.json's weights_sha256) must name the one scored
    (out / "strong-knn.json").write_text(json.dumps({"top1": 0.6, "seed": 0, "weights_sha256": "a" * 64}))
    run = next(r for r in spec.runs() if (r.dataset, r.objective, r.seed) == ("strong", "core", 1))
    results = run.run_dir / "results.json"
    results.write_text(json.dumps({**json.loads(results.read_text()), "weights_sha256": "a" * 64}))
    assert len(strength.gains([spec], out)) == len(rows)
    results.write_text(json.dumps({**json.loads(results.read_text()), "weights_sha256": "b" * 64}))
    with pytest.raises(SystemExit, match=r"^strong/core/frac0\.1/seed1 fine-tuned another file \(SHA-256 b{64}\)"):
        strength.gains([spec], out)


def test_plot_command_writes_the_table_and_the_figure(
    strength: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path)
    fabricate(spec, {(o, d, 0.1): v for (o, d), v in TOP1.items()})
    unfinished = next(r.run_dir for r in spec.runs() if (r.objective, r.dataset, r.seed) == ("core", "weak", 2))
    unfinished.mkdir(parents=True)
    (unfinished / "results.json").write_text(json.dumps({"diverged": "the training loss is nan at epoch 3 …"}))
    table, png, scores = tmp_path / "table.md", tmp_path / "gain.png", tmp_path / "scores"
    # without a score (evaluate not run, or another --eval_dir): one line, no figure of nothing
    with pytest.raises(SystemExit) as info:
        strength.main(["plot", str(tmp_path / "strength.yaml"), f"--eval_dir={scores}", f"--figure={png}"])
    assert info.value.code == 2 and not png.exists()
    assert f"no kNN score of any column in {scores}: run `strength_gain.py evaluate` first" in capsys.readouterr().err
    scores.mkdir()
    (scores / "weak-knn.json").write_text(json.dumps({"top1": 0.2, "seed": 0}))
    strength.main(["plot", str(tmp_path / "strength.yaml"), f"--eval_dir={scores}", f"--figure={png}",
                   f"--markdown={table}", "--footnote=weak: scored at another size"])  # fmt: skip
    assert png.is_file()
    assert "| 10% | strong | – | – | 80.00 | core | 83.00 | +3.00 ± 1.00 (n=3, p = 0.035) |" in table.read_text()
    # a divergence is a finding about its checkpoint, not a missing seed; the caveat follows
    assert table.read_text().endswith(
        "\nDiverged or collapsed (not in the gains):\n- weak/core/10%/seed 2: the training loss is nan at epoch 3 …\n"
        "\nweak: scored at another size\n"
    )
    assert strength.diverged_runs([spec]) == [("weak", "core", 0.1, 2, "the training loss is nan at epoch 3 …")]
    # a run folder started with other fit arguments: one line naming it, not a traceback (nothing written)
    run = next(r for r in spec.runs() if (r.objective, r.dataset, r.seed) == ("ce", "strong", 0))
    (run.run_dir / "fit_args.json").write_text(json.dumps(["--trainer.max_epochs=3"]))
    png.unlink()
    with pytest.raises(SystemExit) as info:
        strength.main(["plot", str(tmp_path / "strength.yaml"), f"--eval_dir={scores}", f"--figure={png}"])
    assert info.value.code == 2 and not png.exists()
    assert f"error: run directory {run.run_dir} was started with other fit arguments" in capsys.readouterr().err


def test_the_figure_marks_few_seeds_diverged_runs_the_checkpoints_and_the_caveat(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figure to look at it
    spec, out = _spec(tmp_path), tmp_path / "eval"
    fabricate(spec, {(o, d, 0.1): v for (o, d), v in TOP1.items()})
    out.mkdir()
    for name, knn in (("weak", 0.2), ("strong", 0.6)):
        (out / f"{name}-knn.json").write_text(json.dumps({"top1": knn, "seed": 0}))
    lost = [("weak", "core", 0.1, 2, "the training loss is nan")]
    strength.figure(strength.gains([spec], out), tmp_path / "gain.png", diverged=lost, footnote="weak: a caveat")
    (ax,) = [a for a in drawn[0].axes if a.get_xlabel()]
    (top,) = [child for child in ax.child_axes if child.get_xticklabels()]  # the checkpoints' names, along the top
    labels = ax.get_legend().get_texts()
    assert {t.get_text() for t in labels} == {
        "ce_mix − ce, 10% labels",  # core's divergence is not on this line
        "core − ce, 10% labels (1 diverged run(s) on this line)",
        "core − ce_mix, 10% labels (1 diverged run(s) on this line)",
    }
    hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
    # weak's core rests on 2 paired seeds where every other point has 3: hollow on both of core's lines, which are
    # drawn second and third of three and so set 0 and +0.4 (1% of the kNN range 20-60) to the side of kNN 20
    hollow_points = sorted(tuple(line.get_xydata()[0]) for line in hollow)
    assert hollow_points == [(20.0, -0.5), (pytest.approx(20.4), 0.0)]
    assert "set apart sideways by up to ±0.4 kNN points" in ax.get_title()
    assert [t.get_text() for t in top.get_xticklabels()] == ["weak", "strong"]
    assert [t.get_text() for t in drawn[0].texts] == ["weak: a caveat"]
    # one colour per comparison, Core-tuning's own contribution (over ce_mix) in black; 10% of the labels solid
    series = {(line.get_color(), line.get_linestyle()) for line in ax.get_lines() if _a_series(line)}
    assert series == {("C0", "-"), ("C1", "-"), ("black", "-")}


def test_the_lines_are_set_apart_around_the_true_score(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dodging: the lines are spaced 1% of the kNN range apart in the order drawn, centred on the true score; one line,
    or one score only, is not moved."""
    dodge = load_benchmark("strength_figure", monkeypatch).dodge
    keys = [("a", 0.1), ("b", 0.1), ("c", 0.01), ("d", 0.01)]
    shift = dodge(keys, [30.0, 70.0, math.nan])
    assert [shift[k] for k in keys] == pytest.approx([-0.6, -0.2, 0.2, 0.6])
    assert sum(shift.values()) == pytest.approx(0.0)
    assert dodge([("a", 0.1)], [30.0, 70.0]) == {("a", 0.1): 0.0}
    assert set(dodge(keys, [50.0, 50.0]).values()) == {0.0}


def _a_series(line: Any) -> bool:
    """A drawn line of the figure: not an error bar's cap, a hollow marker or the zero line."""
    return line.get_linestyle() != "None" and line.get_color() != "grey"


def test_a_comparison_keeps_its_colour_across_label_fractions(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 1% line of a comparison is its 10% line's colour, dashed with squares: the reader pairs them at a glance."""
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    gain = strength.Gain(1.0, 0.5, 3)
    rows = [
        strength.Row(name, fraction, knn, math.nan, method, 60.0, 59.0, gain, gain if method == "core" else None)
        for fraction in (0.1, 0.01)
        for name, knn in (("weak", 20.0), ("strong", 60.0))
        for method in ("ce_mix", "core")
    ]
    strength.figure(rows, tmp_path / "gain.png")
    (ax,) = [a for a in drawn[0].axes if a.get_xlabel()]
    lines = [line for line in ax.get_lines() if _a_series(line)]
    assert sorted((line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines) == sorted(
        (colour, style, marker) for colour in ("C0", "C1", "black") for style, marker in (("-", "o"), ("--", "s"))
    )


def test_the_trend_is_the_least_squares_line_of_the_checkpoints_mean_gains(strength: ModuleType) -> None:
    """The slope against a loop over the normal equations on the checkpoints' mean gains (the checkpoints are the
    replicates): b = Σ(x − x̄)(y − ȳ) / Σ(x − x̄)², its standard error s / √Σ(x − x̄)² with s² = Σ residual² / (n − 2),
    and p from t = b / se on n − 2 degrees of freedom. A checkpoint without a kNN score, or a series with fewer than 3
    checkpoints (the 1% rows: the floor and the strongest), has no trend; a line through the means exactly has no p;
    a checkpoint with fewer paired seeds than the others (a column still running) is left out and counted."""
    from scipy.stats import t as student

    def gain(*values: float) -> Any:
        return strength.Gain(float(np.mean(values)), float(np.std(values, ddof=1)), len(values), math.nan, values)

    over_ce = {20.0: (-1.0, -0.5, 0.0), 40.0: (0.0, 0.5, 0.0), 55.0: (0.5, 1.0), 60.0: (1.0, 2.0, 1.5)}
    over_mix = {20.0: (0.0, 0.0, 0.0), 40.0: (1.0, 1.0, 1.0), 55.0: (1.75, 1.75), 60.0: (2.0, 2.0, 2.0)}  # on a line
    rows = [
        strength.Row(f"c{knn:g}", 0.1, knn, math.nan, "core", 60.0, 59.0, gain(*values), gain(*over_mix[knn]))
        for knn, values in over_ce.items()
    ]
    rows += [strength.Row("unscored", 0.1, math.nan, math.nan, "core", 60.0, 59.0, gain(9.0, 9.5), gain(9.0, 9.5))]
    rows += [strength.Row(f"c{k:g}", 0.01, k, math.nan, "core", 50.0, 49.0, gain(1.0, 2.0), None) for k in (20.0, 60.0)]
    found = {(t.comparison, t.label_fraction): t for t in strength.trends(rows)}
    assert sorted(found) == [("core − ce", 0.1), ("core − ce_mix", 0.1)]
    xs = [knn for knn, values in over_ce.items() if len(values) == 3]  # 55: two seeds, left out
    ys = [float(np.mean(over_ce[knn])) for knn in xs]
    n, x_bar, y_bar = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - x_bar) ** 2 for x in xs)
    b = sum((x - x_bar) * (y - y_bar) for x, y in zip(xs, ys, strict=True)) / sxx
    residuals = [y - (y_bar + b * (x - x_bar)) for x, y in zip(xs, ys, strict=True)]
    se = math.sqrt(sum(r * r for r in residuals) / (n - 2) / sxx)
    p = 2 * student.sf(abs(b / se), n - 2)
    over = found[("core − ce", 0.1)]
    measured = (over.slope, over.slope_se, over.p, over.checkpoints, over.pairs)
    assert measured == pytest.approx((10 * b, 10 * se, p, 3, 9)) and over.left_out == 1
    exact = found[("core − ce_mix", 0.1)]  # 0.05 pp a kNN point, through every mean
    assert exact.slope == pytest.approx(0.5) and math.isnan(exact.p)
    table = strength.trend_table(list(found.values()))
    left_out = "; 1 with fewer paired seeds left out"
    assert f"| 10% | core − ce | kNN | {10 * b:+.2f} ± {10 * se:.2f} | {p:.3f} | 3 (9){left_out} |" in table
    assert f"| 10% | core − ce_mix | kNN | +0.50 ± 0.00 | – | 3 (9){left_out} |" in table
    assert strength.trend_table([]) == ""
    # a seed of c55 diverged: a finding about that checkpoint, not an unfinished column: it stays in the fit
    (kept, _) = strength.trends(rows, diverged=[("c55", "core", 0.1, 2, "")])
    assert (kept.comparison, kept.checkpoints, kept.pairs, kept.left_out) == ("core − ce", 4, 11, 0)
    # two of three checkpoints still running: no line through one, the counts still shown
    few = [r for r in rows if r.knn in (20.0, 55.0) or (r.knn == 40.0 and r.label_fraction == 0.1)]
    few = [strength.Row(**{**r.__dict__, "gain": gain(0.0, 1.0)}) if r.knn == 40.0 else r for r in few]
    (short,) = [t for t in strength.trends(few) if t.comparison == "core − ce"]
    assert math.isnan(short.slope) and (short.checkpoints, short.left_out) == (1, 2)
    short_line = "| 10% | core − ce | kNN | – (fewer than 3 checkpoints) | – | 1 (3); 2 with fewer paired seeds left "
    short_line += "out |"
    assert short_line in strength.trend_table([short])
    # against the linear probe (here the kNN shifted by 5 points: the same slope), named as such
    shifted = [strength.Row(**{**r.__dict__, "linear": r.knn + 5}) for r in rows]
    (probe, _) = strength.trends(shifted, axis="linear")
    assert (probe.axis, probe.slope, probe.p) == pytest.approx(("linear", 10 * b, p))
    assert f"| 10% | core − ce | linear probe | {10 * b:+.2f} ± " in strength.trend_table([probe])
    assert strength.trends(rows, axis="linear") == []  # no probe scores: no trend


def test_a_fragile_pick_of_the_strongest_is_noted(strength: ModuleType, tmp_path: Path) -> None:
    # the strongest column gets the 1% runs: a runner-up within the test set's noise, or a probe that disagrees,
    # makes the pick worth a second look
    for name, top1 in (("a", 0.5), ("b", 0.495), ("c", 0.3)):
        (tmp_path / f"{name}-linear.json").write_text(json.dumps({"top1": top1}))
    assert strength.fragile_pick({"a": 60.0, "b": 55.0, "c": 40.0}, tmp_path) is None
    assert strength.fragile_pick({"a": 60.0, "b": 59.5, "c": 40.0}, tmp_path) == (
        "note: the pick of a is fragile: the runner-up b is 0.50 pp behind, within the test set's noise"
    )
    assert strength.fragile_pick({"a": 50.0, "b": 60.0, "c": 40.0}, tmp_path) == (
        "note: the pick of b is fragile: the linear probe ranks a first (50.00% against 49.50%)"
    )
    assert strength.fragile_pick({"a": 50.0, "b": 60.0, "d": 45.0}, tmp_path) is None  # d has no probe score
    assert strength.fragile_pick({"a": 50.0}, tmp_path) is None


def test_the_table_names_the_strongest_pick_its_fewer_labels_columns_and_a_fragile_pick(
    strength: ModuleType, tmp_path: Path
) -> None:
    """The note ``evaluate`` prints when the pick of the 1% column is fragile reached only the queue's log: the
    committed table now says which columns the fewer-labels rows cover, and why the pick may be fragile."""
    ten, one, out = _spec(tmp_path), _spec(tmp_path, "one", 0.01), tmp_path / "eval"
    fabricate(ten, {(o, d, 0.1): v for (o, d), v in TOP1.items()})
    fabricate(one, {(o, "strong", 0.01): v for (o, d), v in TOP1.items() if d == "strong"} | {
        (o, "weak", 0.01): [None] * 3 for o in ("ce", "ce_mix", "core")})  # fmt: skip
    out.mkdir()
    (out / "weak-knn.json").write_text(json.dumps({"top1": 0.2, "seed": 0}))
    rows = strength.gains([ten, one], out)
    assert strength.pick_text([ten, one], out, rows) == ""  # strong not scored: no pick yet
    (out / "strong-knn.json").write_text(json.dumps({"top1": 0.6, "seed": 0}))
    rows = strength.gains([ten, one], out)
    text = "\nStrongest checkpoint by kNN top-1: strong (60.00%). 1% of the labels: strong.\n"
    assert strength.pick_text([ten, one], out, rows) == text
    for name, top1 in (("weak", 0.7), ("strong", 0.5)):  # the probe ranks weak first
        (out / f"{name}-linear.json").write_text(json.dumps({"top1": top1}))
    assert strength.pick_text([ten, one], out, rows) == text.replace(
        ".\n", ". Note: the pick of strong is fragile: the linear probe ranks weak first (70.00% against 50.00%).\n"
    )


def test_columns_are_scored_as_they_are_fine_tuned(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the fit's image size and normalisation, from its --config file or its options (the last one wins), reach
    # coretune eval; a score at another image size or normalisation than the column's is stale
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({"model": {"weights": None}, "data": {"image_size": 48, "mean": [0.5, 0.5, 0.5]}}))
    spec = _spec(tmp_path)
    configured = replace(spec, base_args=(f"--config={config}", *spec.base_args[:1]))
    assert strength.checkpoints(configured)["strong"] == [
        "--model.backbone=resnet18", "--model.weights=strong.pth", f"--data.root={tmp_path / 'data'}",
        "--data.image_size=48", "--data.mean=[0.5,0.5,0.5]", "--data.batch_size=256",
    ]  # fmt: skip
    overridden = replace(configured, base_args=(*configured.base_args, "--data.image_size=32", "--data.std=[.2,.2,.2]"))
    assert strength.checkpoints(overridden)["weak"][-4:] == [
        "--data.image_size=32", "--data.mean=[0.5,0.5,0.5]", "--data.std=[.2,.2,.2]", "--data.batch_size=256"
    ]  # fmt: skip
    for args, why in (
        (("--config", str(config)), "give a column's config file as one argument, --config=FILE"),
        ((f"--config={tmp_path / 'gone.yaml'}",), "the config file of the specs' fits, is not there"),
    ):
        with pytest.raises(strength.BenchSpecError, match=re.escape(why)):
            strength.checkpoints(replace(spec, base_args=args))
    # the study's own specs (their --config sets 64 px; their options 32 px, and no normalisation)
    monkeypatch.chdir(ROOT)
    for name in ("cifar10_cpu_strength", "cifar10_cpu_strength_1pct"):
        found = strength.checkpoints(BenchSpec.from_yaml(ROOT / "configs" / "bench" / f"{name}.yaml"))
        assert found["random"] == [
            "--model.backbone=resnet18", "--data.root=/work/data/cifar10", "--data.image_size=32",
            "--data.batch_size=256",
        ]  # fmt: skip
        assert found["simclr_in20"][1] == "--model.weights=../shared/checkpoints/simclr_resnet18_in20_64px.pth.tar"
    args = strength.checkpoints(spec)["weak"]
    scores = tmp_path / "weak-knn.json"
    scores.write_text(json.dumps({"top1": 0.2, "seed": 0}))  # older files: neither size nor normalisation
    assert strength.stale(tmp_path, "weak", args) is None
    scores.write_text(json.dumps({"top1": 0.2, "seed": 0, "image_size": 32, "mean": [0.485, 0.456, 0.406]}))
    assert strength.stale(tmp_path, "weak", args) is None
    scores.write_text(json.dumps({"top1": 0.2, "seed": 0, "image_size": 64}))
    assert strength.stale(tmp_path, "weak", args) == f"{scores} scored 64-px images, the column's are 32 px"
    scores.write_text(json.dumps({"top1": 0.2, "seed": 0, "mean": [0.5, 0.5, 0.5]}))
    assert strength.stale(tmp_path, "weak", args) == (
        f"{scores} scored images normalised with mean [0.5, 0.5, 0.5], the column's mean is [0.485, 0.456, 0.406]"
    )


def test_a_vit_column_is_scored_with_the_backbone_args_it_is_fine_tuned_with(
    strength: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a ViT pre-trained at 32 px with 4-px patches: eval builds it as the fits do, or its weights do not fit
    spec = _spec(tmp_path)
    vit = ("--model.backbone=vit_tiny_patch16_224", "--model.backbone_args={img_size: 32, patch_size: 4}")
    column = replace(spec, datasets={"vit": (*vit, "--model.drop_path=0.1", "--model.weights=vit.pth")})
    args = strength.checkpoints(column)["vit"]
    assert args[:3] == [vit[0], '--model.backbone_args={"img_size": 32, "patch_size": 4}', "--model.weights=vit.pth"]
    config = tmp_path / "vit.yaml"  # a --config file's, then one option by name (the last one wins, as in a fit)
    config.write_text(yaml.safe_dump({"model": {"backbone_args": {"img_size": 48, "patch_size": 16}}}))
    dotted = replace(spec, datasets={"vit": (f"--config={config}", "--model.backbone_args.patch_size=4")})
    assert strength.checkpoints(dotted)["vit"][1] == '--model.backbone_args={"img_size": 48, "patch_size": 4}'
    with pytest.raises(strength.BenchSpecError, match=r"--model.backbone_args must be a mapping of options"):
        strength.checkpoints(replace(spec, datasets={"vit": ("--model.backbone_args=[32]",)}))
    scores = tmp_path / "vit-knn.json"
    scores.write_text(json.dumps({"top1": 0.2, "seed": 0, "backbone_args": {"img_size": 32, "patch_size": 4}}))
    assert strength.stale(tmp_path, "vit", args) is None
    scores.write_text(json.dumps({"top1": 0.2, "seed": 0}))  # scored before eval took the options
    assert strength.stale(tmp_path, "vit", args) == (
        f"{scores} scored the backbone built with no options, the column's with {{'img_size': 32, 'patch_size': 4}}"
    )
    monkeypatch.chdir(ROOT)  # the Table 4 spec's ViT column
    table4 = strength.checkpoints(BenchSpec.from_yaml(ROOT / "configs" / "bench" / "cifar10_cpu_10pct_table4.yaml"))
    assert table4["vit_tiny_moco_v3"][:2] == [vit[0], '--model.backbone_args={"img_size": 32, "patch_size": 4}']
    assert not any(a.startswith("--model.backbone_args") for a in table4["resnet18_simclr_e15"])
