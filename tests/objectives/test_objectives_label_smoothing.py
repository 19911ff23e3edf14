"""``--objective.label_smoothing``: every objective's cross-entropy on the classifier with torch's label smoothing,
and Core-tuning's / manifold mixup's soft targets smoothed as timm's ``Mixup(label_smoothing=s)`` builds them."""

import pytest
import torch
import torch.nn.functional as F
from timm.data.mixup import mixup_target
from timm.loss import SoftTargetCrossEntropy

from coretune.models import create_backbone
from coretune.objectives import available, create

B, D, K = 8, 16, 4


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, D, generator=g), torch.arange(B) % K


@pytest.mark.parametrize("name", sorted(available()))
def test_each_objectives_ce_term_is_torchs_label_smoothed_ce(name: str) -> None:
    """The logged ``ce`` term equals F.cross_entropy(logits, y, label_smoothing=s) on the objective's logits, and
    s = 0 is the plain CE, the default."""
    backbone = create_backbone("small_cnn", widths=(4, 4, 4, 8))
    x, y = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(B) % K
    for s in (0.0, 0.1):
        torch.manual_seed(1)
        objective = create(name, feature_dim=backbone.feature_dim, num_classes=K, label_smoothing=s)
        objective.attach_backbone(backbone)
        if objective.needs_class_counts:  # logit adjustment: uniform priors shift every logit alike (CE unchanged)
            objective.observe_class_counts(torch.ones(K, dtype=torch.int64))
        z = backbone(x)  # after attaching: DELTA reads the stage outputs of this forward
        out = objective(z, y, inputs=x)
        expected = F.cross_entropy(objective.classifier(z), y, label_smoothing=s)
        assert objective.label_smoothing == s and objective.hparams()["label_smoothing"] == s
        if name != "manifold_mixup":  # which trains on the mixed rows only: its CE is the soft one (below)
            assert out.terms["ce"].item() == pytest.approx(expected.item(), rel=1e-6), name
    assert create(name).label_smoothing == 0.0


def test_soft_targets_are_smoothed_as_timms_mixup_smooths_them() -> None:
    """A mixed row's target lam·onehot(a) + (1−lam)·onehot(b) smoothed by s is timm's mixup_target(…, smoothing=s);
    the loss is timm's SoftTargetCrossEntropy of it."""
    objective = create("core", feature_dim=D, num_classes=K, label_smoothing=0.2)
    logits = torch.randn(B, K)
    a, b, lam = torch.arange(B) % K, (torch.arange(B) + 1) % K, 0.7
    soft = lam * F.one_hot(a, K).float() + (1 - lam) * F.one_hot(b, K).float()
    # timm flips the batch for its second label: a batch whose flip is b
    timm_target = mixup_target(torch.cat([a, b.flip(0)]), K, lam, smoothing=0.2)[:B]
    timm_loss = SoftTargetCrossEntropy()(logits, timm_target)
    assert objective.soft_cross_entropy(logits, soft).item() == pytest.approx(timm_loss.item(), rel=1e-6)
    assert create("core", feature_dim=D, num_classes=K).soft_cross_entropy(logits, soft).item() == pytest.approx(
        SoftTargetCrossEntropy()(logits, soft).item(), rel=1e-6
    )


@pytest.mark.parametrize("name", ["core", "ce_mix", "manifold_mixup"])
def test_mixed_rows_train_on_the_smoothed_soft_targets(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the same draws, the mixed rows' soft CE with smoothing s is timm's SoftTargetCrossEntropy of the
    targets (1 − s)·t + s/K, t the targets of the run without smoothing."""
    import coretune.objectives.base as base

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    plain = base.soft_cross_entropy
    monkeypatch.setattr(base, "soft_cross_entropy", lambda lg, t: seen.append((lg, t)) or plain(lg, t))
    z, y = batch()
    losses = {}
    for s in (0.0, 0.3):
        torch.manual_seed(2)
        objective = create(name, feature_dim=D, num_classes=K, label_smoothing=s)
        torch.manual_seed(3)
        out = objective(z, y)
        losses[s] = out.terms.get("ce_mix", out.terms["loss"])
    (logits0, t0), (logits, t) = seen
    assert torch.equal(logits0, logits)  # the same rows
    assert torch.allclose(t, 0.7 * t0 + 0.3 / K)
    assert losses[0.3].item() == pytest.approx(SoftTargetCrossEntropy()(logits, 0.7 * t0 + 0.3 / K).item(), rel=1e-6)


@pytest.mark.parametrize("value", [-0.1, 1.0, True])
def test_a_bad_label_smoothing_is_refused_in_one_line(value: object) -> None:
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0, 1\)"):
        create("ce", label_smoothing=value)


def test_segmentations_pixel_ce_is_smoothed_over_the_labelled_pixels() -> None:
    """Segmentation's training CE with the objective's smoothing: torch's label-smoothed CE over the pixels not
    ignored; its evaluation loss stays unsmoothed."""
    from coretune.tasks import TASKS, Batch

    task = TASKS["segmentation"]({})
    objective = create("ce", label_smoothing=0.2)
    objective.build(8, K)
    objective.classifier = torch.nn.Conv2d(8, K, 1)  # a per-pixel classifier, as the task's head is
    features = torch.randn(2, 8, 4, 4)
    masks = torch.randint(0, K, (2, 4, 4))
    masks[0, 0] = task.ignore_index
    out = task.loss(objective, features, Batch(torch.zeros(2, 3, 4, 4), masks), torch.zeros(2, 3, 4, 4))
    logits = task.predict(objective, features, masks)
    smoothed = F.cross_entropy(logits, masks, ignore_index=task.ignore_index, label_smoothing=0.2)
    assert out.terms["ce"].item() == pytest.approx(smoothed.item(), rel=1e-6)
    plain = F.cross_entropy(logits, masks, ignore_index=task.ignore_index)
    assert task.eval_loss(logits, masks).item() == pytest.approx(plain.item(), rel=1e-6)
