"""``coretune export --format timm``: a fine-tuned classifier as a timm model folder, back into the ecosystem.

The folder ``OUTPUT/timm/`` holds ``model.safetensors`` (the backbone and the classifier under timm's own key names)
and ``config.json`` as timm writes it (``timm.models.save_for_hf``: ``architecture``, ``num_classes``,
``model_args``, ``label_names``, and ``pretrained_cfg`` with the fine-tuning's ``mean``, ``std`` and
``input_size``). timm loads it as it loads its own::

    model = timm.create_model("local-dir:OUTPUT/timm", pretrained=True)
    # or by architecture, the file given (num_classes in the overlay too, else timm drops the classifier):
    model = timm.create_model(ARCH, pretrained=True, num_classes=K,
                              pretrained_cfg_overlay=dict(file="OUTPUT/timm/model.safetensors", num_classes=K))

and the folder can be pushed to the Hugging Face hub as it is (``hf upload ORG/REPO OUTPUT/timm``), after which
``timm.create_model("hf-hub:ORG/REPO", pretrained=True)`` and ``coretune fit --model.backbone hf-hub:ORG/REPO
--model.weights hub`` read it. A timm backbone exports as its own model; a torchvision ResNet (coretune's ``resnet18``
… ``wide_resnet50_2``) as timm's model of the same name, which has the same tensors under the same names and computes
the same logits (the export checks it, as it checks every format). Other backbones (``small_cnn``) and segmentation
models have no timm model and are refused before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import timm
from torch import nn

from ..models.exported import ExportedClassifier

__all__ = [
    "TIMM_CONFIG",
    "TIMM_WEIGHTS",
    "check_timm_exportable",
    "load_timm_export",
    "timm_classifier",
    "write_timm_export",
]

TIMM_WEIGHTS = "timm/model.safetensors"
TIMM_CONFIG = "timm/config.json"
_OTHERS = "choose other formats (--format safetensors,pt2,onnx)"


def check_timm_exportable(net: nn.Module, dense: bool) -> None:
    """Raise ``ValueError`` (one line) unless ``net`` (a task's export network) is a classifier whose backbone timm has
    a model of (``Encoder.timm_model``)."""
    if dense or not isinstance(net, ExportedClassifier):
        raise ValueError(
            f"--format timm writes a classifier as a timm model, and this checkpoint's model ({type(net).__name__}) is "
            f"none: {_OTHERS}"
        )
    encoder = net.backbone
    if getattr(encoder, "timm_model", None) is None:
        raise ValueError(
            f"--format timm needs a timm backbone or a torchvision ResNet without backbone_args, and backbone "
            f"{encoder.name!r} has no timm model: {_OTHERS}"
        )


def timm_classifier(net: ExportedClassifier) -> nn.Module:
    """The timm model of ``net``'s backbone with ``net``'s classifier as its head, every tensor copied (strict), in
    eval mode; ``ValueError`` when timm's model does not take those tensors."""
    encoder, classifier = net.backbone, net.classifier
    name, options = encoder.timm_model
    model = timm.create_model(name, pretrained=False, num_classes=classifier.out_features, **options)
    head = model.pretrained_cfg.get("classifier")
    state = dict(encoder.body.state_dict())
    if isinstance(head, str):
        state |= {f"{head}.weight": classifier.weight, f"{head}.bias": classifier.bias}
    try:
        if not isinstance(head, str):
            raise RuntimeError(f"its classifier is {head!r}, not one linear layer")
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        reason = " ".join(str(err).split())[:300]
        raise ValueError(f"backbone {encoder.name!r} does not fit timm's {name!r} ({reason}): {_OTHERS}") from err
    return model.eval()


def write_timm_export(net: ExportedClassifier, folder: Path, config: dict[str, Any], size: int) -> None:
    """Write ``net`` as a timm model into ``folder`` (``model.safetensors``, ``config.json``); ``config`` is the
    export's (``class_names``, ``mean``, ``std``), ``size`` the training image size."""
    from timm.models import save_for_hf

    data: dict[str, Any] = {"input_size": (3, size, size)}
    if config.get("mean") is not None and config.get("std") is not None:
        data |= {"mean": tuple(config["mean"]), "std": tuple(config["std"])}
    labels = {"label_names": list(config["class_names"])} if config.get("class_names") else {}
    save_for_hf(timm_classifier(net), str(folder), model_config=labels, safe_serialization=True, data_config=data)


def load_timm_export(folder: str | Path) -> nn.Module:
    """The model of a timm export folder as a user of timm builds it: ``timm.create_model(architecture,
    pretrained=True)`` with the folder's ``model.safetensors`` as the file, its ``num_classes`` and ``model_args``."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    classes = cfg["num_classes"]
    overlay = {"file": str(folder / "model.safetensors"), "num_classes": classes}
    options = {**(cfg.get("model_args") or {}), "num_classes": classes}
    return timm.create_model(cfg["architecture"], pretrained=True, pretrained_cfg_overlay=overlay, **options).eval()
