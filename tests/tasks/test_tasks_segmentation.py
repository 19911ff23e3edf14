"""Segmentation metrics against hand-computed confusion matrices, the image-level label rules and their positive
masks, the VOC palette, palette mask files and the predictions figure."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coretune.data import read_mask
from coretune.losses import contrastive_loss
from coretune.tasks.segmentation import (
    SegmentationMetrics,
    class_pixel_counts,
    colorize,
    image_labels,
    majority_labels,
    multilabel_labels,
    per_class_scores,
    positive_mask,
    save_palette_mask,
    save_predictions_figure,
    segmentation_scores,
    voc_palette,
)

I = 255  # noqa: E741  the ignore index, short so masks read as pictures

# -- metrics --------------------------------------------------------------------------------------------------
# Ground truth and prediction of one 2×4 image; the ignored pixel (0, 3) is predicted 2 and must not count.
TARGET = torch.tensor([[[0, 0, 1, I], [2, 2, 1, 0]]])
PREDICTION = torch.tensor([[[0, 1, 1, 2], [2, 0, 1, 0]]])
# rows: true class, columns: predicted class
HAND_CONFUSION = torch.tensor([[2, 1, 0], [0, 2, 0], [1, 0, 1]])


def test_metrics_from_a_hand_computed_confusion_matrix() -> None:
    metric = SegmentationMetrics(3)
    metric.update(PREDICTION[:, :1], TARGET[:, :1])  # the two rows as two batches: one matrix over both
    metric.update(PREDICTION[:, 1:], TARGET[:, 1:])
    scores = metric.compute()
    assert torch.equal(scores["confusion"], HAND_CONFUSION)
    # 7 labelled pixels, 5 right; class accuracies 2/3, 2/2, 1/2; IoUs 2/(3+3-2), 2/(2+3-2), 1/(2+1-1)
    expected = {
        "pixel_acc": 5 / 7,
        "mpa": (2 / 3 + 1 + 1 / 2) / 3,
        "miou": (1 / 2 + 2 / 3 + 1 / 2) / 3,
        "fwiou": 3 / 7 * 1 / 2 + 2 / 7 * 2 / 3 + 2 / 7 * 1 / 2,
    }
    for name, value in expected.items():
        assert scores[name].item() == pytest.approx(value, abs=1e-12), name
    assert scores["per_class_iou"].tolist() == pytest.approx([1 / 2, 2 / 3, 1 / 2])
    assert scores["per_class_acc"].tolist() == pytest.approx([2 / 3, 1, 1 / 2])


def test_logits_are_arg_maxed() -> None:
    logits = torch.nn.functional.one_hot(PREDICTION, 3).permute(0, 3, 1, 2).float() * 5 - 1
    metric = SegmentationMetrics(3)
    metric.update(logits, TARGET)
    assert torch.equal(metric.compute()["confusion"], HAND_CONFUSION)


def test_classes_absent_from_the_split() -> None:
    """Class 3 is neither in the ground truth nor predicted: NaN, out of every mean. Class 4 has no ground truth
    but is predicted once: its IoU is 0 and counts in MIoU; its accuracy is NaN, out of MPA; FWIoU weighs it 0."""
    prediction = PREDICTION.clone()
    prediction[0, 1, 1] = 4  # a class-2 pixel predicted as 4 instead of 0
    metric = SegmentationMetrics(5)
    metric.update(prediction, TARGET)
    scores = metric.compute()
    iou, acc = scores["per_class_iou"].tolist(), scores["per_class_acc"].tolist()
    assert math.isnan(iou[3]) and math.isnan(acc[3]) and math.isnan(acc[4]) and iou[4] == 0
    assert iou[:3] == pytest.approx([2 / 3, 2 / 3, 1 / 2])  # class 0 is now predicted twice, both right
    assert acc[:3] == pytest.approx([2 / 3, 1, 1 / 2])
    assert scores["miou"].item() == pytest.approx((2 / 3 + 2 / 3 + 1 / 2 + 0) / 4)
    assert scores["mpa"].item() == pytest.approx((2 / 3 + 1 + 1 / 2) / 3)
    assert scores["fwiou"].item() == pytest.approx(3 / 7 * 2 / 3 + 2 / 7 * 2 / 3 + 2 / 7 * 1 / 2)
    assert per_class_scores(scores["per_class_iou"], ["a", "b", "c", "d", "e"]) == {
        "a": pytest.approx(2 / 3), "b": pytest.approx(2 / 3), "c": pytest.approx(0.5), "d": None, "e": 0.0,
    }  # fmt: skip


def slow_scores(target: np.ndarray, prediction: np.ndarray, k: int) -> dict[str, float]:
    """The definitions, pixel by pixel: no confusion matrix, absent classes skipped by hand."""
    pairs = [(t, p) for t, p in zip(target.ravel().tolist(), prediction.ravel().tolist(), strict=True) if t != I]
    accs, ious, fw = [], [], 0.0
    for c in range(k):
        truth = sum(1 for t, _ in pairs if t == c)
        predicted = sum(1 for _, p in pairs if p == c)
        right = sum(1 for t, p in pairs if t == c and p == c)
        if truth:
            accs.append(right / truth)
        if truth or predicted:
            ious.append(right / (truth + predicted - right))
            fw += truth / len(pairs) * ious[-1]
    return {
        "pixel_acc": sum(1 for t, p in pairs if t == p) / len(pairs),
        "mpa": sum(accs) / len(accs),
        "miou": sum(ious) / len(ious),
        "fwiou": fw,
    }


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_an_obvious_loop_on_random_masks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = 6
    target = rng.integers(0, k - 1, (3, 9, 7))  # class 5 never in the ground truth
    target[rng.random(target.shape) < 0.2] = I
    prediction = np.where(rng.random(target.shape) < 0.6, target, rng.integers(0, k, target.shape))
    prediction[prediction == I] = 0
    metric = SegmentationMetrics(k)
    for b in range(3):
        metric.update(torch.from_numpy(prediction[b : b + 1]), torch.from_numpy(target[b : b + 1]))
    scores = metric.compute()
    for name, value in slow_scores(target, prediction, k).items():
        assert scores[name].item() == pytest.approx(value, abs=1e-12), name


def test_scores_of_an_empty_matrix_are_nan() -> None:
    scores = segmentation_scores(torch.zeros(3, 3, dtype=torch.int64))
    assert all(math.isnan(scores[name].item()) for name in ("pixel_acc", "mpa", "miou", "fwiou"))


# -- image-level labels ---------------------------------------------------------------------------------------
MASKS = torch.tensor(
    [
        [[0, 0, 1], [1, 1, I]],  # 2 × class 0, 3 × class 1
        [[2, 2, 2], [0, I, I]],  # 1 × class 0, 3 × class 2
        [[I, I, I], [I, I, I]],  # nothing labelled
        [[0, 1, 0], [1, 2, 2]],  # a tie: 2 of each
        [[1, 1, 1], [1, 1, 1]],  # class 1 only
    ]
)


def test_class_pixel_counts_and_the_majority_rule() -> None:
    counts = class_pixel_counts(MASKS, 3)
    assert counts.tolist() == [[2, 3, 0], [1, 0, 3], [0, 0, 0], [2, 2, 2], [0, 6, 0]]
    assert majority_labels(MASKS, 3).tolist() == [1, 2, -1, 0, 1]  # a tie goes to the smallest class
    assert torch.equal(image_labels(MASKS, 3, "majority"), majority_labels(MASKS, 3))
    with pytest.raises(ValueError, match="mask value 3 is out of range for 3 classes"):
        class_pixel_counts(torch.tensor([[[0, 3]]]), 3)


def test_the_multilabel_rule() -> None:
    hot = multilabel_labels(MASKS, 3)
    assert hot.tolist() == [
        [True, True, False],
        [True, False, True],
        [False, False, False],
        [True, True, True],
        [False, True, False],
    ]
    assert torch.equal(image_labels(MASKS, 3, "multilabel"), hot)
    with pytest.raises(ValueError, match="image label rule must be 'majority' or 'multilabel', got 'mode'"):
        image_labels(MASKS, 3, "mode")  # type: ignore[arg-type]


def test_positive_masks_of_both_rules() -> None:
    majority = positive_mask(majority_labels(MASKS, 3))
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[0, 4] = expected[4, 0] = True  # both majority class 1; everything else differs or has no label
    assert torch.equal(majority, expected)

    multilabel = positive_mask(multilabel_labels(MASKS, 3))
    shares = {(0, 1), (0, 3), (0, 4), (1, 3), (3, 4)}  # share a class; crop 2 shares nothing
    expected = torch.tensor([[(min(i, j), max(i, j)) in shares for j in range(5)] for i in range(5)])
    assert torch.equal(multilabel, expected)

    # two unlabelled crops are not each other's positives under the majority rule (-1 == -1)
    assert not positive_mask(torch.tensor([-1, -1, 2])).any()
    with pytest.raises(ValueError, match=r"labels must be \(B,\) class indices or \(B, K\) K-hot"):
        positive_mask(torch.zeros(2, 2, 2))


def test_an_unlabelled_crop_is_no_anchor_but_stays_a_negative() -> None:
    features = torch.nn.functional.normalize(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    mask = positive_mask(multilabel_labels(MASKS, 3))
    full = contrastive_loss(features, mask)
    without_anchor = contrastive_loss(features, mask.clone().index_fill_(0, torch.tensor([2]), False))
    assert torch.isfinite(full) and torch.equal(full, without_anchor)


# -- palette, mask files, figure ------------------------------------------------------------------------------
def test_voc_palette() -> None:
    palette = voc_palette()
    assert palette.shape == (256, 3) and palette.dtype == np.uint8
    known = {0: (0, 0, 0), 1: (128, 0, 0), 2: (0, 128, 0), 3: (128, 128, 0), 15: (192, 128, 128), 255: (224, 224, 192)}
    for index, colour in known.items():
        assert tuple(palette[index]) == colour, index
    assert len({tuple(c) for c in palette}) == 256
    assert colorize(np.array([[1, 255]])).tolist() == [[[128, 0, 0], [224, 224, 192]]]


def test_palette_masks_read_back_as_indices_and_show_palette_colours(tmp_path: Path) -> None:
    mask = np.array([[0, 1, 2], [15, 255, 3]], dtype=np.uint8)
    path = tmp_path / "mask.png"
    save_palette_mask(torch.from_numpy(mask), path)
    np.testing.assert_array_equal(read_mask(str(path)), mask)
    with Image.open(path) as img:
        assert img.mode == "P"
        np.testing.assert_array_equal(np.array(img.convert("RGB")), colorize(mask))
    with pytest.raises(ValueError, match=r"values in \[0, 255\], got shape \(1, 2\), values 0…300"):
        save_palette_mask(np.array([[0, 300]]), tmp_path / "bad.png")


def test_predictions_figure(tmp_path: Path) -> None:
    images = torch.zeros(2, 3, 16, 16)
    targets = torch.tensor([[0, 1], [2, I]]).repeat_interleave(8, 0).repeat_interleave(8, 1).expand(2, 16, 16)
    logits = torch.nn.functional.one_hot(torch.ones(2, 16, 16, dtype=torch.int64), 3).permute(0, 3, 1, 2).float()
    path = tmp_path / "predictions.png"
    save_predictions_figure(images, targets, logits, path, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), ["bg", "a", "b"])
    with Image.open(path) as img:
        pixels = np.array(img.convert("RGB")).reshape(-1, 3)
    colours = {tuple(c) for c in np.unique(pixels, axis=0)}
    assert {(128, 0, 0), (0, 128, 0), (224, 224, 192), (128, 128, 128)} <= colours  # classes, ignore, grey image
