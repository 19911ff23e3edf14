"""Hardness-directed mixup: hard positive and hard negative pair generation (paper §4.1, Algorithm 1).

Index choices carry no gradient; the mixing is differentiable in the features. Every random draw comes from
``generator`` when one is given (else from torch's global RNG, so ``torch.manual_seed`` controls it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["HardPairMiner", "HardPairs", "beta_draws", "mine_hard_pairs", "mine_hard_positives", "representable"]


@dataclass
class HardPairs:
    """The hard pairs generated for a batch of ``B`` anchors with ``K`` classes.

    Indices point into the pool ``[batch (B); memory (M)]``: ``j >= B`` is row ``j - B`` of the memory.

    Attributes:
        hardest_positive: ``(B,)`` index of the least similar same-class sample (``i`` if none).
        hardest_negative: ``(B,)`` index of the most similar other-class sample (``i`` if none).
        random_negative: ``(B,)`` index of a uniformly drawn other-class sample (``i`` if none).
        lam_pos: ``(B,)`` mixing weight of the hardest positive in ``z⁺``.
        lam_neg: ``(B,)`` mixing weight of the random negative in ``z⁻``.
        pos_features: ``(B, d)`` generated hard positives ``z⁺``.
        neg_features: ``(B, d)`` generated hard negatives ``z⁻``.
        pos_targets: ``(B, K)`` soft labels ``y⁺``.
        neg_targets: ``(B, K)`` soft labels ``y⁻``.
    """

    hardest_positive: Tensor
    hardest_negative: Tensor
    random_negative: Tensor
    lam_pos: Tensor
    lam_neg: Tensor
    pos_features: Tensor
    neg_features: Tensor
    pos_targets: Tensor
    neg_targets: Tensor


@dataclass(frozen=True)
class HardPairMiner:
    """Hardness-directed mixup (paper §4.1), the component of Core-tuning that generates a hard positive ``z⁺`` and
    a hard negative ``z⁻`` per anchor (:meth:`mine`, :func:`mine_hard_pairs`; for dense prediction
    :func:`mine_hard_positives`), and how its contrast uses them. Its mixup weights' Beta concentration ``α`` is
    the objective's (``alpha``, shared with manifold mixup and tuned with ``eta``).

    Args:
        lambda_n: lower clip ``λ_n ∈ [0, 1]`` of the random negative's weight in ``z⁻``.
        lambda_p: lower clip ``λ_p ∈ [0, 1]`` of the hardest positive's weight in ``z⁺``.
        original_positives: the batch's samples of the anchor's class are positives too (False: only ``z⁺``).
        generated_pairs: ``all``: every generated row of the batch is in each anchor's contrast set ``A_i``, as the
            authors' code does; ``own``: only the anchor's own ``z⁺`` and ``z⁻`` (Algorithm 1 read literally).
    """

    lambda_n: float = 0.8
    lambda_p: float = 0.0
    original_positives: bool = True
    generated_pairs: Literal["all", "own"] = "all"

    def __post_init__(self) -> None:
        problems = [
            f"{name} must lie in [0, 1] (got {value})"
            for name, value in (("lambda_n", self.lambda_n), ("lambda_p", self.lambda_p))
            if not 0.0 <= value <= 1.0
        ]
        if self.generated_pairs not in ("all", "own"):
            problems.append(f"generated_pairs must be 'all' or 'own' (got {self.generated_pairs!r})")
        if problems:
            raise ValueError("invalid hard-pair miner settings: " + "; ".join(problems))

    def mine(
        self,
        features: Tensor,
        labels: Tensor,
        num_classes: int,
        alpha: float,
        generator: torch.Generator | None = None,
        memory: Tensor | None = None,
        memory_labels: Tensor | None = None,
        domains: Tensor | None = None,
    ) -> HardPairs:
        """:func:`mine_hard_pairs` of the batch with this miner's clips (the same arguments otherwise)."""
        return mine_hard_pairs(
            features,
            labels,
            num_classes,
            alpha,
            self.lambda_n,
            self.lambda_p,
            generator,
            memory,
            memory_labels,
            domains,
        )


