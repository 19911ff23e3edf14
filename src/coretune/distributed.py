"""Collectives for contrastive losses over the global batch of a data-parallel run (DDP, multi-node).

Every function degrades to the identity in a single process (``torch.distributed`` not initialised), so the
objectives call them unconditionally. See ``docs/scaling.md`` for the gradient bookkeeping under DDP.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "batch_sizes",
    "gather_batch",
    "gather_rows",
    "gather_with_grad",
    "is_distributed",
    "is_launching_process",
    "listed",
    "outlive_rank_zero",
    "rank",
    "ranks_where",
    "scale_grad",
    "world_size",
]


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes of the run (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def is_launching_process() -> bool:
    """Whether this is the process a user (or a sweep) started, not one a launcher added: global rank 0 by the
    environment of Lightning's DDP launcher, torchrun and SLURM, readable before any process group exists."""
    ranks = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")
    return all(os.environ.get(name, "0") == "0" for name in ranks)


def ranks_where(flag: bool, device: torch.device | str = "cpu") -> list[int]:
    """The ranks whose ``flag`` is true, in rank order (one small all-gather), so that every process can act on a
    condition met on one of them: a NaN loss on one process makes all of them stop, and rank 0 records it."""
    if world_size() == 1:
        return [0] if flag else []
    mine = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    flags = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(flags, mine)
    return [r for r, f in enumerate(torch.cat(flags).tolist()) if f]  # one device-to-host copy


def listed(ranks: list[int]) -> str:
    """``[1]`` → ``"1"``, ``[1, 3]`` → ``"1, 3"``: the processes a message names (:func:`ranks_where`)."""
    return ", ".join(map(str, ranks))


def outlive_rank_zero(timeout: float = 30.0) -> None:
    """In a data-parallel process other than rank 0, wait (at most ``timeout`` seconds) for the process that
    launched it to end before ending too. Lightning's DDP launcher runs rank 0 in the launching process and kills it
    as soon as it sees another process exit with an error, which could cut rank 0's last words (its error message)
    short after an error every process raises together."""
    if not is_distributed() or rank() == 0:
        return
    parent, deadline = os.getppid(), time.monotonic() + timeout
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.1)


def batch_sizes(n: int, device: torch.device | str = "cpu") -> list[int]:
    """The local batch size ``n`` of every rank, in rank order (one small all-gather)."""
    if world_size() == 1:
        return [n]
    mine = torch.tensor([n], dtype=torch.long, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(sizes, mine)
    return [int(s) for s in sizes]


def _gather_parts(x: Tensor, sizes: list[int]) -> list[Tensor]:
    """Every rank's ``x`` (rows may differ in number: padded to the largest, then trimmed), without gradient."""
    largest = max(sizes)
    padded = x.detach()
    if padded.shape[0] < largest:
        padded = torch.cat([padded, padded.new_zeros(largest - padded.shape[0], *padded.shape[1:])])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return [part[:size] for part, size in zip(parts, sizes, strict=True)]


def gather_rows(x: Tensor, sizes: list[int] | None = None) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0, in rank order, without gradient (labels, keys).

    ``sizes`` (from :func:`batch_sizes`) saves the size exchange when the caller already has it.
    """
    if world_size() == 1:
        return x
    return torch.cat(_gather_parts(x, sizes or batch_sizes(x.shape[0], x.device)))


def gather_with_grad(x: Tensor, sizes: list[int] | None = None) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0, in rank order; this rank's slot is ``x`` itself.

    The other ranks' rows are constants, so back-propagating a loss ``L`` of the concatenation gives ``x``
    exactly ``∂L/∂x`` of its own rows — no sum over ranks. When every rank computes the same ``L`` on the same
    global batch, each rank thus holds the single-process gradient of its own rows.
    """
    if world_size() == 1:
        return x
    parts = _gather_parts(x, sizes or batch_sizes(x.shape[0], x.device))
    parts[rank()] = x
    return torch.cat(parts)


def gather_batch(features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, slice]:
    """The global batch ``(features with grad, labels, rows of this rank in it)``; one size exchange."""
    if world_size() == 1:
        return features, labels, slice(0, features.shape[0])
    sizes = batch_sizes(features.shape[0], features.device)
    start = sum(sizes[: rank()])
    rows = slice(start, start + features.shape[0])
    return gather_with_grad(features, sizes), gather_rows(labels, sizes), rows


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """Identity in the forward pass; multiplies the gradient by ``factor`` in the backward pass.

    Under DDP's gradient averaging over ``W`` ranks, a backbone whose rank-``r`` gradient holds only the
    contribution of rank ``r``'s rows ends with ``1/W`` of the single-process gradient; ``scale_grad(z, W)``
    on the features restores it.
    """
    return _ScaleGrad.apply(x, factor)
