"""coretune.losses against slow per-anchor loops written from the equations (paper Eq. 1, §4.1 L^f_con)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import coretune as ct

# ------------------------------------------------------------------------------------------------------------
# References, straight from the specification
# ------------------------------------------------------------------------------------------------------------


def reference_contrastive_loss(
    v: torch.Tensor, pos_mask: torch.Tensor, tau: float, focal: bool, contrast_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """One anchor at a time: A_i = rows != i (those with contrast_mask[i, k] when given), P_i = {j ∈ A_i :
    mask[i, j]}, p_ij = exp(s_ij/τ) / Σ_{A_i} exp(s_ik/τ), loss_i = -(1/|P_i|) Σ_{P_i} w_ij log p_ij (w = 1 - p
    if focal else 1); the mean over anchors with |P_i| > 0."""
    n, m = v.shape[0], pos_mask.shape[0]
    per_anchor = []
    for i in range(m):
        others = [k for k in range(n) if k != i and (contrast_mask is None or bool(contrast_mask[i, k]))]
        positives = [j for j in others if bool(pos_mask[i, j])]
        if not positives:
            continue
        denominator = torch.exp(v[others] @ v[i] / tau).sum()
        p = torch.exp(v[positives] @ v[i] / tau) / denominator
        w = 1 - p if focal else torch.ones_like(p)
        per_anchor.append(-(w * torch.log(p)).sum() / len(positives))
    if not per_anchor:
        return (v * 0).sum()
    return torch.stack(per_anchor).mean()


def reference_core_mask(labels: list[int]) -> torch.Tensor:
    """P_i = {j < B : j != i, y_j = y_i} ∪ {B + i} for rows [originals; hard positives; hard negatives]."""
    b = len(labels)
    mask = torch.zeros(b, 3 * b, dtype=torch.bool)
    for i in range(b):
        for j in range(b):
            if j != i and labels[j] == labels[i]:
                mask[i, j] = True
        mask[i, b + i] = True
    return mask


def unit_rows(n: int, d: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1).to(dtype)


def assert_matches_reference(
    v: torch.Tensor, mask: torch.Tensor, tau: float, focal: bool, contrast_mask: torch.Tensor | None = None
) -> None:
    """Values and gradients (w.r.t. v) of the vectorised loss equal the reference's, in float64."""
    v1 = v.clone().requires_grad_(True)
    v2 = v.clone().requires_grad_(True)
    got = ct.contrastive_loss(v1, mask, tau, focal=focal, contrast_mask=contrast_mask)
    want = reference_contrastive_loss(v2, mask, tau, focal, contrast_mask)
    assert got.dtype == torch.float64 and got.dim() == 0
    torch.testing.assert_close(got, want)
    (g1,) = torch.autograd.grad(got, v1)
    (g2,) = torch.autograd.grad(want, v2)
    torch.testing.assert_close(g1, g2)


# ------------------------------------------------------------------------------------------------------------
# contrastive_loss: property tests against the reference
# ------------------------------------------------------------------------------------------------------------

taus = st.sampled_from([0.05, 0.07, 0.2, 1.0])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 64),
    m=st.integers(0, 64),
    d=st.integers(1, 6),
    density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    tau=taus,
    focal=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(n=64, m=48, d=5, density=0.3, tau=0.07, focal=True, seed=2)
def test_random_masks_match_reference(
    n: int, m: int, d: int, density: float, tau: float, focal: bool, seed: int
) -> None:
    m = min(m, n)  # M <= N: only the first M rows are anchors
    v = unit_rows(n, d, seed)
    mask = torch.rand(m, n, generator=torch.Generator().manual_seed(seed + 1)) < density
    assert_matches_reference(v, mask, tau, focal)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    m=st.integers(0, 40),
    density=st.sampled_from([0.0, 0.3, 1.0]),
    keep=st.sampled_from([0.0, 0.5, 1.0]),
    focal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_contrast_mask_restricts_the_denominator_like_the_reference(
    n: int, m: int, density: float, keep: float, focal: bool, seed: int
) -> None:
    m = min(m, n)
    g = torch.Generator().manual_seed(seed + 1)
    mask, contrast = torch.rand(m, n, generator=g) < density, torch.rand(m, n, generator=g) < keep
    assert_matches_reference(unit_rows(n, 4, seed), mask, 0.1, focal, contrast)


