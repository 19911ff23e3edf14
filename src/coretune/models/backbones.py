"""Encoders: a name → backbone factory and registry in the spirit of ``timm.create_model``.

Every backbone is wrapped in :class:`Encoder`, which maps images ``(B, 3, H, W)`` to pooled features
``(B, d)``: the encoder ``F`` of the paper (§3), whose output ``z`` feeds the objective's heads. The wrapped
network is kept as ``.body`` with its classifier removed, so its ``state_dict`` keys are exactly
torchvision's / timm's keys minus the classifier and pre-trained checkpoints load into it (see
:mod:`coretune.models.checkpoints`).

A name is a registered coretune name (torchvision's ResNets, ``small_cnn``: what they always meant), else a timm
model name as ``timm.create_model`` takes it (``resnet10t``, ``resnet50.a1_in1k``, ``vit_small_patch16_224.dino``) or
``hf-hub:ORG/REPO``; ``timm/<model>`` is the deprecated spelling (:mod:`~coretune.models.hubnames` has the rules).
Models are built with ``weights=None`` / ``pretrained=False``, whatever the name's tag: pre-trained weights are loaded
only when ``weights`` names them — a local file, a hub name (``resnet50.a1_in1k``, ``hf-hub:ORG/REPO``) or ``hub``
(the backbone's own name) — from the local Hugging Face cache, or downloaded into it unless ``HF_HUB_OFFLINE=1`` or
``weights_download=False``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import timm
import torchvision
from torch import Tensor, nn

from .checkpoint_files import CheckpointError, hub_file
from .checkpoints import load_pretrained
from .encoder import TIMM_PREFIX, Encoder
from .hubnames import HF_HUB_PREFIX, OLD_BACKBONE_PREFIX, current_backbone_name, is_timm_name
from .registry import REGISTRY

__all__ = [
    "TIMM_PREFIX",
    "Encoder",
    "SmallCNN",
    "WeightsOptions",
    "create_backbone",
    "list_backbones",
    "register_backbone",
]

_REGISTRY: dict[str, Callable[..., Encoder]] = REGISTRY


@dataclass(frozen=True)
class WeightsOptions:
    """How pre-trained ``weights`` are read into a backbone (``coretune fit --model.weights_options.<x>``; the
    arguments of :func:`create_backbone` of the same meaning).

    Args:
        download: whether a named ``weights`` (``resnet50.a1_in1k``, ``hf-hub:<org>/<repo>``, ``hub``) missing from the
            Hugging Face cache is downloaded (needs network): None (default) as timm does, unless ``HF_HUB_OFFLINE=1``;
            True or False overrides that.
        format: the checkpoint's layout (``auto`` detects it; :func:`~coretune.models.list_layouts` lists them).
        allow_cast: load weights whose floating-point tensors are stored as integers (or quantised), converted to
            floats; refused by default, since such weights are rarely the float values.
    """

    download: bool | None = None
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
    if name.startswith((OLD_BACKBONE_PREFIX, HF_HUB_PREFIX)):
        raise ValueError(f"backbone names starting with {name.partition(':')[0].partition('/')[0]!r} are timm's")

    def decorator(factory: Callable[..., Encoder]) -> Callable[..., Encoder]:
        if name in _REGISTRY:
            raise ValueError(f"backbone {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def list_backbones() -> list[str]:
    """Names registered with coretune; :func:`create_backbone` also takes any timm model's name and
    ``hf-hub:ORG/REPO``."""
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
    weights_download: bool | None = None,
    **kwargs: Any,
) -> Encoder:
    """Build the encoder ``name`` (randomly initialised) and optionally load pre-trained ``weights``.

    Args:
        name: a registered name (:func:`list_backbones`), a timm model name (``resnet10t``, ``resnet50.a1_in1k``:
            its tag picks timm's pretrained config, no weights) or ``hf-hub:ORG/REPO`` (``timm/<model>``: deprecated).
        weights: a local checkpoint (``.pth``/``.pth.tar``/``.ckpt``/``.safetensors``) to load into the body (a file
            that exists always wins), or a hub name: ``<timm model>[.<tag>]``, ``hf-hub:<org>/<repo>``, or ``hub`` for
            the weights ``name`` names.
        weights_format: checkpoint layout (``"auto"`` detects it; see :func:`~coretune.models.list_layouts`).
        verbose: print the one-line load summary.
        allow_missing: accept a checkpoint that lacks backbone tensors (reported either way).
        allow_unexpected: accept a checkpoint with extra tensors (reported either way).
        allow_cast: accept integer or quantised tensors where the backbone has floats, converted (reported).
        weights_download: download named ``weights`` (and an ``hf-hub:`` backbone's ``config.json``) missing from the
            Hugging Face cache (network): None follows ``HF_HUB_OFFLINE``, True / False override it.
        **kwargs: passed to the model constructor, e.g. ``img_size=32`` for a timm ViT.
    """
    name = current_backbone_name(name)
    if name in _REGISTRY:
        try:
            encoder = _REGISTRY[name](**kwargs)
        except TypeError as err:
            raise ValueError(_refused_options(name, kwargs, err)) from err
    elif name.startswith(HF_HUB_PREFIX):
        encoder = _hub_encoder(name, weights_download, **kwargs)
    elif is_timm_name(name):
        encoder = _timm_encoder(name, name, **kwargs)
    else:
        close = timm.list_models(f"*{name.partition('.')[0]}*")[:8] if name and "/" not in name else []
        hint = f" (similar timm models: {', '.join(close)})" if close else ""
        raise ValueError(
            f"unknown backbone {name!r}{hint}: choose one of {', '.join(list_backbones())}, a timm model name "
            "(e.g. 'vit_small_patch16_224.dino', 'resnet50.a1_in1k'; timm.list_models() lists them), or "
            "'hf-hub:ORG/REPO'"
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


DROP_PATH_OPTION = "drop_path_rate"
"""The constructor option of timm models that sets the stochastic depth (drop path) rate: ``--model.drop_path``."""


def _refused_options(name: str, kwargs: dict[str, Any], err: TypeError, what: str = "backbone") -> str:
    """The one line that says the backbone ``name`` refused the constructor options ``kwargs`` (``err``: why); a
    drop path rate gets its own, naming the backbones that take one."""
    if DROP_PATH_OPTION in kwargs and DROP_PATH_OPTION in str(err):
        return (
            f"{what} {name!r} has no drop path (stochastic depth) to set: --model.drop_path (backbone_args "
            f"{DROP_PATH_OPTION}) needs a timm model that takes it (vit_small_patch16_224, deit_small_patch16_224, "
            "timm's ResNets such as resnet50.tv_in1k); drop it for this backbone"
        )
    return f"{what} {name!r} does not accept options {sorted(kwargs)}: {err}"


def _hub_encoder(name: str, download: bool | None, **kwargs: Any) -> Encoder:
    """The timm model of hub repository ``name`` (``hf-hub:ORG/REPO``), built from its ``config.json`` (from the
    local Hugging Face cache, or downloaded as ``download`` says), never pre-trained."""
    repo_id = name[len(HF_HUB_PREFIX) :]
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        raise ValueError(f"malformed backbone name {name!r}: write hf-hub:ORG/REPO (e.g. hf-hub:timm/resnet18.a1_in1k)")
    config = hub_file(repo_id, None, ("config.json",), download, f"the config of backbone {name}")
    assert config is not None  # fetch: a path or an error
    try:
        json.loads(config.read_text())["architecture"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{config} is no timm model config (config.json with an 'architecture'): {err}") from err
    return _timm_encoder(f"local-dir:{config.parent}", name, **kwargs)


def _timm_encoder(model_name: str, name: str, **kwargs: Any) -> Encoder:
    """Any timm model without its classifier (``num_classes=0`` keeps the pooling), never pre-trained: the timm name
    ``model_name`` (or ``local-dir:FOLDER`` of a hub model's config), called ``name``.

    Models with a fixed input size (ViTs: ``img_size``) are built with ``dynamic_img_size=True`` unless ``kwargs``
    set ``img_size`` or ``dynamic_img_size``: they then take any image size (the position embedding is
    interpolated at each forward), so a ViT pre-trained at 224 px fine-tunes at 64 px with its weights as they are.
    """
    body, options = None, dict(kwargs)
    try:
        if not {"img_size", "dynamic_img_size"} & set(kwargs):
            try:
                options = {**kwargs, "dynamic_img_size": True}
                body = timm.create_model(model_name, pretrained=False, num_classes=0, **options)
            except TypeError:
                body, options = None, dict(kwargs)  # a model without that option (CNNs take any size anyway)
        if body is None:
            try:
                body = timm.create_model(model_name, pretrained=False, num_classes=0, **options)
            except TypeError as err:
                raise ValueError(_refused_options(name, kwargs, err, "timm model")) from err
    except RuntimeError as err:  # "Invalid pretrained tag (x) for resnet18."
        arch = name.partition(".")[0]
        raise ValueError(f"backbone {name!r}: {err} timm.list_pretrained('{arch}.*') lists the valid tags") from err
    classifier = body.pretrained_cfg.get("classifier") or ()
    classifier_names = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    stage_names = tuple(info["module"] for info in getattr(body, "feature_info", None) or ())
    return Encoder(
        body,
        int(body.num_features),
        name,
        classifier_names,
        stage_names,
        is_timm=True,
        timm_model=(model_name, options),
    )


CIFAR_STEM_OPTION = "cifar_stem"
"""The constructor option of coretune's ResNets that builds the CIFAR stem (``--model.backbone_args '{cifar_stem:
true}'``)."""


def _torchvision_resnet(arch: str, cifar_stem: bool = False, **kwargs: Any) -> Encoder:
    """A torchvision ResNet/ResNeXt/Wide-ResNet with ``fc`` replaced by identity (``d = fc.in_features``).

    ``cifar_stem``: the stem of the CIFAR ResNets of SimCLR (Chen et al., 2020, Appendix B.9), MoCo's CIFAR-10 demo
    and solo-learn, for 32-px images: ``conv1`` a 3×3 convolution with stride 1 (ImageNet's: 7×7, stride 2) and no
    max pooling, so ``layer1`` sees the image at full resolution (32×32 rather than 8×8) and ``layer4`` at 4×4
    (rather than 1×1), for about 15 times the computation at a given image size. Tensor names are unchanged:
    ``conv1.weight`` is ``(64, 3, 3, 3)``, so checkpoints of such networks (solo-learn's CIFAR ones) load, and an
    ImageNet ResNet's 7×7 ``conv1`` does not (its shape differs: the load report names it).
    """
    if not isinstance(cifar_stem, bool):
        raise ValueError(f"backbone {arch!r}: {CIFAR_STEM_OPTION} must be true or false (got {cifar_stem!r})")
    body = getattr(torchvision.models, arch)(weights=None, **kwargs)
    if cifar_stem:
        body.conv1 = nn.Conv2d(3, body.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(body.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's init
        body.maxpool = nn.Identity()
    feature_dim = body.fc.in_features
    body.fc = nn.Identity()
    # timm's model of that name has the same tensors and outputs (not with a CIFAR stem or other options)
    timm_model = (arch, {}) if not kwargs and not cifar_stem else None
    return Encoder(body, feature_dim, arch, ("fc",), ("layer1", "layer2", "layer3", "layer4"), timm_model=timm_model)


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
