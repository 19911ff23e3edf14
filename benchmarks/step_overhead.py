"""Engine overhead: images/s of a CE-tuning step and a Core-tuning step through the Lightning engine, beside a
bare PyTorch loop doing the CE step — interleaved in one process so machine noise hits all three alike.

    .venv/bin/python benchmarks/step_overhead.py --rounds 5 --steps 20

ResNet-18, 64 px, batch 64, CPU, bf16 autocast + channels_last. Per-step time is the median gap between the
starts of consecutive training steps (data fetch, forward, backward, optimiser step and all framework overhead
included).
Targets (issue 3): Core ÷ CE time ≤ 1.10; engine ÷ bare loop ≤ 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from coretune.data import IMAGENET_MEAN, IMAGENET_STD, TaskDataDefaults
from coretune.engine import FineTuner, OptimSettings
from coretune.objectives import create


class StepTimer(L.Callback):
    """Records the start time of every training batch."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self.starts.append(time.perf_counter())


class _Data(TaskDataDefaults, L.LightningDataModule):
    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.loader, self.num_classes, self.class_names = loader, 10, [str(i) for i in range(10)]
        self.image_size, self.batch_size = loader.dataset.tensors[0].shape[-1], loader.batch_size
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD

    def train_dataloader(self) -> DataLoader:
        return self.loader


def median_step(starts: list[float], warmup: int) -> float:
    gaps = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1 :], strict=False)]
    return statistics.median(gaps)


def engine_step(objective: str, loader: DataLoader, steps: int, warmup: int) -> float:
    model = FineTuner(create(objective), backbone="resnet18", optim=OptimSettings(lr=0.01))
    timer = StepTimer()
    trainer = L.Trainer(
        max_steps=steps + warmup + 1,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(model, datamodule=_Data(loader))
    return median_step(timer.starts, warmup)


def bare_step(loader: DataLoader, steps: int, warmup: int) -> float:
    from coretune.models import create_backbone

    backbone = create_backbone("resnet18", verbose=False).to(memory_format=torch.channels_last)
    head = torch.nn.Linear(backbone.feature_dim, 10)
    params = [*backbone.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    starts: list[float] = []
    it = iter(loader)
    for _ in range(steps + warmup + 1):
        starts.append(time.perf_counter())
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(head(backbone(x)).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return median_step(starts, warmup)


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    n = args.batch_size * 8
    data = TensorDataset(torch.randn(n, 3, args.image_size, args.image_size), torch.randint(0, 10, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    times: dict[str, list[float]] = {"bare loop (CE)": [], "engine CE": [], "engine Core": []}
    for r in range(args.rounds):
        times["bare loop (CE)"].append(bare_step(loader, args.steps, args.warmup))
        times["engine CE"].append(engine_step("ce", loader, args.steps, args.warmup))
        times["engine Core"].append(engine_step("core", loader, args.steps, args.warmup))
        report = ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items())
        print(f"round {r + 1}/{args.rounds}: {report}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, ResNet-18 {args.image_size} px, "
        f"batch {args.batch_size}, bf16 + channels_last, "
        f"median of {args.rounds} rounds x {args.steps} steps\n"
    )
    print("| step | ms / step | images / s |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.1f} | {args.batch_size / v:.0f} |")
    print(f"\nCore ÷ CE (engine): {med['engine Core'] / med['engine CE']:.3f}  (target ≤ 1.10)")
    print(f"engine ÷ bare loop (CE): {med['engine CE'] / med['bare loop (CE)']:.3f}  (target ≤ 1.05)")


if __name__ == "__main__":
    main()
