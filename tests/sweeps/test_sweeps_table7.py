"""Table 7's layout (domain generalization): one column per held-out domain plus the average, each seed's mean over
the domains then mean ± std over seeds, and its paired differences; the selection rule named with the checkpoints it
chose, an oracle marked in every output; the training domains' held-out accuracy."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from scipy.stats import ttest_rel

from coretune.cli import main
from coretune.sweeps import BenchSpec, report
from coretune.sweeps.report import write_summary
from coretune.sweeps.spec import table_layout
from coretune.sweeps.status import print_status

DOMAINS = ("art", "cartoon", "photo", "sketch")


def dg_spec(tmp_path: Path, objectives: list[str] | None = None) -> BenchSpec:
    (tmp_path / "pacs").mkdir(exist_ok=True)  # the data root: the output is not inside it
    datasets = {d: [f"--data.root={tmp_path / 'pacs'}", f"--data.test_domains={d}"] for d in DOMAINS}
    return BenchSpec.from_dict(
        {
            "output": str(tmp_path / "out"),
            "datasets": datasets,
            "objectives": objectives or ["ce", "ce_con", "core"],
            "seeds": [0, 1, 2],
            "table": "table7",
        }
    )


def fabricate(
    spec: BenchSpec, top1: dict[str, list[list[float]]], oracle: bool = False, heldout: float | None = None
) -> None:
    """Finished DG runs: ``top1[objective][seed][domain index]`` (fractions), their selection rule recorded; with
    ``heldout``, also the training domains' held-out accuracy (``top1 + heldout``) and the chosen checkpoint
    (``best.ckpt`` at 0-based epoch ``seed + 2``), as domain_test_results writes them."""
    name = "test-domain validation set (oracle)" if oracle else "training-domain validation set"
    for run in spec.runs():
        value = top1[run.objective][spec.seeds.index(run.seed)][DOMAINS.index(run.dataset)]
        run.run_dir.mkdir(parents=True)
        test = {"top1": value, "test_domains": {run.dataset: value}, "selection": {"name": name, "oracle": oracle}}
        if heldout is not None:
            test["training_domain_val_top1"] = value + heldout
            test["selection"].update(checkpoint="best.ckpt", epoch=run.seed + 2, step=100 * (run.seed + 3))
        (run.run_dir / "results.json").write_text(json.dumps({"test": test, "epochs": 2}))


VALUES = {
    "ce": [[0.70, 0.60, 0.90, 0.50], [0.72, 0.62, 0.88, 0.54], [0.68, 0.61, 0.89, 0.52]],
    "ce_con": [[0.75, 0.65, 0.91, 0.60], [0.74, 0.66, 0.92, 0.58], [0.76, 0.64, 0.90, 0.62]],
    "core": [[0.78, 0.70, 0.93, 0.64], [0.80, 0.69, 0.94, 0.66], [0.79, 0.71, 0.95, 0.65]],
}


def test_one_column_per_held_out_domain_and_the_seed_averaged_mean(tmp_path: Path) -> None:
    spec = dg_spec(tmp_path)
    layout = table_layout(spec)
    assert layout.rows == [("ce", "CE"), ("ce_con", "CE-Con"), ("core", "Core-tuning")]
    assert [label for _, label in layout.columns] == list(DOMAINS)
    assert len(spec.runs()) == 3 * 4 * 3 and spec.runs()[0].args[-4:] == (
        "--objective", "ce", "--data.label_fraction=1.0", "--seed=0",
    )  # fmt: skip
    fabricate(spec, VALUES)
    markdown, paths = write_summary(spec)
    assert "| Method | art | cartoon | photo | sketch | Avg. |" in markdown
    assert "as in the paper's Table 7 (Avg.: each seed's mean over the domains): mean ± sample standard" in markdown
    assert "Model selection: training-domain validation set." in markdown and "ORACLE" not in markdown
    # CE's seeds average (0.70+0.60+0.90+0.50)/4 = 67.5, 69.0, 67.5 → 68.00 ± 0.87
    ce = "| 70.00 ± 2.00 (n=3) | 61.00 ± 1.00 (n=3) | 89.00 ± 1.00 (n=3) | 52.00 ± 2.00 (n=3) | 68.00 ± 0.87 (n=3) |"
    assert f"| CE {ce}" in markdown
    assert "| Core-tuning | **79.00 ± 1.00 (n=3)** |" in markdown
    with (spec.output / "summary.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["Avg. mean (%)"] == "68.0" and float(rows[0]["Avg. std (%)"]) == pytest.approx(0.866, abs=1e-3)
    assert spec.output / "summary.md" in paths


def test_an_oracle_selection_is_marked_in_every_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = dg_spec(tmp_path, ["ce", "core"])
    fabricate(spec, VALUES, oracle=True)
    titles: list[str] = []
    monkeypatch.setattr(report, "plot_bars", lambda spec, cells, layout, note="": titles.append(note) or [])
    markdown, _ = write_summary(spec)
    assert titles == [" (ORACLE model selection)"]  # bars.png's title
    marked = "Model selection: test-domain validation set (oracle). **ORACLE**: each run tests its last checkpoint and "
    assert marked in markdown
    with (spec.output / "summary.csv").open(newline="") as f:
        assert [r["selection"] for r in csv.DictReader(f)] == ["ORACLE: test-domain validation set (oracle)"] * 2
    summary = json.loads((spec.output / "summary.json").read_text())
    assert {s["oracle"] for row in summary["rows"] for s in row["selection"]} == {True}
    with (spec.output / "runs.csv").open(newline="") as f:  # each run's row
        assert {r["selection"] for r in csv.DictReader(f)} == {"ORACLE: test-domain validation set (oracle)"}
    console = Console(record=True, width=200)
    print_status(spec, console)  # coretune bench --status
    assert console.export_text().count("(ORACLE)") == len(spec.runs())


def test_table7_reports_the_training_domains_held_out_accuracy_the_chosen_checkpoints_and_the_average_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = dg_spec(tmp_path, ["ce", "core"])
    fabricate(spec, VALUES, heldout=0.05)
    spec_file = tmp_path / "dg.yaml"
    spec_file.write_text(yaml.safe_dump({
        "output": str(spec.output), "datasets": {d: list(a) for d, a in spec.datasets.items()},
        "objectives": ["ce", "core"], "seeds": [0, 1, 2], "table": "table7",
    }))  # fmt: skip
    main(["bench", str(spec_file), "--aggregate_only"])
    markdown = (spec.output / "summary.md").read_text()
    assert markdown in capsys.readouterr().out
    assert "Model selection: training-domain validation set (tests best.ckpt; chosen at epochs 3, 4, 5)." in markdown
    assert "## Held-out accuracy of the training domains" in markdown
    heldout = markdown.split("## Held-out accuracy of the training domains")[1].split("## Differences")[0]
    assert "| Method | art | cartoon | photo | sketch |" in heldout  # the split's unseen domain names the column
    assert "| CE | 75.00 ± 2.00 (n=3) | 66.00 ± 1.00 (n=3) | 94.00 ± 1.00 (n=3) | 57.00 ± 2.00 (n=3) |" in heldout
    assert "| Core-tuning | **84.00 ± 1.00 (n=3)** | **75.00 ± 1.00 (n=3)** |" in heldout
    # Avg., paired by seed: Core-tuning's seeds average 76.25, 77.25, 77.50; CE's 67.50, 69.00, 67.50
    p = ttest_rel([76.25, 77.25, 77.5], [67.5, 69.0, 67.5]).pvalue
    assert f"| Avg. | Core-tuning | +9.00 | 1.54 | yes | +8.75 / +8.25 / +10.00 | 17.3 ({p:.2g}) |" in markdown
    assert "| art | Core-tuning | +9.00 | 3.16 | yes | +8.00 / +8.00 / +11.00 |" in markdown
    summary = json.loads((spec.output / "summary.json").read_text())
    ce = summary["rows"][0]
    assert ce["training domains held-out"]["photo"]["values"] == pytest.approx([95, 93, 94])
    assert ce["columns"]["art"]["values"] == pytest.approx([70, 72, 68])
    assert ce["selection"][0] == {
        "dataset": "art", "seed": 0, "name": "training-domain validation set", "oracle": False,
        "checkpoint": "best.ckpt", "epoch": 2, "step": 300,
    }  # fmt: skip
    assert [d["column"] for d in summary["differences"]] == [*DOMAINS, "Avg."]
    with (spec.output / "summary.csv").open(newline="") as f:
        assert [r["selection"] for r in csv.DictReader(f)] == ["training-domain validation set"] * 2


def test_the_average_counts_only_seeds_finished_in_every_domain(tmp_path: Path) -> None:
    spec = dg_spec(tmp_path, ["ce"])
    fabricate(spec, {"ce": VALUES["ce"]})
    (spec.output / "photo" / "ce" / "frac1" / "seed2" / "results.json").unlink()
    markdown, _ = write_summary(spec)
    assert "| **89.00 ± 1.41 (n=2)** | **52.00 ± 2.00 (n=3)** | 68.25 ± 1.06 (n=2) |" in markdown
