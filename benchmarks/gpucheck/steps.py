"""Training images/s of one model: a bare PyTorch loop against ``coretune fit``'s engine, on the same batches.

Both run the same backbone (:func:`coretune.models.create_backbone`), batch size, precision (Lightning's
``bf16-mixed``, ``16-mixed`` or ``32-true``; the bare loop autocasts the forward pass the same way and scales fp16
losses with a ``GradScaler``), memory format and compilation, and SGD with Nesterov momentum as
:class:`~coretune.engine.OptimSettings` sets it. The batches are synthetic, made once and held on the device, so
neither side waits for a loader (the loader is measured alone: :mod:`.loading`). Only steady-state steps are timed:
``warmup`` steps first (compilation, cuDNN's choices, the allocator), then ``steps`` steps between two device
synchronisations.
"""

from __future__ import annotations

import gc
import inspect
import logging
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from coretune.data import IMAGENET_MEAN, IMAGENET_STD, TaskDataDefaults
from coretune.engine import FineTuner, OptimSettings, make_trainer, quiet_lightning
from coretune.models import create_backbone
from coretune.objectives import create

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}
NUM_CLASSES = 100
#: Lightning's warnings about what the check does on purpose: no validation, no loader workers (the batches are on
#: the device), no best checkpoint, and fp16 run as bf16 on a CPU (--smoke)
WARNINGS = (
    ".*(does not have many workers|val_dataloader|could not find the monitored key|fp16 is not supported on CPU).*"
)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the check: a backbone name, its constructor options, image size, batch and memory format."""

    label: str
    backbone: str
    image_size: int
    batch_size: int
    channels_last: bool
    backbone_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepSettings:
    """How long each measurement runs, and on which device."""

    steps: int
    warmup: int
    device: str
    compile_backend: str = "inductor"  # --smoke: "eager" (dynamo's graph capture without code generation)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fresh_device(device: str) -> None:
    """Free what the last measurement left (its models, compiled graphs) and restart the peak-memory count."""
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


@contextmanager
def compile_backend(backend: str):
    """``torch.compile`` (which ``nn.Module.compile`` calls) with ``backend`` unless a caller names one: the smoke
    run compiles with dynamo's ``eager`` backend, which captures the graphs without generating code (inductor
    needs ~20 s per model on a small CPU); ``inductor`` (the default) changes nothing."""
    if backend == "inductor":
        yield
        return
    original = torch.compile

    def compile_with(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)

    torch.compile = compile_with
    try:
        yield
    finally:
        torch.compile = original


class Batches(Dataset):
    """``length`` ready batches ``(images, labels)``, cycling through ``distinct`` random ones on the device: a
    whole batch per item (``DataLoader(batch_size=None)``), so no collation or copy happens in the loop."""

    def __init__(self, spec: ModelSpec, length: int, device: str, distinct: int = 4) -> None:
        generator = torch.Generator().manual_seed(0)
        shape = (spec.batch_size, 3, spec.image_size, spec.image_size)
        self.items = [
            (
                torch.randn(shape, generator=generator).to(device),
                torch.randint(0, NUM_CLASSES, (spec.batch_size,), generator=generator).to(device),
            )
            for _ in range(distinct)
        ]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[index % len(self.items)]


class BatchData(TaskDataDefaults, L.LightningDataModule):
    """A data module over :class:`Batches` (classification, ``NUM_CLASSES`` classes)."""

    def __init__(self, batches: Batches, spec: ModelSpec) -> None:
        super().__init__()
        self.batches, self.num_classes = batches, NUM_CLASSES
        self.class_names = [str(i) for i in range(NUM_CLASSES)]
        self.image_size, self.batch_size = spec.image_size, spec.batch_size
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)


class Window(L.Callback):
    """The seconds between the start of step ``warmup`` and the end of step ``warmup + steps - 1`` (each side after
    a device synchronisation): the optimiser steps included, the warm-up and the fit's set-up and end not."""

    def __init__(self, warmup: int, steps: int, device: str) -> None:
        self.first, self.last, self.device = warmup, warmup + steps - 1, device
        self.start: float | None = None
        self.seconds: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.first:
            synchronize(self.device)
            self.start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if idx == self.last and self.start is not None:
            synchronize(self.device)
            self.seconds = time.perf_counter() - self.start


