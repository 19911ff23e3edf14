"""Export a fine-tuned model as ``model.safetensors`` + ``config.json`` (plus a ``torch.export`` program,
TorchScript and ONNX), and load it back: a classifier (images → class logits ``(B, K)``) or, for a segmentation
checkpoint, the DeepLab-V3 model (images → per-pixel logits ``(B, K, H, W)`` at the input's size)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .engine import FineTuner
from .models import DeepLabV3, create_backbone, create_deeplabv3
from .runconfig import check_config_task

__all__ = ["ExportedClassifier", "export_checkpoint", "load_exported"]

EXPORT_FORMAT = "coretune-export-1"


class ExportedClassifier(nn.Module):
    """A fine-tuned backbone and its classifier ``G_y``: images → class logits."""

    def __init__(self, backbone: nn.Module, classifier: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone
        self.classifier = classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.backbone(x))


def _require_onnx() -> None:
    """Refuse ``onnx=True`` before anything is written when the exporter's packages are missing."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"ONNX export needs the onnx extra ({err.name} is not installed): pip install 'coretune[onnx]'"
        ) from None


def export_checkpoint(
    ckpt_path: str | Path,
    output: str | Path,
    torchscript: bool = True,
    exported_program: bool = True,
    onnx: bool = False,
    config_files: Sequence[str] = (),
) -> list[Path]:
    """Write ``model.safetensors``, ``config.json`` and optionally ``model.pt2``, ``model.torchscript.pt`` and
    ``model.onnx`` into ``output``.

    ``model.pt2`` is a ``torch.export`` program with a dynamic batch dimension (load it with
    ``torch.export.load(path).module()``); ``model.torchscript.pt`` is traced with ``torch.jit``, which PyTorch
    has deprecated but many serving stacks still read; ``model.onnx`` (input ``images``, output ``logits``, dynamic
    batch dimension, weights in the one file) comes from ``torch.onnx``'s ``torch.export``-based exporter and needs
    the ``onnx`` extra. A segmentation checkpoint exports its :class:`~coretune.models.DeepLabV3` (``config.json``
    records ``task`` and ``output_stride``). ``config_files``: the ``--config`` files the options came from,
    refused when they record another task than the checkpoint's.
    """
    if onnx:
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
    }
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    written = [output / "model.safetensors", output / "config.json"]
    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(written[0]))
    written[1].write_text(json.dumps(config, indent=2) + "\n")
    size = config["image_size"] or 224
    inputs, dynamic_batch = (torch.zeros(2, 3, size, size),), ({0: torch.export.Dim("batch")},)
    if exported_program:
        program = torch.export.export(net, inputs, dynamic_shapes=dynamic_batch)
        written.append(output / "model.pt2")
        torch.export.save(program, written[-1])
    if torchscript:
        example = torch.zeros(1, 3, size, size)
        with torch.no_grad():
            scripted = torch.jit.trace(net, example)
        written.append(output / "model.torchscript.pt")
        scripted.save(str(written[-1]))
    if onnx:
        written.append(output / "model.onnx")
        torch.onnx.export(
            net,
            inputs,
            written[-1],
            dynamo=True,
            dynamic_shapes=dynamic_batch,
            input_names=["images"],
            output_names=["logits"],
            external_data=False,
            verbose=False,
        )
    return written


def load_exported(folder: str | Path) -> tuple[nn.Module, dict]:
    """The model (:class:`ExportedClassifier`, or :class:`~coretune.models.DeepLabV3` for segmentation) and config
    written by :func:`export_checkpoint` (strict load of every tensor)."""
    folder = Path(folder)
    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"{folder} holds no coretune export (config.json + model.safetensors)")
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
