"""The LightningModule that fine-tunes a backbone with any registered objective (paper Algorithm 1's loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from ..data import require_task_data, train_class_counts
from ..distributed import rank, ranks_where, scale_grad, world_size
from ..models import WeightsOptions, weights_digest
from ..models.blocks import selected_parameters
from ..models.lora import LORA_OPTION, apply_lora
from ..objectives import CETuning, Objective, preset_name
from ..robust.batches import AdversarialBatches
from ..robust.training import AdversarialTraining
from ..tasks import TASKS, Batch
from .checkpoint import CheckpointMeta, check_resumed_model, written_at
from .datachecks import check_data
from .ftp import FTPProjection
from .health import GradScalerWatch, NonFiniteLossError, OutputHealth, training_blowup
from .optim import OptimSettings, build_optimizer, build_schedule, layer_decay_groups, resume_schedule
from .plateau import PlateauDecay
from .seeds import epoch_seed, run_seed, step_seed
from .speed import ChannelsLast, CompileGuard, channels_last_problem, compile_in_place, resolve_channels_last

__all__ = ["BatchTransform", "FineTuner", "NonFiniteLossError", "run_seed", "step_seed"]

BatchTransform = Callable[["FineTuner", Batch], Batch]
"""A training-batch transform (:attr:`FineTuner.batch_transform`): the model and the unpacked batch in, the batch
to train on out (e.g. adversarial training's, with its attacked images in place of or beside the clean ones)."""


def _split_views(x: Tensor | list[Tensor] | tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The query images and the images for the objective's ``inputs``: a batch's second view when it holds two
    (``Objective.input_views == 2``), else the same images."""
    return (x[0], x[1]) if isinstance(x, (list, tuple)) else (x, x)


def example_image(image_size: int | None) -> Tensor | None:
    """One zero image of side ``image_size`` (the data module's; ``None``: no data module, no image): the model
    summary's example input, so it shows FLOPs and layer sizes per image."""
    return torch.zeros(1, 3, image_size, image_size) if isinstance(image_size, int) else None


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


def _averages(trainer: L.Trainer) -> bool:
    """Whether ``trainer`` averages weights (a :class:`~lightning.pytorch.callbacks.WeightAveraging` callback: the
    one of ``coretune fit --averaging.*``, :mod:`~coretune.engine.averaging`)."""
    return any(isinstance(callback, WeightAveraging) for callback in trainer.callbacks)


class FineTuner(L.LightningModule):
    """A backbone ``G_e`` and an objective (its heads and loss), trained with the paper's optimiser (Appendix C).

    Exactly one backbone forward per training step: ``z = G_e(x)`` goes to the objective, which returns the loss.

    Its settings are recorded as the checkpoint's ``hyper_parameters`` (the groups ``optim`` and ``weights_options``
    as dicts) and in a run's ``config.yaml``; those of older versions, which had the groups' settings as their own
    (``lr``, ``weights_format``), are read through :func:`~coretune.engine.modelsettings.grouped_model_settings`.

    Args:
        objective: the fine-tuning method (default: CE-tuning); built here once the number of classes is known.
        backbone: backbone name (``resnet18`` … ``resnet152``, ``resnext50_32x4d``, ``wide_resnet50_2``,
            ``small_cnn``, a timm model name such as ``resnet50.a1_in1k``, or ``hf-hub:<org>/<repo>``).
        weights: a local pre-trained checkpoint to load into the backbone (``None``: random initialisation), or a
            hub name: ``<timm model>[.<tag>]``, ``hf-hub:<org>/<repo>``, or ``hub`` for the weights the backbone's
            name names (:mod:`~coretune.models.hubnames`).
        weights_options: how ``weights`` are read (:class:`~coretune.models.WeightsOptions`: ``download`` a named
            one missing from the cache, the checkpoint's ``format``, ``allow_cast``; ``--model.weights_options.<x>``).
        backbone_args: options of the backbone's constructor, e.g. ``{drop_path_rate: 0.1}`` for a timm ViT
            (``--model.backbone_args '{drop_path_rate: 0.1}'``, or ``--model.drop_path 0.1``). timm ViTs take any
            image size by default.
        optim: the optimiser and learning-rate schedule (:class:`~coretune.engine.optim.OptimSettings`: optimizer,
            lr, backbone_lr, momentum, nesterov, weight_decay, schedule, warmup_epochs, layer_decay; LP-FT's
            ``lp_epochs`` and ``lp_lr``; surgical fine-tuning's ``train_blocks``; FTP's ``ftp`` and ``ftp_k``;
            ``--model.optim.<x>``), and
            which of the backbone's weights train: all, or with ``lora`` (``--model.optim.lora.rank 8``) only LoRA's
            (:class:`~coretune.models.lora.LoRASettings`; the heads train either way).
        channels_last: use the channels-last memory format for the backbone and the images: ``auto`` (default) for
            CNN backbones, where it is faster, not for ViTs and other transformers
            (:func:`~coretune.engine.speed.prefers_channels_last`); or ``True``/``False``.
        compile: ``torch.compile`` the backbone for the fit (training and validation; ``coretune test``, ``predict``
            and exports run eager), in place: checkpoints keep the eager keys. When compilation fails the fit goes
            on eager, with one line naming why (:mod:`~coretune.engine.speed`); ``results.json``'s ``compile``
            says which ran.
        freeze_backbone: train the heads only (linear probing); ``optim.train_blocks`` trains some blocks only,
            ``optim.lp_epochs`` probes linearly first (LP-FT).
        task: what the data, the network on the backbone and the predictions are: ``classification`` (default)
            or another task of :data:`coretune.tasks.TASKS` (``coretune fit --task NAME``).
        task_settings: the task's own settings (:attr:`~coretune.tasks.Task.own_settings`; ``coretune fit
            --task.<setting>``), e.g. segmentation's ``{"output_stride": 8, "image_labels": "multilabel"}``; those
            not given keep the task's defaults. The task checks them
            (:meth:`~coretune.tasks.Task.settings_problems`): another task's, set away from its default, is refused.
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
        weights_options: WeightsOptions = WeightsOptions(),  # noqa: B008  (frozen: never changed)
        backbone_args: dict[str, Any] | None = None,
        optim: OptimSettings = OptimSettings(),  # noqa: B008  (frozen: never changed)
        channels_last: ChannelsLast = "auto",
        compile: bool = False,
        freeze_backbone: bool = False,
        task: str = "classification",
        task_settings: dict[str, Any] | None = None,
        adversarial: AdversarialTraining | None = None,
    ) -> None:
        super().__init__()
        problems = [f"optim.{problem}" for problem in optim.problems()]
        if task not in TASKS:
            problems.append(f"task must be one of {', '.join(TASKS)} (got {task!r})")
        adversarial_on = adversarial is not None and adversarial.enable
        if adversarial_on and task in TASKS and not TASKS[task].supports_adversarial_training:
            problems.append(f"adversarial training works with the classification task only (got task {task!r})")
        if task in TASKS:
            problems += TASKS[task].settings_problems(task_settings or {})
        if problem := channels_last_problem(channels_last):
            problems.append(problem)
        if freeze_backbone and (optim.train_blocks is not None or optim.lp_epochs or optim.ftp):
            given = next(
                f"optim.{n}" for n in ("train_blocks", "lp_epochs", "ftp") if getattr(optim, n) not in (None, 0)
            )
            problems.append(f"freeze_backbone true trains no backbone block: drop {given}, or freeze_backbone")
        if freeze_backbone and optim.lora.enabled:
            problems.append(
                f"freeze_backbone would freeze the LoRA weights {LORA_OPTION}.rank {optim.lora.rank} adds to the "
                "backbone, and nothing of it would train: use one of them"
            )
        if optim.lora.enabled and optim.train_blocks is not None:
            problems.append(
                f"{LORA_OPTION}.rank {optim.lora.rank} trains LoRA's weights in every adapted block, "
                f"optim.train_blocks {optim.train_blocks!r} trains whole blocks: use one of them"
            )
        if problems:
            raise ValueError("invalid model settings: " + "; ".join(problems))
        self.save_hyperparameters(ignore=["objective", "adversarial"])
        # the groups as dicts: a checkpoint is read weights-only, which unpickles no dataclass
        groups = {"optim": asdict(optim), "weights_options": asdict(weights_options)}
        self.hparams.update(groups)
        self._hparams_initial.update(groups)
        self.optim, self.weights_options = optim, weights_options
        self.task = TASKS[task](task_settings)
        self.objective = objective if objective is not None else CETuning()
        if self.objective.registered_name == type(self.objective).name:  # built from its class (the CLI): a preset?
            self.objective.registered_name = preset_name(self.objective)  # --objective ce_con logged as ce_con
        self.task.check_objective(self.objective)
        self.backbone = self.task.build_backbone(
            backbone,
            weights=weights,
            weights_format=weights_options.format,
            allow_cast=weights_options.allow_cast,
            weights_download=weights_options.download,
            **(backbone_args or {}),
        )
        if optim.lora.enabled:  # the pre-trained weights are loaded: LoRA adapts them, frozen
            apply_lora(self.backbone, optim.lora)
        # which file the backbone started from: a resume may then name the same file at another path
        self.weights_sha256 = weights_digest(weights, backbone)
        self.adversarial = adversarial
        self.batch_transform: BatchTransform | None = None
        if adversarial is not None and adversarial.enable:
            self.batch_transform = AdversarialBatches(adversarial)
        self.class_names: list[str] | None = None
        #: The training split's images per class (set by a fit's :meth:`setup`; a checkpoint keeps them): the
        #: many/medium/few-shot groups of the results and the objective's :meth:`~Objective.observe_class_counts`.
        self.train_class_counts: list[int] | None = None
        self.checkpoint_meta: CheckpointMeta | None = None  # the checkpoint's 'coretune' entry (from_checkpoint)
        #: Added to the class logits :meth:`forward` returns (``(K,)``; None: nothing): ``coretune test`` and
        #: ``predict``'s ``--posthoc_adjustment`` (:func:`coretune.apps.posthoc.posthoc_shift`). Never set in a fit.
        self.logit_shift: Tensor | None = None
        self.loaded_checkpoint: dict[str, Any] = {}  # the path, epoch and step of the checkpoint last loaded
        # which weights its checkpoints hold under weight averaging (engine.averaging sets it; None: the trained)
        self.averaging: dict[str, Any] | None = None
        self.channels_last = resolve_channels_last(channels_last, self.backbone)  # what "auto" means here
        if self.channels_last:
            self.backbone.to(memory_format=torch.channels_last)
        self.compile_guard: CompileGuard | None = None  # set by the fit's setup (compile=True)
        if freeze_backbone:
            self.backbone.requires_grad_(False)
        if optim.layer_decay is not None and self.backbone.layer_matcher() is None:
            raise ValueError(
                f"invalid model settings: optim.layer_decay needs a backbone whose layers timm can group (a timm "
                f"model such as vit_small_patch16_224 or resnet50, or a torchvision ResNet), not {backbone!r}: "
                "drop --model.optim.layer_decay or choose such a backbone"
            )
        if optim.train_blocks is not None:  # surgical fine-tuning: the blocks named train, the others are frozen
            try:
                chosen = selected_parameters(self.backbone, optim.train_blocks)
            except ValueError as err:
                raise ValueError(f"invalid model settings: optim.{err}") from None
            for name, p in self.backbone.named_parameters():
                p.requires_grad_(name in chosen)
        # what the optimiser updates in the backbone (the linear-probing phase of LP-FT freezes them for a while)
        self._trainable_backbone = [p for p in self.backbone.parameters() if p.requires_grad]

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
        """Build the heads for the data module's classes, check it (:func:`require_task_data`, then
        :func:`~.datachecks.check_data`) and hand the objective the backbone before a fit. Without a data module
        (loaders given to ``Trainer.fit``) the model must be built (:meth:`build`) before."""
        given = self.trainer.datamodule
        datamodule = None if given is None else require_task_data(given)
        if not hasattr(self, "train_metrics"):
            if datamodule is None:
                raise RuntimeError("FineTuner needs a datamodule (or call .build(num_classes) before fit)")
            self.build(datamodule.num_classes, datamodule.class_names)
        elif datamodule is not None and datamodule.num_classes != self.num_classes:
            self.build(datamodule.num_classes, datamodule.class_names)
        if (example := example_image(None if datamodule is None else datamodule.image_size)) is not None:
            self.example_input_array = example
        check_data(self, datamodule, stage)
        if stage == "fit":
            self._check_lp_strategy()
            self._check_plateau(datamodule)
            self._observe_training_labels(datamodule)
        self.task.train_class_counts = self.train_class_counts  # the task takes the shot thresholds in check_data
        if stage == "fit":
            self.objective.attach_backbone(self.backbone)
            # after attach_backbone: a copy it keeps of the backbone (a frozen source, a key encoder) stays eager
            if self.hparams.get("compile") and self.compile_guard is None:
                self.compile_guard = compile_in_place(self.backbone)

    def _check_lp_strategy(self) -> None:
        """Refuse LP-FT under DDP without ``find_unused_parameters``: the linear-probing phase leaves the backbone's
        parameters, which DDP expects to reduce, without gradients."""
        strategy = self.trainer.strategy
        ddp_kwargs = getattr(strategy, "_ddp_kwargs", None)
        ddp = ddp_kwargs is not None and self.trainer.world_size > 1
        if self.optim.lp_epochs and ddp and not ddp_kwargs.get("find_unused_parameters"):
            raise ValueError(
                "--model.optim.lp_epochs under DDP: the linear-probing phase leaves the backbone without "
                "gradients, which DDP waits for; use --trainer.strategy ddp_find_unused_parameters_true"
            )

    def _check_plateau(self, datamodule: Any) -> None:
        """Refuse a plateau decay that would read the test split (validation on the test images) or that SWA's
        constant rate would override."""
        if self.optim.plateau_patience is None:
            return
        if datamodule is not None and datamodule.validates_on_test:
            raise ValueError(
                "--model.optim.plateau_patience decays the learning rate on the validation loss, and this run "
                "validates on the test images: hold out part of the training set (--data.val_fraction 0.1)"
            )
        if any(getattr(getattr(c, "settings", None), "swa_lr", None) is not None for c in self.trainer.callbacks):
            raise ValueError(
                "--model.optim.plateau_patience and --averaging.swa_lr both set the learning rate: drop one"
            )

    def _observe_training_labels(self, datamodule: Any) -> None:
        """Count the training split's images per class (:attr:`train_class_counts`) and hand them to the objective;
        refuse data that does not list its training labels when the objective needs them."""
        counts = None if datamodule is None else train_class_counts(datamodule, self.num_classes or 0)
        if counts is None:
            if datamodule is not None and self.objective.needs_class_counts:
                raise ValueError(
                    f"objective {self.objective.registered_name!r} needs the training images per class, but "
                    f"{type(datamodule).__name__}'s train_dataset lists no class labels (.targets): use "
                    "ImageClassificationData, or give the data module's train_dataset a .targets list"
                )
            return
        self.train_class_counts = counts
        self.objective.observe_class_counts(torch.tensor(counts, dtype=torch.int64))

    @property
    def compile_status(self) -> str | None:
        """``compiled`` or ``eager: <why compilation failed>`` for a fit with ``compile=True``, else None."""
        return None if self.compile_guard is None else self.compile_guard.status

    def configure_callbacks(self) -> list[L.Callback]:
        """:class:`~coretune.engine.health.OutputHealth` (non-finite, collapsed or exploded evaluation outputs),
        :class:`~coretune.engine.health.GradScalerWatch` (a 16-mixed scaler that keeps skipping steps) and, with
        ``plateau_patience``, :class:`~coretune.engine.plateau.PlateauDecay`, each unless the trainer already has one
        (``coretune fit`` then tests on the same trainer)."""
        have = self.trainer.callbacks if self._trainer is not None else []
        added: list[L.Callback] = [
            kind() for kind in (OutputHealth, GradScalerWatch) if not any(isinstance(c, kind) for c in have)
        ]
        if self.optim.plateau_patience is not None:
            self.plateau = next((c for c in have if isinstance(c, PlateauDecay)), None)
            if self.plateau is None:
                self.plateau = PlateauDecay(self.optim.plateau_patience, self.optim.plateau_stop)
                added.append(self.plateau)
        return added

    @property
    def num_classes(self) -> int | None:
        return self.objective.num_classes

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["coretune"] = CheckpointMeta.of(self).as_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse the checkpoint of another model before its tensors are copied in (torch would only say that
        tensor sizes differ): a resumed run whose data gained or lost a class, another backbone or objective."""
        meta = checkpoint.get("coretune") or {}
        path = self._trainer.ckpt_path if self._trainer is not None else None
        self.loaded_checkpoint = written_at(checkpoint, path)
        self.weights_sha256 = meta.get("weights_sha256") or self.weights_sha256  # the file the run started from
        check_resumed_model(checkpoint, self, path if self._trainer is not None else "the checkpoint")
        fitting = self._trainer is not None and self._trainer.state.fn == TrainerFn.FITTING
        if fitting and "current_model_state" in checkpoint and not _averages(self._trainer):
            raise ValueError(
                f"checkpoint {path} holds averaged weights ({meta.get('averaging', {}).get('weights')}) beside the "
                "trained ones: resume it with the weight averaging it was trained with (its config.yaml's "
                "averaging: --averaging.*), or start a new run from it with --model.weights"
            )

    @property
    def checkpoint_info(self) -> dict[str, Any]:
        """The ``coretune`` entry of the checkpoint the model was loaded from by :meth:`from_checkpoint` (empty
        otherwise): :class:`~coretune.engine.checkpoint.CheckpointMeta` as a dict."""
        return {} if self.checkpoint_meta is None else self.checkpoint_meta.as_dict()

    @property
    def trained_data(self) -> dict[str, Any]:
        """The image size, normalisation and split settings the model was fine-tuned with, as its checkpoint records
        them (:attr:`~coretune.engine.checkpoint.CheckpointMeta.trained_data`; empty for a model not loaded by
        :meth:`from_checkpoint`): what ``coretune test``, ``validate``, ``eval robust`` and ``predict`` use."""
        return {} if self.checkpoint_meta is None else self.checkpoint_meta.trained_data

    @classmethod
    def from_checkpoint(cls, path: str | Path, map_location: str = "cpu") -> FineTuner:
        """Rebuild a fine-tuned model from a coretune checkpoint (safe: ``weights_only=True``).

        The checkpoint's ``coretune`` entry and settings are checked before anything is built
        (:meth:`~coretune.engine.checkpoint.CheckpointMeta.from_checkpoint`); the model keeps the entry as
        ``checkpoint_info`` (``data`` holds the image size and normalisation it was trained with).

        Raises:
            CheckpointError: the file is unreadable or unsafe, or its metadata, settings or weights are unusable
                (one line naming the file and the problem).
        """
        return CheckpointMeta.from_checkpoint(path, cls).build().to(map_location)

    # -- steps ----------------------------------------------------------------------------------------------
    def _images(self, x: Tensor) -> Tensor:
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def forward(self, x: Tensor) -> Tensor:
        """The task's logits of a batch of images (class logits ``(B, K)`` for classification), plus
        :attr:`logit_shift` (in float32) when one is set."""
        x = self._images(x)
        logits = self.task.predict(self.objective, self.task.features(self.backbone, x), x)
        return logits if self.logit_shift is None else logits.float() + self.logit_shift.to(logits.device)

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
        if self.optim.lp_epochs:  # the probe's features: BatchNorm statistics and dropout of evaluation (Kumar et al.)
            self.backbone.train(not self.linear_probing)  # and back to training mode once fine-tuning starts
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
            raise NonFiniteLossError(training_blowup(self, out, z, batch_idx, failed))
        y, bs = unpacked.targets, len(unpacked)
        terms = {f"train/{k}": v for k, v in out.terms.items()}
        # sync_dist: the mean over processes, reduced once per epoch
        self.log_dict(terms, on_step=False, on_epoch=True, batch_size=bs, sync_dist=True)
        self.train_metrics.update(out.logits.detach(), y)
        # Metric objects are reduced by Lightning before any epoch-end hook, so callbacks see them.
        metrics = {f"train/{k}": m for k, m in self.train_metrics.items()}
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=bs)
        if y.dim() == 1 and out.logits.dim() == 2 and len(out.logits) == len(y):
            return {"loss": out.loss, "logits": out.logits.detach(), "targets": y}
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        unpacked = self.task.unpack(batch)
        x, y = unpacked.inputs, unpacked.targets
        logits = self(x)
        loss = self.task.eval_loss(logits, y)
        self.log("val/loss", loss, on_step=False, on_epoch=True, batch_size=y.shape[0], sync_dist=True)
        self.task.update_eval_metrics(self.val_metrics, logits, unpacked)
        return {"images": x, "logits": logits.detach(), "loss": loss}  # for OutputHealth

    def on_validation_epoch_end(self) -> None:  # after OutputHealth's check
        # compute() already reduced over processes; sync_dist averages equal values (and tells Lightning so).
        values = self.task.val_values(self.val_metrics.compute())
        self.log_dict({f"val/{k}": v for k, v in values.items()}, prog_bar=True, sync_dist=True)
        self.val_metrics.reset()

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        unpacked = self.task.unpack(batch)
        x, y = unpacked.inputs, unpacked.targets
        logits = self(x)
        loss = self.task.eval_loss(logits, y)
        self.task.update_eval_metrics(self.test_metrics, logits, unpacked)
        return {"images": x, "logits": logits.detach(), "loss": loss}  # for OutputHealth

    def on_test_start(self) -> None:
        # the weights under test: a checkpoint loaded for it (trainer.test(ckpt_path=…), from_checkpoint), or the
        # model's own
        tested = self._trainer is not None and self._trainer.ckpt_path is not None
        self.task.tested_checkpoint = dict(self.loaded_checkpoint) if tested or self.checkpoint_info else {}

    def on_test_epoch_end(self) -> None:  # after OutputHealth's check
        self.test_results = self.task.test_results(self.test_metrics.compute(), self.class_names or [])
        scalars = {f"test/{k}": v for k, v in self.test_results.items() if isinstance(v, float)}
        self.log_dict(scalars, sync_dist=True)
        self.test_metrics.reset()

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, list | tuple) else batch
        return torch.softmax(self(x).float(), dim=1)

    # -- optimisation ---------------------------------------------------------------------------------------
    @property
    def linear_probing(self) -> bool:
        """Whether the current epoch is in LP-FT's linear-probing phase (``optim.lp_epochs``): the backbone frozen
        and in evaluation mode, the objective's heads training."""
        return self._trainer is not None and self.current_epoch < self.optim.lp_epochs

    @property
    def weight_decay(self) -> float:
        """The optimiser's weight decay: ``optim.weight_decay``, or the objective's own
        (:attr:`~coretune.objectives.Objective.optimizer_weight_decay`: 0 for L2-SP and DELTA)."""
        own = self.objective.optimizer_weight_decay
        return self.optim.weight_decay if own is None else own

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """The optimiser's parameter groups (torch's dicts), the trainable tensors only: the backbone's at
        ``backbone_lr`` and the objective's heads at ``lr``, every tensor with :attr:`weight_decay`; with
        ``optim.layer_decay``, the backbone's layers each at ``backbone_lr × layer_decay ** (L - 1 - layer)``
        (:func:`~.optim.layer_decay_groups`: timm's ``param_groups_layer_decay``, 1-D tensors and the backbone's
        ``no_weight_decay()`` without weight decay) and the heads at ``lr`` × 1.0, the top layer's scale, their 1-D
        tensors without weight decay too. The heads' group comes last (the ``lr`` metrics.csv logs)."""
        optim, decay = self.optim, self.weight_decay
        heads = [p for p in self.objective.parameters() if p.requires_grad]
        if optim.layer_decay is None:
            backbone = self._trainable_backbone  # LP-FT's probe freezes them for a while: they train after it
            return [{"params": backbone, "lr": optim.backbone_rate}, {"params": heads, "lr": optim.lr}]
        matcher = self.backbone.layer_matcher()
        assert matcher is not None  # checked by __init__
        groups = layer_decay_groups(
            self.backbone.body, matcher, optim.layer_decay, optim.backbone_rate, decay, self.backbone.no_weight_decay()
        )
        return [
            *groups,
            {"params": [p for p in heads if p.ndim <= 1], "lr": optim.lr, "weight_decay": 0.0},
            {"params": [p for p in heads if p.ndim > 1], "lr": optim.lr, "weight_decay": decay},
        ]

    def configure_optimizers(self) -> dict[str, Any]:
        """The optimiser over :meth:`optimizer_groups` and its per-step schedule, which multiplies every group's
        own rate (``LambdaLR``)."""
        optim = self.optim
        optimizer = build_optimizer(
            self.optimizer_groups(), optim.optimizer, optim.momentum, optim.nesterov, self.weight_decay
        )
        if optim.ftp:  # the projection after each step, anchored at the backbone's weights now (the pre-trained ones)
            optimizer.register_step_post_hook(FTPProjection(self._trainable_backbone, optim.ftp_k))
        lp_scale = 1.0 if optim.lp_lr is None else optim.lp_lr / optim.lr
        plateau = getattr(self, "plateau", None)
        scheduler = build_schedule(
            optimizer,
            self.trainer,
            optim.warmup_epochs,
            optim.schedule,
            lp_epochs=optim.lp_epochs,
            lp_scale=lp_scale,
            scale=None if plateau is None else (lambda: plateau.scale),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        resume_schedule(self.trainer)  # a run extended on resume: the stretched schedule's lr from its first step
        if self.trainer.ckpt_path is None:  # a resumed run restores what prepare() computed
            data = self.trainer.datamodule
            loader = data.train_dataloader() if data is not None else []
            # on the device and through the data module's hook, as training batches (--data.augment_on device)
            on_device = (
                data.on_after_batch_transfer(self.transfer_batch_to_device(b, self.device, 0), 0) for b in loader
            )
            batches = map(self.task.unpack, on_device)
            self.objective.prepare(
                (self._images(_split_views(b.inputs)[0].to(self.device)), b.targets.to(self.device)) for b in batches
            )

    def on_train_epoch_start(self) -> None:
        # Seeded by (seed, epoch): a re-initialisation (RIFLE) is the same on every DDP process and after a resume.
        torch.manual_seed(epoch_seed(run_seed(), self.current_epoch))
        if self.optim.lp_epochs:  # LP-FT: the backbone trains from the first epoch after the linear probe
            for p in self._trainable_backbone:
                p.requires_grad_(not self.linear_probing)
        self.objective.on_train_epoch_start(self.current_epoch, self.trainer.max_epochs or 1)
        if self.objective.needs_optimizer_reset:  # e.g. RIFLE re-initialised the classifier
            optimizer = self.optimizers()
            self.objective.reset_optimizer_state(getattr(optimizer, "optimizer", optimizer))

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        # after the step: a momentum encoder follows the weights just updated, as tllib's Bi-tuning and MoCo do
        # (Lightning's on_before_zero_grad runs before backward and step: the keys lagged one update)
        super().optimizer_step(*args, **kwargs)
        self.objective.on_after_optimizer_step()
