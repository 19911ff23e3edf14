"""What makes Core-tuning collapse at the paper's ImageNet20 learning rate 0.1? (issue 41, part 3)

Short controlled fine-tuning runs of the shared SimCLR ResNet-18 on real CIFAR-10 (10% of the labels, a stratified
seeded subset), SGD + Nesterov at lr 0.1 with the linear decay and weight decay of ``configs/cpu/imagenet20.yaml``.
Each variant changes ONE thing against ``core`` (η 0.1, α 1, τ 0.07: the config's objective) to isolate a
candidate cause:

- the contrastive term through a fresh projection head (``core_no_con``: η 0, the generated rows stay in the CE;
  ``core_no_mix``: the contrastive term stays, no generated rows in the classifier's CE);
- bf16 (``core_fp32``: no autocast anywhere; ``core_fp32_head``: autocast for the backbone only, the objective in
  float32);
- the generated rows' share of the classifier's CE (``core_no_mix`` above);
- and candidate remedies: ``core_warmup`` (linear warm-up over 20 steps), ``core_clip`` and ``ce_clip``
  (gradient-norm clipping at 1), ``core_head_lr`` (the backbone at 0.1× the heads' learning rate);
  ``core_lr001`` is the reference at the paper's CIFAR-10 learning rate 0.01.

Per step it records the loss terms, the training top-1 of the batch, the total gradient norm per parameter group
(backbone, classifier, projection head) before any clipping, and at each of the first 5 steps and every
``--grad-every`` steps after that the gradient norm of each loss term separately (``ce``, ``ce_mix``, ``η·con``)
on the backbone, the classifier, the projection head and the features ``z`` (one extra backward pass per term);
the mean feature norm ``‖z‖`` and the classifier's weight norm. At the end: the test top-1 on ``--test-images``
CIFAR-10 test images (every k-th: all classes).

Run one variant at a time (one torch process; the machine's 2 cores are shared)::

    python ../shared/data/unpack.py cifar10 /work/data
    nice -n 10 .venv/bin/python benchmarks/lr_stability.py --variants ce core --steps 300 --out runs/lr_stability

Each variant writes ``<out>/<variant>.json`` (the per-step log and the summary); a variant whose file exists is
skipped, so re-running the command resumes. ``--summary`` prints the table of every variant in ``<out>``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from coretune import objectives
from coretune.data import ImageClassificationData
from coretune.engine.optim import build_optimizer, lr_factor
from coretune.models import create_backbone
from coretune.objectives import core as core_module

WEIGHTS = "../shared/checkpoints/simclr_resnet18_in20_64px.pth.tar"


@dataclass
class Variant:
    """One controlled run: an objective and the optimisation settings that differ from the baseline."""

    objective: str = "core"
    hparams: dict[str, Any] = field(default_factory=dict)
    precision: str = "bf16"  # "bf16": autocast around backbone + objective; "bf16_backbone": the backbone only
    warmup_steps: int = 0
    clip: float = 0.0  # max total gradient norm (0: off)
    backbone_lr_factor: float = 1.0  # backbone lr = lr x this; the heads keep lr
    lr_factor: float = 1.0  # every group's lr x this (the reference run at the paper's CIFAR-10 lr 0.01)


VARIANTS: dict[str, Variant] = {
    "ce": Variant("ce"),
    "ce_mix": Variant("ce_mix"),
    "core": Variant(),
    "core_no_con": Variant(hparams={"eta": 0.0}),
    "core_no_mix": Variant(hparams={"smooth_classifier": False}),
    "core_fp32": Variant(precision="fp32"),
    "core_fp32_head": Variant(precision="bf16_backbone"),
    "core_warmup": Variant(warmup_steps=20),
    "core_clip": Variant(clip=1.0),
    "core_head_lr": Variant(backbone_lr_factor=0.1),
    "ce_clip": Variant("ce", clip=1.0),
    "core_lr001": Variant(lr_factor=0.1),
}


class TermRecorder:
    """Keeps the live (not detached) outputs of Core-tuning's loss functions of the current step."""

    def __init__(self) -> None:
        self.live: dict[str, Tensor] = {}
        self._originals = core_module.contrastive_loss, core_module.soft_cross_entropy

        def contrastive(*args: Any, **kwargs: Any) -> Tensor:
            self.live["con"] = out = self._originals[0](*args, **kwargs)
            return out

        def soft_ce(*args: Any, **kwargs: Any) -> Tensor:
            self.live["ce_mix"] = out = self._originals[1](*args, **kwargs)
            return out

        core_module.contrastive_loss, core_module.soft_cross_entropy = contrastive, soft_ce

    def close(self) -> None:
        core_module.contrastive_loss, core_module.soft_cross_entropy = self._originals


