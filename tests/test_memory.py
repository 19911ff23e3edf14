"""coretune.memory.FeatureMemory: FIFO order, wrap-around, writes larger than the memory, state in state_dict."""

from __future__ import annotations

import pytest
import torch

from coretune.memory import FeatureMemory


def rows(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose features and labels are their running number: row r is ``[r, r]`` with label ``r``."""
    r = torch.arange(start, start + n)
    return r[:, None].float().repeat(1, 2), r


def test_fills_in_order_then_wraps_around_overwriting_the_oldest() -> None:
    memory = FeatureMemory(5, 2)
    assert len(memory) == 0 and memory.rows()[0].shape == (0, 2)
    memory.push(*rows(0, 3))
    assert len(memory) == 3 and memory.rows()[1].tolist() == [0, 1, 2] and int(memory.ptr) == 3
    memory.push(*rows(3, 4))  # slots 3, 4, then 0, 1: rows 0 and 1 are the oldest and go
    features, labels = memory.rows()
    assert len(memory) == 5 and int(memory.ptr) == 2
    assert labels.tolist() == [5, 6, 2, 3, 4]
    assert torch.equal(features, labels[:, None].float().repeat(1, 2))
    memory.push(*rows(7, 1))
    assert memory.rows()[1].tolist() == [5, 6, 7, 3, 4] and int(memory.ptr) == 3


def test_a_write_larger_than_the_memory_keeps_its_last_rows() -> None:
    memory = FeatureMemory(4, 2)
    memory.push(*rows(0, 1))
    memory.push(*rows(1, 10))  # rows 1..10 from slot 1: only 7..10 survive, row r in slot r % 4
    assert memory.rows()[1].tolist() == [8, 9, 10, 7]
    assert int(memory.ptr) == 3 and len(memory) == 4


def test_rows_are_detached_views_and_writes_cast_to_the_memory_dtype() -> None:
    memory = FeatureMemory(3, 2)
    z = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    memory.push(z, torch.tensor([1, 0]))
    features, labels = memory.rows()
    assert features.dtype == torch.float32 and not features.requires_grad and labels.dtype == torch.long
    assert torch.equal(features, z.detach().float())
    memory.push(torch.ones(2, 2), torch.tensor([1, 1]))  # overwrites the views' slot 2, then slot 0
    assert features.tolist() == [[1.0, 1.0], z[1].float().tolist()]


def test_the_state_is_in_the_state_dict() -> None:
    memory = FeatureMemory(4, 3)
    memory.push(torch.randn(6, 3), torch.arange(6))
    memory.steps += 2
    restored = FeatureMemory(4, 3)
    restored.load_state_dict(memory.state_dict())
    assert set(memory.state_dict()) == {"features", "labels", "ptr", "filled", "steps"}
    for name, value in memory.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"needs size >= 1 and dim >= 1, got 0 and 3"):
        FeatureMemory(0, 3)
