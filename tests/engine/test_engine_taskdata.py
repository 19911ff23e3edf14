"""The engine reads a data module through :class:`coretune.data.TaskData` alone: a user's plain LightningDataModule
gets one error naming what it lacks before any training, one listing :class:`~coretune.data.TaskDataDefaults`
trains, and no module of the engine, the tasks or the applications probes a data module with ``getattr``."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import coretune
from coretune.data import DataError, TaskDataDefaults
from coretune.engine import FineTuner, make_trainer
from coretune.objectives import create


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.arange(8) % 2), batch_size=4)


class _Plain(L.LightningDataModule):
    """Classes and loaders only: not a TaskData."""

    num_classes, class_names = 2, ["a", "b"]

    def train_dataloader(self) -> DataLoader:
        return _loader()


class _Declared(TaskDataDefaults, _Plain):
    """The same, with TaskData's defaults and the rest declared."""

    image_size, batch_size, mean, std = 16, 4, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def test_a_plain_data_module_is_refused_before_training_naming_what_it_lacks(tmp_path: Path) -> None:
    model = FineTuner(create("ce"), backbone="small_cnn", channels_last=False)
    trainer = make_trainer(tmp_path, progress=False, max_epochs=1, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(DataError, match=r"^the data module must implement coretune\.data\.TaskData: _Plain lacks "
                                        r"split_settings, makes_views, image_size, batch_size, mean, std, .*; "
                                        r"subclass coretune\.data\.ImageDataModule, or list "
                                        r"coretune\.data\.TaskDataDefaults among its bases"):  # fmt: skip
        trainer.fit(model, datamodule=_Plain())
    assert trainer.global_step == 0 and model.num_classes is None  # refused before the heads were built
    trainer = make_trainer(tmp_path / "ok", progress=False, max_epochs=1, enable_model_summary=False,
                           limit_val_batches=0)  # fmt: skip
    data = _Declared()
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 2 and model.num_classes == 2 and data.train_views == 1


def test_a_two_view_objective_needs_a_data_module_that_makes_views(tmp_path: Path) -> None:
    model = FineTuner(create("bi_tuning"), backbone="small_cnn", channels_last=False)
    trainer = make_trainer(tmp_path, progress=False, max_epochs=1, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"'bi_tuning' needs 2 augmented views .* makes_views = True"):
        trainer.fit(model, datamodule=_Declared())  # makes_views False: its batches hold one view


def test_no_getattr_probe_of_a_data_module_is_left() -> None:
    # the engine, the tasks and the applications read data modules through TaskData (typed attribute access)
    package = Path(coretune.__file__).parent
    sources = [*(package / "engine").glob("*.py"), *(package / "tasks").glob("*.py"), *(package / "apps").glob("*.py")]
    sources.append(package / "cli.py")
    probe = re.compile(r"(getattr|hasattr)\((self\.)?(trainer\.)?(datamodule|data)\b")
    found = [f"{path.name}: {line.strip()}" for path in sources for line in path.read_text().splitlines()
             if probe.search(line)]  # fmt: skip
    assert found == []
