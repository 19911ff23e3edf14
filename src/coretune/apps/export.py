"""Export a fine-tuned model as ``config.json`` plus the formats asked for — ``model.safetensors``, a
``torch.export`` program, TorchScript, ONNX, a timm model folder (``timm/``: :mod:`~.timm_export`) — and load it back: a
classifier (images → class logits ``(B, K)``) or, for a segmentation checkpoint, the DeepLab-V3 model (images →
per-pixel logits ``(B, K, H, W)`` at the input's size, any size in every format)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch._dynamo.exc import UserError
from torch.export import ExportedProgram
from torch.fx.experimental import _config as fx_config

from ..engine import FineTuner
from ..extras import need
from ..models.exported import ExportedClassifier
from ..models.lora import merge_lora
from ..models.segmentation import AtrousConv2d
from ..runs.atomic import strict_json
from ..runs.config import check_config_task
from ..runs.outputs import check_folder_output, trained_data_paths
from ..tasks import DEFAULT_TASK, get_task
from .devices import placement
from .posthoc import check_posthoc_adjustment, posthoc_shift
from .timm_export import TIMM_CONFIG, TIMM_WEIGHTS, check_timm_exportable, load_timm_export, write_timm_export

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
    "timm": TIMM_WEIGHTS,
}
#: What ``coretune export`` writes without ``--format`` (TorchScript, deprecated by PyTorch, only when asked for).
DEFAULT_FORMATS: tuple[str, ...] = ("safetensors", "pt2")
#: How far a written file's logits may lie from the checkpoint's model's, relative to the largest logit (at least 1):
#: float32 kernels of another runtime differ by ~1e-6 of it; a wrong graph or weights by far more.
CHECK_TOLERANCE = 1e-3


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
    for module in ("onnx", "onnxruntime", "onnxscript"):  # onnxruntime runs each written model.onnx: _check_written
        need(module, "ONNX export")


def _without_atrous_shortcut(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose :class:`~coretune.models.AtrousConv2d` layers are plain ``nn.Conv2d`` (the same
    weights and outputs): their shortcut branches on the feature map's size, which a traced or exported graph
    would fix at the example's size."""
    net = copy.deepcopy(net)
    for module in net.modules():
        if isinstance(module, AtrousConv2d):
            module.__class__ = nn.Conv2d
    return net


def _size_oblivious() -> contextlib.AbstractContextManager[object]:
    """``torch.export`` without its "0/1 specialization" (experimental in torch, ``backed_size_oblivious``: sizes 0
    and 1 take the general case), where the installed torch has it: a ResNet's last feature map is 1 × 1 at 32 px,
    which would otherwise fix the exported height and width at the example's."""
    if hasattr(fx_config, "backed_size_oblivious"):
        return fx_config.patch(backed_size_oblivious=True)
    return contextlib.nullcontext()


