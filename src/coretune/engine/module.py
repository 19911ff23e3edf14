"""The LightningModule that fine-tunes a backbone with any registered objective (paper Algorithm 1's loop)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from ..distributed import rank, scale_grad, world_size
from ..models import create_backbone, load_checkpoint_file
from ..objectives import CETuning, Objective
from ..objectives import get as get_objective
from ..tasks import TASKS
from .optim import OptimizerName, Schedule, build_optimizer, lr_factor, optimizer_problems

__all__ = ["FineTuner", "NonFiniteLossError", "step_seed"]


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of training step ``step`` of a run seeded with ``seed``."""
    return (seed * 1_000_003 + step + 1) % 2**63


def epoch_seed(seed: int, epoch: int) -> int:
    """The RNG seed of the start of epoch ``epoch`` (objective hooks, e.g. RIFLE's re-initialisation), away from
    the step seeds."""
    return (seed * 1_000_003 + 2**40 + epoch) % 2**63


def _run_seed() -> int:
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
    """The training loss became NaN or infinite."""


def _train_features(backbone: torch.nn.Module, x: Tensor) -> Tensor:
    """``backbone(x)`` in training mode, with a clear error for a batch that BatchNorm cannot normalise."""
    try:
        return backbone(x)
    except ValueError as err:
        if "Expected more than 1 value per channel" not in str(err):
            raise
        raise ValueError(
            f"a training batch of {x.shape[0]} image cannot pass the backbone's BatchNorm layers, which need 2 or "
            "more values per channel in training: use --data.batch_size 2 or more (a last incomplete batch is "
            "dropped once the training set holds more than one batch)"
        ) from None


