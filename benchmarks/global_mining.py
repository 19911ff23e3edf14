"""What does global hard-pair mining cost as the global batch grows? (issue 7, docs/scaling.md)

Under DDP with ``gather=True`` every process mines and contrasts the whole global batch ``B = W · b``, so the
objective's cost per process grows with ``B²`` instead of ``b²``. For each ``B`` (d = 2048 features as a
ResNet-50 encoder, K = 100 classes, projection width 256), the median wall time of, forward + backward:

- mining: ``mine_hard_pairs`` on ``(B, d)`` (cosine similarities ``B × B × d``, hardest pairs, mixup);
- loss: the focal contrastive loss ``contrastive_loss`` on ``(3B, 256)`` normalised rows (``[z; z⁺; z⁻]``);

and the process's peak resident memory after that size (sizes run in increasing order, so it is that size's
peak: the ``(3B)²`` logits and their intermediates dominate).

Run: ``python benchmarks/global_mining.py --batch-sizes 512 1024 2048 4096 8192 --repeats 3``
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from coretune import contrastive_loss, core_positive_mask, mine_hard_pairs


def median_time(step: Callable[[], None], repeats: int, warmup: int) -> float:
    """Median seconds of ``step()`` over ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def steps(b: int, d: int, k: int, proj_dim: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """Mining forward + backward on ``(B, d)``, and the focal loss forward + backward on ``(3B, proj_dim)``."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(b, d, generator=g).requires_grad_(True)
    y = torch.randint(0, k, (b,), generator=g)
    v = F.normalize(torch.randn(3 * b, proj_dim, generator=g), dim=1).requires_grad_(True)
    pair_gen = torch.Generator().manual_seed(1)

    def mine() -> None:
        pairs = mine_hard_pairs(z, y, k, generator=pair_gen)
        torch.autograd.backward(
            [pairs.pos_features, pairs.neg_features],
            [torch.ones_like(pairs.pos_features), torch.ones_like(pairs.neg_features)],
        )
        z.grad = None

    def loss() -> None:
        contrastive_loss(v, core_positive_mask(y), 0.07, focal=True).backward()
        v.grad = None

    return mine, loss


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dim", type=int, default=2048, help="feature width d (ResNet-50: 2048)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--proj-dim", type=int, default=256)
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print(f"d={args.dim}, K={args.classes}, proj_dim={args.proj_dim}, repeats={args.repeats}\n")
    rows = []
    for b in sorted(args.batch_sizes):
        mine, loss = steps(b, args.dim, args.classes, args.proj_dim)
        t_mine = median_time(mine, args.repeats, args.warmup)
        t_loss = median_time(loss, args.repeats, args.warmup)
        rows.append((b, t_mine, t_loss, peak_rss_gb()))
        print(f"B={b}: done", flush=True)

    base_b, base_mine, base_loss, _ = rows[0]
    print(
        "\n| B_global | mining (ms) | loss (ms) | mining + loss (ms) | ÷ smallest B | (B / smallest B)² "
        "| peak RSS (GB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b, t_mine, t_loss, rss in rows:
        ratio = (t_mine + t_loss) / (base_mine + base_loss)
        print(
            f"| {b} | {1e3 * t_mine:.0f} | {1e3 * t_loss:.0f} | {1e3 * (t_mine + t_loss):.0f} | {ratio:.1f}× "
            f"| {(b / base_b) ** 2:.0f}× | {rss:.2f} |"
        )
    print(f"\nForward + backward, median of {args.repeats} after {args.warmup} warm-up run(s).")


if __name__ == "__main__":
    main()
