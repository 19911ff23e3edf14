"""``--data.num_workers`` and ``--data.pin_memory``: ``auto`` (the default) chosen for the accelerator, explicit values
kept, bad values refused in one line. No GPU is needed: CUDA is faked where it decides."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

from coretune.data import DataError, ImageClassificationData
from coretune.data import loading as loading_module
from coretune.data.loading import (
    MAX_AUTO_WORKERS,
    LoaderSettings,
    hardware_of_settings,
    hardware_of_trainer,
    resolve_loading,
)
from image_trees import make_image_tree


def test_auto_on_cpu_loads_in_the_main_process_as_before() -> None:
    settings = resolve_loading("auto", "auto", cuda=False, cores=64)
    assert settings == LoaderSettings(0, False, None, settings.chosen)
    assert settings.options() == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    assert "auto without CUDA" in settings.chosen


@pytest.mark.parametrize(
    ("cores", "processes", "workers", "prefetch"),
    [(16, 1, 8, 2), (64, 2, 8, 2), (12, 4, 3, 3), (4, 2, 2, 4), (1, 1, 1, 4), (2, 4, 0, None)],
)
def test_auto_on_cuda_starts_a_worker_per_core_of_each_process_up_to_8(
    cores: int, processes: int, workers: int, prefetch: int | None
) -> None:
    settings = resolve_loading("auto", "auto", cuda=True, processes_per_node=processes, cores=cores)
    assert (settings.num_workers, settings.pin_memory, settings.prefetch_factor) == (workers, True, prefetch)
    assert settings.num_workers <= MAX_AUTO_WORKERS
    options = settings.options()
    assert options["persistent_workers"] is (workers > 0) and options["pin_memory"] is True
    assert options.get("prefetch_factor") == prefetch  # torch refuses a prefetch_factor without workers
    assert f"{cores // processes} CPU core(s) per process of {processes}" in settings.describe()


@pytest.mark.parametrize("cuda", [False, True])
def test_explicit_values_win(cuda: bool) -> None:
    settings = resolve_loading(3, False, cuda=cuda, cores=16)
    assert (settings.num_workers, settings.pin_memory, settings.chosen) == (3, False, "")
    assert resolve_loading(0, True, cuda=cuda, cores=16).options() == {
        "num_workers": 0, "pin_memory": True, "persistent_workers": False}  # fmt: skip
    mixed = resolve_loading(2, "auto", cuda=cuda, cores=16)  # one given, the other chosen
    assert (mixed.num_workers, mixed.pin_memory) == (2, cuda) and mixed.chosen


def test_cpu_cores_is_the_process_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading_module.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert loading_module.cpu_cores() == 3
    assert resolve_loading("auto", "auto", cuda=True).num_workers == 3


def fake_cuda(monkeypatch: pytest.MonkeyPatch, devices: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        ({}, (True, 4)),  # accelerator and devices auto: every device of the node
        ({"accelerator": "gpu", "devices": 2}, (True, 2)),
        ({"accelerator": "cuda", "devices": [0, 3]}, (True, 2)),
        ({"accelerator": "auto", "devices": "0,1,2"}, (True, 3)),
        ({"accelerator": "auto", "devices": -1}, (True, 4)),
        ({"accelerator": "cpu", "devices": 2}, (False, 1)),
    ],
)
def test_the_trainer_settings_name_the_hardware(
    monkeypatch: pytest.MonkeyPatch, trainer: dict[str, object], expected: tuple[bool, int]
) -> None:
    fake_cuda(monkeypatch, devices=4)
    assert hardware_of_settings(trainer) == expected


def test_without_cuda_auto_and_gpu_settings_are_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hardware_of_settings({"accelerator": "auto", "devices": "auto"}) == (False, 1)
    assert hardware_of_trainer(None) == (False, 1)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_tree(tmp_path_factory.mktemp("loading") / "data", per_class=4, val_per_class=2, size=16)


def test_a_data_module_resolves_auto_for_its_trainer_and_says_so_once(
    tree: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loading_module, "cpu_cores", lambda: 12)
    dm = ImageClassificationData(str(tree), image_size=16, batch_size=4)
    assert (dm.num_workers, dm.pin_memory) == ("auto", "auto")  # the defaults
    dm.trainer = SimpleNamespace(accelerator=CPUAccelerator(), num_devices=1)  # type: ignore[assignment]
    loader = dm.val_dataloader()
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (0, False, False)
    dm = ImageClassificationData(str(tree), image_size=16, batch_size=4)
    dm.trainer = SimpleNamespace(accelerator=CUDAAccelerator(), num_devices=2)  # type: ignore[assignment]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert dm.loader_settings() == LoaderSettings(6, True, 2, dm.loader_settings().chosen)
        dm.loader_settings()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data loading:")]
    assert lines == [
        "data loading: num_workers=6, pin_memory=true, persistent_workers=true, prefetch_factor=2 (auto for CUDA, "
        "6 CPU core(s) per process of 2; --data.num_workers and --data.pin_memory set them)"
    ]
    dm = ImageClassificationData(str(tree), image_size=16, batch_size=4, num_workers=1, pin_memory=False)
    dm.trainer = SimpleNamespace(accelerator=CUDAAccelerator(), num_devices=1)  # type: ignore[assignment]
    assert (dm.loader_settings().num_workers, dm.loader_settings().pin_memory) == (1, False)  # explicit wins


def test_without_a_trainer_auto_follows_torch_cuda(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading_module, "cpu_cores", lambda: 3)
    fake_cuda(monkeypatch, devices=1)
    dm = ImageClassificationData(str(tree), image_size=16, batch_size=4)
    assert (dm.loader_settings().num_workers, dm.loader_settings().pin_memory) == (3, True)  # coretune eval's case


@pytest.mark.parametrize(("value", "message"), [(-1, "num_workers must be >= 0 or auto, got -1")])
def test_bad_values_are_refused_in_one_line(tree: Path, value: int, message: str) -> None:
    with pytest.raises(DataError) as err:
        ImageClassificationData(str(tree), num_workers=value)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_each_slurm_task_has_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading_module.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert resolve_loading("auto", "auto", cuda=True, processes_per_node=4).num_workers == 2  # one process's cores
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # srun --ntasks-per-node 4 --cpus-per-task 8: 8 cores each
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert resolve_loading("auto", "auto", cuda=True, processes_per_node=4).num_workers == 8