def _computes_eager(exported: Callable[[Tensor], Tensor], net: nn.Module, size: int) -> bool:
    """Whether ``exported`` gives ``net``'s logits on one image of the training size and on two of another size."""
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for shape in ((1, 3, size, size), (2, 3, 2 * size, size + size // 2)):
                images = torch.rand(shape, generator=generator)
                if not torch.allclose(exported(images), net(images), atol=1e-4, rtol=1e-4):
                    return False
    except Exception:  # any failure at another size means: the training size only
        return False
    return True


def _classifier_program(net: nn.Module, inputs: tuple[Tensor], size: int) -> tuple[ExportedProgram, tuple[dict]]:
    """``net`` as a ``torch.export`` program and the dynamic shapes it was exported with: any batch size and, when
    the program is checked to compute ``net``'s logits at batch 1 and at another size, any height and width
    (``batch``, ``height``, ``width``); else the training size (a ViT's patch grid fixes it). Export to ONNX with
    these shapes under :func:`_size_oblivious` too."""
    batch, height, width = torch.export.Dim("batch"), torch.export.Dim("height"), torch.export.Dim("width")
    dynamic: tuple[dict] = ({0: batch, 2: height, 3: width},)
    with _size_oblivious():
        try:
            program = torch.export.export(net, inputs, dynamic_shapes=dynamic)
            if _computes_eager(program.module(), net, size):
                return program, dynamic
        except UserError:  # a guard on the size
            pass
    dynamic = ({0: batch},)
    return torch.export.export(net, inputs, dynamic_shapes=dynamic), dynamic


def export_checkpoint(
    ckpt_path: str | Path,
    output: str | Path,
    formats: str | Sequence[str] = DEFAULT_FORMATS,
    config_files: Sequence[str] = (),
    accelerator: str = "cpu",
    devices: Any = "auto",
    precision: Any = "32-true",
    posthoc_adjustment: float = 0.0,
) -> list[Path]:
    """Write the files of ``formats`` (:data:`EXPORT_FORMATS`, default :data:`DEFAULT_FORMATS`) and
    ``config.json`` into ``output``; return their paths.

    ``model.safetensors`` holds the weights (:func:`load_exported` rebuilds the model from them);
    ``model.pt2`` is a ``torch.export`` program (load it with ``torch.export.load(path).module()``);
    ``model.torchscript.pt`` is traced with ``torch.jit``, which PyTorch has deprecated but many serving stacks
    still read; ``model.onnx`` (input ``images``, output ``logits``, weights in the one file) comes from
    ``torch.onnx``'s ``torch.export``-based exporter and needs the ``onnx`` extra; ``timm/model.safetensors`` and
    ``timm/config.json`` are the classifier as a timm model (:func:`~.timm_export.write_timm_export`: a timm
    backbone or a torchvision ResNet; ``timm.create_model("local-dir:OUTPUT/timm", pretrained=True)``). A model
    fine-tuned with LoRA (``--model.optim.lora.rank``) is exported merged (:func:`~coretune.models.lora.merge_lora`):
    every format holds the plain backbone, no LoRA tensor. Every format takes any batch
    size and any height and width: a classifier when every format written is checked to compute its logits at
    batch 1 and at another size (a CNN's; a ViT's patch grid keeps the training image size), a segmentation
    model (a :class:`~coretune.models.DeepLabV3`; ``config.json`` records ``task`` and ``output_stride``)
    always — its ``model.pt2`` from the smallest size its graph was checked for (17 px at output stride 16, 9 at
    8), smaller inputs fail its guard. ``config.json`` records the formats written and the ``input_shape`` they
    take (``"batch"``, ``"height"``, ``"width"`` where any size goes). ``config_files``: the ``--config`` files the
    options came from, refused when they record another task than the checkpoint's. Every option is checked before
    anything is written. Every file written is read back and run against the checkpoint's model before it reaches
    ``output`` (``config.json``'s ``check``: the images, the tolerance and each format's largest logit difference);
    a file beyond :data:`CHECK_TOLERANCE` fails the export. The files are written into a temporary folder inside
    ``output`` and moved into it once every format is done: an error leaves ``output`` as it was, and afterwards it
    holds no file of a format not written this time (an earlier export's). ``accelerator`` and ``devices``
    (``--trainer.*``, :func:`~coretune.apps.devices.placement`; default the CPU) are where that check runs (ONNX's on
    the CPU, onnxruntime's), in float32 (TF32 off): ``precision`` is ``32-true``, the files' own.
    ``posthoc_adjustment`` τ > 0 (a classifier's): every format predicts the post-hoc logit-adjusted logits
    ``f(x) − τ · log π`` (:mod:`~coretune.apps.posthoc`; π the checkpoint's training class frequencies), the shift
    folded into the classifier's bias — what ``coretune test`` / ``predict`` score with the same option;
    ``config.json`` records τ (0: the logits as trained).
    """
    formats = check_formats(formats)
    check_posthoc_adjustment(posthoc_adjustment)
    place = placement(accelerator, devices, precision, command="export")
    if place.dtype is not None:
        raise ValueError(
            f"--trainer.precision {precision}: coretune export writes float32 files and checks them in float32 "
            "against the checkpoint's model: pass --trainer.precision 32-true (or leave it out)"
        )
    if Path(output).exists() and not Path(output).is_dir():
        raise ValueError(
            f"--output {output} is a file: give a folder (the export writes its model files and config.json into it)"
        )
    _check_replaceable(Path(output))
    reads = [("the checkpoint", ckpt_path), *(("a --config file", path) for path in config_files)]
    # a folder holding an earlier export (its config.json, checked above) may take this one
    check_folder_output(
        output, "export", reads=reads, data=trained_data_paths(ckpt_path),  # not into the data it was trained on
        ours=lambda folder: (folder / "config.json").is_file(),
    )  # fmt: skip
    if "onnx" in formats:
        _require_onnx()
    model = FineTuner.from_checkpoint(ckpt_path).eval()
    merge_lora(model.backbone)  # a LoRA fine-tuning's: the plain backbone, its low-rank updates in its weights
    for config_file in config_files:
        check_config_task(config_file, model.task.name, str(ckpt_path))
    shift = posthoc_shift(model, posthoc_adjustment, ckpt_path)  # refuses a segmentation model, missing counts
    dense = model.task.dense_logits
    net = model.task.export_network(model)
    if shift is not None:
        _fold_logit_shift(net, shift)
    if "timm" in formats:
        check_timm_exportable(net, dense)
    net.eval()
    net.to(memory_format=torch.contiguous_format)
    meta = model.checkpoint_info
    data = meta.get("data", {})
    size = data.get("image_size") or 224
    config = {
        "format": EXPORT_FORMAT,
        "task": model.task.name,
        **model.task.export_settings(),
        "backbone": model.hparams.backbone,
        "backbone_args": dict(model.hparams.get("backbone_args") or {}),  # the constructor's: load_exported's too
        "feature_dim": model.backbone.feature_dim,
        "num_classes": model.num_classes,
        "class_names": model.class_names,
        "objective": meta.get("objective"),
        "image_size": data.get("image_size"),
        "mean": data.get("mean"),
        "std": data.get("std"),
        "formats": formats,
        "input_shape": ["batch", 3, "height", "width"],
        "posthoc_adjustment": float(posthoc_adjustment),
    }
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=output))  # inside: the same file system, no parent write
    try:
        names = _write_formats(net, staging, formats, config, dense, size, place.device)
        _move_in(staging, output, names)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [output / name for name in names]


