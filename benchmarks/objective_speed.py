"""How much does Core-tuning's objective add to a training step? (issue 2)

For each batch size ``B`` (d = 2048 features and K = 100 classes, as a ResNet-50 encoder on a 100-class task),
the median wall time of:

(a) ``mine_hard_pairs`` on ``(B, d)`` + ``contrastive_loss`` (focal) on normalised ``(3B, proj_dim)`` rows,
    forward + backward (the projection head excluded; both inputs require grad);
(b) the projection head ``G_c`` forward + backward on ``(3B, d)``;
(c) the full ``core`` objective forward + backward (mining, classifier, projection head, both losses);
(d) a backbone forward + backward: torchvision ResNet-18 at ``--image-size`` px, bf16 autocast, channels_last.

ResNet-50 at 224 px is what the paper fine-tunes but is unaffordable on a 2-core CPU; ResNet-18 at 64 px is a
much *cheaper* step, so the ratios below overstate the objective's share. Batches above
``--backbone-max-batch`` skip the backbone: its time is extrapolated linearly from the largest measured batch.

Run: ``python benchmarks/objective_speed.py --batch-sizes 64 256 1024 --repeats 7``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torchvision

import coretune as ct
from coretune import objectives
from coretune.heads import ProjectionHead

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_time(step: Callable[[], None], repeats: int, warmup: int, clock: str = "wall") -> float:
    """Median seconds of ``step()`` over ``repeats`` runs after ``warmup`` untimed ones."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = now()
        step()
        times.append(now() - start)
    return statistics.median(times)


def mining_and_loss(b: int, d: int, k: int, proj_dim: int) -> tuple[Callable[[], None], ...]:
    """Steps for (a) and its halves: mining fwd+bwd on (B, d) and the focal loss fwd+bwd on (3B, proj_dim)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(b, d, generator=g).requires_grad_(True)
    y = torch.randint(0, k, (b,), generator=g)
    v = F.normalize(torch.randn(3 * b, proj_dim, generator=g), dim=1).requires_grad_(True)
    pair_gen = torch.Generator().manual_seed(1)

    def mine() -> None:
        pairs = ct.mine_hard_pairs(z, y, k, generator=pair_gen)
        torch.autograd.backward(
            [pairs.pos_features, pairs.neg_features],
            [torch.ones_like(pairs.pos_features), torch.ones_like(pairs.neg_features)],
        )
        z.grad = None

    def loss() -> None:
        ct.contrastive_loss(v, ct.core_positive_mask(y), 0.07, focal=True).backward()
        v.grad = None

    def both() -> None:
        mine()
        loss()

    return both, mine, loss


def projection(b: int, d: int, proj_dim: int) -> Callable[[], None]:
    head = ProjectionHead(d, proj_dim, 2)
    x = torch.randn(3 * b, d).requires_grad_(True)

    def step() -> None:
        head(x).sum().backward()
        head.zero_grad(set_to_none=True)
        x.grad = None

    return step


def full_objective(b: int, d: int, k: int) -> Callable[[], None]:
    obj = objectives.create("core", d, k)
    obj.generator = torch.Generator().manual_seed(0)
    z = torch.randn(b, d).requires_grad_(True)
    y = torch.randint(0, k, (b,))

    def step() -> None:
        obj(z, y).loss.backward()
        obj.zero_grad(set_to_none=True)
        z.grad = None

    return step


def backbone(b: int, image_size: int) -> Callable[[], None]:
    model = torchvision.models.resnet18(weights=None).to(memory_format=torch.channels_last)
    model.fc = torch.nn.Identity()
    x = torch.randn(b, 3, image_size, image_size).to(memory_format=torch.channels_last)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            feats = model(x)
        feats.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time (with --threads 1: robust to other jobs on the machine)",
    )
    parser.add_argument("--dim", type=int, default=2048, help="feature width d (ResNet-50: 2048)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--proj-dim", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=64, help="backbone input size in px")
    parser.add_argument("--backbone-repeats", type=int, default=3, help="timed backbone steps (after one warm-up step)")
    parser.add_argument(
        "--backbone-max-batch",
        type=int,
        default=256,
        help="larger batches extrapolate the backbone time linearly from the largest measured one",
    )
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print(f"d={args.dim}, K={args.classes}, proj_dim={args.proj_dim}, {args.clock} clock\n")
    rows = []
    measured: dict[int, float] = {}
    for b in sorted(args.batch_sizes):
        both, mine, loss = mining_and_loss(b, args.dim, args.classes, args.proj_dim)
        t_a = median_time(both, args.repeats, args.warmup, args.clock)
        t_mine = median_time(mine, args.repeats, args.warmup, args.clock)
        t_loss = median_time(loss, args.repeats, args.warmup, args.clock)
        t_b = median_time(projection(b, args.dim, args.proj_dim), args.repeats, args.warmup, args.clock)
        t_c = median_time(full_objective(b, args.dim, args.classes), args.repeats, args.warmup, args.clock)
        if b <= args.backbone_max_batch:
            t_d = median_time(backbone(b, args.image_size), args.backbone_repeats, 1, args.clock)
            measured[b] = t_d
            how = "measured"
        else:
            ref = max(measured) if measured else None
            if ref is None:
                raise SystemExit("--backbone-max-batch is below every batch size: nothing to extrapolate")
            t_d = measured[ref] * b / ref
            how = f"extrapolated from B={ref}"
        rows.append((b, t_a, t_mine, t_loss, t_b, t_c, t_d, how))
        print(f"B={b}: done", flush=True)

    ms = lambda t: f"{1e3 * t:.1f}"  # noqa: E731
    print(
        "\n| B | (a) mining + loss | of which mining | of which loss | (b) projection head | (c) full `core` "
        "| (d) ResNet-18 step | (a) ÷ (d) | (c) ÷ (d) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, t_a, t_mine, t_loss, t_b, t_c, t_d, how in rows:
        star = "" if how == "measured" else " *"
        print(
            f"| {b} | {ms(t_a)} | {ms(t_mine)} | {ms(t_loss)} | {ms(t_b)} | {ms(t_c)} | {ms(t_d)}{star} "
            f"| {100 * t_a / t_d:.2f}% | {100 * t_c / t_d:.2f}% |"
        )
    print(f"\n{args.clock.capitalize()} times in ms (median of {args.repeats}; backbone: of {args.backbone_repeats}).")
    for b, *_, how in rows:
        if how != "measured":
            print(f"* B={b}: backbone time {how} (linear in B).")


if __name__ == "__main__":
    main()