def reference_own_pairs_mask(b: int, extra: int) -> torch.Tensor:
    """Algorithm 1 read literally: A_i = the originals, z⁺_i, z⁻_i and every extra (memory) row."""
    mask = torch.zeros(b, 3 * b + extra, dtype=torch.bool)
    for i in range(b):
        for j in range(3 * b + extra):
            mask[i, j] = j < b or j in (b + i, 2 * b + i) or j >= 3 * b
    return mask


@settings(max_examples=30, deadline=None)
@given(
    labels=st.integers(1, 6).flatmap(lambda k: st.lists(st.integers(0, k - 1), min_size=1, max_size=16)),
    memory_labels=st.lists(st.integers(0, 5), max_size=12),
    own=st.booleans(),
    focal=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(labels=[0, 1, 2], memory_labels=[], own=True, focal=True, seed=0)  # no original positive, no memory
@example(labels=[2, 2, 2], memory_labels=[2, 2], own=True, focal=True, seed=1)  # one class
def test_core_layout_with_memory_and_own_pairs_matches_reference(
    labels: list[int], memory_labels: list[int], own: bool, focal: bool, seed: int
) -> None:
    """Rows [z; z⁺; z⁻; memory]: P_i adds the memory rows of the anchor's class; A_i is every row (the default)
    or, with own pairs, only the anchor's own generated rows."""
    b, extra = len(labels), len(memory_labels)
    assert torch.equal(ct.own_pairs_mask(b, extra), reference_own_pairs_mask(b, extra))
    same = torch.tensor(labels)[:, None] == torch.tensor(memory_labels, dtype=torch.long)[None, :]
    mask = torch.cat([reference_core_mask(labels), same], dim=1)
    contrast = reference_own_pairs_mask(b, extra) if own else None
    rows = unit_rows(3 * b + extra, 5, seed)
    assert_matches_reference(rows, mask, 0.07, focal, contrast)
    # The memory's rows as constant keys: the same loss, and the same gradient for the other rows.
    v = rows[: 3 * b].clone().requires_grad_(True)
    got = ct.contrastive_loss(v, mask, 0.07, focal, contrast, keys=rows[3 * b :])
    whole = rows.clone().requires_grad_(True)
    want = reference_contrastive_loss(whole, mask, 0.07, focal, contrast)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, v)[0], torch.autograd.grad(want, whole)[0][: 3 * b])


@settings(max_examples=40, deadline=None)
@given(
    labels=st.integers(1, 20).flatmap(lambda k: st.lists(st.integers(0, k - 1), min_size=1, max_size=64)),
    d=st.integers(1, 6),
    tau=taus,
    focal=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(labels=[0] * 64, d=3, tau=0.07, focal=True, seed=0)  # one class, B = 64
@example(labels=[i % 20 for i in range(64)], d=2, tau=0.07, focal=False, seed=1)
def test_core_layout_matches_reference(labels: list[int], d: int, tau: float, focal: bool, seed: int) -> None:
    mask = ct.core_positive_mask(torch.tensor(labels))
    assert torch.equal(mask, reference_core_mask(labels))
    assert_matches_reference(unit_rows(3 * len(labels), d, seed), mask, tau, focal)


@settings(max_examples=40, deadline=None)
@given(
    labels=st.integers(1, 20).flatmap(lambda k: st.lists(st.integers(0, k - 1), min_size=1, max_size=64)),
    d=st.integers(1, 6),
    focal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_supcon_layout_matches_reference(labels: list[int], d: int, focal: bool, seed: int) -> None:
    y = torch.tensor(labels)
    mask = ct.supcon_positive_mask(y)
    want = (y[:, None] == y[None, :]) & ~torch.eye(len(labels), dtype=torch.bool)
    assert torch.equal(mask, want)
    assert_matches_reference(unit_rows(len(labels), d, seed), mask, 0.07, focal)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), focal=st.booleans(), seed=st.integers(0, 2**16))
