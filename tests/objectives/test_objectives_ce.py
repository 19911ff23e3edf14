"""CE-tuning objective and the objective registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coretune import objectives


def test_ce_equals_cross_entropy() -> None:
    torch.manual_seed(0)
    obj = objectives.create("ce", 8, 5)
    z = torch.randn(12, 8, requires_grad=True)
    y = torch.randint(0, 5, (12,))
    out = obj(z, y)
    logits = z @ obj.classifier.weight.T + obj.classifier.bias
    torch.testing.assert_close(out.logits, logits)
    torch.testing.assert_close(out.loss, F.cross_entropy(logits, y))
    assert set(out.terms) == {"ce", "loss"}
    assert out.terms["loss"].item() == out.terms["ce"].item() == out.loss.item()
    assert not out.terms["loss"].requires_grad
    out.loss.backward()
    assert z.grad is not None and obj.classifier.weight.grad is not None
    torch.testing.assert_close(obj.predict(z), logits)


def test_ce_under_bf16_autocast_is_float32() -> None:
    obj = objectives.create("ce", 8, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = obj(torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


def test_create_builds_only_when_both_dims_are_given() -> None:
    obj = objectives.create("ce")
    assert not obj.is_built and obj.registered_name == "ce"
    with pytest.raises(
        RuntimeError, match=r"objective 'ce' has no heads yet: call \.build\(feature_dim, num_classes\)"
    ):
        obj(torch.randn(2, 3), torch.tensor([0, 1]))
    obj.build(3, 2)
    assert obj.is_built and obj.classifier.in_features == 3 and obj.classifier.out_features == 2


def test_build_rejects_empty_dims() -> None:
    with pytest.raises(ValueError, match="feature_dim and num_classes must be >= 1, got 0 and 3"):
        objectives.create("ce", 0, 3)


def test_unknown_name_lists_available_objectives() -> None:
    names = sorted(objectives.available())
    assert {"ce", "core", "ce_con", "ce_mix", "ce_con_mixh"} <= set(names)
    with pytest.raises(ValueError, match="unknown objective 'nope'; choose one of: ") as info:
        objectives.create("nope", 4, 2)
    assert str(info.value).endswith(", ".join(names))


def test_registering_a_name_twice_fails() -> None:
    with pytest.raises(ValueError, match="objective 'ce' is already registered"):
        objectives.register("ce")(objectives.CETuning)


def test_available_has_one_line_descriptions() -> None:
    for name, doc in objectives.available().items():
        assert doc and "\n" not in doc, name
