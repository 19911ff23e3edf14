"""``coretune predict``: classify every image under a folder with a fine-tuned checkpoint, into a CSV."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from .data import IMAGENET_MEAN, IMAGENET_STD, ImageFileDataset, eval_transform
from .data.datasets import OnBadImage
from .data.transforms import eval_draft_size
from .engine import FineTuner, atomic_write
from .models import CheckpointError

__all__ = ["predict_folder"]


def predict_folder(
    ckpt_path: str | Path,
    folder: str | Path,
    output: str | Path = "predictions.csv",
    image_size: int | None = None,
    batch_size: int = 64,
    num_workers: int = 0,
    on_bad_image: OnBadImage = "error",
) -> Path:
    """Write ``path, prediction, confidence, p_<class>…`` for every image under ``folder``; return the CSV path.

    The image size and normalisation default to those the model was fine-tuned with (stored in the checkpoint).
    The CSV is written to a temporary file that replaces ``output`` only once every image is predicted: an error
    leaves an existing ``output`` as it was. ``on_bad_image="skip"`` decodes every file first and leaves the
    unreadable ones out, with one warning listing them.

    Raises:
        CheckpointError: the checkpoint is unusable, or gives NaN or infinite outputs.
        DataError: the folder holds no image, or an unreadable one (``on_bad_image="error"``).
    """
    model = FineTuner.from_checkpoint(ckpt_path).eval()
    data = model.trained_data
    size = image_size or data.get("image_size") or 224
    transform = eval_transform(size, tuple(data.get("mean", IMAGENET_MEAN)), tuple(data.get("std", IMAGENET_STD)))
    dataset = ImageFileDataset(str(folder), transform, draft_size=eval_draft_size(size), on_bad_image=on_bad_image)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    names = model.class_names
    output = Path(output)
    with atomic_write(output, newline="") as f, torch.inference_mode():
        writer = csv.writer(f)
        writer.writerow(["path", "prediction", "confidence", *(f"p_{n}" for n in names)])
        for images, indices in loader:
            logits = model(images).float()
            if not (finite := torch.isfinite(logits).all(dim=1)).all():
                bad = [dataset.paths[i] for i in indices[~finite].tolist()]
                raise CheckpointError(
                    f"checkpoint {ckpt_path} gives NaN or infinite outputs for {bad[0]}"
                    f"{f' (and {len(bad) - 1} more of its batch)' if len(bad) > 1 else ''}: its weights overflow; "
                    "use an earlier checkpoint of the run, or fine-tune again with a lower learning rate (--model.lr)"
                )
            probs = torch.softmax(logits, dim=1)
            conf, pred = probs.max(dim=1)
            for i, p, c, row in zip(indices.tolist(), pred.tolist(), conf.tolist(), probs.tolist(), strict=True):
                writer.writerow([dataset.paths[i], names[p], f"{c:.6f}", *(f"{x:.6f}" for x in row)])
    return output
