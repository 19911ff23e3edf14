"""Robust accuracy of a ``coretune bench`` sweep's runs (issue 38): score each finished run with ``coretune eval
robust`` into its run directory; ``coretune bench SPEC --aggregate_only`` (``table: table8``) then tabulates clean and
robust accuracy per method, mean ± std over seeds, with paired differences from the baseline row.

    .venv/bin/python benchmarks/robust_table.py evaluate configs/bench/cifar10_cpu_10pct_adversarial.yaml
    .venv/bin/coretune bench configs/bench/cifar10_cpu_10pct_adversarial.yaml --aggregate_only

``evaluate`` runs, for every finished run of the spec (``results.json`` holds its test results) that has not been
scored yet, two commands on its ``checkpoints/last.ckpt`` (the final model, as the fit's test top-1):

- both PGD-10s (coretune's and torchattacks', the referee) on the whole test set → ``RUN/robust_results.json``;
- AutoAttack, and coretune's PGD-10 beside it, on ``--autoattack_images`` test images drawn at random (seed 0: the
  same images for every run) → ``RUN/robust_results_autoattack.json`` (the table's ``[200 images, seed 0]`` columns)

at ``--threat_models`` (default ℓ∞ 4/255 and ℓ2 0.5, the two the paper trains and attacks with); and on a run trained
without adversarial examples, the issue's sanity check: coretune's PGD-10 at ℓ∞ 8/255, which an undefended model must
not survive → ``RUN/robust_results_sanity_linf8.json``. A run whose file exists is skipped, so the command resumes; a
run whose scoring fails is named at the end (exit status 1) after the others are scored. ``--only_objectives`` /
``--only_seeds`` score part of the spec (as ``coretune bench``'s options, a list ``'[ce, at_ce_linf]'`` or words),
``--autoattack_seeds 0`` runs the costly AutoAttack on seed 0's runs only, and ``--referee_seeds 0`` the torchattacks
PGD (the other seeds: coretune's PGD alone). ``coretune bench SPEC --export DIR`` copies these files with the run's
records. The bench's ``table8`` layout reads them back (from the run directories, or from exported records copied into
the output folder): one row per method, clean accuracy, then one column per (attack, threat model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from coretune.cli import main as coretune
from coretune.runs.layout import RunDir
from coretune.sweeps import BenchSpec

AUTOATTACK_FILE = "robust_results_autoattack.json"
SANITY_FILE = "robust_results_sanity_linf8.json"


def evaluate(
    spec: BenchSpec,
    threat_models: list[str],
    autoattack_images: int,
    autoattack_seeds: list[int] | None = None,
    referee_seeds: list[int] | None = None,
) -> list[str]:
    """Score every finished, unscored run of ``spec``; AutoAttack only on ``autoattack_seeds`` and the torchattacks
    PGD only on ``referee_seeds`` (``None``: every seed). A run whose scoring fails is reported and left unscored,
    and the others are still scored: returns the failures, one line each."""
    threats = f"[{', '.join(threat_models)}]"
    failures = []
    for run in spec.runs():
        rundir = RunDir(run.run_dir)
        if not rundir.is_finished():
            print(f"skip {run.label}: {'diverged: nothing to score' if rundir.divergence() else 'not finished'}")
            continue
        # the run's config first: options after it override it (and it never names the checkpoint to score)
        scored = ["eval", "robust", f"--config={rundir.config}", f"--ckpt_path={rundir.last_checkpoint}"]
        commands = []
        if not rundir.robust_results.is_file():
            attacks = "[pgd, torchattacks-pgd]" if referee_seeds is None or run.seed in referee_seeds else "pgd"
            commands.append([*scored, f"--threat_models={threats}", f"--attack={attacks}"])
        if not (run.run_dir / AUTOATTACK_FILE).is_file() and (autoattack_seeds is None or run.seed in autoattack_seeds):
            # coretune's PGD on the same sample: AutoAttack's columns compare with a PGD-10 on the same images
            sample = [f"--max_images={autoattack_images}", f"--output={run.run_dir / AUTOATTACK_FILE}"]
            commands.append([*scored, f"--threat_models={threats}", "--attack=[pgd, autoattack]", *sample])
        trained = (yaml.safe_load(rundir.config.read_text()) or {}).get("adversarial") or {}
        if not trained.get("enable") and not (run.run_dir / SANITY_FILE).is_file():
            commands.append([*scored, "--threat_models=linf:8/255", "--attack=pgd",
                             f"--output={run.run_dir / SANITY_FILE}"])  # fmt: skip
        for command in commands:
            try:
                coretune(command)
            except SystemExit as stop:  # coretune's one-line error; the next runs are still scored
                if stop.code not in (None, 0):
                    print(f"not scored {run.label}: {stop.code}", file=sys.stderr)
                    failures.append(f"{run.label}: {stop.code}")
                    break
    return failures


def listed(values: list[str] | None) -> list[str] | None:
    """Command-line words, or one YAML list as ``coretune bench`` takes it (``'[ce, at_ce_linf]'``), as a list."""
    if values and len(values) == 1 and values[0].lstrip().startswith("["):
        return [str(v) for v in yaml.safe_load(values[0])]
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["evaluate"])
    parser.add_argument("spec", type=Path, help="the coretune bench spec whose runs to score")
    parser.add_argument("--threat_models", nargs="+", default=["linf:4/255", "l2:0.5"])
    parser.add_argument("--autoattack_images", type=int, default=200)
    parser.add_argument("--autoattack_seeds", nargs="+", help="AutoAttack only these seeds' runs (all)")
    parser.add_argument("--referee_seeds", nargs="+", help="torchattacks' PGD only on these seeds' runs (all)")
    parser.add_argument("--only_objectives", nargs="+", help="score only these rows of the spec (all)")
    parser.add_argument("--only_seeds", nargs="+", help="score only these seeds (all)")
    args = parser.parse_args()
    try:
        seeds = {k: None if (v := listed(getattr(args, k))) is None else [int(s) for s in v]
                 for k in ("autoattack_seeds", "referee_seeds", "only_seeds")}  # fmt: skip
        spec = BenchSpec.from_yaml(args.spec).subset(listed(args.only_objectives), seeds["only_seeds"])
    except ValueError as error:
        parser.error(str(error))
    failures = evaluate(
        spec, args.threat_models, args.autoattack_images, seeds["autoattack_seeds"], seeds["referee_seeds"]
    )
    if failures:
        sys.exit(f"{len(failures)} run(s) not scored:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
