"""ViT fine-tuning: per-step costs (issue 64). The time of a FineTuner training step of Core-tuning, of layer-wise
learning-rate decay, of weight EMA and of LoRA, each as a ratio to the CE-tuning step, on a ViT-Tiny and a ResNet-18,
interleaved in one process so a change in the machine's load hits every variant alike.

    .venv/bin/python benchmarks/vit_speed.py --repeats 8 --out /tmp/vit_speed

The backbones: timm's ``vit_tiny_patch16_224`` at 32 px with 4 px patches (65 tokens; as
``configs/cpu/vit_s16_dino.yaml`` and ``configs/pretrain/cifar10_vit_tiny_moco_v3.yaml`` build it) and ResNet-18 at
32 px, random weights (the cost does not depend on them), random images, 10 classes, batch 64. The variants:

* ``ce``: CE-tuning; ``core``: Core-tuning's default preset (``--objective core``);
* ``ce+layer_decay``: CE with ``--model.optim.layer_decay 0.75`` (timm's layer groups: one optimiser group per
  layer and weight-decay kind);
* ``ce+ema``: CE with ``--averaging.ema_decay 0.999``: the :class:`~coretune.engine.averaging.AveragedWeights`
  callback's ``on_train_batch_end`` after each optimiser step, as Lightning calls it (the EMA copy made by its
  ``on_fit_start``); its own time is also given alone;
* ``ce+lora``: CE with ``--model.optim.lora.rank 8`` (peft's LoRA on ``qkv``; ViTs only: its default targets are
  a ViT's layers).

One step is the engine's: ``FineTuner.training_step`` under autocast (as Lightning's ``bf16-mixed`` runs it: the
task's features, the objective's loss, the training metrics), backward, ``step`` of the optimiser the engine builds
(``FineTuner.optimizer_groups`` through ``build_optimizer``, as ``configure_optimizers`` does; AdamW for the ViT, as
its config, Nesterov SGD for the ResNet, as the paper) and the objective's after-step hook. Not timed: Lightning's
loop, logging and the learning-rate schedule (the same for every variant; ``step_overhead.py`` measures the loop).
Each round runs one step of every variant in turn (A B C D A B C D …); the first ``--warmup`` rounds are discarded;
reported are the median ms per step over the timed rounds and the median over rounds of each variant ÷ the CE step
of the same round.

``--smoke``: tiny models and 2 steps each (the test runs it). ``--threads 1 --clock cpu``: CPU seconds of one thread,
robust to other jobs on a shared machine (as ``objective_speed.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from coretune.engine import FineTuner, OptimSettings, build_optimizer, default_precision
from coretune.engine.averaging import AveragedWeights, Averaging
from coretune.models.lora import LoRASettings
from coretune.objectives import create

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}

#: (backbone name, its arguments, optimiser) of each model benchmarked; ``--smoke`` shrinks them
BACKBONES: dict[str, tuple[str, dict[str, Any], str]] = {
    "vit_tiny": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4}, "adamw"),
    "resnet18": ("resnet18", {}, "sgd"),
}
SMOKE_BACKBONE_ARGS = {"vit_tiny": {"patch_size": 4, "depth": 2}}

VARIANTS = ("ce", "core", "ce+layer_decay", "ce+ema", "ce+lora")


@dataclass
class Step:
    """A variant's training step (``run(x, y)``: the EMA update's own seconds, 0 without EMA) and what it steps."""

    run: Callable[[torch.Tensor, torch.Tensor], float]
    model: FineTuner
    optimizer: torch.optim.Optimizer
    ema: AveragedWeights | None

    def facts(self) -> dict[str, int | None]:
        """What the variant's settings made of the step: optimiser groups, trainable tensors, EMA updates done."""
        return {
            "param_groups": len(self.optimizer.param_groups),
            "trainable_tensors": sum(p.requires_grad for p in self.model.parameters()),
            "ema_updates": None if self.ema is None else self.ema.n_averaged,
        }


def build_step(backbone: str, variant: str, *, image_size: int, classes: int, bf16: bool, smoke: bool) -> Step:
    """One engine training step of ``variant`` on ``backbone`` (a key of :data:`BACKBONES`), on a fresh seeded
    FineTuner with random weights."""
    name, backbone_args, optimizer = BACKBONES[backbone]
    backbone_args = {**backbone_args, **(SMOKE_BACKBONE_ARGS.get(backbone, {}) if smoke else {})}
    if "img_size" in backbone_args:
        backbone_args["img_size"] = image_size
    lr, weight_decay = (2.5e-4, 0.05) if optimizer == "adamw" else (0.01, 1e-4)
    optim = OptimSettings(
        optimizer=optimizer,  # type: ignore[arg-type]
        lr=lr,
        weight_decay=weight_decay,
        layer_decay=0.75 if variant == "ce+layer_decay" else None,
        lora=LoRASettings(rank=8) if variant == "ce+lora" else LoRASettings(),
    )
    torch.manual_seed(0)
    objective = create("core" if variant == "core" else "ce")
    model = FineTuner(objective, backbone=name, backbone_args=backbone_args, optim=optim)
    model.build(classes)
    model.objective.attach_backbone(model.backbone)  # FineTuner.setup's, before a fit
    model.train()
    opt = build_optimizer(model.optimizer_groups(), optim.optimizer, optim.momentum, optim.nesterov, model.weight_decay)
    trainer = SimpleNamespace(global_step=0, max_epochs=1, datamodule=None, callbacks=[])
    ema = Averaging(ema_decay=0.999).callback() if variant == "ce+ema" else None
    if ema is not None:
        ema.setup(trainer, model, "fit")  # type: ignore[arg-type]  (what it reads of a trainer)
        ema.on_fit_start(trainer, model)  # type: ignore[arg-type]
    clock = CLOCK

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model.training_step((x, y), trainer.global_step)
        loss = out["loss"] if isinstance(out, dict) else out
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.objective.on_after_optimizer_step()
        trainer.global_step += 1
        if ema is None:
            return 0.0
        start = clock()
        ema.on_train_batch_end(trainer, model, out, (x, y), trainer.global_step - 1)  # type: ignore[arg-type]
        return clock() - start

    return Step(step, model, opt, ema)


