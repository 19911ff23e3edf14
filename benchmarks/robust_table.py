"""Robust accuracy of a ``coretune bench`` sweep's runs (issue 38): score each finished run with ``coretune eval
robust`` into its run directory, then print the table of clean and robust accuracy per method, mean ± std over
seeds.

    .venv/bin/python benchmarks/robust_table.py evaluate configs/bench/cifar10_cpu_10pct_adversarial.yaml
    .venv/bin/python benchmarks/robust_table.py table configs/bench/cifar10_cpu_10pct_adversarial.yaml

``evaluate`` runs, for every finished run of the spec (``results.json`` holds its test results) that has not been
scored yet, two commands on its ``checkpoints/last.ckpt`` (the final model, as the fit's test top-1):

- both PGD-10s (coretune's and torchattacks') on the whole test set → ``RUN/robust_results.json``;
- AutoAttack on the first ``--autoattack_images`` test images → ``RUN/robust_results_autoattack.json``

at ``--threat_models`` (default ℓ∞ 4/255 and ℓ2 0.5, the two the paper trains and attacks with). A run whose file
exists is skipped, so the command resumes. ``coretune bench SPEC --export DIR`` copies both files with the run's
records. ``table`` reads them back: one row per method, one column per (attack, threat model), plus clean
accuracy (which each model is trained for: the rows' ``--adversarial.*`` settings, in the spec).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from coretune.cli import main as coretune
from coretune.robustness import format_threat, parse_threat
from coretune.rundir import RunDir
from coretune.sweeps import BenchSpec
from coretune.sweeps.stats import Cell

AUTOATTACK_FILE = "robust_results_autoattack.json"


def evaluate(spec: BenchSpec, threat_models: list[str], autoattack_images: int) -> None:
    threats = f"[{', '.join(threat_models)}]"
    for run in spec.runs():
        rundir = RunDir(run.run_dir)
        if not rundir.is_finished():
            print(f"skip {run.label}: not finished")
            continue
        ckpt = f"--ckpt={rundir.last_checkpoint}"
        config = f"--config={rundir.config}"
        if not rundir.robust_results.is_file():
            coretune(["eval", "robust", ckpt, config, f"--threat_models={threats}", "--attack=[pgd, torchattacks-pgd]"])
        if not (run.run_dir / AUTOATTACK_FILE).is_file():
            coretune(["eval", "robust", ckpt, config, f"--threat_models={threats}", "--attack=autoattack",
                      f"--max_images={autoattack_images}", f"--output={run.run_dir / AUTOATTACK_FILE}"])  # fmt: skip


def table(spec: BenchSpec, threat_models: list[str]) -> str:
    threats = [parse_threat(t) for t in threat_models]
    columns = ["clean"] + [f"{a} {format_threat(n, e)}" for a in ("pgd", "torchattacks-pgd", "autoattack")
                           for n, e in threats]  # fmt: skip
    values: dict[tuple[str, str], list[float]] = {}
    images: dict[str, set[int]] = {}
    for run in spec.runs():
        for file in (RunDir(run.run_dir).robust_results, run.run_dir / AUTOATTACK_FILE):
            if not file.is_file():
                continue
            for report in json.loads(file.read_text())["reports"]:
                images.setdefault(report["attack"], set()).add(report["num_images"])
                if report["attack"] == "pgd":
                    values.setdefault((run.objective, "clean"), []).append(100 * report["clean_accuracy"])
                for result in report["results"]:
                    column = f"{report['attack']} {format_threat(result['norm'], result['eps'])}"
                    values.setdefault((run.objective, column), []).append(100 * result["accuracy"])
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for entry in spec.objectives:
        cells = [Cell(entry.name, "", 0.0, tuple(values.get((entry.name, c), ()))).text() for c in columns]
        lines.append(f"| {entry.name} | " + " | ".join(cells) + " |")
    counts = "; ".join(f"{a}: {', '.join(map(str, sorted(n)))}" for a, n in sorted(images.items()))
    return "\n".join(lines) + f"\n\ntop-1 in %, mean ± std over seeds (n); test images scored per attack: {counts}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["evaluate", "table"])
    parser.add_argument("spec", type=Path, help="the coretune bench spec whose runs to score")
    parser.add_argument("--threat_models", nargs="+", default=["linf:4/255", "l2:0.5"])
    parser.add_argument("--autoattack_images", type=int, default=200)
    args = parser.parse_args()
    spec = BenchSpec.from_yaml(args.spec)
    if args.command == "evaluate":
        evaluate(spec, args.threat_models, args.autoattack_images)
    else:
        print(table(spec, args.threat_models))


if __name__ == "__main__":
    main()
