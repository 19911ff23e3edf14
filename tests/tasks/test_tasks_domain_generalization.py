"""Domain generalization's metrics and outputs: accuracy per group against hand counts, the results entry with the
selection rule (DomainBed's names; the oracle marked as one) and the summary line."""

from __future__ import annotations

import math

import pytest
import torch

from coretune.data.domains import SELECTIONS, EvalGroup
from coretune.tasks.domain_generalization import (
    DomainGeneralizationTask,
    GroupAccuracy,
    domain_test_results,
    domain_val_values,
    selection_entry,
    summary_text,
)

GROUPS = [
    EvalGroup("photo", "test", "in"),
    EvalGroup("photo", "test", "out"),
    EvalGroup("art", "train", "out"),
    EvalGroup("sketch", "train", "out"),
]


def logits_for(predicted: list[int], k: int = 3) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(predicted), k).float()


def test_group_accuracy_counts_each_group_over_batches() -> None:
    metric = GroupAccuracy(4)
    metric.update(logits_for([0, 1, 2, 0]), torch.tensor([0, 1, 1, 0]), torch.tensor([0, 0, 2, 2]))
    metric.update(logits_for([2, 2, 1]), torch.tensor([2, 0, 1]), torch.tensor([0, 2, 2]))
    accuracies = metric.compute()
    assert accuracies[0].item() == pytest.approx(3 / 3)  # group 0: 0→0, 1→1, 2→2
    assert accuracies[2].item() == pytest.approx(2 / 4)  # group 2: wrong, right, wrong, right
    assert math.isnan(accuracies[1]) and math.isnan(accuracies[3])  # no items
    with pytest.raises(ValueError, match=r"groups must lie in \[0, 4\), got \[4, 4\]"):
        metric.update(logits_for([0]), torch.tensor([0]), torch.tensor([4]))
    unsized = GroupAccuracy()  # as many groups as the largest seen + 1
    unsized.update(logits_for([1, 1]), torch.tensor([1, 0]), torch.tensor([0, 1]))
    assert unsized.compute().tolist() == [1.0, 0.0]


def test_validation_that_saw_only_the_first_group_is_padded_not_a_crash() -> None:
    """Lightning's sanity check validates the first batches only, all of group 0: torchmetrics squeezes the
    one-group result to a 0-d tensor (the real PACS run stopped on len() of it)."""
    task = DomainGeneralizationTask()
    task.val_groups = GROUPS[2:]
    metric = GroupAccuracy()
    metric.update(logits_for([0, 1]), torch.tensor([0, 0]), torch.tensor([0, 0]))
    computed = metric.compute()
    assert computed.dim() == 0  # what the task receives
    values = task.val_values(computed)
    assert float(values["art/top1"]) == pytest.approx(0.5) and math.isnan(values["sketch/top1"])


def test_validation_values_are_each_training_domain_and_their_unweighted_mean() -> None:
    values = domain_val_values(torch.tensor([0.5, 0.9], dtype=torch.float64), GROUPS[2:])
    assert set(values) == {"top1", "art/top1", "sketch/top1"}
    assert float(values["top1"]) == pytest.approx(0.7)


@pytest.mark.parametrize("rule", list(SELECTIONS))
def test_results_report_each_group_and_the_chosen_checkpoint(rule: str) -> None:
    test = domain_test_results(
        torch.tensor([0.8, 0.75, 0.9, 0.6], dtype=torch.float64), GROUPS, rule, {"epoch": 3, "step": 400}
    )
    assert test["top1"] == 0.8 and test["test_domains"] == {"photo": 0.8}
    assert test["test_domains_heldout"] == {"photo": 0.75} and test["test_domain_val_top1"] == 0.75
    assert test["training_domains_heldout"] == {"art": 0.9, "sketch": 0.6}
    assert test["training_domain_val_top1"] == pytest.approx(0.75)
    selection = test["selection"]
    assert selection["rule"] == rule and selection["epoch"] == 3 and selection["step"] == 400
    line = summary_text(test)
    assert line.startswith(
        "unseen domain(s): photo 80.00%; training domains' held-out parts: art 90.00%, sketch 60.00%; selection: "
    )
    if rule == "test_domain_validation":
        assert selection["oracle"] is True and selection["name"] == "test-domain validation set (oracle)"
        assert selection["checkpoint"] == "last.ckpt" and selection["score"] == 0.75
        oracle = "ORACLE: its score reads the unseen domains' held-out images"
        assert line.endswith(f"(last.ckpt, epoch 4, step 400) — {oracle}")
    else:
        assert selection["oracle"] is False and "ORACLE" not in line
        assert selection["score"] == pytest.approx(0.75)
    if rule == "training_domain_validation":
        assert selection["name"] == "training-domain validation set" and selection["checkpoint"] == "best.ckpt"


def test_the_rules_carry_domainbeds_names() -> None:
    assert {rule: s.name for rule, s in SELECTIONS.items()} == {
        "training_domain_validation": "training-domain validation set",
        "test_domain_validation": "test-domain validation set (oracle)",
        "last_checkpoint": "last checkpoint",
    }
    assert [rule for rule, s in SELECTIONS.items() if s.oracle] == ["test_domain_validation"]
    assert selection_entry("last_checkpoint")["checkpoint"] == "last.ckpt"
