"""Table 6's layout (segmentation): MPA, FWIoU and MIoU per method, mean ± std over seeds with n and the standard
error, paired differences from the baseline, the per-class IoU; and configs/bench/camvid_cpu.yaml's runs unchanged
by it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from scipy.stats import ttest_rel

from coretune.cli import main
from coretune.sweeps import BenchSpec

ROOT = Path(__file__).resolve().parents[2]
CAMVID = ROOT / "configs" / "bench" / "camvid_cpu.yaml"

#: Per objective and seed: MPA, FWIoU and the per-class IoU (sky, road, car; None: car absent), MIoU their mean.
RUNS = {
    "ce": [(0.60, 0.70, (0.90, 0.50, 0.10)), (0.62, 0.71, (0.92, 0.52, 0.12)), (0.64, 0.72, (0.94, 0.54, 0.14))],
    "core": [(0.63, 0.72, (0.93, 0.50, 0.16)), (0.64, 0.73, (0.94, 0.56, 0.18)), (0.68, 0.74, (0.96, 0.60, 0.12))],
    "random_init": [
        (0.30, 0.40, (0.30, 0.10, None)),
        (0.31, 0.41, (0.33, 0.10, 0.20)),
        (0.32, 0.42, (0.36, 0.10, 0.20)),
    ],
}


def camvid_spec(tmp_path: Path) -> Path:
    """configs/bench/camvid_cpu.yaml writing into ``tmp_path/out``."""
    raw = yaml.safe_load(CAMVID.read_text())
    spec_file = tmp_path / "camvid_cpu.yaml"
    spec_file.write_text(yaml.safe_dump({**raw, "output": str(tmp_path / "out")}))
    return spec_file


def fabricate(spec: BenchSpec, runs: dict[str, list[tuple[float, float, tuple[float | None, ...]]]]) -> None:
    """Finished segmentation runs: config.yaml records the task, results.json's test entry what a run writes."""
    for run in spec.runs():
        mpa, fwiou, ious = runs[run.objective][spec.seeds.index(run.seed)]
        present = [v for v in ious if v is not None]
        test = {
            "pixel_acc": 0.9,
            "mpa": mpa,
            "fwiou": fwiou,
            "miou": sum(present) / len(present),
            "per_class_iou": dict(zip(("sky", "road", "car"), ious, strict=True)),
        }
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"task": "segmentation"}}))
        (run.run_dir / "results.json").write_text(json.dumps({"test": test, "epochs": 30}))


def test_camvid_spec_tabulates_table6_with_the_same_runs_as_before(tmp_path: Path) -> None:
    raw = yaml.safe_load(CAMVID.read_text())
    assert raw["table"] == "table6"
    before = BenchSpec.from_dict({**raw, "table": "table1"}).runs()  # the layout the sweep in progress started with
    assert BenchSpec.from_dict(raw).runs() == before  # same fit arguments (fit_args.json) and run directories
    assert [r.label for r in before[:3]] == [
        "camvid/ce/frac1/seed0",
        "camvid/core/frac1/seed0",
        "camvid/random_init/frac1/seed0",
    ]


