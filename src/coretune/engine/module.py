"""The LightningModule that fine-tunes a backbone with any registered objective (paper Algorithm 1's loop)."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from ..data import check_shareable, trained_items
from ..data.transforms import other_normalisation
from ..distributed import listed, rank, ranks_where, scale_grad, world_size
from ..models import CheckpointError, load_checkpoint_file, weights_digest
from ..objectives import CETuning, Objective, preset_name
from ..objectives import get as get_objective
from ..robust.batches import AdversarialBatches
from ..robust.training import AdversarialTraining
from ..tasks import TASKS, Batch
from .optim import (
    OptimizerName,
    Schedule,
    build_optimizer,
    build_schedule,
    diverged_fix,
    optimizer_problems,
    resume_schedule,
)
from .preflight import check_images_vary

__all__ = ["BatchTransform", "FineTuner", "NonFiniteLossError", "run_seed", "step_seed"]

BatchTransform = Callable[["FineTuner", Batch], Batch]
"""A training-batch transform (:attr:`FineTuner.batch_transform`): the model and the unpacked batch in, the batch
to train on out (e.g. adversarial training's, with its attacked images in place of or beside the clean ones)."""


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of training step ``step`` of a run seeded with ``seed``."""
    return (seed * 1_000_003 + step + 1) % 2**63


def epoch_seed(seed: int, epoch: int) -> int:
    """The RNG seed of the start of epoch ``epoch`` (objective hooks, e.g. RIFLE's re-initialisation), away from
    the step seeds."""
    return (seed * 1_000_003 + 2**40 + epoch) % 2**63


def run_seed() -> int:
    """The run's seed (Lightning's ``seed_everything`` exports it as ``PL_GLOBAL_SEED``)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def _split_views(x: Tensor | list[Tensor] | tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The query images and the images for the objective's ``inputs``: a batch's second view when it holds two
    (``Objective.input_views == 2``), else the same images."""
    return (x[0], x[1]) if isinstance(x, (list, tuple)) else (x, x)


def example_image(datamodule: Any) -> Tensor | None:
    """One zero image at ``datamodule.image_size`` (``None`` without one): the model summary's example input, so it
    shows FLOPs and layer sizes per image."""
    size = getattr(datamodule, "image_size", None)
    return torch.zeros(1, 3, size, size) if isinstance(size, int) else None


class NonFiniteLossError(FloatingPointError):
    """The training loss, or the validation or test loss, became NaN or infinite, or the model's outputs collapsed
    (the same logits for every image of an evaluation epoch)."""


_LIMITED_SPLITS = {"fit": ("train", "val", "test"), "validate": ("val",), "test": ("test",)}
"""The splits whose ``--trainer.limit_<split>_batches`` each stage checks (``coretune fit`` tests at its end)."""
_SPLIT_NAMES = {"train": "training", "val": "validation", "test": "test"}

LOGIT_LIMIT = 1e6
"""Logits beyond this magnitude mean a diverged model: a trained classifier's stay within ~100 (a logit gap of 100
is already a probability of 1 - 4e-44), so finite logits of 1e15 after a huge step predict by their sign alone."""


class _OutputWatch:
    """Whether an evaluation epoch's logits are all the same row while its images are not all the same image, and
    the largest logit magnitude of the epoch (NaN counted as infinite).

    A classifier whose outputs no longer depend on its input has collapsed (dead or saturated activations after a
    diverging step) and predicts one class for everything, yet ends with a plausible accuracy (the share of that
    class). The rule is exact equality, on 2 or more differing images, so a working model is never flagged: two
    different images giving bit-identical logits does not happen by chance, and an epoch of identical images (a
    blank test set) is never judged. Images are compared within their batch and with the epoch's first image of
    their size, kept (copied) for the first :attr:`SHAPES` sizes only: whole-image segmentation batches images of
    one size, and a data set of hundreds of sizes would otherwise hold an image and its per-pixel logits for each.
    A diverged model whose logits still differ between images shows in their size instead (:data:`LOGIT_LIMIT`).
    Flags are kept as tensors: no device sync per batch.
    """

    SHAPES = 4

    def __init__(self) -> None:
        self.first: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}  # per image shape: its first image, logits
        self.images_differ: Tensor | bool = False
        self.logits_differ: Tensor | bool = False
        self.largest: Tensor | float = 0.0
        self.count = 0
        self.nonfinite: str | None = None  # the epoch's first non-finite loss, described

    def update(self, x: Tensor, logits: Tensor) -> None:
        shape = tuple(x.shape[1:])
        if shape not in self.first and len(self.first) < self.SHAPES:
            self.first[shape] = (x[0].clone(), logits[0].clone())  # copies: a view would keep the whole batch
        image, first = self.first.get(shape, (x[0], logits[0]))  # beyond the kept sizes: within the batch only
        self.images_differ = (x != image).any() | self.images_differ
        self.logits_differ = (logits != first).any() | self.logits_differ
        # NaN counts as infinite: a NaN only on pixels the loss ignores leaves the loss finite (segmentation)
        self.largest = torch.clamp(logits.abs().amax().float().nan_to_num(math.inf, math.inf), min=self.largest)
        self.count += len(x)

    def collapsed(self) -> bool:
        return bool(self.images_differ) and not bool(self.logits_differ)

    @property
    def logits(self) -> Tensor:
        """The epoch's first image's logits (what a collapsed model gives every image of that size)."""
        return next(iter(self.first.values()))[1]


def _train_features(features: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``features(x)`` (the backbone's) in training mode, with a clear error for a batch that BatchNorm cannot
    normalise."""
    try:
        return features(x)
    except ValueError as err:
        if "Expected more than 1 value per channel" not in str(err):
            raise
        raise ValueError(
            f"a training batch of {x.shape[0]} image cannot pass the backbone's BatchNorm layers, which need 2 or "
            "more values per channel in training: use --data.batch_size 2 or more (a last incomplete batch is "
            "dropped once the training set holds more than one batch)"
        ) from None


# Backbone options that would fetch pre-trained weights (torchvision, timm): coretune never downloads, and a
# crafted checkpoint must not make it.
_WEIGHT_FETCHING_OPTIONS = frozenset(
    {"weights", "weights_backbone", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path"}
)


def _checked_checkpoint(
    path: Path, ckpt: Any, cls: type[FineTuner]
) -> tuple[dict[str, Any], type[Objective], dict[str, Any], dict[str, Any]]:
    """``(coretune entry, objective class, objective settings, FineTuner settings)`` of a fine-tuning checkpoint,
    checked against what :meth:`FineTuner.on_save_checkpoint` writes and the classes' signatures before anything
    is built.

    Raises:
        CheckpointError: one line naming the file and the first problem found.
    """
    from jsonargparse import ArgumentError, ArgumentParser

    meta = ckpt.get("coretune") if isinstance(ckpt, dict) else None
    if meta is None:
        raise CheckpointError(
            f"{path} is not a coretune fine-tuning checkpoint (no 'coretune' entry): pass a .ckpt written by "
            "`coretune fit` (a pre-trained backbone checkpoint goes to `coretune fit --model.weights`)"
        )

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path} is damaged or was not written by `coretune fit`: {problem}; use another checkpoint "
            "of the run, or fine-tune again"
        )

    def settings(of: type, values: Any, what: str, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The ``values`` ``of`` takes (others, e.g. an older version's, are dropped), their types checked by
        jsonargparse against its signature."""
        if not isinstance(values, dict):
            raise refuse(f"its {what} are a {type(values).__name__}, not a dict")
        accepted = set(inspect.signature(of).parameters) - skip
        known = {k: v for k, v in values.items() if k in accepted}
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(of, skip=set(skip))
        try:
            parser.parse_object(known)
        except ArgumentError as err:  # several lines
            raise refuse(f"its {what} do not fit {of.__name__}: {' '.join(str(err).split())}") from None
        return known

    if not isinstance(meta, dict):
        raise refuse(f"its 'coretune' entry is a {type(meta).__name__}, not the dict of settings `coretune fit` writes")
    name = meta.get("objective")
    if not isinstance(name, str):
        raise refuse("its 'coretune' entry names no objective" if name is None else f"its objective is {name!r}")
    try:
        objective_cls, _ = get_objective(name)
    except ValueError as err:
        raise refuse(str(err)) from None
    objective_hparams = settings(objective_cls, meta.get("objective_hparams", {}), "objective settings")
    hparams = settings(cls, ckpt.get("hyper_parameters", {}), "model settings", frozenset({"objective", "weights"}))
    backbone_args = hparams.get("backbone_args") or {}
    if fetching := sorted(_WEIGHT_FETCHING_OPTIONS & set(backbone_args)):
        raise refuse(
            f"its backbone_args set {fetching}, which would fetch pre-trained weights (coretune never downloads)"
        )
    num_classes, names = meta.get("num_classes"), meta.get("class_names")
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 2:
        raise refuse(f"its num_classes is {num_classes!r}, not a whole number >= 2")
    if names is not None and (
        not isinstance(names, list) or len(names) != num_classes or not all(isinstance(n, str) for n in names)
    ):
        raise refuse(f"its class_names ({_preview(names)}) are not {num_classes} names, one per class")
    if names is not None and len(set(names)) != len(names):
        raise refuse(f"its class_names ({_preview(names)}) repeat a name")
    if problem := _data_problem(meta.get("data", {})):
        raise refuse(problem)
    weights = ckpt.get("state_dict")
    if not isinstance(weights, dict) or not all(isinstance(v, Tensor) for v in weights.values()):
        raise refuse("its state_dict is missing or holds something other than tensors")
    if broken := [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]:
        raise CheckpointError(
            f"checkpoint {path} holds NaN or infinite weights ({len(broken)} of {len(weights)} tensors, e.g. "
            f"{broken[0]}): the run that wrote it diverged; use an earlier checkpoint, or fine-tune again with a "
            "lower learning rate (--model.lr)"
        )
    return meta, objective_cls, objective_hparams, hparams


def _data_problem(data: Any) -> str | None:
    """What is wrong with a checkpoint's ``data`` entry (image size, mean and std), or ``None``."""
    if not isinstance(data, dict):
        return f"its data settings are a {type(data).__name__}, not a dict"
    size = data.get("image_size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        return f"its image_size is {size!r}, not a whole number >= 1"
    for key in ("mean", "std"):
        value = data.get(key)
        numbers = (
            isinstance(value, list | tuple)
            and len(value) == 3
            and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        )
        if value is not None and (not numbers or (key == "std" and min(value) <= 0)):
            return f"its {key} is {value!r}, not 3 finite numbers" + (" > 0" if key == "std" else "")
    return None


def _written_at(checkpoint: dict[str, Any], path: str | Path | None) -> dict[str, Any]:
    """Where a Lightning checkpoint was written: its ``path``, ``epoch`` (0-based) and ``step``."""
    return {
        "path": None if path is None else str(path),
        "epoch": checkpoint.get("epoch"),
        "step": checkpoint.get("global_step"),
    }


def _preview(value: Any, show: int = 4) -> str:
    """``repr(value)``, a long list cut to its first ``show`` items (for messages)."""
    if isinstance(value, list) and len(value) > show:
        return f"[{', '.join(map(repr, value[:show]))}, … ({len(value)} in all)]"
    return repr(value)


def _foreign_settings(task: str, settings: Mapping[str, Any]) -> list[str]:
    """One problem per setting that only another task reads, set away from its default: ``task`` would
    silently ignore it (``output_stride 8`` for classification)."""
    if task not in TASKS:
        return []
    return [
        f"{key} is a {other.name} setting that task {task!r} ignores (got {settings[key]!r}): drop "
        f"--model.{key}, or fit with --task {other.name}"
        for other in TASKS.values()
        if other.name != task
        for key, default in other.own_settings.items()
        if key in settings and key not in TASKS[task].own_settings and settings[key] != default
    ]


class FineTuner(L.LightningModule):
    """A backbone ``G_e`` and an objective (its heads and loss), trained with the paper's optimiser (Appendix C).

    Exactly one backbone forward per training step: ``z = G_e(x)`` goes to the objective, which returns the loss.

    Args:
        objective: the fine-tuning method (default: CE-tuning); built here once the number of classes is known.
        backbone: backbone name (``resnet18`` … ``resnet152``, ``resnext50_32x4d``, ``wide_resnet50_2``,
            ``small_cnn``, or ``timm/<model>``).
        weights: a local pre-trained checkpoint to load into the backbone (``None``: random initialisation), or a
            name in the local Hugging Face cache: ``timm:<model>[.<tag>]`` or ``hf-hub:<org>/<repo>``.
        weights_download: download a named ``weights`` missing from the Hugging Face cache (needs network; off by
            default, when nothing is ever downloaded).
        weights_format: checkpoint layout (``auto`` detects it).
        weights_allow_cast: load ``weights`` whose floating-point tensors are stored as integers (or quantised),
            converted to floats; refused by default, since such weights are rarely the float values.
        backbone_args: options of the backbone's constructor, e.g. ``{drop_path_rate: 0.1}`` for a timm ViT
            (``--model.backbone_args '{drop_path_rate: 0.1}'``). timm ViTs take any image size by default.
        optimizer: ``sgd`` (Nesterov momentum, the paper's), ``adam`` (domain generalisation) or ``adamw``.
        lr: learning rate of the new heads, and of the backbone unless ``backbone_lr`` is given.
        backbone_lr: separate learning rate of the pre-trained backbone.
        momentum: SGD momentum.
        nesterov: Nesterov momentum for SGD.
        weight_decay: weight decay of every parameter group (objectives whose reference code trains without it,
            L2-SP and DELTA, replace it: ``Objective.optimizer_weight_decay``).
        schedule: per-step learning-rate decay: ``cosine`` (paper default), ``linear`` (ImageNet20), ``poly``
            (DeepLab's ``(1 - step / total) ** 0.9``, segmentation) or ``constant``.
        warmup_epochs: linear warm-up length in epochs (may be fractional).
        channels_last: use the channels-last memory format for the backbone and the images (fast for CNNs).
        freeze_backbone: train the heads only (linear probing).
        task: what the data, the network on the backbone and the predictions are: ``classification`` (default)
            or another task of :data:`coretune.tasks.TASKS` (``coretune fit --task NAME``).
        output_stride: segmentation: input size ÷ the dilated backbone's feature-map size (16 or 8). This and
            ``image_labels`` are the segmentation task's own settings (``coretune fit --task.output_stride``,
            ``--task.image_labels``): other tasks refuse them set away from their defaults, which they would
            silently ignore.
        image_labels: segmentation with Core-tuning: the rule giving each crop the image-level label its
            contrastive positives come from, ``majority`` (its most frequent class) or ``multilabel`` (crops
            sharing any class are positives); see :class:`coretune.tasks.SegmentationTask`.
        adversarial: adversarial training (``coretune fit --adversarial.*``, classification): with
            ``enable``, every training batch is extended with its PGD examples against the current model
            (:class:`~coretune.robust.batches.AdversarialBatches`); recorded in checkpoints as
            ``coretune.robust.training``.

    Attributes:
        batch_transform: ``None``, or a :data:`BatchTransform` applied to every unpacked training batch before the
            backbone sees it (after the step's RNG seeding, so its draws are reproducible too).
    """

    def __init__(
        self,
        objective: Objective | None = None,
        backbone: str = "resnet50",
        weights: str | None = None,
        weights_download: bool = False,
        weights_format: str = "auto",
        weights_allow_cast: bool = False,
        backbone_args: dict[str, Any] | None = None,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.01,
        backbone_lr: float | None = None,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 1e-4,
        schedule: Schedule = "cosine",
        warmup_epochs: float = 0.0,
        channels_last: bool = True,
        freeze_backbone: bool = False,
        task: str = "classification",
        output_stride: Literal[16, 8] = 16,
        image_labels: Literal["majority", "multilabel"] = "majority",
        adversarial: AdversarialTraining | None = None,
    ) -> None:
        super().__init__()
        problems = optimizer_problems(lr, weight_decay, momentum, warmup_epochs)
        if backbone_lr is not None and backbone_lr < 0:
            problems.append(f"backbone_lr must be >= 0 (got {backbone_lr})")
        if task not in TASKS:
            problems.append(f"task must be one of {', '.join(TASKS)} (got {task!r})")
        adversarial_on = adversarial is not None and adversarial.enable
        if adversarial_on and task in TASKS and not TASKS[task].supports_adversarial_training:
            problems.append(f"adversarial training works with the classification task only (got task {task!r})")
        problems += _foreign_settings(task, {"output_stride": output_stride, "image_labels": image_labels})
        if problems:
            raise ValueError("invalid model settings: " + "; ".join(problems))
        self.save_hyperparameters(ignore=["objective", "adversarial"])
        self.task = TASKS[task](self.hparams)
        self.objective = objective if objective is not None else CETuning()
        if self.objective.registered_name == type(self.objective).name:  # built from its class (the CLI): a preset?
            self.objective.registered_name = preset_name(self.objective)  # --objective ce_con logged as ce_con
        self.task.check_objective(self.objective)
        self.backbone = self.task.build_backbone(
            backbone,
            weights=weights,
            weights_format=weights_format,
            allow_cast=weights_allow_cast,
            weights_download=weights_download,
            **(backbone_args or {}),
        )
        # which file the backbone started from: a resume may then name the same file at another path
        self.weights_sha256 = weights_digest(weights)
        self.adversarial = adversarial
        self.batch_transform: BatchTransform | None = None
        if adversarial is not None and adversarial.enable:
            self.batch_transform = AdversarialBatches(adversarial)
        self.class_names: list[str] | None = None
        self._watch: _OutputWatch | None = None  # the current evaluation epoch's outputs (collapse check)
        self.checkpoint_info: dict[str, Any] = {}  # the checkpoint's 'coretune' entry (from_checkpoint)
        self.loaded_checkpoint: dict[str, Any] = {}  # the path, epoch and step of the checkpoint last loaded
        if channels_last:
            self.backbone.to(memory_format=torch.channels_last)
        if freeze_backbone:
            self.backbone.requires_grad_(False)

    # -- set-up ---------------------------------------------------------------------------------------------
    def build(self, num_classes: int, class_names: list[str] | None = None) -> None:
        """Create the task's heads (the objective's) for ``num_classes`` classes and the metrics."""
        if num_classes < 2:
            raise ValueError(f"{self.task.name} needs at least 2 classes, the data has {num_classes}")
        if not self.objective.is_built:
            self.task.build_heads(self.objective, self.backbone.feature_dim, num_classes)
        elif self.objective.num_classes != num_classes:
            raise ValueError(
                f"the model was built for {self.objective.num_classes} classes but the data has {num_classes}: "
                "use data with the same classes, or fine-tune a new model"
            )
        self.class_names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
        self.train_metrics = self.task.train_metrics(num_classes)
        self.val_metrics = self.task.val_metrics(num_classes)
        self.test_metrics = self.task.test_metrics(num_classes)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if not hasattr(self, "train_metrics"):
            if datamodule is None or getattr(datamodule, "num_classes", None) is None:
                raise RuntimeError("FineTuner needs a datamodule with num_classes (or call .build(num_classes))")
            self.build(datamodule.num_classes, getattr(datamodule, "class_names", None))
        elif datamodule is not None and getattr(datamodule, "num_classes", None) not in (
            None,
            self.num_classes,
        ):
            self.build(datamodule.num_classes, getattr(datamodule, "class_names", None))
        if (example := example_image(datamodule)) is not None:
            self.example_input_array = example
        if datamodule is not None:
            self.task.check_data(datamodule, stage)
        if stage == "fit":
            for split, name in (("validation", "val_dataset"), ("test", "test_dataset")):  # at the start, not at
                if (dataset := getattr(datamodule, name, None)) is not None:  # the final test (shared under DDP)
                    check_shareable(dataset, split)
        if datamodule is not None:
            self._check_batch_limits(datamodule, _LIMITED_SPLITS.get(stage, ()))
        if stage == "fit":
            if isinstance(self.batch_transform, AdversarialBatches) and not (
                hasattr(datamodule, "mean") and hasattr(datamodule, "std")
            ):
                raise ValueError(
                    "adversarial training attacks images in pixel space and needs the data module's normalisation "
                    "(mean and std attributes): use coretune's ImageClassificationData"
                )
            self.objective.attach_backbone(self.backbone)
            check_images_vary(datamodule)
            self._warn_memory_spans_epoch(datamodule)
            self._warn_other_normalization(datamodule)
            self._warn_test_in_training(datamodule)
            views = self.objective.input_views
            if datamodule is not None and hasattr(datamodule, "train_views"):
                datamodule.train_views = views  # also back to 1 when a data module is reused for another method
            elif views > 1:
                raise ValueError(
                    f"objective {self.objective.name!r} needs {views} augmented views of each training image "
                    "(forward's inputs are a second view): use coretune's ImageClassificationData, or a data "
                    "module with a train_views attribute whose batches are ((view_1, view_2), labels)"
                )

    def _check_batch_limits(self, datamodule: Any, splits: tuple[str, ...]) -> None:
        """Refuse, at the start, a limit of a task's validation or test batches that would leave groups out
        (:attr:`~coretune.tasks.Task.scores_every_group`: domain generalization), and a fraction
        ``--trainer.limit_<split>_batches`` in (0, 1) that keeps no batch of a split on the process with the fewest
        (Lightning refuses it with a traceback when that split's loop starts: the test split's after the whole
        training, and under DDP on that process alone while the others wait).

        Raises:
            ValueError: naming the option, the split's batches and the smallest fraction that keeps one.
        """
        for split in splits:
            limit = getattr(self.trainer, f"limit_{split}_batches", 1.0)
            # all batches, or none (the split off); an int is a number of batches: 1 is one batch
            whole = (isinstance(limit, float) and limit == 1.0) or limit == 0
            if self.task.scores_every_group and split in ("val", "test") and not whole:
                raise ValueError(
                    f"--trainer.limit_{split}_batches={limit}: {self.task.name} scores each domain on all its images, "
                    f"and the {_SPLIT_NAMES[split]} loader reads one domain after another, so part of it would leave "
                    "whole domains out of the score: pass 1.0 (all batches)"
                )
            loader = getattr(datamodule, f"{split}_dataloader", None)
            if not isinstance(limit, float) or not 0 < limit < 1 or loader is None:
                continue
            if getattr(datamodule, f"{split}_dataset", None) is None:
                continue
            built = loader()
            if not isinstance(built, DataLoader) or not hasattr(built.dataset, "__len__"):
                continue  # several loaders (checked by Lightning one by one), or an iterable dataset
            batches = len(built)
            mine = torch.tensor(float(batches), device=self.trainer.strategy.root_device)
            fewest = int(self.trainer.strategy.reduce(mine, reduce_op="min"))
            if fewest > 0 and int(fewest * limit) == 0:
                least = math.ceil(100 / fewest) / 100
                where = " on the process with the fewest" if world_size() > 1 else ""
                fix = f"at least {least}, " if least < 1 else ""
                raise ValueError(
                    f"--trainer.limit_{split}_batches={limit} keeps no batch of the {_SPLIT_NAMES[split]} split "
                    f"({limit} × {fewest} batch(es){where} < 1): pass {fix}a whole number of batches "
                    f"(--trainer.limit_{split}_batches=1), or 1.0 for all of them"
                )

    def _warn_other_normalization(self, datamodule: Any) -> None:
        """Warn when the data is normalised otherwise than the pre-trained weights were trained with (their
        checkpoint or timm name says how: :func:`coretune.models.normalization_of`; :func:`other_normalisation`)."""
        trained = getattr(self.backbone, "pretrained_normalization", None)
        used = getattr(datamodule, "mean", None), getattr(datamodule, "std", None)
        if (why := other_normalisation(trained, *used, self.hparams.weights)) is not None:
            rank_zero_warn(why)

    def _warn_test_in_training(self, datamodule: Any) -> None:
        """Warn when test images are training images too (``test_files_in_training``: a test folder inside the
        training folder, a class folder symlinked into it): the test score is then partly a training accuracy; and
        when a validation folder's are (``val_files_in_training``): ``best.ckpt`` is then chosen on them."""
        for split, name, consequence in (
            ("test", "test", "the test score is partly a training accuracy"),
            ("val", "validation", "best.ckpt is chosen partly on training accuracy"),
        ):
            shared = getattr(datamodule, f"{split}_files_in_training", list)()
            if shared:
                scored = len(getattr(datamodule, f"{split}_dataset", None) or shared)
                rank_zero_warn(
                    f"{len(shared)} of the {scored} {name} images are training images too (the same files, e.g. "
                    f"{shared[0]}): {consequence}; keep the {name} images out of the training folder (a symlink "
                    "into it counts)"
                )

    def _warn_memory_spans_epoch(self, datamodule: Any) -> None:
        """Warn when a cross-batch memory holds an epoch of rows (issue 40): the images come back in a fresh order
        each epoch, so half the anchors or more then meet their own earlier feature among the memory's positives,
        an easy positive that only looks like more data (every anchor from two epochs' rows)."""
        size = getattr(self.objective, "memory_size", 0)
        train, batch = getattr(datamodule, "train_dataset", None), getattr(datamodule, "batch_size", None)
        if not size or train is None or not batch:
            return
        rows = trained_items(len(train), batch, world_size())
        rows *= 2 if isinstance(self.batch_transform, AdversarialBatches) else 1
        if size >= rows:
            rank_zero_warn(
                f"memory_size {size} holds an epoch's {rows} training rows or more: half the anchors or more meet "
                f"their own earlier feature in the memory (an easy positive; all of them from {2 * rows} rows). "
                f"Half an epoch, --objective.memory_size {rows // 2}, keeps it to about one anchor in eight"
            )

    @property
    def num_classes(self) -> int | None:
        return self.objective.num_classes

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        checkpoint["coretune"] = {
            "task": self.task.name,
            "data": {k: getattr(datamodule, k) for k in ("image_size", "mean", "std") if hasattr(datamodule, k)},
            "objective": self.objective.registered_name,
            "objective_class": f"{type(self.objective).__module__}.{type(self.objective).__qualname__}",
            "objective_hparams": self.objective.hparams(),
            "num_classes": self.num_classes,
            "class_names": self.class_names,
            "feature_dim": self.backbone.feature_dim,
            "adversarial": None if self.adversarial is None else self.adversarial.hparams(),
            "weights_sha256": self.weights_sha256,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse the checkpoint of another model before its tensors are copied in (torch would only say that
        tensor sizes differ): a resumed run whose data gained or lost a class, another backbone or objective."""
        meta = checkpoint.get("coretune") or {}
        path = self._trainer.ckpt_path if self._trainer is not None else None
        self.loaded_checkpoint = _written_at(checkpoint, path)
        self.weights_sha256 = meta.get("weights_sha256") or self.weights_sha256  # the file the run started from
        objective = f"{type(self.objective).__module__}.{type(self.objective).__qualname__}"
        differ = [
            f"{name} {old} → {new}"
            for name, old, new in (
                ("backbone", checkpoint.get("hyper_parameters", {}).get("backbone"), self.hparams.backbone),
                ("objective", meta.get("objective_class"), objective),
            )
            if old is not None and old != new
        ]
        old_classes = meta.get("class_names")
        if old_classes is not None and list(old_classes) != self.class_names:
            added = [c for c in self.class_names if c not in old_classes]
            removed = [c for c in old_classes if c not in self.class_names]
            what = "; ".join([f"added {added}"] * bool(added) + [f"removed {removed}"] * bool(removed)) or "reordered"
            differ.append(f"classes: {len(old_classes)} → {len(self.class_names)} ({what})")
        if differ:
            where = self._trainer.ckpt_path if self._trainer is not None else "the checkpoint"
            raise ValueError(
                f"checkpoint {where} holds another model than this run builds: {'; '.join(differ)}. Resume it with "
                "the data and settings it was trained with, or start a new run with another --run_dir"
            )

    @property
    def trained_data(self) -> dict[str, Any]:
        """The image size and normalisation (``image_size``, ``mean``, ``std``) the model was fine-tuned with, and
        the settings that drew its splits (``seed``; classification and segmentation: ``label_fraction``,
        ``val_fraction``, and segmentation's ``eval_mode``; domain generalization: ``test_domains``,
        ``holdout_fraction``, ``selection``), as its checkpoint records them (empty for a model not loaded by
        :meth:`from_checkpoint`, or one saved without a data module): what ``coretune test``, ``validate``, ``eval
        robust`` and ``predict`` evaluate it with unless told otherwise (a run's seed is not in its ``config.yaml``:
        ``--seed`` sets it)."""
        data = self.checkpoint_info.get("data") or {}
        return {k: list(v) if isinstance(v, tuple | list) else v for k, v in data.items()}

    @classmethod
    def from_checkpoint(cls, path: str | Path, map_location: str = "cpu") -> FineTuner:
        """Rebuild a fine-tuned model from a coretune checkpoint (safe: ``weights_only=True``).

        The checkpoint's ``coretune`` entry and settings are checked before anything is built
        (:func:`_checked_checkpoint`); the model keeps the entry as ``checkpoint_info`` (``data`` holds the image
        size and normalisation it was trained with).

        Raises:
            CheckpointError: the file is unreadable or unsafe, or its metadata, settings or weights are unusable
                (one line naming the file and the problem).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} not found: pass a .ckpt written by `coretune fit`")
        ckpt = load_checkpoint_file(path)  # CheckpointError for truncated files and pickles that would run code
        meta, objective_cls, objective_hparams, hparams = _checked_checkpoint(path, ckpt, cls)
        try:
            objective = objective_cls(**objective_hparams)
            model = cls(objective=objective, **hparams, weights=None)  # the weights come from the checkpoint itself
        except ValueError as err:  # a setting out of range: the class's own message
            raise CheckpointError(f"checkpoint {path} holds settings coretune refuses: {err}") from err
        objective.registered_name = meta["objective"]
        model.build(meta["num_classes"], meta["class_names"])
        try:
            model.load_state_dict(ckpt["state_dict"])
        except RuntimeError as err:  # torch lists every missing, unexpected and mis-shaped tensor, one per line
            raise CheckpointError(
                f"checkpoint {path}: its weights do not fit the model its settings describe "
                f"({' '.join(str(err).split())[:300]}): the file is damaged; use the run's other checkpoint"
            ) from err
        model.checkpoint_info = {**meta, "data": {**meta.get("data", {}), **model._split_settings(ckpt)}}
        model.loaded_checkpoint = _written_at(ckpt, path)
        return model.to(map_location)

    def _split_settings(self, ckpt: Mapping[str, Any]) -> dict[str, Any]:
        """The data options that drew the run's splits (its task's data class's ``split_settings``: the seed; for
        classification also the label and validation fractions, for domain generalization the unseen domains,
        held-out fraction and selection rule), as Lightning saved the
        data module's arguments with the checkpoint (``datamodule_hyper_parameters``); empty without them."""
        saved = ckpt.get("datamodule_hyper_parameters")
        names = getattr(self.task.data_class, "split_settings", ())
        return {k: saved[k] for k in names if k in saved} if isinstance(saved, Mapping) else {}

    # -- steps ----------------------------------------------------------------------------------------------
    def _images(self, x: Tensor) -> Tensor:
        if self.hparams.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def forward(self, x: Tensor) -> Tensor:
        """The task's logits of a batch of images (class logits ``(B, K)`` for classification)."""
        x = self._images(x)
        return self.task.predict(self.objective, self.task.features(self.backbone, x), x)

    def transform_batch(self, batch: Batch) -> Batch:
        """The training batch the backbone sees: :attr:`batch_transform`'s result, or ``batch`` itself."""
        return batch if self.batch_transform is None else self.batch_transform(self, batch)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | dict[str, Tensor]:
        """The objective's loss on the batch; for classification also the classifier's logits on the training rows
        and their labels (detached), from which :class:`~coretune.engine.ChanceLevelGuard` tells a collapse."""
        # Every draw depends on (seed, step) only, so a run resumed from a checkpoint repeats the uninterrupted run
        # exactly (the data module does the same per image). The backbone's own draws (dropout, stochastic depth)
        # also depend on the process, like its images; the objective's (mixup weights, random negatives) do not,
        # so every DDP process draws the same values for the global batch it mines.
        # Under gradient accumulation the optimiser step counts windows: each micro-batch of a window gets its own
        # draws (one accumulated batch: the same seeds as before)
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        seed = step_seed(run_seed(), self.global_step * accumulate + batch_idx % accumulate)
        torch.manual_seed(step_seed(seed, rank()) if rank() else seed)
        unpacked = self.transform_batch(self.task.unpack(batch))
        query, key = _split_views(unpacked.inputs)
        x = self._images(query)
        inputs = x if key is query else self._images(key)
        z = _train_features(lambda images: self.task.features(self.backbone, images), x)
        if self.task.gathers(self.objective):
            # Every process computes the loss of the global batch, but its backbone only sees its own rows'
            # gradient; DDP's average over W processes would leave 1/W of the single-process gradient.
            z = scale_grad(z, world_size())
        torch.manual_seed(seed)
        out = self.task.loss(self.objective, z, unpacked, inputs)
        # decided over every process (DDP: each computes its own loss), so they all stop and rank 0 records it
        if failed := ranks_where(not bool(torch.isfinite(out.loss)), out.loss.device):
            raise NonFiniteLossError(self._training_blowup(out, z, batch_idx, failed))
        y, bs = unpacked.targets, len(unpacked)
        self.log_dict(
            {f"train/{k}": v for k, v in out.terms.items()},
            on_step=False,
            on_epoch=True,
            batch_size=bs,
            sync_dist=True,  # the mean over processes, reduced once per epoch
        )
        self.train_metrics.update(out.logits.detach(), y)
        # Metric objects are reduced by Lightning before any epoch-end hook, so callbacks see them.
        self.log_dict(
            {f"train/{k}": m for k, m in self.train_metrics.items()},
            on_step=False,
            on_epoch=True,
            batch_size=bs,
        )
        if y.dim() == 1 and out.logits.dim() == 2 and len(out.logits) == len(y):
            return {"loss": out.loss, "logits": out.logits.detach(), "targets": y}
        return out.loss

    def _training_blowup(self, out: Any, z: Tensor, batch_idx: int, failed: list[int]) -> str:
        """The message of a non-finite training loss on the processes ``failed``, from this process's view. Every
        process calls it (one more collective under DDP with a gathering objective)."""
        when = f"at epoch {self.current_epoch}, step {self.global_step}"
        origin = ""
        # a gathering objective's loss is the gathered batch's: one process's non-finite features make them all NaN
        gathered = world_size() > 1 and self.task.gathers(self.objective)
        if gathered and (sources := ranks_where(not bool(torch.isfinite(z).all()), z.device)):
            origin = f"; the non-finite features come from process {listed(sources)}"
        if rank() in failed:
            terms = ", ".join(f"{k}={float(v):.4g}" for k, v in out.terms.items())
            where = f" on process {rank()}" if world_size() > 1 else ""
            what = f"the training loss is {float(out.loss.detach())}{where} {when} (batch {batch_idx}; {terms}{origin})"
        else:
            what = f"the training loss is not finite on process {listed(failed)} {when} (batch {batch_idx}{origin})"
        return f"{what}. Check the images for NaN/Inf, {self._diverged_fix()}"

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        unpacked = self.task.unpack(batch)
        x, y = unpacked.inputs, unpacked.targets
        logits = self(x)
        loss = self.task.eval_loss(logits, y)
        self._watch_outputs("validation", x, logits, batch_idx, loss)
        self.log("val/loss", loss, on_step=False, on_epoch=True, batch_size=y.shape[0], sync_dist=True)
        self.task.update_eval_metrics(self.val_metrics, logits, unpacked)

    def on_validation_epoch_end(self) -> None:
        self._check_outputs("validation")
        # compute() already reduced over processes; sync_dist averages equal values (and tells Lightning so).
        values = self.task.val_values(self.val_metrics.compute())
        self.log_dict({f"val/{k}": v for k, v in values.items()}, prog_bar=True, sync_dist=True)
        self.val_metrics.reset()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        unpacked = self.task.unpack(batch)
        x, y = unpacked.inputs, unpacked.targets
        logits = self(x)
        self._watch_outputs("test", x, logits, batch_idx, self.task.eval_loss(logits, y))
        self.task.update_eval_metrics(self.test_metrics, logits, unpacked)

    def on_test_start(self) -> None:
        # the weights under test: a checkpoint loaded for it (trainer.test(ckpt_path=…), from_checkpoint), or the
        # model's own
        tested = self._trainer is not None and self._trainer.ckpt_path is not None
        self.task.tested_checkpoint = dict(self.loaded_checkpoint) if tested or self.checkpoint_info else {}

    def on_test_epoch_end(self) -> None:
        self._check_outputs("test")
        self.test_results = self.task.test_results(self.test_metrics.compute(), self.class_names or [])
        scalars = {f"test/{k}": v for k, v in self.test_results.items() if isinstance(v, float)}
        self.log_dict(scalars, sync_dist=True)
        self.test_metrics.reset()

    def _watch_outputs(self, stage: str, x: Tensor, logits: Tensor, batch_idx: int, loss: Tensor) -> None:
        """Remember the batch for the epoch's checks (:class:`_OutputWatch`, :meth:`_check_outputs`), and the first
        non-finite ``stage`` loss: it raises at the epoch's end, where every process decides together (under DDP
        the processes may hold different numbers of evaluation batches, so no per-batch collective)."""
        if batch_idx == 0 or self._watch is None:
            self._watch = _OutputWatch()
        if self._watch.nonfinite is None and not torch.isfinite(loss):
            self._watch.nonfinite = (
                f"the {stage} loss is {float(loss)}{f' on process {rank()}' if world_size() > 1 else ''} at epoch "
                f"{self.current_epoch}, step {self.global_step} (batch {batch_idx}; "
                f"{int((~torch.isfinite(logits)).any(dim=1).sum())} of {len(logits)} images have non-finite logits)"
            )
        self._watch.update(x, logits.detach())

    def _diverged_fix(self) -> str:
        """What to try after a blow-up, for this run's precision (none known outside a Trainer)."""
        return diverged_fix(getattr(self._trainer, "precision", None))

    def _check_outputs(self, stage: str) -> None:
        """Raise :class:`NonFiniteLossError` when the ``stage`` epoch had a non-finite loss (on any process), its
        outputs collapsed (on every process) or its logits exploded (on any process)."""
        watch, self._watch = self._watch, None
        nonfinite = watch.nonfinite if watch is not None else None
        if failed := ranks_where(nonfinite is not None, self.device):
            what = nonfinite or (
                f"the {stage} loss is not finite on process {listed(failed)} at epoch {self.current_epoch}, step "
                f"{self.global_step} (that process's error names the batch)"
            )
            raise NonFiniteLossError(f"{what}. Check the pre-trained weights, {self._diverged_fix()}")
        # over every process's images: some differ and no logits differ (a process may have judged nothing: its
        # images all of different sizes, or none); every process decides alike and raises together
        strategy = self.trainer.strategy
        images_differ = strategy.reduce_boolean_decision(watch is not None and bool(watch.images_differ), all=False)
        logits_differ = strategy.reduce_boolean_decision(watch is not None and bool(watch.logits_differ), all=False)
        if images_differ and not logits_differ:
            seen = ""
            if watch is not None and watch.first:
                scores = watch.logits.float().reshape(len(watch.logits), -1).mean(1)  # (K,) also per-pixel logits
                row = ", ".join(f"{v:.4g}" for v in scores.tolist()[:5])
                name = self.class_names[int(scores.argmax())] if self.class_names else "?"
                more = ", …" if len(watch.logits) > 5 else ""
                seen = f" ({row}{more}), so it predicts class {name!r} for every image"
            count = f"all {watch.count} " if watch is not None and world_size() == 1 else "all "
            raise NonFiniteLossError(
                f"the model collapsed at epoch {self.current_epoch}, step {self.global_step}: {count}{stage} images "
                f"get the same logits{seen}. Check the pre-trained weights, {self._diverged_fix()}"
            )
        mine = torch.as_tensor(0.0 if watch is None else watch.largest, dtype=torch.float32, device=self.device)
        largest = float(self.trainer.strategy.reduce(mine, reduce_op="max"))  # over every process's epoch
        if largest > LOGIT_LIMIT:
            reach = "are not finite" if math.isinf(largest) else f"reach {largest:.3g} in magnitude"
            raise NonFiniteLossError(
                f"the model diverged at epoch {self.current_epoch}, step {self.global_step}: its {stage} logits "
                f"{reach} (a trained model's stay within ~100), so its predictions no longer mean anything. Check "
                f"the pre-trained weights, {self._diverged_fix()}"
            )

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, list | tuple) else batch
        return torch.softmax(self(x).float(), dim=1)

    # -- optimisation ---------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        backbone_lr = hp.lr if hp.backbone_lr is None else hp.backbone_lr
        backbone_params = [p for p in self.backbone.parameters() if p.requires_grad]
        head_params = [p for p in self.objective.parameters() if p.requires_grad]
        optimizer = build_optimizer(
            [(backbone_params, backbone_lr), (head_params, hp.lr)],
            hp.optimizer,
            hp.momentum,
            hp.nesterov,
            hp.weight_decay if self.objective.optimizer_weight_decay is None else self.objective.optimizer_weight_decay,
        )
        scheduler = build_schedule(optimizer, self.trainer, hp.warmup_epochs, hp.schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        resume_schedule(self.trainer)  # a run extended on resume: the stretched schedule's lr from its first step
        if self.trainer.ckpt_path is None:  # a resumed run restores what prepare() computed
            loader = self.trainer.datamodule.train_dataloader() if self.trainer.datamodule is not None else []
            batches = map(self.task.unpack, loader)
            self.objective.prepare(
                (self._images(_split_views(b.inputs)[0].to(self.device)), b.targets.to(self.device)) for b in batches
            )

    def on_train_epoch_start(self) -> None:
        # Seeded by (seed, epoch): a re-initialisation (RIFLE) is the same on every DDP process and after a resume.
        torch.manual_seed(epoch_seed(run_seed(), self.current_epoch))
        self.objective.on_train_epoch_start(self.current_epoch, self.trainer.max_epochs or 1)
        if self.objective.needs_optimizer_reset:  # e.g. RIFLE re-initialised the classifier
            optimizer = self.optimizers()
            self.objective.reset_optimizer_state(getattr(optimizer, "optimizer", optimizer))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        # after the step: a momentum encoder follows the weights just updated, as tllib's Bi-tuning and MoCo do
        # (Lightning's on_before_zero_grad runs before backward and step: the keys lagged one update)
        super().optimizer_step(*args, **kwargs)
        self.objective.on_after_optimizer_step()