CLOCK: Callable[[], float] = time.perf_counter


def measure(args: argparse.Namespace, bf16: bool) -> dict[str, Any]:
    """Every (backbone, variant) step, interleaved; the JSON record of the medians and ratios."""
    have_peft = importlib.util.find_spec("peft") is not None
    skipped: dict[str, str] = {}
    steps: dict[tuple[str, str], Step] = {}
    for backbone in args.backbones:
        for variant in args.variants:
            key = f"{backbone} {variant}"
            if variant == "ce+lora" and not backbone.startswith("vit"):
                skipped[key] = "LoRA's default targets (qkv) are a ViT's layers"
                continue
            if variant == "ce+lora" and not have_peft:
                skipped[key] = "peft is not installed: pip install 'coretune[peft]'"
                continue
            steps[(backbone, variant)] = build_step(
                backbone, variant, image_size=args.image_size, classes=args.classes, bf16=bf16, smoke=args.smoke
            )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.arange(args.batch_size) % args.classes
    times: dict[tuple[str, str], list[float]] = {k: [] for k in steps}
    ema_times: dict[tuple[str, str], list[float]] = {k: [] for k in steps}
    for r in range(args.warmup + args.repeats):
        for key, step in steps.items():
            start = CLOCK()
            ema_s = step.run(x, y)
            if r >= args.warmup:
                times[key].append(CLOCK() - start)
                ema_times[key].append(ema_s)
        if not args.smoke:
            print(f"round {r + 1}/{args.warmup + args.repeats} done", flush=True)
    rows = []
    for (backbone, variant), ts in times.items():
        ce = times.get((backbone, "ce"))
        ratio = statistics.median(t / c for t, c in zip(ts, ce, strict=True)) if ce else None
        ema = statistics.median(ema_times[(backbone, variant)]) if variant == "ce+ema" else None
        rows.append(
            {
                "backbone": backbone,
                "variant": variant,
                "ms_per_step": 1e3 * statistics.median(ts),
                "ratio_to_ce": ratio,
                "ema_update_ms": None if ema is None else 1e3 * ema,
                **steps[(backbone, variant)].facts(),
                "steps_ms": [1e3 * t for t in ts],
            }
        )
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "clock": args.clock,
        "precision": "bf16 autocast" if bf16 else "float32",
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "classes": args.classes,
        "warmup_rounds": args.warmup,
        "timed_rounds": args.repeats,
        "smoke": args.smoke,
        "rows": rows,
        "skipped": skipped,
    }


def markdown(record: dict[str, Any]) -> str:
    """The record as the Markdown table of docs/benchmarks.md, with its header line."""
    r = record
    lines = [
        f"torch {r['torch']}, {r['threads']} threads, {r['clock']} clock, CPU, {r['image_size']} px, batch "
        f"{r['batch_size']}, {r['precision']}, engine training step, median of {r['timed_rounds']} interleaved "
        f"rounds after {r['warmup_rounds']} warm-up rounds",
        "",
        "| backbone | variant | ms / step | ÷ CE step (median over rounds) | EMA update ms | optimiser groups "
        "| trainable tensors |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        ratio = "—" if row["ratio_to_ce"] is None else f"{row['ratio_to_ce']:.3f}"
        ema = "" if row["ema_update_ms"] is None else f"{row['ema_update_ms']:.1f}"
        lines.append(
            f"| {row['backbone']} | {row['variant']} | {row['ms_per_step']:.1f} | {ratio} | {ema} "
            f"| {row['param_groups']} | {row['trainable_tensors']} |"
        )
    lines += [f"\n{key}: skipped ({why})" for key, why in r["skipped"].items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8, help="timed rounds (one step of every variant each)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--backbones", nargs="+", choices=sorted(BACKBONES), default=list(BACKBONES))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--precision", choices=["auto", "32"], default="auto", help="auto: as coretune fit picks")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: the process's CPU seconds")
    parser.add_argument("--out", type=Path, default=None, help="a folder for vit_speed.json and vit_speed.md")
    parser.add_argument("--smoke", action="store_true", help="tiny models, batch 16 at 32 px, 2 steps each")
    args = parser.parse_args(argv)
    if args.smoke:
        # not smaller: at 8 px and batch 4 ResNet-18's last stages normalise 4 values a channel (1x1 maps), and one
        # SGD step then turned the network's outputs NaN in about 1 run of 8 (bf16 kernels are not bit-exact)
        args.repeats, args.warmup, args.batch_size, args.image_size = 1, 1, 16, 32
    if "ce" not in args.variants:
        parser.error("--variants must include ce: every ratio is to the CE step")
    for name in ("repeats", "batch_size", "image_size", "classes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0 (got {args.warmup})")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    bf16 = args.precision == "auto" and default_precision() == "bf16-mixed"
    with warnings.catch_warnings():  # training_step's self.log without a Trainer: nothing to log to, by design
        warnings.filterwarnings("ignore", message=".*self.log.*")
        record = measure(args, bf16)
    table = markdown(record)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vit_speed.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / "vit_speed.md").write_text(table + "\n")
    return record


if __name__ == "__main__":
    main()
