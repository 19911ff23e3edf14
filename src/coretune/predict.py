"""``coretune predict``: classify every image under a folder with a fine-tuned checkpoint, into a CSV."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from .data import IMAGENET_MEAN, IMAGENET_STD, ImageFileDataset, eval_transform
from .data.transforms import eval_draft_size
from .engine import FineTuner

__all__ = ["predict_folder"]


def predict_folder(
    ckpt_path: str | Path,
    folder: str | Path,
    output: str | Path = "predictions.csv",
    image_size: int | None = None,
    batch_size: int = 64,
    num_workers: int = 0,
) -> Path:
    """Write ``path, prediction, confidence, p_<class>…`` for every image under ``folder``; return the CSV path.

    The image size and normalisation default to those the model was fine-tuned with (stored in the checkpoint).
    """
    model = FineTuner.from_checkpoint(ckpt_path).eval()
    data = torch.load(ckpt_path, map_location="cpu", weights_only=True)["coretune"].get("data", {})
    size = image_size or data.get("image_size") or 224
    transform = eval_transform(size, tuple(data.get("mean", IMAGENET_MEAN)), tuple(data.get("std", IMAGENET_STD)))
    dataset = ImageFileDataset(str(folder), transform, draft_size=eval_draft_size(size))
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    names = model.class_names
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", newline="") as f, torch.inference_mode():
        writer = csv.writer(f)
        writer.writerow(["path", "prediction", "confidence", *(f"p_{n}" for n in names)])
        for images, indices in loader:
            probs = torch.softmax(model(images).float(), dim=1)
            conf, pred = probs.max(dim=1)
            for i, p, c, row in zip(indices.tolist(), pred.tolist(), conf.tolist(), probs.tolist(), strict=True):
                writer.writerow([dataset.paths[i], names[p], f"{c:.6f}", *(f"{x:.6f}" for x in row)])
    return output