def norm(tensors: list[Tensor | None]) -> float:
    """The L2 norm of the concatenation of ``tensors`` (``None``: zero)."""
    squares = [t.float().pow(2).sum() for t in tensors if t is not None]
    return math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0


def batches(loader: Any) -> Iterator[tuple[Tensor, Tensor]]:
    """Training batches, epoch after epoch."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def run(name: str, v: Variant, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    data = ImageClassificationData(
        root=args.data, image_size=args.image_size, batch_size=args.batch_size, label_fraction=0.1,
        seed=args.seed, crop_scale=(0.35, 1.0),
    )  # fmt: skip
    data.setup()
    backbone = create_backbone("resnet18", weights=args.weights, verbose=False).to(memory_format=torch.channels_last)
    objective = objectives.create(v.objective, backbone.feature_dim, data.num_classes, **v.hparams)
    objective.attach_backbone(backbone)
    groups = {
        "backbone": list(backbone.parameters()),
        "classifier": list(objective.classifier.parameters()),
        "projector": list(objective.projector.parameters()) if hasattr(objective, "projector") else [],
    }
    heads = [p for p in objective.parameters()]
    lr = args.lr * v.lr_factor
    optimizer = build_optimizer([(groups["backbone"], lr * v.backbone_lr_factor), (heads, lr)])
    total = args.schedule_epochs * len(data.train_dataloader())
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, "linear", v.warmup_steps)
    )
    bf16 = v.precision != "fp32"
    backbone.train()
    objective.train()
    log: list[dict[str, Any]] = []
    recorder = TermRecorder()
    start = time.perf_counter()
    try:
        for step, (x, y) in zip(range(args.steps), batches(data.train_dataloader()), strict=False):
            torch.manual_seed(args.seed * 100_003 + step)
            x = x.contiguous(memory_format=torch.channels_last)
            recorder.live.clear()
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                z = backbone(x)
            if v.precision == "bf16_backbone":
                z = z.float()
            with torch.autocast("cpu", torch.bfloat16, enabled=v.precision == "bf16"):
                out = objective(z, y, inputs=x)
            row: dict[str, Any] = {
                "step": step,
                "lr": scheduler.get_last_lr()[0],
                "top1": float((out.logits.argmax(1) == y).float().mean()),
                "z_norm": float(z.detach().float().norm(dim=1).mean()),
                "w_norm": float(objective.classifier.weight.detach().norm()),
                **{k: float(t) for k, t in out.terms.items()},
            }
            if step < 5 or step % args.grad_every == 0:
                terms = {"ce": F.cross_entropy(out.logits.float(), y), **recorder.live}
                if "con" in terms:
                    terms["con"] = objective.eta * terms["con"]
                inputs = [z, *groups["backbone"], *groups["classifier"], *groups["projector"]]
                for term, value in terms.items():
                    grads = torch.autograd.grad(value, inputs, retain_graph=True, allow_unused=True)
                    n_bb, n_cls = len(groups["backbone"]), len(groups["classifier"])
                    row[f"g_{term}"] = {
                        "z": norm([grads[0]]),
                        "backbone": norm(list(grads[1 : 1 + n_bb])),
                        "classifier": norm(list(grads[1 + n_bb : 1 + n_bb + n_cls])),
                        "projector": norm(list(grads[1 + n_bb + n_cls :])),
                    }
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            row["grad"] = {g: norm([p.grad for p in ps]) for g, ps in groups.items()}
            if v.clip > 0:
                nn.utils.clip_grad_norm_([*groups["backbone"], *heads], v.clip)
            optimizer.step()
            scheduler.step()
            log.append(row)
            if not math.isfinite(row["loss"]):
                break
            if step % 25 == 0:
                print(
                    f"{name} step {step}: loss {row['loss']:.3f} top1 {row['top1']:.3f} grad {row['grad']}", flush=True
                )
    finally:
        recorder.close()
    train_seconds = time.perf_counter() - start
    backbone.eval()
    objective.eval()
    test = data.test_dataset
    every = max(1, len(test) // args.test_images)  # every k-th image: the test folder is sorted by class
    loader = DataLoader(Subset(test, range(0, len(test), every)), batch_size=256)
    correct = seen = 0
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        for x, y in loader:
            logits = objective.predict(backbone(x.contiguous(memory_format=torch.channels_last)))
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
    return {"variant": name, "settings": vars(v) | {"lr": lr}, "seconds": train_seconds,
            "test_top1": correct / seen, "test_images": seen, "log": log}  # fmt: skip


def window(log: list[dict[str, Any]], key: str, lo: int, hi: int) -> float:
    values = [r[key] for r in log[lo:hi] if key in r]
    return sum(values) / len(values) if values else float("nan")


def first_steps_median(log: list[dict[str, Any]], term: str, group: str) -> str:
    """The median gradient norm of loss ``term`` on ``group`` over the first 5 steps ("–": no such term)."""
    values = sorted(row[f"g_{term}"][group] for row in log[:5] if f"g_{term}" in row)
    return f"{values[len(values) // 2]:.3g}" if values else "–"


def summary(out: Path) -> str:
    """A Markdown table of every variant recorded in ``out``."""
    lines = [
        "| variant | train top-1 (%) steps 0-9 / 10-29 / last 20 | train CE last 20 | test top-1 (%) | "
        "max ‖∇‖ backbone (step) | max ‖∇‖ classifier (step) | "
        "median ‖∇_z‖ ce / ce_mix / η·con, steps 0-4 | median ‖∇_backbone‖ ce / ce_mix / η·con, steps 0-4 | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(out.glob("*.json")):
        r = json.loads(path.read_text())
        log = r["log"]
        n = len(log)
        top = " / ".join(f"{100 * window(log, 'top1', a, b):.1f}" for a, b in ((0, 10), (10, 30), (n - 20, n)))
        peak = max(log, key=lambda row: row["grad"]["backbone"])
        peak_cls = max(log, key=lambda row: row["grad"]["classifier"])

        gz = " / ".join(first_steps_median(log, t, "z") for t in ("ce", "ce_mix", "con"))
        gb = " / ".join(first_steps_median(log, t, "backbone") for t in ("ce", "ce_mix", "con"))
        lines.append(
            f"| {r['variant']} | {top} | {window(log, 'ce', n - 20, n):.2f} | {100 * r['test_top1']:.1f} | "
            f"{peak['grad']['backbone']:.3g} ({peak['step']}) | {peak_cls['grad']['classifier']:.3g} "
            f"({peak_cls['step']}) | {gz} | {gb} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--data", default="/work/data/cifar10")
    parser.add_argument("--weights", default=WEIGHTS)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--schedule-epochs", type=int, default=100, help="length of the linear decay, in epochs")
    parser.add_argument("--grad-every", type=int, default=20)
    parser.add_argument("--test-images", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--out", type=Path, default=Path("runs/lr_stability"))
    parser.add_argument("--summary", action="store_true", help="print the table of the recorded variants and exit")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.summary:
        args.out.mkdir(parents=True, exist_ok=True)
        for name in args.variants:
            path = args.out / f"{name}.json"
            if path.exists():
                continue
            result = run(name, VARIANTS[name], args)
            path.write_text(json.dumps(result))
            print(f"{name}: test top-1 {100 * result['test_top1']:.1f}% in {result['seconds']:.0f} s", flush=True)
    print(summary(args.out))


if __name__ == "__main__":
    main()
