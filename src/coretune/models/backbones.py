"""Encoders: a name → backbone factory and registry in the spirit of ``timm.create_model``.

Every backbone is wrapped in :class:`Encoder`, which maps images ``(B, 3, H, W)`` to pooled features
``(B, d)``: the encoder ``F`` of the paper (§3), whose output ``z`` feeds the objective's heads. The wrapped
network is kept as ``.body`` with its classifier removed, so its ``state_dict`` keys are exactly
torchvision's / timm's keys minus the classifier and pre-trained checkpoints load into it (see
:mod:`coretune.models.checkpoints`).

Nothing here downloads: torchvision models are built with ``weights=None`` and timm models with
``pretrained=False``; pre-trained weights come from a local file passed as ``weights``, or a name found in the local
Hugging Face cache (``timm:resnet18.a1_in1k``, ``hf-hub:ORG/REPO``), downloaded only with ``weights_download=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import timm
import torchvision
from torch import Tensor, nn

from .checkpoints import load_pretrained
from .encoder import TIMM_PREFIX, Encoder

__all__ = [
    "TIMM_PREFIX",
    "Encoder",
    "SmallCNN",
    "WeightsOptions",
    "create_backbone",
    "list_backbones",
    "register_backbone",
]

_REGISTRY: dict[str, Callable[..., Encoder]] = {}


@dataclass(frozen=True)
class WeightsOptions:
    """How pre-trained ``weights`` are read into a backbone (``coretune fit --model.weights_options.<x>``; the
    arguments of :func:`create_backbone` of the same meaning).

    Args:
        download: download a named ``weights`` (``timm:<model>``, ``hf-hub:<org>/<repo>``) missing from the Hugging
            Face cache (needs network; off by default, when nothing is ever downloaded).
        format: the checkpoint's layout (``auto`` detects it; :func:`~coretune.models.list_layouts` lists them).
        allow_cast: load weights whose floating-point tensors are stored as integers (or quantised), converted to
            floats; refused by default, since such weights are rarely the float values.
    """

    download: bool = False
    format: str = "auto"
    allow_cast: bool = False


_TORCHVISION_RESNETS = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "wide_resnet50_2",
)


def register_backbone(name: str) -> Callable[[Callable[..., Encoder]], Callable[..., Encoder]]:
    """Register ``factory(**kwargs) -> Encoder`` as ``name`` (a decorator, like timm's ``register_model``)."""
    if name.startswith(TIMM_PREFIX):
        raise ValueError(f"backbone names starting with {TIMM_PREFIX!r} are reserved for timm models")

    def decorator(factory: Callable[..., Encoder]) -> Callable[..., Encoder]:
        if name in _REGISTRY:
            raise ValueError(f"backbone {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def list_backbones() -> list[str]:
    """Names accepted by :func:`create_backbone`, besides ``timm/<name>`` for any timm model."""
    return sorted(_REGISTRY)


def create_backbone(
    name: str,
    weights: str | Path | None = None,
    weights_format: str = "auto",
    verbose: bool = True,
    *,
    allow_missing: bool = False,
    allow_unexpected: bool = False,
    allow_cast: bool = False,
    weights_download: bool = False,
    **kwargs: Any,
) -> Encoder:
    """Build the encoder ``name`` (randomly initialised) and optionally load pre-trained ``weights``.

    Args:
        name: a registered name (:func:`list_backbones`) or ``timm/<model>`` for any timm model.
        weights: a local checkpoint (``.pth``/``.pth.tar``/``.ckpt``/``.safetensors``) to load into the body, or a
            name in the local Hugging Face cache (``timm:<model>[.<tag>]``, ``hf-hub:<org>/<repo>``).
        weights_format: checkpoint layout (``"auto"`` detects it; see :func:`~coretune.models.list_layouts`).
        verbose: print the one-line load summary.
        allow_missing: accept a checkpoint that lacks backbone tensors (reported either way).
        allow_unexpected: accept a checkpoint with extra tensors (reported either way).
        allow_cast: accept integer or quantised tensors where the backbone has floats, converted (reported).
        weights_download: download named ``weights`` missing from the Hugging Face cache (network); never by default.
        **kwargs: passed to the model constructor, e.g. ``img_size=32`` for a timm ViT.
    """
    if name.startswith(TIMM_PREFIX):
        encoder = _timm_encoder(name[len(TIMM_PREFIX) :], **kwargs)
    elif name in _REGISTRY:
        try:
            encoder = _REGISTRY[name](**kwargs)
        except TypeError as err:
            raise ValueError(f"backbone {name!r} does not accept options {sorted(kwargs)}: {err}") from err
    else:
        raise ValueError(
            f"unknown backbone {name!r}: choose one of {', '.join(list_backbones())}, "
            f"or '{TIMM_PREFIX}<name>' for any timm model (e.g. '{TIMM_PREFIX}vit_tiny_patch16_224'; "
            "timm.list_models() lists them)"
        )
    if weights is not None:
        report = load_pretrained(
            encoder,
            weights,
            weights_format,
            allow_missing=allow_missing,
            allow_unexpected=allow_unexpected,
            allow_cast=allow_cast,
            download=weights_download,
        )
        encoder.pretrained_normalization = report.normalization
        if verbose:
            from rich.console import Console

            Console(stderr=True).print(
                f"{name} ← {weights}: {report.summary()}", highlight=False, markup=False, soft_wrap=True
            )
    return encoder


def _timm_encoder(model_name: str, **kwargs: Any) -> Encoder:
    """Any timm model without its classifier (``num_classes=0`` keeps the pooling), never pre-trained.

    Models with a fixed input size (ViTs: ``img_size``) are built with ``dynamic_img_size=True`` unless ``kwargs``
    set ``img_size`` or ``dynamic_img_size``: they then take any image size (the position embedding is
    interpolated at each forward), so a ViT pre-trained at 224 px fine-tunes at 64 px with its weights as they are.
    """
    if not timm.is_model(model_name):
        close = timm.list_models(f"*{model_name}*")[:8]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise ValueError(f"unknown timm model {model_name!r}{hint}: timm.list_models() lists the valid names")
    body = None
    if not {"img_size", "dynamic_img_size"} & set(kwargs):
        try:
            body = timm.create_model(model_name, pretrained=False, num_classes=0, dynamic_img_size=True, **kwargs)
        except TypeError:
            body = None  # a model without that option (CNNs take any size anyway)
    if body is None:
        try:
            body = timm.create_model(model_name, pretrained=False, num_classes=0, **kwargs)
        except TypeError as err:
            raise ValueError(f"timm model {model_name!r} does not accept options {sorted(kwargs)}: {err}") from err
    classifier = body.pretrained_cfg.get("classifier") or ()
    classifier_names = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    stage_names = tuple(info["module"] for info in getattr(body, "feature_info", None) or ())
    return Encoder(body, int(body.num_features), TIMM_PREFIX + model_name, classifier_names, stage_names)


def _torchvision_resnet(arch: str, **kwargs: Any) -> Encoder:
    """A torchvision ResNet/ResNeXt/Wide-ResNet with ``fc`` replaced by identity (``d = fc.in_features``)."""
    body = getattr(torchvision.models, arch)(weights=None, **kwargs)
    feature_dim = body.fc.in_features
    body.fc = nn.Identity()
    return Encoder(body, feature_dim, arch, ("fc",), ("layer1", "layer2", "layer3", "layer4"))


for _arch in _TORCHVISION_RESNETS:
    register_backbone(_arch)(partial(_torchvision_resnet, _arch))


class SmallCNN(nn.Module):
    """Four conv–BN–ReLU blocks (widths ``32-64-128-256``, stride 2 after the first), global average pool.

    A fast stand-in for a ResNet in tests and CPU demos on 8–32 px images; its BatchNorm buffers make it
    behave like a real backbone when checkpoints are saved and loaded.
    """

    def __init__(self, widths: tuple[int, int, int, int] = (32, 64, 128, 256), in_chans: int = 3) -> None:
        super().__init__()
        channels = (in_chans, *widths)
        for i in range(4):
            block = nn.Sequential(
                nn.Conv2d(channels[i], channels[i + 1], 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                nn.BatchNorm2d(channels[i + 1]),
                nn.ReLU(inplace=True),
            )
            self.add_module(f"layer{i + 1}", block)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.num_features = widths[-1]

    def forward(self, x: Tensor) -> Tensor:
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.pool(x)


@register_backbone("small_cnn")
def small_cnn(**kwargs: Any) -> Encoder:
    """:class:`SmallCNN` (``d = 256`` by default) for tests and CPU demos."""
    body = SmallCNN(**kwargs)
    return Encoder(body, body.num_features, "small_cnn", ("fc",), ("layer1", "layer2", "layer3", "layer4"))
