"""The GPU check (issue 62): is coretune as fast as PyTorch on a GPU? One command, within ~8 minutes on one GPU.

    python benchmarks/gpu_check.py [--out DIR]      # on a GPU; writes DIR/gpu_check.json and DIR/gpu_check.md
    python benchmarks/gpu_check.py --smoke          # the same code on CPU with tiny models, under a minute
    benchmarks/gpu_check.sh                         # on a GPU machine without coretune's dependencies (offline)

Measures, for ResNet-50 at 224 px (channels-last) and ViT-S/16 (``timm/vit_small_patch16_224``), batch 128:
training images/s of ``coretune fit``'s engine (CE-tuning and Core-tuning) against a bare PyTorch loop with the
same model, synthetic batches on the GPU, precision and memory format (bf16, then fp16; eager, then compiled with
``torch.compile``), peak GPU memory of each; the training loader alone (``num_workers auto``, a generated JPEG
folder) against what the model consumes; and, where 2 GPUs are present, a 2-process DDP fit with Core-tuning's
global hard-pair mining. Rows run most important first; once ``--budget-s`` has passed the rest are skipped.
Targets on a GPU: ``coretune fit`` ÷ bare loop >= 0.95 (images/s); Core ÷ CE <= 1.05 (time per image); loader >=
1.5x what the model consumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpucheck import loading, report, steps
from gpucheck.steps import ModelSpec, StepSettings

GPU_MODELS = (
    ModelSpec("resnet50", "resnet50", 224, 128, channels_last=True),
    ModelSpec("vit_small_patch16", "timm/vit_small_patch16_224", 224, 128, channels_last=False),
)
SMOKE_MODELS = (
    ModelSpec("small_cnn", "small_cnn", 16, 4, channels_last=True),
    ModelSpec("vit_tiny_2_blocks", "timm/vit_tiny_patch16_224", 16, 4, channels_last=False, backbone_args={"depth": 2}),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="folder for the results")
    parser.add_argument("--smoke", action="store_true", help="tiny models and sizes on CPU: tests the script")
    parser.add_argument("--steps", type=int, help="timed steps per row (default 30; smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 10, covering compilation; smoke 1)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="skip the rows left after this many seconds")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process DDP fit")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (1 if args.smoke else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    problems = [f"--{name} must be >= {low} (got {value})" for name, value, low in
                (("steps", args.steps, 1), ("warmup", args.warmup, 0), ("budget-s", args.budget_s, 0))
                if value < low]  # fmt: skip
    if not args.smoke and not torch.cuda.is_available():
        problems.append("no CUDA GPU here: run it on a GPU machine, or pass --smoke to test the script on CPU")
    if problems:
        parser.error("; ".join(problems))
    return args


class Check:
    """Runs the measurements in order, each guarded: an error or the spent budget marks its row and the check
    goes on."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.perf_counter(), budget_s
        self.errors = 0

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.start, 1)

    def run(self, what: str, measure: Callable[[], dict[str, Any]], skip: str | None = None) -> dict[str, Any]:
        if skip is None and self.elapsed() > self.budget_s:
            skip = f"time budget of {self.budget_s:.0f} s spent"
        if skip is not None:
            print(f"[{self.elapsed():6.1f} s] {what}: skipped ({skip})", flush=True)
            return {"status": f"skipped: {skip}"}
        try:
            result = measure() | {"status": "ok"}
        except Exception as err:  # one failed row must not lose the others' numbers
            traceback.print_exc()
            self.errors += 1
            first = (str(err).strip().splitlines() or ["no message"])[0][:300]
            result = {"status": f"error: {type(err).__name__}: {first}"}
        shown = {k: v for k, v in result.items() if k in ("images_per_s", "peak_memory_gib", "status")}
        print(f"[{self.elapsed():6.1f} s] {what}: {shown}", flush=True)
        return result


def plan(models: tuple[ModelSpec, ...]) -> list[dict[str, Any]]:
    """The model rows in the order they run: bf16 eager (bare loop, CE fit, Core fit) for every model, then fp16
    (bare, CE), then compiled (bare, CE)."""
    kinds = (
        [("bare", None, "bf16-mixed", False), ("fit", "ce", "bf16-mixed", False), ("fit", "core", "bf16-mixed", False)],
        [("bare", None, "16-mixed", False), ("fit", "ce", "16-mixed", False)],
        [("bare", None, "bf16-mixed", True), ("fit", "ce", "bf16-mixed", True)],
    )
    keys = ("runner", "objective", "precision", "compile")
    return [
        {"model": spec.label, **dict(zip(keys, kind, strict=True))}
        for group in kinds
        for spec in models
        for kind in group
    ]


