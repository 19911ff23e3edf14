"""Post-hoc logit adjustment of the long-tailed runs (issue 65; Menon et al. 2021, §4: predict with
``argmax_y f_y(x) − δ · log π_y``, π the training label frequencies): how far does each method's accuracy move when
its test logits are shifted, no retraining? Two questions of ``docs/results.md`` section 15 rest on it:

* does ``core_la``'s lead over logit adjustment (both trained at τ = 1) hold when each is also given the
  adjustment that suits it best — or is it what a larger τ would give?
* how does each training objective compare once every one is corrected for the prior after training (δ = 1 is
  Menon et al.'s post-hoc baseline for a CE-trained model)?

Stage 1 (``--logits``) reads each finished run's ``checkpoints/best.ckpt`` under ``RUNS`` (a ``coretune bench``
output's data-set folder: ``RUNS/<method>/frac1/seedN``), predicts the test folder on the CPU at the precision the
run tested at (its ``config.yaml``'s: bf16 autocast for the spec's runs) and keeps the float32 logits in
``CACHE/<method>-seedN.npz``; a run whose δ = 0 top-1 is not its ``results.json`` test top-1 (to 0.1 pp) is refused.
Stage 2 (always) reads the cache, sweeps δ over ``GRID`` for every run — top-1 over all classes and over its
many/medium/few-shot groups (the classes ``results.json`` lists in ``test.shot_groups``) — and cross-fits the choice
of δ: the test images are split per class into two halves (alternate files in path order), δ chosen on one half (the
most accurate; ties to the smallest |δ|) is scored on the other, and the two scores are averaged. The cross-fitted
top-1 is what a user with a balanced held-out set of 5,000 images would get; the same number for every method makes
their comparison fair. Paired differences (seed by seed, :func:`coretune.sweeps.stats.compare`'s t-test) of the
cross-fitted top-1 (over all classes, then each group's), of δ = 0 and of δ = 1 follow. ``--out`` writes everything
as strict JSON (the record); the markdown tables go to stdout.

    .venv/bin/python benchmarks/lt_posthoc.py runs/bench/cifar10-cpu-lt/cifar10_lt100 \\
        --test /work/data/cifar10/test --cache runs/lt-posthoc/lt100 --logits \\
        --out docs/records/cifar10-cpu-lt-posthoc/cifar10_lt100.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from coretune.sweeps.stats import Cell, compare

GRID = tuple(round(-1.0 + 0.1 * i, 1) for i in range(41))
"""The shifts δ swept: −1.0 … 3.0 in steps of 0.1 (0 is the model as trained; 1 is Menon et al.'s post-hoc τ)."""
PAIRS = (
    ("ce_mix", "ce"),
    ("core", "ce"),
    ("core", "ce_mix"),
    ("logit_adjusted", "ce"),
    ("core_la", "logit_adjusted"),
    ("ce_mix_la", "logit_adjusted"),
    ("core_la", "ce_mix_la"),
)
"""The comparisons of section 15 (``a − b``), reported when both methods have runs."""
GROUPS = ("many", "medium", "few")
RUN = re.compile(r"^(?P<method>[\w.-]+)/frac1/seed(?P<seed>\d+)$")


def adjusted_top1(logits: np.ndarray, labels: np.ndarray, log_prior: np.ndarray, deltas) -> np.ndarray:
    """Top-1 (%) of ``argmax(logits − δ · log_prior)`` for each δ of ``deltas`` (one row of ``logits`` an image)."""
    shifted = logits[None, :, :] - np.asarray(deltas, dtype=np.float64)[:, None, None] * log_prior[None, None, :]
    return 100.0 * (shifted.argmax(axis=2) == labels[None, :]).mean(axis=1)


def halves(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two halves of the images, split per class: the class's 1st, 3rd, 5th … image (in the cache's path order) in
    the first, the 2nd, 4th … in the second."""
    rank = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        where = np.flatnonzero(labels == c)
        rank[where] = np.arange(len(where))
    first = rank % 2 == 0
    return np.flatnonzero(first), np.flatnonzero(~first)


def choose(scores: np.ndarray, deltas) -> int:
    """The index of the best score; among equal ones (to 1e-9), the δ of smallest magnitude."""
    best = scores.max()
    tied = [i for i, s in enumerate(scores) if s >= best - 1e-9]
    return min(tied, key=lambda i: (abs(deltas[i]), deltas[i]))


def analyse_run(logits: np.ndarray, labels: np.ndarray, counts: np.ndarray, groups: dict[str, list[int]]) -> dict:
    """One run's sweep (``top1`` and each group's top-1 at every δ of :data:`GRID`), its δ = 0 and δ = 1 readings,
    and the cross-fitted top-1 (over all classes and each group's) with the δ each half chose."""
    log_prior = np.log(counts / counts.sum())
    sweep: dict[str, list[float]] = {"top1": adjusted_top1(logits, labels, log_prior, GRID).tolist()}
    for name, classes in groups.items():
        keep = np.isin(labels, classes)
        sweep[name] = adjusted_top1(logits[keep], labels[keep], log_prior, GRID).tolist() if classes else []
    a, b = halves(labels)
    on_a = adjusted_top1(logits[a], labels[a], log_prior, GRID)
    on_b = adjusted_top1(logits[b], labels[b], log_prior, GRID)
    pick_a, pick_b = choose(on_a, GRID), choose(on_b, GRID)

    def cross_fitted(keep: np.ndarray) -> float:  # each half's images of ``keep``, at the δ the other half chose
        ka, kb = a[keep[a]], b[keep[b]]
        score_b = adjusted_top1(logits[kb], labels[kb], log_prior, [GRID[pick_a]])[0]
        score_a = adjusted_top1(logits[ka], labels[ka], log_prior, [GRID[pick_b]])[0]
        return float((score_b * len(kb) + score_a * len(ka)) / (len(ka) + len(kb)))

    fitted = {"top1": cross_fitted(np.ones(len(labels), dtype=bool))}
    fitted |= {g: cross_fitted(np.isin(labels, c)) if c else None for g, c in groups.items()}
    at = {d: GRID.index(d) for d in (0.0, 1.0)}
    best = choose(np.asarray(sweep["top1"]), GRID)
    return {
        "sweep": sweep,
        "delta0": {k: (v[at[0.0]] if v else None) for k, v in sweep.items()},
        "delta1": {k: (v[at[1.0]] if v else None) for k, v in sweep.items()},
        "best_on_test": {"delta": GRID[best], "top1": sweep["top1"][best]},
        "cross_fitted": {**fitted, "deltas": [GRID[pick_a], GRID[pick_b]]},
    }


def find_runs(root: Path) -> dict[tuple[str, int], Path]:
    """The finished runs under ``root`` (``<method>/frac1/seedN`` with a test top-1 in ``results.json``)."""
    runs = {}
    for results in sorted(root.glob("*/frac1/seed*/results.json")):
        match = RUN.match(str(results.parent.relative_to(root)))
        test = json.loads(results.read_text()).get("test") or {}
        if match and test.get("top1") is not None:
            runs[(match["method"], int(match["seed"]))] = results.parent
    return runs


def predict_logits(run: Path, test: Path, cache: Path) -> Path:
    """Stage 1 for one run (module docstring): ``CACHE/<method>-seedN.npz`` with ``logits``, ``labels`` and
    ``class_names``; kept when it exists."""
    import torch
    import yaml
    from torch.utils.data import DataLoader

    from coretune.apps.devices import placement
    from coretune.data import ImageFileDataset
    from coretune.engine import FineTuner

    target = cache / f"{run.parent.parent.name}-{run.name}.npz"
    if target.exists():
        return target
    model = FineTuner.from_checkpoint(run / "checkpoints" / "best.ckpt", map_location="cpu").eval()
    data = model.trained_data
    transform, draft = model.task.image_transform(data["image_size"], tuple(data["mean"]), tuple(data["std"]))
    dataset = ImageFileDataset(str(test), transform, draft_size=draft)
    names = list(model.class_names)
    unknown = sorted({Path(p).parent.name for p in dataset.paths} - set(names))
    if unknown:
        raise SystemExit(f"lt_posthoc: {test} has classes the checkpoint of {run} lacks: {', '.join(unknown)}")
    labels = np.array([names.index(Path(p).parent.name) for p in dataset.paths])
    precision = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["precision"]
    place = placement("cpu", 1, precision, command="lt_posthoc")  # as the run tested
    out = np.empty((len(dataset), len(names)), dtype=np.float32)
    with torch.inference_mode(), place.autocast():
        for images, indices in DataLoader(dataset, batch_size=256):
            out[indices.numpy()] = model(images).float().numpy()
    check_top1(run, out, labels)
    cache.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256((run / "checkpoints" / "best.ckpt").read_bytes()).hexdigest()
    np.savez_compressed(target, logits=out, labels=labels, class_names=np.array(names), checkpoint_sha256=digest)
    return target


def check_top1(run: Path, logits: np.ndarray, labels: np.ndarray) -> None:
    """Refuse logits whose top-1 is not the run's test top-1 (``results.json``, to 0.1 pp): another test folder,
    preprocessing or checkpoint (a cache left from an earlier run of that name)."""
    expected = 100.0 * json.loads((run / "results.json").read_text())["test"]["top1"]
    got = 100.0 * float((logits.argmax(axis=1) == labels).mean())
    if abs(got - expected) > 0.1:
        raise SystemExit(
            f"lt_posthoc: {run}: top-1 {got:.2f} from these logits, {expected:.2f} in its results.json: not the "
            "run's test (another test folder or checkpoint; delete its cached .npz to predict it again)"
        )


def read_run(run: Path, npz: Path) -> dict:
    """:func:`analyse_run` of a cached run, with its prior and groups from ``results.json`` and the SHA-256 of the
    checkpoint its logits came from."""
    results = json.loads((run / "results.json").read_text())
    cached = np.load(npz)
    check_top1(run, cached["logits"], cached["labels"])
    names = [str(n) for n in cached["class_names"]]
    counts = np.array([results["train_class_counts"][n] for n in names], dtype=np.float64)
    shot = results["test"]["shot_groups"]
    groups = {g: [names.index(c) for c in shot[g]["classes"]] for g in GROUPS}
    analysis = analyse_run(cached["logits"].astype(np.float64), cached["labels"], counts, groups)
    return {"checkpoint_sha256": str(cached["checkpoint_sha256"]), **analysis}


def paired(report: dict[tuple[str, int], dict], key) -> list[dict[str, Any]]:
    """:data:`PAIRS`' paired differences of ``key(analysis)`` (a top-1), seed by seed."""
    rows = []
    for a, b in PAIRS:
        cells = []
        for m in (a, b):
            seeds = sorted(s for mm, s in report if mm == m)
            cells.append(Cell(m, "", 1.0, tuple(key(report[(m, s)]) for s in seeds), tuple(seeds)))
        if cells[0].n and cells[1].n:
            c = compare(*cells)
            if c.paired:
                p = None if math.isnan(c.paired_p) else c.paired_p
                rows.append({"a": a, "b": b, "diffs": list(c.paired), "seeds": list(c.paired_seeds), "p": p})
    return rows


def _mean_sd(values: list[float], sign: str = "") -> str:
    sd = f" ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else ""
    return f"{np.mean(values):{sign}.2f}{sd}"


def tables(report: dict[tuple[str, int], dict], pairs: dict[str, list[dict]]) -> str:
    """Markdown: each method's mean over seeds at δ = 0, δ = 1, best δ on the test set and cross-fitted; the
    cross-fitted top-1 of each shot group; then the paired differences."""
    lines = [
        "| Method (seeds) | δ = 0 (as trained) | δ = 1 | best δ on test (δ) | cross-fitted (δ chosen per half) |",
        "|---|:-:|:-:|:-:|:-:|",
    ]
    for m in sorted({m for m, _ in report}):
        runs = [report[(m, s)] for s in sorted(s for mm, s in report if mm == m)]
        deltas = ", ".join(f"{r['best_on_test']['delta']:+.1f}" for r in runs)
        chosen = "; ".join(", ".join(f"{d:+.1f}" for d in r["cross_fitted"]["deltas"]) for r in runs)
        lines.append(
            f"| {m} ({len(runs)}) | {_mean_sd([r['delta0']['top1'] for r in runs])} | "
            f"{_mean_sd([r['delta1']['top1'] for r in runs])} | "
            f"{_mean_sd([r['best_on_test']['top1'] for r in runs])} ({deltas}) | "
            f"{_mean_sd([r['cross_fitted']['top1'] for r in runs])} ({chosen}) |"
        )
    lines += ["", "| Method, cross-fitted | top-1 | many-shot | medium-shot | few-shot |", "|---|:-:|:-:|:-:|:-:|"]
    for m in sorted({m for m, _ in report}):
        fitted = [report[(m, s)]["cross_fitted"] for s in sorted(s for mm, s in report if mm == m)]
        cells = [_mean_sd([f[k] for f in fitted]) if fitted[0][k] is not None else "–" for k in ("top1", *GROUPS)]
        lines.append(f"| {m} | {' | '.join(cells)} |")
    lines += ["", "| Comparison | reading | mean ± sd | per seed | paired p |", "|---|---|:-:|:-:|:-:|"]
    for reading, rows in pairs.items():
        for r in rows:
            p = "–" if r["p"] is None else f"{r['p']:.3g}"
            per_seed = ", ".join(f"{d:+.2f}" for d in r["diffs"])
            lines.append(f"| {r['a']} − {r['b']} | {reading} | {_mean_sd(r['diffs'], '+')} | {per_seed} | {p} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="a bench output's data-set folder: RUNS/<method>/frac1/seedN")
    parser.add_argument("--test", type=Path, help="the test image folder (<class>/<image>), for --logits")
    parser.add_argument("--cache", type=Path, required=True, help="folder of the runs' test logits (.npz)")
    parser.add_argument("--logits", action="store_true", help="predict the runs not cached yet (stage 1)")
    parser.add_argument("--out", type=Path, help="write the record (strict JSON) here; refused if it exists")
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        raise SystemExit(f"lt_posthoc: not a folder: {args.runs} (give a bench output's data-set folder)")
    if args.logits and (args.test is None or not args.test.is_dir()):
        raise SystemExit(f"lt_posthoc: --logits needs --test, the test image folder (got {args.test})")
    if args.out is not None and args.out.exists():
        raise SystemExit(f"lt_posthoc: {args.out} exists: give another --out (this script does not replace files)")
    runs = find_runs(args.runs)
    if not runs:
        raise SystemExit(f"lt_posthoc: no finished run (<method>/frac1/seedN/results.json) under {args.runs}")
    report = {}
    for (method, seed), run in sorted(runs.items()):
        npz = predict_logits(run, args.test, args.cache) if args.logits else args.cache / f"{method}-seed{seed}.npz"
        if npz.exists():
            report[(method, seed)] = read_run(run, npz)
        else:
            print(f"lt_posthoc: {method} seed {seed}: no cached logits (run with --logits)", file=sys.stderr)
    pairs = {
        "δ = 0": paired(report, lambda r: r["delta0"]["top1"]),
        "δ = 1": paired(report, lambda r: r["delta1"]["top1"]),
        "cross-fitted": paired(report, lambda r: r["cross_fitted"]["top1"]),
    }
    for g in GROUPS:  # a group without classes (R = 10's few-shot) has no pairs
        if all(r["cross_fitted"][g] is not None for r in report.values()):
            pairs[f"cross-fitted, {g}-shot"] = paired(report, lambda r, g=g: r["cross_fitted"][g])
    print(tables(report, pairs))
    if args.out is not None:
        record = {
            "runs": str(args.runs),
            "grid": list(GRID),
            "analyses": {f"{m}/seed{s}": r for (m, s), r in sorted(report.items())},
            "paired": pairs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
