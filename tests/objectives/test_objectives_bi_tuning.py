"""Bi-tuning (Zhong et al., 2020): losses vs a per-sample loop, per-class FIFO queues, momentum updates."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coretune import objectives

Factory = Callable[..., nn.Module]


def _reference_losses(
    obj: objectives.BiTuning,
    features: torch.Tensor,
    labels: torch.Tensor,
    z_keys: torch.Tensor,
    queue_h: torch.Tensor,
    queue_z: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CCE and CCL one sample at a time: logits [current key, own-class queue, other classes' queues] / τ."""
    k, tau = obj.queue_size, obj.temperature
    z = F.normalize(obj.projector(features), dim=1)
    h = F.normalize(torch.cat([features, torch.ones(len(features), 1)], dim=1), dim=1)
    w = F.normalize(torch.cat([obj.classifier.weight, obj.classifier.bias[:, None]], dim=1), dim=1)
    cce, ccl = [], []
    for i, c in enumerate(labels.tolist()):
        others = [o for o in range(obj.num_classes) if o != c]
        zq = torch.cat([z_keys[i : i + 1], queue_z[c], *(queue_z[o] for o in others)])
        logp = F.log_softmax(zq @ z[i] / tau, dim=0)
        ccl.append(-logp[: k + 1].mean())
        hq = torch.cat([h[i : i + 1], queue_h[c], *(queue_h[o] for o in others)])
        logp = F.log_softmax(hq @ w[c] / tau, dim=0)
        cce.append(-logp[: k + 1].mean())
    return torch.stack(cce).mean(), torch.stack(ccl).mean()


@pytest.mark.parametrize("momentum_backbone", [False, True])
def test_losses_equal_per_sample_loop(tiny_backbone: Factory, momentum_backbone: bool) -> None:
    backbone = tiny_backbone()
    obj = objectives.create("bi_tuning", 16, 3, queue_size=4, contrast_weight=0.5, momentum_backbone=momentum_backbone)
    obj.attach_backbone(backbone)
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 0, 1, 1])
    features = backbone(x)
    queue_h, queue_z = obj.queue_h.clone(), obj.queue_z.clone()
    out = obj(features, y, inputs=x)
    # Just attached: the key encoder equals the online one, so the keys are the queries.
    z_keys = F.normalize(obj.projector(features), dim=1).detach()
    # tllib's order: the projector head reads the queues before the batch is enqueued, the classifier head after.
    cce, ccl = _reference_losses(obj, features, y, z_keys, obj.queue_h.clone(), queue_z)
    cce_before, _ = _reference_losses(obj, features, y, z_keys, queue_h, queue_z)
    assert abs(float((cce_before - cce).detach())) > 1e-3
    torch.testing.assert_close(out.terms["cce"], cce.detach())
    torch.testing.assert_close(out.terms["ccl"], ccl.detach())
    ce = F.cross_entropy(obj.classifier(features), y)
    torch.testing.assert_close(out.loss, ce + 0.5 * (cce + ccl))
    assert set(out.terms) == {"ce", "cce", "ccl", "loss"}
    out.loss.backward()
    assert obj.classifier.weight.grad is not None and obj.projector.weight.grad is not None


def test_queues_are_per_class_and_fifo() -> None:
    obj = objectives.create("bi_tuning", 2, 3, queue_size=3, proj_dim=2, momentum_backbone=False)
    model: dict[int, list[int | None]] = {c: [None] * 3 for c in range(3)}  # slot -> key id
    pointer = dict.fromkeys(range(3), 0)
    key_id = 0
    for labels in ([0, 0, 1, 0, 0], [2, 0, 1], [1, 1, 1, 1, 2]):  # 4 keys of class 0 in a 3-slot queue
        y = torch.tensor(labels)
        ids = torch.arange(key_id, key_id + len(labels), dtype=torch.float32)
        key_id += len(labels)
        h_keys = ids[:, None].repeat(1, 3)  # key n is the constant vector n
        obj.enqueue(h_keys, ids[:, None].repeat(1, 2), y)
        for n, c in zip(ids.int().tolist(), labels, strict=True):  # one write at a time, oldest slot first
            model[c][pointer[c]] = n
            pointer[c] = (pointer[c] + 1) % 3
        for c in range(3):
            written = [(s, n) for s, n in enumerate(model[c]) if n is not None]
            for slot, n in written:
                assert obj.queue_h[c, slot].tolist() == [n] * 3
                assert obj.queue_z[c, slot].tolist() == [n] * 2
        assert obj.queue_ptr.tolist() == [pointer[c] for c in range(3)]
    assert [model[c] for c in range(3)] == [[4, 6, 3], [9, 10, 11], [5, 12, None]]


def test_forward_enqueues_each_key_in_its_class_only() -> None:
    torch.manual_seed(0)
    obj = objectives.create("bi_tuning", 4, 3, queue_size=5, proj_dim=3, momentum_backbone=False)
    before = obj.queue_h.clone()
    z, y = torch.randn(4, 4), torch.tensor([2, 0, 2, 2])
    obj(z, y)
    keys = F.normalize(torch.cat([z, torch.ones(4, 1)], dim=1), dim=1)
    torch.testing.assert_close(obj.queue_h[2, :3], keys[[0, 2, 3]])
    torch.testing.assert_close(obj.queue_h[0, :1], keys[[1]])
    torch.testing.assert_close(obj.queue_h[2, 3:], before[2, 3:])
    torch.testing.assert_close(obj.queue_h[0, 1:], before[0, 1:])
    torch.testing.assert_close(obj.queue_h[1], before[1])
    assert obj.queue_ptr.tolist() == [1, 0, 3]


