"""Table 8's layout (adversarial training): clean accuracy and robust accuracy per attack and threat model from each
run's robust_results*.json, mean ± std over seeds, paired differences from the baseline; reproduced from exported
records with --aggregate_only; and benchmarks/robust_table.py's evaluate, which writes those files."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from scipy.stats import ttest_rel

from benchmark_scripts import load_benchmark
from coretune.cli import main
from coretune.sweeps import BenchSpec

ROOT = Path(__file__).resolve().parents[2]
ADVERSARIAL = ROOT / "configs" / "bench" / "cifar10_cpu_10pct_adversarial.yaml"
THREATS = (("linf", 4 / 255), ("l2", 0.5))

#: Per objective, per seed: clean, PGD-10 at ℓ∞ 4/255 and ℓ2 0.5 (10,000 images; torchattacks' PGD 1 point lower),
#: then the clean and AutoAttack accuracy at both of a random sample of 200 images.
RECORDS = {
    "ce": [
        (0.80, 0.01, 0.10, 0.81, 0.0, 0.05),
        (0.82, 0.02, 0.12, 0.80, 0.0, 0.06),
        (0.84, 0.03, 0.14, 0.85, 0.0, 0.07),
    ],
    "at_ce_linf": [
        (0.70, 0.40, 0.45, 0.70, 0.35, 0.40),
        (0.71, 0.42, 0.46, 0.72, 0.36, 0.41),
        (0.72, 0.44, 0.47, 0.71, 0.37, 0.42),
    ],
    "at_core_linf": [
        (0.72, 0.43, 0.46, 0.73, 0.36, 0.41),
        (0.74, 0.44, 0.49, 0.74, 0.38, 0.43),
        (0.76, 0.48, 0.49, 0.77, 0.40, 0.45),
    ],
}


def report(attack: str, images: int, clean: float, robust: tuple[float, float], steps: int | None) -> dict:
    """One attack's entry of ``coretune eval robust``'s JSON (``RobustnessReport`` as written)."""
    results = [
        {"norm": n, "eps": e, "accuracy": a, "step_size": None} for (n, e), a in zip(THREATS, robust, strict=True)
    ]
    return {
        "attack": attack,
        "num_images": images,
        "clean_accuracy": clean,
        "results": results,
        "steps": steps,
        "seed": 0,
    }


def fabricate(
    spec: BenchSpec, records: dict[str, list[tuple[float, ...]]], unscored: tuple[str, int] = ("", -1)
) -> None:
    """Finished runs of ``records``' objectives (test top-1 = the clean accuracy) with their robust_results.json
    (both PGD-10s) and robust_results_autoattack.json, except the run ``unscored`` (objective, seed)."""
    for run in spec.runs():
        if run.objective not in records:
            continue
        clean, linf, l2, aa_clean, aa_linf, aa_l2 = records[run.objective][spec.seeds.index(run.seed)]
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "results.json").write_text(json.dumps({"test": {"top1": clean, "top5": 1.0}, "epochs": 20}))
        adversarial = {"enable": run.objective.startswith("at_"), "norm": "linf", "eps": 4 / 255}
        (run.run_dir / "config.yaml").write_text(yaml.safe_dump({"adversarial": adversarial}))
        if (run.objective, run.seed) == unscored:
            continue
        pgds = [
            report("pgd", 10000, clean, (linf, l2), 10),
            report("torchattacks-pgd", 10000, clean, (linf - 0.01, l2 - 0.01), 10),
        ]
        # robust_table.py's AutoAttack file: coretune's PGD (5 points above AutoAttack) and AutoAttack on a sample
        autoattack = [
            report("pgd", 200, aa_clean, (aa_linf + 0.05, aa_l2 + 0.05), 10),
            report("autoattack", 200, aa_clean, (aa_linf, aa_l2), None),
        ]
        for name, reports, sample in (
            ("robust_results.json", pgds, None),
            ("robust_results_autoattack.json", autoattack, {"max_images": 200, "seed": 0}),
        ):
            (run.run_dir / name).write_text(
                json.dumps({"checkpoint": "last.ckpt", "split": "test", "sample": sample, "reports": reports})
            )


def adversarial_spec(tmp_path: Path) -> Path:
    raw = yaml.safe_load(ADVERSARIAL.read_text())
    spec_file = tmp_path / "adversarial.yaml"
    spec_file.write_text(yaml.safe_dump({**raw, "output": str(tmp_path / "out")}))
    return spec_file


def test_table8_from_exported_records_is_clean_and_robust_accuracy_per_attack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert yaml.safe_load(ADVERSARIAL.read_text())["table"] == "table8"
    spec_file = adversarial_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, RECORDS, unscored=("at_core_linf", 2))
    (spec.runs()[0].run_dir / "checkpoints").mkdir()
    (spec.runs()[0].run_dir / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    records = tmp_path / "records"
    main(["bench", str(spec_file), "--export", str(records)])  # the records a commit keeps, robust results included
    shutil.rmtree(spec.output)
    shutil.copytree(records, spec.output)  # the documented reproduction: copy them back, then one command
    main(["bench", str(spec_file), "--aggregate_only"])
    markdown = (spec.output / "summary.md").read_text()
    assert markdown in capsys.readouterr().out
    assert (
        "Adversarial training: clean accuracy and robust accuracy (%) on the test split under each attack and threat "
        "model of the runs' robust_results*.json (coretune eval robust), as in the paper's Table 8: mean ± sample"
    ) in markdown
    # the sample's columns apart from the whole test set's: AutoAttack beside coretune's PGD on the same 200 images
    assert (
        "| Method | clean | pgd-10 ℓ∞ 4/255 | pgd-10 ℓ2 0.5 | torchattacks-pgd-10 ℓ∞ 4/255 "
        "| torchattacks-pgd-10 ℓ2 0.5 | clean [200 images, seed 0] | pgd-10 ℓ∞ 4/255 [200 images, seed 0] "
        "| pgd-10 ℓ2 0.5 [200 images, seed 0] | autoattack ℓ∞ 4/255 [200 images, seed 0] "
        "| autoattack ℓ2 0.5 [200 images, seed 0] |"
    ) in markdown
    # clean: the PGD report's (10,000 images), not the sample's; ℓ∞ 1, 2, 3; torchattacks 1 point lower; on the
    # sample: clean 81, 80, 85, PGD 5 points above AutoAttack's 0, 0, 0 and 5, 6, 7
    ce = "| ce | **82.00 ± 2.00 (n=3)** | 2.00 ± 1.00 (n=3) | 12.00 ± 2.00 (n=3) | 1.00 ± 1.00 (n=3) "
    ce += "| 11.00 ± 2.00 (n=3) | **82.00 ± 2.65 (n=3)** | 5.00 ± 0.00 (n=3) | 11.00 ± 1.00 (n=3) "
    assert ce + "| 0.00 ± 0.00 (n=3) | 6.00 ± 1.00 (n=3) |" in markdown
    assert "| at_ce_linf | 71.00 ± 1.00 (n=3) | 42.00 ± 2.00 (n=3) | 46.00 ± 1.00 (n=3) |" in markdown
    # at_core_linf's seed 2 has no robust results: n = 2 in those columns
    assert "| at_core_linf | 73.00 ± 1.41 (n=2) | **43.50 ± 0.71 (n=2)** | **47.50 ± 2.12 (n=2)** |" in markdown
    assert "| at_ce_l2 | – | – | – | – | – | – | – | – | – | – |" in markdown  # not run
    images = "autoattack: 200; pgd-10: 200, 10000; torchattacks-pgd-10: 10000"
    assert f"Test images scored per attack: {images}" in markdown
    assert (
        "1 finished run(s) have no robust_results*.json yet (cifar10/at_core_linf/frac0.1/seed2): score them with "
        "`python benchmarks/robust_table.py evaluate SPEC`"
    ) in markdown
    # AT-CE − CE under PGD-10 ℓ∞ 4/255: paired 39, 40, 41 → t = 40 / (1 / √3); s_p² = (2·1 + 2·4) / 4
    p = ttest_rel([40, 42, 44], [1, 2, 3]).pvalue
    assert (
        f"| pgd-10 ℓ∞ 4/255 | at_ce_linf | +40.00 | 3.16 | yes | +39.00 / +40.00 / +41.00 | 69.3 ({p:.2g}) |"
        in markdown
    )
    assert "| clean | at_core_linf | -9.00 | 3.65 | yes | -8.00 / -8.00 | – |" in markdown  # seed 2 unscored
    summary = json.loads((spec.output / "summary.json").read_text())
    at_ce = summary["rows"][1]
    assert at_ce["objective"] == "at_ce_linf" and at_ce["columns"]["autoattack ℓ∞ 4/255 [200 images, seed 0]"][
        "values"
    ] == pytest.approx([35, 36, 37])
    # each difference names the seeds it pairs (at_core_linf's seed 2 is unscored) and none is reconstructed
    clean = {(d["column"], d["method"]): d for d in summary["differences"]}[("clean", "at_core_linf")]
    assert (clean["paired_seeds"], clean["reconstructed_seeds"], clean["paired_pp"]) == ([0, 1], [], [-8.0, -8.0])
    assert {p.name for p in spec.output.iterdir()} >= {"summary.json", "bars.png", "runs.csv", "summary.csv"}


def test_a_malformed_robust_results_file_is_one_line(tmp_path: Path) -> None:
    spec_file = adversarial_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, {"ce": RECORDS["ce"]})
    bad = spec.runs()[0].run_dir / "robust_results.json"
    bad.write_text(json.dumps({"clean": 0.8}))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(spec_file), "--aggregate_only"])
    assert str(info.value.code) == (
        f"coretune bench: error: {bad} is not a result of coretune eval robust (KeyError: 'reports'): write it again "
        "with coretune eval robust --output, or move it out of the run directory"
    )


def test_a_robust_results_file_of_weights_the_run_trained_on_from_is_refused(tmp_path: Path) -> None:
    # scored, then the run was resumed or extended: its last.ckpt (and test) changed, the robustness file did not;
    # the table put the old model's robust accuracy beside the new one's test
    spec_file = adversarial_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file)
    fabricate(spec, {"ce": RECORDS["ce"]})
    for run in spec.runs():
        if (run.run_dir / "results.json").is_file():
            results = json.loads((run.run_dir / "results.json").read_text())
            (run.run_dir / "results.json").write_text(json.dumps({**results, "last_checkpoint_sha256": "b" * 64}))
            for scored in run.run_dir.glob("robust_results*.json"):
                entries = {**json.loads(scored.read_text()), "checkpoint": str(run.run_dir / "checkpoints/last.ckpt")}
                scored.write_text(json.dumps({**entries, "checkpoint_sha256": "b" * 64}))
    main(["bench", str(spec_file), "--aggregate_only"])  # the same weights: tabled
    stale = spec.runs()[0].run_dir / "robust_results.json"
    stale.write_text(json.dumps({**json.loads(stale.read_text()), "checkpoint_sha256": "a" * 64}))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(spec_file), "--aggregate_only"])
    assert str(info.value.code) == (
        f"coretune bench: error: {stale} scored {spec.runs()[0].run_dir / 'checkpoints/last.ckpt'} as it was before "
        "the run trained on (its SHA-256 differs from the final last.ckpt's in results.json): score the run's "
        "last.ckpt with coretune eval robust, or move the file out of the run directory"
    )
    # scored on another checkpoint (best.ckpt): its clean and robust accuracy are not the tested model's
    best = spec.runs()[0].run_dir / "checkpoints/best.ckpt"
    stale.write_text(json.dumps({**json.loads(stale.read_text()), "checkpoint": str(best)}))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(spec_file), "--aggregate_only"])
    assert str(info.value.code) == (
        f"coretune bench: error: {stale} scored {best} (its SHA-256 differs from the final last.ckpt's in "
        "results.json, whose test the table reports): score the run's last.ckpt with coretune eval robust, or move "
        "the file out of the run directory"
    )


def test_robust_table_evaluate_scores_each_finished_unscored_run_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    robust_table = load_benchmark("robust_table", monkeypatch)
    calls: list[list[str]] = []
    monkeypatch.setattr(robust_table, "coretune", calls.append)
    assert (
        robust_table.listed(["[ce, at_ce_linf]"]) == robust_table.listed(["ce", "at_ce_linf"]) == ["ce", "at_ce_linf"]
    )
    spec = BenchSpec.from_yaml(adversarial_spec(tmp_path)).subset(["ce", "at_ce_linf"], [0])
    fabricate(spec, {"ce": RECORDS["ce"][:1]})  # at_ce_linf seed 0 is not finished
    ce = spec.runs()[0].run_dir
    (ce / "robust_results_autoattack.json").unlink()
    (ce / "robust_results.json").unlink()
    assert robust_table.evaluate(spec, ["linf:4/255", "l2:0.5"], 100) == []
    # the run's config first, then the checkpoint: a resumed run's config.yaml records ckpt_path: last
    run = ["eval", "robust", f"--config={ce / 'config.yaml'}", f"--ckpt_path={ce / 'checkpoints' / 'last.ckpt'}"]
    common = [*run, "--threat_models=[linf:4/255, l2:0.5]"]
    sample = ["--max_images=100", f"--output={ce / 'robust_results_autoattack.json'}"]
    assert calls == [
        [*common, "--attack=[pgd, torchattacks-pgd]"],
        [*common, "--attack=[pgd, autoattack]", *sample],  # AutoAttack beside coretune's PGD on the same images
        # the undefended model's sanity check: nothing survives ℓ∞ 8/255
        [*run, "--threat_models=linf:8/255", "--attack=pgd", f"--output={ce / 'robust_results_sanity_linf8.json'}"],
    ]
    for name in ("robust_results.json", "robust_results_autoattack.json", "robust_results_sanity_linf8.json"):
        (ce / name).write_text("{}")
    calls.clear()
    assert robust_table.evaluate(spec, ["linf:4/255"], 100) == []  # resumes: scored runs are skipped
    assert calls == []
    (ce / "robust_results_autoattack.json").unlink()
    (ce / "robust_results.json").unlink()
    # AutoAttack and the torchattacks referee on seed 1's runs only: coretune's PGD alone on seed 0's
    robust_table.evaluate(spec, ["linf:4/255"], 100, autoattack_seeds=[1], referee_seeds=[1])
    assert calls == [[*run, "--threat_models=[linf:4/255]", "--attack=pgd"]]


def test_robust_table_evaluate_goes_on_past_a_run_it_cannot_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    robust_table = load_benchmark("robust_table", monkeypatch)
    spec_file = adversarial_spec(tmp_path)
    spec = BenchSpec.from_yaml(spec_file).subset(["ce"], [0, 1])
    fabricate(spec, {"ce": RECORDS["ce"][:2]})
    for run in spec.runs():
        for name in ("robust_results.json", "robust_results_autoattack.json"):
            (run.run_dir / name).unlink()
    broken = spec.runs()[0].run_dir
    calls: list[list[str]] = []

    def coretune(args: list[str]) -> None:  # seed 0's checkpoint is unreadable: coretune's one-line exit
        calls.append(args)
        if str(broken) in args[3]:
            raise SystemExit(f"coretune eval robust: error: {broken}/checkpoints/last.ckpt is truncated")

    monkeypatch.setattr(robust_table, "coretune", coretune)
    failures = robust_table.evaluate(spec, ["linf:4/255"], 100)
    assert failures == [
        f"{spec.runs()[0].label}: coretune eval robust: error: {broken}/checkpoints/last.ckpt is truncated"
    ]
    assert len(calls) == 1 + 3  # seed 0 stops at its first command; seed 1 is scored all the same
    monkeypatch.setattr(sys, "argv", ["robust_table.py", "evaluate", str(spec_file), "--only_objectives", "ce",
                                      "--only_seeds", "0", "1"])  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        robust_table.main()
    assert str(exit_.value.code).startswith(f"1 run(s) not scored:\n{spec.runs()[0].label}: coretune eval robust")


def test_before_any_run_finished_the_table_has_its_clean_column(tmp_path: Path) -> None:
    spec_file = adversarial_spec(tmp_path)
    main(["bench", str(spec_file), "--aggregate_only"])
    markdown = (tmp_path / "out" / "summary.md").read_text()
    assert "| Method | clean |\n|---|:-:|\n| ce | – |\n| at_ce_linf | – |\n" in markdown
    assert "finished run(s) have no robust_results" not in markdown


def test_a_pgd_with_another_step_size_gets_its_own_column(tmp_path: Path) -> None:
    """Two files scoring PGD-10 at ℓ∞ 4/255, one with the default step size 2.5·ε/steps = 1/255 (recorded as a
    number) and one with 2/255: each keeps its column, the second labelled with its step size (the first file's value
    was kept for both)."""
    from coretune.sweeps.measures import robust_measures

    (tmp_path / "results.json").write_text(json.dumps({"test": {"top1": 0.8}}))
    for name, step, accuracy in (
        ("robust_results.json", 2.5 * 4 / 255 / 10, 0.4),
        ("robust_results_a2.json", 2 / 255, 0.3),
    ):
        results = [{"norm": "linf", "eps": 4 / 255, "accuracy": accuracy, "step_size": step}]
        reports = [{"attack": "pgd", "num_images": 100, "clean_accuracy": 0.8, "results": results, "steps": 10}]
        (tmp_path / name).write_text(json.dumps({"checkpoint": "last.ckpt", "sample": None, "reports": reports}))
    assert robust_measures(tmp_path, {}) == {
        "clean": ("clean", 80.0),
        "pgd-10 ℓ∞ 4/255": ("pgd-10 ℓ∞ 4/255", 40.0),
        "pgd-10 ℓ∞ 4/255 α 2/255": ("pgd-10 ℓ∞ 4/255 α 2/255", 30.0),
    }
