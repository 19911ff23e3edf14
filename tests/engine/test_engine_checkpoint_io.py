"""Checkpoint writes are atomic: a failed write leaves the previous checkpoint intact."""

from pathlib import Path

import pytest
import torch

from coretune.engine import atomic_torch_save


def test_atomic_save_writes_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"x": torch.ones(2)}, path)
    atomic_torch_save({"x": torch.zeros(2)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_failed_write_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"x": torch.ones(2)}, path)

    def disk_full(obj: object, f: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        atomic_torch_save({"x": torch.zeros(2)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind
