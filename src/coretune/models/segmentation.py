"""DeepLab-V3 (Chen et al. 2017) for semantic segmentation: torchvision's ASPP head on a dilated coretune ResNet.

The backbone is built by :func:`~coretune.models.create_backbone`, so pre-trained weights go through the same
checkpoint loader and load report as classification; dilation changes strides and paddings only, never a
tensor's shape, so the weights are loaded first and the last stages dilated afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.resnet import ResNet
from torchvision.models.segmentation.deeplabv3 import DeepLabHead

from .backbones import _TORCHVISION_RESNETS, Encoder, create_backbone

__all__ = [
    "DILATION_BY_OUTPUT_STRIDE",
    "DeepLabV3",
    "create_deeplabv3",
    "create_dilated_backbone",
    "dilate_resnet",
    "resnet_feature_map",
]

DILATION_BY_OUTPUT_STRIDE: dict[int, list[bool]] = {16: [False, False, True], 8: [False, True, True]}
"""torchvision's ``replace_stride_with_dilation`` for ``layer2``–``layer4`` at each output stride."""


def dilate_resnet(resnet: ResNet, replace_stride_with_dilation: list[bool]) -> None:
    """Replace the stride of ``layer2``–``layer4`` by dilation where asked, in place, exactly as torchvision's
    ``ResNet(replace_stride_with_dilation=…)`` builds it: the stage's first block keeps the previous dilation with
    stride 1, its other blocks dilate by twice as much per dilated stage.

    torchvision refuses dilation for ``BasicBlock`` (ResNet-18/34: ``NotImplementedError``) only because its
    constructor passes one ``dilation`` to a block whose two 3×3 convolutions would both need it; this sets it
    on every 3×3 convolution of the block, so ResNet-18/34 dilate like the Bottleneck ResNets (a test checks
    that for ResNet-50 the result computes the same as torchvision's own dilated model).
    """
    dilation = 1
    for name, dilate in zip(("layer2", "layer3", "layer4"), replace_stride_with_dilation, strict=True):
        if not dilate:
            continue
        previous, dilation = dilation, dilation * 2
        for index, block in enumerate(getattr(resnet, name)):
            rate = previous if index == 0 else dilation
            for conv in block.modules():
                if not isinstance(conv, nn.Conv2d):
                    continue
                conv.stride = (1, 1)
                if conv.kernel_size == (3, 3):
                    conv.dilation, conv.padding = (rate, rate), (rate, rate)


def resnet_feature_map(body: ResNet, x: Tensor) -> Tensor:
    """A ResNet's last stage output ``(B, C, ⌈H/os⌉, ⌈W/os⌉)`` (stem, ``layer1``–``layer4``, no pooling)."""
    x = body.maxpool(body.relu(body.bn1(body.conv1(x))))
    return body.layer4(body.layer3(body.layer2(body.layer1(x))))


class DeepLabV3(nn.Module):
    """A ResNet encoder, dilated to ``output_stride``, under torchvision's DeepLab-V3 head (ASPP + 3×3 conv + 1×1
    classifier).

    ``forward(x)`` returns the class logits ``(B, K, H, W)`` bilinearly upsampled to the input's size;
    :meth:`forward_with_features` also returns the backbone's last feature map ``(B, C, H/os, W/os)``, on which
    the Core-tuning regulariser acts after global average pooling (``feature_map.mean((2, 3))``, which equals
    ``encoder(x)``, the encoder's pooled features).

    Attributes:
        encoder: the :class:`~coretune.models.Encoder` (its ``body`` the dilated ResNet, ``fc`` removed), so
            objectives and checkpoints see the same module as in classification.
        head: torchvision's :class:`~torchvision.models.segmentation.deeplabv3.DeepLabHead`.
        output_stride: input size ÷ feature-map size (16 or 8).
    """

    def __init__(self, encoder: Encoder, num_classes: int, output_stride: int = 16) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = DeepLabHead(encoder.feature_dim, num_classes)
        self.num_classes, self.output_stride = num_classes, output_stride

    def feature_map(self, x: Tensor) -> Tensor:
        """The last stage's output ``(B, C, ⌈H/os⌉, ⌈W/os⌉)`` (:func:`resnet_feature_map`)."""
        return resnet_feature_map(self.encoder.body, x)

    def forward_with_features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(logits (B, K, H, W) upsampled to the input size, last feature map (B, C, h, w))``."""
        features = self.feature_map(x)
        logits = F.interpolate(self.head(features), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return logits, features

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with_features(x)[0]


def create_deeplabv3(
    backbone: str,
    num_classes: int,
    output_stride: Literal[16, 8] = 16,
    weights: str | Path | None = None,
    weights_format: str = "auto",
    verbose: bool = True,
) -> DeepLabV3:
    """DeepLab-V3 on the coretune ResNet ``backbone`` (``resnet18`` … ``wide_resnet50_2``).

    ``weights`` (a local checkpoint of any layout coretune reads, see :func:`~coretune.models.load_pretrained`)
    is loaded into the backbone by :func:`~coretune.models.create_backbone`, which prints its load report when
    ``verbose``; the head starts from torchvision's initialisation.

    Raises:
        ValueError: ``backbone`` is not a torchvision ResNet, ``output_stride`` is not 16 or 8, or
            ``num_classes < 2``.
        CheckpointError: the weights cannot be read or do not fit the backbone.
    """
    if num_classes < 2:
        raise ValueError(f"segmentation needs at least 2 classes, got {num_classes}")
    encoder = create_dilated_backbone(
        backbone, output_stride, weights=weights, weights_format=weights_format, verbose=verbose
    )
    return DeepLabV3(encoder, num_classes, output_stride)


def create_dilated_backbone(backbone: str, output_stride: int = 16, **options: Any) -> Encoder:
    """The coretune ResNet ``backbone`` (:func:`~coretune.models.create_backbone` with ``options``: weights, load
    report …), its last stages dilated to ``output_stride`` (:data:`DILATION_BY_OUTPUT_STRIDE`).

    Raises:
        ValueError: ``backbone`` is not a torchvision ResNet, or ``output_stride`` is not 16 or 8.
    """
    if output_stride not in DILATION_BY_OUTPUT_STRIDE:
        raise ValueError(f"output_stride must be 16 or 8 for DeepLab-V3, got {output_stride}")
    if backbone not in _TORCHVISION_RESNETS:
        raise ValueError(
            f"DeepLab-V3 needs a ResNet backbone ({', '.join(_TORCHVISION_RESNETS)}), got {backbone!r}: "
            "its last stages are dilated, which only these support here"
        )
    encoder = create_backbone(backbone, **options)
    dilate_resnet(encoder.body, DILATION_BY_OUTPUT_STRIDE[output_stride])
    return encoder
