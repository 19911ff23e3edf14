"""The report: mean ± std tables in the paper's layouts, the curves, and the command's --dry_run / --aggregate_only."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from sweep_helpers import data_root, fabricate, spec_of

from coretune.cli import main
from coretune.sweeps import BenchSpec, BenchSpecError, collect_curves, curves_metric, table_layout, write_summary
from coretune.sweeps.plots import _plot_label


def test_aggregation_is_mean_and_sample_std(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, seeds=[0, 1, 2], datasets={"a": [], "b": []})
    values = {
        ("ce", "a", 1.0): [0.80, 0.82, 0.87],
        ("core", "a", 1.0): [0.90, 0.91, 0.95],
        ("ce", "b", 1.0): [0.50, 0.60, None],  # one seed unfinished
        ("core", "b", 1.0): [0.70, None, None],
    }
    fabricate(spec, values)
    markdown, paths = write_summary(spec)
    assert {p.name for p in paths} == {"runs.csv", "summary.csv", "summary.md", "bars.png"}
    # Δ = 92 − 83; s_p² = (2·13 + 2·7) / 4; paired 10, 9, 8 → t = 9 / (1 / √3); cell b pairs seed 0 only
    assert "| a | core | +9.00 | 6.32 | yes | +10.00 / +9.00 / +8.00 | 15.6 (0.0041) |" in markdown
    assert "| b | core | +15.00 | – | n/a | +20.00 | – |" in markdown
    summary = {r["objective"]: r for r in csv.DictReader((spec.output / "summary.csv").open())}
    for (objective, dataset, _), seeds in values.items():
        done = 100 * np.array([v for v in seeds if v is not None])
        row = summary[objective]
        assert float(row[f"{dataset} mean (%)"]) == pytest.approx(done.mean(), abs=1e-4)
        assert int(row[f"{dataset} n"]) == len(done)
        if len(done) > 1:
            assert float(row[f"{dataset} std (%)"]) == pytest.approx(done.std(ddof=1), abs=1e-4)
        else:
            assert row[f"{dataset} std (%)"] == ""
    # Table 1 layout: methods × data sets + the average of the cell means; best mean in bold
    assert "| Method | a | b | Avg. |" in markdown
    assert "| ce | 83.00 ± 3.61 (n=3) | 55.00 ± 7.07 (n=2) | 69.00 |" in markdown
    assert "| core | **92.00 ± 2.65 (n=3)** | **70.00 (n=1)** | 81.00 |" in markdown
    # core − ce on a: Δ = 9, s_p = sqrt((2·13 + 2·7)/4) = sqrt(10), 2 s_p = 6.32 → beyond 2σ; b has n = 1
    assert "| a | core | +9.00 | 6.32 | yes |" in markdown
    assert "| b | core | +15.00 | – | n/a |" in markdown
    runs = list(csv.DictReader((spec.output / "runs.csv").open()))
    assert [r["status"] for r in runs if r["dataset"] == "b" and r["objective"] == "core"] == ["finished"] + [
        "missing"
    ] * 2


def test_curves_are_the_per_epoch_mean_and_std_over_finished_seeds(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, seeds=[0, 1, 2], label_fractions=[0.1, 1.0])
    rng = np.random.default_rng(0)
    curves: dict[tuple[str, float, int], list[float | None]] = {}  # per run: val/top1 per epoch (None: not validated)
    for run in spec.runs():
        curve = [float(v) for v in rng.uniform(0.3, 0.9, size=4)]
        if run.seed == 2:
            curve[1] = None  # this seed validated every other epoch only
        curves[(run.objective, run.label_fraction, run.seed)] = curve
        run.run_dir.mkdir(parents=True)
        rows = "".join(f"{e},{'' if v is None else v}\n" for e, v in enumerate(curve))
        (run.run_dir / "metrics.csv").write_text("epoch,val/top1\n" + rows)
        if (run.objective, run.label_fraction, run.seed) != ("core", 0.1, 1):  # one unfinished run: left out
            # no validation split (seed 1: a record from before results.json said so)
            on_test = {"validated_on_test_images": True} if run.seed != 1 else {}
            (run.run_dir / "results.json").write_text(json.dumps({"test": {"top1": 0.5}, **on_test}))
    _, paths = write_summary(spec)
    assert (spec.output / "curves.png") in paths and (spec.output / "curves.csv") in paths
    width, height = Image.open(spec.output / "curves.png").size
    assert height > 0.75 * width  # two columns (10%, 100%), two rows of panels: the curves, then the paired Δ
    got = list(csv.DictReader((spec.output / "curves.csv").open()))
    expected = []  # reference: loop over cells and epochs, statistics of the finished seeds that validated
    for objective in ("ce", "core"):
        for fraction in (0.1, 1.0):
            for epoch in range(4):
                seeds = [s for s in (0, 1, 2) if (objective, fraction, s) != ("core", 0.1, 1)]
                values = [100 * v for s in seeds if (v := curves[(objective, fraction, s)][epoch]) is not None]
                deltas = []  # paired with the baseline (ce) on the seeds both finished and validated this epoch
                for s in seeds if objective != "ce" else ():
                    v, b = curves[(objective, fraction, s)][epoch], curves[("ce", fraction, s)][epoch]
                    if v is not None and b is not None:
                        deltas.append(100 * v - 100 * b)
                expected.append((objective, fraction, epoch + 1, len(values), statistics.mean(values), values, deltas))
    assert len(got) == len(expected)
    for row, (objective, fraction, epoch, n, mean, values, deltas) in zip(got, expected, strict=True):
        assert row["baseline"] == "ce"
        if deltas:
            assert int(row["delta_n"]) == len(deltas)
            assert float(row["delta_mean_pp"]) == pytest.approx(statistics.mean(deltas), abs=1e-3)
            if len(deltas) > 1:
                assert float(row["delta_std_pp"]) == pytest.approx(statistics.stdev(deltas), abs=1e-3)
            else:
                assert row["delta_std_pp"] == ""
        else:
            assert row["delta_n"] == row["delta_mean_pp"] == row["delta_std_pp"] == ""
        assert (row["objective"], float(row["label_fraction"]), int(row["epoch"]), int(row["n"])) == (
            objective,
            fraction,
            epoch,
            n,
        )
        assert row["validated_on"] == "test"
        assert float(row["val_top1_mean_pct"]) == pytest.approx(mean, abs=1e-3)
        if n > 1:
            assert float(row["val_top1_std_pct"]) == pytest.approx(statistics.stdev(values), abs=1e-3)
        else:
            assert row["val_top1_std_pct"] == ""
    assert curves_metric(collect_curves(spec)) == "test top-1 (no validation split)"
    # no row to pair with the baseline (a spec of one objective): no Δ columns filled, one row of panels
    solo = spec_of(tmp_path / "solo", objectives=["ce"], label_fractions=[0.1, 1.0], seeds=[0, 1])
    for run in solo.runs():  # 10%: a validation split; 100%: seed 0 on a split, seed 1 on the test images
        on_test = run.label_fraction == 1.0 and run.seed == 1
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n1,0.6\n")
        results = {"test": {"top1": 0.6}, "validated_on_test_images": on_test}
        (run.run_dir / "results.json").write_text(json.dumps(results))
    write_summary(solo)
    solo_curves = list(csv.DictReader((solo.output / "curves.csv").open()))
    assert {r["delta_n"] for r in solo_curves} == {""}
    assert {(r["label_fraction"], r["validated_on"]) for r in solo_curves} == {("0.1", "val"), ("1.0", "mixed")}
    points = collect_curves(solo)
    assert [{k: str(v) for k, v in p.csv_row().items()} for p in points] == solo_curves  # None: blank
    assert curves_metric(points) == "validated top-1 (validation split or test images)"
    assert curves_metric([p for p in points if p.label_fraction == 0.1]) == "validation top-1"
    assert curves_metric([dataclasses.replace(p, validated_on=None) for p in points]).startswith("validated top-1")
    width, height = Image.open(solo.output / "curves.png").size
    assert height < 0.6 * width


def test_a_cell_of_one_seed_has_no_error_bar_or_band(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its std (NaN) was drawn as 0: a bar, point or band of one seed looked perfectly reproducible."""
    from matplotlib.container import BarContainer, ErrorbarContainer
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self))
    spec = spec_of(tmp_path, table="table4", label_fractions=[0.1, 1.0], seeds=[0, 1])
    values = {("ce", 0.1): [0.5, 0.6], ("ce", 1.0): [0.7, None], ("core", 0.1): [0.55, None], ("core", 1.0): [0.8, 0.9]}
    fabricate(spec, {(o, "tiny", f): v for (o, f), v in values.items()})
    for run in spec.runs():
        if run.run_dir.is_dir():
            (run.run_dir / "metrics.csv").write_text(f"epoch,val/top1\n0,0.4\n1,{0.5 + run.seed / 10}\n")
    write_summary(spec)
    bars, fractions, curves = figures
    # bars.png: per row (ce, core), whether each column (10%, 100%) has an error bar; n=1 over the others' bars
    (ax,) = bars.axes
    errors = [c.errorbar.lines[2][0].get_segments() for c in ax.containers if isinstance(c, BarContainer)]
    assert [[len(s) > 0 for s in row] for row in errors] == [[True, False], [False, True]]
    marks = sorted((t.get_text(), t.get_position()[1]) for t in ax.texts)  # at the top of core 10% and ce 100%
    assert marks == [("n=1", pytest.approx(55.0)), ("n=1", pytest.approx(70.0))]
    # label_fraction.png: the same per point
    errors = [c.lines[2][0].get_segments() for c in fractions.axes[0].containers if isinstance(c, ErrorbarContainer)]
    assert [[len(s) > 0 for s in row] for row in errors] == [[True, False], [False, True]]
    # curves.png: a band for the cells of two seeds only (10%: ce; 100%: core); each Δ pairs one seed: no band
    top, _, delta, _ = curves.axes  # 10%, 100% above; their Δ panels below
    assert [bool(c.get_paths()) for c in top.collections] == [True, False]
    assert [bool(c.get_paths()) for c in curves.axes[1].collections] == [False, True]
    assert [bool(c.get_paths()) for ax in (delta, curves.axes[3]) for c in ax.collections] == [False, False]


