"""``coretune predict``: predict every image under a folder with a fine-tuned checkpoint, as its task does:
classes and probabilities into a CSV (classification), one palette mask PNG per image (segmentation)."""

from __future__ import annotations

import csv
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from ..data import IMAGENET_MEAN, IMAGENET_STD, ImageFileDataset
from ..data.datasets import OnBadImage
from ..data.loading import NumWorkers, is_auto, resolve_loading
from ..data.samplers import same_size_batches
from ..engine import FineTuner, atomic_write
from ..models import CheckpointError
from ..runs.config import check_config_task
from ..runs.outputs import check_file_output, check_folder_output, check_output_path, mark_folder, trained_data_paths
from ..tasks import Task
from .devices import Placement, placement
from .posthoc import check_posthoc_adjustment, posthoc_shift

__all__ = ["default_output", "predict_folder", "predict_masks"]


def default_output(task: Task | type[Task]) -> str:
    """Where ``coretune predict`` writes without ``--output``: ``predictions/`` (a folder of masks) for a task that
    predicts masks (:attr:`~coretune.tasks.Task.prediction_kind`: segmentation), ``predictions.csv`` otherwise."""
    return "predictions" if task.prediction_kind == "masks" else "predictions.csv"


def predict_folder(
    ckpt_path: str | Path,
    folder: str | Path,
    output: str | Path | None = None,
    image_size: int | None = None,
    batch_size: int = 64,
    num_workers: NumWorkers = "auto",
    on_bad_image: OnBadImage = "error",
    overlay: bool = False,
    config_files: Sequence[str] = (),
    accelerator: str = "auto",
    devices: Any = "auto",
    precision: Any = "32-true",
    posthoc_adjustment: float = 0.0,
) -> Path:
    """Predict every image under ``folder`` (or the one image file it names) with the checkpoint's task; return what
    was written (default :func:`default_output`).

    Classification writes ``path, prediction, confidence, p_<class>…`` for every image into a CSV; segmentation
    one palette mask per image (:func:`predict_masks`, which ``overlay`` concerns). ``config_files``: the
    ``--config`` files the options came from, refused when they record another task than the checkpoint's.
    ``accelerator``, ``devices`` and ``precision`` (``--trainer.*``, :func:`~coretune.apps.devices.placement`): where
    the images are predicted, a batch at a time (``auto``: CUDA if available, else the CPU), and at what precision
    (``bf16-mixed`` and ``16-mixed`` under autocast). ``num_workers``: loader processes; ``auto`` as the data
    modules choose (:func:`~coretune.data.loading.resolve_loading`: on CUDA a worker per core up to 8, pinned memory;
    on the CPU none).

    The image size and normalisation default to those the model was fine-tuned with (stored in the checkpoint).
    ``posthoc_adjustment`` τ > 0 (classification): predict ``argmax f(x) − τ · log π`` (π the checkpoint's
    training class frequencies; :mod:`~coretune.apps.posthoc`); the probabilities are the softmax of those logits.
    The CSV is written to a temporary file that replaces ``output`` only once every image is predicted: an error
    leaves an existing ``output`` as it was. ``on_bad_image="skip"`` decodes every file first and leaves the
    unreadable ones out, with one warning listing them.

    Raises:
        CheckpointError: the checkpoint is unusable, or gives NaN or infinite outputs.
        DataError: the folder holds no image, or an unreadable one (``on_bad_image="error"``).
        ValueError: a ``config_files`` entry is another task's, or an option does not apply to the task (or the
            device or precision is not one this machine runs).
    """
    if not is_auto(num_workers) and (not isinstance(num_workers, int) or num_workers < 0):
        raise ValueError(f"--data.num_workers must be >= 0 or auto (got {num_workers!r})")
    place = placement(accelerator, devices, precision, command="predict")
    check_posthoc_adjustment(posthoc_adjustment)
    reads = [("the checkpoint", ckpt_path), *(("a --config file", path) for path in config_files)]
    trained = trained_data_paths(ckpt_path)
    check_output_path(output, "predict", reads=reads, data=[Path(folder), *trained])  # before the checkpoint is read
    model = FineTuner.from_checkpoint(ckpt_path, map_location=str(place.device)).eval()
    model.logit_shift = posthoc_shift(model, posthoc_adjustment, ckpt_path)
    for config in config_files:
        check_config_task(config, model.task.name, str(ckpt_path))
    output = Path(output if output is not None else default_output(model.task))
    check_output(output, folder, reads, model.task.prediction_kind, trained)
    if model.task.prediction_kind == "masks":
        if image_size is not None:
            raise ValueError(
                f"--data.image_size {image_size}: a segmentation model predicts each image at its own size (its mask "
                "has the image's size); drop --data.image_size"
            )
        return predict_masks(model, ckpt_path, folder, output, num_workers, on_bad_image, overlay, batch_size, place)
    if overlay:
        raise ValueError("--overlay true is for segmentation checkpoints (it draws masks over images): drop it")
    data = _trained_data(model, ckpt_path, ("mean", "std") if image_size else ("image_size", "mean", "std"))
    size = image_size or data.get("image_size") or 224
    mean, std = tuple(data.get("mean", IMAGENET_MEAN)), tuple(data.get("std", IMAGENET_STD))
    transform, draft = model.task.image_transform(size, mean, std)  # as the task's test split reads images
    dataset = ImageFileDataset(str(folder), transform, draft_size=draft, on_bad_image=on_bad_image)
    loader = DataLoader(dataset, batch_size=batch_size, **_loader_options(num_workers, place))
    names = model.class_names
    with atomic_write(output, newline="") as f, torch.inference_mode():
        writer = csv.writer(f)
        writer.writerow([*CSV_HEADER, *(f"p_{n}" for n in names)])
        for images, indices in loader:
            logits = _finite_logits(model, images, ckpt_path, dataset.paths, indices, place)
            probs = torch.softmax(logits, dim=1)
            conf, pred = probs.max(dim=1)
            for i, p, c, row in zip(indices.tolist(), pred.tolist(), conf.tolist(), probs.tolist(), strict=True):
                writer.writerow([dataset.paths[i], names[p], f"{c:.6f}", *(f"{x:.6f}" for x in row)])
    return output


