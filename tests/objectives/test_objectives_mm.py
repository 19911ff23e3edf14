"""M&M (Zhan et al., 2018) baseline: CE + batch-hard triplet loss, against a loop over anchors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coretune import objectives
from coretune.objectives import batch_hard_triplet_loss


def _triplet_loop(z: torch.Tensor, labels: list[int], margin: float) -> float:
    v = F.normalize(z.double(), dim=1)
    losses = []
    for i, yi in enumerate(labels):
        pos = [torch.dist(v[i], v[j]).item() for j, yj in enumerate(labels) if j != i and yj == yi]
        neg = [torch.dist(v[i], v[k]).item() for k, yk in enumerate(labels) if yk != yi]
        if pos and neg:
            losses.append(max(0.0, max(pos) - min(neg) + margin))
    return sum(losses) / len(losses) if losses else 0.0


@pytest.mark.parametrize("margin", [0.3, 1.0])
def test_triplet_equals_loop(margin: float) -> None:
    torch.manual_seed(0)
    z = torch.randn(9, 6)
    labels = [0, 0, 1, 1, 1, 2, 0, 1, 3]  # class 3: no positive, skipped as an anchor (still a negative)
    got = batch_hard_triplet_loss(z, torch.tensor(labels), margin)
    assert got.item() == pytest.approx(_triplet_loop(z, labels, margin), rel=1e-5, abs=1e-6)


def test_objective_adds_weighted_triplet_to_cross_entropy() -> None:
    torch.manual_seed(0)
    obj = objectives.create("mm", 6, 3, triplet_weight=0.5)
    z, y = torch.randn(8, 6), torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    out = obj(z, y)
    torch.testing.assert_close(out.terms["triplet"], batch_hard_triplet_loss(z, y, 0.3))
    torch.testing.assert_close(out.loss, F.cross_entropy(obj.classifier(z), y) + 0.5 * out.terms["triplet"])
    assert set(out.terms) == {"ce", "triplet", "loss"}


def test_no_valid_anchor_gives_zero_and_finite_gradients() -> None:
    z = torch.randn(4, 6, requires_grad=True)
    loss = batch_hard_triplet_loss(z, torch.zeros(4, dtype=torch.long))  # no negatives at all
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))


def test_duplicate_features_keep_gradients_finite() -> None:
    base = torch.randn(1, 6)
    z = torch.cat([base, base, torch.randn(2, 6)]).requires_grad_()
    loss = batch_hard_triplet_loss(z, torch.tensor([0, 0, 1, 1]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"invalid M&M settings: margin must be >= 0 \(got -0.1\)"):
        objectives.create("mm", margin=-0.1)
