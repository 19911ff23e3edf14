"""Batched SimCLR augmentations: per-image crops within torchvision's ranges, exact flips and grayscale."""

import math

import pytest
import torch

from coretune.pretrain import BatchAugment

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _unnormalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


def _plain(**kwargs: object) -> BatchAugment:
    settings = dict(
        crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0.0, jitter_p=0.0, grayscale_p=0.0, mean=MEAN, std=STD
    )
    settings.update(kwargs)
    return BatchAugment(8, **settings)


def test_whole_image_crop_without_jitter_is_identity_and_normalises() -> None:
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    out = _plain()(x)
    assert out.shape == (4, 3, 8, 8) and out.dtype == torch.float32
    assert torch.allclose(_unnormalize(out), x.float() / 255, atol=1e-5)


def test_flip_and_grayscale_are_exact() -> None:
    x = torch.rand(3, 3, 8, 8)
    assert torch.allclose(_unnormalize(_plain(flip_p=1.0)(x)), x.flip(3), atol=1e-5)
    gray = _unnormalize(_plain(grayscale_p=1.0)(x))
    luma = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    for c in range(3):
        assert torch.allclose(gray[:, c], luma, atol=1e-5)


def test_crop_boxes_follow_random_resized_crop_ranges() -> None:
    aug = BatchAugment(8, crop_scale=(0.2, 0.6), crop_ratio=(3 / 4, 4 / 3))
    torch.manual_seed(0)
    boxes = aug.crop_boxes(4000, 30, 40, torch.device("cpu"))
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 40 + 1e-4).all() and (boxes[:, 3] <= 30 + 1e-4).all()
    area = w * h / (30 * 40)
    assert area.min() >= 0.2 - 1e-4 and area.max() <= 0.6 + 1e-4
    ratio = w / h
    assert ratio.min() >= 3 / 4 - 1e-4 and ratio.max() <= 4 / 3 + 1e-4
    assert math.isclose(float(area.mean()), 0.4, abs_tol=0.02)  # uniform in the scale range
    assert w.std() > 0.5 and boxes[:, 0].std() > 0.5  # every image draws its own box


def test_colour_jitter_keeps_grey_images_grey_and_varies_per_image() -> None:
    x = torch.rand(64, 1, 8, 8).expand(64, 3, 8, 8).contiguous()
    aug = _plain(jitter_p=1.0, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.5)
    out = _unnormalize(aug(x))
    assert torch.allclose(out[:, 0], out[:, 1], atol=1e-4) and torch.allclose(out[:, 1], out[:, 2], atol=1e-4)
    assert out.min() >= -1e-5 and out.max() <= 1 + 1e-5
    gain = out.mean(dim=(1, 2, 3)) / x.mean(dim=(1, 2, 3))
    assert gain.std() > 0.05


def test_hue_rotation_keeps_luma_and_chroma_magnitude() -> None:
    torch.manual_seed(0)
    x = 0.4 + 0.1 * torch.rand(32, 3, 1, 1).expand(32, 3, 8, 8)  # mid-range colours: no clamping
    out = _unnormalize(_plain(jitter_p=1.0, brightness=0.0, contrast=0.0, saturation=0.0, hue=0.5)(x))
    to_yiq = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    yiq_in, yiq_out = (torch.einsum("ij,bjhw->bihw", to_yiq, t) for t in (x, out))
    assert torch.allclose(yiq_out[:, 0], yiq_in[:, 0], atol=1e-5)  # luma Y unchanged
    assert torch.allclose(yiq_out[:, 1:].norm(dim=1), yiq_in[:, 1:].norm(dim=1), atol=1e-5)  # chroma rotated
    assert (out - x).abs().amax(dim=(1, 2, 3)).median() > 1e-3  # the hue of most images changed


def test_invalid_settings_name_every_problem() -> None:
    with pytest.raises(ValueError, match=r"crop_scale must satisfy 0 < min <= max <= 1 .*flip_p must lie in"):
        BatchAugment(8, crop_scale=(0.5, 1.5), flip_p=2.0)
    with pytest.raises(ValueError, match=r"expected a batch of RGB images \(B, 3, H, W\), got shape \(3, 8, 8\)"):
        BatchAugment(8)(torch.rand(3, 8, 8))
