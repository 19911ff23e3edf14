"""What does Core-tuning's cross-batch memory cost per step? (issue 40)

For each feature width ``d`` and batch size ``B`` with a full memory of ``N`` rows (K classes, projection width
256), the median time of, side by side in one process:

(a) mining: ``mine_hard_pairs`` of the ``B`` anchors over the pool ``[batch; memory]`` (``B × (B + N)``
    similarities), forward + backward; (a0) the same without memory;
(b) loss: the focal ``contrastive_loss`` of the ``B`` anchors over ``[z; z⁺; z⁻; memory keys]``
    (``B × (3B + N)`` logits), forward + backward; (b0) without the memory keys;
(c) keys: the projection head ``G_c`` (d → d → 256) on the ``N`` memory rows, without gradient (the memory's
    rows pass through the current head every step), float32 and (c16) under bf16 autocast, as in a training step
    of the engine's ``bf16-mixed`` precision;
(e) the whole ``core`` objective, forward + backward, with the memory and (e0) without;
(d) a ResNet-18 training step (forward + backward) at ``--image-size`` px, bf16 autocast, channels_last.

Target (issue 40): (a) + (b) at most 5 % of (d).

Run: ``python benchmarks/memory_speed.py --dims 512 2048 --batch-sizes 32 64 --memory 4096``
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F

import coretune as ct
from coretune import objectives
from coretune.heads import ProjectionHead
from coretune.memory import CrossBatchMemory
from objective_speed import CLOCKS, backbone, median_time  # the same backbone step, timed the same way


def steps(b: int, d: int, n: int, k: int, proj_dim: int) -> dict[str, Callable[[], None]]:
    """The timed steps (a0, a, b0, b, c, e0, e) for batch ``b``, width ``d`` and a full memory of ``n`` rows."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(b, d, generator=g).requires_grad_(True)
    y = torch.randint(0, k, (b,), generator=g)
    memory, memory_labels = torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)
    v = F.normalize(torch.randn(3 * b, proj_dim, generator=g), dim=1).requires_grad_(True)
    keys = F.normalize(torch.randn(n, proj_dim, generator=g), dim=1)
    pair_gen = torch.Generator().manual_seed(1)
    mask = ct.core_positive_mask(y)
    mask_memory = torch.cat([mask, y[:, None] == memory_labels[None, :]], dim=1)
    head = ProjectionHead(d, proj_dim, 2)

    def mine(with_memory: bool) -> Callable[[], None]:
        def step() -> None:
            extra = (memory, memory_labels) if with_memory else (None, None)
            pairs = ct.mine_hard_pairs(z, y, k, generator=pair_gen, memory=extra[0], memory_labels=extra[1])
            torch.autograd.backward(
                [pairs.pos_features, pairs.neg_features],
                [torch.ones_like(pairs.pos_features), torch.ones_like(pairs.neg_features)],
            )
            z.grad = None

        return step

    def loss(with_memory: bool) -> Callable[[], None]:
        def step() -> None:
            extra = {"keys": keys} if with_memory else {}
            ct.contrastive_loss(v, mask_memory if with_memory else mask, 0.07, focal=True, **extra).backward()
            v.grad = None

        return step

    def project_keys(bf16: bool) -> Callable[[], None]:
        def step() -> None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                F.normalize(head(memory).float(), dim=1)

        return step

    def objective(memory_size: int) -> Callable[[], None]:
        memory_settings = CrossBatchMemory(memory_size, warmup_steps=0) if memory_size else None
        obj = objectives.create("core", d, k, memory=memory_settings)
        obj.generator = torch.Generator().manual_seed(2)
        if memory_size:
            obj.memory.push(memory, memory_labels)

        def step() -> None:
            obj(z, y).loss.backward()
            obj.zero_grad(set_to_none=True)
            z.grad = None

        return step

    return {
        "a0": mine(False),
        "a": mine(True),
        "b0": loss(False),
        "b": loss(True),
        "c": project_keys(False),
        "c16": project_keys(True),
        "e0": objective(0),
        "e": objective(n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[512, 2048], help="feature widths d")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--memory", type=int, default=4096, help="memory rows N (full)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--proj-dim", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=64, help="ResNet-18 input size in px")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="wall time or this process's CPU time")
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print(f"N={args.memory}, K={args.classes}, proj_dim={args.proj_dim}, {args.clock} clock\n")
    step_ms = {
        b: 1e3 * median_time(backbone(b, args.image_size), args.repeats, args.warmup, args.clock)
        for b in args.batch_sizes
    }
    header = (
        "| d | B | (a0) mining, no memory | (a) mining with memory | (b0) loss, no memory | (b) loss with memory "
        "| (c) memory keys through G_c | (c16) same, bf16 | (e0) `core`, no memory | (e) `core` with memory "
        "| (d) ResNet-18 step "
        "| (a)+(b) ÷ (d) | (e)−(e0) ÷ (d) |"
    )
    rows = []
    for d in args.dims:
        for b in args.batch_sizes:
            t = {
                name: 1e3 * median_time(step, args.repeats, args.warmup, args.clock)
                for name, step in steps(b, d, args.memory, args.classes, args.proj_dim).items()
            }
            step = step_ms[b]
            rows.append(
                f"| {d} | {b} | {t['a0']:.1f} | {t['a']:.1f} | {t['b0']:.1f} | {t['b']:.1f} "
                f"| {t['c']:.1f} | {t['c16']:.1f} "
                f"| {t['e0']:.1f} | {t['e']:.1f} | {step:.1f} | {100 * (t['a'] + t['b']) / step:.1f} % "
                f"| {100 * (t['e'] - t['e0']) / step:.1f} % |"
            )
            print(f"d={d} B={b}: done", flush=True)
    print(f"\n{header}\n|{'---:|' * 13}")
    print("\n".join(rows))
    print(f"\n{args.clock.capitalize()} times in ms, median of {args.repeats} after {args.warmup} warm-up run(s).")


if __name__ == "__main__":
    main()
