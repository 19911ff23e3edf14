"""Core-tuning and CE-Con with domain labels (domain generalization): positives by class across domains by default
(the paper), or restricted to the anchor's domain with ``same_domain_positives``, against a loop reference."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import coretune as ct
from coretune import objectives
from coretune.memory import CrossBatchMemory
from coretune.objectives import CoreTuning

LABELS = torch.tensor([0, 1, 1, 2, 0, 1, 0, 2, 2, 0])
DOMAINS = torch.tensor([0, 0, 1, 1, 2, 0, 0, 2, 1, 1])


def loop_con(v: torch.Tensor, labels: list[int], domains: list[int], obj: CoreTuning, hard: bool) -> torch.Tensor:
    """L_con one anchor at a time on [z (B); z⁺ (B); z⁻ (B)] (or [z] without mixing), positives restricted to the
    anchor's domain: A_i = every row but i and the anchor's class from other domains; P_i = the anchor's class from
    its domain (originals) and z⁺_i."""
    b = len(labels)
    per_anchor = []
    for i in range(b):
        elsewhere = {j for j in range(b) if labels[j] == labels[i] and domains[j] != domains[i]}
        contrast = [j for j in range(len(v)) if j != i and j not in elsewhere]
        positives = [j for j in contrast if (j < b and labels[j] == labels[i]) or (hard and j == b + i)]
        if not positives:
            continue
        denominator = torch.exp(v[contrast] @ v[i] / obj.temperature).sum()
        p = torch.exp(v[positives] @ v[i] / obj.temperature) / denominator
        w = 1 - p if obj.focal else torch.ones_like(p)
        per_anchor.append(-(w * torch.log(p)).sum() / len(positives))
    return torch.stack(per_anchor).mean()


@pytest.mark.parametrize("name", ["core", "ce_con"])
def test_same_domain_positives_equal_the_loop_reference(name: str) -> None:
    torch.manual_seed(0)
    obj = objectives.create(name, 6, 3, proj_dim=5, same_domain_positives=True)
    z = torch.randn(10, 6, requires_grad=True)
    obj.generator = torch.Generator().manual_seed(2)
    out = obj(z, LABELS, domains=DOMAINS)
    (grad,) = torch.autograd.grad(out.loss, z)

    hard = obj.mixing == "hard"
    rows, ce = z, F.cross_entropy(obj.classifier(z), LABELS)
    if hard:
        p = ct.mine_hard_pairs(z, LABELS, 3, generator=torch.Generator().manual_seed(2), domains=DOMAINS)
        rows = torch.cat([z, p.pos_features, p.neg_features])
        generated, targets = torch.cat([p.pos_features, p.neg_features]), torch.cat([p.pos_targets, p.neg_targets])
        ce = ce - (targets * torch.log_softmax(obj.classifier(generated), dim=1)).sum(1).mean()
    v = F.normalize(obj.projector(rows), dim=1)
    con = loop_con(v, LABELS.tolist(), DOMAINS.tolist(), obj, hard)
    torch.testing.assert_close(out.terms["con"], con.detach())
    torch.testing.assert_close(out.loss, ce + obj.eta * con)
    torch.testing.assert_close(grad, torch.autograd.grad(ce + obj.eta * con, z)[0])
    across = objectives.create(name, 6, 3, proj_dim=5)
    across.load_state_dict(obj.state_dict())
    across.generator = torch.Generator().manual_seed(2)
    assert not torch.equal(across(z, LABELS, domains=DOMAINS).terms["con"], out.terms["con"])


@pytest.mark.parametrize("name", ["core", "ce_con"])
def test_by_default_positives_are_by_class_across_domains(name: str) -> None:
    torch.manual_seed(0)
    obj = objectives.create(name, 6, 3, proj_dim=5)
    assert obj.same_domain_positives is False
    z = torch.randn(10, 6)
    obj.generator = torch.Generator().manual_seed(2)
    with_domains = obj(z, LABELS, domains=DOMAINS)
    obj.generator = torch.Generator().manual_seed(2)
    without = obj(z, LABELS)
    assert torch.equal(with_domains.loss, without.loss)


def test_the_hardest_positive_is_mined_in_the_anchors_domain() -> None:
    z = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    pairs = ct.mine_hard_pairs(z, LABELS, 3, generator=torch.Generator().manual_seed(0), domains=DOMAINS)
    for i, j in enumerate(pairs.hardest_positive.tolist()):
        same = [k for k in range(10) if k != i and LABELS[k] == LABELS[i] and DOMAINS[k] == DOMAINS[i]]
        if not same:
            assert j == i  # no positive of its class in its domain: the anchor itself
            continue
        similarity = F.cosine_similarity(z[i][None], z[same])
        assert j == same[int(similarity.argmin())]
    anywhere = ct.mine_hard_pairs(z, LABELS, 3, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(anywhere.hardest_positive, pairs.hardest_positive)
    with pytest.raises(ValueError, match="domains restrict the in-batch positives: mine without a memory"):
        ct.mine_hard_pairs(z, LABELS, 3, memory=z, memory_labels=LABELS, domains=DOMAINS)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"memory": CrossBatchMemory(8)},
            "same_domain_positives needs memory null (the memory keeps no domain labels)",
        ),
        ({"miner": None, "eta": 0.0}, "same_domain_positives needs a miner or eta > 0"),
    ],
)
def test_settings_that_cannot_restrict_positives_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        CoreTuning(same_domain_positives=True, **settings)


def test_without_domain_labels_the_restriction_is_one_line_with_the_fix() -> None:
    obj = objectives.create("core", 6, 3, same_domain_positives=True)
    with pytest.raises(ValueError, match="same_domain_positives needs the batches' domain labels: fine-tune with "
                       "--task domain_generalization"):  # fmt: skip
        obj(torch.randn(4, 6), torch.tensor([0, 1, 0, 1]))
