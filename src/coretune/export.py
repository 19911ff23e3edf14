"""Export a fine-tuned model as ``config.json`` plus the formats asked for — ``model.safetensors``, a
``torch.export`` program, TorchScript, ONNX — and load it back: a classifier (images → class logits ``(B, K)``) or,
for a segmentation checkpoint, the DeepLab-V3 model (images → per-pixel logits ``(B, K, H, W)`` at the input's
size, any size in every format)."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch._dynamo.exc import UserError
from torch.fx.experimental import _config as fx_config

from .engine import FineTuner
from .models import DeepLabV3, create_backbone, create_deeplabv3
from .models.segmentation import AtrousConv2d
from .runconfig import check_config_task

__all__ = [
    "DEFAULT_FORMATS",
    "EXPORT_FORMATS",
    "ExportedClassifier",
    "check_formats",
    "export_checkpoint",
    "load_exported",
]

EXPORT_FORMAT = "coretune-export-1"

#: Every export format and the file it writes, in the order they are written.
EXPORT_FORMATS: dict[str, str] = {
    "safetensors": "model.safetensors",
    "pt2": "model.pt2",
    "torchscript": "model.torchscript.pt",
    "onnx": "model.onnx",
}
#: What ``coretune export`` writes without ``--format``.
DEFAULT_FORMATS: tuple[str, ...] = ("safetensors", "pt2", "torchscript")


class ExportedClassifier(nn.Module):
    """A fine-tuned backbone and its classifier ``G_y``: images → class logits."""

    def __init__(self, backbone: nn.Module, classifier: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone
        self.classifier = classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.backbone(x))


def check_formats(formats: str | Sequence[str]) -> list[str]:
    """``formats`` (a name, a comma-separated list of names, or a list of them) as a list of
    :data:`EXPORT_FORMATS` names, in the order they are written, each once; ``ValueError`` naming the valid
    formats for an unknown name or none."""
    values = [formats] if isinstance(formats, str) else formats
    names = [name.strip() for value in values for name in str(value).split(",") if name.strip()]
    unknown = [name for name in names if name not in EXPORT_FORMATS]
    valid = ", ".join(EXPORT_FORMATS)
    if unknown:
        raise ValueError(f"unknown export format {unknown[0]!r}: choose one or more of {valid} (--format onnx,pt2)")
    if not names:
        raise ValueError(f"--format names no format: choose one or more of {valid}")
    return [name for name in EXPORT_FORMATS if name in names]


def _require_onnx() -> None:
    """Refuse the ONNX format before anything is written when the exporter's packages are missing."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"ONNX export needs the onnx extra ({err.name} is not installed): pip install 'coretune[onnx]'"
        ) from None


