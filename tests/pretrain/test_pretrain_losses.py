"""NT-Xent and MoCo's InfoNCE against reference loops; the MoCo key queue is FIFO."""

import math

import pytest
import torch
import torch.nn.functional as F

from coretune.losses import contrastive_loss
from coretune.pretrain import KeyQueue, moco_infonce, nt_xent


def _nt_xent_loop(z1: torch.Tensor, z2: torch.Tensor, tau: float) -> float:
    """SimCLR Eq. 1 written out: ℓ(i, j) = -log exp(s_ij/τ) / Σ_{k≠i} exp(s_ik/τ), averaged over the 2N anchors."""
    v = F.normalize(torch.cat([z1, z2]).double(), dim=1)
    n2 = v.shape[0]
    n = n2 // 2
    total = 0.0
    for i in range(n2):
        j = (i + n) % n2
        sims = [float(v[i] @ v[k]) / tau for k in range(n2)]
        denominator = sum(math.exp(sims[k]) for k in range(n2) if k != i)
        total += -math.log(math.exp(sims[j]) / denominator)
    return total / n2


@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_nt_xent_equals_reference_loop(tau: float) -> None:
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert nt_xent(z1, z2, tau).item() == pytest.approx(_nt_xent_loop(z1, z2, tau), rel=1e-5)


def test_nt_xent_is_supcon_with_the_other_view_as_only_positive() -> None:
    g = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    v = F.normalize(torch.cat([z1, z2]), dim=1)
    pair = torch.arange(8).remainder(4)
    mask = (pair[:, None] == pair[None, :]) & ~torch.eye(8, dtype=torch.bool)
    assert nt_xent(z1, z2, 0.2).item() == pytest.approx(contrastive_loss(v, mask, 0.2).item(), rel=1e-5)


def test_nt_xent_rejects_mismatched_views() -> None:
    with pytest.raises(ValueError, match=r"z1 and z2 must both be \(N, d\), got \(4, 3\) and \(5, 3\)"):
        nt_xent(torch.randn(4, 3), torch.randn(5, 3))


def test_moco_infonce_equals_reference_loop() -> None:
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    queue = F.normalize(torch.randn(4, 7, generator=g), dim=0)
    tau = 0.2
    qn, kn = F.normalize(q.double(), dim=1), F.normalize(k.double(), dim=1)
    expected = 0.0
    for i in range(3):
        pos = math.exp(float(qn[i] @ kn[i]) / tau)
        negs = sum(math.exp(float(qn[i] @ queue[:, j].double()) / tau) for j in range(7))
        expected += -math.log(pos / (pos + negs))
    assert moco_infonce(q, k, queue, tau).item() == pytest.approx(expected / 3, rel=1e-5)


def test_key_queue_is_fifo_and_wraps_around() -> None:
    queue = KeyQueue(dim=2, size=5)
    assert queue.queue.shape == (2, 5)
    assert torch.allclose(queue.queue.norm(dim=0), torch.ones(5))

    def keys(*ids: int) -> torch.Tensor:
        return torch.tensor([[float(i), -float(i)] for i in ids])

    queue.enqueue(keys(1, 2))
    queue.enqueue(keys(3, 4))
    assert queue.queue[0, :4].tolist() == [1, 2, 3, 4] and int(queue.queue_ptr) == 4
    queue.enqueue(keys(5, 6, 7))  # 5 fills the last slot, 6 and 7 replace the two oldest (1, 2)
    assert queue.queue[0].tolist() == [6, 7, 3, 4, 5]
    assert queue.queue[1].tolist() == [-6, -7, -3, -4, -5]
    assert int(queue.queue_ptr) == 2
    queue.enqueue(keys(*range(10, 17)))  # more keys than slots: the newest 5 remain
    assert sorted(queue.queue[0].tolist()) == [12, 13, 14, 15, 16]
    assert {"queue", "queue_ptr"} <= set(queue.state_dict())


def test_the_losses_stay_in_float32_under_bf16_autocast() -> None:
    # the pre-trainings run under bf16 autocast, whose CPU matmuls would round logits near 1/τ = 5 to steps of
    # 0.02–0.03 (and the gradients through them): the losses compute in float32, as the docstrings say
    g = torch.Generator().manual_seed(3)
    z1, z2 = torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g)
    queue = F.normalize(torch.randn(128, 256, generator=g), dim=0)
    for loss in (lambda a, b: nt_xent(a, b, 0.2), lambda a, b: moco_infonce(a, b, queue, 0.2)):
        plain = [z.clone().requires_grad_() for z in (z1, z2)]
        loss(*plain).backward()
        mixed = [z.clone().requires_grad_() for z in (z1, z2)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = loss(*mixed)
        value.backward()
        assert value.dtype == torch.float32
        assert value.item() == pytest.approx(loss(z1, z2).item(), rel=1e-6)
        for a, b in zip(plain, mixed, strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