def test_table6_is_mpa_fwiou_and_miou_with_paired_differences_and_per_class_iou(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = camvid_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, RUNS)
    main(["bench", str(spec_file), "--aggregate_only"])
    printed = capsys.readouterr().out
    markdown = (spec.output / "summary.md").read_text()
    assert markdown in printed
    assert (
        "mean IoU (MIoU) (%) on the test split, as in the paper's Table 6 (its Appendix D gives standard errors "
        "instead: SE = std / √n, listed in summary.csv and summary.json): mean ± sample standard deviation (ddof = 1) "
        "over seeds [0, 1, 2]; n = finished runs of the cell"
    ) in markdown
    assert "| Method | MPA | FWIoU | MIoU |" in markdown  # no Avg. of different measures
    # CE: MPA 60, 62, 64; FWIoU 70, 71, 72; MIoU 50, 52, 54
    assert "| CE-tuning | 62.00 ± 2.00 (n=3) | 71.00 ± 1.00 (n=3) | 52.00 ± 2.00 (n=3) |" in markdown
    # Core-tuning: MPA 63, 64, 68 (var (4+1+9)/2 = 7); FWIoU 72, 73, 74; MIoU 53, 56, 56 (var (4+1+1)/2 = 3)
    assert "| Core-tuning | **65.00 ± 2.65 (n=3)** | **73.00 ± 1.00 (n=3)** | **55.00 ± 1.73 (n=3)** |" in markdown
    assert "| random_init | 31.00 ± 1.00 (n=3) | 41.00 ± 1.00 (n=3) | 21.00 ± 1.00 (n=3) |" in markdown
    # MIoU, Core-tuning − CE: paired 3, 4, 2 → t = 3 / (1 / √3) = 5.2; s_p² = (2·4 + 2·3) / 4, 2 s_p = 3.74
    p = ttest_rel([53, 56, 56], [50, 52, 54]).pvalue
    assert f"| MIoU | Core-tuning | +3.00 | 3.74 | no | +3.00 / +4.00 / +2.00 | 5.2 ({p:.2g}) |" in markdown
    assert "| MPA | Core-tuning | +3.00 | 4.69 | no | +3.00 / +2.00 / +4.00 | 5.2 (" in markdown
    assert "| MIoU | random_init | -31.00 | 3.16 | yes | -30.00 / -31.00 / -32.00 | -53.7 (" in markdown
    # the per-class IoU: classes as rows, methods as columns; car absent from random_init's seed 0
    assert "| Class | CE-tuning | Core-tuning | random_init |" in markdown
    assert "| sky | 92.00 ± 2.00 (n=3) | 94.33 ± 1.53 (n=3) | 33.00 ± 3.00 (n=3) |" in markdown
    assert "| car | 12.00 ± 2.00 (n=3) | 15.33 ± 3.06 (n=3) | 20.00 ± 0.00 (n=2) |" in markdown
    with (spec.output / "summary.csv").open(newline="") as f:
        rows = {r["objective"]: r for r in csv.DictReader(f)}
    assert rows["ce"]["MIoU mean (%)"] == "52.0" and rows["ce"]["MIoU std (%)"] == "2.0"
    assert rows["ce"]["MIoU se (%)"] == "1.1547" and rows["ce"]["MIoU n"] == "3"  # 2 / √3
    summary = json.loads((spec.output / "summary.json").read_text())
    assert summary["table"] == "table6" and summary["baseline"] == "ce"
    core = summary["rows"][1]
    assert core["method"] == "Core-tuning" and core["columns"]["MIoU"]["values"] == pytest.approx([53, 56, 56])
    assert core["columns"]["MIoU"]["seeds"] == [0, 1, 2]
    assert core["columns"]["MIoU"]["se"] == pytest.approx(1.0)  # √3 / √3
    assert core["per_class_iou"]["camvid 100%"]["road"]["mean"] == pytest.approx(55.333333)
    assert summary["rows"][2]["per_class_iou"]["camvid 100%"]["car"]["seeds"] == [1, 2]
    (miou,) = [d for d in summary["differences"] if d["column"] == "MIoU" and d["method"] == "Core-tuning"]
    assert miou["diff_pp"] == pytest.approx(3.0) and miou["paired_p"] == pytest.approx(p)
    runs = list(csv.DictReader((spec.output / "runs.csv").open()))
    assert [r["test_top1_pct"] for r in runs[:3]] == ["50.0", "52.0", "54.0"]  # each run's task score, MIoU
    assert {"bars.png", "summary.json"} <= {p.name for p in spec.output.iterdir()}


def test_a_reconstructed_or_missing_run_is_marked_and_counted(tmp_path: Path) -> None:
    spec_file = camvid_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, RUNS)
    results = spec.output / "camvid" / "core" / "frac1" / "seed1" / "results.json"
    results.write_text(json.dumps({**json.loads(results.read_text()), "reconstructed": {"from": "notes"}}))
    (spec.output / "camvid" / "random_init" / "frac1" / "seed2" / "results.json").unlink()
    main(["bench", str(spec_file), "--aggregate_only"])
    markdown = (spec.output / "summary.md").read_text()
    assert "| Core-tuning | **65.00 ± 2.65 (n=3)†** |" in markdown
    assert "† Includes reconstructed records: Core-tuning (MPA) seed 1; Core-tuning (FWIoU) seed 1;" in markdown
    assert "| random_init | 30.50 ± 0.71 (n=2) | 40.50 ± 0.71 (n=2) | 20.50 ± 0.71 (n=2) |" in markdown


