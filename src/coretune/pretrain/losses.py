"""Contrastive pre-training losses: SimCLR's NT-Xent, MoCo's InfoNCE against a FIFO queue of keys, and MoCo v3's
InfoNCE against the keys of the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import batch_sizes, gather_with_grad, rank, scale_grad, world_size

__all__ = ["KeyQueue", "global_moco_v3_infonce", "global_nt_xent", "moco_infonce", "moco_v3_infonce", "nt_xent"]


def nt_xent(z1: Tensor, z2: Tensor, temperature: float = 0.5) -> Tensor:
    r"""NT-Xent (SimCLR, Chen et al. 2020, Eq. 1), averaged over all ``2N`` anchors.

    ``z1[i]`` and ``z2[i]`` are two views of image ``i``; with ``v = normalize([z1; z2])`` and ``j(i)`` the
    other view of anchor ``i``: ``ℓ_i = -log exp(v_i·v_{j(i)}/τ) / Σ_{k≠i} exp(v_i·v_k/τ)``, in float32, also
    under bf16 autocast (whose matmuls would round the logits to steps of 0.02–0.03 at τ = 0.2).
    """
    if z1.shape != z2.shape or z1.dim() != 2:
        raise ValueError(f"z1 and z2 must both be (N, d), got {tuple(z1.shape)} and {tuple(z2.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n = z1.shape[0]
    with torch.autocast(device_type=z1.device.type, enabled=False):  # bf16 autocast would round the products
        v = F.normalize(torch.cat([z1, z2]).float(), dim=1)
        logits = v @ v.T / temperature
        self_mask = torch.eye(2 * n, dtype=torch.bool, device=v.device)
        logits = logits.masked_fill(self_mask, float("-inf"))
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(v.device)
        return F.cross_entropy(logits, targets)


def global_nt_xent(z1: Tensor, z2: Tensor, temperature: float = 0.5) -> Tensor:
    """:func:`nt_xent` over the global batch of a data-parallel run: every process all-gathers both views'
    projections (its own rows keep their gradient, scaled by the number of processes ``W``) and computes the
    loss of all ``2·ΣN`` anchors, so every image has the whole global batch as negatives, as SimCLR's TPU
    implementation. After DDP averages the ``W`` processes' gradients, the parameters get the single-process
    gradient of the global batch (``docs/scaling.md``). In one process this is :func:`nt_xent`."""
    w = world_size()
    if w == 1:
        return nt_xent(z1, z2, temperature)
    sizes = batch_sizes(z1.shape[0], z1.device)
    z1 = gather_with_grad(scale_grad(z1, w), sizes)
    z2 = gather_with_grad(scale_grad(z2, w), sizes)
    return nt_xent(z1, z2, temperature)


def moco_infonce(q: Tensor, k: Tensor, queue: Tensor, temperature: float = 0.2) -> Tensor:
    """MoCo's InfoNCE (He et al. 2020, Eq. 1): key ``k[i]`` is the positive of query ``q[i]``, the queued
    keys ``queue`` (``(d, K)``, L2-normalised columns) are its negatives; ``q`` and ``k`` get normalised. In float32,
    also under bf16 autocast (whose matmuls would round the logits ``/τ`` to steps of 0.02–0.03)."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k = F.normalize(q.float(), dim=1), F.normalize(k.float(), dim=1)
        positive = (q * k).sum(dim=1, keepdim=True)
        negatives = q @ queue.float()
        logits = torch.cat([positive, negatives], dim=1) / temperature
        return F.cross_entropy(logits, torch.zeros(q.shape[0], dtype=torch.long, device=q.device))


def moco_v3_infonce(q: Tensor, k: Tensor, temperature: float = 0.2, offset: int = 0) -> Tensor:
    """MoCo v3's ``ctr(q, k)`` (Chen, Xie, He 2021, Algorithm 1): InfoNCE of query ``q[i]`` ``(N, d)`` against the
    keys ``k`` ``(M, d)`` of the batch, its positive ``k[offset + i]`` (``offset``: where this process's keys start
    in the gathered keys of a data-parallel batch, else 0), the other keys its negatives; ``q`` and ``k`` get
    normalised, and the cross-entropy of ``q·kᵀ/τ`` is multiplied by ``2τ``, as in the paper's pseudo-code and
    facebookresearch/moco-v3 (``moco/builder.py``), which makes the gradient's scale independent of ``τ``. No
    gradient flows into ``k`` (the momentum encoder's). In float32, also under bf16 autocast."""
    if q.dim() != 2 or k.dim() != 2 or q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must be (N, d) and (M, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    if not 0 <= offset <= k.shape[0] - q.shape[0]:
        raise ValueError(f"offset {offset} puts the positives of {q.shape[0]} queries outside the {k.shape[0]} keys")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k = F.normalize(q.float(), dim=1), F.normalize(k.detach().float(), dim=1)
        logits = q @ k.T / temperature
        labels = torch.arange(q.shape[0], device=q.device) + offset
        return F.cross_entropy(logits, labels) * (2 * temperature)


def global_moco_v3_infonce(q: Tensor, k: Tensor, temperature: float = 0.2) -> Tensor:
    """:func:`moco_v3_infonce` of this process's queries against the keys of every process of a data-parallel run
    (all-gathered, without gradient: moco-v3's ``concat_all_gather``), the positive of query ``i`` the key at this
    process's offset + ``i``. DDP's average of the processes' gradients is then the gradient of the loss over the
    global batch, as in facebookresearch/moco-v3. In one process this is :func:`moco_v3_infonce`."""
    if world_size() == 1:
        return moco_v3_infonce(q, k, temperature)
    sizes = batch_sizes(k.shape[0], k.device)
    return moco_v3_infonce(q, gather_with_grad(k.detach(), sizes), temperature, sum(sizes[: rank()]))


class KeyQueue(nn.Module):
    """A FIFO queue of ``size`` keys, the columns of ``queue`` ``(dim, size)``, as in facebookresearch/moco.

    :meth:`enqueue` overwrites the oldest columns (wrapping around), so any batch size works, not only
    divisors of ``size``. The buffers ``queue`` and ``queue_ptr`` are saved with the model.
    """

    queue: Tensor
    queue_ptr: Tensor

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        if dim < 1 or size < 1:
            raise ValueError(f"queue dim and size must be >= 1, got {dim} and {size}")
        self.register_buffer("queue", F.normalize(torch.randn(dim, size), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @property
    def size(self) -> int:
        return self.queue.shape[1]

    @torch.no_grad()
    def enqueue(self, keys: Tensor) -> None:
        """Replace the ``B`` oldest keys by ``keys`` ``(B, dim)`` (the newest ``size`` if ``B > size``)."""
        keys = keys.detach()[-self.size :].to(self.queue.dtype)
        ptr = int(self.queue_ptr)
        index = (ptr + torch.arange(keys.shape[0], device=self.queue.device)) % self.size
        self.queue[:, index] = keys.T
        self.queue_ptr[0] = (ptr + keys.shape[0]) % self.size
