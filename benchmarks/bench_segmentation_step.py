"""Segmentation training step: Core-tuning ÷ CE-tuning step time, side by side, with the CPU config's model and
batch (``configs/cpu/camvid.yaml``).

    .venv/bin/python benchmarks/bench_segmentation_step.py --pairs 15

Side by side: one CE step, then one Core step, ``--pairs`` times in one process (after warm-up steps of each), so
a change in the machine's load hits both alike; the figure is the median over pairs of (Core step ÷ CE step),
beside the median step times. On a loaded machine the pairs scatter widely, so the work Core-tuning adds is also
timed alone, right after each pair: the regulariser's forward and backward from the pooled feature map (image
labels, hard positives, projection head, focal contrastive loss), as a fraction of that pair's CE step.

The step is the engine's (``coretune.tasks.SegmentationTask``): the dilated ResNet's last feature map, the DeepLab-V3
head's pixel logits upsampled to the crop, pixel-wise CE, and for Core-tuning η × the focal contrastive term on the
pooled feature map through its projection head (one generated hard positive per crop, majority image labels),
then backward and an SGD (Nesterov) step; random images and masks of 11 classes with ignored pixels, precision
as ``coretune fit`` picks it on this machine (bf16 autocast where the CPU has it) and channels_last. Each step
is timed around the whole step (forward, backward, optimiser). Target (issue 36): ≤ 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from coretune.engine import FineTuner, default_precision
from coretune.objectives import create
from coretune.tasks import Batch
from coretune.tasks.segmentation import dense_contrastive_loss, image_labels


def build(
    objective: str, backbone: str, output_stride: int, num_classes: int
) -> tuple[FineTuner, Callable[[torch.Tensor, torch.Tensor], None]]:
    """A FineTuner for segmentation and a function running one training step on a batch."""
    model = FineTuner(
        create(objective), backbone=backbone, task="segmentation", task_settings={"output_stride": output_stride}
    )
    model.build(num_classes)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    bf16 = default_precision() == "bf16-mixed"

    def step(x: torch.Tensor, masks: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            features = model.task.features(model.backbone, x)
            loss = model.task.loss(model.objective, features, Batch(x, masks), x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return model, step


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=15, help="timed (CE step, Core step) pairs")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--output-stride", type=int, default=8)
    parser.add_argument("--num-classes", type=int, default=11)
    args = parser.parse_args()
    torch.manual_seed(0)
    size = (args.batch_size, 3, args.image_size, args.image_size)
    x = torch.randn(size).contiguous(memory_format=torch.channels_last)
    masks = torch.randint(0, args.num_classes, (args.batch_size, args.image_size, args.image_size))
    masks[:, :4] = 255  # a band of ignored (void) pixels
    _, ce = build("ce", args.backbone, args.output_stride, args.num_classes)
    model, core = build("core", args.backbone, args.output_stride, args.num_classes)
    with torch.no_grad():
        pooled = model.task.features(model.backbone, x).mean((2, 3)).float()

    def regulariser() -> None:
        """The work Core-tuning adds to a step: its term's forward and backward from the pooled features."""
        leaf = pooled.clone().requires_grad_()
        labels = image_labels(masks, args.num_classes)
        dense_contrastive_loss(model.objective, leaf, labels).backward()

    for _ in range(args.warmup):
        ce(x, masks)
        core(x, masks)
        regulariser()
    pairs, added = [], []
    for _ in range(args.pairs):
        pairs.append((timed(lambda: ce(x, masks)), timed(lambda: core(x, masks))))
        added.append(timed(regulariser) / pairs[-1][0])
    ratio = statistics.median(b / a for a, b in pairs)
    ce_ms, core_ms = (1e3 * statistics.median(t[i] for t in pairs) for i in (0, 1))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, DeepLab-V3 {args.backbone} output stride "
        f"{args.output_stride}, {args.image_size} px crops, batch {args.batch_size}, {args.num_classes} classes, "
        f"{default_precision()} + channels_last, {args.pairs} alternating pairs after {args.warmup} warm-up steps\n"
    )
    print("| objective | median ms / step |")
    print("|---|---:|")
    print(f"| CE-tuning (pixel CE) | {ce_ms:.0f} |")
    print(f"| Core-tuning (pixel CE + η · focal contrastive, hard positives) | {core_ms:.0f} |")
    low, _, high = statistics.quantiles([b / a for a, b in pairs], n=4)
    print(f"\nCore ÷ CE, median over pairs: {ratio:.3f} (quartiles {low:.3f}–{high:.3f}; target ≤ 1.10)")
    print(f"the regulariser alone ÷ the pair's CE step, median: {statistics.median(added):.4f}")


if __name__ == "__main__":
    main()
