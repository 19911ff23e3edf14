"""Fine-tuning gain against the strength of the pre-trained checkpoint (issue 41, part 2; the paper's Table 3 and
its Appendix E figure): one ``coretune bench`` spec whose columns (``datasets``) are checkpoints, each fine-tuned by
CE-tuning and the methods compared with it.

    .venv/bin/python benchmarks/strength_gain.py evaluate configs/bench/cifar10_cpu_strength.yaml
    .venv/bin/python benchmarks/strength_gain.py plot configs/bench/cifar10_cpu_strength.yaml \\
        configs/bench/cifar10_cpu_strength_1pct.yaml

``evaluate`` scores every checkpoint of the specs (each column's ``--model.weights``; none: a random initialisation;
a column listed by several specs is scored once) frozen, with ``coretune eval knn`` and ``coretune eval linear`` on
the spec's data at its image size, the backbone built as its fits build it (``--model.backbone_args``: a ViT's
``img_size`` and ``patch_size``), into ``--eval_dir`` (``<checkpoint>-knn.json``, ``<checkpoint>-linear.json``, each
with the SHA-256 of the file scored and seed 0, the random initialisation's; a file that exists is kept, so the
command resumes, unless its checkpoint was re-made or its backbone's options changed since), and names the
strongest checkpoint by kNN top-1 (the 1% spec's column run beside the floor) once every column is scored, with a
note when that pick is fragile (:func:`fragile_pick`). Both protocols use the data root's whole training split with
all its labels (CIFAR-10: 50,000 images; not the 10% or 1% the fine-tunings see) as the kNN memory bank
and the probe's training set, and score its test split: they rank the checkpoints' features, not a label budget.
``--only_datasets simclr_e5 simclr_e15`` scores only those columns (the checkpoints on this machine); with
``--refuse_stale`` a checkpoint re-made since it was scored, or since a finished run of the specs fine-tuned it
(its ``results.json``'s ``weights_sha256``), stops the command, nothing written. ``plot`` reads the specs' finished
runs (run directories, or exported records copied back) and those files, and writes a table (``--markdown``) and a
figure (``--figure``): per checkpoint and label fraction, each method's mean top-1 and its paired difference from
CE-tuning (seed by seed, with its paired t-test's p), and Core-tuning's difference from ``ce_mix`` (its
contribution beyond the mixup), against the checkpoint's kNN top-1; under the table, each difference's trend with
the checkpoint's strength (:func:`trends`); ``--footnote`` adds a caveat under both. The tables and the figure are
laid out by ``strength_figure.py`` beside it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from coretune.cli import main as coretune
from coretune.data.transforms import IMAGENET_MEAN, IMAGENET_STD, option_values
from coretune.models import weights_digest
from coretune.runs.layout import RunDir
from coretune.sweeps import BenchSpec, BenchSpecError, Run, collect_cells
from coretune.sweeps.records import OtherFitArgs
from coretune.sweeps.stats import Cell
from strength_figure import Gain, Row, figure, markdown, trend_table, trends

EVAL_DIR = Path("docs/records/cifar10-cpu-strength-eval")
PROTOCOLS = ("knn", "linear")


def _option(args: list[str], name: str) -> str | None:
    """The last ``--name=value`` of ``args`` (the one a fit would take), or None."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return values[-1] if values else None


_FIT_SETTINGS = ("model.backbone", "model.weights", "data.root", "data.image_size", "data.mean", "data.std")
BACKBONE_ARGS = "model.backbone_args"
"""The backbone's constructor options (a ViT's ``img_size``, ``patch_size``): the fit's, to build what it loads."""


def _options(value: object, where: str) -> dict[str, object]:
    """A ``backbone_args`` value (a mapping, or its YAML text) as a dict, or None for null."""
    found = yaml.safe_load(value) if isinstance(value, str) else value
    if found is not None and not isinstance(found, dict):
        raise BenchSpecError(f"{where}: --{BACKBONE_ARGS} must be a mapping of options (got {value!r})")
    return dict(found or {})


