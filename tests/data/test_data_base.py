"""The data modules' shared base (options, checks, help lines) and the TaskData protocol they satisfy."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import docstring_parser
import pytest

from coretune.data import (
    DataError,
    DomainGeneralizationData,
    ImageClassificationData,
    ImageDataModule,
    SegmentationData,
    TaskData,
    TaskDataDefaults,
    missing_task_data,
    require_task_data,
)
from coretune.data.base import option_docs
from coretune.data.taskdata import TASK_DATA_MEMBERS
from coretune.tasks import TASKS
from domain_trees import make_domain_tree
from image_trees import make_image_tree
from segmentation_sets import make_voc_set

DATA_CLASSES = (ImageClassificationData, SegmentationData, DomainGeneralizationData)


def each_data_module(tmp_path: Path) -> list[ImageDataModule]:
    return [
        ImageClassificationData(str(make_image_tree(tmp_path / "cls", per_class=4, val_per_class=2, size=16)),
                                image_size=16, batch_size=4),
        SegmentationData(str(make_voc_set(tmp_path / "voc")), image_size=32, batch_size=4),
        DomainGeneralizationData(str(make_domain_tree(tmp_path / "dg", per_class=3, size=16)), test_domains="photo",
                                 image_size=16, batch_size=6, steps_per_epoch=2),
    ]  # fmt: skip


def test_every_data_module_is_task_data_and_an_image_data_module(tmp_path: Path) -> None:
    for data in each_data_module(tmp_path):
        data.setup()
        assert isinstance(data, ImageDataModule)
        assert isinstance(data, TaskData), type(data).__name__
        assert data.num_classes == len(data.class_names) >= 2
        data.check_folders()
        assert isinstance(data.separate_validation(), bool) and data.validates_on_test in (True, False)
        assert {"seed"} <= set(type(data).split_settings) <= set(inspect.signature(type(data)).parameters)
    assert not isinstance(object(), TaskData)


def test_each_registered_tasks_data_class_implements_task_data(tmp_path: Path) -> None:
    # every member the engine, the tasks and the applications read, declared once (the protocol's)
    assert set(TASK_DATA_MEMBERS) == {
        "split_settings", "makes_views", "image_size", "batch_size", "mean", "std", "validates_on_test",
        "train_views", "steps_per_epoch", "train_dataset", "val_dataset", "test_dataset", "num_classes",
        "class_names", "setup", "train_dataloader", "val_dataloader", "test_dataloader", "check_folders",
        "separate_validation", "test_files_in_training", "val_files_in_training", "require_test_split",
    }  # fmt: skip
    modules = {type(data): data for data in each_data_module(tmp_path)}
    for name, task in TASKS.items():
        data = modules[task.data_class]
        assert missing_task_data(data) == [], name  # before setup, reading no image
        assert require_task_data(data) is data
        assert (data.train_dataset, data.val_dataset, data.test_dataset) == (None, None, None)  # not set up yet
        data.setup()
        assert isinstance(data, TaskData), name
        assert all(hasattr(data, member) for member in TASK_DATA_MEMBERS)
        assert data.train_views == 1 and data.makes_views == (name != "segmentation")
        assert data.steps_per_epoch == (2 if name == "domain_generalization" else None)
        assert data.test_files_in_training() == data.val_files_in_training() == []
        assert data.require_test_split("unused") is None and len(data.train_dataset) > 0


class _Plain:
    """A data module of a user's own that implements too little of TaskData."""

    num_classes, class_names, image_size, batch_size = 2, ["a", "b"], 16, 4


class _WithDefaults(TaskDataDefaults, _Plain):
    mean = std = (0.5, 0.5, 0.5)


def test_a_data_module_missing_members_gets_one_error_naming_them_and_the_fix() -> None:
    with pytest.raises(DataError) as caught:
        require_task_data(_Plain())
    assert str(caught.value) == (
        "the data module must implement coretune.data.TaskData: _Plain lacks split_settings, makes_views, mean, "
        "std, validates_on_test, train_views, steps_per_epoch, train_dataset, val_dataset, test_dataset, setup, "
        "train_dataloader, val_dataloader, test_dataloader, check_folders, separate_validation, "
        "test_files_in_training, val_files_in_training, require_test_split; subclass coretune.data.ImageDataModule, "
        "or list coretune.data.TaskDataDefaults among its bases for the optional ones and define the rest"
    )
    with pytest.raises(DataError, match=r": _WithDefaults lacks setup, train_dataloader, val_dataloader, test_data"):
        require_task_data(_WithDefaults())  # the defaults leave the loaders (and setup, a LightningDataModule's)
    data = _WithDefaults()
    data.setup = data.train_dataloader = data.val_dataloader = data.test_dataloader = lambda: None
    assert require_task_data(data) is data
    assert (data.train_views, data.steps_per_epoch, data.split_settings, data.makes_views) == (1, None, (), False)
    assert data.separate_validation() and data.check_folders() is None and data.test_files_in_training() == []


@pytest.mark.parametrize("cls", DATA_CLASSES)
def test_every_option_is_in_the_signature_and_documented_once(cls: type[ImageDataModule]) -> None:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    documented = [p.arg_name for p in docstring_parser.parse(cls.__doc__ or "").params]
    assert sorted(documented) == sorted(p.name for p in params)  # the shared lines added, none twice
    assert all(p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    shared = option_docs(ImageDataModule.__doc__ or "")
    written = ast.get_docstring(ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]) or ""  # as in the file
    assert {"eval_batch_size", "num_workers", "mean", "std", "pin_memory"} <= shared.keys()
    for name in ("eval_batch_size", "num_workers", "mean", "std", "pin_memory"):  # declared once, on the base
        assert option_docs(cls.__doc__ or "")[name] == shared[name]
        assert f"    {name}:" not in written


@pytest.mark.parametrize("cls", DATA_CLASSES)
def test_shared_options_are_checked_in_one_message(cls: type[ImageDataModule]) -> None:
    with pytest.raises(DataError) as err:
        cls(root="x", batch_size=0, num_workers=-1, on_bad_image="ignore", mean=(2.0, 0.0, 0.0))  # type: ignore
    message = str(err.value)
    assert message.startswith("invalid data option(s): ") and message.endswith(" — set valid values (--data.<option>)")
    for part in ("batch_size must be >= 1, got 0", "num_workers must be >= 0 or auto, got -1",
                 "on_bad_image must be 'error' or 'skip', got 'ignore'", "mean"):  # fmt: skip
        assert part in message
