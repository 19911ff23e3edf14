"""Per-step cost of the non-finite loss decision that every process of a DDP fit takes together
(``coretune.distributed.ranks_where``: an all-gather of one int32), beside a bare one-element all-reduce, on 2 gloo
CPU processes (issue 60, principle 9). Usage: ``python benchmarks/ddp_divergence_check.py [STEPS]`` (default 5000)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _per_step(step: object, n: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        step()  # type: ignore[operator]
    return (time.perf_counter() - start) / n


def worker(rank: int, world: int, n: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from coretune.distributed import ranks_where

    loss, flag = torch.tensor(1.0), torch.zeros(1, dtype=torch.int32)
    _per_step(lambda: ranks_where(not bool(torch.isfinite(loss))), 200)  # warm-up
    gather = _per_step(lambda: ranks_where(not bool(torch.isfinite(loss))), n)
    reduce = _per_step(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX), n)
    if rank == 0:
        print(f"ranks_where (all_gather of 1 int32): {gather * 1e6:.0f} us/step; "
              f"all_reduce MAX of 1 int32: {reduce * 1e6:.0f} us/step ({n} steps, {world} gloo processes)")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, int(sys.argv[1]) if len(sys.argv) > 1 else 5000), nprocs=2)
