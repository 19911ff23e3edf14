"""Semantic segmentation (``--task segmentation``, :class:`SegmentationTask`) and its pieces: metrics from one
confusion matrix, the image-level labels that give the contrastive regulariser its positives, the regulariser
itself (Core-tuning's, :func:`coretune.objectives.core.dense_contrastive_loss`, re-exported here), and the colour
palette with its mask files and figures.

Masks are ``(B, H, W)`` int64 class indices with ``ignore_index`` (255) for pixels left out of everything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from ..data import TaskData
from ..data.segmentation import IGNORE_INDEX, SegmentationData
from ..losses import image_label_positive_mask
from ..models import DeepLabV3, Encoder, create_dilated_backbone, deeplab_head, resnet_feature_map
from ..objectives import Objective, ObjectiveOutput, dense_contrastive_loss
from .base import Batch, Task, register_task

__all__ = [
    "ImageLabelRule",
    "SegmentationMetrics",
    "SegmentationTask",
    "class_pixel_counts",
    "colorize",
    "dense_contrastive_loss",
    "image_labels",
    "majority_labels",
    "multilabel_labels",
    "per_class_scores",
    "positive_mask",
    "save_palette_mask",
    "save_predictions_figure",
    "segmentation_scores",
    "voc_palette",
]

ImageLabelRule = Literal["majority", "multilabel"]

positive_mask = image_label_positive_mask
"""The positives of image-level labels: :func:`coretune.losses.image_label_positive_mask` (its earlier name)."""


# ------------------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------------------
def segmentation_scores(confusion: Tensor) -> dict[str, Tensor]:
    """Pixel accuracy, MPA, FWIoU, MIoU and per-class accuracy and IoU of a ``(K, K)`` confusion matrix
    (rows: ground truth, columns: prediction, ignored pixels not counted), as fractions in [0, 1].

    With ``n_c`` the ground-truth pixels of class ``c``, ``p_c`` its predicted pixels, ``t_c`` the correct ones
    and ``N = Σ n_c``:

    - ``pixel_acc = Σ t_c / N``;
    - ``per_class_acc[c] = t_c / n_c`` and ``mpa`` its mean;
    - ``per_class_iou[c] = t_c / (n_c + p_c − t_c)`` and ``miou`` its mean;
    - ``fwiou = Σ (n_c / N) · per_class_iou[c]``.

    Classes absent from the split, as the usual VOC/DeepLab evaluation treats them (``np.nanmean`` over classes):
    a class with no ground-truth pixel has ``per_class_acc`` NaN, left out of MPA; if nothing is predicted as it
    either, its IoU is NaN too and it is left out of MIoU; if it is predicted somewhere, its IoU is 0 and counts
    in MIoU (those predictions are wrong). FWIoU weighs classes by ``n_c``, so absent classes weigh nothing.
    Everything is NaN for a matrix without pixels.
    """
    confusion = confusion.to(torch.float64)
    true_pixels, predicted, correct = confusion.sum(1), confusion.sum(0), confusion.diagonal()
    total = true_pixels.sum()
    nan = torch.tensor(math.nan, dtype=torch.float64)
    per_class_acc = torch.where(true_pixels > 0, correct / true_pixels, nan)
    union = true_pixels + predicted - correct
    per_class_iou = torch.where(union > 0, correct / union, nan)
    return {
        "pixel_acc": correct.sum() / total if total > 0 else nan,
        "mpa": per_class_acc.nanmean(),
        "fwiou": (true_pixels / total * per_class_iou.nan_to_num()).sum() if total > 0 else nan,
        "miou": per_class_iou.nanmean(),
        "per_class_acc": per_class_acc,
        "per_class_iou": per_class_iou,
    }


def per_class_scores(values: Tensor, class_names: Sequence[str]) -> dict[str, float | None]:
    """``{class name: value}`` of a per-class score for ``results.json``: NaN (absent class) becomes None."""
    return {name: None if math.isnan(v) else v for name, v in zip(class_names, values.tolist(), strict=True)}


class SegmentationMetrics(MulticlassConfusionMatrix):
    """One ``(K, K)`` confusion matrix accumulated over a whole split (torchmetrics, pixels equal to
    ``ignore_index`` in the target left out), scored by :func:`segmentation_scores` at :meth:`compute`.

    ``update(preds, target)`` takes logits ``(B, K, H, W)`` (arg-maxed over ``K``) or class indices ``(B, H, W)``,
    and target masks ``(B, H, W)``. Scores over a whole split are not means of per-image or per-batch scores.
    :meth:`compute` returns :func:`segmentation_scores`'s dict plus ``"confusion"`` (int64 counts).
    """

    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX, **kwargs: object) -> None:
        super().__init__(num_classes, ignore_index=ignore_index, **kwargs)

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        confusion = super().compute()
        return {**segmentation_scores(confusion), "confusion": confusion}


# ------------------------------------------------------------------------------------------------------------
# image-level labels for the contrastive regulariser
# ------------------------------------------------------------------------------------------------------------
def class_pixel_counts(masks: Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``(B, K)`` int64: how many pixels of each class every mask ``(B, H, W)`` holds (``ignore_index`` not
    counted).

    Raises:
        ValueError: a mask value is neither in ``[0, K)`` nor ``ignore_index``.
    """
    flat = masks.reshape(masks.shape[0], -1).long()
    valid = flat != ignore_index
    if ((flat < 0) | (flat >= num_classes))[valid].any():
        bad = flat[valid & ((flat < 0) | (flat >= num_classes))][0]
        raise ValueError(f"mask value {int(bad)} is out of range for {num_classes} classes ({ignore_index} = ignore)")
    counts = torch.zeros(masks.shape[0], num_classes + 1, dtype=torch.int64, device=masks.device)
    counts.scatter_add_(1, torch.where(valid, flat, num_classes), torch.ones_like(flat))
    return counts[:, :num_classes]