def test_momentum_update_follows_m(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = objectives.create("bi_tuning", 16, 3, momentum=0.9)
    obj.attach_backbone(backbone)
    key_proj_before = obj.key_projector.weight.detach().clone()
    key_conv_before = obj.key_backbone[0][0].weight.detach().clone()
    with torch.no_grad():
        obj.projector.weight.add_(1.0)
        backbone[0][0].weight.mul_(-2.0)
    obj.on_after_optimizer_step()
    torch.testing.assert_close(obj.key_projector.weight, 0.9 * key_proj_before + 0.1 * obj.projector.weight)
    torch.testing.assert_close(obj.key_backbone[0][0].weight, 0.9 * key_conv_before + 0.1 * backbone[0][0].weight)


def test_key_encoder_is_frozen_and_outside_parameters(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = objectives.create("bi_tuning", 16, 3)
    obj.attach_backbone(backbone)
    heads = {id(p) for m in (obj.classifier, obj.projector) for p in m.parameters()}
    assert {id(p) for p in obj.parameters()} == heads
    keys = [*obj.key_projector.parameters(), *obj.key_backbone.parameters()]
    assert keys and all(not p.requires_grad for p in keys)
    assert set(obj.state_dict()) == {
        "classifier.weight", "classifier.bias", "projector.weight", "projector.bias",
        "queue_h", "queue_z", "queue_ptr", "_extra_state",
    }  # fmt: skip
    assert set(obj.state_dict()["_extra_state"]) == {"key_projector", "key_backbone"}
    assert obj.queue_h.shape == (3, 40, 17) and obj.queue_z.shape == (3, 40, 128)


def test_errors(tiny_backbone: Factory) -> None:
    with pytest.raises(ValueError, match=r"queue_size must be >= 1 \(got 0\); momentum must lie in \[0, 1\]"):
        objectives.create("bi_tuning", queue_size=0, momentum=1.5)
    obj = objectives.create("bi_tuning", 16, 3)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=r"bi_tuning with momentum_backbone=True needs objective\.attach_back"):
        obj(torch.randn(2, 16), y, inputs=x)
    backbone = tiny_backbone()
    obj.attach_backbone(backbone)
    with pytest.raises(ValueError, match=r"bi_tuning with momentum_backbone=True needs the batch's images"):
        obj(backbone(x), y)


def _drift(obj: objectives.BiTuning, backbone: nn.Module) -> None:
    """Train-like changes: the online weights move and the key encoder follows by momentum."""
    with torch.no_grad():
        obj.projector.weight.add_(1.0)
        backbone[0][0].weight.mul_(-2.0)
    obj.on_after_optimizer_step()


@pytest.mark.parametrize("order", ["attach-then-load", "load-then-attach"])
def test_momentum_key_encoder_is_saved_and_restored(tiny_backbone: Factory, order: str) -> None:
    torch.manual_seed(0)
    backbone = tiny_backbone()
    obj = objectives.create("bi_tuning", 16, 3, momentum=0.5)
    obj.attach_backbone(backbone)
    _drift(obj, backbone)
    state = obj.state_dict()
    saved = [p.clone() for p in (*obj.key_projector.parameters(), *obj.key_backbone.parameters())]

    fresh_backbone = tiny_backbone()  # as a resumed run: the backbone and heads come from the checkpoint too
    fresh_backbone.load_state_dict(backbone.state_dict())
    restored = objectives.create("bi_tuning", 16, 3, momentum=0.5)
    if order == "attach-then-load":  # `coretune fit --ckpt_path last`: setup attaches, then the state loads
        restored.attach_backbone(fresh_backbone)
        restored.load_state_dict(state)
    else:  # FineTuner.from_checkpoint, then fit: the state waits for attach_backbone
        restored.load_state_dict(state)
        assert restored.key_backbone is None
        restored.attach_backbone(fresh_backbone)
    keys = [*restored.key_projector.parameters(), *restored.key_backbone.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(keys, saved, strict=True))
    assert not torch.equal(restored.key_projector.weight, restored.projector.weight)  # not a fresh copy


def test_a_checkpoint_without_the_key_encoder_loads_with_a_warning(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = objectives.create("bi_tuning", 16, 3)
    obj.attach_backbone(backbone)
    old = {k: v for k, v in obj.state_dict().items() if k != "_extra_state"}  # written by an earlier coretune
    with pytest.warns(UserWarning, match="no momentum key encoder .* restarts from the current backbone"):
        obj.load_state_dict(old)


def test_key_view_decides_how_many_views_the_engine_provides() -> None:
    assert objectives.create("bi_tuning").input_views == 2  # a second augmented view, as the authors
    assert objectives.create("bi_tuning", key_view="same").input_views == 1
    assert objectives.create("bi_tuning", momentum_backbone=False).input_views == 1
    assert objectives.create("core").input_views == 1
    with pytest.raises(ValueError, match="key_view must be 'second' or 'same'"):
        objectives.create("bi_tuning", key_view="other")