def test_an_undefined_score_is_missing_never_averaged(tmp_path: Path) -> None:
    """A run whose test masks held no pixel to score records its MIoU, MPA and FWIoU as null (an older run: NaN, read
    back as a float): the cell counts the other seeds, the run's row is blank, summary.json stays strict JSON."""
    spec_file = camvid_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, RUNS)
    ce = [run for run in spec.runs() if run.objective == "ce"]
    for run, undefined in zip(ce[1:], ("null", "NaN"), strict=True):  # seeds 1 and 2
        test = json.loads((run.run_dir / "results.json").read_text())["test"]
        text = json.dumps({"test": {**test, "mpa": None, "fwiou": None, "miou": None}, "epochs": 30})
        (run.run_dir / "results.json").write_text(text.replace("null", undefined))
    main(["bench", str(spec_file), "--aggregate_only"])
    markdown = (spec.output / "summary.md").read_text()
    assert "| CE-tuning | 60.00 (n=1) | 70.00 (n=1) | 50.00 (n=1) |" in markdown  # seed 0 alone
    runs = list(csv.DictReader((spec.output / "runs.csv").open()))
    assert [r["test_top1_pct"] for r in runs if r["objective"] == "ce"] == ["50.0", "", ""]
    summary = json.loads((spec.output / "summary.json").read_text(), parse_constant=_refuse_constant)
    assert summary["rows"][0]["columns"]["MIoU"]["values"] == [50.0]


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"{name} in a JSON file: not strict JSON")


def test_table6_refuses_runs_without_segmentation_measures_and_the_val_metric(tmp_path: Path) -> None:
    spec_file = camvid_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, RUNS)
    results = spec.runs()[0].run_dir / "results.json"
    results.write_text(json.dumps({"test": {"top1": 0.5, "miou": 0.5}}))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(spec_file), "--aggregate_only"])
    assert str(info.value.code) == (
        f"coretune bench: error: table6 tabulates segmentation runs' MPA, FWIoU and MIoU, but {results} has no mpa, "
        "fwiou in its test entry (not a --task segmentation run?): use table1 for one score per run"
    )
    raw = yaml.safe_load(spec_file.read_text())
    spec_file.write_text(yaml.safe_dump({**raw, "metric": "val"}))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(spec_file), "--aggregate_only"])
    assert str(info.value.code) == (
        f"coretune bench: error: {spec_file}: table6 tabulates measures of the test split (test score (the "
        "column's MPA, FWIoU or MIoU)); metric 'val' does not apply: drop it, or use table1 for the final epoch's "
        "validation score"
    )


def test_before_any_run_finished_the_table_has_its_columns_and_no_numbers(tmp_path: Path) -> None:
    spec_file = camvid_spec(tmp_path)
    main(["bench", str(spec_file), "--aggregate_only"])
    markdown = (tmp_path / "out" / "summary.md").read_text()
    assert "| Method | MPA | FWIoU | MIoU |\n|---|:-:|:-:|:-:|\n| CE-tuning | – | – | – |\n" in markdown
    assert "## Per-class IoU" not in markdown
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows"][0]["columns"]["MIoU"] == {
        "mean": None, "std": None, "se": None, "n": 0, "seeds": [], "values": [], "reconstructed_seeds": [],
    }  # fmt: skip


def test_validation_curves_are_plotted_per_data_set_under_a_measures_layout(tmp_path: Path) -> None:
    """Table 6's columns are measures, not data sets: the curves still get one panel (it used to stop the
    aggregation with matplotlib's "Number of columns must be a positive integer, not 0")."""
    spec_file = camvid_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, RUNS)
    for run in spec.runs():
        start = 0.2 + 0.01 * spec.seeds.index(run.seed)
        (run.run_dir / "metrics.csv").write_text(
            "epoch,step,val/miou\n" + "".join(f"{e},{10 * (e + 1)},{start + 0.05 * e}\n" for e in (4, 9))
        )
    main(["bench", str(spec_file), "--aggregate_only"])
    with (spec.output / "curves.csv").open(newline="") as f:
        ce = [r for r in csv.DictReader(f) if r["objective"] == "ce"]
    assert [r["epoch"] for r in ce] == ["5", "10"]
    assert float(ce[0]["val_top1_mean_pct"]) == pytest.approx(41.0)  # 100 × (0.2 + 0.05·4 + 0.01), seeds 0-2
    assert (spec.output / "curves.png").stat().st_size > 0
