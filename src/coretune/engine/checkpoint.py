"""What a fine-tuning checkpoint records besides its weights: coretune's ``checkpoint["coretune"]`` entry
(:class:`CheckpointMeta`: task, objective and its settings, classes, data settings, the pre-trained weights' SHA-256,
adversarial settings), written by :meth:`CheckpointMeta.of` and read back, checked before anything is built, by
:meth:`CheckpointMeta.from_checkpoint` (:meth:`coretune.engine.FineTuner.from_checkpoint` builds the model from it);
and the check that a resumed run's checkpoint holds the model the run builds (:func:`check_resumed_model`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..data import TaskData
from ..models import CheckpointError, load_checkpoint_file
from ..objectives import Objective
from ..objectives import get as get_objective
from ..tasks import moved_task_settings
from .modelsettings import GROUPS, grouped_model_settings

__all__ = ["CheckedCheckpoint", "CheckpointMeta", "check_resumed_model", "split_settings", "written_at"]


def data_settings(datamodule: TaskData) -> dict[str, Any]:
    """The data module's settings a checkpoint keeps (``coretune.data``): what the model is evaluated with, its
    ``image_size``, ``mean`` and ``std``."""
    return {"image_size": datamodule.image_size, "mean": datamodule.mean, "std": datamodule.std}


# Backbone options that would fetch pre-trained weights (torchvision, timm): coretune never downloads, and a
# crafted checkpoint must not make it.
_WEIGHT_FETCHING_OPTIONS = frozenset(
    {"weights", "weights_backbone", "pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path"}
)


def _class_path(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@dataclass
class CheckpointMeta:
    """coretune's entry of a fine-tuning checkpoint (``checkpoint["coretune"]``), in the order it is written.

    Attributes:
        data: the image size and normalisation it was trained with (``image_size``, ``mean``, ``std``); a model
            loaded by ``FineTuner.from_checkpoint`` adds the settings that drew its splits (:func:`split_settings`).
        train_class_counts: the training split's images per class (the results' many/medium/few-shot groups);
            None for data that does not list its labels, and in older checkpoints.
        extra: entries of other coretune versions, kept as they are.
    """

    task: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    objective: str | None = None
    objective_class: str | None = None
    objective_hparams: dict[str, Any] = field(default_factory=dict)
    num_classes: int | None = None
    class_names: list[str] | None = None
    train_class_counts: list[int] | None = None
    feature_dim: int | None = None
    adversarial: dict[str, Any] | None = None
    weights_sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: Any) -> CheckpointMeta:
        """The entry of ``model`` (a FineTuner), with its trainer's data module's settings when it has one."""
        datamodule = model._trainer.datamodule if model._trainer is not None else None
        return cls(
            task=model.task.name,
            data={} if datamodule is None else data_settings(datamodule),
            objective=model.objective.registered_name,
            objective_class=_class_path(model.objective),
            objective_hparams=model.objective.hparams(),
            num_classes=model.num_classes,
            class_names=model.class_names,
            train_class_counts=getattr(model, "train_class_counts", None),
            feature_dim=model.backbone.feature_dim,
            adversarial=None if model.adversarial is None else model.adversarial.hparams(),
            weights_sha256=model.weights_sha256,
            # weight averaging (engine.averaging): which weights state_dict holds; absent without it
            extra={"averaging": averaging} if (averaging := getattr(model, "averaging", None)) else {},
        )

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> CheckpointMeta:
        """The entry as a checkpoint holds it (a dict, checked by :meth:`from_checkpoint`)."""
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(
            **{k: v for k, v in entry.items() if k in names},
            extra={k: v for k, v in entry.items() if k not in names},
        )

    def as_dict(self) -> dict[str, Any]:
        """The entry as written into ``checkpoint["coretune"]`` (and ``FineTuner.checkpoint_info``)."""
        entry = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**entry, **self.extra}

    @property
    def trained_data(self) -> dict[str, Any]:
        """The image size and normalisation (``image_size``, ``mean``, ``std``) the model was fine-tuned with, and
        the settings that drew its splits (``seed``; classification and segmentation: ``label_fraction``,
        ``val_fraction``, and segmentation's ``eval_mode``; domain generalization: ``test_domains``,
        ``holdout_fraction``, ``selection``), as its checkpoint records them (empty for one saved without a data
        module), sequences as lists: what ``coretune test``, ``validate``, ``eval robust`` and ``predict`` evaluate
        it with unless told otherwise (a run's seed is not in its ``config.yaml``: ``--seed`` sets it)."""
        return {k: list(v) if isinstance(v, tuple | list) else v for k, v in (self.data or {}).items()}

    @classmethod
    def from_checkpoint(cls, path: str | Path, model_cls: type) -> CheckedCheckpoint:
        """Read the fine-tuning checkpoint ``path`` (safe: ``weights_only=True``) and check its entry, its
        settings (against the objective's and ``model_cls``'s signatures) and its weights before anything is built.

        Raises:
            FileNotFoundError: no such file.
            CheckpointError: one line naming the file and the first problem found.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} not found: pass a .ckpt written by `coretune fit`")
        ckpt = load_checkpoint_file(path)  # CheckpointError for truncated files and pickles that would run code
        return _checked(path, ckpt, model_cls)


@dataclass(frozen=True)
class CheckedCheckpoint:
    """A checkpoint read and checked by :meth:`CheckpointMeta.from_checkpoint`: its entry, what rebuilds its model
    (the objective's class and settings, the model's settings), and the whole checkpoint (``raw``: its
    ``state_dict``, epoch and step, the data module's settings)."""

    path: Path
    meta: CheckpointMeta
    objective_cls: type[Objective]
    objective_hparams: dict[str, Any]
    hparams: dict[str, Any]
    model_cls: type
    raw: dict[str, Any]

    def build(self) -> Any:
        """The model (a ``model_cls``) the checkpoint describes, its weights loaded; it keeps the entry as
        ``checkpoint_meta`` (its ``data`` with the settings that drew the run's splits: :func:`split_settings`).

        Raises:
            CheckpointError: a setting the classes refuse, or weights that do not fit the model.
        """
        path, meta = self.path, self.meta
        try:
            objective = self.objective_cls.from_settings(self.objective_hparams)
            groups = {k: GROUPS[k](**v) for k, v in self.hparams.items() if k in GROUPS and isinstance(v, dict)}
            model = self.model_cls(objective=objective, **{**self.hparams, **groups}, weights=None)  # the file's
        except ValueError as err:  # a setting out of range: the class's own message
            raise CheckpointError(f"checkpoint {path} holds settings coretune refuses: {err}") from err
        objective.registered_name = meta.objective
        model.build(meta.num_classes, meta.class_names)
        try:
            model.load_state_dict(self.raw["state_dict"])
        except RuntimeError as err:  # torch lists every missing, unexpected and mis-shaped tensor, one per line
            raise CheckpointError(
                f"checkpoint {path}: its weights do not fit the model its settings describe "
                f"({' '.join(str(err).split())[:300]}): the file is damaged; use the run's other checkpoint"
            ) from err
        model.checkpoint_meta = replace(meta, data={**meta.data, **split_settings(self.raw, model.task)})
        model.train_class_counts = meta.train_class_counts
        model.loaded_checkpoint = written_at(self.raw, path)
        return model


def _checked(path: Path, ckpt: Any, model_cls: type) -> CheckedCheckpoint:
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
    recorded = meta.get("objective_hparams", {})  # an older version's spelling (Core-tuning's lambda_n): upgraded
    recorded = objective_cls.upgrade_settings(recorded)[0] if isinstance(recorded, dict) else recorded
    objective_hparams = settings(objective_cls, recorded, "objective settings")
    # an older version's task settings (output_stride) move into task_settings, its optimiser's (lr) into optim, ...
    recorded = ckpt.get("hyper_parameters", {})
    recorded = grouped_model_settings(moved_task_settings(recorded)) if isinstance(recorded, dict) else recorded
    hparams = settings(model_cls, recorded, "model settings", frozenset({"objective", "weights"}))
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
    counts = meta.get("train_class_counts")
    if counts is not None and (
        not isinstance(counts, list)
        or len(counts) != num_classes
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
    ):
        raise refuse(f"its train_class_counts ({_preview(counts)}) are not {num_classes} image counts, one per class")
    if problem := _data_problem(meta.get("data", {})):
        raise refuse(problem)
    weights = ckpt.get("state_dict")
    if not isinstance(weights, dict) or not all(isinstance(v, Tensor) for v in weights.values()):
        raise refuse("its state_dict is missing or holds something other than tensors")
    if broken := [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]:
        raise CheckpointError(
            f"checkpoint {path} holds NaN or infinite weights ({len(broken)} of {len(weights)} tensors, e.g. "
            f"{broken[0]}): the run that wrote it diverged; use an earlier checkpoint, or fine-tune again with a "
            "lower learning rate (--model.optim.lr)"
        )
    entry = CheckpointMeta.from_entry(meta)
    return CheckedCheckpoint(path, entry, objective_cls, objective_hparams, hparams, model_cls, ckpt)


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


def _preview(value: Any, show: int = 4) -> str:
    """``repr(value)``, a long list cut to its first ``show`` items (for messages)."""
    if isinstance(value, list) and len(value) > show:
        return f"[{', '.join(map(repr, value[:show]))}, … ({len(value)} in all)]"
    return repr(value)


def written_at(checkpoint: Mapping[str, Any], path: str | Path | None) -> dict[str, Any]:
    """Where a Lightning checkpoint was written: its ``path``, ``epoch`` (0-based) and ``step``."""
    return {
        "path": None if path is None else str(path),
        "epoch": checkpoint.get("epoch"),
        "step": checkpoint.get("global_step"),
    }


def split_settings(ckpt: Mapping[str, Any], task: Any) -> dict[str, Any]:
    """The data options that drew the run's splits (``task``'s data class's ``split_settings``: the seed; for
    classification also the label and validation fractions, for domain generalization the unseen domains,
    held-out fraction and selection rule), as Lightning saved the data module's arguments with the checkpoint
    (``datamodule_hyper_parameters``); empty without them."""
    saved = ckpt.get("datamodule_hyper_parameters")
    names = task.data_class.split_settings
    return {k: saved[k] for k in names if k in saved} if isinstance(saved, Mapping) else {}


def check_resumed_model(checkpoint: Mapping[str, Any], model: Any, where: Any) -> None:
    """Refuse the checkpoint (at ``where``) of another model than ``model`` (a FineTuner) before its tensors are
    copied in (torch would only say that tensor sizes differ): a resumed run whose data gained or lost a class,
    another backbone or objective.

    Raises:
        ValueError: naming what differs.
    """
    meta = checkpoint.get("coretune") or {}
    differ = [
        f"{name} {old} → {new}"
        for name, old, new in (
            ("backbone", checkpoint.get("hyper_parameters", {}).get("backbone"), model.hparams.backbone),
            ("objective", meta.get("objective_class"), _class_path(model.objective)),
        )
        if old is not None and old != new
    ]
    old_classes, classes = meta.get("class_names"), model.class_names
    if old_classes is not None and list(old_classes) != classes:
        added = [c for c in classes if c not in old_classes]
        removed = [c for c in old_classes if c not in classes]
        what = "; ".join([f"added {added}"] * bool(added) + [f"removed {removed}"] * bool(removed)) or "reordered"
        differ.append(f"classes: {len(old_classes)} → {len(classes)} ({what})")
    if differ:
        raise ValueError(
            f"checkpoint {where} holds another model than this run builds: {'; '.join(differ)}. Resume it with "
            "the data and settings it was trained with, or start a new run with another --run_dir"
        )
