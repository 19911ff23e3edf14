"""What every data module shares: :class:`ImageDataModule`, the base class holding the options all tasks' data take
(their checks and help lines declared once here) and the defaults of :class:`~coretune.data.taskdata.TaskData`, the
protocol naming what the engine and the tasks read from a data module (re-exported here).

A task's data module (classification, segmentation, domain generalization) subclasses :class:`ImageDataModule`,
lists every option in its own ``__init__`` signature (jsonargparse builds the ``--data.*`` options from it), adds
its own options, their checks (:attr:`ImageDataModule.option_checks`) and help lines, and documents a shared option
only where its help differs (:meth:`ImageDataModule.__init_subclass__` adds the shared lines to its docstring).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, get_args

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from .datasets import OnBadImage
from .device_augment import AugmentOn, DeviceAugment
from .errors import DataError
from .loading import LoaderSettings, NumWorkers, PinMemory, hardware_of_trainer, is_auto, resolve_loading
from .samplers import eval_loader
from .taskdata import TaskData, TaskDataDefaults
from .transforms import normalisation_problems

__all__ = [
    "SHARED_CHECKS",
    "ImageDataModule",
    "OptionCheck",
    "TaskData",
    "check_options",
    "label_fraction_rule",
    "rule",
    "val_fraction_rule",
]

OptionCheck = Callable[[Mapping[str, Any]], "str | None"]
"""A check of a data module's options (by name): the problem, naming the option and its value, or None."""


def rule(name: str, ok: Callable[[Any], bool], expected: str, quote: bool = False) -> OptionCheck:
    """The check that option ``name`` passes ``ok``, else ``"<name> must be <expected>, got <value>"`` (the value
    quoted, ``repr``, with ``quote``)."""

    def check(options: Mapping[str, Any]) -> str | None:
        value = options[name]
        if ok(value):
            return None
        return f"{name} must be {expected}, got {value!r}" if quote else f"{name} must be {expected}, got {value}"

    return check


SHARED_CHECKS: dict[str, OptionCheck] = {
    "on_bad_image": rule("on_bad_image", lambda v: v in get_args(OnBadImage), "'error' or 'skip'", quote=True),
    "image_size": rule("image_size", lambda v: v >= 1, ">= 1 pixel"),
    "batch_size": rule("batch_size", lambda v: v >= 1, ">= 1"),
    "eval_batch_size": rule("eval_batch_size", lambda v: v is None or v >= 1, ">= 1 (or unset to use batch_size)"),
    "num_workers": rule("num_workers", lambda v: is_auto(v) or v >= 0, ">= 0 or auto"),
    "augment_on": rule("augment_on", lambda v: v in get_args(AugmentOn), "'loader' or 'device'", quote=True),
    "crop_scale": rule(
        "crop_scale", lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1, "(low, high) with 0 < low <= high <= 1"
    ),
}
"""The checks of options that several data modules take alike, by option name (an entry of
:attr:`ImageDataModule.option_checks`)."""


def label_fraction_rule(unit: str) -> OptionCheck:
    """``label_fraction`` in (0, 1], where 1 uses every ``unit`` (label, image)."""
    return rule("label_fraction", lambda v: 0 < v <= 1, f"in (0, 1] (1 uses every {unit})")


def val_fraction_rule(held_out: str) -> OptionCheck:
    """``val_fraction`` in [0, 1), where 0 validates on ``held_out`` (the val/ or test/ folder, val.txt …)."""
    return rule("val_fraction", lambda v: 0 <= v < 1, f"in [0, 1) (0 validates on {held_out})")


def check_options(options: Mapping[str, Any], checks: Sequence[OptionCheck | str]) -> None:
    """Reject values the type hints allow but the data cannot use, naming every bad option at once (in the order of
    ``checks``: each a check, or the name of one of :data:`SHARED_CHECKS`; then the normalisation's ``mean`` and
    ``std``): :class:`DataError`."""
    resolved = [SHARED_CHECKS[check] if isinstance(check, str) else check for check in checks]
    problems = [problem for check in resolved if (problem := check(options))]
    problems += normalisation_problems(options["mean"], options["std"])
    if problems:
        raise DataError(f"invalid data option(s): {'; '.join(problems)} — set valid values (--data.<option>)")


