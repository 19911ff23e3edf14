"""Backbone and weights names as their owners write them: timm's model names and Hugging Face hub repositories.

- **A backbone** (``--model.backbone``) is a coretune name (:func:`~coretune.models.list_backbones`: torchvision's
  ``resnet18`` … ``wide_resnet50_2``, ``small_cnn``), which keeps meaning what it always meant; else a timm model name
  as ``timm.create_model`` takes it (``resnet10t``, ``resnet50.a1_in1k``, ``vit_small_patch16_224.dino``), or
  ``hf-hub:ORG/REPO`` (a timm model on the hub, built from its ``config.json``). timm's ``resnet50`` is not
  torchvision's: name timm's with its tag (``resnet50.a1_in1k``). A tag picks timm's pretrained config, as in timm;
  it never loads weights by itself: coretune loads weights only when ``--model.weights`` asks.
- **Weights** (``--model.weights``): a file that exists always wins; else ``hub`` (:data:`HUB_KEYWORD`: the weights
  the backbone's name names — ``resnet50.a1_in1k``'s, timm's default tag's for ``resnet10t``, or the ``hf-hub:``
  repository's), a timm name (``resnet50.a1_in1k``; ``resnet50`` is timm's default tag), or
  ``hf-hub:ORG/REPO[@REVISION]``; else a path (a missing one is an error that names it). A string with a path
  separator or a checkpoint suffix (``.pth``, ``.pt``, ``.ckpt``, ``.safetensors``, ``.bin``, ``.tar``) is a path.
- **Downloads**: a named weights file (or an ``hf-hub:`` backbone's ``config.json``) is read from the local Hugging
  Face cache first, with no network call. One missing from it is downloaded as timm would
  (:func:`downloads_allowed`): unless ``HF_HUB_OFFLINE=1``; ``--model.weights_options.download true`` / ``false``
  overrides that (with true, coretune asks huggingface_hub to download whatever ``HF_HUB_OFFLINE`` says; a
  huggingface_hub imported under ``HF_HUB_OFFLINE=1`` still refuses, and the message says so).
- **Old spellings** work for one more release, with one line on stderr the first time each is met:
  ``timm/<model>`` backbones (now ``<model>``; ``timm/resnet50``, which a coretune name shadows, is
  ``resnet50.<timm's default tag>``) and ``timm:<model>`` weights (now ``<model>``). Recorded settings (checkpoints,
  ``config.yaml``, exports) are read with the new spelling silently (:func:`current_backbone_name` with
  ``warn=False``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import CheckpointError
from .registry import REGISTRY

__all__ = [
    "HF_HUB_PREFIX",
    "HUB_KEYWORD",
    "OLD_BACKBONE_PREFIX",
    "OLD_WEIGHTS_PREFIX",
    "current_backbone_name",
    "current_weights_name",
    "downloads_allowed",
    "hub_offline",
    "is_timm_name",
    "named_weights",
    "timm_backbone",
]

HUB_KEYWORD = "hub"
"""``--model.weights hub``: the weights the backbone's name names (a timm name's tag, an ``hf-hub:`` repository)."""
HF_HUB_PREFIX = "hf-hub:"
"""A Hugging Face hub repository, ``hf-hub:ORG/REPO`` (weights: ``[@REVISION]`` too), as timm writes it."""
OLD_BACKBONE_PREFIX = "timm/"
"""Deprecated: ``timm/<model>`` backbones (now ``<model>``)."""
OLD_WEIGHTS_PREFIX = "timm:"
"""Deprecated: ``timm:<model>`` weights (now ``<model>``)."""

_PATH_SUFFIXES = (".pth", ".pt", ".ckpt", ".safetensors", ".bin", ".tar", ".pkl", ".npz")
_WARNED: set[str] = set()


def _warn_once(old: str, what: str, new: str) -> None:
    if old not in _WARNED:
        _WARNED.add(old)
        print(
            f"coretune: {what} {old!r} is deprecated and will be removed in the next release: use {new!r}",
            file=sys.stderr,
        )


def is_timm_name(name: str) -> bool:
    """Whether ``name`` is a timm model name (``resnet10t``, ``resnet50.a1_in1k``; the tag is not checked here) and
    cannot be a path: no path separator, no checkpoint suffix."""
    if not name or "/" in name or os.sep in name or name.lower().endswith(_PATH_SUFFIXES):
        return False
    import timm

    return bool(timm.is_model(name))


def _default_tag(model: str) -> str:
    """``model`` with timm's default pretrained tag (``resnet50`` → ``resnet50.a1_in1k``); ``model`` if it has none."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(model)
    return f"{model}.{cfg.tag}" if cfg is not None and getattr(cfg, "tag", None) else model


