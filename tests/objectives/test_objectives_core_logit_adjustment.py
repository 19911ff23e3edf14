"""Core-tuning with logit adjustment (``logit_adjustment=τ``): both cross-entropies read ``logits + τ log π``
(Menon et al., ICLR 2021, eq. 10; for a generated row of soft target ``t``, ``−Σ_k t_k log softmax(f + τ log π)_k``),
checked against slow loops of those equations and against the identity that shifting the logits equals shifting the
classifier's bias; the contrastive term and the evaluated logits are unchanged; priors in checkpoints; errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from coretune import objectives
from coretune.objectives import CoreTuning

PRIORS = [0.6, 0.25, 0.1, 0.05]
COUNTS = torch.tensor([60, 25, 10, 5])


def hard_ce_loop(logits: Tensor, labels: Tensor, tau: float) -> float:
    """Mean over rows of −log(e^{f_y + τ log π_y} / Σ_k e^{f_k + τ log π_k}), one scalar at a time."""
    total = 0.0
    for row, y in zip(logits.tolist(), labels.tolist(), strict=True):
        shifted = [f + tau * math.log(p) for f, p in zip(row, PRIORS, strict=True)]
        total += -(shifted[y] - math.log(sum(math.exp(s) for s in shifted)))
    return total / len(labels)


def soft_ce_loop(logits: Tensor, targets: Tensor, tau: float) -> float:
    """Mean over rows of −Σ_k t_k log softmax(f + τ log π)_k."""
    total = 0.0
    for row, target in zip(logits.tolist(), targets.tolist(), strict=True):
        shifted = [f + tau * math.log(p) for f, p in zip(row, PRIORS, strict=True)]
        log_z = math.log(sum(math.exp(s) for s in shifted))
        total += -sum(t * (s - log_z) for t, s in zip(target, shifted, strict=True))
    return total / len(logits)


@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0, 2.0])
def test_ce_mix_loss_is_the_adjusted_hard_and_soft_cross_entropies(tau: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``ce_mix`` preset (manifold mixup, η = 0): its loss is the two adjusted cross-entropies of the loops, with
    the mixed rows fixed (the mixing itself is tested in test_objectives_core.py)."""
    torch.manual_seed(0)
    obj = objectives.create("ce_mix", feature_dim=8, num_classes=4, logit_adjustment=tau).double()
    obj.observe_class_counts(COUNTS)
    features, labels = torch.randn(6, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 1])
    mixed, targets = torch.randn(6, 8, dtype=torch.float64), torch.softmax(torch.randn(6, 4), 1).double()
    monkeypatch.setattr(obj, "_manifold_mix", lambda z, y: (mixed, targets))
    out = obj(features, labels)
    logits, mixed_logits = obj.classifier(features), obj.classifier(mixed)
    assert out.terms["ce"].item() == pytest.approx(hard_ce_loop(logits, labels, tau), rel=1e-6)
    assert out.terms["ce_mix"].item() == pytest.approx(soft_ce_loop(mixed_logits, targets, tau), rel=1e-6)
    assert out.loss.item() == pytest.approx(out.terms["ce"].item() + out.terms["ce_mix"].item(), rel=1e-6)
    assert torch.equal(out.logits, logits) and torch.equal(obj.predict(features), logits)  # evaluation: plain


@pytest.mark.parametrize("preset", ["core", "ce_mix", "ce_con"])
def test_adjusting_the_logits_is_shifting_the_classifier_bias_by_tau_log_prior(preset: str) -> None:
    """Whole objective, hard pairs and contrastive term included: Core-tuning at τ equals Core-tuning at 0 whose
    classifier bias is ``b + τ log π`` (the miner and mixup read features, not logits), term by term."""
    tau = 1.5
    torch.manual_seed(1)
    adjusted = objectives.create(preset, feature_dim=8, num_classes=4, logit_adjustment=tau).double()
    adjusted.observe_class_counts(COUNTS)
    plain = objectives.create(preset, feature_dim=8, num_classes=4).double()
    state = {k: v for k, v in adjusted.state_dict().items() if k != "log_prior"}
    plain.load_state_dict(state)
    with torch.no_grad():
        plain.classifier.bias += tau * torch.tensor(PRIORS, dtype=torch.float64).log()
    features, labels = torch.randn(8, 8, dtype=torch.float64), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    torch.manual_seed(2)
    ours = adjusted(features, labels)
    torch.manual_seed(2)
    theirs = plain(features, labels)
    assert set(ours.terms) == set(theirs.terms)
    for name, value in ours.terms.items():
        assert value.item() == pytest.approx(theirs.terms[name].item(), rel=1e-5), name
    assert torch.allclose(ours.logits, adjusted.classifier(features))  # the plain logits, not the shifted ones


def test_priors_are_kept_only_when_adjusting_and_a_lazy_objective_takes_them_at_build() -> None:
    plain = CoreTuning(num_classes=4, feature_dim=8)
    assert "log_prior" not in plain.state_dict() and not plain.needs_class_counts  # its checkpoints as before
    plain.observe_class_counts(COUNTS)  # coretune fit hands every objective the counts: nothing to keep
    assert "log_prior" not in plain.state_dict()
    obj = CoreTuning(num_classes=4, feature_dim=8, logit_adjustment=1)
    assert obj.needs_class_counts
    obj.observe_class_counts(COUNTS)
    copy = CoreTuning(num_classes=4, feature_dim=8, logit_adjustment=1)
    copy.load_state_dict(obj.state_dict())
    features, labels = torch.randn(8, 8), torch.tensor([0, 1, 2, 3] * 2)
    torch.manual_seed(3)
    expected = obj(features, labels).loss.item()
    torch.manual_seed(3)
    assert copy(features, labels).loss.item() == pytest.approx(expected)
    lazy = CoreTuning(num_classes=4, logit_adjustment=1)
    lazy.observe_class_counts(COUNTS)
    lazy.predict(torch.randn(2, 8))
    assert torch.equal(lazy.log_prior, obj.log_prior)
    assert obj.hparams()["logit_adjustment"] == 1.0 and plain.hparams()["logit_adjustment"] == 0.0


def test_bad_settings_missing_priors_and_segmentation_are_one_line() -> None:
    for bad in (-1, True, "1"):
        with pytest.raises(ValueError, match=r"^invalid Core-tuning settings: logit_adjustment must be >= 0 \(got "):
            CoreTuning(logit_adjustment=bad)  # type: ignore[arg-type]
    obj = CoreTuning(num_classes=4, feature_dim=8, logit_adjustment=1)
    with pytest.raises(RuntimeError, match=r"^logit adjustment has no class priors: call objective\.observe_class"):
        obj(torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"^logit adjustment needs training images of every class: class 2 has none"):
        obj.observe_class_counts(torch.tensor([4, 3, 0, 2]))
    what, why = CoreTuning(logit_adjustment=1).dense_problem() or ("", "")
    assert what == "'core' with logit_adjustment 1" and "not the pixel-wise one" in why
    assert CoreTuning().dense_problem() is None