def test_table2_and_table4_layouts(tmp_path: Path) -> None:
    table2 = spec_of(tmp_path, table="table2", objectives=["core", "ce_mix", "ce", "ce_con_mixh", "ce_con"])
    assert table_layout(table2).rows == [
        ("ce", "CE"),
        ("ce_con", "CE + L_con"),
        ("ce_mix", "CE + mix"),
        ("ce_con_mixh", "CE + L_con + mix-H"),
        ("core", "CE + L^f_con + mix-H (Core-tuning)"),
    ]
    assert table2.baseline == "ce" and table_layout(table2).columns == [(("tiny", 1.0), "tiny")]
    plotted = [_plot_label(label) for _, label in table_layout(table2).rows]
    assert plotted[1] == r"CE + $\mathcal{L}_{con}$" and plotted[4].startswith(r"CE + $\mathcal{L}^f_{con}$ + mix-H")
    tuned = spec_of(tmp_path, table="table2", objectives=["ce", {"name": "core", "args": ["--objective.alpha=10"]}])
    assert tuned.runs()[1].args[-3:] == ("--objective.alpha=10", "--data.label_fraction=1.0", "--seed=0")
    with pytest.raises(BenchSpecError, match="table2 takes the Table 2 rows only"):
        spec_of(tmp_path, table="table2", objectives=[{"name": "core", "objective": "ce"}])

    table4 = spec_of(tmp_path, table="table4", label_fractions=[0.1, 0.25, 1.0], seeds=[0, 1])
    assert [label for _, label in table_layout(table4).columns] == ["10%", "25%", "100%"]
    fabricate(table4, {(o, "tiny", f): [0.5 + f / 4, 0.5 + f / 2] for o in ("ce", "core") for f in (0.1, 0.25, 1.0)})
    markdown, paths = write_summary(table4)
    assert "| Method | 10% | 25% | 100% | Avg. |" in markdown
    assert (table4.output / "label_fraction.png") in paths
    # a second data set joins the columns of Table 1 with several label fractions
    both = spec_of(tmp_path, datasets={"a": [], "b": []}, label_fractions=[0.1, 1.0])
    assert [label for _, label in table_layout(both).columns] == ["a 10%", "a 100%", "b 10%", "b 100%"]


