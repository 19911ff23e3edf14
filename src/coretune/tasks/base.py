"""The task seam: what a task owns, so that the engine (:class:`coretune.engine.FineTuner`, ``coretune fit``, the
run directory) holds nothing specific to one task.

A task is one class per module, registered under its name with :func:`register_task` (:data:`TASKS`,
:func:`get_task`): coretune's under :mod:`coretune.tasks`, or user code's (``coretune fit --task NAME`` then takes
it once its module is imported). It owns

- its data module (:attr:`Task.data_class`: the ``--data.*`` options of ``coretune fit``/``test``/``validate``);
- its own settings (:attr:`Task.own_settings`: ``FineTuner(task_settings=...)``, ``coretune fit --task.<setting>``)
  and their check (:meth:`Task.settings_problems`); :func:`moved_task_settings` reads the older records that kept
  them among the model's settings;
- the network it trains: the backbone (:meth:`Task.build_backbone`) and the heads on it (:meth:`Task.build_heads`,
  usually the objective's);
- how a batch is unpacked (:meth:`Task.unpack` → :class:`Batch`), how the backbone's features are taken
  (:meth:`Task.features`), how the objective turns them into the training loss (:meth:`Task.loss`) and how the
  model predicts (:meth:`Task.predict`);
- its metrics for training, validation and test, the value the best checkpoint is chosen by (:attr:`Task.monitor`),
  what ``results.json``'s ``test`` entry holds (:meth:`Task.test_results`), the run summary's line
  (:meth:`Task.summary_line`) and its figures (:meth:`Task.write_figures`);
- what the applications do with its checkpoints: ``coretune predict``'s output (:attr:`Task.prediction_kind`),
  ``coretune export``'s network (:meth:`Task.export_network`, :meth:`Task.exported_network`), ``coretune test`` /
  ``validate``'s data (:meth:`Task.scored_folder_options`, :meth:`Task.check_scored_data`), whether ``coretune eval
  robust`` and adversarial training apply (:attr:`Task.supports_robust_eval`,
  :attr:`Task.supports_adversarial_training`), and how ``coretune fit`` names its model selection
  (:meth:`Task.selection_hint`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import lightning as L
from torch import Tensor, nn
from torchmetrics import MetricCollection

from ..data import TaskData
from ..longtail import DEFAULT_SHOT_THRESHOLDS
from ..models import Encoder, create_backbone
from ..models.exported import ExportedClassifier
from ..objectives import Objective, ObjectiveOutput

T = TypeVar("T", bound="Task")

PredictionKind = Literal["classes", "masks"]

__all__ = ["TASKS", "Batch", "Task", "get_task", "moved_task_settings", "register_task"]


@dataclass
class Batch:
    """A training or evaluation batch as the engine sees it, whatever the data module yields.

    Attributes:
        inputs: the images ``(B, 3, H, W)``, or a pair of views ``(view_1, view_2)`` when the objective asks for
            two (``Objective.input_views == 2``).
        targets: what the model is trained to predict (class labels ``(B,)``, masks ``(B, H, W)`` …).
        extras: anything else a batch carries (e.g. ``domains``: domain labels ``(B,)``); every entry reaches the
            objective as a keyword argument of the same name (:meth:`Task.loss`).
    """

    inputs: Any
    targets: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.targets.shape[0])


class Task:
    """Base class of a task. Subclasses set the class attributes and override what differs from classification's
    defaults below (a backbone's pooled features into the objective)."""

    name: ClassVar[str] = ""
    #: Its LightningDataModule (``coretune fit``'s ``--data.*``), a :class:`~coretune.data.TaskData` (what the
    #: engine reads of it; ``FineTuner.setup`` checks it): ``split_settings`` is read from the class itself.
    data_class: ClassVar[type[L.LightningDataModule]]
    #: The validation value (``val/<monitor>``, higher is better) that chooses ``best.ckpt``, that ``results.json``
    #: records as ``best_val_<monitor>``, that the learning curve plots and that sweeps score runs by.
    monitor: ClassVar[str]
    #: How :attr:`monitor` is named in figures and tables (``top-1``, ``MIoU``).
    monitor_label: ClassVar[str]
    #: The ``metrics.csv`` columns an epoch's log line shows (those the row has), loss first.
    summary_keys: ClassVar[tuple[str, ...]]
    #: Why a run validated on the test images, and how to hold out a validation split (the run summary's note).
    no_validation_split: ClassVar[str]
    validation_split_fix: ClassVar[str]
    #: The names of its training and validation metrics (``train/<name>``, ``val/<name>``), as opposed to losses.
    metric_names: ClassVar[tuple[str, ...]]
    #: Its data module's option that holds out part of the training data as the validation split, never reading the
    #: test split: ``coretune tune`` sets it to its ``--val_fraction``.
    validation_holdout: ClassVar[str] = "val_fraction"
    #: The task's own settings with their defaults (``FineTuner(task_settings={...})``, ``coretune fit
    #: --task.<setting>``): another task refuses them set to anything else (a setting that would silently do nothing).
    own_settings: ClassVar[Mapping[str, Any]] = {}
    #: Whether its validation and test scores need every batch: their loaders read one group (domain) after another,
    #: so ``--trainer.limit_val_batches`` / ``limit_test_batches`` below all of them would leave whole groups out.
    scores_every_group: ClassVar[bool] = False
    #: What ``coretune predict`` writes: ``"classes"``, a CSV of each image's class and probabilities (through
    #: :meth:`image_transform`), or ``"masks"``, a folder of one palette mask per image.
    prediction_kind: ClassVar[PredictionKind] = "classes"
    #: Whether its logits are per pixel at the input's size (segmentation's): ``coretune export`` then exports its
    #: network for any input size.
    dense_logits: ClassVar[bool] = False
    #: Whether ``coretune eval robust`` scores its checkpoints (classifiers' top-1 under attack).
    supports_robust_eval: ClassVar[bool] = False
    #: Whether ``coretune fit --adversarial.enable true`` trains it (attacked images keep their labels).
    supports_adversarial_training: ClassVar[bool] = False

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        """``settings``: the task's own settings (:attr:`own_settings`; those not given keep their defaults)."""
        self.settings = self.resolved_settings(settings)
        #: Where the weights under test were written, set by the engine before each test: the checkpoint's ``path``,
        #: ``epoch`` (0-based) and ``step``; empty when they are the model's own weights in memory.
        self.tested_checkpoint: dict[str, Any] = {}
        #: The training split's images per class, set by the engine before validation and test (``None``: not known,
        #: e.g. a checkpoint of an older version), and the data's ``(many, few)`` bounds of the many/medium/few-shot
        #: groups (:mod:`coretune.longtail`): what a task may report per group.
        self.train_class_counts: list[int] | None = None
        self.shot_thresholds: tuple[int, ...] = DEFAULT_SHOT_THRESHOLDS

    # -- its settings ---------------------------------------------------------------------------------------
    @classmethod
    def resolved_settings(cls, settings: Mapping[str, Any] | None) -> dict[str, Any]:
        """Its :attr:`own_settings`, those ``settings`` gives replaced (others are left out)."""
        given = settings or {}
        return {key: given.get(key, default) for key, default in cls.own_settings.items()}

    @classmethod
    def settings_problems(cls, settings: Mapping[str, Any]) -> list[str]:
        """One problem per entry of ``settings`` this task does not take: another task's setting set away from its
        default (this task would silently ignore it, e.g. ``output_stride 8`` for classification), or no task's.
        A task with settings of its own extends it with their values' checks."""
        problems = [
            f"{key} is a {other.name} setting that task {cls.name!r} ignores (got {settings[key]!r}): drop "
            f"--task.{key}, or fit with --task {other.name}"
            for other in TASKS.values()
            if other.name != cls.name
            for key, default in other.own_settings.items()
            if key in settings and key not in cls.own_settings and settings[key] != default
        ]
        known = {key for task in TASKS.values() for key in task.own_settings}
        return problems + [
            f"{key} is not a setting of task {cls.name!r} (its settings: {', '.join(cls.own_settings) or 'none'})"
            for key in settings
            if key not in known
        ]

    # -- the network ----------------------------------------------------------------------------------------
    def build_backbone(self, backbone: str, **options: Any) -> Encoder:
        """The backbone ``G_e``, pre-trained weights loaded (``options``: those of
        :func:`~coretune.models.create_backbone`)."""
        return create_backbone(backbone, **options)

    def check_objective(self, objective: Objective) -> None:
        """Raise ``ValueError`` (one line) if ``objective`` cannot train this task."""

    def build_heads(self, objective: Objective, feature_dim: int, num_classes: int) -> None:
        """Create the heads on the backbone for ``num_classes`` classes (the objective's, by default)."""
        objective.build(feature_dim, num_classes)

    def check_data(self, datamodule: TaskData, stage: str) -> None:
        """Raise ``ValueError`` (one line) if the data module's settings do not suit this task for ``stage``
        (``fit``, ``validate``, ``test`` …; called when the model is set up, after the data module)."""

    def gathers(self, objective: Objective) -> bool:
        """Whether the objective computes its loss on the batch gathered from every process (the engine then
        rescales the backbone's gradient)."""
        return objective.gathers

    # -- batches and steps ----------------------------------------------------------------------------------
    def unpack(self, batch: Any) -> Batch:
        """The :class:`Batch` of what a data module yields: ``(inputs, targets, ...)`` by default."""
        return Batch(batch[0], batch[1])

    def features(self, backbone: nn.Module, x: Tensor) -> Tensor:
        """What the backbone gives the objective for images ``x`` (its pooled features ``(B, d)`` by default)."""
        return backbone(x)

    def loss(self, objective: Objective, features: Tensor, batch: Batch, inputs: Tensor) -> ObjectiveOutput:
        """The training loss of a batch: ``objective(features, targets, inputs=inputs, **extras)``."""
        return objective(features, batch.targets, inputs=inputs, **batch.extras)

    def update_eval_metrics(self, metrics: Any, logits: Tensor, batch: Batch) -> None:
        """Update validation or test metrics with a batch's logits (``metrics.update(logits, targets)`` by default;
        a task whose metrics need the batch's extras overrides it)."""
        metrics.update(logits, batch.targets)

    def predict(self, objective: Objective, features: Tensor, x: Tensor) -> Tensor:
        """Logits of images ``x`` from their :meth:`features`."""
        return objective.predict(features)

    def eval_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The validation/test loss of logits against targets."""
        raise NotImplementedError

    # -- metrics and outputs --------------------------------------------------------------------------------
    def train_metrics(self, num_classes: int) -> MetricCollection:
        """Metrics updated with each training batch's logits and logged per epoch as ``train/<name>``."""
        raise NotImplementedError

    def val_metrics(self, num_classes: int) -> Any:
        """Metrics accumulated over the validation split (``update(logits, targets)``, ``compute()``)."""
        return self.train_metrics(num_classes)

    def val_values(self, computed: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The scalars of the validation metrics' ``compute()`` logged as ``val/<name>`` (into ``metrics.csv``)."""
        return dict(computed)

    def test_metrics(self, num_classes: int) -> Any:
        """Metrics accumulated over the test split."""
        raise NotImplementedError

    def test_results(self, computed: Mapping[str, Tensor], class_names: list[str]) -> dict[str, Any]:
        """``results.json``'s ``test`` entry (JSON values) from the test metrics' ``compute()``; its scalar
        entries are also logged as ``test/<name>``."""
        raise NotImplementedError

    def summary_line(self, test: Mapping[str, Any]) -> str:
        """The run summary's line of results (``coretune fit``'s end) from ``results.json``'s ``test`` entry."""
        raise NotImplementedError

    def test_checkpoint(self, run_dir: Path) -> str | None:
        """The checkpoint ``coretune fit`` tests once training ends (a path, or Lightning's ``"best"``); ``None``
        (default): the final weights, in memory."""
        return None

    def write_figures(self, module: L.LightningModule, datamodule: TaskData, run_dir: Path) -> list[Path]:
        """Write the task's figures besides the learning curve into ``run_dir`` (none by default)."""
        return []

    def selection_hint(self, datamodule: TaskData) -> str:
        """How ``coretune fit``'s messages name the option that makes it test ``best.ckpt``."""
        return "the task's model selection"

    # -- the applications ------------------------------------------------------------------------------------
    def image_transform(
        self, image_size: int, mean: tuple[float, float, float], std: tuple[float, float, float]
    ) -> tuple[Callable[[Any], Tensor], int]:
        """How this task's test split reads one image, and the draft size to decode it at (the data module's
        ``test_transform``): ``coretune predict`` reads a folder of new images the same way."""
        return self.data_class.test_transform(image_size, mean, std)  # type: ignore[attr-defined]

    def export_network(self, model: Any) -> nn.Module:
        """The network ``coretune export`` writes of a fine-tuned ``model`` (a FineTuner): images → logits (the
        backbone and the objective's classifier by default, :class:`~coretune.models.exported.ExportedClassifier`)."""
        return ExportedClassifier(model.backbone, model.objective.classifier)

    def export_settings(self) -> dict[str, Any]:
        """The task's settings the exported ``config.json`` records besides its name (what
        :meth:`exported_network` needs)."""
        return {}

    @classmethod
    def exported_network(cls, config: Mapping[str, Any]) -> nn.Module:
        """The untrained network of an exported ``config.json`` (``coretune.apps.export.load_exported`` loads its
        weights into it)."""
        return ExportedClassifier(
            create_backbone(config["backbone"], verbose=False, **(config.get("backbone_args") or {})),
            nn.Linear(config["feature_dim"], config["num_classes"]),
        )

    def scored_folder_options(self, command: str, options: dict[str, Any]) -> dict[str, Any] | None:
        """The data options with which ``coretune test`` / ``validate`` (``command``) score one labelled folder
        without training data, or ``None`` (by default: the options are used as given)."""
        return None

    def check_scored_data(self, model: Any, datamodule: TaskData, ckpt_path: str) -> None:
        """Raise ``ValueError`` (one line) if ``coretune test`` / ``validate`` / ``eval robust`` must not score the
        checkpoint ``ckpt_path`` (its ``model``) on ``datamodule`` (before any image is read)."""


TASKS: dict[str, type[Task]] = {}
"""The registered tasks by name, in registration order: those :class:`coretune.engine.FineTuner` accepts
(``task=``, ``coretune fit --task NAME``)."""


def register_task(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator registering a :class:`Task` subclass under ``name`` (its :attr:`Task.name`).

    Raises:
        ValueError: another class is already registered under ``name``.
    """

    def wrap(cls: type[T]) -> type[T]:
        if name in TASKS and TASKS[name] is not cls:
            raise ValueError(f"task {name!r} is already registered ({TASKS[name].__qualname__})")
        cls.name = name
        TASKS[name] = cls
        return cls

    return wrap


def moved_task_settings(model: Mapping[str, Any]) -> dict[str, Any]:
    """A :class:`~coretune.engine.FineTuner`'s settings (a checkpoint's ``hyper_parameters``, ``config.yaml``'s
    ``model`` entry) as they are recorded now: each task setting that older versions recorded among them
    (``output_stride: 8``) moved into ``task_settings`` (whose own entries win). A setting of another task than the
    recorded ``task`` is dropped at its default (older versions recorded every task's), kept otherwise (the task
    then refuses it)."""
    owners = {key: task for task in reversed(TASKS.values()) for key in task.own_settings}
    old = {key: value for key, value in model.items() if key in owners}
    if not old:
        return dict(model)
    task = TASKS.get(str(model.get("task")))
    kept = {
        key: value
        for key, value in old.items()
        if (task is not None and key in task.own_settings) or value != owners[key].own_settings[key]
    }
    moved = {key: value for key, value in model.items() if key not in owners}
    if kept or model.get("task_settings"):
        moved["task_settings"] = {**kept, **(model.get("task_settings") or {})}
    return moved


def get_task(name: str) -> type[Task]:
    """The task class registered as ``name``.

    Raises:
        ValueError: no task has that name (the message lists them).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]
