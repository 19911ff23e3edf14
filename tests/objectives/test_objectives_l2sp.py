"""L2-SP (Li et al., 2018): α/2‖w − w⁰‖² on the backbone + β/2‖w‖² on new heads, against explicit loops."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coretune import objectives

Factory = Callable[..., nn.Module]


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8), torch.arange(n) % 3


def _train_steps(backbone: nn.Module, obj: objectives.Objective, steps: int = 3) -> None:
    optimizer = torch.optim.SGD([*backbone.parameters(), *obj.parameters()], lr=0.5, momentum=0.9)
    for _ in range(steps):
        x, y = _batch()
        out = obj(backbone(x), y, inputs=x)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        obj.on_after_optimizer_step()


def test_penalty_is_zero_right_after_attach(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = objectives.create("l2sp", 16, 3)
    obj.attach_backbone(backbone)
    x, y = _batch()
    out = obj(backbone(x), y, inputs=x)
    assert out.terms["l2sp"].item() == 0.0
    assert set(out.terms) == {"ce", "l2sp", "l2_new", "loss"}


def test_loss_equals_explicit_loop_over_parameters(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    start = copy.deepcopy(backbone)
    obj = objectives.create("l2sp", 16, 3, alpha=0.3, beta=0.2)
    obj.attach_backbone(backbone)
    _train_steps(backbone, obj)

    x, y = _batch()
    features = backbone(x)
    out = obj(features, y, inputs=x)
    pairs = zip(backbone.parameters(), start.parameters(), strict=True)
    sp = sum(0.5 * (p - p0).pow(2).sum() for p, p0 in pairs)
    new = 0.5 * (obj.classifier.weight.pow(2).sum() + obj.classifier.bias.pow(2).sum())
    ce = F.cross_entropy(obj.classifier(features), y)
    assert sp > 0
    torch.testing.assert_close(out.terms["l2sp"], sp.detach())
    torch.testing.assert_close(out.terms["l2_new"], new.detach())
    torch.testing.assert_close(out.loss, ce + 0.3 * sp + 0.2 * new)


def test_batchnorm_affine_parameters_count_and_running_stats_do_not(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = objectives.create("l2sp", 16, 3)
    obj.attach_backbone(backbone)
    with torch.no_grad():
        backbone[0][1].weight += 0.5  # 4 BN scales
        backbone[0][1].running_mean += 10.0  # a buffer, not a weight
    assert obj.starting_point_penalty().item() == pytest.approx(0.5 * 4 * 0.25)


def test_gradient_pulls_towards_the_starting_point(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = objectives.create("l2sp", 16, 3)
    obj.attach_backbone(backbone)
    conv = backbone[1][0].weight
    start = conv.detach().clone()
    with torch.no_grad():
        conv.add_(torch.randn_like(conv))
    obj.starting_point_penalty().backward()
    torch.testing.assert_close(conv.grad, conv.detach() - start)


def test_starting_point_never_changes_and_is_not_trainable(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    start = {k: v.clone() for k, v in backbone.named_parameters()}
    obj = objectives.create("l2sp", 16, 3)
    obj.attach_backbone(backbone)
    _train_steps(backbone, obj)
    assert any(not torch.equal(p, start[k]) for k, p in backbone.named_parameters())
    expected = sum(0.5 * (p - start[k]).pow(2).sum() for k, p in backbone.named_parameters())
    torch.testing.assert_close(obj.starting_point_penalty(), expected.detach())
    assert {id(p) for p in obj.parameters()} == {id(p) for p in obj.classifier.parameters()}
    assert set(obj.state_dict()) == {"classifier.weight", "classifier.bias"}


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"invalid L2-SP settings: alpha must be >= 0 \(got -1\)"):
        objectives.create("l2sp", alpha=-1)
    obj = objectives.create("l2sp", 4, 2)
    with pytest.raises(RuntimeError, match=r"l2sp needs the pre-trained backbone: call objective\.attach_"):
        obj(torch.randn(2, 4), torch.tensor([0, 1]))
