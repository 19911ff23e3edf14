"""DELTA (Li et al., 2019): attention-weighted stage feature-map distance, against explicit loops."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coretune import objectives

Factory = Callable[..., nn.Module]


def _batch(n: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.arange(n) % 3


def _attached(backbone: nn.Module, **hparams: float) -> objectives.DELTA:
    obj = objectives.create("delta", 16, 3, **hparams)
    obj.attach_backbone(backbone)
    return obj


def _perturb(backbone: nn.Module, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backbone.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def _reference_penalty(trained: nn.Module, start: nn.Module, x: torch.Tensor, attention: list) -> torch.Tensor:
    """Ω_FM = Σ_j Σ_b ½ Σ_c C_j a_jc ‖FM_jc(w, x_b) − FM_jc(w⁰, x_b)‖² / (H_j W_j), one scalar at a time."""
    total = torch.zeros(())
    fm, fm0 = x, x
    for j in range(2):
        fm, fm0 = trained[j](fm), start[j](fm0)
        b, c, h, w = fm.shape
        for i in range(b):
            for k in range(c):
                distance = (fm[i, k] - fm0[i, k]).pow(2).sum()
                total = total + 0.5 * c * attention[j][k] * distance / (h * w)
    return total


def test_penalty_is_zero_before_the_first_update_in_eval_mode(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone().eval()
    obj = _attached(backbone)
    for seed in (1, 2):  # the frozen copy keeps matching while the backbone is unchanged
        x, y = _batch(seed=seed)
        out = obj(backbone(x), y, inputs=x)
        assert out.terms["delta"].item() == 0.0
    assert set(out.terms) == {"ce", "delta", "l2_new", "loss"}


def test_reference_uses_the_pretrained_running_statistics_in_training(tiny_backbone: Factory) -> None:
    """As the authors' ``model_source.eval()`` and tllib: the frozen copy normalises with the pre-trained running
    statistics while the trainable backbone uses batch statistics, so the penalty is > 0 from the first step."""
    backbone = tiny_backbone()
    with torch.no_grad():  # running statistics unlike any one batch's
        backbone(2 * torch.randn(32, 3, 8, 8) + 1)
    start = copy.deepcopy(backbone).eval()
    obj = _attached(backbone)
    x, y = _batch()
    out = obj(backbone(x), y, inputs=x)
    uniform = [torch.full((4,), 0.25), torch.full((16,), 1 / 16)]
    expected = _reference_penalty(copy.deepcopy(backbone), start, x, uniform)
    assert expected > 0
    torch.testing.assert_close(out.terms["delta"], expected.detach())


def test_loss_equals_explicit_loop_over_stages_and_channels(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    start = copy.deepcopy(backbone).eval()
    obj = _attached(backbone, alpha=0.5, beta=0.2)
    attention = [torch.softmax(torch.randn(4), 0), torch.softmax(torch.randn(16), 0)]
    obj.set_channel_attention(attention)
    _perturb(backbone)

    x, y = _batch()
    features = backbone(x)
    out = obj(features, y, inputs=x)
    omega = _reference_penalty(backbone, start, x, attention)
    new = 0.5 * (obj.classifier.weight.pow(2).sum() + obj.classifier.bias.pow(2).sum())
    ce = F.cross_entropy(obj.classifier(features), y)
    assert omega > 0
    torch.testing.assert_close(out.terms["delta"], omega.detach())
    torch.testing.assert_close(out.terms["l2_new"], new.detach())
    torch.testing.assert_close(out.loss, ce + 0.5 * omega + 0.2 * new)
    out.loss.backward()
    assert all(p.grad is not None for p in backbone.parameters())


def test_uniform_attention_until_computed(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    start = copy.deepcopy(backbone).eval()
    obj = _attached(backbone)
    _perturb(backbone)
    x, y = _batch()
    out = obj(backbone(x), y, inputs=x)
    uniform = [torch.full((4,), 0.25), torch.full((16,), 1 / 16)]
    torch.testing.assert_close(out.terms["delta"], _reference_penalty(backbone, start, x, uniform).detach())
    assert not obj.attention_ready


def test_frozen_reference_never_changes_and_is_not_trainable(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = _attached(backbone)
    reference = obj.reference_backbone
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    optimizer = torch.optim.SGD([*backbone.parameters(), *obj.parameters()], lr=0.5)
    for seed in range(3):
        x, y = _batch(seed=seed)
        out = obj(backbone(x), y, inputs=x)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert out.terms["delta"].item() > 0  # the trainable backbone moved away
    after = reference.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # incl. BatchNorm running statistics
    assert backbone.training and not any(m.training for m in reference.modules())  # eval mode throughout
    assert all(not p.requires_grad for p in reference.parameters())
    assert {id(p) for p in obj.parameters()} == {id(p) for p in obj.classifier.parameters()}
    assert set(obj.state_dict()) == {
        "attention_ready",
        "attention_0",
        "attention_1",
        *(f"classifier.{n}" for n in ("weight", "bias")),
    }


def test_channel_attention_equals_explicit_ablation_loop(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    backbone.train()
    obj = _attached(backbone)
    torch.manual_seed(3)
    probe = nn.Linear(16, 3)
    batches = [_batch(seed=s) for s in (4, 5)]
    weights = obj.compute_channel_attention(batches, classifier=probe)

    start = copy.deepcopy(backbone).eval()
    expected = []
    with torch.no_grad():
        for j, channels in enumerate((4, 16)):
            increase = torch.zeros(channels, dtype=torch.float64)
            for x, y in batches:
                base = F.cross_entropy(probe(start(x)), y)
                for c in range(channels):
                    h = start[0](x)
                    if j == 0:
                        h[:, c] = 0
                    h = start[1](h)
                    if j == 1:
                        h[:, c] = 0
                    ablated = F.cross_entropy(probe(start[3](start[2](h))), y)
                    increase[c] += float(ablated - base) / len(batches)
            z = (increase - increase.mean()) / increase.std(unbiased=False)
            expected.append(torch.softmax(z / 5.0, 0).float())
    for got, want in zip(weights, expected, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(obj.attention(0, 4, torch.device("cpu")), expected[0])
    assert obj.attention_ready and backbone.training  # modes restored


def test_attention_survives_a_state_dict_round_trip(tiny_backbone: Factory) -> None:
    obj = _attached(tiny_backbone())
    weights = [torch.softmax(torch.randn(4), 0), torch.softmax(torch.randn(16), 0)]
    obj.set_channel_attention(weights)
    fresh = objectives.create("delta", 16, 3)
    fresh.load_state_dict(obj.state_dict())
    fresh.attach_backbone(tiny_backbone())
    assert fresh.attention_ready
    torch.testing.assert_close(fresh.attention(1, 16, torch.device("cpu")), weights[1])


def test_stages_fall_back_to_sequential_children() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(  # no stages() method
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU()),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    obj = _attached(backbone)
    x, y = _batch()
    out = obj(backbone(x), y, inputs=x)
    assert out.terms["delta"].item() == 0.0
    assert len(obj.state_dict()) == 5  # classifier (2) + attention_ready + one attention per stage


def test_errors(tiny_backbone: Factory) -> None:
    with pytest.raises(ValueError, match=r"invalid DELTA settings: beta must be >= 0 \(got -1\); attention_temp"):
        objectives.create("delta", beta=-1, attention_temperature=0)
    with pytest.raises(ValueError, match=r"cannot find the stages of backbone Linear: give it a stages\(\) method"):
        objectives.create("delta", 4, 2).attach_backbone(nn.Linear(3, 4))
    backbone = tiny_backbone()
    obj = _attached(backbone)
    x, y = _batch()
    with pytest.raises(ValueError, match=r"delta needs the batch's images: call objective\(features, labels, inp"):
        obj(backbone(x), y)
    with pytest.raises(RuntimeError, match="delta found no stage outputs of this batch"):
        _attached(backbone)(torch.randn(6, 16), y, inputs=x)  # no backbone forward since attaching
    with pytest.raises(ValueError, match="expected channel weights for 2 stages, got 1"):
        obj.set_channel_attention([torch.ones(4)])
    with pytest.raises(RuntimeError, match="delta needs the pre-trained backbone"):
        objectives.create("delta", 16, 3).compute_channel_attention([_batch()])


def test_hooked_backbone_stays_picklable_and_copyable(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = _attached(backbone)
    x, y = _batch()
    backbone(x)  # the hooks now hold non-leaf activations, which must not be copied
    clone = pickle.loads(pickle.dumps(backbone))
    copied = copy.deepcopy(backbone)
    obj(torch.randn(6, 16), y, inputs=x)  # consumes the captured activations
    for other in (clone, copied):
        other(x)  # their (copied) hooks must not feed the objective
    with pytest.raises(RuntimeError, match="delta found no stage outputs of this batch"):
        obj(torch.randn(6, 16), y, inputs=x)


def test_prepare_fits_a_probe_and_computes_the_attention_once(tiny_backbone: Factory) -> None:
    backbone = tiny_backbone()
    obj = _attached(backbone, attention_batches=2, probe_batches=3)
    batches = [_batch(seed=s) for s in range(5)]
    seen: list[int] = []

    def lazy() -> object:
        for i, b in enumerate(batches):
            seen.append(i)
            yield b

    obj.prepare(lazy())
    assert seen == [0, 1, 2]  # only max(attention_batches, probe_batches) batches are read
    assert obj.attention_ready
    weights = [obj.attention(j, c, torch.device("cpu")) for j, c in enumerate((4, 16))]
    for w in weights:
        torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    assert any(not torch.allclose(w, torch.full_like(w, 1 / w.numel())) for w in weights)
    before = [w.clone() for w in weights]
    obj.prepare(iter(batches))  # already computed: unchanged
    for j, c in enumerate((4, 16)):
        torch.testing.assert_close(obj.attention(j, c, torch.device("cpu")), before[j])


def test_prepare_with_zero_attention_batches_keeps_uniform_weights(tiny_backbone: Factory) -> None:
    obj = _attached(tiny_backbone(), attention_batches=0)
    obj.prepare(iter([_batch()]))
    assert not obj.attention_ready