def fit_settings(args: Sequence[str]) -> dict[str, str]:
    """The settings of a fit with ``args`` that decide how its checkpoint is scored (backbone, its constructor's
    options, weights, data root, image size, normalisation), as option values: each ``--config=FILE``'s (its YAML,
    read from where the command runs) and each ``--name=value``, the last one winning, as the fit takes them;
    ``--model.backbone_args.NAME=value`` sets one option of ``backbone_args`` (JSON in the result).

    Raises:
        BenchSpecError: a ``--config`` file that is not there, or given as two arguments (``--config FILE``).
    """
    found: dict[str, str] = {}
    built: dict[str, object] = {}
    for arg in args:
        if arg == "--config":
            raise BenchSpecError("give a column's config file as one argument, --config=FILE, in the spec")
        if arg.startswith("--config="):
            path = Path(arg.split("=", 1)[1])
            if not path.is_file():
                raise BenchSpecError(f"{path}, the config file of the specs' fits, is not there: run from the checkout")
            config = yaml.safe_load(path.read_text()) or {}
            for key in (*_FIT_SETTINGS, BACKBONE_ARGS):
                section, name = key.split(".")
                value = (config.get(section) or {}).get(name)
                if key == BACKBONE_ARGS and name in (config.get(section) or {}):
                    built = _options(value, str(path))
                elif value is not None:
                    found[key] = option_values(value) if isinstance(value, list) else str(value)
        elif arg.startswith("--") and "=" in arg and (key := arg[2:].split("=", 1)[0]) in _FIT_SETTINGS:
            found[key] = arg.split("=", 1)[1]
        elif arg.startswith(f"--{BACKBONE_ARGS}="):
            built = _options(arg.split("=", 1)[1], arg)
        elif arg.startswith(f"--{BACKBONE_ARGS}.") and "=" in arg:
            key, value = arg[len(BACKBONE_ARGS) + 3 :].split("=", 1)
            built[key] = yaml.safe_load(value)
    if built:
        found[BACKBONE_ARGS] = json.dumps(built)
    return found


def checkpoints(spec: BenchSpec) -> dict[str, list[str]]:
    """The ``coretune eval`` arguments of each column of ``spec``: the backbone and its constructor's options (if the
    fit sets any), weights (if any), data root, image size and normalisation (if the fit sets one) its fine-tunings
    use (:func:`fit_settings`)."""
    found = {}
    for name, dataset_args in spec.datasets.items():
        fit = fit_settings([*spec.base_args, *dataset_args])
        weights = fit.get("model.weights")
        found[name] = [
            f"--model.backbone={fit.get('model.backbone', 'resnet18')}",
            *([f"--{BACKBONE_ARGS}={fit[BACKBONE_ARGS]}"] if BACKBONE_ARGS in fit else []),
            *([f"--model.weights={weights}"] if weights not in (None, "null") else []),
            f"--data.root={fit.get('data.root')}",
            f"--data.image_size={fit.get('data.image_size', 224)}",
            *(f"--data.{key}={fit[f'data.{key}']}" for key in ("mean", "std") if f"data.{key}" in fit),
            "--data.batch_size=256",
        ]
    return found


def stale(eval_dir: Path, name: str, args: list[str]) -> str | None:
    """Why the column's scores in ``eval_dir`` no longer describe its checkpoint (re-made since, scored before
    digests were recorded, or at another image size or normalisation), or None: fine, not scored, or the checkpoint
    is not on this machine."""
    weights = _option(args, "model.weights")  # None: a random initialisation
    digest = weights_digest(weights) if weights is not None and Path(weights).is_file() else None
    for protocol in PROTOCOLS:
        path = eval_dir / f"{name}-{protocol}.json"
        if not path.is_file():
            continue
        scored = json.loads(path.read_text())
        if weights is None and scored.get("seed") != 0:  # before --seed, each call drew its own random network
            return f"{path} scored a random initialisation without seed 0"
        if digest is not None and scored.get("weights_sha256") != digest:
            return f"{path} scored another file than today's {weights} (SHA-256 {scored.get('weights_sha256')})"
        built = json.loads(_option(args, BACKBONE_ARGS) or "{}")
        if (used := scored.get("backbone_args") or {}) != built:  # older files: built without options
            return f"{path} scored the backbone built with {used or 'no options'}, the column's with {built or 'none'}"
        size = int(_option(args, "data.image_size") or 224)
        if scored.get("image_size", size) != size:  # older files did not record it
            return f"{path} scored {scored['image_size']}-px images, the column's are {size} px"
        for key, default in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):  # older files: the ImageNet defaults
            used = scored.get(key, list(default))
            wanted = json.loads(given) if (given := _option(args, f"data.{key}")) else list(default)
            if not np.allclose(used, wanted):
                return f"{path} scored images normalised with {key} {used}, the column's {key} is {wanted}"
    return None


