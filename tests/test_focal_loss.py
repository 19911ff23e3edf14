"""coretune.FocalContrastiveLoss, the nn.Module of L^f_con, against a slow loop written from the paper (§4.1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import coretune as ct
from coretune.losses import FocalContrastiveLoss


def paper_focal_contrastive_loss(embeddings: torch.Tensor, labels: list[int], tau: float, focal: bool) -> torch.Tensor:
    """L^f_con read off the paper, one anchor and one pair at a time, in float64:

        v_i = z_i / ||z_i||,  p_ij = exp(v_i^T v_j / τ) / Σ_{k ∈ A_i} exp(v_i^T v_k / τ)
        L = -(1/n) Σ_i (1/|P_i|) Σ_{j ∈ P_i} (1 - p_ij) log p_ij

    with A_i every sample but i, P_i those of i's class, and n the anchors with a positive (an anchor without one
    has no term; none at all: 0). ``focal=False``: Eq. 1, no (1 - p_ij)."""
    v = [row / row.norm() for row in embeddings.double()]
    n = len(labels)
    terms = []
    for i in range(n):
        a_i = [k for k in range(n) if k != i]
        p_i = [j for j in a_i if labels[j] == labels[i]]
        if not p_i:
            continue
        denominator = sum(torch.exp(v[i] @ v[k] / tau) for k in a_i)
        total = 0.0
        for j in p_i:
            p_ij = torch.exp(v[i] @ v[j] / tau) / denominator
            weight = 1 - p_ij if focal else 1.0
            total = total + weight * torch.log(p_ij)
        terms.append(-total / len(p_i))
    return torch.stack(terms).mean() if terms else embeddings.double().sum() * 0


def _embeddings(n: int, d: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).mul(2).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    labels=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    d=st.integers(1, 6),
    tau=st.sampled_from([0.05, 0.07, 0.5, 1.0]),
    focal=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(labels=[0, 0, 1, 2, 2, 2], d=3, tau=0.07, focal=True, seed=0)  # class 1 has one sample
@example(labels=[1, 1, 1, 1], d=2, tau=0.07, focal=True, seed=1)  # all one class
@example(labels=[0, 1, 2], d=4, tau=0.07, focal=False, seed=2)  # no positive at all
@example(labels=[0], d=1, tau=0.07, focal=True, seed=3)  # one sample
def test_the_module_matches_the_papers_equation(labels: list[int], d: int, tau: float, focal: bool, seed: int) -> None:
    z1 = _embeddings(len(labels), d, seed).requires_grad_(True)
    z2 = z1.detach().clone().requires_grad_(True)
    got = FocalContrastiveLoss(temperature=tau, focal=focal)(z1, torch.tensor(labels))
    want = paper_focal_contrastive_loss(z2, labels, tau, focal)
    assert got.dtype == torch.float64 and got.dim() == 0
    torch.testing.assert_close(got, want)
    (g1,) = torch.autograd.grad(got, z1)
    (g2,) = torch.autograd.grad(want, z2, allow_unused=True)
    torch.testing.assert_close(g1, torch.zeros_like(z2) if g2 is None else g2)
    assert torch.isfinite(g1).all()


def test_a_class_with_one_sample_is_no_anchor_but_a_negative() -> None:
    z = _embeddings(5, 3, 7)
    labels = torch.tensor([0, 0, 1, 1, 2])  # sample 4 is alone in class 2
    loss = FocalContrastiveLoss()(z, labels)
    assert loss.item() == pytest.approx(paper_focal_contrastive_loss(z, labels.tolist(), 0.07, True).item())
    # as a negative it is in the other anchors' denominators: moving it changes the loss
    moved = z.clone()
    moved[4] = -moved[4]
    assert FocalContrastiveLoss()(moved, labels).item() != pytest.approx(loss.item())


def test_no_positive_gives_zero_in_the_graph() -> None:
    z = _embeddings(4, 3, 8).requires_grad_(True)
    loss = FocalContrastiveLoss()(z, torch.arange(4))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))


def test_focal_weighting_lowers_the_loss_of_the_same_pairs() -> None:
    z, labels = _embeddings(8, 4, 9), torch.arange(8) % 2
    focal = FocalContrastiveLoss(focal=True)(z, labels)
    supcon = FocalContrastiveLoss(focal=False)(z, labels)
    assert 0 < focal.item() < supcon.item()  # every weight 1 - p_ij is in (0, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("autocast", [False, True])
def test_low_precision_embeddings_give_a_float32_loss(dtype: torch.dtype, autocast: bool) -> None:
    z = _embeddings(12, 8, 10, dtype).requires_grad_(True)
    labels = torch.arange(12) % 3
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = FocalContrastiveLoss()(z, labels)
    assert loss.dtype == torch.float32
    want = paper_focal_contrastive_loss(z.detach(), labels.tolist(), 0.07, True)  # from the low-precision values
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()
    assert z.grad.dtype == dtype and torch.isfinite(z.grad.float()).all()


def test_a_positive_mask_gives_the_functional_loss_of_that_layout() -> None:
    z, labels = _embeddings(12, 5, 11), torch.tensor([0, 1, 0, 1])  # rows [z (4); z⁺ (4); z⁻ (4)]
    mask = ct.core_positive_mask(labels)
    got = FocalContrastiveLoss(temperature=0.1)(z, positive_mask=mask)
    v = F.normalize(z, dim=1)
    assert got.item() == pytest.approx(ct.contrastive_loss(v, mask, 0.1, focal=True).item(), rel=1e-12)
    own = ct.own_pairs_mask(4)
    got_own = FocalContrastiveLoss(temperature=0.1)(z, positive_mask=mask, contrast_mask=own)
    want_own = ct.contrastive_loss(v, mask, 0.1, focal=True, contrast_mask=own)
    assert got_own.item() == pytest.approx(want_own.item(), rel=1e-12) and got_own.item() != pytest.approx(got.item())


def test_normalize_makes_it_scale_free_and_false_takes_rows_as_they_are() -> None:
    z, labels = _embeddings(6, 3, 12), torch.tensor([0, 0, 1, 1, 2, 2])
    loss = FocalContrastiveLoss()(z, labels)
    assert FocalContrastiveLoss()(3 * z, labels).item() == pytest.approx(loss.item(), rel=1e-12)
    raw = FocalContrastiveLoss(normalize=False)
    assert raw(F.normalize(z, dim=1), labels).item() == pytest.approx(loss.item(), rel=1e-12)
    assert raw(3 * F.normalize(z, dim=1), labels).item() != pytest.approx(loss.item())


def test_it_trains_a_head_in_a_loop_and_is_exported() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 3)
    loss_fn = ct.FocalContrastiveLoss(temperature=0.5)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5)
    x, labels = torch.randn(16, 4), torch.arange(16) % 2
    losses = []
    for _ in range(20):
        loss = loss_fn(head(x), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert ct.FocalContrastiveLoss is FocalContrastiveLoss and not list(loss_fn.parameters())
    assert repr(loss_fn) == "FocalContrastiveLoss(temperature=0.5, focal=True, normalize=True)"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f: f(torch.zeros(4, 2)), r"takes labels \(N,\) or positive_mask=\(M, N\), not neither"),
        (
            lambda f: f(torch.zeros(4, 2), torch.zeros(4), positive_mask=torch.zeros(4, 4, dtype=torch.bool)),
            r"not both",
        ),
        (lambda f: f(torch.zeros(4, 2), torch.zeros(3)), r"labels must be \(4,\), one per embedding, got shape \(3,\)"),
        (lambda f: f(torch.zeros(4), torch.zeros(4)), r"embeddings must be \(N, d\), got shape \(4,\)"),
        (
            lambda f: f(torch.zeros(4, 2), positive_mask=torch.zeros(4, 5, dtype=torch.bool)),
            r"pos_mask must be \(M, N\) with M <= N = 4",
        ),
    ],
)
def test_bad_calls_are_refused_in_one_line(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(FocalContrastiveLoss())  # type: ignore[operator]


@pytest.mark.parametrize("tau", [0.0, -0.1])
def test_a_non_positive_temperature_is_refused_at_construction(tau: float) -> None:
    with pytest.raises(ValueError, match=rf"temperature must be > 0, got {tau}"):
        FocalContrastiveLoss(temperature=tau)