class FineTuner(L.LightningModule):
    """A backbone ``G_e`` and an objective (its heads and loss), trained with the paper's optimiser (Appendix C).

    Exactly one backbone forward per training step: ``z = G_e(x)`` goes to the objective, which returns the loss.

    Args:
        objective: the fine-tuning method (default: CE-tuning); built here once the number of classes is known.
        backbone: backbone name (``resnet18`` … ``resnet152``, ``resnext50_32x4d``, ``wide_resnet50_2``,
            ``small_cnn``, or ``timm/<model>``).
        weights: a local pre-trained checkpoint to load into the backbone (``None``: random initialisation).
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
        weight_decay: weight decay of every parameter group.
        schedule: per-step learning-rate decay: ``cosine`` (paper default), ``linear`` (ImageNet20) or ``constant``.
        warmup_epochs: linear warm-up length in epochs (may be fractional).
        channels_last: use the channels-last memory format for the backbone and the images (fast for CNNs).
        freeze_backbone: train the heads only (linear probing).
        task: what the data and predictions are (``classification``, the only task so far; see
            :mod:`coretune.tasks`).
    """

    def __init__(
        self,
        objective: Objective | None = None,
        backbone: str = "resnet50",
        weights: str | None = None,
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
    ) -> None:
        super().__init__()
        problems = optimizer_problems(lr, weight_decay, momentum, warmup_epochs)
        if backbone_lr is not None and backbone_lr < 0:
            problems.append(f"backbone_lr must be >= 0 (got {backbone_lr})")
        if task not in TASKS:
            problems.append(f"task must be one of {', '.join(TASKS)} (got {task!r})")
        if problems:
            raise ValueError("invalid model settings: " + "; ".join(problems))
        self.save_hyperparameters(ignore=["objective"])
        self.backbone = create_backbone(
            backbone,
            weights=weights,
            weights_format=weights_format,
            allow_cast=weights_allow_cast,
            **(backbone_args or {}),
        )
        self.objective = objective if objective is not None else CETuning()
        self.task = TASKS[task]()
        self.class_names: list[str] | None = None
        if channels_last:
            self.backbone.to(memory_format=torch.channels_last)
        if freeze_backbone:
            self.backbone.requires_grad_(False)

    # -- set-up ---------------------------------------------------------------------------------------------
    def build(self, num_classes: int, class_names: list[str] | None = None) -> None:
        """Create the objective's heads for ``num_classes`` classes and the metrics."""
        if num_classes < 2:
            raise ValueError(f"classification needs at least 2 classes, the data has {num_classes}")
        if not self.objective.is_built:
            self.objective.build(self.backbone.feature_dim, num_classes)
        elif self.objective.num_classes != num_classes:
            raise ValueError(
                f"the model was built for {self.objective.num_classes} classes but the data has {num_classes}: "
                "use data with the same classes, or fine-tune a new model"
            )
        self.class_names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
        self.train_metrics = self.task.train_metrics(num_classes)
        self.val_metrics = self.task.train_metrics(num_classes)
        self.test_metrics = self.task.eval_metrics(num_classes)

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
        if stage == "fit":
            self.objective.attach_backbone(self.backbone)
            views = self.objective.input_views
            if datamodule is not None and hasattr(datamodule, "train_views"):
                datamodule.train_views = views  # also back to 1 when a data module is reused for another method
            elif views > 1:
                raise ValueError(
                    f"objective {self.objective.name!r} needs {views} augmented views of each training image "
                    "(forward's inputs are a second view): use coretune's ImageClassificationData, or a data "
                    "module with a train_views attribute whose batches are ((view_1, view_2), labels)"
                )

    @property
    def num_classes(self) -> int | None:
        return self.objective.num_classes

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        checkpoint["coretune"] = {
            "data": {k: getattr(datamodule, k) for k in ("image_size", "mean", "std") if hasattr(datamodule, k)},
            "objective": getattr(self.objective, "registered_name", self.objective.name),
            "objective_class": f"{type(self.objective).__module__}.{type(self.objective).__qualname__}",
            "objective_hparams": self.objective.hparams(),
            "num_classes": self.num_classes,
            "class_names": self.class_names,
            "feature_dim": self.backbone.feature_dim,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse the checkpoint of another model before its tensors are copied in (torch would only say that
        tensor sizes differ): a resumed run whose data gained or lost a class, another backbone or objective."""
        meta = checkpoint.get("coretune") or {}
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

    @classmethod
    def from_checkpoint(cls, path: str | Path, map_location: str = "cpu") -> FineTuner:
        """Rebuild a fine-tuned model from a coretune checkpoint (safe: ``weights_only=True``)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} not found: pass a .ckpt written by `coretune fit`")
        ckpt = load_checkpoint_file(path)  # CheckpointError for truncated files and pickles that would run code
        meta = ckpt.get("coretune") if isinstance(ckpt, dict) else None
        if meta is None:
            raise ValueError(
                f"{path} is not a coretune fine-tuning checkpoint (no 'coretune' entry): pass a .ckpt written by "
                "`coretune fit` (a pre-trained backbone checkpoint goes to `coretune fit --model.weights`)"
            )
        objective_cls, _ = get_objective(meta["objective"])
        objective = objective_cls(**meta["objective_hparams"])
        objective.registered_name = meta["objective"]
        accepted = inspect.signature(cls.__init__).parameters
        hparams = {k: v for k, v in ckpt.get("hyper_parameters", {}).items() if k in accepted}
        hparams.update(weights=None)  # the fine-tuned weights come from the checkpoint itself
        model = cls(objective=objective, **hparams)
        model.build(meta["num_classes"], meta["class_names"])
        model.load_state_dict(ckpt["state_dict"])
        return model.to(map_location)

    # -- steps ----------------------------------------------------------------------------------------------
    def _images(self, x: Tensor) -> Tensor:
        if self.hparams.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def forward(self, x: Tensor) -> Tensor:
        """Class logits of a batch of images."""
        return self.objective.predict(self.backbone(self._images(x)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        # Every draw depends on (seed, step) only, so a run resumed from a checkpoint repeats the uninterrupted run
        # exactly (the data module does the same per image). The backbone's own draws (dropout, stochastic depth)
        # also depend on the process, like its images; the objective's (mixup weights, random negatives) do not,
        # so every DDP process draws the same values for the global batch it mines.
        seed = step_seed(_run_seed(), self.global_step)
        torch.manual_seed(step_seed(seed, rank()) if rank() else seed)
        x, y = self.task.unpack(batch)
        query, key = _split_views(x)
        x = self._images(query)
        inputs = x if key is query else self._images(key)
        z = _train_features(self.backbone, x)
        if self.objective.gathers:
            # Every process computes the loss of the global batch, but its backbone only sees its own rows'
            # gradient; DDP's average over W processes would leave 1/W of the single-process gradient.
            z = scale_grad(z, world_size())
        torch.manual_seed(seed)
        out = self.objective(z, y, inputs=inputs)
        if not torch.isfinite(out.loss):
            terms = ", ".join(f"{k}={float(v):.4g}" for k, v in out.terms.items())
            raise NonFiniteLossError(
                f"the training loss is {float(out.loss.detach())} at epoch {self.current_epoch}, "
                f"step {self.global_step} "
                f"(batch {batch_idx}; {terms}). Check the images for NaN/Inf, lower the learning rate "
                "(--model.lr), or train in float32 (--trainer.precision 32-true)."
            )
        bs = y.shape[0]
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
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self.task.unpack(batch)
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        self.log("val/loss", loss, on_step=False, on_epoch=True, batch_size=y.shape[0], sync_dist=True)
        self.val_metrics.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        # compute() already reduced over processes; sync_dist averages equal values (and tells Lightning so).
        self.log_dict({f"val/{k}": v for k, v in self.val_metrics.compute().items()}, prog_bar=True, sync_dist=True)
        self.val_metrics.reset()

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self.task.unpack(batch)
        self.test_metrics.update(self(x), y)

    def on_test_epoch_end(self) -> None:
        values = self.test_metrics.compute()
        self.test_results = {
            "top1": float(values["top1"]),
            "top5": float(values["top5"]),
            "per_class_accuracy": dict(zip(self.class_names, values["per_class"].tolist(), strict=True)),
            "confusion_matrix": values["confusion"].tolist(),
        }
        self.log_dict({"test/top1": values["top1"], "test/top5": values["top5"]}, sync_dist=True)
        self.test_metrics.reset()

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
            hp.weight_decay,
        )
        total = int(self.trainer.estimated_stepping_batches)
        steps_per_epoch = total / max(1, self.trainer.max_epochs or 1)
        warmup = round(hp.warmup_epochs * steps_per_epoch)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total, hp.schedule, warmup)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path is None:  # a resumed run restores what prepare() computed
            loader = self.trainer.datamodule.train_dataloader() if self.trainer.datamodule is not None else []
            batches = map(self.task.unpack, loader)
            self.objective.prepare(
                (self._images(_split_views(x)[0].to(self.device)), y.to(self.device)) for x, y in batches
            )

    def on_train_epoch_start(self) -> None:
        # Seeded by (seed, epoch): a re-initialisation (RIFLE) is the same on every DDP process and after a resume.
        torch.manual_seed(epoch_seed(_run_seed(), self.current_epoch))
        self.objective.on_train_epoch_start(self.current_epoch, self.trainer.max_epochs or 1)
        if self.objective.needs_optimizer_reset:  # e.g. RIFLE re-initialised the classifier
            optimizer = self.optimizers()
            self.objective.reset_optimizer_state(getattr(optimizer, "optimizer", optimizer))

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.objective.on_after_optimizer_step()
