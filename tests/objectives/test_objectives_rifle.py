"""RIFLE (Li et al., 2020): the classifier is re-initialised exactly at the scheduled epochs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coretune import objectives


@pytest.mark.parametrize(
    ("times", "fraction", "epochs", "expected"),
    [
        (3, 1.0, 40, [10, 20, 30]),  # the authors' train.py: every T/(n+1) epochs
        (3, 0.5, 40, [5, 10, 15]),
        (1, 1.0, 9, [4]),
        (3, 1.0, 3, [1, 2]),  # floor(k·3/4) = 0, 1, 2: epoch 0 is dropped
        (0, 1.0, 40, []),
    ],
)
def test_schedule(times: int, fraction: float, epochs: int, expected: list[int]) -> None:
    assert objectives.create("rifle", reinit_times=times, reinit_fraction=fraction).schedule(epochs) == expected


def test_reinitialises_exactly_at_scheduled_epochs() -> None:
    torch.manual_seed(0)
    obj = objectives.create("rifle", 8, 3, reinit_times=3)
    changed = []
    for epoch in range(12):
        before = [p.detach().clone() for p in obj.classifier.parameters()]
        obj.on_train_epoch_start(epoch, 12)
        after = list(obj.classifier.parameters())
        if any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)):
            changed.append(epoch)
    assert changed == obj.reinitialized_at == [3, 6, 9]


def test_optimizer_state_of_the_classifier_is_reset() -> None:
    torch.manual_seed(0)
    obj = objectives.create("rifle", 8, 3, reinit_times=1)
    encoder = torch.nn.Linear(5, 8)
    optimizer = torch.optim.SGD([*encoder.parameters(), *obj.parameters()], lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 5), torch.arange(6) % 3
    out = obj(encoder(x), y)
    out.loss.backward()
    optimizer.step()
    assert not obj.needs_optimizer_reset
    obj.on_train_epoch_start(1, 2)
    assert obj.needs_optimizer_reset and obj.reinitialized_at == [1]
    obj.reset_optimizer_state(optimizer)
    assert not obj.needs_optimizer_reset
    assert all(p not in optimizer.state for p in obj.classifier.parameters())
    assert all("momentum_buffer" in optimizer.state[p] for p in encoder.parameters())


def test_loss_is_cross_entropy_and_errors() -> None:
    obj = objectives.create("rifle", 4, 2)
    z, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
    out = obj(z, y)
    torch.testing.assert_close(out.loss, F.cross_entropy(obj.classifier(z), y))
    assert set(out.terms) == {"ce", "loss"}
    with pytest.raises(ValueError, match=r"reinit_times must be >= 0 \(got -1\); reinit_fraction must lie in \(0, 1\]"):
        objectives.create("rifle", reinit_times=-1, reinit_fraction=0.0)
