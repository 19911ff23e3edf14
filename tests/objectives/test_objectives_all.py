"""Every registered objective: a training step on a tiny backbone, the interface contract, the docs table."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from coretune import objectives

Factory = Callable[..., nn.Module]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "objectives.md"


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_training_step_on_a_tiny_backbone(name: str, tiny_backbone: Factory) -> None:
    backbone = tiny_backbone(16)
    obj = objectives.create(name, 16, 3)
    obj.generator = torch.Generator().manual_seed(0)  # used by the mixup objectives, ignored by the others
    obj.attach_backbone(backbone)
    obj.observe_class_counts(torch.tensor([3, 2, 1]))  # as the engine does: logit adjustment's priors
    obj.on_train_epoch_start(0, 4)
    optimizer = torch.optim.SGD([*backbone.parameters(), *obj.parameters()], lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    out = obj(backbone(x), y, inputs=x)
    assert out.logits.shape == (6, 3) and out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert "loss" in out.terms and out.terms["loss"].item() == pytest.approx(out.loss.item())
    assert all(t.dim() == 0 and not t.requires_grad and torch.isfinite(t) for t in out.terms.values())
    optimizer.zero_grad()
    out.loss.backward()
    optimizer.step()
    obj.on_after_optimizer_step()
    assert all(torch.isfinite(p.grad).all() for p in backbone.parameters() if p.grad is not None)
    assert all(p.requires_grad for p in obj.parameters())  # no frozen copy reaches the optimiser
    assert not {id(p) for p in obj.parameters()} & {id(p) for p in backbone.parameters()}


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_hparams_are_the_constructor_arguments(name: str) -> None:
    cls, preset = objectives.get(name)
    signature = inspect.signature(cls.__init__)
    obj = objectives.create(name)
    expected = {p.name: preset.get(p.name, p.default) for p in list(signature.parameters.values())[1:]}
    # a part (Core-tuning's miner, memory) is recorded as a plain dict: checkpoints load with weights_only
    expected = {k: asdict(v) if is_dataclass(v) else v for k, v in expected.items()}
    assert obj.hparams() == expected
    assert all(p.annotation is not inspect.Parameter.empty for p in list(signature.parameters.values())[1:])


def test_docs_table_lists_every_objective() -> None:
    text = DOCS.read_text(encoding="utf-8")
    for name in objectives.available():
        assert f"| `{name}` |" in text, name


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_preset_name_finds_each_registered_name_from_the_settings_alone(name: str) -> None:
    # an objective built from its class path (the CLI's --objective ce_con) knew only its class's name, core
    built = objectives.create(name)
    built.registered_name = type(built).name
    assert objectives.preset_name(built) == name
