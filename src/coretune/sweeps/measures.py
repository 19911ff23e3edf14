"""Several measures of each finished run, as cells over seeds: the columns of the layouts that tabulate more than one
number per run (Table 5, class-imbalanced data: top-1 over all classes and over the many-, medium- and few-shot
classes, from ``results.json``'s ``shot_groups``; Table 6: segmentation's MPA, FWIoU and MIoU, and the per-class
IoU; Table 8: clean accuracy and robust accuracy per attack and threat model, from ``coretune eval robust``'s
``robust_results*.json``), and Table 7's second table (the training domains' held-out accuracy)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..longtail import SHOT_GROUPS
from ..runs.layout import RunDir
from .records import percent
from .spec import BenchSpec, BenchSpecError
from .stats import Cell

__all__ = [
    "ROBUST_RESULTS",
    "SEGMENTATION_MEASURES",
    "attack_label",
    "collect_measures",
    "per_class_iou",
    "robust_measures",
    "segmentation_measures",
    "shot_measures",
    "spec_measures",
    "training_domains_heldout",
]

#: Table 6's columns: ``results.json``'s test key and the paper's name.
SEGMENTATION_MEASURES = (("mpa", "MPA"), ("fwiou", "FWIoU"), ("miou", "MIoU"))

#: The files ``coretune eval robust`` writes into a run directory (``robust_results.json``, and others named with
#: ``--output``, e.g. ``robust_results_autoattack.json``); ``coretune bench --export`` keeps them.
ROBUST_RESULTS = "robust_results*.json"

#: A run's measures: ``{key: (column label, value in %)}``, keys in column order.
Measures = dict[str, tuple[str, float]]


def segmentation_measures(run_dir: Path, test: dict[str, Any]) -> Measures:
    """MPA, FWIoU and MIoU (%) of a finished segmentation run's test entry; an undefined one (``null``: a test split
    without a pixel to score) is left out, a missing value of its cell, never averaged."""
    missing = [key for key, _ in SEGMENTATION_MEASURES if key not in test]
    if missing:
        raise BenchSpecError(
            f"table6 tabulates segmentation runs' MPA, FWIoU and MIoU, but {RunDir(run_dir).results} has no "
            f"{', '.join(missing)} in its test entry (not a --task segmentation run?): use table1 for one score per run"
        )
    scores = {key: (label, percent(test[key])) for key, label in SEGMENTATION_MEASURES}
    return {key: (label, value) for key, (label, value) in scores.items() if value is not None}


def shot_measures(run_dir: Path, test: dict[str, Any]) -> Measures:
    """Top-1 (%) over all test classes and over each many/medium/few-shot group of a finished run's test entry (its
    ``shot_groups``, by the fit's ``--data.shot_thresholds``, named in the column: ``many-shot (>100)``); a group
    without a class (``null``) is left out, a missing value of its cell, never averaged."""
    groups = test.get("shot_groups")
    if not isinstance(groups, dict):
        raise BenchSpecError(
            f"table5 tabulates the many/medium/few-shot top-1 of each run, but {RunDir(run_dir).results} has no "
            "shot_groups in its test entry (a run of an older version, or data that does not list its training "
            "labels): fit it again, or use table1 for one score per run"
        )
    many, few = groups["thresholds"]["many_above"], groups["thresholds"]["few_below"]
    labels = {"many": f"many-shot (>{many})", "medium": f"medium-shot ({few}-{many})", "few": f"few-shot (<{few})"}
    values: Measures = {"top1": ("top-1", 100 * float(test["top1"]))}
    for group in SHOT_GROUPS:
        if (value := groups[group]["top1"]) is not None:
            values[labels[group]] = (labels[group], 100 * float(value))
    return values


def attack_label(report: dict[str, Any]) -> str:
    """An attack of a ``robust_results*.json`` report as ``coretune eval robust`` prints it: ``pgd-10``,
    ``autoattack`` (AutoAttack sets its own steps)."""
    return f"{report['attack']}-{report['steps']}" if report.get("steps") else report["attack"]


def robust_measures(run_dir: Path, test: dict[str, Any]) -> Measures:
    """Clean accuracy and each (attack, threat model)'s robust accuracy (%) in a run's ``robust_results*.json``
    (``robust_results.json`` first, then the others by name). Columns are labelled ``pgd-10 ℓ∞ 4/255`` (attack and
    steps, as ``coretune eval robust`` prints them, then the threat model, then `` α 1/255`` for a step size other
    than the default); nothing without such files. ``clean`` is the clean accuracy of the report scored on the most
    images of the whole test set (the first such). A file scored on a random sample of N images (``--max_images``,
    as AutoAttack is) has its own columns, ``clean [N images, seed S]`` and ``autoattack ℓ∞ 4/255 [N images, seed
    S]``: a sample's numbers sit beside other attacks' on the same sample (size and seed), never in a column of the
    whole test set."""
    from ..apps.robustness import format_threat

    clean: tuple[int, float] | None = None
    values: Measures = {}
    final = RunDir(run_dir).read_results().get("last_checkpoint_sha256")
    for path in sorted(run_dir.glob(ROBUST_RESULTS)):
        try:
            scored = json.loads(path.read_text())
            _check_scored_weights(path, scored, final)
            sample = scored.get("sample")
            for report in scored["reports"]:
                # a sample is its size and seed: another seed's images are another sample, never paired with it
                on = f" [{report['num_images']} images, seed {sample.get('seed')}]" if sample is not None else ""
                sampled = sample is not None
                if sampled:
                    values.setdefault(f"clean{on}", (f"clean{on}", 100 * float(report["clean_accuracy"])))
                elif clean is None or report["num_images"] > clean[0]:
                    clean = (report["num_images"], 100 * float(report["clean_accuracy"]))
                attack = attack_label(report)
                for result in report["results"]:
                    threat = format_threat(result["norm"], result["eps"])
                    label = f"{attack} {threat}{_step_text(result, report.get('steps'))}{on}"
                    values.setdefault(label, (label, 100 * float(result["accuracy"])))
        except BenchSpecError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise BenchSpecError(
                f"{path} is not a result of coretune eval robust ({type(error).__name__}: {error}): write it again "
                "with coretune eval robust --output, or move it out of the run directory"
            ) from None
    return {"clean": ("clean", clean[1]), **values} if clean is not None else values


def _step_text(result: dict[str, Any], steps: int | None) -> str:
    """`` α 1/255`` for a PGD result whose step size is not the default ``2.5·ε/steps``, so that two files scored
    with other step sizes get a column each; empty for the default and for AutoAttack (no step size)."""
    from ..apps.robustness import format_threat

    step, eps = result.get("step_size"), float(result["eps"])
    if step is None or not steps or math.isclose(float(step), 2.5 * eps / steps, rel_tol=1e-6):
        return ""
    return f" α {format_threat(result['norm'], float(step)).split(' ', 1)[1]}"


def _check_scored_weights(path: Path, scored: dict[str, Any], final: str | None) -> None:
    """Refuse a robustness file scored on other weights than the run's final ``last.ckpt`` (whose test the table
    reports): ``last.ckpt`` as it was before the run was resumed or extended, or another checkpoint
    (``best.ckpt``, another run's). Files and results without the digests (older versions) are taken as they are."""
    digest, checkpoint = scored.get("checkpoint_sha256"), str(scored.get("checkpoint", ""))
    if digest and final and digest != final:
        what = (
            "as it was before the run trained on (its SHA-256 differs from the final last.ckpt's in results.json)"
            if Path(checkpoint).name == "last.ckpt"
            else "(its SHA-256 differs from the final last.ckpt's in results.json, whose test the table reports)"
        )
        raise BenchSpecError(
            f"{path} scored {checkpoint} {what}: score the run's last.ckpt with coretune eval robust, or move the file "
            "out of the run directory"
        )


def training_domains_heldout(run_dir: Path, test: dict[str, Any]) -> Measures:
    """A domain-generalization run's mean accuracy (%) on its training domains' held-out parts (the
    training-domain validation score of the checkpoint it tested); nothing for runs that do not record it."""
    value = test.get("training_domain_val_top1")
    return {"heldout": ("held-out", 100 * float(value))} if isinstance(value, int | float) else {}


def spec_measures(table: str) -> tuple[Callable[[Path, dict[str, Any]], Measures], tuple[tuple[str, str], ...]]:
    """The measures a layout tabulates (:func:`~.spec.measure_layout`), and the columns it has before any run
    finished (Table 8's attacks and threat models are those of the runs' files)."""
    return {
        "table5": (shot_measures, (("top1", "top-1"),)),
        "table6": (segmentation_measures, SEGMENTATION_MEASURES),
        "table8": (robust_measures, (("clean", "clean"),)),
    }[table]


def collect_measures(
    spec: BenchSpec,
    measures: Callable[[Path, dict[str, Any]], Measures],
    columns: Sequence[tuple[str, str]] = (),
) -> tuple[dict[tuple[str, str, float, str], Cell], list[tuple[str, str]]]:
    """Cells keyed by ``(objective, dataset, label_fraction, measure key)`` of every finished run's ``measures``
    (values in %, seeds in order, reconstructed records marked), and the measures, ``(key, label)``: ``columns``,
    then those found in the order they first appear. A cell no run measured is empty."""
    found: dict[str, str] = dict(columns)
    values: dict[tuple[str, str, float, str], list[tuple[int, float, bool]]] = {}
    for run in spec.runs():
        results = RunDir(run.run_dir).read_results()
        if not (test := results.get("test") or {}):
            continue
        for key, (label, value) in measures(run.run_dir, test).items():
            found.setdefault(key, label)
            cell = values.setdefault((run.objective, run.dataset, run.label_fraction, key), [])
            cell.append((run.seed, value, bool(results.get("reconstructed"))))
    cells = {}
    for entry in spec.objectives:
        for dataset in spec.datasets:
            for fraction in spec.label_fractions:
                for key in found:
                    runs = sorted(values.get((entry.name, dataset, fraction, key), []))
                    cells[(entry.name, dataset, fraction, key)] = Cell(
                        entry.name,
                        dataset,
                        fraction,
                        tuple(v for _, v, _ in runs),
                        tuple(s for s, _, _ in runs),
                        tuple(s for s, _, rebuilt in runs if rebuilt),
                    )
    return cells, list(found.items())


def per_class_iou(spec: BenchSpec) -> dict[tuple[str, str, float], dict[str, Cell]]:
    """Per ``(objective, dataset, label_fraction)``: each class's test IoU (%) over the finished seeds
    (``results.json``'s ``per_class_iou``; a class absent from a run's test split, ``null`` there, is left out of
    that seed), classes in the order the runs list them."""
    per_seed: dict[tuple[str, str, float], dict[str, list[tuple[int, float]]]] = {}
    for run in sorted(spec.runs(), key=lambda r: r.seed):
        test = RunDir(run.run_dir).read_results().get("test") or {}
        classes = per_seed.setdefault((run.objective, run.dataset, run.label_fraction), {})
        for name, value in (test.get("per_class_iou") or {}).items():
            classes.setdefault(name, [])
            if value is not None:
                classes[name].append((run.seed, 100 * float(value)))
    return {
        key: {
            name: Cell(key[0], key[1], key[2], tuple(v for _, v in pairs), tuple(s for s, _ in pairs))
            for name, pairs in classes.items()
        }
        for key, classes in per_seed.items()
    }