def test_cli_dry_run_and_aggregate_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    config.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"]}))
    main(["bench", str(config), "--dry_run"])
    out = capsys.readouterr().out
    assert "1 runs, 0 finished (skipped), 1 to run" in out
    assert re.search(r"coretune\.cli fit --trainer\.enable_progress_bar=false --data\.root=\S+ --objective ce", out)
    assert not (tmp_path / "out").exists()
    main(["bench", str(config), "--dry_run", "--only_objectives=[ce]", "--only_seeds=[0]"])
    assert "1 runs, 0 finished (skipped), 1 to run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="core, 7 not in the spec"):
        main(["bench", str(config), "--dry_run", "--only_objectives=[core]", "--only_seeds=[7]"])
    main(["bench", str(config), "--aggregate_only"])
    assert "| ce | – |" in (tmp_path / "out" / "summary.md").read_text()
    with pytest.raises(SystemExit, match=r"^coretune bench: error: --baseline 'core' is not a row of the spec"):
        main(["bench", str(config), "--aggregate_only", "--baseline=core"])
    with pytest.raises(SystemExit, match=r"^coretune bench: error: bench spec .*missing\.yaml does not exist$"):
        main(["bench", str(tmp_path / "missing.yaml")])


def test_baseline_option_compares_every_row_with_another(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bench.yaml"
    datasets = {"d": [f"--data.root={data_root(tmp_path)}"]}
    raw = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce", "ce_mix", "core"],
           "seeds": [0, 1]}  # fmt: skip
    config.write_text(yaml.safe_dump(raw))
    fabricate(
        BenchSpec.from_yaml(config),
        {("ce", "d", 1.0): [0.50, 0.52], ("ce_mix", "d", 1.0): [0.60, 0.61], ("core", "d", 1.0): [0.62, 0.64]},
    )
    main(["bench", str(config), "--aggregate_only", "--baseline=ce_mix"])
    markdown = (tmp_path / "out" / "summary.md").read_text()
    assert "## Differences from ce_mix" in markdown
    assert "| d | core | +2.50 |" in markdown and "| d | ce | -9.50 |" in markdown  # paired: +2 / +3, −10 / −9
    assert "+2.00 / +3.00" in markdown
    main(["bench", str(config), "--aggregate_only"])  # the spec's own baseline again
    assert "## Differences from ce" in (tmp_path / "out" / "summary.md").read_text()