def _fold_logit_shift(net: nn.Module, shift: Tensor) -> None:
    """Add ``shift`` ``(K,)`` to the bias of ``net``'s classifier (an :class:`ExportedClassifier`'s ``nn.Linear``):
    its logits become ``f(x) + shift`` in every format written from it."""
    classifier = net.classifier
    with torch.no_grad():
        classifier.bias.add_(shift.to(classifier.bias))


def _write_formats(
    net: nn.Module,
    folder: Path,
    formats: Sequence[str],
    config: dict,
    dense: bool,
    size: int,
    device: torch.device | None = None,
) -> list[str]:
    """Write ``net`` in ``formats`` and then ``config`` (its ``input_shape`` completed) into ``folder``; return the
    names of the files written, in order. ``dense``: ``net`` gives logits at its input's size (segmentation's,
    :attr:`~coretune.tasks.Task.dense_logits`), exported for any size. The files are made on the CPU and checked on
    ``device`` (:func:`_check_written`)."""
    written: list[str] = []
    reference = net
    if "safetensors" in formats:
        written.append(EXPORT_FORMATS["safetensors"])
        save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(folder / written[-1]))
    inputs = (torch.zeros(2, 3, size, size),)
    any_size = True  # a classifier's: every format written computes its logits at other sizes too
    program, dynamic = None, ()
    if dense:
        net = _without_atrous_shortcut(net)
        any_dim = torch.export.Dim.DYNAMIC
        dynamic = ({0: any_dim, 2: any_dim, 3: any_dim},)
        if "pt2" in formats:
            program = torch.export.export(net, inputs, dynamic_shapes=dynamic)
    elif {"pt2", "onnx"} & set(formats):
        program, dynamic = _classifier_program(net, inputs, size)
        any_size = 2 in dynamic[0]
    elif {"safetensors", "timm"} & set(formats):  # the model load_exported rebuilds, or timm's
        any_size = _computes_eager(net, net, size)
    if "pt2" in formats:
        written.append(EXPORT_FORMATS["pt2"])
        torch.export.save(program, folder / written[-1])
    program = None  # the check loads each file back: one copy of the weights at a time beside the reference
    if "torchscript" in formats:
        with torch.no_grad(), warnings.catch_warnings():  # the format asked for: not torch's deprecation notice
            warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", FutureWarning)
            # the trace records the sizes it reads, so the interpolation follows the input's
            scripted = torch.jit.trace(net, torch.zeros(1, 3, size, size))
            any_size = any_size and (dense or _computes_eager(scripted, net, size))
        written.append(EXPORT_FORMATS["torchscript"])
        scripted.save(str(folder / written[-1]))
        del scripted
    if "timm" in formats:
        write_timm_export(reference, folder / Path(TIMM_WEIGHTS).parent, config, size)
        written += [TIMM_WEIGHTS, TIMM_CONFIG]
    if "onnx" in formats:
        written.append(EXPORT_FORMATS["onnx"])
        with _size_oblivious() if not dense else contextlib.nullcontext():
            torch.onnx.export(
                net,
                inputs,
                folder / written[-1],
                dynamo=True,
                dynamic_shapes=dynamic,
                input_names=["images"],
                output_names=["logits"],
                external_data=False,
                verbose=False,
            )
    if not any_size:
        config["input_shape"] = ["batch", 3, size, size]
    config["check"] = _check_written(folder, config, reference, size, any_size, dense, device)
    written.append("config.json")  # last: it lists the formats written
    (folder / written[-1]).write_text(strict_json(config, indent=2) + "\n")
    return written


