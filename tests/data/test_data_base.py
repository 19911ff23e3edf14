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
)
from coretune.data.base import option_docs
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
    for part in ("batch_size must be >= 1, got 0", "num_workers must be >= 0, got -1",
                 "on_bad_image must be 'error' or 'skip', got 'ignore'", "mean"):  # fmt: skip
        assert part in message