def _trained_data(model: FineTuner, ckpt_path: str | Path, needed: Sequence[str]) -> dict:
    """The checkpoint's image size and normalisation (:attr:`FineTuner.trained_data`), with a warning when it
    does not record the ``needed`` ones (a model saved without coretune's data module): the defaults, 224 px and
    ImageNet's normalisation, may not be what it was trained on."""
    data = model.trained_data
    missing = [key for key in needed if key not in data]
    if missing:
        used = [*(["224 px"] * ("image_size" in missing)), *(["ImageNet's normalisation"] * ("mean" in missing))]
        warnings.warn(
            f"checkpoint {ckpt_path} does not record its {', '.join(missing)}: predicting with "
            f"{' and '.join(used)}, which may not be what the model was trained on"
            f"{' (pass --data.image_size)' if 'image_size' in missing else ''}",
            UserWarning,
            stacklevel=3,
        )
    return data


CSV_HEADER = ("path", "prediction", "confidence")
"""The first columns of the CSV ``coretune predict`` writes: how it tells its own file (which it may replace)."""


def _our_csv(path: Path) -> bool:
    try:
        with path.open(newline="") as f:
            return tuple(next(csv.reader(f), ())[: len(CSV_HEADER)]) == CSV_HEADER
    except (OSError, UnicodeDecodeError, csv.Error):
        return False


def check_output(
    output: Path, folder: str | Path, reads: Sequence[tuple[str, str | Path]], kind: str, trained: Sequence[Path]
) -> None:
    """Refuse an ``output`` that would replace what ``coretune predict`` did not make
    (:mod:`coretune.runs.outputs`): an input (the checkpoint, a ``--config`` file, the input folder or anything in it,
    the data the checkpoint was trained on, ``trained``), a run's files, a file that is not an earlier predictions
    CSV (``kind`` ``"classes"``), or a folder that is neither new, empty nor an earlier ``coretune predict``'s masks
    (``"masks"``: its ``.coretune-predict`` marker).

    Raises:
        ValueError: naming ``output`` and what it would replace.
    """
    data = [Path(folder), *trained]
    if kind != "masks":
        check_file_output(output, "predict", reads=reads, data=data, ours=_our_csv)
        return
    check_folder_output(output, "predict", reads=reads, data=data)
    source = Path(os.path.realpath(folder))
    if not source.is_dir() and Path(os.path.realpath(output)) / f"{source.stem}.png" == source:
        raise ValueError(f"--output {output}: the mask {source.stem}.png would replace the input image; pass another "
                         "--output")  # fmt: skip