def model_row(check: Check, row: dict[str, Any], spec: ModelSpec, settings: StepSettings, no_compile: bool) -> dict:
    skip = None
    if row["compile"] and no_compile:
        skip = "--no-compile"
    elif row["compile"] and row["runner"] == "fit" and not steps.fine_tuner_takes_compile():
        skip = "this coretune's FineTuner has no compile setting"
    if row["runner"] == "bare":
        measure = lambda: steps.bare_loop(spec, settings, row["precision"], row["compile"])  # noqa: E731
    else:
        measure = lambda: steps.fit_run(spec, settings, row["precision"], row["compile"], row["objective"])  # noqa: E731
    name = [spec.label, row["runner"], row["objective"] or "", row["precision"], "compiled" if row["compile"] else ""]
    measured = check.run(" ".join(" ".join(name).split()), measure, skip)
    return row | {"image_size": spec.image_size, "batch_size": spec.batch_size, "channels_last": spec.channels_last,
                  "backbone": spec.backbone} | measured  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check = Check(args.budget_s)
    device = "cpu" if args.smoke else "cuda"
    models = SMOKE_MODELS if args.smoke else GPU_MODELS
    settings = StepSettings(args.steps, args.warmup, device, compile_backend="eager" if args.smoke else "inductor")
    env = report.environment()
    print(f"coretune GPU check ({'smoke' if args.smoke else 'gpu'}): {json.dumps(env)}", flush=True)
    specs = {spec.label: spec for spec in models}
    todo = plan(models)

    def run_rows(which: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [model_row(check, r, specs[r["model"]], settings, args.no_compile) for r in which]

    rows = run_rows([r for r in todo if not r["compile"] and r["precision"] == "bf16-mixed"])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        size, count = ((48, 40), 64) if args.smoke else ((500, 375), 4608)
        batch, batches = (8, 4) if args.smoke else (128, 24)
        written = check.run("JPEG folder", lambda: loading.make_jpeg_folder(folder, count, size))
        no_folder = None if written["status"] == "ok" else "no image folder"
        measure = lambda: loading.loader_rate(folder, models[0].image_size, batch, batches)  # noqa: E731
        loader = check.run("loader", measure, no_folder) | {"folder": written}
        rows += run_rows([r for r in todo if not r["compile"] and r["precision"] == "16-mixed"])
        # before the compiled rows: where 2 GPUs are, whether DDP with global mining runs matters more
        gpus = torch.cuda.device_count()
        why_not = "--no-ddp" if args.no_ddp else None if args.smoke or gpus >= 2 else f"{gpus} GPU (needs 2)"
        ddp_args = ("small_cnn", 16, 4, 2, "cpu") if args.smoke else ("resnet50", 224, 64, 30, "gpu")
        measure = lambda: loading.ddp_fit(folder, Path(tmp) / "ddp-run", *ddp_args)  # noqa: E731
        ddp = check.run("DDP fit, 2 processes, global mining", measure, why_not or no_folder)
    rows += run_rows([r for r in todo if r["compile"]])

    ratios = {spec.label: steps_ratios(rows, loader, spec.label) for spec in models}
    result = {
        "mode": "smoke" if args.smoke else "gpu",
        "environment": env,
        "settings": {
            "steps": args.steps,
            "warmup": args.warmup,
            "budget_s": args.budget_s,
            "compile_backend": settings.compile_backend,
        },
        "measurements": rows,
        "loader": loader,
        "ddp": ddp,
        "ratios": ratios,
        "targets": report.verdicts(ratios, on_gpu=not args.smoke),
        "total_s": check.elapsed(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu_check.md").write_text(report.markdown(result))
    print(report.markdown(result))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}; total {result['total_s']} s", flush=True)
    return 1 if check.errors else 0


def steps_ratios(rows: list[dict[str, Any]], loader: dict[str, Any], model: str) -> dict[str, float | None]:
    """:func:`report.model_ratios`, and the loader's images/s over the fastest CE fit's of the model (eager or
    compiled, bf16 or fp16): what the model consumes at its fastest."""
    ratios = report.model_ratios(rows, model)
    fits = [r["images_per_s"] for r in rows if r["model"] == model and r["runner"] == "fit" and r["status"] == "ok"
            and r["objective"] == "ce"]  # fmt: skip
    ratios["loader_over_model"] = report.ratio(loader.get("images_per_s"), max(fits, default=None))
    return ratios


if __name__ == "__main__":
    sys.exit(main())
