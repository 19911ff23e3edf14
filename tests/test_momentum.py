"""The momentum encoder update (:func:`coretune.momentum.momentum_update`) against MoCo's rule written per tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from coretune.momentum import momentum_update


@settings(max_examples=20, deadline=None)
@given(m=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_the_update_is_mocos_rule_on_every_parameter_and_leaves_buffers(m: float, seed: int) -> None:
    torch.manual_seed(seed)
    online = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    target = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    target[1].running_mean.fill_(5.0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    momentum_update(online, target, m)
    queries = dict(online.named_parameters())
    for name, value in target.named_parameters():
        expected = m * before[name] + (1 - m) * queries[name].detach()
        torch.testing.assert_close(value, expected)
        assert not value.requires_grad or value.grad is None
    assert torch.equal(target[1].running_mean, before["1.running_mean"])  # buffers are not averaged


def test_modules_of_different_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        momentum_update(nn.Linear(3, 4), nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4)), 0.9)