def rates(spec: ModelSpec, steps: int, seconds: float, device: str) -> dict[str, Any]:
    return {
        "images_per_s": round(steps * spec.batch_size / seconds, 1),
        "step_ms": round(1e3 * seconds / steps, 2),
        "peak_memory_gib": peak_memory_gib(device),
    }


def fine_tuner_takes_compile() -> bool:
    """Whether this coretune's :class:`FineTuner` has the ``compile`` setting (``--model.compile``)."""
    return "compile" in inspect.signature(FineTuner).parameters


def bare_loop(spec: ModelSpec, settings: StepSettings, precision: str, compiled: bool) -> dict[str, Any]:
    """Images/s of a plain PyTorch training loop: backbone, linear classifier, cross-entropy, SGD."""
    device, dtype = settings.device, AUTOCAST[precision]
    fresh_device(device)
    backbone = create_backbone(spec.backbone, verbose=False, **spec.backbone_args).to(device)
    if spec.channels_last:
        backbone = backbone.to(memory_format=torch.channels_last)
    head = torch.nn.Linear(backbone.feature_dim, NUM_CLASSES).to(device)
    optim = OptimSettings()
    optimizer = torch.optim.SGD(
        [*backbone.parameters(), *head.parameters()],
        lr=optim.lr,
        momentum=optim.momentum,
        nesterov=optim.nesterov,
        weight_decay=optim.weight_decay,
    )
    scaler = torch.amp.GradScaler(device) if precision == "16-mixed" else None
    batches = Batches(spec, settings.warmup + settings.steps, device)
    with compile_backend(settings.compile_backend):
        if compiled:
            backbone.compile()
        start = 0.0
        for index in range(len(batches)):
            if index == settings.warmup:
                synchronize(device)
                start = time.perf_counter()
            images, labels = batches[index]
            if spec.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            cast = torch.autocast(device, dtype=dtype) if dtype is not None else nullcontext()
            with cast:
                logits = head(backbone(images))
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        synchronize(device)
    result = rates(spec, settings.steps, time.perf_counter() - start, device)
    return result | ({"compile_status": "compiled"} if compiled else {})


def fit_run(spec: ModelSpec, settings: StepSettings, precision: str, compiled: bool, objective: str) -> dict[str, Any]:
    """Images/s of ``coretune fit``'s engine: :class:`FineTuner` with ``objective`` in the trainer coretune makes
    (its checkpoints, run files, health checks and guards; no progress bar, no validation)."""
    device = settings.device
    fresh_device(device)
    options: dict[str, Any] = {"compile": True} if compiled else {}
    model = FineTuner(
        create(objective),
        backbone=spec.backbone,
        backbone_args=spec.backbone_args or None,
        channels_last=spec.channels_last,
        **options,
    )
    window = Window(settings.warmup, settings.steps, device)
    batches = Batches(spec, settings.warmup + settings.steps, device)
    quiet_lightning()
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # not the accelerator and precision report of every fit
    with tempfile.TemporaryDirectory() as run_dir, compile_backend(settings.compile_backend), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=WARNINGS)
        trainer = make_trainer(
            run_dir,
            progress=False,
            enable_progress_bar=False,
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=1,
            precision=precision,
            max_steps=settings.warmup + settings.steps,
            max_epochs=1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            enable_model_summary=False,
            callbacks=[window],
        )
        try:
            trainer.fit(model, datamodule=BatchData(batches, spec))
        finally:
            lightning_log.setLevel(level)
    if window.seconds is None:
        raise RuntimeError(f"the fit ran {trainer.global_step} steps, fewer than the {len(batches)} asked for")
    result = rates(spec, settings.steps, window.seconds, device)
    result["precision_used"] = str(trainer.precision)  # Lightning runs 16-mixed as bf16-mixed on a CPU
    if compiled:
        result["compile_status"] = getattr(model, "compile_status", None) or "unknown"
    return result
