"""SCL (Gunel et al., 2021): (1−λ)·CE + λ·SupCon on L2-normalised features, against a per-anchor loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from coretune import objectives


def _supcon_loop(z: torch.Tensor, labels: list[int], tau: float) -> float:
    phi = F.normalize(z.double(), dim=1).tolist()
    n = len(labels)

    def sim(i: int, j: int) -> float:
        return sum(a * b for a, b in zip(phi[i], phi[j], strict=True)) / tau

    per_anchor = []
    for i in range(n):
        positives = [j for j in range(n) if j != i and labels[j] == labels[i]]
        if not positives:
            continue  # anchors without a positive are skipped
        log_denominator = math.log(sum(math.exp(sim(i, k)) for k in range(n) if k != i))
        per_anchor.append(-sum(sim(i, j) - log_denominator for j in positives) / len(positives))
    return sum(per_anchor) / len(per_anchor)


@pytest.mark.parametrize(("lam", "tau"), [(0.9, 0.3), (0.5, 0.1)])
def test_loss_equals_per_anchor_supcon_loop(lam: float, tau: float) -> None:
    torch.manual_seed(0)
    obj = objectives.create("scl", 8, 4, lam=lam, temperature=tau)
    z = torch.randn(10, 8)
    labels = [0, 0, 1, 1, 1, 2, 2, 3, 0, 2]  # class 3 has a single sample
    y = torch.tensor(labels)
    out = obj(z, y)
    assert out.terms["scl"].item() == pytest.approx(_supcon_loop(z, labels, tau), rel=1e-5)
    ce = F.cross_entropy(obj.classifier(z), y)
    torch.testing.assert_close(out.loss, (1 - lam) * ce + lam * out.terms["scl"])
    assert set(out.terms) == {"ce", "scl", "loss"}


def test_contrast_ignores_feature_scale() -> None:
    torch.manual_seed(0)
    obj = objectives.create("scl", 8, 2)
    z, y = torch.randn(6, 8), torch.tensor([0, 0, 0, 1, 1, 1])
    torch.testing.assert_close(obj(z, y).terms["scl"], obj(3 * z, y).terms["scl"])


def test_defaults_and_errors() -> None:
    assert objectives.create("scl").hparams() == {
        "lam": 0.9,
        "temperature": 0.3,
        "gather": True,
        "label_smoothing": 0.0,
    }
    with pytest.raises(ValueError, match=r"lam must lie in \[0, 1\] \(got 1.5\); temperature must be > 0"):
        objectives.create("scl", lam=1.5, temperature=0)
