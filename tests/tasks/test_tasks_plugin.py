"""A new task is one class plus its data module, registered from user code (this file) alone: ``coretune fit --task
NAME``, ``coretune test`` and ``coretune predict`` then run it through :func:`coretune.cli.main` without any edit of
coretune (issue 61)."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy
from torchvision.transforms import v2

from coretune.cli import main
from coretune.data import TaskDataDefaults
from coretune.tasks import TASKS, Task, get_task, register_task
from fit_flags import QUIET
from image_trees import make_image_tree

MEAN = STD = (0.5, 0.5, 0.5)


class _Brightness(Dataset):
    """The images under a folder (recursively), labelled by their mean brightness: 0 dark, 1 bright."""

    def __init__(self, folder: Path, transform: Callable[[Any], Tensor]) -> None:
        self.paths = sorted(folder.rglob("*.png"))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image = Image.open(self.paths[i]).convert("RGB")
        return self.transform(image), int(np.asarray(image).mean() > 127.5)


class BrightnessData(TaskDataDefaults, L.LightningDataModule):
    """``root/{train,val}/**/*.png`` labelled dark or bright by their pixels (the folders' names play no part);
    validation and test read ``val/``. It implements :class:`coretune.data.TaskData` with the defaults of its
    optional members (:class:`~coretune.data.TaskDataDefaults`): no split settings, one view, no folder check."""

    def __init__(
        self,
        root: str = "",
        image_size: int = 16,
        batch_size: int = 8,
        seed: int = 0,
        mean: tuple[float, float, float] = MEAN,
        std: tuple[float, float, float] = STD,
    ) -> None:
        super().__init__()
        self.root, self.image_size, self.batch_size, self.seed = Path(root), image_size, batch_size, seed
        self.mean, self.std = tuple(mean), tuple(std)
        self.num_classes, self.class_names = 2, ["dark", "bright"]
        self.validates_on_test = True

    @classmethod
    def test_transform(
        cls, image_size: int, mean: tuple[float, float, float], std: tuple[float, float, float]
    ) -> tuple[Callable[[Any], Tensor], int]:
        ops = [v2.ToImage(), v2.Resize((image_size, image_size)), v2.ToDtype(torch.float32, scale=True)]
        return v2.Compose([*ops, v2.Normalize(mean, std)]), image_size

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        transform, _ = self.test_transform(self.image_size, self.mean, self.std)
        generator = torch.Generator().manual_seed(self.seed)
        dataset = _Brightness(self.root / split, transform)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, generator=generator)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("val")


class BrightnessTask(Task):
    """Dark or bright: the objective's classifier on the backbone's pooled features, scored by accuracy."""

    data_class = BrightnessData
    monitor = "acc"
    monitor_label = "accuracy"
    summary_keys: ClassVar[tuple[str, ...]] = ("train/loss", "train/acc", "val/loss", "val/acc")
    metric_names: ClassVar[tuple[str, ...]] = ("acc",)
    no_validation_split = "validation reads val/, as the test does"
    validation_split_fix = "a data module with a validation split of its own"

    def eval_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), targets)

    def train_metrics(self, num_classes: int) -> MetricCollection:
        return MetricCollection({"acc": MulticlassAccuracy(num_classes, average="micro")})

    def test_metrics(self, num_classes: int) -> MetricCollection:
        return self.train_metrics(num_classes)

    def test_results(self, computed: Mapping[str, Tensor], class_names: list[str]) -> dict[str, Any]:
        return {"acc": float(computed["acc"])}

    def summary_line(self, test: Mapping[str, Any]) -> str:
        return f"accuracy {100 * test['acc']:.2f}%"


@pytest.fixture
def brightness() -> Iterator[type[Task]]:
    """``@register_task("brightness")`` applied by user code for the test, and taken back after it (the other tests
    list the built-in tasks)."""
    registered = register_task("brightness")(BrightnessTask)
    yield registered
    TASKS.pop("brightness", None)


def test_a_task_registered_by_user_code_fits_tests_and_predicts(
    brightness: type[Task], tmp_path: Path, capsys: Any
) -> None:
    assert get_task("brightness") is BrightnessTask and list(TASKS)[-1] == "brightness"
    palette = np.array([[30, 30, 30], [225, 225, 225]])
    root = make_image_tree(tmp_path / "data", classes=("a", "b"), per_class=8, val_per_class=4, size=16,
                           palette=palette, noise=10)  # fmt: skip
    run = tmp_path / "run"
    fit = ["fit", "--task", "brightness", f"--data.root={root}", f"--run_dir={run}", "--model.backbone=small_cnn",
           "--trainer.max_epochs=1", *QUIET]  # fmt: skip
    main(fit)
    results = json.loads((run / "results.json").read_text())
    assert set(results["test"]) == {"acc"} and 0 <= results["test"]["acc"] <= 1
    assert "accuracy " in capsys.readouterr().out  # the task's summary line
    ckpt = run / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["coretune"]["task"] == "brightness"

    main(["test", f"--ckpt_path={ckpt}", f"--data.root={root}"])
    tested = json.loads((run / "test_results.json").read_text())
    assert tested["test"] == results["test"]  # the same weights (last.ckpt is the final one) on the same images

    output = tmp_path / "predictions.csv"
    main(["predict", f"--ckpt_path={ckpt}", f"--input={root / 'val'}", f"--output={output}"])
    with output.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["path", "prediction", "confidence", "p_dark", "p_bright"]
    assert len(rows) == 1 + 8 and {row[1] for row in rows[1:]} <= {"dark", "bright"}


def test_task_settings_are_task_options_and_the_model_spelling_is_deprecated(capsys: Any) -> None:
    from coretune.engine import translate_args

    args = ["--task", "segmentation", "--task.output_stride", "8", "--task.image_labels=multilabel"]
    assert translate_args(args) == [
        "--model.task=segmentation",
        "--model.task_settings.output_stride=8",
        "--model.task_settings.image_labels=multilabel",
    ]
    assert capsys.readouterr().err == ""
    assert translate_args(["--model.output_stride", "8"]) == ["--model.task_settings.output_stride=8"]
    assert capsys.readouterr().err == (
        "coretune fit: --model.output_stride is deprecated and will be removed in the next release: use "
        "--task.output_stride (a setting of the segmentation task)\n"
    )
