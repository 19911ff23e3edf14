"""A stand-in for ``coretune`` and for ``python benchmarks/<script>.py`` under benchmarks/study_queue.sh's test: it
does what each command the queue calls leaves on disk (a finished run's results.json, an export, the robust
results, the snapshots of a pre-training, the kNN and probe scores), in milliseconds, and logs every call.

Called as ``queue_stub.py coretune ARGS`` or ``queue_stub.py python SCRIPT ARGS``. Environment: ``QUEUE_STUB_LOG``
(the call log), ``QUEUE_STUB_FAIL`` (``objective/seed/dataset`` of a fit that fails), ``QUEUE_STUB_DIVERGE`` (of fits
that diverge, comma-separated: recorded as ``diverged`` and, as by ``coretune bench``, never fitted again),
``QUEUE_STUB_PRECISION`` (the default precision ``python -c`` prints; ``bf16-mixed``), ``QUEUE_STUB_STRONGEST``
(the column ``strength_gain.py evaluate`` names the strongest; ``simclr_in20``). ``strength_gain.py plot`` writes a
placeholder figure and table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import types
from pathlib import Path

ROBUST = ("robust_results.json", "robust_results_autoattack.json", "robust_results_sanity_linf8.json")


def option(args: list[str], name: str) -> list[str] | None:
    """The words after ``--name`` up to the next option; a ``[a, b]`` word is split into its items."""
    if name not in args:
        return None
    words = []
    for word in args[args.index(name) + 1 :]:
        if word.startswith("--"):
            break
        words += [w.strip() for w in word.strip("[]").split(",") if w.strip()]
    return words


def spec_of(path: str) -> dict:
    """The few entries of a bench spec the queue's commands need, read without a YAML parser."""
    text = Path(path).read_text()
    block = text.split("\ndatasets:", 1)[1].split("\nobjectives:", 1)[0]
    return {
        "output": re.search(r"^output: *(\S+)", text, re.M)[1],
        "datasets": re.findall(r"^  (\w+): \[", block, re.M),
        "fraction": re.search(r"^label_fractions: *\[ *([0-9.]+)", text, re.M)[1],
    }


def runs(args: list[str]) -> list[tuple[Path, str]]:
    spec = spec_of(args[1])
    datasets = option(args, "--only_datasets") or spec["datasets"]
    found = []
    for dataset in datasets:
        for objective in option(args, "--only_objectives"):
            for seed in option(args, "--only_seeds"):
                label = f"{objective}/{seed}/{dataset}"
                found.append(
                    (Path(spec["output"], dataset, objective, f"frac{spec['fraction']}", f"seed{seed}"), label)
                )
    return found


def bench(args: list[str]) -> int:
    export = option(args, "--export")
    status = 0
    for run, label in runs(args):
        results = json.loads((run / "results.json").read_text()) if (run / "results.json").is_file() else {}
        finished, diverged = "test" in results, "diverged" in results
        if export:
            if finished or diverged:
                target = Path(export[0]) / run.relative_to(spec_of(args[1])["output"])
                target.mkdir(parents=True, exist_ok=True)
                for name in ("results.json", *ROBUST):
                    if (run / name).is_file():
                        shutil.copy(run / name, target / name)
        elif not finished:
            if label == os.environ.get("QUEUE_STUB_FAIL") or diverged:
                status = 1
                continue
            if label in os.environ.get("QUEUE_STUB_DIVERGE", "").split(","):
                run.mkdir(parents=True, exist_ok=True)
                (run / "results.json").write_text(json.dumps({"diverged": "the training loss is nan …"}))
                status = 1
                continue
            (run / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run / "checkpoints" / "last.ckpt").write_text("weights")
            (run / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
    return status


def pretrain(args: list[str]) -> int:
    run_dir = Path(option(args, "--run_dir")[0])
    run_dir.mkdir(parents=True, exist_ok=True)
    for epoch in option(args, "--snapshot_epochs"):
        (run_dir / f"pretrained-epoch{epoch}.pth.tar").write_text(f"{option(args, '--method')[0]} epoch {epoch}")
    (run_dir / "metrics.csv").write_text("epoch,step\n0,1\n")
    (run_dir / "results.json").write_text(json.dumps({"epochs": 15}))
    return 0


def robust_table(args: list[str]) -> int:
    spec = spec_of(args[2])
    objective, seed = option(args, "--only_objectives")[0], option(args, "--only_seeds")[0]
    run = Path(spec["output"], "cifar10", objective, f"frac{spec['fraction']}", f"seed{seed}")
    (run / ROBUST[0]).write_text("{}")
    if seed == "0":
        (run / ROBUST[1]).write_text("{}")
    if objective == "ce":
        (run / ROBUST[2]).write_text("{}")
    return 0


def strength_gain(args: list[str]) -> int:
    spec, eval_dir = spec_of(args[2]), Path(option(args, "--eval_dir")[0])
    if args[1] == "plot":
        Path(option(args, "--figure")[0]).parent.mkdir(parents=True, exist_ok=True)
        Path(option(args, "--figure")[0]).write_bytes(b"\x89PNG")
        Path(option(args, "--markdown")[0]).write_text("| Labels | Checkpoint |\n")
        return 0
    strongest = os.environ.get("QUEUE_STUB_STRONGEST", "simclr_in20")
    eval_dir.mkdir(parents=True, exist_ok=True)
    for column in option(args, "--only_datasets") or spec["datasets"]:
        for protocol in ("knn", "linear"):
            if not (eval_dir / f"{column}-{protocol}.json").is_file():
                top1 = 0.9 if column == strongest else 0.3
                (eval_dir / f"{column}-{protocol}.json").write_text(json.dumps({"top1": top1}))
    scored = [c for c in spec["datasets"] if (eval_dir / f"{c}-knn.json").is_file()]
    print(f"strongest by kNN top-1{'' if scored == spec['datasets'] else ' so far'}: {strongest} (90.00%); ...")
    return 0


def main() -> int:
    role, args = sys.argv[1], sys.argv[2:]
    with open(os.environ["QUEUE_STUB_LOG"], "a") as log:
        log.write(" ".join(args) + "\n")
    if role == "python" and args[0] == "-c" and "live_claim" in args[1]:  # the pre-training's claim: the real test
        sys.argv = ["-c", *args[2:]]
        # coretune's real coretune.runs.claim, without the package's __init__ (which imports torch: ~2 s of CPU a call)
        found = importlib.util.find_spec("coretune")
        package = types.ModuleType("coretune")
        package.__path__ = list(found.submodule_search_locations)
        sys.modules["coretune"] = package
        exec(compile(args[1], "-c", "exec"), {"__name__": "__main__"})
        return 0
    if role == "python" and args[0] == "-c":  # the queue's check of coretune's default precision
        print(os.environ.get("QUEUE_STUB_PRECISION", "bf16-mixed"))
        return 0
    if role == "python":
        script = Path(args[0]).stem
        return {"robust_table": robust_table, "strength_gain": strength_gain}[script](args)
    return {"bench": bench, "pretrain": pretrain}[args[0]](args)


if __name__ == "__main__":
    sys.exit(main())
