"""BSS (Chen et al., 2019): η Σ_{i≤k} σ_{-i}² of the batch features, against torch.linalg.svdvals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coretune import objectives


@pytest.mark.parametrize(("batch", "dim", "k"), [(8, 16, 1), (8, 16, 3), (20, 16, 2), (4, 16, 10)])
def test_penalty_equals_smallest_squared_singular_values(batch: int, dim: int, k: int) -> None:
    torch.manual_seed(0)
    obj = objectives.create("bss", dim, 3, eta=0.5, k=k)
    z = torch.randn(batch, dim, dtype=torch.float64)
    y = torch.arange(batch) % 3
    out = obj(z.float(), y)
    sigma = sorted(torch.linalg.svdvals(z).tolist())  # ascending
    expected = sum(s**2 for s in sigma[: min(k, len(sigma))])  # all min(B, d) values when k exceeds them
    assert out.terms["bss"].item() == pytest.approx(expected, rel=1e-4)
    ce = F.cross_entropy(obj.classifier(z.float()), y)
    torch.testing.assert_close(out.loss, ce + 0.5 * out.terms["bss"])
    assert set(out.terms) == {"ce", "bss", "loss"}


def test_gradient_shrinks_the_smallest_singular_value() -> None:
    torch.manual_seed(0)
    obj = objectives.create("bss", 6, 2, eta=1.0)
    z = torch.randn(10, 6, requires_grad=True)
    before = torch.linalg.svdvals(z.detach())[-1]
    obj.spectral_penalty(z).backward()
    assert torch.isfinite(z.grad).all()
    after = torch.linalg.svdvals(z.detach() - 0.05 * z.grad)[-1]
    assert after < before


def test_defaults_and_errors() -> None:
    assert objectives.create("bss").hparams() == {"eta": 0.001, "k": 1, "label_smoothing": 0.0}
    with pytest.raises(ValueError, match=r"invalid BSS settings: eta must be >= 0 \(got -1\); k must be >= 1"):
        objectives.create("bss", eta=-1, k=0)
