"""``--model.compile``: training images/s of the backbone eager and compiled (``torch.compile``, inductor), side by
side, on CPU, for ``small_cnn`` and ``resnet18`` at 64 px (issue 62).

    .venv/bin/python benchmarks/compile_speed.py --pairs 10

For each backbone two FineTuners with the same initial weights, one compiled as ``coretune fit --model.compile true``
compiles it (:func:`coretune.engine.speed.compile_in_place`, in place, the backbone only); a training step is the
engine's (the classification task's features, CE-tuning's loss, backward, an SGD step with Nesterov momentum) on
random images, with channels_last as ``auto`` sets it (on: both are CNNs) and the precision ``coretune fit`` picks
on this machine (bf16 autocast where the CPU has it; ``--precision 32`` for float32). The compiled model's first
steps compile (training graph, forward and backward: the "compile s" column, wall-clock seconds of the warm-up
steps, whose compilation the inductor cache shortens on a second run); then
``--pairs`` alternating (eager step, compiled step) pairs, so a change in the machine's load hits both alike. The
figures are the median step time of each as images/s, and the median over pairs of eager ÷ compiled step time.
On a machine shared with other jobs, ``--threads 1 --clock cpu`` times the CPU seconds of the step (the work done,
not the time spent waiting for a core), as ``objective_speed.py`` does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from coretune.engine import FineTuner, default_precision
from coretune.engine.speed import compile_in_place
from coretune.objectives import create
from coretune.tasks import Batch


def build(backbone: str, compiled: bool, bf16: bool, classes: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step of a seeded FineTuner (``backbone``, CE-tuning), compiled or not."""
    torch.manual_seed(0)
    model = FineTuner(create("ce"), backbone=backbone)
    model.build(classes)
    model.train()
    if compiled:
        guard = compile_in_place(model.backbone)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x = model._images(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            features = model.task.features(model.backbone, x)
            loss = model.task.loss(model.objective, features, Batch(x, y), x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if compiled and guard.status != "compiled":
            raise SystemExit(f"compilation failed: {guard.status}")

    return step


CLOCK = time.perf_counter


def timed(step: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor, y: torch.Tensor) -> float:
    start = CLOCK()
    step(x, y)
    return CLOCK() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10, help="timed (eager step, compiled step) pairs")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (the compiled: compiling)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--backbones", nargs="+", default=["small_cnn", "resnet18"])
    parser.add_argument("--precision", choices=["auto", "32"], default="auto", help="auto: as coretune fit picks")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: the process's CPU seconds")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    bf16 = args.precision == "auto" and default_precision() == "bf16-mixed"
    classes = 10
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(0))
    y = torch.arange(args.batch_size) % classes
    rows = []
    for backbone in args.backbones:
        eager, compiled = build(backbone, False, bf16, classes), build(backbone, True, bf16, classes)
        start = time.perf_counter()  # wall clock: inductor compiles in worker processes too
        for _ in range(args.warmup):
            compiled(x, y)
        compile_s = time.perf_counter() - start
        for _ in range(args.warmup):
            eager(x, y)
        pairs = [(timed(eager, x, y), timed(compiled, x, y)) for _ in range(args.pairs)]
        eager_s, compiled_s = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        speedup = statistics.median(a / b for a, b in pairs)
        rows.append((backbone, args.batch_size / eager_s, args.batch_size / compiled_s, speedup, compile_s))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, CPU, {args.image_size} px, "
        f"batch {args.batch_size}, {'bf16 autocast' if bf16 else 'float32'} + channels_last, CE-tuning training step, "
        f"{args.pairs} alternating pairs after {args.warmup} warm-up steps\n"
    )
    unit = "images per CPU s" if args.clock == "cpu" else "images/s"
    print(f"| backbone | eager {unit} | compiled {unit} | eager ÷ compiled step time (median) | compile s |")
    print("|---|---:|---:|---:|---:|")
    for backbone, eager_ips, compiled_ips, speedup, compile_s in rows:
        print(f"| {backbone} | {eager_ips:.0f} | {compiled_ips:.0f} | {speedup:.2f} | {compile_s:.0f} |")


if __name__ == "__main__":
    main()
