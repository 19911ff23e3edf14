"""Manifold mixup (Verma et al., 2019) of encoder features: the formula, with a fixed generator."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coretune import objectives
from coretune.mining import beta_draws


def test_mixing_and_loss_follow_the_formula() -> None:
    torch.manual_seed(0)
    obj = objectives.create("manifold_mixup", 8, 3)
    obj.generator = torch.Generator().manual_seed(7)
    z, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    out = obj(z, y)

    g = torch.Generator().manual_seed(7)  # the same draws, in the same order
    perm = torch.randperm(6, generator=g)
    lam = beta_draws(1, 2.0, g)[0]
    mixed = lam * z + (1 - lam) * z[perm]
    onehot = F.one_hot(y, 3).float()
    targets = lam * onehot + (1 - lam) * onehot[perm]
    expected = -(targets * F.log_softmax(obj.classifier(mixed), dim=1)).sum(1).mean()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.logits, obj.classifier(z))
    assert set(out.terms) == {"ce_mix", "loss"}


def test_one_lambda_per_batch_and_soft_targets_sum_to_one() -> None:
    torch.manual_seed(0)
    obj = objectives.create("manifold_mixup", 4, 5)
    obj.generator = torch.Generator().manual_seed(1)
    z, y = torch.randn(10, 4), torch.arange(10) % 5
    mixed, targets, perm, lam = obj.mix(z, y)
    assert lam.dim() == 0 and 0 < lam.item() < 1
    torch.testing.assert_close(mixed, lam * z + (1 - lam) * z[perm])
    torch.testing.assert_close(targets.sum(1), torch.ones(10))
    assert sorted(perm.tolist()) == list(range(10))


def test_bf16_targets_use_the_mixing_lambda() -> None:
    obj = objectives.create("manifold_mixup", 4, 5)
    obj.generator = torch.Generator().manual_seed(2)
    z, y = torch.randn(10, 4).bfloat16(), torch.arange(10) % 5
    mixed, targets, perm, lam = obj.mix(z, y)
    assert torch.equal(lam.bfloat16().float(), lam)
    lam_b = lam.bfloat16()
    assert torch.equal(mixed, lam_b * z + (1 - lam_b) * z[perm])
    onehot = F.one_hot(y, 5).float()
    assert torch.equal(targets, lam * onehot + (1 - lam) * onehot[perm])


def test_seeded_runs_are_reproducible_and_differ_across_seeds() -> None:
    obj = objectives.create("manifold_mixup", 4, 2)
    z, y = torch.randn(8, 4), torch.arange(8) % 2
    losses = []
    for seed in (3, 3, 4):
        obj.generator = torch.Generator().manual_seed(seed)
        losses.append(obj(z, y).loss.item())
    assert losses[0] == losses[1] != losses[2]


def test_defaults_and_errors() -> None:
    assert objectives.create("manifold_mixup").hparams() == {"alpha": 2.0, "label_smoothing": 0.0}
    with pytest.raises(ValueError, match=r"invalid manifold mixup settings: alpha must be > 0 \(got 0\)"):
        objectives.create("manifold_mixup", alpha=0)
