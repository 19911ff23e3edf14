"""AdversarialTraining: the settings' one-line errors, the clean + PGD batch (in pixel space and for normalised
images), the model left as it was, determinism, and the adversarial row as a positive of its clean source."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adversarial_models import DIGITS_MEAN, DIGITS_STD, digits, trained_digits_cnn
from coretune.losses import core_positive_mask, supcon_positive_mask
from coretune.robust.attacks import PGD
from coretune.robust.training import AdversarialTraining, repeat_rows


def _batch(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, x, y = digits()
    return x[:n], y[:n]


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps": -0.1}, "PGD eps must be a finite radius >= 0 in [0, 1] pixel units (e.g. 8/255), got -0.1"),
        ({"norm": "l1"}, "PGD norm must be one of linf, l2; got 'l1'"),
        ({"steps": 0}, "PGD steps must be >= 1, got 0"),
        ({"step_size": 0.0}, "PGD step_size must be > 0 (or None for 2.5·eps/steps), got 0.0"),
    ],
)
def test_bad_settings_give_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        AdversarialTraining(enable=True, **kwargs)
    assert str(info.value) == f"invalid adversarial-training settings: {message}"


def test_defaults_are_pgd_10_at_linf_8_255_with_a_random_start() -> None:
    at = AdversarialTraining(enable=True)
    assert repr(at) == (
        "AdversarialTraining(enable=True, PGD(norm='linf', eps=0.0313725, steps=10, step_size=0.00784314, "
        "random_start=True))"
    )
    assert at.attack.step_size == pytest.approx(2 / 255)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_the_batch_is_clean_then_adversarial_within_the_ball_and_lowers_accuracy(norm: str) -> None:
    model = trained_digits_cnn()
    x, y = _batch()
    eps = 0.15 if norm == "linf" else 1.0
    images, labels = AdversarialTraining(enable=True, norm=norm, eps=eps).extend(model, x, y)
    clean, adv = images[:64], images[64:]
    assert images.shape == (128, 1, 8, 8) and torch.equal(clean, x)
    assert torch.equal(labels, torch.cat([y, y]))
    delta = (adv - x).flatten(1)
    size = delta.abs().amax(dim=1) if norm == "linf" else delta.norm(dim=1)
    assert size.max() <= eps + 1e-6 and adv.min() >= 0 and adv.max() <= 1
    assert _accuracy(model, adv, y) < _accuracy(model, x, y) - 0.3


def test_normalised_images_are_attacked_in_pixel_space_and_come_back_normalised() -> None:
    """The engine's case: the data module normalises, the model takes normalised images."""
    pixel_model = trained_digits_cnn()
    net = pixel_model.model  # takes normalised images
    x, y = _batch()
    mean, std = torch.tensor(DIGITS_MEAN).view(1, -1, 1, 1), torch.tensor(DIGITS_STD).view(1, -1, 1, 1)
    at = AdversarialTraining(enable=True, eps=0.1)
    images, labels = at.extend(net, (x - mean) / std, y, mean=DIGITS_MEAN, std=DIGITS_STD,
                               generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.equal(images[:64], (x - mean) / std) and torch.equal(labels, torch.cat([y, y]))
    adv_pixels = images[64:] * std + mean
    assert (adv_pixels - x).abs().max() <= 0.1 + 1e-5 and adv_pixels.min() >= -1e-6 and adv_pixels.max() <= 1 + 1e-6
    # the same examples as attacking the pixel-space model with the same seed
    expected = PGD("linf", 0.1)(pixel_model, x, y, torch.Generator().manual_seed(0))
    torch.testing.assert_close(adv_pixels, expected, atol=1e-5, rtol=0)


def test_building_the_batch_leaves_the_model_parameters_grads_and_batchnorm_unchanged() -> None:
    model = trained_digits_cnn().train()
    x, y = _batch()
    torch.nn.functional.cross_entropy(model(x), y).backward()  # a gradient already accumulated
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    AdversarialTraining(enable=True).extend(model, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # incl. running mean/var
    assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters())
    assert all(m.training for m in model.modules())


def test_seeded_batches_are_deterministic_and_keep_channels_last() -> None:
    model = trained_digits_cnn()
    x, y = _batch(16)
    x = x.expand(-1, 1, 8, 8).contiguous(memory_format=torch.channels_last)
    at = AdversarialTraining(enable=True, norm="l2", eps=0.5)
    first, _ = at.extend(model, x, y, generator=torch.Generator().manual_seed(3))
    again, _ = at.extend(model, x, y, generator=torch.Generator().manual_seed(3))
    other, _ = at.extend(model, x, y, generator=torch.Generator().manual_seed(4))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.is_contiguous(memory_format=torch.channels_last)


def test_the_adversarial_row_is_a_positive_of_its_clean_source() -> None:
    """Class-label positives pair row i with row B + i both ways (SupCon's mask, Core-tuning's originals over the
    2B rows); an instance-contrastive objective gets the clean source's inputs for the adversarial row."""
    x, y = _batch(8)
    _, labels = AdversarialTraining(enable=True).extend(trained_digits_cnn(), x, y)
    b = len(y)
    rows = torch.arange(b)
    for mask in (supcon_positive_mask(labels), core_positive_mask(labels)[:, : 2 * b]):
        assert mask[rows, rows + b].all() and mask[rows + b, rows].all()
    keys = torch.randn(b, 5)
    assert torch.equal(repeat_rows(keys)[rows + b], keys)
