"""coretune.mine_hard_pairs against per-anchor loops written from the equations (paper §4.1, Algorithm 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import coretune as ct

# ------------------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------------------


def cosine_matrix(z: torch.Tensor) -> list[list[float]]:
    """s_ij = z_i·z_j / (|z_i| |z_j|), one pair at a time in float64."""
    z = z.detach().double()
    norms = [float(z[i].norm()) for i in range(len(z))]
    return [[float(z[i] @ z[j]) / (norms[i] * norms[j]) for j in range(len(z))] for i in range(len(z))]


def reference_hardest(z: torch.Tensor, labels: list[int], b: int | None = None) -> tuple[list[int], list[int]]:
    """hp(i) = argmin_{j != i, y_j = y_i} s_ij, hn(i) = argmax_{y_j != y_i} s_ij; ties: lowest j; none: i.
    The anchors are the first ``b`` rows (default: all); the candidates are every row (a batch and its memory)."""
    s = cosine_matrix(z)
    hp, hn = [], []
    for i, yi in enumerate(labels[:b]):
        best_p, best_n = i, i
        for j, yj in enumerate(labels):
            if j != i and yj == yi and (best_p == i or s[i][j] < s[i][best_p]):
                best_p = j
            if yj != yi and (best_n == i or s[i][j] > s[i][best_n]):
                best_n = j
        hp.append(best_p)
        hn.append(best_n)
    return hp, hn


def reference_mix(
    z: torch.Tensor,
    labels: list[int],
    k: int,
    hp: list[int],
    hn: list[int],
    rn: list[int],
    lam: list[float],
    lam_n: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """z⁺_i = λ z_hp + (1-λ) z_hn, y⁺_i = λ e(y_hp) + (1-λ) e(y_hn);
    z⁻_i = (1-λ') z_i + λ' z_n, y⁻_i = (1-λ') e(y_i) + λ' e(y_n), for the anchors i < len(hp)."""
    e = torch.eye(k, dtype=torch.float64)
    anchors = range(len(hp))
    pos = torch.stack([lam[i] * z[hp[i]] + (1 - lam[i]) * z[hn[i]] for i in anchors])
    neg = torch.stack([(1 - lam_n[i]) * z[i] + lam_n[i] * z[rn[i]] for i in anchors])
    pos_t = torch.stack([lam[i] * e[labels[hp[i]]] + (1 - lam[i]) * e[labels[hn[i]]] for i in anchors])
    neg_t = torch.stack([(1 - lam_n[i]) * e[labels[i]] + lam_n[i] * e[labels[rn[i]]] for i in anchors])
    return pos, neg, pos_t, neg_t


def batch(labels: list[int], d: int, seed: int, duplicates: int = 0) -> torch.Tensor:
    """Random float64 features; the first ``duplicates`` rows are copied onto the last ones (exact ties)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(len(labels), d, generator=g, dtype=torch.float64)
    for r in range(min(duplicates, len(labels) // 2)):
        z[len(labels) - 1 - r] = z[r]
    return z


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


label_lists = st.integers(1, 20).flatmap(
    lambda k: st.tuples(st.just(k), st.lists(st.integers(0, k - 1), min_size=1, max_size=64))
)


# ------------------------------------------------------------------------------------------------------------
# Property tests
# ------------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    kl=label_lists,
    d=st.integers(1, 6),
    duplicates=st.integers(0, 8),
    alpha=st.sampled_from([0.2, 1.0, 4.0]),
    lambda_n=st.floats(0, 1),
    lambda_p=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
@example(kl=(1, [0] * 64), d=3, duplicates=0, alpha=1.0, lambda_n=0.8, lambda_p=0.0, seed=0)  # one class
@example(kl=(20, [i % 20 for i in range(64)]), d=2, duplicates=5, alpha=1.0, lambda_n=0.8, lambda_p=0.0, seed=1)
@example(kl=(3, [2]), d=4, duplicates=0, alpha=1.0, lambda_n=0.8, lambda_p=0.3, seed=2)  # B = 1
def test_pairs_match_reference(
    kl: tuple[int, list[int]],
    d: int,
    duplicates: int,
    alpha: float,
    lambda_n: float,
    lambda_p: float,
    seed: int,
) -> None:
    k, labels = kl
    z = batch(labels, d, seed, duplicates).requires_grad_(True)
    pairs = ct.mine_hard_pairs(z, torch.tensor(labels), k, alpha, lambda_n, lambda_p, generator=gen(seed))
    check_pairs(pairs, z, z.detach(), labels, k, lambda_n, lambda_p, seed)


def check_pairs(
    pairs: ct.HardPairs,
    z: torch.Tensor,
    pool: torch.Tensor,
    pool_labels: list[int],
    k: int,
    lambda_n: float,
    lambda_p: float,
    seed: int,
) -> None:
    """``pairs`` mined for the batch ``z`` (the first rows of ``pool``, whose labels are ``pool_labels``) against
    the loop reference: the hardest choices, the random negatives' constraints, the mixing and its gradient,
    which reaches the batch's rows only (a memory row is a constant)."""
    b, d = z.shape
    n = len(pool_labels)

    # Deterministic part: hardest positive / negative, as in the loop. The implementation may compute s_ij in
    # lower precision than this float64 loop, so a row whose optimum is within 1e-6 of a *different* value is
    # only checked for near-optimality; exact ties (duplicated rows) must resolve to the lowest index.
    s = cosine_matrix(pool)
    hp_ref, hn_ref = reference_hardest(pool, pool_labels, b)
    hp, hn, rn = (
        pairs.hardest_positive.tolist(),
        pairs.hardest_negative.tolist(),
        pairs.random_negative.tolist(),
    )
    for i in range(b):
        for got, want, same_class in ((hp[i], hp_ref[i], True), (hn[i], hn_ref[i], False)):
            if got == want:
                continue
            if max(got, want) >= b and torch.equal(pool[got], pool[want]):  # a memory row's exact duplicate
                assert pool_labels[got] == pool_labels[want] and got != i
                continue
            candidates = [j for j in range(n) if (pool_labels[j] == pool_labels[i]) == same_class and j != i]
            near = [j for j in candidates if 0 < abs(s[i][j] - s[i][want]) < 1e-6]
            assert near and got in candidates and abs(s[i][got] - s[i][want]) < 1e-6, (i, got, want)

    # Random part: constraints.
    assert pairs.lam_pos.shape == pairs.lam_neg.shape == (b,)
    assert bool((pairs.lam_pos >= lambda_p).all() and (pairs.lam_pos <= 1).all())
    assert bool((pairs.lam_neg >= lambda_n).all() and (pairs.lam_neg <= 1).all())
    for i in range(b):
        if len(set(pool_labels)) > 1:
            assert pool_labels[rn[i]] != pool_labels[i]
        else:
            assert rn[i] == i

    # Mixing: the formulas, given the returned indices and weights.
    lam, lam_n = pairs.lam_pos.double().tolist(), pairs.lam_neg.double().tolist()
    pos, neg, pos_t, neg_t = reference_mix(pool.double(), pool_labels, k, hp, hn, rn, lam, lam_n)
    # λ is returned in float32 and applied in z's dtype (float64 here): exact up to float64 rounding.
    torch.testing.assert_close(pairs.pos_features.detach(), pos)
    torch.testing.assert_close(pairs.neg_features.detach(), neg)
    torch.testing.assert_close(pairs.pos_targets.double(), pos_t)
    torch.testing.assert_close(pairs.neg_targets.double(), neg_t)
    assert pairs.pos_targets.shape == pairs.neg_targets.shape == (b, k)
    torch.testing.assert_close(pairs.pos_targets.sum(1), torch.ones(b))

    # Gradient: only through the mixing. For cotangents G⁺, G⁻ the vector-Jacobian product is
    # dz_j = Σ_i [hp(i)=j] λ_i G⁺_i + [hn(i)=j] (1-λ_i) G⁺_i + [i=j] (1-λ'_i) G⁻_i + [rn(i)=j] λ'_i G⁻_i.
    g = torch.Generator().manual_seed(seed + 7)
    gp = torch.randn(b, d, generator=g, dtype=torch.float64)
    gn = torch.randn(b, d, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((pairs.pos_features * gp).sum() + (pairs.neg_features * gn).sum(), z)
    want = torch.zeros(n, d, dtype=torch.float64)
    for i in range(b):
        want[hp[i]] += lam[i] * gp[i]
        want[hn[i]] += (1 - lam[i]) * gp[i]
        want[i] += (1 - lam_n[i]) * gn[i]
        want[rn[i]] += lam_n[i] * gn[i]
    torch.testing.assert_close(grad, want[:b])
    for t in (pairs.hardest_positive, pairs.hardest_negative, pairs.random_negative):
        assert t.dtype == torch.long and not t.requires_grad
    assert not (pairs.lam_pos.requires_grad or pairs.pos_targets.requires_grad or pairs.neg_targets.requires_grad)


# ------------------------------------------------------------------------------------------------------------
# A cross-batch memory: the pool [batch; memory]
# ------------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    kl=label_lists,
    memory_labels=st.lists(st.integers(0, 19), max_size=24),
    d=st.integers(1, 6),
    copies=st.integers(0, 4),
    lambda_n=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
@example(kl=(3, [0, 1, 2]), memory_labels=[0, 1, 2] * 3, d=3, copies=0, lambda_n=0.8, seed=0)  # no in-batch pos
@example(kl=(1, [0] * 5), memory_labels=[0, 0], d=2, copies=2, lambda_n=0.8, seed=1)  # one class everywhere
@example(kl=(4, [1] * 6), memory_labels=[3, 1], d=4, copies=1, lambda_n=0.5, seed=2)  # negatives only in memory
@example(kl=(3, [0, 1, 2, 0]), memory_labels=[], d=3, copies=0, lambda_n=0.8, seed=3)  # empty memory
@example(kl=(2, [0, 1] * 8), memory_labels=[1, 0], d=2, copies=0, lambda_n=0.8, seed=4)  # memory < batch
def test_pairs_with_a_memory_match_the_reference_over_the_pool(
    kl: tuple[int, list[int]], memory_labels: list[int], d: int, copies: int, lambda_n: float, seed: int
) -> None:
    """Candidates come from [batch; memory]; a memory row copied from a batch row is an equally hard candidate
    (either may be chosen: the memory columns are not deduplicated); the gradient reaches the batch only."""
    k, labels = kl
    memory_labels = [y % k for y in memory_labels]
    z = batch(labels, d, seed).requires_grad_(True)
    memory = torch.randn(len(memory_labels), d, generator=gen(seed + 1), dtype=torch.float64)
    for r in range(min(copies, len(memory_labels), len(labels))):
        memory[-1 - r] = z[r].detach()
        memory_labels[-1 - r] = labels[r]
    y, my = torch.tensor(labels), torch.tensor(memory_labels, dtype=torch.long)
    pairs = ct.mine_hard_pairs(z, y, k, 1.0, lambda_n, 0.0, gen(seed), memory, my)
    check_pairs(pairs, z, torch.cat([z.detach(), memory]), labels + memory_labels, k, lambda_n, 0.0, seed)


def test_an_empty_memory_mines_exactly_the_batch() -> None:
    z, y = torch.randn(12, 5, generator=gen(0)), torch.arange(12) % 3
    plain = vars(ct.mine_hard_pairs(z, y, 3, generator=gen(1)))
    empty = vars(ct.mine_hard_pairs(z, y, 3, generator=gen(1), memory=torch.zeros(0, 5), memory_labels=y[:0]))
    assert all(torch.equal(empty[name], value) for name, value in plain.items())


def test_a_memory_gives_anchors_without_a_batch_positive_one() -> None:
    """Batch 4 of 4 classes: no anchor has a positive in the batch; the memory holds one per class."""
    z = torch.eye(4)
    memory = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    pairs = ct.mine_hard_pairs(z, torch.arange(4), 4, memory=memory, memory_labels=torch.tensor([1, 0, 3, 2]))
    assert pairs.hardest_positive.tolist() == [5, 4, 7, 6]
    in_batch = ct.mine_hard_pairs(z, torch.arange(4), 4)
    assert in_batch.hardest_positive.tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------------------
# Ties and missing candidates
# ------------------------------------------------------------------------------------------------------------


def test_ties_resolve_to_lowest_index() -> None:
    """Rows 1 and 3 duplicate the least similar positive of anchor 0; rows 2 and 4 duplicate its most similar
    negative: anchor 0 must pick 1 and 2. All-identical features make every candidate tie."""
    a, far, close = [1.0, 0.0], [-1.0, 0.2], [0.9, 0.3]
    z = torch.tensor([a, far, close, far, close, [0.5, 0.5]])
    y = torch.tensor([0, 0, 1, 0, 1, 0])
    pairs = ct.mine_hard_pairs(z, y, 2, generator=gen(0))
    assert pairs.hardest_positive[0].item() == 1
    assert pairs.hardest_negative[0].item() == 2

    y = torch.tensor([3, 1, 3, 3, 1, 2, 1, 3])
    pairs = ct.mine_hard_pairs(torch.ones(8, 5), y, 4, generator=gen(0))
    assert pairs.hardest_positive.tolist() == [2, 4, 0, 0, 1, 5, 1, 0]
    assert pairs.hardest_negative.tolist() == [1, 0, 1, 1, 0, 0, 0, 1]


@pytest.mark.parametrize("b", [2, 33, 64])
def test_ties_among_many_duplicates(b: int) -> None:
    """Every sample has an exact duplicate at a higher index; the lowest one always wins."""
    g = gen(b)
    base = torch.randn(b // 2 + 1, 7, generator=g)
    z = torch.cat([base, base])[:b]
    y = torch.randint(0, 3, (b,), generator=g)
    pairs = ct.mine_hard_pairs(z, y, 3, generator=gen(0))
    hp_ref, hn_ref = reference_hardest(z, y.tolist())
    assert pairs.hardest_positive.tolist() == hp_ref
    assert pairs.hardest_negative.tolist() == hn_ref


@pytest.mark.parametrize("b", [6, 17, 40])
def test_duplicated_rows_tie_exactly(b: int) -> None:
    """A GEMM may round identical columns differently (edge tiles use other kernels): s(z_i, z_0) and
    s(z_i, z_{B-1}) with z_{B-1} = z_0 must still tie, so the lowest index wins."""
    for seed in range(20):
        z = torch.randn(b, 4, generator=gen(seed), dtype=torch.float64)
        z[-1] = z[0]
        labels = [0] * b if seed % 2 else [int(i % 3 == 0) for i in range(b)]
        pairs = ct.mine_hard_pairs(z, torch.tensor(labels), 2, generator=gen(0))
        hp_ref, hn_ref = reference_hardest(z, labels)
        assert pairs.hardest_positive.tolist() == hp_ref, seed
        assert pairs.hardest_negative.tolist() == hn_ref, seed


def test_no_candidate_falls_back_to_anchor() -> None:
    # Class 2 has a single sample: no positive. Class 0 anchors do have candidates.
    y = torch.tensor([0, 0, 2, 0])
    pairs = ct.mine_hard_pairs(torch.randn(4, 3, generator=gen(1)), y, 3, generator=gen(0))
    assert pairs.hardest_positive[2].item() == 2
    assert all(pairs.hardest_positive[i].item() != i for i in (0, 1, 3))

    # One class: no negative anywhere, so hn = rn = i and z⁻ = z (whatever λ').
    z = torch.randn(5, 3, generator=gen(2))
    pairs = ct.mine_hard_pairs(z, torch.full((5,), 1), 2, generator=gen(0))
    assert pairs.hardest_negative.tolist() == pairs.random_negative.tolist() == list(range(5))
    torch.testing.assert_close(pairs.neg_features, z)
    torch.testing.assert_close(pairs.neg_targets, F.one_hot(torch.full((5,), 1), 2).float())

    # B = 1: everything is the anchor itself.
    z = torch.randn(1, 4, generator=gen(3))
    pairs = ct.mine_hard_pairs(z, torch.tensor([0]), 1, generator=gen(0))
    assert pairs.hardest_positive.tolist() == pairs.hardest_negative.tolist() == pairs.random_negative.tolist() == [0]
    torch.testing.assert_close(pairs.pos_features, z)
    torch.testing.assert_close(pairs.neg_features, z)


# ------------------------------------------------------------------------------------------------------------
# The random draws
# ------------------------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(kl=label_lists, seed=st.integers(0, 2**16))
def test_random_negatives_never_share_the_anchor_class(kl: tuple[int, list[int]], seed: int) -> None:
    k, labels = kl
    y = torch.tensor(labels)
    rn = ct.mine_hard_pairs(torch.randn(len(labels), 3, generator=gen(seed)), y, k, generator=gen(seed)).random_negative
    other_class_exists = torch.tensor([bool((y != yi).any()) for yi in labels])
    assert torch.equal(y[rn] != y, other_class_exists)
    assert torch.equal(rn[~other_class_exists], torch.arange(len(labels))[~other_class_exists])


def test_same_seed_same_pairs_different_seed_different_pairs() -> None:
    z = torch.randn(64, 16, generator=gen(0))
    y = torch.randint(0, 10, (64,), generator=gen(1))
    a = ct.mine_hard_pairs(z, y, 10, generator=gen(5))
    b = ct.mine_hard_pairs(z, y, 10, generator=gen(5))
    c = ct.mine_hard_pairs(z, y, 10, generator=gen(6))
    for name in ("random_negative", "lam_pos", "lam_neg", "pos_features", "neg_features", "neg_targets"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.random_negative, c.random_negative)
    assert not torch.equal(a.lam_pos, c.lam_pos)
    assert not torch.equal(a.lam_neg, c.lam_neg)
    # The deterministic choices do not depend on the seed.
    assert torch.equal(a.hardest_positive, c.hardest_positive)
    assert torch.equal(a.hardest_negative, c.hardest_negative)


def test_generator_is_the_only_source_of_randomness() -> None:
    z = torch.randn(32, 8, generator=gen(0))
    y = torch.arange(32) % 4
    torch.manual_seed(1)
    a = ct.mine_hard_pairs(z, y, 4, generator=gen(5))
    torch.manual_seed(2)
    b = ct.mine_hard_pairs(z, y, 4, generator=gen(5))
    assert torch.equal(a.random_negative, b.random_negative) and torch.equal(a.lam_neg, b.lam_neg)


def test_global_seed_controls_draws_without_generator() -> None:
    z = torch.randn(32, 8, generator=gen(0))
    y = torch.arange(32) % 4
    torch.manual_seed(3)
    a = ct.mine_hard_pairs(z, y, 4)
    torch.manual_seed(3)
    b = ct.mine_hard_pairs(z, y, 4)
    c = ct.mine_hard_pairs(z, y, 4)  # the global stream has moved on
    assert torch.equal(a.random_negative, b.random_negative) and torch.equal(a.lam_pos, b.lam_pos)
    assert torch.equal(a.lam_neg, b.lam_neg)
    assert not torch.equal(a.lam_neg, c.lam_neg)


def test_random_negatives_are_uniform_over_other_class_samples() -> None:
    """Anchor 0 (class 0) has 7 other-class candidates in classes of unequal size: each is drawn ~1/7."""
    y = torch.tensor([0, 1, 1, 1, 1, 2, 2, 0, 3])
    candidates = [1, 2, 3, 4, 5, 6, 8]
    z = torch.randn(len(y), 4, generator=gen(0))
    g = gen(123)
    draws = 1400
    counts = torch.zeros(len(y))
    for _ in range(draws):
        rn = ct.mine_hard_pairs(z, y, 4, generator=g).random_negative
        counts[rn[0]] += 1
    assert counts[[0, 7]].sum() == 0
    expected = draws / len(candidates)
    chi2 = float(((counts[candidates] - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, counts  # df = 6: P(chi2 > 22.5) = 0.001 under uniformity


def test_random_negatives_from_a_memory_are_uniform_over_the_pool() -> None:
    """With a memory the draw is one uniform number per anchor: anchor 0 (class 0) has 3 other-class candidates
    in the batch and 4 in the memory, each drawn ~1/7; seeded by the generator alone."""
    y, memory_labels = torch.tensor([0, 1, 2, 0, 3]), torch.tensor([0, 2, 2, 1, 0, 3])
    candidates = [1, 2, 4, 6, 7, 8, 10]
    z, memory = torch.randn(5, 4, generator=gen(0)), torch.randn(6, 4, generator=gen(1))
    g = gen(123)
    draws = 1400
    counts = torch.zeros(11)
    for _ in range(draws):
        counts[
            ct.mine_hard_pairs(z, y, 4, generator=g, memory=memory, memory_labels=memory_labels).random_negative[0]
        ] += 1
    assert counts.sum() == counts[candidates].sum()
    expected = draws / len(candidates)
    chi2 = float(((counts[candidates] - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, counts  # df = 6: P(chi2 > 22.5) = 0.001 under uniformity
    a = ct.mine_hard_pairs(z, y, 4, generator=gen(5), memory=memory, memory_labels=memory_labels)
    torch.manual_seed(9)
    b = ct.mine_hard_pairs(z, y, 4, generator=gen(5), memory=memory, memory_labels=memory_labels)
    assert torch.equal(a.random_negative, b.random_negative)


@pytest.mark.parametrize(("alpha", "lambda_n", "lambda_p"), [(1.0, 0.8, 0.0), (0.5, 0.0, 0.6), (2.0, 1.0, 1.0)])
def test_lambda_draws_are_clipped_beta(alpha: float, lambda_n: float, lambda_p: float) -> None:
    """λ ~ Beta(α, α) clipped from below: the unclipped part has the Beta mean 1/2, the clip mass is right."""
    b = 4000
    y = torch.arange(b) % 2
    pairs = ct.mine_hard_pairs(torch.randn(b, 2, generator=gen(0)), y, 2, alpha, lambda_n, lambda_p, gen(9))
    for lam, clip in ((pairs.lam_pos, lambda_p), (pairs.lam_neg, lambda_n)):
        assert float(lam.min()) >= clip and float(lam.max()) <= 1.0
        clipped_mass = float((np.random.default_rng(0).beta(alpha, alpha, 10**6) <= clip).mean())  # P(λ <= clip)
        assert float((lam == clip).double().mean()) == pytest.approx(clipped_mass, abs=0.03)
        if clip == 0:
            assert float(lam.mean()) == pytest.approx(0.5, abs=0.02)


# ------------------------------------------------------------------------------------------------------------
# Precision, dtypes and errors
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_autocast_does_not_change_the_hardest_choices(dtype: torch.dtype) -> None:
    """Under bf16 or fp16 autocast (bf16-mixed, 16-mixed) the similarities must still be float32: a bf16 matmul
    (8-bit mantissa) turns close similarities into ties and picks other pairs (seen on correlated 2048-d features,
    like an encoder's); an fp16 one (11 bits) too, less often."""
    g = gen(0)
    z = torch.randn(256, 2048, generator=g) + 0.5 * torch.randn(1, 2048, generator=g)
    y = torch.randint(0, 100, (256,), generator=g)
    plain = ct.mine_hard_pairs(z, y, 100, generator=gen(0))
    with torch.autocast("cpu", dtype=dtype):
        auto = ct.mine_hard_pairs(z, y, 100, generator=gen(0))
    assert torch.equal(plain.hardest_positive, auto.hardest_positive)
    assert torch.equal(plain.hardest_negative, auto.hardest_negative)


def test_bf16_features_mix_in_bf16() -> None:
    z = torch.randn(16, 8, generator=gen(0)).bfloat16().requires_grad_(True)
    y = torch.arange(16) % 4
    pairs = ct.mine_hard_pairs(z, y, 4, generator=gen(0))
    assert pairs.pos_features.dtype == pairs.neg_features.dtype == torch.bfloat16
    assert pairs.pos_targets.dtype == torch.float32
    (pairs.pos_features.float().sum() + pairs.neg_features.float().sum()).backward()
    assert torch.isfinite(z.grad.float()).all()


def test_bf16_features_and_soft_targets_share_one_lambda() -> None:
    """bf16 features are mixed with a bf16 λ; y⁺ and y⁻ use that λ, not the float32 draw it was rounded from."""
    z = torch.randn(16, 8, generator=gen(0))
    y = torch.arange(16) % 4
    exact = ct.mine_hard_pairs(z, y, 4, generator=gen(1))
    pairs = ct.mine_hard_pairs(z.bfloat16(), y, 4, generator=gen(1))
    assert not torch.equal(exact.lam_pos, pairs.lam_pos)  # the float32 draws are not bf16 numbers
    torch.testing.assert_close(pairs.lam_pos, exact.lam_pos.bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(pairs.lam_neg, exact.lam_neg.bfloat16().float(), rtol=0, atol=0)
    hp, hn, rn = pairs.hardest_positive, pairs.hardest_negative, pairs.random_negative
    zb, lp, ln = z.bfloat16(), pairs.lam_pos.bfloat16()[:, None], pairs.lam_neg.bfloat16()[:, None]
    assert torch.equal(pairs.pos_features, lp * zb[hp] + (1 - lp) * zb[hn])
    assert torch.equal(pairs.neg_features, (1 - ln) * zb + ln * zb[rn])
    onehot = F.one_hot(y, 4).float()
    lam_p, lam_n = pairs.lam_pos[:, None], pairs.lam_neg[:, None]
    assert torch.equal(pairs.pos_targets, lam_p * onehot[hp] + (1 - lam_p) * onehot[hn])
    assert torch.equal(pairs.neg_targets, (1 - lam_n) * onehot + lam_n * onehot[rn])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lambda_n": 1.5}, r"lambda_n and lambda_p must lie in \[0, 1\]"),
        ({"lambda_p": -0.1}, r"lambda_n and lambda_p must lie in \[0, 1\]"),
        ({"alpha": 0.0}, r"alpha must be > 0"),
        ({"labels": torch.tensor([0, 1, 3])}, r"labels must lie in \[0, 3\)"),
        ({"labels": torch.tensor([0, 1])}, "2 labels for 3 feature rows"),
        ({"features": torch.zeros(3)}, r"features must be \(B, d\)"),
        ({"features": torch.zeros(0, 2), "labels": torch.zeros(0, dtype=torch.long)}, "empty batch"),
        ({"memory": torch.zeros(2, 3), "memory_labels": torch.tensor([0, 1])}, r"memory must be \(M, 2\)"),
        ({"memory": torch.zeros(2, 2)}, r"memory must be \(M, 2\) with its \(M,\) memory_labels"),
        ({"memory": torch.zeros(2, 2), "memory_labels": torch.tensor([0])}, "1 memory_labels for 2 memory rows"),
        ({"memory": torch.zeros(1, 2), "memory_labels": torch.tensor([3])}, r"memory_labels must lie in \[0, 3\)"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, message: str) -> None:
    args = {"features": torch.randn(3, 2), "labels": torch.tensor([0, 1, 2]), "num_classes": 3} | kwargs
    with pytest.raises(ValueError, match=message):
        ct.mine_hard_pairs(**args)


def test_the_miner_component_mines_with_its_clips() -> None:
    """HardPairMiner.mine is mine_hard_pairs with the miner's λ_n and λ_p: the same draws, bit for bit."""
    z, labels = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    memory, memory_labels = torch.randn(3, 4), torch.tensor([2, 0, 1])
    miner = ct.HardPairMiner(lambda_n=0.6, lambda_p=0.3)
    got = miner.mine(z, labels, 3, 0.7, torch.Generator().manual_seed(5), memory, memory_labels)
    want = ct.mine_hard_pairs(z, labels, 3, 0.7, 0.6, 0.3, torch.Generator().manual_seed(5), memory, memory_labels)
    for field in ("hardest_positive", "random_negative", "lam_pos", "lam_neg", "pos_features", "neg_targets"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