def test_only_datasets_runs_some_columns_of_the_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--only_datasets`` picks columns (a checkpoint on this machine), alone or with the other filters."""
    config = tmp_path / "bench.yaml"
    root = f"--data.root={data_root(tmp_path)}"
    datasets = {"a": [root], "b": [root, "--data.image_size=16"]}
    config.write_text(
        yaml.safe_dump(
            {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce", "core"], "seeds": [0, 1]}
        )
    )
    main(["bench", str(config), "--dry_run", "--only_datasets=[b]"])
    out = capsys.readouterr().out
    assert "4 runs, 0 finished (skipped), 4 to run" in out and "--data.image_size=16" in out
    main(["bench", str(config), "--dry_run", "--only_datasets=[b]", "--only_objectives=[core]", "--only_seeds=[1]"])
    out = capsys.readouterr().out
    assert "1 runs, 0 finished (skipped), 1 to run" in out and re.search(
        r"--data\.image_size=16 .*--objective core", out
    )
    with pytest.raises(SystemExit, match=r"c not in the spec .*datasets: a, b\)"):
        main(["bench", str(config), "--dry_run", "--only_datasets=[c]"])


def test_reconstructed_records_are_marked_with_a_dagger_and_a_footnote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec_of(tmp_path, seeds=[0, 1])
    fabricate(spec, {("ce", "tiny", 1.0): [0.60, 0.62], ("core", "tiny", 1.0): [0.70, 0.74]})
    ce_seed1 = next(r.run_dir for r in spec.runs() if r.objective == "ce" and r.seed == 1)
    results = json.loads((ce_seed1 / "results.json").read_text())
    (ce_seed1 / "results.json").write_text(json.dumps({**results, "reconstructed": "lost; recorded in the docs"}))
    config = tmp_path / "bench.yaml"
    datasets = {"tiny": [f"--data.root={data_root(tmp_path)}"]}
    raw = {"output": str(spec.output), "datasets": datasets, "objectives": ["ce", "core"], "seeds": [0, 1]}
    config.write_text(yaml.safe_dump(raw))
    main(["bench", str(config), "--aggregate_only"])
    out = capsys.readouterr().out
    assert "| ce | 61.00 ± 1.41 (n=2)† |" in out
    assert "| core | **72.00 ± 2.83 (n=2)** |" in out  # no reconstructed run: no dagger
    assert "† Includes reconstructed records: ce seed 1. Their runs' files were lost;" in out
    # what rests on seed 1 in the differences: the means (Δ, s_p), seed 1's pair and the t-test; seed 0's pair not
    assert "| tiny | core | +11.00† | 4.47† | yes | +10.00 / +12.00† | 11.0 (0.058)† |" in out
    assert "† Rests, wholly or in part, on reconstructed records (marked † in the table above)." in out
    assert out.count("†") == 8
    runs = {(r["objective"], r["seed"]): r["reconstructed"] for r in csv.DictReader((spec.output / "runs.csv").open())}
    assert runs == {("ce", "0"): "False", ("ce", "1"): "True", ("core", "0"): "False", ("core", "1"): "False"}


def test_the_avg_column_and_the_figures_mark_what_rests_on_reconstructed_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Avg. column (a mean of the row's column means) and bars.png / label_fraction.png showed a reconstructed
    cell's number unmarked, where the table beside them carries its †."""
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self))
    spec = spec_of(tmp_path, seeds=[0, 1], datasets={"a": [], "b": []}, label_fractions=[0.1, 1.0])
    fabricate(spec, {(o, d, f): [0.6, 0.7] for o in ("ce", "core") for d in ("a", "b") for f in (0.1, 1.0)})
    lost = next(
        r.run_dir for r in spec.runs() if (r.objective, r.dataset, r.label_fraction, r.seed) == ("ce", "b", 1.0, 1)
    )
    results = json.loads((lost / "results.json").read_text())
    (lost / "results.json").write_text(json.dumps({**results, "reconstructed": "lost; recorded in the docs"}))
    markdown, _ = write_summary(spec)
    rows = {line.split(" | ")[0]: line.rsplit(" | ", 1)[1] for line in markdown.splitlines() if line.startswith("| c")}
    assert rows == {"| ce": "65.00† |", "| core": "65.00 |"}  # Avg.: only ce's rests on the reconstructed run
    bars, fractions = figures[:2]
    note = "† includes reconstructed records (the run's numbers without its files; see summary.md)"
    assert [t.get_text() for t in bars.axes[0].texts] == ["†", note]  # ce's bar in column (b, 100%); the note
    assert [t.get_text() for ax in fractions.axes for t in ax.texts] == ["†"]  # ce's 100% point in panel b
    assert [t.get_text() for t in fractions.texts] == [note]


def test_means_equal_as_shown_are_both_bold(tmp_path: Path) -> None:
    # 70.00 and 70.00 on the page (69.9967 and 70.0033 in the floats): one bold and not the other read as a ranking
    spec = spec_of(tmp_path, seeds=[0, 1, 2], datasets={"a": []})
    fabricate(spec, {("ce", "a", 1.0): [0.69, 0.70, 0.7099], ("core", "a", 1.0): [0.69, 0.70, 0.7101]})
    markdown, _ = write_summary(spec)
    assert "| ce | **70.00 ± " in markdown and "| core | **70.00 ± " in markdown