def _without_atrous_shortcut(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose :class:`~coretune.models.AtrousConv2d` layers are plain ``nn.Conv2d`` (the same
    weights and outputs): their shortcut branches on the feature map's size, which a traced or exported graph
    would fix at the example's size."""
    net = copy.deepcopy(net)
    for module in net.modules():
        if isinstance(module, AtrousConv2d):
            module.__class__ = nn.Conv2d
    return net


def _export_classifier(net: nn.Module, inputs: tuple[Tensor]) -> tuple[torch.export.ExportedProgram, tuple[dict]]:
    """``net`` as a ``torch.export`` program and the dynamic shapes it was exported with: any batch size and, if
    its graph allows, any image size (``batch``, ``height``, ``width``). A CNN's does, but a ResNet's last feature
    map is 1 × 1 at 32 px, which ``torch.export`` would fix at 1 (its "0/1 specialization", refusing larger
    images): export under ``backed_size_oblivious`` (experimental in torch: the general case for sizes 0 and 1),
    as the ONNX export must with these shapes. A model that fixes the size (a ViT's patch grid) keeps it."""
    batch, height, width = torch.export.Dim("batch"), torch.export.Dim("height"), torch.export.Dim("width")
    dynamic: tuple[dict] = ({0: batch, 2: height, 3: width},)
    with fx_config.patch(backed_size_oblivious=True):
        try:
            return torch.export.export(net, inputs, dynamic_shapes=dynamic), dynamic
        except UserError:  # a guard on the image size
            dynamic = ({0: batch},)
            return torch.export.export(net, inputs, dynamic_shapes=dynamic), dynamic


def export_checkpoint(
    ckpt_path: str | Path,
    output: str | Path,
    formats: str | Sequence[str] = DEFAULT_FORMATS,
    config_files: Sequence[str] = (),
) -> list[Path]:
    """Write the files of ``formats`` (:data:`EXPORT_FORMATS`, default :data:`DEFAULT_FORMATS`) and
    ``config.json`` into ``output``; return their paths.

    ``model.safetensors`` holds the weights (:func:`load_exported` rebuilds the model from them);
    ``model.pt2`` is a ``torch.export`` program (load it with ``torch.export.load(path).module()``);
    ``model.torchscript.pt`` is traced with ``torch.jit``, which PyTorch has deprecated but many serving stacks
    still read; ``model.onnx`` (input ``images``, output ``logits``, weights in the one file) comes from
    ``torch.onnx``'s ``torch.export``-based exporter and needs the ``onnx`` extra. Every format takes any batch
    size and any height and width: a classifier whose graph allows it (a CNN's; a ViT's patch grid keeps the
    training image size), a segmentation model (a :class:`~coretune.models.DeepLabV3`; ``config.json`` records
    ``task`` and ``output_stride``) always — its ``model.pt2`` from the smallest size its graph was checked for
    (17 px at output stride 16, 9 at 8), smaller inputs fail its guard. ``config.json`` records the formats
    written and the ``input_shape`` they take (``"batch"``, ``"height"``, ``"width"`` where any size goes).
    ``config_files``: the ``--config`` files the options came from, refused when they record another task than
    the checkpoint's. Every option is checked before anything is written.
    """
    formats = check_formats(formats)
    if Path(output).exists() and not Path(output).is_dir():
        raise ValueError(
            f"--output {output} is a file: give a folder (the export writes its model files and config.json into it)"
        )
    if "onnx" in formats:
        _require_onnx()
    model = FineTuner.from_checkpoint(ckpt_path).eval()
    for config_file in config_files:
        check_config_task(config_file, model.task.name, str(ckpt_path))
    segmentation = model.task.name == "segmentation"
    net: nn.Module
    if segmentation:
        net = DeepLabV3(model.backbone, model.num_classes or 0, model.hparams.output_stride)
        net.head = model.objective.classifier
    else:
        net = ExportedClassifier(model.backbone, model.objective.classifier)
    net.eval()
    net.to(memory_format=torch.contiguous_format)
    meta = model.checkpoint_info
    data = meta.get("data", {})
    size = data.get("image_size") or 224
    config = {
        "format": EXPORT_FORMAT,
        "task": model.task.name,
        **({"output_stride": model.hparams.output_stride} if segmentation else {}),
        "backbone": model.hparams.backbone,
        "feature_dim": model.backbone.feature_dim,
        "num_classes": model.num_classes,
        "class_names": model.class_names,
        "objective": meta.get("objective"),
        "image_size": data.get("image_size"),
        "mean": data.get("mean"),
        "std": data.get("std"),
        "formats": formats,
        "input_shape": ["batch", 3, "height", "width"],
    }
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if "safetensors" in formats:
        written.append(output / EXPORT_FORMATS["safetensors"])
        save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(written[-1]))
    inputs = (torch.zeros(2, 3, size, size),)
    if segmentation:
        net = _without_atrous_shortcut(net)
        any_size = torch.export.Dim.DYNAMIC
        dynamic: tuple[dict] = ({0: any_size, 2: any_size, 3: any_size},)
        program = torch.export.export(net, inputs, dynamic_shapes=dynamic) if "pt2" in formats else None
    else:
        program, dynamic = _export_classifier(net, inputs)
        if 2 not in dynamic[0]:
            config["input_shape"] = ["batch", 3, size, size]
    if "pt2" in formats:
        written.append(output / EXPORT_FORMATS["pt2"])
        torch.export.save(program, written[-1])
    if "torchscript" in formats:
        with torch.no_grad(), warnings.catch_warnings():  # the format asked for: not torch's deprecation notice
            warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", FutureWarning)
            # the trace records the sizes it reads, so the interpolation follows the input's
            scripted = torch.jit.trace(net, torch.zeros(1, 3, size, size))
        written.append(output / EXPORT_FORMATS["torchscript"])
        scripted.save(str(written[-1]))
    if "onnx" in formats:
        written.append(output / EXPORT_FORMATS["onnx"])
        with fx_config.patch(backed_size_oblivious=not segmentation):
            torch.onnx.export(
                net,
                inputs,
                written[-1],
                dynamo=True,
                dynamic_shapes=dynamic,
                input_names=["images"],
                output_names=["logits"],
                external_data=False,
                verbose=False,
            )
    written.append(output / "config.json")  # last: it lists the formats written
    written[-1].write_text(json.dumps(config, indent=2) + "\n")
    return written


def load_exported(folder: str | Path) -> tuple[nn.Module, dict]:
    """The model (:class:`ExportedClassifier`, or :class:`~coretune.models.DeepLabV3` for segmentation) and config
    written by :func:`export_checkpoint` (strict load of every tensor)."""
    folder = Path(folder)
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(
            f"{folder} holds no coretune export (config.json + model.safetensors): export the checkpoint with "
            "coretune export (the safetensors format)"
        )
    config = json.loads(config_path.read_text())
    if config.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{config_path} has format {config.get('format')!r}, expected {EXPORT_FORMAT!r}")
    net: nn.Module
    if config.get("task") == "segmentation":
        net = create_deeplabv3(config["backbone"], config["num_classes"], config["output_stride"], verbose=False)
    else:
        net = ExportedClassifier(
            create_backbone(config["backbone"]), nn.Linear(config["feature_dim"], config["num_classes"])
        )
    net.load_state_dict(load_file(str(weights_path)))
    return net.eval(), config