def beta_draws(
    n: int, alpha: float, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> Tensor:
    """``n`` draws of ``Beta(alpha, alpha)`` (mixup, Zhang et al. 2018), seeded from ``generator``.

    torch's Beta sampler takes no generator, so a 63-bit seed is drawn from ``generator`` (or torch's global RNG)
    and NumPy's exact Beta sampler uses it: the draws are reproducible under either seeding.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0 for Beta(alpha, alpha), got {alpha}")
    seed_device = generator.device if generator is not None else "cpu"
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=seed_device))
    draws = np.random.default_rng(seed).beta(alpha, alpha, size=n)
    return torch.from_numpy(draws).to(device=device, dtype=torch.float32)


def representable(lam: Tensor, dtype: torch.dtype) -> Tensor:
    """Mixing weights ``λ`` rounded to ``dtype`` (the features' dtype) and returned as float32.

    Under bf16 autocast the features are mixed with the bf16 ``λ`` (8-bit mantissa, up to 0.4% off); the soft
    targets ``λ y_a + (1 - λ) y_b`` (§4.1, and mixup) must use that same ``λ``, so both sides take the rounded value.
    """
    return lam.to(dtype).float()


@torch.no_grad()
def _pair_indices(
    features: Tensor,
    labels: Tensor,
    memory: Tensor | None,
    pool_labels: Tensor,
    generator: torch.Generator | None,
    domains: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Hardest positive, hardest negative and random negative of the ``B`` anchors among the pool
    ``[features; memory]`` (labels ``pool_labels``): ``B × (B + M)`` similarities at once; with ``domains`` (no
    memory) positives are mined within the anchor's domain."""
    b = labels.numel()
    with torch.autocast(device_type=features.device.type, enabled=False):  # bf16 similarities would tie
        dtype = torch.float64 if features.dtype == torch.float64 else torch.float32
        z = F.normalize(features.detach().to(dtype), dim=1)
        # GEMM rounding differs between output columns, so duplicated rows are given one shared column:
        # exact ties then stay ties and resolve to the lowest index.
        unique, inverse = torch.unique(z, dim=0, return_inverse=True)
        sim = (z @ unique.T)[:, inverse]
        if memory is not None:
            # One GEMM against the raw memory scaled by its inverse norms: no normalised copy of its M rows, and
            # no torch.unique over them (it would cost more than the GEMM); a memory row that exactly duplicates
            # another candidate may lose the tie to the higher index.
            m = memory.to(dtype)
            norms = torch.linalg.vector_norm(m, dim=1).clamp(min=1e-12)
            sim = torch.cat([sim, (z @ m.T) / norms], dim=1)
    same = labels[:, None] == pool_labels[None, :]
    eye = torch.eye(b, pool_labels.numel(), dtype=torch.bool, device=labels.device)
    anchor = torch.arange(b, device=labels.device)
    pos_cand = same & ~eye
    if domains is not None:
        pos_cand &= domains[:, None] == domains[None, :]
    neg_cand = ~same
    # torch.argmin / argmax return the first (lowest) index among ties.
    hardest_pos = sim.masked_fill(~pos_cand, float("inf")).argmin(dim=1)
    hardest_pos = torch.where(pos_cand.any(dim=1), hardest_pos, anchor)
    hardest_neg = sim.masked_fill(~neg_cand, float("-inf")).argmax(dim=1)
    has_neg = neg_cand.any(dim=1)
    hardest_neg = torch.where(has_neg, hardest_neg, anchor)
    # Uniform over the other classes' samples; rows without any fall back to the anchor itself.
    candidates = torch.where(has_neg[:, None], neg_cand, eye)
    draw_device = generator.device if generator is not None else candidates.device
    if memory is None:
        weights = candidates.float().to(draw_device)
        random_neg = torch.multinomial(weights, 1, generator=generator).squeeze(1).to(labels.device)
    else:
        # torch.multinomial races one exponential draw per candidate, B × (B + M) of them; one uniform draw per
        # anchor picks from the same distribution: the ⌊u·c_i⌋-th of its c_i candidates.
        cumulative = candidates.long().cumsum(dim=1)
        u = torch.rand(b, generator=generator, device=draw_device, dtype=torch.float64).to(labels.device)
        rank = (u * cumulative[:, -1]).long().clamp(max=cumulative[:, -1] - 1)
        random_neg = torch.searchsorted(cumulative, (rank + 1)[:, None]).squeeze(1)
    return hardest_pos, hardest_neg, random_neg


def _pool_rows(features: Tensor, memory: Tensor | None, index: Tensor) -> Tensor:
    """Rows ``index`` of ``[features; memory]`` without concatenating the two (memory rows: constants)."""
    if memory is None:
        return features[index]
    b = features.shape[0]
    batch_rows = features[index.clamp(max=b - 1)]
    memory_rows = memory[(index - b).clamp(min=0)].to(features.dtype)
    return torch.where((index < b)[:, None], batch_rows, memory_rows)


def mine_hard_pairs(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    alpha: float = 1.0,
    lambda_n: float = 0.8,
    lambda_p: float = 0.0,
    generator: torch.Generator | None = None,
    memory: Tensor | None = None,
    memory_labels: Tensor | None = None,
    domains: Tensor | None = None,
) -> HardPairs:
    """Generate a hard positive and a hard negative for every anchor (paper §4.1, Appendix E thresholds).

    With ``s_ij`` the cosine similarity of ``z_i`` and ``z_j`` and ``e(k)`` the one-hot of class ``k``:

    - hardest positive ``hp(i) = argmin_{j != i, y_j = y_i} s_ij``; hardest negative
      ``hn(i) = argmax_{y_j != y_i} s_ij`` (ties: lowest index; no candidate: ``i``);
    - hard positive: ``λ ~ Beta(α, α)``, ``λ ← max(λ, λ_p)``, ``z⁺ = λ z_hp + (1-λ) z_hn`` and
      ``y⁺ = λ e(y_hp) + (1-λ) e(y_hn)``;
    - hard negative: ``n(i)`` uniform among other-class samples (``i`` if none), ``λ' ~ Beta(α, α)``,
      ``λ' ← max(λ', λ_n)``, ``z⁻ = (1-λ') z_i + λ' z_n`` and ``y⁻ = (1-λ') e(y_i) + λ' e(y_n)``.

    The candidates ``j`` are the batch's rows, or with a ``memory`` (a cross-batch feature memory,
    :class:`coretune.memory.FeatureMemory`) the pool ``[batch; memory]``: the returned indices point into it, and
    a memory row mixed into ``z⁺`` or ``z⁻`` is a constant (the gradient reaches the batch's rows only). Exact
    duplicates inside the batch tie and resolve to the lowest index; a memory row that duplicates another
    candidate bit for bit may win the tie instead (equally hard, same features). No memory, or an empty one,
    gives exactly the in-batch pairs of Algorithm 1.

    Args:
        features: ``(B, d)`` encoder outputs ``z`` (any float dtype; mixing keeps it).
        labels: ``(B,)`` integer class labels in ``[0, num_classes)``.
        num_classes: ``K``, the width of the soft labels.
        alpha: Beta concentration ``α > 0``.
        lambda_n: lower clip ``λ_n ∈ [0, 1]`` of the negative's weight in ``z⁻``.
        lambda_p: lower clip ``λ_p ∈ [0, 1]`` of the hardest positive's weight in ``z⁺``.
        generator: source of every random draw.
        memory: ``(M, d)`` further candidate features (detached), or ``None``.
        memory_labels: ``(M,)`` their labels, in ``[0, num_classes)``.
        domains: ``(B,)`` domain labels: the hardest positive is then mined among the anchor's class *and domain*
            (``same_domain_positives`` of :class:`coretune.objectives.CoreTuning`); not with a memory.
    """
    if features.dim() != 2:
        raise ValueError(f"features must be (B, d), got shape {tuple(features.shape)}")
    labels = labels.reshape(-1).long()
    if labels.numel() != features.shape[0]:
        raise ValueError(f"{labels.numel()} labels for {features.shape[0]} feature rows")
    if labels.numel() == 0:
        raise ValueError("features is an empty batch (0 rows): hard pairs need at least one anchor")
    if not (0.0 <= lambda_n <= 1.0 and 0.0 <= lambda_p <= 1.0):
        raise ValueError(f"lambda_n and lambda_p must lie in [0, 1], got {lambda_n} and {lambda_p}")
    if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]")
    pool_labels = labels
    if memory is not None and memory.shape[0] == 0:
        memory = None
    if memory is not None:
        if memory_labels is None or memory.dim() != 2 or memory.shape[1] != features.shape[1]:
            raise ValueError(
                f"memory must be (M, {features.shape[1]}) with its (M,) memory_labels, got shape {tuple(memory.shape)}"
            )
        memory_labels = memory_labels.reshape(-1).to(labels.device, torch.long)
        if memory_labels.numel() != memory.shape[0]:
            raise ValueError(f"{memory_labels.numel()} memory_labels for {memory.shape[0]} memory rows")
        if int(memory_labels.min()) < 0 or int(memory_labels.max()) >= num_classes:
            raise ValueError(f"memory_labels must lie in [0, {num_classes})")
        memory = memory.detach().to(features.device)
        pool_labels = torch.cat([labels, memory_labels])

    if domains is not None:
        if memory is not None:
            raise ValueError("domains restrict the in-batch positives: mine without a memory")
        domains = domains.reshape(-1).to(labels.device)
        if domains.numel() != labels.numel():
            raise ValueError(f"{domains.numel()} domain labels for {labels.numel()} feature rows")
    b = labels.numel()
    hp, hn, rn = _pair_indices(features, labels, memory, pool_labels, generator, domains)
    lam = beta_draws(2 * b, alpha, generator, features.device)
    lam_pos = representable(lam[:b].clamp(min=lambda_p), features.dtype)
    lam_neg = representable(lam[b:].clamp(min=lambda_n), features.dtype)

    lp = lam_pos.to(features.dtype)[:, None]
    ln = lam_neg.to(features.dtype)[:, None]
    pos_features = lp * _pool_rows(features, memory, hp) + (1 - lp) * _pool_rows(features, memory, hn)
    neg_features = (1 - ln) * features + ln * _pool_rows(features, memory, rn)

    onehot = F.one_hot(pool_labels, num_classes).float()
    pos_targets = lam_pos[:, None] * onehot[hp] + (1 - lam_pos[:, None]) * onehot[hn]
    neg_targets = (1 - lam_neg[:, None]) * onehot[:b] + lam_neg[:, None] * onehot[rn]
    return HardPairs(hp, hn, rn, lam_pos, lam_neg, pos_features, neg_features, pos_targets, neg_targets)


def mine_hard_positives(
    features: Tensor,
    pos_mask: Tensor,
    alpha: float = 1.0,
    lambda_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Hard positives ``z⁺`` of every anchor from a positive mask instead of labels (dense prediction: positives of
    image-level labels that may be multi-label, and crops without a label).

    With ``s_ij`` the cosine similarity, ``P_i = {j : pos_mask[i, j]}`` and ``N_i = {j ≠ i : j ∉ P_i}``: the
    hardest positive ``hp(i) = argmin_{j ∈ P_i} s_ij`` and hardest negative ``hn(i) = argmax_{j ∈ N_i} s_ij``
    (ties: lowest index; ``i`` when the set is empty), ``λ ~ Beta(α, α)``, ``λ ← max(λ, λ_p)`` and
    ``z⁺ = λ z_hp + (1-λ) z_hn``: :func:`mine_hard_pairs`'s hard positive, whose positives are ``y_j = y_i``.
    No hard negative and no soft label are made (for dense prediction the mixed features train no classifier).

    Args:
        features: ``(B, d)`` features ``z``.
        pos_mask: ``(B, B)`` bool positives (the diagonal is ignored).
        alpha: Beta concentration ``α > 0``.
        lambda_p: lower clip ``λ_p ∈ [0, 1]`` of the hardest positive's weight.
        generator: source of the random draws.

    Returns:
        ``(B, d)`` generated hard positives, differentiable in ``features``.
    """
    b = features.shape[0]
    if features.dim() != 2 or pos_mask.shape != (b, b):
        raise ValueError(
            f"features must be (B, d) and pos_mask (B, B), got shapes {tuple(features.shape)} and "
            f"{tuple(pos_mask.shape)}"
        )
    with torch.no_grad(), torch.autocast(device_type=features.device.type, enabled=False):
        z = F.normalize(features.detach().float(), dim=1)
        sim = z @ z.T
        eye = torch.eye(b, dtype=torch.bool, device=features.device)
        pos = pos_mask.to(torch.bool) & ~eye
        neg = ~pos & ~eye
        anchor = torch.arange(b, device=features.device)
        hardest_pos = torch.where(pos.any(1), sim.masked_fill(~pos, float("inf")).argmin(1), anchor)
        hardest_neg = torch.where(neg.any(1), sim.masked_fill(~neg, float("-inf")).argmax(1), anchor)
    lam = representable(beta_draws(b, alpha, generator, features.device).clamp(min=lambda_p), features.dtype)
    lp = lam.to(features.dtype)[:, None]
    return lp * features[hardest_pos] + (1 - lp) * features[hardest_neg]