def test_true_diagonal_changes_nothing(n: int, focal: bool, seed: int) -> None:
    v = unit_rows(n, 4, seed)
    m = max(1, n // 2)
    mask = torch.rand(m, n, generator=torch.Generator().manual_seed(seed)) < 0.4
    with_diag = mask | torch.eye(m, n, dtype=torch.bool)
    without_diag = mask & ~torch.eye(m, n, dtype=torch.bool)
    va = v.clone().requires_grad_(True)
    vb = v.clone().requires_grad_(True)
    la = ct.contrastive_loss(va, with_diag, 0.1, focal=focal)
    lb = ct.contrastive_loss(vb, without_diag, 0.1, focal=focal)
    assert torch.equal(la, lb)
    assert torch.equal(torch.autograd.grad(la, va)[0], torch.autograd.grad(lb, vb)[0])


# ------------------------------------------------------------------------------------------------------------
# contrastive_loss: hand-computed values and edge cases
# ------------------------------------------------------------------------------------------------------------


def test_hand_computed_supcon_and_focal_values() -> None:
    """v = (e1, e1, e2), y = (0, 0, 1), τ = 1: anchors 0 and 1 have p = e/(e+1); anchor 2 has no positive."""
    v = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    mask = ct.supcon_positive_mask(torch.tensor([0, 0, 1]))
    p = math.e / (math.e + 1)
    assert ct.contrastive_loss(v, mask, 1.0).item() == pytest.approx(-math.log(p), rel=1e-12)
    assert ct.contrastive_loss(v, mask, 1.0, focal=True).item() == pytest.approx(-(1 - p) * math.log(p), rel=1e-12)


def test_default_temperature_is_0_07() -> None:
    v = unit_rows(6, 3, 0)
    mask = ct.supcon_positive_mask(torch.tensor([0, 0, 1, 1, 2, 2]))
    torch.testing.assert_close(ct.contrastive_loss(v, mask), reference_contrastive_loss(v, mask, 0.07, False))


@pytest.mark.parametrize("focal", [False, True])
@pytest.mark.parametrize(("n", "m"), [(1, 1), (5, 5), (5, 2), (5, 0), (0, 0)])
def test_no_positive_gives_zero_in_graph(n: int, m: int, focal: bool) -> None:
    v = unit_rows(n, 3, 1, torch.float32).requires_grad_(True)
    loss = ct.contrastive_loss(v, torch.zeros(m, n, dtype=torch.bool), focal=focal)
    assert loss.requires_grad and loss.item() == 0.0
    loss.backward()
    assert v.grad is not None and torch.equal(v.grad, torch.zeros_like(v))


def test_single_row_with_true_self_mask_is_zero_not_nan() -> None:
    v = unit_rows(1, 3, 1, torch.float32).requires_grad_(True)
    loss = ct.contrastive_loss(v, torch.ones(1, 1, dtype=torch.bool), focal=True)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("focal", [False, True])
def test_stable_at_tiny_temperature(focal: bool) -> None:
    """s/τ up to 1000: a naive exp overflows; the log-sum-exp form stays finite and agrees with float64."""
    v64 = unit_rows(32, 4, 3)
    mask = ct.supcon_positive_mask(torch.arange(32) % 4)
    v32 = v64.float().requires_grad_(True)
    loss32 = ct.contrastive_loss(v32, mask, 1e-3, focal=focal)
    loss32.backward()
    loss64 = ct.contrastive_loss(v64, mask, 1e-3, focal=focal)
    assert torch.isfinite(loss32) and torch.isfinite(v32.grad).all()
    assert loss32.item() == pytest.approx(loss64.item(), rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_give_float32(dtype: torch.dtype) -> None:
    v = unit_rows(12, 8, 4, dtype)
    mask = ct.supcon_positive_mask(torch.arange(12) % 3)
    loss = ct.contrastive_loss(v, mask, focal=True)
    assert loss.dtype == torch.float32
    want = reference_contrastive_loss(v.double(), mask, 0.07, True)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("focal", [False, True])
def test_bf16_autocast_returns_float32(focal: bool) -> None:
    v = unit_rows(24, 16, 5, torch.bfloat16).requires_grad_(True)
    mask = ct.core_positive_mask(torch.arange(8) % 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ct.contrastive_loss(v, mask, focal=focal)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    # Computed from the bf16 values in float32, not in bf16.
    want = reference_contrastive_loss(v.detach().double(), mask, 0.07, focal)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()
    assert v.grad.dtype == torch.bfloat16 and torch.isfinite(v.grad.float()).all()


def test_float64_stays_float64_under_autocast() -> None:
    v = unit_rows(6, 3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ct.contrastive_loss(v, ct.supcon_positive_mask(torch.tensor([0, 0, 1, 1, 2, 2])))
    assert loss.dtype == torch.float64


@pytest.mark.parametrize(
    ("features", "mask", "tau", "message"),
    [
        (torch.zeros(4), torch.zeros(4, 4, dtype=torch.bool), 0.1, r"features must be \(N, d\)"),
        (
            torch.zeros(4, 2),
            torch.zeros(4, 5, dtype=torch.bool),
            0.1,
            r"pos_mask must be \(M, N\) with M <= N = 4",
        ),
        (
            torch.zeros(4, 2),
            torch.zeros(5, 4, dtype=torch.bool),
            0.1,
            r"pos_mask must be \(M, N\) with M <= N = 4",
        ),
        (torch.zeros(4, 2), torch.zeros(4, 4, dtype=torch.bool), 0.0, "temperature must be > 0"),
    ],
)
def test_bad_arguments_raise(features: torch.Tensor, mask: torch.Tensor, tau: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ct.contrastive_loss(features, mask, tau)


# ------------------------------------------------------------------------------------------------------------
# masks and soft cross-entropy
# ------------------------------------------------------------------------------------------------------------


def test_core_mask_small_example() -> None:
    mask = ct.core_positive_mask(torch.tensor([1, 0, 1]))
    want = torch.tensor(
        [
            [0, 0, 1, 1, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 1, 0, 0, 0, 0],
            [1, 0, 0, 0, 0, 1, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    assert mask.dtype == torch.bool and torch.equal(mask, want)


def test_core_mask_without_original_positives_keeps_only_generated_positive() -> None:
    mask = ct.core_positive_mask(torch.tensor([1, 0, 1]), original_positives=False)
    assert torch.equal(mask, torch.cat([torch.zeros(3, 3), torch.eye(3), torch.zeros(3, 3)], 1).bool())


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 32), k=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_soft_cross_entropy_is_mean_of_target_weighted_log_softmax(b: int, k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k, generator=g, dtype=torch.float64)
    targets = torch.rand(b, k, generator=g, dtype=torch.float64)
    targets = targets / targets.sum(1, keepdim=True)
    want = sum(-(targets[i] * torch.log(torch.softmax(logits[i], 0))).sum() for i in range(b)) / b
    torch.testing.assert_close(ct.soft_cross_entropy(logits, targets), want)
    hard = torch.randint(0, k, (b,), generator=g)
    torch.testing.assert_close(
        ct.soft_cross_entropy(logits, F.one_hot(hard, k).double()), F.cross_entropy(logits, hard)
    )


def test_soft_cross_entropy_low_precision_is_float32() -> None:
    logits = torch.randn(4, 3).bfloat16()
    assert ct.soft_cross_entropy(logits, torch.full((4, 3), 1 / 3)).dtype == torch.float32


def test_keys_of_another_width_or_masks_without_their_columns_are_refused() -> None:
    with pytest.raises(ValueError, match=r"keys must be \(K, 2\), got shape \(3, 4\)"):
        ct.contrastive_loss(torch.zeros(4, 2), torch.zeros(3, 7), 0.1, keys=torch.zeros(3, 4))
    with pytest.raises(
        ValueError, match=r"pos_mask must be \(M, N \+ K\) = \(M, 7\) with M <= N = 4, got shape \(3, 4\)"
    ):
        ct.contrastive_loss(torch.zeros(4, 2), torch.zeros(3, 4), 0.1, keys=torch.zeros(3, 2))


def test_a_contrast_mask_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"contrast_mask must have pos_mask's shape \(3, 4\), got \(3, 3\)"):
        ct.contrastive_loss(torch.zeros(4, 2), torch.zeros(3, 4), 0.1, contrast_mask=torch.ones(3, 3))
