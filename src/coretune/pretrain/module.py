"""Contrastive pre-training as Lightning modules: SimCLR (Chen et al. 2020) and MoCo v2 (Chen et al. 2020).

Both train any coretune backbone (:func:`coretune.models.create_backbone`) on batches of two views
``(view1, view2)`` (:class:`~coretune.pretrain.data.PretrainData`), with the optimiser and schedules of the
fine-tuning engine. Besides Lightning's ``.ckpt`` (for resuming), :class:`ExportPretrained` writes the encoder
in the layout of the method's reference code after every epoch, which ``coretune fit --model.weights`` and
other tools read:

- SimCLR: ``{'epoch', 'arch', 'method': 'simclr', 'state_dict': {'backbone.<encoder keys>',
  'projector.<…>'}}``;
- MoCo v2 (facebookresearch/moco): ``{'epoch', 'arch', 'state_dict': {'module.encoder_q.<encoder keys>',
  'module.encoder_q.fc.{0,2}.*', 'module.encoder_k.…', 'module.queue', 'module.queue_ptr'}, 'optimizer'}``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from ..distributed import listed, rank, ranks_where, world_size
from ..engine import (
    NonFiniteLossError,
    RunArtifacts,
    StopOnSignal,
    atomic_torch_save,
    build_optimizer,
    default_precision,
    with_atomic_io,
)
from ..engine.loggers import LogRunSettings
from ..engine.module import example_image
from ..engine.optim import OptimizerName, Schedule, build_schedule, diverged_fix, optimizer_problems, resume_schedule
from ..engine.preflight import check_images_vary
from ..heads import ProjectionHead
from ..models import create_backbone
from ..momentum import momentum_update
from ..runs.layout import RunDir
from .losses import KeyQueue, global_nt_xent, moco_infonce, nt_xent

__all__ = [
    "PRETRAINED_FILENAME",
    "ContrastivePretrainer",
    "ExportPretrained",
    "MoCoV2",
    "SimCLR",
    "check_snapshot_epochs",
    "make_pretrain_trainer",
    "pretrain_callbacks",
    "pretrain_trainer_defaults",
    "snapshot_path",
]

PRETRAINED_FILENAME = "pretrained.pth.tar"
"""Name of the exported encoder checkpoint in a pre-training run directory."""


class ContrastivePretrainer(L.LightningModule):
    """Shared parts of the contrastive methods: encoder ``f``, projection head ``g`` (``d → d → proj_dim``),
    optimiser and schedule; subclasses define :meth:`contrastive_loss` and :meth:`pretrained_checkpoint`.

    Args:
        backbone: backbone name (``resnet18`` … , ``small_cnn``, ``timm/<model>``).
        weights: optional local checkpoint to start from (continued pre-training).
        weights_allow_cast: load ``weights`` whose floating-point tensors are stored as integers (or quantised).
        proj_dim: output width of the projection head.
        temperature: softmax temperature ``τ`` of the contrastive loss.
        optimizer: ``sgd`` (momentum), ``adam`` or ``adamw``.
        lr: learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay.
        schedule: per-step learning-rate decay (``cosine``, ``linear``, ``constant``).
        warmup_epochs: linear warm-up length in epochs.
        channels_last: channels-last memory format for the encoders and views (fast for CNNs).
        backbone_args: options of the backbone's constructor, e.g. ``{img_size: 32, patch_size: 4}`` for a timm ViT
            (as ``coretune fit``'s ``--model.backbone_args``; fine-tune the export with the same).
    """

    method = ""

    def __init__(
        self,
        backbone: str,
        weights: str | None,
        proj_dim: int,
        temperature: float,
        optimizer: OptimizerName,
        lr: float,
        momentum: float,
        weight_decay: float,
        schedule: Schedule,
        warmup_epochs: float,
        channels_last: bool,
        weights_allow_cast: bool = False,
        backbone_args: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        problems = []
        if proj_dim < 1:
            problems.append(f"proj_dim must be >= 1 (got {proj_dim})")
        if temperature <= 0:
            problems.append(f"temperature must be > 0 (got {temperature})")
        problems += optimizer_problems(lr, weight_decay, momentum, warmup_epochs)
        if problems:
            raise ValueError(f"invalid {self.method} settings: " + "; ".join(problems))
        self.save_hyperparameters()
        self.backbone = create_backbone(
            backbone, weights=weights, allow_cast=weights_allow_cast, **(backbone_args or {})
        )
        self.projector = ProjectionHead(self.backbone.feature_dim, proj_dim, depth=2)
        if channels_last:
            self.backbone.to(memory_format=torch.channels_last)

    def _views(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.hparams.channels_last else x

    def forward(self, x: Tensor) -> Tensor:
        """Projections ``g(f(x))`` of a batch of views (the query encoder's, for MoCo)."""
        return self.projector(self.backbone(self._views(x)))

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if (example := example_image(getattr(datamodule, "image_size", None))) is not None:
            self.example_input_array = example
        dataset, batch_size = getattr(datamodule, "train_dataset", None), getattr(datamodule, "batch_size", None)
        if stage == "fit":
            check_images_vary(dataset)
        processes = world_size()
        if processes > 1 and dataset is not None and batch_size is not None and len(dataset) < processes * batch_size:
            most = len(dataset) // processes
            fix = f"pass --data.batch_size {most} or less" if most >= 2 else "add images, or run on fewer processes"
            # the distributed sampler pads the order by repeating images: an image's views among its own negatives
            raise ValueError(
                f"{len(dataset)} training images fill less than one global batch of {processes} processes × "
                f"--data.batch_size {batch_size}, so batches would repeat images, each image's views then among its "
                f"own negatives: {fix}"
            )

    def contrastive_loss(self, view1: Tensor, view2: Tensor) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        view1, view2 = batch
        loss = self.contrastive_loss(view1, view2)
        # decided over every process, so they all stop and rank 0 records it
        if failed := ranks_where(not bool(torch.isfinite(loss)), loss.device):
            value = float(loss.detach()) if rank() in failed else "not finite"
            where = f" on process {listed(failed)}" if world_size() > 1 else ""
            raise NonFiniteLossError(
                f"the {self.method} loss is {value}{where} at epoch {self.current_epoch}, "
                f"step {self.global_step}: {diverged_fix(getattr(self._trainer, 'precision', None), '--model.lr')}"
            )
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=view1.shape[0])
        return loss

    def on_train_start(self) -> None:
        resume_schedule(self.trainer)  # a run extended on resume: the stretched schedule's lr from its first step

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = build_optimizer([(params, hp.lr)], hp.optimizer, hp.momentum, False, hp.weight_decay)
        scheduler = build_schedule(optimizer, self.trainer, hp.warmup_epochs, hp.schedule, "--model.schedule")
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def pretrained_checkpoint(self) -> dict[str, Any]:
        """The encoder (and heads) in the method's reference layout, as :func:`torch.save` should write it."""
        raise NotImplementedError

    @staticmethod
    def _prefixed(module: torch.nn.Module, prefix: str) -> dict[str, Tensor]:
        return {prefix + k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}


class SimCLR(ContrastivePretrainer):
    """SimCLR: NT-Xent over the ``2N`` projections of both views of a batch (Chen et al., ICML 2020, Alg. 1).

    Both views go through the encoder in one batch. Under DDP, ``gather=True`` (default) contrasts the global
    batch (:func:`~coretune.pretrain.losses.global_nt_xent`: every image against all ``2·B_global − 2`` others,
    as SimCLR's own implementation); ``gather=False`` keeps each process's batch as its negatives.
    Defaults follow the small-image recipe of the shared ``simclr_resnet18_in20_64px`` checkpoint (τ = 0.2, Adam lr
    1e-3, weight decay 1e-6, cosine decay).

    Args:
        gather: under DDP, contrast the global batch (see above); ``False``: each process's own batch.
    """

    method = "simclr"

    def __init__(
        self,
        backbone: str = "resnet18",
        weights: str | None = None,
        proj_dim: int = 128,
        temperature: float = 0.2,
        optimizer: OptimizerName = "adam",
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 1e-6,
        schedule: Schedule = "cosine",
        warmup_epochs: float = 0.0,
        channels_last: bool = True,
        gather: bool = True,
        weights_allow_cast: bool = False,
        backbone_args: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            backbone=backbone,
            weights=weights,
            proj_dim=proj_dim,
            temperature=temperature,
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            schedule=schedule,
            warmup_epochs=warmup_epochs,
            channels_last=channels_last,
            weights_allow_cast=weights_allow_cast,
            backbone_args=backbone_args,
        )
        self.gather = gather

    def contrastive_loss(self, view1: Tensor, view2: Tensor) -> Tensor:
        z1, z2 = self(torch.cat([view1, view2])).chunk(2)
        return (global_nt_xent if self.gather else nt_xent)(z1, z2, self.hparams.temperature)

    def pretrained_checkpoint(self) -> dict[str, Any]:
        state = self._prefixed(self.backbone.body, "backbone.") | self._prefixed(self.projector, "projector.")
        return {
            "epoch": self.current_epoch + 1,
            "arch": self.backbone.name,
            "method": self.method,
            "state_dict": state,
        }


class MoCoV2(ContrastivePretrainer):
    """MoCo v2: a query encoder trained with InfoNCE against a momentum key encoder and a queue of keys
    (He et al., CVPR 2020, Algorithm 1; Chen et al. 2020: MLP head, τ = 0.2, aug+, cosine schedule).

    Batch-norm shuffling (Shuffle BN) is simulated on one device: the keys are computed in ``bn_splits``
    sub-batches of a random permutation, so a query and its key never share batch statistics (per process under
    DDP). The queries use the whole batch's statistics, as MoCo's multi-GPU code does per GPU; MoCo's CIFAR demo
    splits the query encoder's batch norm too (``SplitBatchNorm``), which also updates its running statistics
    once per step, where ``bn_splits`` sequential forwards here would update them ``bn_splits`` times. With several
    processes every one enqueues the keys of the global batch, as MoCo's ``concat_all_gather`` does.

    Args:
        queue_size: number of queued negative keys ``K`` (65536 in the paper for ImageNet; keep it below the
            number of training images).
        key_momentum: momentum ``m`` of the key encoder update ``θ_k ← m θ_k + (1 - m) θ_q`` (0.999 in the paper
            for ImageNet; the default 0.99, as in MoCo's CIFAR demo, suits short runs).
        bn_splits: number of sub-batches of the key forward pass (1: no Shuffle BN); a per-process batch needs at
            least ``2 × bn_splits`` images.
    """

    method = "moco_v2"

    def __init__(
        self,
        backbone: str = "resnet18",
        weights: str | None = None,
        proj_dim: int = 128,
        temperature: float = 0.2,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.06,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        schedule: Schedule = "cosine",
        warmup_epochs: float = 0.0,
        channels_last: bool = True,
        queue_size: int = 4096,
        key_momentum: float = 0.99,
        bn_splits: int = 8,
        weights_allow_cast: bool = False,
        backbone_args: dict[str, Any] | None = None,
    ) -> None:
        problems = []
        if queue_size < 1:
            problems.append(f"queue_size must be >= 1 (got {queue_size})")
        if not 0 <= key_momentum < 1:
            problems.append(f"key_momentum must lie in [0, 1) (got {key_momentum})")
        if bn_splits < 1:
            problems.append(f"bn_splits must be >= 1 (got {bn_splits})")
        if problems:
            raise ValueError(f"invalid {self.method} settings: " + "; ".join(problems))
        super().__init__(
            backbone=backbone,
            weights=weights,
            proj_dim=proj_dim,
            temperature=temperature,
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            schedule=schedule,
            warmup_epochs=warmup_epochs,
            channels_last=channels_last,
            weights_allow_cast=weights_allow_cast,
            backbone_args=backbone_args,
        )
        self.momentum_backbone = copy.deepcopy(self.backbone).requires_grad_(False)
        self.momentum_projector = copy.deepcopy(self.projector).requires_grad_(False)
        self.queue = KeyQueue(proj_dim, queue_size)
        self._updated_at: int | None = None  # the optimiser step the key encoder last followed the query encoder at

    def setup(self, stage: str) -> None:
        super().setup(stage)
        precision = str(getattr(self.trainer, "precision", ""))
        if precision.endswith("-true") and precision != "32-true" and precision != "64-true":
            raise ValueError(
                f"MoCo's key encoder moves by (1 − key_momentum) of its distance to the query encoder each step, "
                f"which --trainer.precision {precision} (half-precision weights) rounds away: use bf16-mixed or "
                "16-mixed (float32 weights, half-precision compute)"
            )
        datamodule = getattr(self.trainer, "datamodule", None)
        dataset = getattr(datamodule, "train_dataset", None)
        if dataset is not None and self.queue.size > len(dataset):
            raise ValueError(
                f"MoCo's queue_size {self.queue.size} exceeds the {len(dataset)} training images, so the "
                "queue would hold keys of the query's own image as negatives: lower --model.queue_size"
            )
        if dataset is not None and (batch_size := getattr(datamodule, "batch_size", None)) is not None:
            self._check_bn_splits(batch_size, len(dataset))

    def _check_bn_splits(self, batch_size: int, images: int) -> None:
        """Refuse a per-process batch that leaves a Shuffle BN sub-batch of :meth:`keys` fewer than 2 images. The
        loader drops an incomplete last batch; one process given fewer images than a batch has one batch of all."""
        splits, several = self.hparams.bn_splits, world_size() > 1
        batch = batch_size if several else min(batch_size, images)
        if batch >= 2 * splits:
            return
        if several:
            source = f"--data.batch_size {batch_size}, per process"
        elif batch < batch_size:
            source = f"all {images} images: --data.batch_size {batch_size} exceeds them"
        else:
            source = f"--data.batch_size {batch_size}"
        fixes = [f"--data.batch_size {2 * splits} or more"] if several or images >= 2 * splits else []
        fixes.append(f"--model.bn_splits {batch // 2} or fewer (1: no Shuffle BN)")
        raise ValueError(
            f"MoCo's --model.bn_splits {splits} cuts each batch of {batch} images ({source}) into sub-batches of "
            "fewer than 2 images for the key encoder, whose batch-norm statistics are then meaningless (Shuffle BN "
            f"needs 2 or more per sub-batch): pass {', or '.join(fixes)}"
        )

    @torch.no_grad()
    def _momentum_update(self) -> None:
        m = self.hparams.key_momentum
        momentum_update(self.backbone, self.momentum_backbone, m)
        momentum_update(self.projector, self.momentum_projector, m)

    @torch.no_grad()
    def keys(self, x: Tensor) -> Tensor:
        """Normalised keys of the momentum encoder, computed on ``bn_splits`` shuffled sub-batches whose sizes differ
        by at most 1."""
        perm = torch.randperm(x.shape[0], device=x.device)
        chunks = self._views(x[perm]).tensor_split(self.hparams.bn_splits)
        k = torch.cat([self.momentum_projector(self.momentum_backbone(c)) for c in chunks])
        return torch.nn.functional.normalize(k.float(), dim=1)[torch.argsort(perm)]

    def contrastive_loss(self, view1: Tensor, view2: Tensor) -> Tensor:
        step = self.trainer.global_step if self._trainer is not None else None
        if step is None or step != self._updated_at:  # once per optimiser step (accumulate_grad_batches: not per batch)
            self._momentum_update()
            self._updated_at = step
        q = self(view1)
        k = self.keys(view2)
        loss = moco_infonce(q, k, self.queue.queue.clone(), self.hparams.temperature)
        if self._trainer is not None and self.trainer.world_size > 1:  # every process enqueues the global batch
            k = self.all_gather(k).reshape(-1, k.shape[1])
        self.queue.enqueue(k)
        return loss

    def pretrained_checkpoint(self) -> dict[str, Any]:
        state = (
            self._prefixed(self.backbone.body, "module.encoder_q.")
            | self._prefixed(self.projector, "module.encoder_q.fc.")
            | self._prefixed(self.momentum_backbone.body, "module.encoder_k.")
            | self._prefixed(self.momentum_projector, "module.encoder_k.fc.")
            | {
                "module.queue": self.queue.queue.detach().cpu().clone(),
                "module.queue_ptr": self.queue.queue_ptr.detach().cpu().clone(),
            }
        )
        optimizer = self.optimizers(use_pl_optimizer=False) if self._trainer is not None else None
        return {
            "epoch": self.current_epoch + 1,
            "arch": self.backbone.name,
            "state_dict": state,
            "optimizer": optimizer.state_dict() if optimizer is not None else {},
        }


class ExportPretrained(Callback):
    """Atomically write :meth:`ContrastivePretrainer.pretrained_checkpoint`, with the data's input normalisation
    (``normalization``: ``{"mean": […], "std": […]}``), to ``path`` after every epoch
    (default ``<run dir>/pretrained.pth.tar``), and keep a copy, ``pretrained-epoch<E>.pth.tar`` beside it, after each
    epoch ``E`` of ``snapshot_epochs`` (counted from 1): encoders of graded strength from one run. An epoch a stop
    cut short (``max_time``, ``max_steps``) gets no snapshot; ``pretrained.pth.tar`` then holds the encoder as it
    stopped, its ``epoch`` the complete epochs and ``steps`` the optimiser steps."""

    def __init__(self, path: str | Path | None = None, snapshot_epochs: Sequence[int] = ()) -> None:
        self.path = Path(path) if path is not None else None
        self.snapshot_epochs = frozenset(snapshot_epochs)

    def target(self, trainer: L.Trainer) -> Path:
        return self.path if self.path is not None else Path(trainer.default_root_dir) / PRETRAINED_FILENAME

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps, length = trainer.fit_loop.epoch_loop.batch_progress.current.completed, trainer.num_training_batches
        epoch, complete = trainer.current_epoch + 1, not (math.isfinite(length) and steps < length)
        if not complete:  # a stop inside the epoch (max_time, max_steps): the weights are not epoch E's
            rank_zero_warn(
                f"pre-training stopped inside epoch {epoch} ({steps} of {int(length)} steps): "
                f"{self.target(trainer).name} holds the encoder as it stopped (its 'epoch' counts the {epoch - 1} "
                f"complete epoch(s), 'steps' the {trainer.global_step} optimiser steps) and no snapshot of epoch "
                f"{epoch} is written"
            )
        if trainer.is_global_zero and isinstance(pl_module, ContrastivePretrainer):
            checkpoint, target = pl_module.pretrained_checkpoint(), self.target(trainer)
            if not complete:  # (a complete epoch's file stays as it was: re-made checkpoints compare by SHA-256)
                checkpoint["epoch"], checkpoint["steps"] = epoch - 1, trainer.global_step
            data = trainer.datamodule
            if hasattr(data, "mean") and hasattr(data, "std"):  # for fine-tuning to check it feeds the same scale
                checkpoint["normalization"] = {
                    "mean": [float(v) for v in data.mean],
                    "std": [float(v) for v in data.std],
                }
            atomic_torch_save(checkpoint, target)
            if complete and epoch in self.snapshot_epochs:
                atomic_torch_save(checkpoint, snapshot_path(target, epoch))


def snapshot_path(pretrained: Path, epoch: int) -> Path:
    """Where :class:`ExportPretrained` keeps the encoder after ``epoch``: ``pretrained-epoch<epoch>.pth.tar`` beside
    ``pretrained``."""
    stem, dot, suffixes = pretrained.name.partition(".")
    return pretrained.with_name(f"{stem}-epoch{epoch}{dot}{suffixes}")


def check_snapshot_epochs(snapshot_epochs: Sequence[int], max_epochs: int | None) -> None:
    """Refuse snapshot epochs the run will never end: below 1 or beyond ``max_epochs`` (one ``ValueError``)."""
    bounded = max_epochs is not None and max_epochs >= 0  # -1 or None: no epoch limit
    bad = [e for e in snapshot_epochs if e < 1 or (bounded and e > max_epochs)]
    if bad:
        limit = f"1 to --trainer.max_epochs ({max_epochs})" if bounded else ">= 1"
        raise ValueError(
            f"--snapshot_epochs {list(snapshot_epochs)}: {bad} never end in this run; give epoch counts from {limit}"
        )


def pretrain_callbacks(run_dir: str | Path | None = None, snapshot_epochs: Sequence[int] = ()) -> list[Callback]:
    """``checkpoints/last.ckpt`` (every epoch, to resume), the exported encoder (and its ``snapshot_epochs`` copies,
    :class:`ExportPretrained`), ``metrics.csv``/``results.json``/
    learning curve, the run's settings for its loggers, and a resumable stop on SIGTERM/SIGINT; ``run_dir`` None
    means the trainer's ``default_root_dir`` (``checkpoints/`` there while the trainer has no logger, else in the
    first logger's folder). (Lightning adds its rich progress bar unless ``enable_progress_bar=False``.)"""
    root = Path(run_dir) if run_dir is not None else None
    return [
        ModelCheckpoint(
            dirpath=RunDir(root).checkpoints if root else None, filename="last", enable_version_counter=False
        ),
        ExportPretrained(root / PRETRAINED_FILENAME if root else None, snapshot_epochs),
        RunArtifacts(run_dir),
        LogRunSettings(),
        StopOnSignal(),
    ]


def pretrain_trainer_defaults(run_dir: str | Path | None = None) -> dict[str, Any]:
    """``lightning.Trainer`` settings of pre-training: native-bf16 precision where available
    (:func:`~coretune.engine.default_precision`), no logger (one given gets the run's settings from
    :class:`~coretune.engine.loggers.LogRunSettings` instead of Lightning's own hyper-parameters) and
    :func:`pretrain_callbacks`. The atomic checkpoint IO is added when the trainer is made
    (:func:`~coretune.engine.with_atomic_io`; an instance cannot be a serialisable CLI default)."""
    return {
        "precision": default_precision(),
        "logger": False,
        "enable_autolog_hparams": False,
        "callbacks": pretrain_callbacks(run_dir),
    }


def make_pretrain_trainer(run_dir: str | Path, **kwargs: Any) -> L.Trainer:
    """A ``Trainer`` for pre-training into ``run_dir``, set up as ``coretune pretrain`` does
    (:func:`pretrain_trainer_defaults` and atomic checkpoints; ``kwargs`` override them, extra ``callbacks`` and
    ``plugins`` are appended)."""
    settings = pretrain_trainer_defaults(run_dir)
    settings["callbacks"] += list(kwargs.pop("callbacks", None) or [])
    settings["plugins"] = with_atomic_io(kwargs.pop("plugins", None))
    return L.Trainer(default_root_dir=str(run_dir), **(settings | kwargs))
