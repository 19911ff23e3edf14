"""Property-based fuzzing of the Core-tuning losses, the hard-pair mining and the objectives' forward pass.

Random batch sizes (1–64), class counts (1–20), widths, label patterns (one class, all distinct, duplicates,
classes absent), feature magnitudes from 1e-6 to 1e4 (zero and identical rows included), float32 and bfloat16
(inputs in bf16, and the objective under CPU bf16 autocast): the loss and every gradient are always finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coretune import objectives
from coretune.losses import contrastive_loss, core_positive_mask, soft_cross_entropy, supcon_positive_mask
from coretune.mining import mine_hard_pairs

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LABELS = ("random", "one class", "distinct", "two of many")
ROWS = ("gaussian", "with zero rows", "identical rows")


@dataclass
class Batch:
    features: torch.Tensor  # (B, d) float32, requires grad
    labels: torch.Tensor  # (B,)
    num_classes: int
    dtype: torch.dtype

    def inputs(self) -> torch.Tensor:
        """The features in the case's dtype (a graph node, so gradients reach ``features``)."""
        return self.features.to(self.dtype)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    b, k, d = draw(st.integers(1, 64)), draw(st.integers(1, 20)), draw(st.integers(1, 48))
    magnitude = draw(st.sampled_from([1e-6, 1e-3, 1.0, 1e2, 1e4]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pattern, rows = draw(st.sampled_from(LABELS)), draw(st.sampled_from(ROWS))
    if pattern == "one class":
        labels = torch.full((b,), int(torch.randint(k, (), generator=g)))
    elif pattern == "distinct":
        labels = torch.randperm(max(k, b), generator=g)[:b] % k
    elif pattern == "two of many":  # most classes absent from the batch
        labels = torch.randint(min(k, 2), (b,), generator=g)
    else:
        labels = torch.randint(k, (b,), generator=g)
    z = torch.randn(b, d, generator=g) * magnitude
    if rows == "with zero rows":
        z[torch.rand(b, generator=g) < 0.3] = 0.0
    elif rows == "identical rows":
        z = z[:1].expand(b, d).clone()
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return Batch(z.requires_grad_(), labels, k, dtype)


def assert_finite_with_grads(loss: torch.Tensor, *leaves: torch.Tensor) -> None:
    assert loss.dim() == 0 and torch.isfinite(loss), loss
    loss.backward()
    for leaf in leaves:
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


@FUZZ
@given(
    batch=batches(),
    temperature=st.sampled_from([0.01, 0.07, 0.5, 1.0]),
    focal=st.booleans(),
    layout=st.sampled_from(["supcon", "core"]),
)
def test_contrastive_loss_is_finite(batch: Batch, temperature: float, focal: bool, layout: str) -> None:
    v = batch.inputs()
    if layout == "core":  # [originals; hard positives; hard negatives] as Core-tuning lays them out
        v, mask = torch.cat([v, v.flip(0), -v]), core_positive_mask(batch.labels)
    else:
        mask = supcon_positive_mask(batch.labels)
    loss = contrastive_loss(F.normalize(v, dim=1), mask, temperature, focal=focal)
    assert loss >= 0
    assert_finite_with_grads(loss, batch.features)


@FUZZ
@given(
    batch=batches(),
    alpha=st.sampled_from([0.1, 1.0, 5.0]),
    lambda_n=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
    lambda_p=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_mining_is_finite(batch: Batch, alpha: float, lambda_n: float, lambda_p: float) -> None:
    pairs = mine_hard_pairs(batch.inputs(), batch.labels, batch.num_classes, alpha, lambda_n, lambda_p)
    for name in ("lam_pos", "lam_neg", "pos_features", "neg_features", "pos_targets", "neg_targets"):
        assert torch.isfinite(getattr(pairs, name).float()).all(), name
    assert torch.allclose(pairs.pos_targets.sum(1), torch.ones(len(batch.labels)))
    assert torch.allclose(pairs.neg_targets.sum(1), torch.ones(len(batch.labels)))
    logits = torch.cat([pairs.pos_features, pairs.neg_features]).float() @ torch.ones(batch.features.shape[1], 1)
    loss = soft_cross_entropy(torch.cat([logits, -logits], 1), torch.full((2 * len(batch.labels), 2), 0.5))
    assert_finite_with_grads(loss, batch.features)


@FUZZ
@given(batch=batches(), name=st.sampled_from(["core", "ce_con", "ce_mix", "ce_con_mixh"]))
def test_core_tuning_forward_is_finite(batch: Batch, name: str) -> None:
    torch.manual_seed(0)
    objective = objectives.create(name, batch.features.shape[1], batch.num_classes)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=batch.dtype == torch.bfloat16):
        out = objective(batch.features, batch.labels)
    assert out.logits.shape == (len(batch.labels), batch.num_classes)
    assert all(torch.isfinite(v) for v in out.terms.values()), out.terms
    assert_finite_with_grads(out.loss, batch.features, *objective.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_logits_keep_the_soft_cross_entropy_finite(dtype: torch.dtype) -> None:
    logits = torch.tensor([[1e6, -1e6, 0.0], [1e4, 1e4, -1e4]]).to(dtype).requires_grad_()
    targets = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.0, 0.5]])
    assert_finite_with_grads(soft_cross_entropy(logits, targets), logits)