class ImageDataModule(TaskDataDefaults, L.LightningDataModule):
    """The options, checks and evaluation loaders every task's data module shares (subclassed, not used alone).

    A subclass's ``__init__`` lists every option (jsonargparse reads the signature), passes them all by name to
    ``super().__init__`` (which checks them with :attr:`option_checks` and keeps the shared ones as attributes),
    then calls ``self.save_hyperparameters()``. Its docstring's Args section (the last section) documents its own
    options and any shared one whose help differs; the shared lines below are added to it for the rest.

    Args:
        root: The data folder (its layout is the task's).
        image_size: Side of the square network input in pixels.
        batch_size: Training batch size.
        eval_batch_size: Validation/test batch size (default: batch_size).
        num_workers: DataLoader worker processes (0 loads in the main process); auto: min(8, CPU cores per
            process) on CUDA, else 0.
        label_fraction: Fraction of the training labels to use, drawn with seed; in (0, 1].
        seed: Seed of the splits and subsets drawn and of the training order and augmentation.
        mean: Per-channel normalisation mean (RGB, in [0, 1]) of the pre-trained model.
        std: Per-channel normalisation standard deviation (RGB) of the pre-trained model.
        hflip: Random horizontal flips in training augmentation.
        on_bad_image: Unreadable image files: "error" stops at the first with its path; "skip" decodes every
            file at setup, leaves the bad ones out and warns once.
        pin_memory: Pin batches in page-locked memory (speeds host-to-GPU copies); auto: on CUDA only.
        augment_on: Where training augmentation runs: "loader" (per image, in the loader workers) or "device"
            (the loader decodes to fixed uint8 squares of image_size·256/224 px; the random crop, flip, jitter …
            run on the batch on the model's device: for GPUs whose loader workers cannot keep up; see
            docs/usage.md).
    """

    #: The checks of the options (a check, or the name of a shared one), in the order their problems are named
    #: (:func:`check_options`).
    option_checks: ClassVar[tuple[OptionCheck | str, ...]] = (
        "on_bad_image", "image_size", "batch_size", "eval_batch_size", "num_workers", label_fraction_rule("label"),
    )  # fmt: skip
    #: Options that drew the run's splits. A checkpoint keeps them; ``coretune test`` and ``validate`` default to
    #: them (``FineTuner.trained_data``).
    split_settings: ClassVar[tuple[str, ...]] = ("seed",)

    def __init__(
        self,
        *,
        root: str | None,
        image_size: int,
        batch_size: int,
        eval_batch_size: int | None,
        num_workers: NumWorkers,
        label_fraction: float,
        seed: int,
        mean: tuple[float, float, float],
        std: tuple[float, float, float],
        hflip: bool,
        on_bad_image: OnBadImage,
        pin_memory: PinMemory,
        augment_on: AugmentOn = "loader",
        **task_options: Any,
    ) -> None:
        """Check every option (``task_options``: the subclass's own, checked only) and keep the shared ones."""
        super().__init__()
        shared = {k: v for k, v in locals().items() if k not in ("self", "task_options", "__class__")}
        check_options({**shared, **task_options}, self.option_checks)
        self.root = root
        self.image_size, self.batch_size, self.num_workers = image_size, batch_size, num_workers
        self.eval_batch_size = eval_batch_size or batch_size
        self.label_fraction, self.seed = label_fraction, seed
        self.mean, self.std, self.hflip = tuple(mean), tuple(std), hflip
        self.on_bad_image, self.pin_memory, self.augment_on = on_bad_image, pin_memory, augment_on
        #: The training batches' augmentation on the device (set by a subclass for ``augment_on="device"``).
        self.device_augment: DeviceAugment | None = None
        self.validates_on_test, self.train_views = False, 1
        self.train_dataset: Any = None
        self.val_dataset: Any = None
        self.test_dataset: Any = None
        self._class_names: list[str] | None = None  # set by setup
        self._told_loading = False  # the line naming what auto chose, printed once

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Add the shared options' help lines (this class's Args) that ``cls``'s docstring leaves out, for the
        options its ``__init__`` takes: ``--help``, the docs and the docstring then hold every option."""
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__ or not cls.__doc__:
            return
        own, shared = option_docs(cls.__doc__), option_docs(ImageDataModule.__doc__ or "")
        added = [shared[name] for name in inspect.signature(cls.__init__).parameters if name in shared.keys() - own]
        if added:
            head = "" if own or "\n    Args:\n" in cls.__doc__ else "\n\n    Args:\n"
            cls.__doc__ = cls.__doc__.rstrip() + head + "\n" + "\n".join(added) + "\n    "

    # -- what the data is -----------------------------------------------------------------------------------
    @property
    def class_names(self) -> list[str]:
        """Class names in label order (as :meth:`setup`, which this runs when read before it, found them)."""
        if self._class_names is None:
            self.setup()
        assert self._class_names is not None
        return self._class_names

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.class_names)

    # -- loaders --------------------------------------------------------------------------------------------
    def val_dataloader(self) -> DataLoader:
        """The validation split in order."""
        self.setup()
        assert self.val_dataset is not None
        return self._eval_loader(self.val_dataset)

    def test_dataloader(self) -> DataLoader:
        """The test split in order."""
        self.setup()
        assert self.test_dataset is not None
        return self._eval_loader(self.test_dataset)

    def _eval_loader(self, dataset: Dataset) -> DataLoader:
        """In item order, each item once (:func:`~.samplers.eval_loader`)."""
        return eval_loader(dataset, self.eval_batch_size, **self._loader_options())

    def loader_settings(self) -> LoaderSettings:
        """The loaders' ``num_workers``, ``pin_memory`` and prefetching: the options as given, ``auto`` resolved for
        the attached trainer's accelerator (without one: CUDA where it is available), named in one line the first
        time ``auto`` chooses (:func:`~coretune.data.loading.resolve_loading`)."""
        cuda, processes = hardware_of_trainer(getattr(self, "trainer", None))
        settings = resolve_loading(self.num_workers, self.pin_memory, cuda=cuda, processes_per_node=processes)
        if settings.chosen and not self._told_loading:
            rank_zero_info(settings.describe())
            self._told_loading = True
        return settings

    def _loader_options(self) -> dict[str, Any]:
        return self.loader_settings().options()

    # -- augmentation on the device -----------------------------------------------------------------------
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With :attr:`device_augment`, a training batch ``(images uint8, labels, …, item seeds)`` on the device →
        ``(images, labels, …)`` as the loader path's (``train_views`` > 1: ``((view_1, view_2, …), labels, …)``),
        augmented by :class:`~coretune.data.device_augment.DeviceAugment`. Every other batch (evaluation's float
        images, the loader path's) passes unchanged."""
        if not self.is_device_batch(batch):
            return batch
        images, *rest, seeds = batch
        assert self.device_augment is not None
        views = self.device_augment(images, seeds, self.train_views)
        return [views[0] if self.train_views == 1 else list(views), *rest]

    def is_device_batch(self, batch: Any) -> bool:
        """Whether ``batch`` is a training batch awaiting augmentation on the device (uint8 images first)."""
        return (
            self.device_augment is not None
            and isinstance(batch, list | tuple)
            and len(batch) >= 3
            and getattr(batch[0], "dtype", None) == torch.uint8
        )


def option_docs(doc: str) -> dict[str, str]:
    """The entries of a class docstring's Args section by option name, each its lines as they stand (the name's
    line, indented 8 spaces, and its continuation lines, indented more)."""
    lines = doc.splitlines()
    if "    Args:" not in lines:
        return {}
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines[lines.index("    Args:") + 1 :]:
        if line.startswith(" " * 9) and current is not None:
            current.append(line)
        elif line.startswith(" " * 8) and ":" in line:
            current = entries.setdefault(line.strip().split(":", 1)[0], [line])
        elif line.strip():
            break  # the next section
    return {name: "\n".join(entry) for name, entry in entries.items()}