def majority_labels(masks: Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``(B,)`` int64: each crop's most frequent non-ignored class (the smallest index on a tie), ``-1`` for a
    crop whose pixels are all ignored.

    Why: the paper contrasts globally pooled features of the last feature map, one vector per crop, and does
    not say which label such a vector has. The majority class is the one that dominates the pooled feature (it
    covers most of the pooled area), so two crops are positives when the same thing dominates both — for VOC
    usually the object class, as an image-classification label would be. Crops of mostly background
    all share the background class; :func:`multilabel_labels` is the alternative when that is too coarse.
    """
    counts = class_pixel_counts(masks, num_classes, ignore_index)
    return torch.where(counts.sum(1) > 0, counts.argmax(1), -1)


def multilabel_labels(masks: Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``(B, K)`` bool: the classes present in each crop (a K-hot vector; all False for an all-ignored crop).

    Why: a pooled crop feature mixes every class in the crop, so the majority class discards the others (a
    small person on a large sofa); here two crops are positives when they share any class, the multi-label
    generalisation of SupCon's same-class rule. Its drawback: a class present in nearly every crop
    (background) makes nearly every pair positive, leaving few negatives.
    """
    return class_pixel_counts(masks, num_classes, ignore_index) > 0


def image_labels(
    masks: Tensor, num_classes: int, rule: ImageLabelRule = "majority", ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Image-level labels of a batch of crops by ``rule``: :func:`majority_labels` ``(B,)`` or
    :func:`multilabel_labels` ``(B, K)``."""
    if rule == "majority":
        return majority_labels(masks, num_classes, ignore_index)
    if rule == "multilabel":
        return multilabel_labels(masks, num_classes, ignore_index)
    raise ValueError(f"image label rule must be 'majority' or 'multilabel', got {rule!r}")


# ------------------------------------------------------------------------------------------------------------
# palette, mask files, figures
# ------------------------------------------------------------------------------------------------------------
def voc_palette(n: int = 256) -> np.ndarray:
    """PASCAL VOC's colour map ``(n, 3)`` uint8: the bits of index ``k`` dealt in turn to R, G, B from the most
    significant bit down (1 → dark red (128, 0, 0), 15 → person (192, 128, 128), 255 → (224, 224, 192))."""
    palette = np.zeros((n, 3), dtype=np.uint8)
    for k in range(n):
        c, rgb = k, [0, 0, 0]
        for bit in range(8):
            for channel in range(3):
                rgb[channel] |= ((c >> channel) & 1) << (7 - bit)
            c >>= 3
        palette[k] = rgb
    return palette


_PALETTE = voc_palette()


def colorize(mask: Tensor | np.ndarray) -> np.ndarray:
    """An ``(H, W)`` class-index mask as an ``(H, W, 3)`` uint8 RGB image in :func:`voc_palette`'s colours."""
    return _PALETTE[np.asarray(mask, dtype=np.int64)]


def save_palette_mask(mask: Tensor | np.ndarray, path: str | Path) -> None:
    """Write an ``(H, W)`` class-index mask as a palette PNG (mode ``P``, :func:`voc_palette`): viewers show the
    colours, :func:`coretune.data.read_mask` reads back the indices.

    Raises:
        ValueError: the mask is not 2-D or holds a value outside ``[0, 255]``.
    """
    array = np.asarray(mask)
    if array.ndim != 2 or array.min(initial=0) < 0 or array.max(initial=0) > 255:
        raise ValueError(
            f"a palette mask must be (H, W) with values in [0, 255], got shape {array.shape}, "
            f"values {array.min(initial=0)}…{array.max(initial=0)}"
        )
    image = Image.fromarray(array.astype(np.uint8), mode="P")
    image.putpalette(_PALETTE.reshape(-1).tolist())
    image.save(path)


def save_predictions_figure(
    images: Tensor,
    targets: Tensor,
    predictions: Tensor,
    path: str | Path,
    mean: Sequence[float],
    std: Sequence[float],
    class_names: Sequence[str] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> None:
    """``predictions.png``: one row per image — the image, its ground truth, the prediction — in the fixed palette
    (ignored pixels in 255's colour), with a legend of the classes shown.

    Args:
        images: ``(N, 3, H, W)`` normalised images (as the model saw them; ``mean``/``std`` undo it).
        targets: ``(N, H, W)`` ground-truth masks.
        predictions: ``(N, H, W)`` predicted class indices (or ``(N, K, H, W)`` logits, arg-maxed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if predictions.dim() == 4:
        predictions = predictions.argmax(1)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    n = images.shape[0]
    fig, axes = plt.subplots(n, 3, figsize=(7.5, 2.5 * n), squeeze=False)
    for row in range(n):
        rgb = (images[row].detach().float().cpu() * std_t + mean_t).clamp(0, 1).permute(1, 2, 0).numpy()
        panels = (rgb, colorize(targets[row].cpu()), colorize(predictions[row].cpu()))
        for ax, panel, title in zip(axes[row], panels, ("image", "ground truth", "prediction"), strict=True):
            ax.imshow(panel, interpolation="nearest")
            ax.set_axis_off()
            if row == 0:
                ax.set_title(title)
    shown = sorted(set(torch.cat([targets.flatten(), predictions.flatten()]).cpu().tolist()))

    def name(k: int) -> str:
        if k == ignore_index:
            return "ignore"
        return class_names[k] if class_names is not None and k < len(class_names) else str(k)

    handles = [Patch(color=_PALETTE[k] / 255, label=name(k)) for k in shown]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------
# the task
# ------------------------------------------------------------------------------------------------------------
@register_task("segmentation")
class SegmentationTask(Task):
    """Semantic segmentation (``--task segmentation``, paper §5.2): DeepLab-V3 on a dilated ResNet.

    - Data: :class:`~coretune.data.SegmentationData` (the PASCAL VOC layout); batches ``(images, masks)``.
    - Settings (:attr:`own_settings`: ``FineTuner(task_settings={...})``, ``coretune fit --task.<setting>``):
      ``output_stride`` (16 or 8) and ``image_labels`` (``majority`` or ``multilabel``), below.
    - Network: the backbone's last stages dilated to the setting ``output_stride`` (16, the paper's, or 8;
      weights through the same loader and load report as classification), torchvision's DeepLab-V3 head (ASPP)
      as the objective's classifier ``G_y``; logits upsampled to the input size.
    - Objectives: ``ce`` (pixel-wise CE), and Core-tuning's class with its hard-pair ``miner`` (``core``) or
      without (``ce_con``): pixel-wise CE from the head + ``η ×`` the contrastive term of
      :func:`~coretune.objectives.core.dense_contrastive_loss` (the objective's
      :meth:`~coretune.objectives.Objective.dense_loss`) on the pooled last feature map, through the objective's own
      projection head.
      The positives come from image-level labels, which the paper leaves undefined: the setting ``image_labels``,
      a rule: ``majority`` (default: the crop's most frequent non-ignored class, the class that dominates the pooled
      feature; :func:`majority_labels`) or ``multilabel`` (crops sharing any class; :func:`multilabel_labels`).
      As the paper's source does for dense prediction, only hard *positive* pairs are generated, and the mixed
      features do not train the classifier (there is no soft-label CE: ``smooth_classifier`` and
      ``classifier_pairs`` have no effect). Every other objective is refused.
    - Metrics: pixel accuracy in training; validation and test from one confusion matrix over the split
      (:class:`SegmentationMetrics`): pixel accuracy, MPA, FWIoU, MIoU (chooses ``best.ckpt``) and, in
      ``results.json``, per-class accuracy and IoU and the confusion matrix. ``predictions.png`` shows a few
      validation images with their ground truth and prediction.
    """

    data_class = SegmentationData
    monitor = "miou"
    monitor_label = "MIoU"
    summary_keys: ClassVar[tuple[str, ...]] = ("train/loss", "train/pixel_acc", "val/loss", "val/miou")
    metric_names: ClassVar[tuple[str, ...]] = ("pixel_acc", "mpa", "fwiou", "miou")
    no_validation_split = "ImageSets/Segmentation/ lists val.txt or test.txt, not both, and no --data.val_fraction"
    validation_split_fix = "--data.val_fraction 0.1, or list validation images in val.txt and test images in test.txt"
    ignore_index = IGNORE_INDEX
    #: How many validation images ``predictions.png`` shows.
    figure_images = 4
    own_settings: ClassVar[Mapping[str, Any]] = {"output_stride": 16, "image_labels": "majority"}
    prediction_kind = "masks"
    dense_logits = True

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        super().__init__(settings)
        self.output_stride = int(self.settings["output_stride"])
        self.image_labels: ImageLabelRule = self.settings["image_labels"]

    @classmethod
    def settings_problems(cls, settings: Mapping[str, Any]) -> list[str]:
        """Also refuse an ``output_stride`` other than 16 or 8 and an ``image_labels`` rule other than ``majority``
        or ``multilabel``."""
        problems = super().settings_problems(settings)
        stride, rule = settings.get("output_stride", 16), settings.get("image_labels", "majority")
        if isinstance(stride, bool) or stride not in (16, 8):
            problems.append(f"output_stride must be 16 or 8 (got {stride!r})")
        if rule not in ("majority", "multilabel"):
            problems.append(f"image_labels must be majority or multilabel (got {rule!r})")
        return problems

    # -- the network ----------------------------------------------------------------------------------------
    def build_backbone(self, backbone: str, **options: Any) -> Encoder:
        return create_dilated_backbone(backbone, self.output_stride, **options)

    def check_objective(self, objective: Objective) -> None:
        """Refuse an objective that does not train dense prediction (:attr:`Objective.dense`,
        :meth:`Objective.dense_problem`)."""
        if (refused := objective.dense_problem()) is not None:
            what, problem = refused
            raise ValueError(
                f"objective {what} does not apply to --task segmentation ({problem}): use ce, ce_con or core"
            )

    def build_heads(self, objective: Objective, feature_dim: int, num_classes: int) -> None:
        objective.build(feature_dim, num_classes)
        objective.classifier = deeplab_head(feature_dim, num_classes, self.output_stride)

    def check_data(self, datamodule: TaskData, stage: str) -> None:
        """Refuse a :class:`SegmentationData` whose ``ignore_index`` is not the task's, and a fit on batches of 1
        image (ASPP's BatchNorm)."""
        ignore = datamodule.ignore_index if isinstance(datamodule, SegmentationData) else self.ignore_index
        if ignore != self.ignore_index:
            raise ValueError(
                f"--data.ignore_index {ignore}: the segmentation task leaves out mask value {self.ignore_index} "
                f"only; remap the masks' ignored value to {self.ignore_index}"
            )
        if stage != "fit":
            return
        images = len(datamodule.train_dataset) if datamodule.train_dataset is not None else None
        if datamodule.batch_size < 2 or images == 1:
            what = "--data.batch_size 1" if images != 1 else "a training set of 1 image"
            raise ValueError(
                f"{what}: DeepLab-V3's ASPP pools each image to one value per channel before a BatchNorm layer, "
                "which cannot train on a batch of 1: use --data.batch_size 2 or more (and 2 or more training images)"
            )

    # -- the applications ------------------------------------------------------------------------------------
    @staticmethod
    def save_mask(mask: Tensor | np.ndarray, path: str | Path) -> None:
        """``coretune predict``'s mask file of an image: :func:`save_palette_mask`."""
        save_palette_mask(mask, path)

    @staticmethod
    def colorize(mask: Tensor | np.ndarray) -> np.ndarray:
        """A mask's colours (``coretune predict --overlay``): :func:`colorize`."""
        return colorize(mask)

    def export_network(self, model: Any) -> nn.Module:
        """:class:`~coretune.models.DeepLabV3`: the dilated backbone under the trained DeepLab-V3 head."""
        net = DeepLabV3(model.backbone, model.num_classes or 0, self.output_stride)
        net.head = model.objective.classifier
        return net

    def export_settings(self) -> dict[str, Any]:
        return {"output_stride": self.output_stride}

    @classmethod
    def exported_network(cls, config: Mapping[str, Any]) -> nn.Module:
        stride, options = config["output_stride"], config.get("backbone_args") or {}
        backbone = create_dilated_backbone(config["backbone"], stride, verbose=False, **options)
        return DeepLabV3(backbone, config["num_classes"], stride)

    def gathers(self, objective: Objective) -> bool:
        return False  # the contrastive term is computed per process

    # -- steps ----------------------------------------------------------------------------------------------
    def features(self, backbone: nn.Module, x: Tensor) -> Tensor:
        return resnet_feature_map(backbone.body, x)

    def predict(self, objective: Objective, features: Tensor, x: Tensor) -> Tensor:
        logits = objective.classifier(features)
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)

    def loss(self, objective: Objective, features: Tensor, batch: Batch, inputs: Tensor) -> ObjectiveOutput:
        masks = batch.targets
        logits = self.predict(objective, features, masks)
        ce = self.pixel_cross_entropy(logits, masks, objective.label_smoothing)
        loss, terms = ce, {"ce": ce.detach()}
        if objective.dense_weight > 0:
            labels = image_labels(masks, objective.num_classes or 0, self.image_labels, self.ignore_index)
            con = objective.dense_loss(features.mean((2, 3)), labels)
            loss = loss + objective.dense_weight * con
            terms["con"] = con.detach()
        terms["loss"] = loss.detach()
        return ObjectiveOutput(loss, logits, terms)

    def eval_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Pixel-wise CE over the non-ignored pixels (0 for a batch without any)."""
        return self.pixel_cross_entropy(logits, targets)

    def pixel_cross_entropy(self, logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """Pixel-wise CE over the non-ignored pixels (0 for a batch without any), with ``label_smoothing`` (the
        objective's, in training)."""
        total = F.cross_entropy(
            logits.float(), targets, ignore_index=self.ignore_index, reduction="sum", label_smoothing=label_smoothing
        )
        return total / (targets != self.ignore_index).sum().clamp(min=1)

    # -- metrics and outputs --------------------------------------------------------------------------------
    def train_metrics(self, num_classes: int) -> MetricCollection:
        return MetricCollection(
            {"pixel_acc": MulticlassAccuracy(num_classes, average="micro", ignore_index=self.ignore_index)}
        )

    def val_metrics(self, num_classes: int) -> SegmentationMetrics:
        return SegmentationMetrics(num_classes, self.ignore_index)

    def val_values(self, computed: Mapping[str, Tensor]) -> dict[str, Tensor]:
        self._warn_undefined(computed, "validation")
        return {k: computed[k].float() for k in self.metric_names}

    def test_metrics(self, num_classes: int) -> SegmentationMetrics:
        return SegmentationMetrics(num_classes, self.ignore_index)

    def test_results(self, computed: Mapping[str, Tensor], class_names: list[str]) -> dict[str, Any]:
        self._warn_undefined(computed, "test")
        return {
            **{k: None if math.isnan(v := float(computed[k])) else v for k in self.metric_names},
            "per_class_iou": per_class_scores(computed["per_class_iou"], class_names),
            "per_class_accuracy": per_class_scores(computed["per_class_acc"], class_names),
            "confusion_matrix": computed["confusion"].tolist(),
        }

    def _warn_undefined(self, computed: Mapping[str, Tensor], split: str) -> None:
        """Warn (one line naming ``split``) when the split's masks hold no pixel to score: every score of it is
        then undefined, NaN in ``metrics.csv`` and ``null`` in the results' JSON, not a number to compare."""
        if int(computed["confusion"].sum()) == 0:
            chooses = "; best.ckpt cannot be chosen on it" if split == "validation" else ""
            rank_zero_warn(
                f"the {split} split's masks hold no pixel to score (every pixel is {self.ignore_index} = ignore): its "
                f"MIoU, MPA, FWIoU and pixel accuracy are undefined (null in the results' JSON){chooses}; give the "
                f"{split} images masks with labelled pixels"
            )

    def summary_line(self, test: Mapping[str, Any]) -> str:
        if test.get("miou") is None:
            return "MIoU undefined: the test masks hold no pixel to score (every pixel is ignored)"
        return (
            f"MIoU {100 * test['miou']:.2f}%  MPA {100 * test['mpa']:.2f}%  FWIoU {100 * test['fwiou']:.2f}%  "
            f"pixel accuracy {100 * test['pixel_acc']:.2f}%"
        )

    def write_figures(self, module: L.LightningModule, datamodule: TaskData, run_dir: Path) -> list[Path]:
        """``predictions.png``: the first :attr:`figure_images` validation images in loader order (with
        ``eval_mode whole``, the first images of the first size), their ground truth and the model's prediction
        (:func:`save_predictions_figure`), predicted batch by batch and padded for the figure only."""
        images, masks, predicted = [], [], []
        training = module.training
        module.eval()
        with torch.inference_mode():  # batch by batch: a batch holds images of one size, padded only for the figure
            for batch_images, batch_masks in datamodule.val_dataloader():
                wanted = self.figure_images - sum(len(m) for m in masks)
                images.append(batch_images[:wanted])
                masks.append(batch_masks[:wanted])
                predicted.append(module(images[-1].to(module.device)).argmax(1).cpu())
                if wanted <= len(batch_images):
                    break
        module.train(training)
        if not images:
            return []
        size = [max(t.shape[-2] for t in masks), max(t.shape[-1] for t in masks)]

        def padded(tensors: list[Tensor], fill: float) -> Tensor:
            pads = [(0, size[1] - t.shape[-1], 0, size[0] - t.shape[-2]) for t in tensors]
            return torch.cat([F.pad(t, pad, value=fill) for t, pad in zip(tensors, pads, strict=True)])

        x, y, predictions = padded(images, 0.0), padded(masks, self.ignore_index), padded(predicted, self.ignore_index)
        path = Path(run_dir) / "predictions.png"
        save_predictions_figure(
            x, y, predictions, path, datamodule.mean, datamodule.std, getattr(module, "class_names", None)
        )
        return [path]
