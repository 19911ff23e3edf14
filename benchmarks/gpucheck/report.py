"""The check's environment, its ratios against issue 62's targets, and the Markdown it writes beside the JSON."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

import torch

#: issue 62's targets on a GPU: (key in ``ratios``, what it compares, the comparison, the bound)
TARGETS = (
    ("fit_ce_over_bare", "`coretune fit` (CE) ÷ bare loop, images/s", ">=", 0.95),
    ("core_time_over_ce", "Core ÷ CE step time (`coretune fit`)", "<=", 1.05),
    ("loader_over_model", "loader (`num_workers auto`) ÷ images/s the model consumes", ">=", 1.5),
)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Python, torch, CUDA, cuDNN, the card(s), the CPU cores, and the versions of the libraries that time."""
    cuda = torch.cuda.is_available()
    cards = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "gpus": cards,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "bf16_supported": torch.cuda.is_bf16_supported() if cuda else None,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "lightning": _version("lightning"),
        "timm": _version("timm"),
        "coretune": _version("coretune"),
        "coretune_from": sys.modules["coretune"].__file__ if "coretune" in sys.modules else None,
    }


def rate(rows: list[dict[str, Any]], **match: Any) -> float | None:
    """The images/s of the one row matching ``match`` that ran (None: none did)."""
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()) and row.get("status") == "ok":
            return row["images_per_s"]
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def model_ratios(rows: list[dict[str, Any]], model: str) -> dict[str, float | None]:
    """One model's ratios of images/s: its bf16 rows against each other, fp16 against bf16, compiled against eager."""

    def of(runner: str, objective: str | None = None, compiled: bool = False, at: str = "bf16-mixed") -> float | None:
        return rate(rows, model=model, runner=runner, objective=objective, compile=compiled, precision=at)

    fit_ce, fit_core, bare = of("fit", "ce"), of("fit", "core"), of("bare")
    fit_compiled, bare_compiled = of("fit", "ce", compiled=True), of("bare", compiled=True)
    return {
        "fit_ce_over_bare": ratio(fit_ce, bare),
        "core_time_over_ce": ratio(fit_ce, fit_core),  # time per image: the inverse of the images/s ratio
        "fp16_over_bf16_bare": ratio(of("bare", at="16-mixed"), bare),
        "fp16_over_bf16_fit_ce": ratio(of("fit", "ce", at="16-mixed"), fit_ce),
        "compiled_over_eager_bare": ratio(bare_compiled, bare),
        "compiled_over_eager_fit_ce": ratio(fit_compiled, fit_ce),
        "fit_ce_over_bare_compiled": ratio(fit_compiled, bare_compiled),
    }


def verdicts(ratios: dict[str, dict[str, float | None]], on_gpu: bool) -> list[dict[str, Any]]:
    """Each target against each model's ratio (and the loader's against the first model's CE fit); ``met`` is
    None where the ratio is missing or off a GPU, where the targets do not apply."""
    out = []
    for key, what, op, bound in TARGETS:
        for model, values in ratios.items():
            value = values.get(key)
            if value is None:
                continue
            met = (value >= bound if op == ">=" else value <= bound) if on_gpu else None
            out.append({"model": model, "check": what, "value": value, "target": f"{op} {bound}", "met": met})
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.3f}" if value < 10 else f"{value:,.0f}"
    return str(value)


def markdown(result: dict[str, Any]) -> str:
    """The check as Markdown: the environment, every measurement, the loader, the DDP fit and the targets."""
    env = result["environment"]
    card = ", ".join(env["gpus"]) or "no GPU (CPU)"
    lines = [
        f"# coretune GPU check ({result['mode']})",
        "",
        f"{card}; torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, Python {env['python']}, "
        f"{env['cpu_cores']} CPU cores; Lightning {env['lightning']}, timm {env['timm']}, coretune {env['coretune']}. "
        f"{result['settings']['steps']} timed steps after {result['settings']['warmup']} warm-up steps per row; "
        f"total {result['total_s']} s.",
    ]
    if result["mode"] == "smoke":
        lines += ["", "**Smoke run (tiny models on CPU): the numbers test the script, they measure nothing.**"]
    lines += [
        "",
        "| model | run | objective | precision | compile | images/s | ms/step | peak GPU GiB | status |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for row in result["measurements"]:
        run = "`coretune fit`" if row["runner"] == "fit" else "bare loop"
        status = row.get("compile_status") or row["status"]
        cells = [row["model"], run, row.get("objective"), row["precision"], row["compile"], row.get("images_per_s")]
        cells += [row.get("step_ms"), row.get("peak_memory_gib"), status]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    loader, ddp = result["loader"], result["ddp"]
    lines += [
        "",
        f"Loader alone ({loader.get('image_size')} px, batch {loader.get('batch_size')}, num_workers auto = "
        f"{loader.get('num_workers')}, pin_memory {loader.get('pin_memory')}): "
        f"**{_cell(loader.get('images_per_s'))} images/s** ({loader['status']}).",
        "",
        f"DDP, 2 processes, Core-tuning with global mining: {ddp['status']}"
        + (f", {_cell(ddp.get('images_per_s'))} images/s" if ddp.get("images_per_s") else "")
        + ".",
        "",
        "| model | check | value | target | met |",
        "|---|---|---:|---|---|",
    ]
    for v in result["targets"]:
        met = "n/a (no GPU)" if v["met"] is None else _cell(v["met"])
        lines.append(f"| {v['model']} | {v['check']} | {v['value']:.3f} | {v['target']} | {met} |")
    targeted = {key for key, *_ in TARGETS}
    others = [
        f"{model}: " + ", ".join(f"{k} {_cell(v)}" for k, v in values.items() if k not in targeted)
        for model, values in result["ratios"].items()
    ]
    lines += ["", "Other ratios (images/s over images/s): " + "; ".join(others) + "."]
    return "\n".join(lines) + "\n"