def timm_backbone(model: str) -> str:
    """The backbone name that builds timm's model ``model`` (or an ``hf-hub:`` one): ``model`` itself, or
    ``model.<timm's default tag>`` where a coretune name shadows it (``resnet50`` → ``resnet50.a1_in1k``)."""
    return _default_tag(model) if model in REGISTRY else model


def current_backbone_name(name: str, warn: bool = True) -> str:
    """``name`` as written now: ``timm/<model>`` (deprecated; one stderr line when ``warn``) becomes ``<model>``, or
    ``<model>.<timm's default tag>`` when ``<model>`` is a coretune name (``timm/resnet50`` → ``resnet50.a1_in1k``:
    coretune's ``resnet50`` is torchvision's); any other name is returned as it is."""
    if not name.startswith(OLD_BACKBONE_PREFIX):
        return name
    new = timm_backbone(name[len(OLD_BACKBONE_PREFIX) :])
    if warn:
        _warn_once(name, "backbone name", new)
    return new


def current_weights_name(weights: str | Path, warn: bool = True) -> str | Path:
    """``weights`` as written now: ``timm:<model>`` (deprecated; one stderr line when ``warn``) becomes ``<model>``
    unless a file of that name exists (it wins); anything else is returned as it is."""
    text = str(weights)
    if not text.startswith(OLD_WEIGHTS_PREFIX) or Path(text).exists():
        return weights
    new = text[len(OLD_WEIGHTS_PREFIX) :]
    if warn:
        _warn_once(text, "weights name", new)
    return new


def named_weights(weights: str | Path, backbone: str | None) -> str | Path:
    """The weights ``weights`` names, the :data:`HUB_KEYWORD` replaced by the backbone's name (a timm name or an
    ``hf-hub:`` repository) and old spellings by new ones; a file that exists is returned as it is.

    Raises:
        ValueError: ``hub`` without a backbone, or with a coretune backbone (whose name names no weights).
    """
    if Path(weights).exists():
        return weights
    weights = current_weights_name(weights)
    if str(weights) != HUB_KEYWORD:
        return weights
    name = current_backbone_name(backbone, warn=False) if backbone else None
    if name is None or name in REGISTRY:
        what = f"the coretune backbone {name!r} (not a timm model)" if name else "no backbone"
        raise CheckpointError(
            f"--model.weights {HUB_KEYWORD} loads the weights the backbone's name names, and {what} names none: "
            "give a timm backbone (e.g. --model.backbone resnet50.a1_in1k) or the weights' name or file as "
            "--model.weights (e.g. resnet50.a1_in1k, hf-hub:ORG/REPO)"
        )
    return name


def downloads_allowed(download: bool | None) -> bool:
    """Whether a name missing from the Hugging Face cache may be downloaded: ``download`` when given
    (``--model.weights_options.download``), else unless ``HF_HUB_OFFLINE`` is set true (as timm and
    huggingface_hub do; read now, not at import)."""
    if download is not None:
        return bool(download)
    return not hub_offline()


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set true (``1``, ``true``, ``yes``, ``on``) in the environment now."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "TRUE", "YES", "ON"}
