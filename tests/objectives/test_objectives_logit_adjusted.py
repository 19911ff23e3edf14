"""Logit adjustment (Menon et al., ICLR 2021): the loss against slow loops of the paper's eq. 10 and its margin form
(eq. 11), the priors counted from an imbalanced toy set, evaluation on the plain logits, checkpoints and errors."""

from __future__ import annotations

import math

import pytest
import torch

from coretune import objectives
from coretune.objectives import LogitAdjusted


def eq10_loop(logits: torch.Tensor, labels: torch.Tensor, priors: list[float], tau: float) -> float:
    """Mean over the batch of −log(e^{f_y + τ log π_y} / Σ_y' e^{f_y' + τ log π_y'}), one scalar at a time."""
    total = 0.0
    for row, y in zip(logits.tolist(), labels.tolist(), strict=True):
        shifted = [f + tau * math.log(p) for f, p in zip(row, priors, strict=True)]
        total += -(shifted[y] - math.log(sum(math.exp(s) for s in shifted)))
    return total / len(labels)


def eq11_loop(logits: torch.Tensor, labels: torch.Tensor, priors: list[float], tau: float) -> float:
    """The margin form: log[1 + Σ_{y' ≠ y} (π_y' / π_y)^τ · e^{f_y' − f_y}]."""
    total = 0.0
    for row, y in zip(logits.tolist(), labels.tolist(), strict=True):
        others = sum((priors[k] / priors[y]) ** tau * math.exp(row[k] - row[y]) for k in range(len(row)) if k != y)
        total += math.log1p(others)
    return total / len(labels)


@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0, 2.0])
def test_loss_is_the_papers_equation_with_priors_from_an_imbalanced_set(tau: float) -> None:
    torch.manual_seed(0)
    toy_labels = torch.tensor([0] * 60 + [1] * 25 + [2] * 10 + [3] * 5)  # an imbalanced training set: π = .6 .25 .1 .05
    counts = torch.bincount(toy_labels, minlength=4)
    obj = objectives.create("logit_adjusted", feature_dim=8, num_classes=4, tau=tau)
    obj.observe_class_counts(counts)
    priors = [0.6, 0.25, 0.1, 0.05]
    assert obj.log_prior.tolist() == pytest.approx([math.log(p) for p in priors])
    features, labels = torch.randn(12, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3] * 3)
    obj.double()
    out = obj(features, labels)
    logits = obj.classifier(features)
    assert out.loss.item() == pytest.approx(eq10_loop(logits, labels, priors, tau), rel=1e-6)
    assert out.loss.item() == pytest.approx(eq11_loop(logits, labels, priors, tau), rel=1e-6)
    assert torch.equal(out.logits, logits)  # training metrics and evaluation read the plain logits
    assert torch.equal(obj.predict(features), logits)
    if tau == 0:  # no adjustment: plain cross-entropy
        assert out.loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)


def test_balanced_softmax_at_tau_one_weights_the_softmax_by_the_class_counts() -> None:
    # Ren et al. 2020: p̂_y = n_y e^{f_y} / Σ_k n_k e^{f_k}
    obj = LogitAdjusted(num_classes=3, feature_dim=4).double()
    counts = torch.tensor([30, 9, 1])
    obj.observe_class_counts(counts)
    features, labels = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 2, 1])
    logits = obj.classifier(features)
    weighted = counts * logits.exp()
    expected = -(weighted[torch.arange(5), labels] / weighted.sum(1)).log().mean()
    assert obj(features, labels).loss.item() == pytest.approx(expected.item(), rel=1e-6)  # float32 CE


def test_priors_are_kept_in_the_state_dict_and_a_lazy_objective_takes_them_at_build() -> None:
    obj = LogitAdjusted(num_classes=3, feature_dim=4)
    obj.observe_class_counts(torch.tensor([6, 3, 1]))
    copy = LogitAdjusted(num_classes=3, feature_dim=4)
    copy.load_state_dict(obj.state_dict())
    features, labels = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    assert copy(features, labels).loss.item() == pytest.approx(obj(features, labels).loss.item())
    lazy = LogitAdjusted(num_classes=3)
    lazy.observe_class_counts(torch.tensor([6, 3, 1]))
    lazy.predict(torch.randn(2, 4))
    assert torch.equal(lazy.log_prior, obj.log_prior)


def test_bad_settings_and_missing_priors_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"^invalid logit adjustment settings: tau must be >= 0 \(got -1"):
        LogitAdjusted(tau=-1)
    obj = LogitAdjusted(num_classes=3, feature_dim=4)
    with pytest.raises(RuntimeError, match=r"^logit adjustment has no class priors: call objective\.observe_class"):
        obj(torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"^logit adjustment got 2 class counts for 3 classes"):
        obj.observe_class_counts(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"^logit adjustment needs training images of every class: class 1 has none"):
        obj.observe_class_counts(torch.tensor([4, 0, 2]))
    assert LogitAdjusted.search_space == {"tau": (0.5, 1.0, 2.0)} and LogitAdjusted.needs_class_counts
