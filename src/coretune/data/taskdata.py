"""The :class:`TaskData` protocol: what the engine, the tasks and the applications read from a data module; the
defaults of its optional members (:class:`TaskDataDefaults`, which :class:`~coretune.data.ImageDataModule`
inherits), and the one check that a data module implements it (:func:`require_task_data`)."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

from .errors import DataError

__all__ = [
    "TASK_DATA_MEMBERS",
    "TaskData",
    "TaskDataDefaults",
    "missing_task_data",
    "require_task_data",
    "train_class_counts",
]


@runtime_checkable
class TaskData(Protocol):
    """What the engine (``FineTuner``, its callbacks, checkpoints and preflight), the tasks and the applications read
    from a data module: coretune's three data modules satisfy it (:class:`ImageDataModule` holds the defaults, in
    :class:`TaskDataDefaults`), and a data module of a user's own must too (:func:`require_task_data` names what it
    lacks; ``isinstance(data, TaskData)`` on Python < 3.12 reads ``num_classes``, which sets the data module up).

    A task's own data settings are the task's business, read from its own data class: ``ignore_index``
    (segmentation), ``selection``, ``test_domains``, ``val_groups``/``test_groups`` (domain generalization), and
    ``test_transform`` (``coretune predict``, a static method of the data class :meth:`Task.image_transform
    <coretune.tasks.Task.image_transform>` calls); ``coretune eval`` reads
    :class:`~coretune.data.ImageClassificationData`'s ``has_test_split``, ``tests_on_training_folder`` and
    ``train_as_evaluated``.
    """

    #: Options that drew the run's splits, kept in the checkpoint (``FineTuner.trained_data``; default none).
    split_settings: ClassVar[tuple[str, ...]]
    #: Whether :attr:`train_views` > 1 makes training batches of ``((view_1, view_2, ...), labels)``: independently
    #: augmented views of each image, for an objective with ``input_views`` > 1 (Bi-tuning); default False.
    makes_views: ClassVar[bool]
    #: Side of the square network input in pixels (the model summary's example input, the checkpoint's data).
    image_size: int
    #: Training batch size (memory and batch-size checks).
    batch_size: int
    #: The normalisation of the images (the checkpoint's data, adversarial training, figures).
    mean: tuple[float, ...]
    std: tuple[float, ...]
    #: Whether validation reads the test split's images (set at ``setup``; recorded in the results; default False).
    validates_on_test: bool
    #: Augmented views per training image its training batches hold: set by the engine to the objective's
    #: ``input_views`` before a fit (1 by default; more only where :attr:`makes_views`).
    train_views: int
    #: Training batches per epoch when epochs have a fixed length, else None (the training loader's length;
    #: default None).
    steps_per_epoch: int | None
    #: The splits after ``setup`` (None: no such split; default None).
    train_dataset: Any
    val_dataset: Any
    test_dataset: Any

    @property
    def num_classes(self) -> int:
        """Number of classes (sets the data module up when read before ``setup``)."""
        ...

    @property
    def class_names(self) -> list[str]:
        """Class names in label order."""
        ...

    def setup(self, stage: str | None = None) -> None:
        """Read the splits (once)."""
        ...

    def train_dataloader(self) -> Any:
        """The training batches."""
        ...

    def val_dataloader(self) -> Any:
        """The validation batches."""
        ...

    def test_dataloader(self) -> Any:
        """The test batches."""
        ...

    def check_folders(self) -> None:
        """Check, reading no image, that the data folders exist (``bench``, ``tune``, ``fit`` before any run;
        default: nothing to check)."""
        ...

    def separate_validation(self) -> bool:
        """Whether validation reads other images than the test split, reading no image (``tune``, ``bench``;
        default: not :attr:`validates_on_test`)."""
        ...

    def test_files_in_training(self) -> list[str]:
        """The test split's image files that the training split reads too (a warning before a fit; default
        none)."""
        ...

    def val_files_in_training(self) -> list[str]:
        """The validation split's image files that the training split reads too (default none)."""
        ...

    def require_test_split(self, why: str) -> None:
        """Raise :class:`DataError` (``why`` says what needs them) when there are no images to test on, reading no
        image (``coretune fit``, which ends with a test, before it trains; default: there are)."""
        ...


TASK_DATA_MEMBERS: tuple[str, ...] = (
    *TaskData.__annotations__,
    *(n for n, v in vars(TaskData).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))),
)
"""The names a :class:`TaskData` has (its attributes, properties and methods), in declaration order."""


class TaskDataDefaults:
    """The defaults of the :class:`TaskData` members that a data module may leave out (:class:`ImageDataModule`
    inherits them): no split settings, one training view, no fixed epoch length, no split before ``setup``, no
    folder to check, no test or validation image in training, and a test split. A data module of a user's own
    lists it among its bases (``class MyData(TaskDataDefaults, L.LightningDataModule)``) and defines the rest:
    ``image_size``, ``batch_size``, ``mean``, ``std``, ``num_classes``, ``class_names`` and the loaders."""

    split_settings: ClassVar[tuple[str, ...]] = ()
    makes_views: ClassVar[bool] = False
    validates_on_test: bool = False
    train_views: int = 1
    steps_per_epoch: int | None = None
    train_dataset: Any = None
    val_dataset: Any = None
    test_dataset: Any = None

    def check_folders(self) -> None:
        """Nothing to check."""

    def separate_validation(self) -> bool:
        """Not :attr:`validates_on_test`."""
        return not self.validates_on_test

    def test_files_in_training(self) -> list[str]:
        """None."""
        return []

    def val_files_in_training(self) -> list[str]:
        """None."""
        return []

    def require_test_split(self, why: str) -> None:
        """There is a test split."""


def missing_task_data(data: object) -> list[str]:
    """The :class:`TaskData` members (:data:`TASK_DATA_MEMBERS`) that ``data`` lacks, looked up without running
    a property (``num_classes`` would set a data module up)."""
    missing = []
    for name in TASK_DATA_MEMBERS:
        try:
            inspect.getattr_static(data, name)
        except AttributeError:
            missing.append(name)
    return missing


def require_task_data(data: object) -> TaskData:
    """``data``, once it is known to be a :class:`TaskData` (the one check of a data module the engine is given:
    ``FineTuner.setup``, ``coretune fit``/``test``/``validate``).

    Raises:
        DataError: naming the members it lacks and the fix.
    """
    if missing := missing_task_data(data):
        raise DataError(
            f"the data module must implement coretune.data.TaskData: {type(data).__name__} lacks "
            f"{', '.join(missing)}; subclass coretune.data.ImageDataModule, or list coretune.data.TaskDataDefaults "
            "among its bases for the optional ones and define the rest"
        )
    return cast(TaskData, data)


def train_class_counts(data: object, num_classes: int) -> list[int] | None:
    """The training images of each of ``num_classes`` classes in ``data``'s set-up training split (its
    ``train_dataset.targets``: class indices, as :class:`~coretune.data.LabeledImageDataset` holds them), or None
    when the split does not list its labels so (segmentation's masks, a data module of a user's own)."""
    targets = getattr(getattr(data, "train_dataset", None), "targets", None)
    if not isinstance(targets, list | tuple) or not all(isinstance(t, int) and 0 <= t < num_classes for t in targets):
        return None
    counts = [0] * num_classes
    for t in targets:
        counts[t] += 1
    return counts
