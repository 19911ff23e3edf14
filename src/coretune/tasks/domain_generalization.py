"""Domain generalization (``--task domain_generalization``): leave-domains-out fine-tuning in DomainBed's layout,
with DomainBed's model selection. Accuracy per evaluation group (an unseen domain, a held-out part),
``results.json``'s entry with the checkpoint the selection rule chose, and the run summary's line.

Evaluation batches are ``(images, labels, group)`` with ``group`` indexing the data module's ``val_groups`` or
``test_groups`` (:class:`~coretune.data.domains.EvalGroup`): the training domains' held-out parts in validation; the
unseen domains' ``in`` parts (the reported accuracy), their ``out`` parts (the oracle's validation) and the training
domains' held-out parts in test.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from ..data import TaskData
from ..data.domains import SELECTIONS, DomainGeneralizationData, EvalGroup, domain_folders, domain_list
from ..objectives import Objective, ObjectiveOutput
from ..runs.layout import RunDir
from .base import Batch, register_task
from .classification import ClassificationTask

__all__ = [
    "DomainGeneralizationTask",
    "GroupAccuracy",
    "domain_test_results",
    "domain_val_values",
    "selection_entry",
    "summary_text",
]


class GroupAccuracy(Metric):
    """Top-1 accuracy of each group of items (an unseen domain, a held-out part), accumulated over a split:
    ``update(logits, targets, groups)``; ``compute()`` gives ``(G,)`` accuracies, NaN for a group without items,
    with ``G`` = ``num_groups`` (default: the largest group seen + 1). The items' hits and groups are kept and
    concatenated over processes, so the number of groups need not be known when the metric is made."""

    full_state_update = False

    def __init__(self, num_groups: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_groups = num_groups
        self.add_state("hits", [], dist_reduce_fx="cat")
        self.add_state("groups", [], dist_reduce_fx="cat")

    def update(self, logits: Tensor, targets: Tensor, groups: Tensor) -> None:
        groups = groups.reshape(-1).long()
        if groups.numel() and (int(groups.min()) < 0 or (self.num_groups and int(groups.max()) >= self.num_groups)):
            low, high = int(groups.min()), int(groups.max())
            raise ValueError(f"groups must lie in [0, {self.num_groups}), got [{low}, {high}]")
        self.hits.append((logits.argmax(dim=1) == targets.reshape(-1)).long())
        self.groups.append(groups)

    def compute(self) -> Tensor:
        hits, groups = dim_zero_cat(self.hits), dim_zero_cat(self.groups)
        size = self.num_groups or (int(groups.max()) + 1 if groups.numel() else 0)
        total = torch.bincount(groups, minlength=size).double()
        correct = torch.bincount(groups, weights=hits.double(), minlength=size)
        return torch.where(total > 0, correct / total.clamp(min=1), torch.full_like(total, float("nan")))


def domain_val_values(accuracies: Tensor, groups: Sequence[EvalGroup]) -> dict[str, Tensor]:
    """``val/<domain>/top1`` of every training domain's held-out part and ``val/top1``, their unweighted mean
    (DomainBed's training-domain validation accuracy), from :class:`GroupAccuracy`'s ``compute()``."""
    values = {f"{g.domain}/top1": acc for g, acc in zip(groups, accuracies, strict=True)}
    return {"top1": accuracies.nanmean(), **values}


def selection_entry(rule: str, chosen: dict[str, Any] | None = None) -> dict[str, Any]:
    """``results.json``'s ``selection``: the rule (option value and DomainBed's name), whether it is an oracle, which
    checkpoint it tests and what its score is on; ``chosen`` adds where that checkpoint was written (``epoch``,
    ``step``, ``path``), whose file name is then the ``checkpoint`` (``coretune test`` of another file than the
    rule's names the file it tested)."""
    selection = SELECTIONS[rule]
    entry = {
        "rule": rule,
        "name": selection.name,
        "oracle": selection.oracle,
        "checkpoint": f"{selection.checkpoint}.ckpt",
        "scored_on": selection.scored_on,
    }
    if chosen and chosen.get("path"):
        entry["checkpoint"] = Path(chosen["path"]).name
    return {**entry, **(chosen or {})}


def domain_test_results(
    accuracies: Tensor, groups: Sequence[EvalGroup], rule: str, chosen: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``results.json``'s ``test`` entry from the test split's per-group accuracies (:class:`GroupAccuracy`):

    - ``top1``: the mean accuracy over the unseen domains (their ``in`` parts, as DomainBed reports), what sweeps
      tabulate, and ``test_domains`` each one's;
    - ``training_domains_heldout``: each training domain's held-out part, ``training_domain_val_top1`` their mean
      (the training-domain validation score of the tested checkpoint);
    - ``test_domains_heldout``: each unseen domain's held-out part, ``test_domain_val_top1`` their mean (the
      oracle's score);
    - ``selection``: :func:`selection_entry` (the rule, oracle or not, the tested checkpoint: ``path``, ``epoch``
      0-based as in ``metrics.csv``, ``step``); ``score`` its value.
    """
    values = {g: float(acc) for g, acc in zip(groups, accuracies.tolist(), strict=True)}
    unseen = {g.domain: v for g, v in values.items() if g.role == "test" and g.part == "in"}
    unseen_out = {g.domain: v for g, v in values.items() if g.role == "test" and g.part == "out"}
    heldout = {g.domain: v for g, v in values.items() if g.role == "train"}
    selection = selection_entry(rule, chosen)
    selection["score"] = fmean(unseen_out.values()) if SELECTIONS[rule].oracle else fmean(heldout.values())
    return {
        "top1": fmean(unseen.values()),
        "test_domains": unseen,
        "training_domains_heldout": heldout,
        "training_domain_val_top1": fmean(heldout.values()),
        "test_domains_heldout": unseen_out,
        "test_domain_val_top1": fmean(unseen_out.values()),
        "selection": selection,
    }


def summary_text(test: dict[str, Any]) -> str:
    """The run summary's line: each unseen domain's accuracy, the held-out training domains' and the checkpoint the
    rule chose, an oracle said to be one."""
    unseen = ", ".join(f"{d} {100 * v:.2f}%" for d, v in test["test_domains"].items())
    heldout = ", ".join(f"{d} {100 * v:.2f}%" for d, v in test["training_domains_heldout"].items())
    selection = test["selection"]
    where = f"{selection['checkpoint']}" + (
        f", epoch {selection['epoch'] + 1}, step {selection['step']}" if "epoch" in selection else ""
    )
    oracle = " — ORACLE: its score reads the unseen domains' held-out images" if selection["oracle"] else ""
    return (
        f"unseen domain(s): {unseen}; training domains' held-out parts: {heldout}; selection: {selection['name']} "
        f"({where}){oracle}"
    )


@register_task("domain_generalization")
class DomainGeneralizationTask(ClassificationTask):
    """Domain generalization (``--task domain_generalization``): leave-domains-out data in DomainBed's layout
    (:class:`~coretune.data.DomainGeneralizationData`) and the objective's classifier, as in classification.

    Training batches carry domain labels (``extras["domains"]``), passed to the objectives that take them
    (:attr:`~coretune.objectives.Objective.takes_domains`: Core-tuning and its presets); the others train on images
    and labels. Validation scores each training domain's held-out part (``val/<domain>/top1``) and their mean
    (``val/top1``, which chooses ``best.ckpt``); the test scores each :class:`~coretune.data.domains.EvalGroup` of
    the checkpoint the selection rule (``--data.selection``) names (:func:`domain_test_results`).
    """

    data_class = DomainGeneralizationData
    scores_every_group = True
    validation_holdout = "holdout_fraction"  # validation reads the training domains' held-out parts only
    supports_robust_eval = False
    supports_adversarial_training = False

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        super().__init__(settings)
        self.val_groups: list[EvalGroup] = []
        self.test_groups: list[EvalGroup] = []
        self.selection = "training_domain_validation"

    def check_data(self, datamodule: TaskData, stage: str) -> None:
        """Take the evaluation groups and the selection rule of a :class:`DomainGeneralizationData`."""
        if not isinstance(datamodule, DomainGeneralizationData):
            raise ValueError(
                f"--task domain_generalization reads DomainGeneralizationData (DomainBed's layout "
                f"<root>/<domain>/<class>/<images>), not {type(datamodule).__name__}"
            )
        datamodule.setup()
        self.val_groups, self.test_groups = datamodule.val_groups, datamodule.test_groups
        self.selection = datamodule.selection

    def selection_hint(self, datamodule: TaskData) -> str:
        """The selection rule's option (``--data.selection RULE``) of a :class:`DomainGeneralizationData` (the
        only data :meth:`check_data` lets through)."""
        if isinstance(datamodule, DomainGeneralizationData):
            return f"--data.selection {datamodule.selection}"
        return super().selection_hint(datamodule)

    def scored_folder_options(self, command: str, options: dict[str, Any]) -> dict[str, Any] | None:
        return None  # DomainBed's layout: the domains' folders, no standalone folder

    def check_scored_data(self, model: Any, datamodule: TaskData, ckpt_path: str) -> None:
        """Refuse to score as unseen a domain the checkpoint trained on: data holding the checkpoint's unseen
        domains (``test_domains``) is its data set, whose other domains it trained on; data without them is another
        data set, all of whose domains are new to it."""
        trained = domain_list(model.trained_data.get("test_domains"))  # as given: "photo", "art,sketch" or a list
        if not isinstance(datamodule, DomainGeneralizationData):
            return  # refused by check_data when the model is set up
        root = datamodule.root
        if not trained or root is None or not os.path.isdir(root):
            return
        if not set(trained) <= set(domain_folders(root)):
            return
        if seen := [d for d in datamodule.test_domains if d not in trained]:
            raise ValueError(
                f"checkpoint {ckpt_path} trained on domain(s) {seen} (its unseen domains are {list(trained)}): scored "
                f"as unseen, their training images would pass for new ones; pass --data.test_domains "
                f"{','.join(trained)} (the checkpoint's, the default), or score a model that held them out"
            )

    def unpack(self, batch: Any) -> Batch:
        """``(images, labels, groups)``: the groups are training batches' domain labels and evaluation batches'
        group indices; both ride in ``extras["domains"]``."""
        return Batch(batch[0], batch[1], {"domains": batch[2]})

    def loss(self, objective: Objective, features: Tensor, batch: Batch, inputs: Tensor) -> ObjectiveOutput:
        """The objective's loss; the domain labels go to the objectives that take them
        (:attr:`~coretune.objectives.Objective.takes_domains`)."""
        extras = batch.extras if objective.takes_domains else {}
        return objective(features, batch.targets, inputs=inputs, **extras)

    def update_eval_metrics(self, metrics: Any, logits: Tensor, batch: Batch) -> None:
        metrics.update(logits, batch.targets, batch.extras["domains"])

    def val_metrics(self, num_classes: int) -> GroupAccuracy:
        return GroupAccuracy()

    def val_values(self, computed: Tensor) -> dict[str, Tensor]:  # type: ignore[override]
        return domain_val_values(_padded(computed, len(self.val_groups)), self.val_groups)

    def test_metrics(self, num_classes: int) -> GroupAccuracy:
        return GroupAccuracy()

    def test_results(self, computed: Tensor, class_names: list[str]) -> dict[str, Any]:  # type: ignore[override]
        chosen = {k: v for k, v in self.tested_checkpoint.items() if v is not None}
        return domain_test_results(_padded(computed, len(self.test_groups)), self.test_groups, self.selection, chosen)

    def summary_line(self, test: Mapping[str, Any]) -> str:
        return summary_text(dict(test))

    def test_checkpoint(self, run_dir: Path) -> str | None:
        """The selection rule's checkpoint: ``best.ckpt`` (the best ``val/top1``) or ``last.ckpt``."""
        run = RunDir(run_dir)
        return str(run.best_checkpoint if SELECTIONS[self.selection].checkpoint == "best" else run.last_checkpoint)


def _padded(accuracies: Tensor, size: int) -> Tensor:
    """``accuracies`` of groups ``0 … n-1`` extended with NaN to ``size`` groups (groups with no item seen).
    torchmetrics squeezes a one-element result to 0-d (only group 0 seen, as in Lightning's sanity check over the
    first validation batches), hence the reshape."""
    accuracies = accuracies.reshape(-1)
    return torch.cat([accuracies, accuracies.new_full((max(0, size - len(accuracies)),), float("nan"))])