def _finite_logits(
    model: FineTuner,
    images: torch.Tensor,
    ckpt_path: str | Path,
    paths: Sequence[str],
    indices: torch.Tensor,
    place: Placement | None = None,
) -> torch.Tensor:
    """``model(images)`` on ``place``'s device at its precision, in float32 on the CPU; :class:`CheckpointError`
    naming the first image with a NaN or infinite one."""
    place = place or Placement(torch.device("cpu"))
    with place.autocast():
        logits = model(images.to(place.device, non_blocking=True)).float().cpu()
    if not (finite := torch.isfinite(logits).reshape(len(logits), -1).all(dim=1)).all():
        bad = [paths[i] for i in indices[~finite].tolist()]
        raise CheckpointError(
            f"checkpoint {ckpt_path} gives NaN or infinite outputs for {bad[0]}"
            f"{f' (and {len(bad) - 1} more of its batch)' if len(bad) > 1 else ''}: its weights overflow; "
            "use an earlier checkpoint of the run, or fine-tune again with a lower learning rate (--model.optim.lr)"
        )
    return logits


def _mask_name(path: str, base: str | Path) -> Path:
    """The name of ``path``'s mask under the output folder, without its ``.png``: its path under ``base``."""
    return Path(os.path.relpath(path, base)).with_suffix("")


def _check_mask_names(paths: Sequence[str], base: str | Path, output: Path, overlay: bool) -> None:
    """Refuse two images of ``paths`` whose mask (or, with ``overlay``, overlay) files would have one name."""
    targets: dict[Path, str] = {}
    for path in paths:
        name = _mask_name(path, base)
        for target in (Path(f"{name}.png"), *([Path(f"{name}_overlay.png")] if overlay else [])):
            if (other := targets.setdefault(target, path)) != path:
                raise ValueError(
                    f"images {other} and {path} would both be written to {output / target} (each image's files "
                    "are named after it without its extension): rename one of them"
                )


def _loader_options(num_workers: NumWorkers, place: Placement | None) -> dict[str, Any]:
    """The ``DataLoader`` options of one pass over the images: ``auto`` resolved for the device the images go to."""
    cuda = place is not None and place.device.type == "cuda"
    loading = resolve_loading(num_workers, "auto", cuda=cuda)
    return {"num_workers": loading.num_workers, "pin_memory": loading.pin_memory}


def predict_masks(
    model: FineTuner,
    ckpt_path: str | Path,
    folder: str | Path,
    output: Path,
    num_workers: NumWorkers = "auto",
    on_bad_image: OnBadImage = "error",
    overlay: bool = False,
    batch_size: int = 64,
    place: Placement | None = None,
) -> Path:
    """Segment every image under ``folder`` at its own size, up to ``batch_size`` images of one size at a time
    (:func:`same_size_batches`): ``output/<its path under folder>.png``, a palette mask of class indices (the task's
    ``save_mask``, :func:`~coretune.tasks.segmentation.save_palette_mask`; ``read_mask`` reads the indices back), and
    with ``overlay`` ``<…>_overlay.png``, the image with the mask's colours blended in (50 %). The files are written
    into a temporary folder beside ``output`` and moved into it once every image is done: an error leaves ``output``
    as it was. Two images whose files would have one name (``a.jpg`` and ``a.png``) are refused (``ValueError``)
    before anything is written. ``place``: the device and precision (default the CPU, float32)."""
    data = _trained_data(model, ckpt_path, ("mean", "std"))  # each image at its own size
    mean, std = tuple(data.get("mean", IMAGENET_MEAN)), tuple(data.get("std", IMAGENET_STD))
    transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    # the stored pixels, as the model was trained and same_size_batches groups them (by their headers' sizes)
    dataset = ImageFileDataset(str(folder), transform, on_bad_image=on_bad_image, orient=False)
    base = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))  # one image: its folder
    _check_mask_names(dataset.paths, base, output, overlay)
    batches = same_size_batches(dataset.paths, batch_size)
    loader = DataLoader(dataset, batch_sampler=batches, **_loader_options(num_workers, place))
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        written: list[Path] = []
        with torch.inference_mode():
            for images, indices in loader:
                masks = _finite_logits(model, images, ckpt_path, dataset.paths, indices, place).argmax(1).numpy()
                for image, index, mask in zip(images, indices.tolist(), masks, strict=True):
                    name = _mask_name(dataset.paths[index], base)
                    (staging / name).parent.mkdir(parents=True, exist_ok=True)
                    model.task.save_mask(mask, staging / f"{name}.png")
                    written.append(Path(f"{name}.png"))
                    if overlay:
                        rgb = image * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
                        rgb = (rgb.clamp(0, 1).permute(1, 2, 0).numpy() * 255).astype(np.float32)
                        blend = (0.5 * rgb + 0.5 * model.task.colorize(mask)).round().astype(np.uint8)
                        Image.fromarray(blend).save(staging / f"{name}_overlay.png")
                        written.append(Path(f"{name}_overlay.png"))
        mark_folder(output, "predict")
        for relative in written:
            (output / relative).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / relative, output / relative)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output