def columns_of(specs: Sequence[BenchSpec], columns: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The ``coretune eval`` arguments of every column of ``specs`` (of ``columns`` if given), each once.

    Raises:
        BenchSpecError: a column not in any spec, or listed by two specs with different checkpoints or data.
    """
    found: dict[str, list[str]] = {}
    for spec in specs:
        mine = [c for c in columns if c in spec.datasets] if columns is not None else None
        for name, args in checkpoints(spec.subset(datasets=mine) if mine is not None else spec).items():
            if found.setdefault(name, args) != args:
                raise BenchSpecError(f"column {name} reads {found[name]} in one spec and {args} in another")
    missing = [c for c in columns or () if c not in found]
    if missing:
        raise BenchSpecError(f"{', '.join(missing)} not in the specs' datasets: {', '.join(sorted(found))}")
    return found


def _fine_tuned_digest(run: Run) -> str | None:
    """The SHA-256 of the pre-trained file a run fine-tuned (its ``results.json``'s ``weights_sha256``), or None."""
    results = RunDir(run.run_dir).results
    return json.loads(results.read_text()).get("weights_sha256") if results.is_file() else None


def runs_from_another_file(specs: Sequence[BenchSpec], found: dict[str, list[str]]) -> list[str]:
    """Why finished runs of ``specs`` in the columns ``found`` (:func:`columns_of`) fine-tuned another file than the
    column's checkpoint today (their ``results.json``'s ``weights_sha256``): one line per run; none when every
    recorded digest matches, or the file is not on this machine, or a run recorded none (diverged, older)."""
    today: dict[str, str | None] = {}
    lines = []
    for spec in specs:
        for run in spec.runs():
            if run.dataset not in found:
                continue
            if run.dataset not in today:
                weights = _option(found[run.dataset], "model.weights")
                today[run.dataset] = weights_digest(weights) if weights and Path(weights).is_file() else None
            used = _fine_tuned_digest(run)
            if used and today[run.dataset] and used != today[run.dataset]:
                lines.append(f"{run.label} fine-tuned another file (SHA-256 {used}) than today's")
    return lines


def evaluate(
    specs: Sequence[BenchSpec], eval_dir: Path, columns: Sequence[str] | None = None, refuse_stale: bool = False
) -> None:
    """``coretune eval knn|linear`` of every checkpoint of ``specs`` (of ``columns`` if given: those on this
    machine) not scored yet (or re-made since it was: scored again, or with ``refuse_stale`` nothing is scored and
    the command stops naming it, since its fine-tuning runs came from the old file; as it does when a finished run
    of the specs fine-tuned another file than today's), into ``eval_dir``; then name the strongest by kNN top-1 (the
    1% spec's column run beside the floor) once every column is scored, or the strongest so far."""
    found = columns_of(specs, columns)
    remade = {name: why for name, args in found.items() if (why := stale(eval_dir, name, args)) is not None}
    elsewhere = runs_from_another_file(specs, found)
    if (remade or elsewhere) and refuse_stale:
        raise SystemExit(
            "re-made since scored or fine-tuned, so its fine-tuning runs came from another file: "
            + "; ".join([*(f"{name}: {why}" for name, why in remade.items()), *elsewhere])
            + ". Move the runs and eval files of every column its pre-training made aside (SimCLR makes two), or drop "
            "--refuse_stale to score it again"
        )
    for line in elsewhere:
        print(f"{line}: re-run it from today's file")
    for name, args in found.items():
        if name in remade:
            print(f"re-scoring {name}: {remade[name]}; its fine-tuning runs came from the old file: re-run them too")
        for protocol in PROTOCOLS:
            out = eval_dir / f"{name}-{protocol}.json"
            if out.is_file() and name not in remade:
                print(f"skip {name} {protocol}: {out} exists")
                continue
            coretune(["eval", protocol, *args, "--seed=0", f"--output={out}"])
    every = list(columns_of(specs))
    knn = {name: top1 for name in every if not math.isnan(top1 := _top1(eval_dir, name, "knn"))}
    if knn:
        strongest = max(knn, key=knn.__getitem__)
        unscored = [name for name in every if name not in knn]
        print(f"strongest by kNN top-1{' so far' if unscored else ''}: {strongest} ({knn[strongest]:.2f}%); kNN top-1 "
              "of each: " + ", ".join(f"{n} {v:.2f}" for n, v in knn.items())
              + (f"; not scored yet: {', '.join(unscored)}" if unscored else ""))  # fmt: skip
        if not unscored and (note := fragile_pick(knn, eval_dir)):
            print(note)


def fragile_pick(knn: dict[str, float], eval_dir: Path, resolution: float = 1.0) -> str | None:
    """Why the strongest by kNN top-1 (``knn``: each column's, in %) may not be the strongest: the runner-up
    within ``resolution`` pp (a binomial standard error on 10,000 test images is about 0.5 pp), or the linear
    probe ranking another column first; None when neither."""
    if len(knn) < 2:
        return None
    first, second = sorted(knn, key=knn.__getitem__, reverse=True)[:2]
    linear = {name: top1 for name in knn if not math.isnan(top1 := _top1(eval_dir, name, "linear"))}
    by_probe = max(linear, key=linear.__getitem__) if len(linear) == len(knn) else None
    why = []
    if (gap := knn[first] - knn[second]) < resolution:
        why.append(f"the runner-up {second} is {gap:.2f} pp behind, within the test set's noise")
    if by_probe is not None and linear[by_probe] > linear[first]:
        why.append(f"the linear probe ranks {by_probe} first ({linear[by_probe]:.2f}% against {linear[first]:.2f}%)")
    return f"note: the pick of {first} is fragile: {'; '.join(why)}" if why else None


def pick_text(specs: Sequence[BenchSpec], eval_dir: Path, rows: Sequence[Row]) -> str:
    """The table's record of which checkpoints the fewer-labels rows cover and of the pick of the strongest by kNN
    top-1 (the 1% spec's column beside the floor), with :func:`fragile_pick`'s note; empty before every column is
    scored."""
    every = list(columns_of(specs))
    knn = {name: top1 for name in every if not math.isnan(top1 := _top1(eval_dir, name, "knn"))}
    if not knn or len(knn) < len(every):
        return ""
    strongest = max(knn, key=knn.__getitem__)
    lines = [f"\nStrongest checkpoint by kNN top-1: {strongest} ({knn[strongest]:.2f}%)."]
    most = max((r.label_fraction for r in rows), default=1.0)
    for fraction in sorted({r.label_fraction for r in rows if r.label_fraction < most}, reverse=True):
        covered = sorted({r.checkpoint for r in rows if r.label_fraction == fraction}, key=knn.__getitem__)
        lines.append(f"{100 * fraction:g}% of the labels: {', '.join(covered)}.")
    if note := fragile_pick(knn, eval_dir):
        lines.append(note.replace("note: the pick", "Note: the pick", 1) + ".")
    return " ".join(lines) + "\n"


def _top1(eval_dir: Path, name: str, protocol: str) -> float:
    """The checkpoint's frozen-feature top-1 (%) under ``protocol`` (``evaluate``'s file), NaN if not scored."""
    path = eval_dir / f"{name}-{protocol}.json"
    return 100 * float(json.loads(path.read_text())["top1"]) if path.is_file() else math.nan


def _paired_means(cell: Cell, reference: Cell) -> tuple[float, float]:
    """Both cells' mean top-1 over the seeds they share (so their difference is the paired gain shown beside)."""
    shared = set(cell.seeds) & set(reference.seeds)
    if not shared:
        return math.nan, math.nan
    means = [
        float(np.mean([v for s, v in zip(c.seeds, c.values, strict=True) if s in shared])) for c in (cell, reference)
    ]
    return means[0], means[1]


def fine_tuned_another_file(run: Run, eval_dir: Path) -> str | None:
    """Why a run's record names another pre-trained file (its ``results.json``'s ``weights_sha256``) than the one
    its column's scores describe, or None: the same file, or either digest not recorded (a record from before
    ``weights_sha256``, a random initialisation)."""
    scores = eval_dir / f"{run.dataset}-knn.json"
    used = _fine_tuned_digest(run)
    scored = json.loads(scores.read_text()).get("weights_sha256") if scores.is_file() else None
    if used and scored and used != scored:
        return (
            f"{run.label} fine-tuned another file (SHA-256 {used}) than {scores} scored ({scored}): move that "
            "column's runs or its scores aside and make them again from one file"
        )
    return None


def gains(specs: list[BenchSpec], eval_dir: Path, baseline: str = "ce") -> list[Row]:
    """One row per (spec column, label fraction, method other than ``baseline``) of the specs' finished runs.

    Raises:
        SystemExit: a column's kNN / linear scores were made from another file than its checkpoint today.
    """
    rows = []
    for spec in specs:
        for name, args in checkpoints(spec).items():
            if (why := stale(eval_dir, name, args)) is not None:
                raise SystemExit(
                    f"{why}: score it again with `strength_gain.py evaluate` (and re-run its fine-tunings)"
                )
        for run in spec.runs():
            if (why := fine_tuned_another_file(run, eval_dir)) is not None:
                raise SystemExit(why)
        cells, _ = collect_cells(spec)
        names = [o.name for o in spec.objectives]
        for name in spec.datasets:
            for fraction in spec.label_fractions:
                base = cells[(baseline, name, fraction)]
                for method in (n for n in names if n != baseline):
                    cell = cells[(method, name, fraction)]
                    if not cell.values and not base.values:  # a column not run (the 1% spec runs two of five)
                        continue
                    mix = cells[("ce_mix", name, fraction)] if method == "core" and "ce_mix" in names else None
                    top1, base_top1 = _paired_means(cell, base)
                    rows.append(Row(
                        name, fraction, _top1(eval_dir, name, "knn"), _top1(eval_dir, name, "linear"), method,
                        top1, base_top1, Gain.of(cell, base), Gain.of(cell, mix) if mix is not None else None,
                    ))  # fmt: skip
    return rows


def diverged_runs(specs: list[BenchSpec]) -> list[tuple[str, str, float, int, str]]:
    """The runs of ``specs`` that diverged or collapsed (``results.json``'s ``diverged``): (checkpoint, method, label
    fraction, seed, message), each a finding about its checkpoint and method, left out of the gains (which pair
    finished seeds)."""
    return [
        (row.dataset, row.objective, row.label_fraction, row.seed, RunDir(row.run_dir).divergence())
        for spec in specs
        for row in collect_cells(spec)[1]
        if row.status == "diverged"
    ]


def diverged(runs: Sequence[tuple[str, str, float, int, str]]) -> str:
    """The table's note on :func:`diverged_runs`, one line each; empty without any."""
    lines = [
        f"- {column}/{method}/{100 * fraction:g}%/seed {seed}: {message}"
        for column, method, fraction, seed, message in runs
    ]
    return "\n".join(["", "Diverged or collapsed (not in the gains):", *lines, ""]) if lines else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["evaluate", "plot"])
    parser.add_argument("specs", type=Path, nargs="+", help="coretune bench specs whose columns are checkpoints")
    parser.add_argument("--eval_dir", type=Path, default=EVAL_DIR, help="the kNN / linear-probe results (JSON)")
    parser.add_argument("--figure", type=Path, default=Path("docs/img/strength_gain.png"))
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--footnote", default="", help="plot: a caveat printed under the table and the figure")
    parser.add_argument("--only_datasets", nargs="+", help="evaluate: score only these columns (all)")
    parser.add_argument(
        "--refuse_stale", action="store_true", help="evaluate: stop, scoring nothing, if a checkpoint was re-made"
    )
    args = parser.parse_args(argv)
    specs = [BenchSpec.from_yaml(s) for s in args.specs]
    if args.command == "evaluate":
        try:
            evaluate(specs, args.eval_dir, args.only_datasets, args.refuse_stale)
        except BenchSpecError as error:
            parser.error(str(error))
        return
    if not any(not math.isnan(_top1(args.eval_dir, name, "knn")) for spec in specs for name in spec.datasets):
        parser.error(
            f"no kNN score of any column in {args.eval_dir}: run `strength_gain.py evaluate` first, or name the "
            "folder that holds them with --eval_dir"
        )
    try:
        rows = gains(specs, args.eval_dir)
        lost = diverged_runs(specs)
        found = [t for axis in ("knn", "linear") for t in trends(rows, diverged=lost, axis=axis)]
        table = markdown(rows) + trend_table(found) + pick_text(specs, args.eval_dir, rows)
        table += diverged(lost)
        table += f"\n{args.footnote}\n" if args.footnote else ""
    except (OtherFitArgs, BenchSpecError) as error:  # a run folder started with other fit arguments than its
        parser.error(str(error))  # spec's (collect_cells), or a spec whose fits cannot be read (fit_settings)
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table)
    print(f"wrote {figure(rows, args.figure, diverged=lost, footnote=args.footnote)}")


if __name__ == "__main__":
    main()