def _check_written(
    folder: Path,
    config: dict,
    reference: nn.Module,
    size: int,
    any_size: bool,
    dense: bool,
    device: torch.device | None = None,
) -> dict:
    """Load each model file of ``config["formats"]`` back from ``folder``, one at a time, and run it against
    ``reference`` (the checkpoint's model, eager, float32) on seeded random images: one at the training size and two
    at another size (a classifier's: twice the height, 1.5 times the width; a segmentation model's: 16 and a quarter
    more, which keeps a large crop affordable; the training size when the export keeps it), on ``device`` (default
    the CPU; ``model.onnx`` runs on the CPU, onnxruntime's) with TF32 off. Return the images' shapes,
    :data:`CHECK_TOLERANCE` and each format's largest logit difference (``config.json``'s ``check``); ``ValueError``
    naming the file that cannot be read back or run, or whose logits lie further than the tolerance allows, before
    anything reaches the output folder."""
    device = device or torch.device("cpu")
    if not any_size:
        other = (2, 3, size, size)
    elif dense:
        other = (2, 3, size + 16, size + size // 4)
    else:
        other = (2, 3, 2 * size, size + size // 2)
    generator = torch.Generator().manual_seed(0)
    reference = reference.to(device)
    with torch.no_grad(), _float32_only(device):
        cases = [
            (images, reference(images.to(device)).float().cpu())
            for images in (torch.randn(s, generator=generator) for s in ((1, 3, size, size), other))
        ]
    reference.cpu()
    differences: dict[str, float] = {}
    for name in config["formats"]:
        file = EXPORT_FORMATS[name]
        fails = f"export check failed: {file} read back"
        fix = (
            "so nothing was written and --output is as it was. Export the other formats (--format) and report this "
            "with the checkpoint's backbone and the installed torch version"
        )
        on = torch.device("cpu") if name == "onnx" else device
        try:
            run = _load_written(name, folder, config, on)
            with torch.no_grad(), _float32_only(on):
                outputs = [run(images.to(on)).float().cpu() for images, _ in cases]
        except Exception as err:  # any failure of the file written is the export's, named as such
            raise ValueError(
                f"{fails} fails ({type(err).__name__}: {' '.join(str(err).split())[:300]}), {fix}"
            ) from err
        del run
        differences[name] = 0.0
        for (images, expected), output in zip(cases, outputs, strict=True):
            allowed = CHECK_TOLERANCE * max(1.0, expected.abs().max().item())
            difference = (output - expected).abs().max().item() if output.shape == expected.shape else math.inf
            differences[name] = max(differences[name], difference)
            if not difference <= allowed:  # NaN too
                raise ValueError(
                    f"{fails} computes logits {difference:.3g} away from the checkpoint's model on images of shape "
                    f"{list(images.shape)} (allowed {allowed:.3g}), {fix}"
                )
    return {
        "images": [list(images.shape) for images, _ in cases],
        "tolerance": CHECK_TOLERANCE,
        "max_abs_logit_difference": differences,
    }


@contextlib.contextmanager
def _float32_only(device: torch.device) -> Iterator[None]:
    """On a CUDA device, float32 matrix products and convolutions without TF32 (cuDNN's convolutions use it by
    default, which would put ~1e-3 between the files' logits and the reference's)."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        cudnn = torch.backends.cudnn
        with cudnn.flags(
            enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False
        ):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


def _load_written(
    name: str, folder: Path, config: dict, device: torch.device | None = None
) -> Callable[[Tensor], Tensor]:
    """The file of format ``name`` in ``folder``, loaded back as its users load it onto ``device`` (default the CPU;
    ``model.onnx`` runs on the CPU), as a function of images."""
    device = device or torch.device("cpu")
    path = folder / EXPORT_FORMATS[name]
    if name == "safetensors":
        return _rebuild(config, path).to(device)
    if name == "pt2":
        return torch.export.load(path).module().to(device)
    if name == "torchscript":
        with warnings.catch_warnings():  # the format asked for: not torch's deprecation notice
            warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", FutureWarning)
            return torch.jit.load(str(path), map_location=device)
    if name == "timm":
        return load_timm_export(path.parent)
    return _onnx_runner(path)


def _onnx_runner(path: Path) -> Callable[[Tensor], Tensor]:
    """``model.onnx`` as a function of a tensor, run by onnxruntime on the CPU."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda images: torch.from_numpy(session.run(None, {"images": images.cpu().numpy()})[0])


def _check_replaceable(output: Path) -> None:
    """Refuse an ``output`` folder holding another model's files (a ``config.json`` that is not a coretune export's,
    or model files without one, e.g. a Hugging Face model folder): an export replaces its ``config.json`` and model
    files."""
    config, models = output / "config.json", [output / name for name in (*EXPORT_FORMATS.values(), TIMM_CONFIG)]
    if config.is_file():
        try:
            ours = json.loads(config.read_text()).get("format") == EXPORT_FORMAT
        except (ValueError, AttributeError):
            ours = False
    else:
        ours = not any(path.exists() for path in models)
    if not ours:
        raise ValueError(
            f"--output {output} holds another model's files (its config.json, or model files, are not a coretune "
            "export's), which the export would replace: pass another --output folder (an interrupted coretune export "
            "leaves model files without config.json: delete them)"
        )


def _move_in(staging: Path, output: Path, names: Sequence[str]) -> None:
    """Move the files ``names`` of a complete export from ``staging`` into ``output``, ``config.json`` last, and
    remove the files of the formats it lacks: ``output`` holds this export alone (its other files stay). The old
    ``config.json`` goes first, so an interrupted move leaves no folder :func:`load_exported` would read."""
    output.mkdir(exist_ok=True)
    (output / "config.json").unlink(missing_ok=True)
    for name in (*EXPORT_FORMATS.values(), TIMM_CONFIG):
        if name not in names:
            (output / name).unlink(missing_ok=True)
    for name in names:
        (output / name).parent.mkdir(exist_ok=True)  # timm/
        os.replace(staging / name, output / name)


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
    return _rebuild(config, weights_path), config


def _rebuild(config: dict, weights_path: Path) -> nn.Module:
    """The model ``config`` describes (its task's :meth:`~coretune.tasks.Task.exported_network`) with the weights of
    ``weights_path`` (strict load), in eval mode."""
    net = get_task(config.get("task") or DEFAULT_TASK).exported_network(config)
    net.load_state_dict(load_file(str(weights_path)))
    return net.eval()
