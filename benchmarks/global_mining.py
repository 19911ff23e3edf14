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

import torch

from objective_speed import median_time, mining_and_loss  # the same steps, timed the same way


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
        _, mine, loss = mining_and_loss(b, args.dim, args.classes, args.proj_dim)
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
