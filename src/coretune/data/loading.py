"""How the data modules' loaders load: ``--data.num_workers`` and ``--data.pin_memory`` given, or ``auto`` (the
default) chosen for the accelerator the run trains on (:func:`resolve_loading`).

``auto`` on CUDA: ``min(8, CPU cores per process)`` workers (the cores this process may run on, shared by the
devices of one node), pinned memory, workers kept alive between epochs and enough batches prefetched to keep at
least 8 in flight (up to 4 per worker). ``auto`` elsewhere (CPU, MPS): loading in the main process, unpinned, as
before ``auto`` existed. An explicit int or true/false always wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "AUTO",
    "MAX_AUTO_WORKERS",
    "LoaderSettings",
    "NumWorkers",
    "PinMemory",
    "cores_per_process",
    "cpu_cores",
    "hardware_of_settings",
    "hardware_of_trainer",
    "is_auto",
    "resolve_loading",
]

AUTO = "auto"
NumWorkers = int | Literal["auto"]
"""``--data.num_workers``: worker processes, or ``auto``."""
PinMemory = bool | Literal["auto"]
"""``--data.pin_memory``: pin batches in page-locked memory, or ``auto`` (on CUDA only)."""

MAX_AUTO_WORKERS = 8
"""The most workers ``auto`` starts per process (more rarely loads faster and costs memory per worker)."""
_IN_FLIGHT = 8  # batches ``auto`` keeps prefetched on CUDA across the workers
_MAX_PREFETCH = 4  # per worker


@dataclass(frozen=True)
class LoaderSettings:
    """A data module's ``DataLoader`` settings, resolved (no ``auto`` left)."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None = None
    """Batches each worker loads ahead (None: torch's default, 2 with workers)."""
    chosen: str = ""
    """Why, when ``auto`` chose any of them (``"auto on CUDA: 16 CPU cores, 2 devices"``); empty otherwise."""

    @property
    def persistent_workers(self) -> bool:
        """Workers kept alive between epochs (whenever there are any)."""
        return self.num_workers > 0

    def options(self) -> dict[str, Any]:
        """The ``DataLoader`` keyword arguments."""
        options: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                                   "persistent_workers": self.persistent_workers}  # fmt: skip
        if self.prefetch_factor is not None and self.num_workers > 0:
            options["prefetch_factor"] = self.prefetch_factor
        return options

    def describe(self) -> str:
        """One line naming the values (and, for ``auto``, why)."""
        prefetch = f", prefetch_factor={self.prefetch_factor}" if self.prefetch_factor and self.num_workers else ""
        why = f" ({self.chosen})" if self.chosen else ""
        return (
            f"data loading: num_workers={self.num_workers}, pin_memory={str(self.pin_memory).lower()}, "
            f"persistent_workers={str(self.persistent_workers).lower()}{prefetch}{why}"
        )


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: a job scheduler's share, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cores_per_process(processes_per_node: int, cores: int | None = None) -> int:
    """The CPU cores each of ``processes_per_node`` processes may use: ``cores`` (default: :func:`cpu_cores`)
    shared among them, as when Lightning or torchrun start them from one process; in a SLURM job step (``srun``,
    ``--cpus-per-task``) each task's affinity is its own already, and :func:`cpu_cores` is its share."""
    if cores is None and "SLURM_STEP_ID" in os.environ and "SLURM_CPUS_PER_TASK" in os.environ:
        return cpu_cores()
    return (cores if cores is not None else cpu_cores()) // max(1, processes_per_node)


def is_auto(value: Any) -> bool:
    """Whether an option's value is ``auto``."""
    return isinstance(value, str) and value == AUTO


def resolve_loading(
    num_workers: NumWorkers, pin_memory: PinMemory, *, cuda: bool, processes_per_node: int = 1, cores: int | None = None
) -> LoaderSettings:
    """The loader settings for these option values, on CUDA or not, with ``processes_per_node`` processes (the
    devices of one node) sharing ``cores`` CPU cores (default: :func:`cores_per_process`'s). Explicit values are kept as
    they are (the data modules check them: :data:`~coretune.data.base.SHARED_CHECKS`).
    """
    auto_workers, auto_pin = is_auto(num_workers), is_auto(pin_memory)
    per_process = cores_per_process(processes_per_node, cores)
    workers = (min(MAX_AUTO_WORKERS, per_process) if cuda else 0) if auto_workers else num_workers
    pin = cuda if auto_pin else pin_memory
    prefetch = min(_MAX_PREFETCH, max(2, math.ceil(_IN_FLIGHT / workers))) if cuda and workers > 0 else None
    chosen = ""
    if auto_workers or auto_pin:
        where = f"for CUDA, {per_process} CPU core(s) per process of {processes_per_node}" if cuda else "without CUDA"
        chosen = f"auto {where}; --data.num_workers and --data.pin_memory set them"
    return LoaderSettings(workers, pin, prefetch, chosen)


def _is_cuda_name(accelerator: Any) -> bool:
    """Whether a ``--trainer.accelerator`` value trains on CUDA here (``auto`` and ``gpu`` do where CUDA is)."""
    from lightning.pytorch.accelerators import CUDAAccelerator

    if isinstance(accelerator, CUDAAccelerator):
        return True
    name = str(accelerator if accelerator is not None else AUTO).lower()
    return name in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def _cuda_devices(devices: Any) -> int:
    """How many CUDA devices of this node a ``--trainer.devices`` value uses (``auto``, ``-1``: all)."""
    count = torch.cuda.device_count()
    if isinstance(devices, list | tuple):
        return max(1, len(devices))
    text = str(devices if devices is not None else AUTO).strip()
    if text in ("auto", "-1"):
        return max(1, count)
    if "," in text:
        return max(1, len([d for d in text.split(",") if d.strip()]))
    try:
        return max(1, int(text))
    except ValueError:
        return 1


def hardware_of_settings(trainer: Mapping[str, Any]) -> tuple[bool, int]:
    """Whether a run's trainer settings (``--trainer.*``, parsed) train on CUDA, and with how many processes per
    node (its CUDA devices; 1 without CUDA)."""
    cuda = _is_cuda_name(trainer.get("accelerator"))
    return cuda, _cuda_devices(trainer.get("devices")) if cuda else 1


def hardware_of_trainer(trainer: Any) -> tuple[bool, int]:
    """Whether a ``Trainer`` (None: not attached, as for ``coretune eval``) runs on CUDA, and how many processes per
    node; without one, CUDA where it is available, one process."""
    if trainer is None:
        return torch.cuda.is_available(), 1
    from lightning.pytorch.accelerators import CUDAAccelerator

    cuda = isinstance(getattr(trainer, "accelerator", None), CUDAAccelerator)
    return cuda, max(1, int(getattr(trainer, "num_devices", 1) or 1)) if cuda else 1
