"""benchmarks/keep_snapshot.py (issue 65): a pre-training snapshot kept in half precision loads into the backbone as
the snapshot's tensors rounded to float16 (integers as they are), keeps its metadata and names its source; it is
about half the size; a missing snapshot, an existing destination, a value float16 cannot hold and a snapshot of
another network are refused in one line, nothing written."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmark_scripts import load_benchmark
from coretune.models import create_backbone, load_checkpoint_file, load_pretrained

NORMALIZATION = {"mean": [0.4914, 0.4822, 0.4465], "std": [0.247, 0.2435, 0.2616]}


@pytest.fixture
def keep_snapshot(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("keep_snapshot", monkeypatch)


def _snapshot(path: Path, backbone: str = "resnet18", **overrides: float) -> dict[str, torch.Tensor]:
    """A file as `coretune pretrain`'s SimCLR writes it (the ``backbone``/``projector`` layout), with random
    weights and BatchNorm statistics (and ``overrides``: key → a value for its first element)."""
    torch.manual_seed(0)
    body = create_backbone(backbone, verbose=False).body.state_dict()
    state = {}
    for key, value in body.items():
        if value.is_floating_point():
            value = torch.randn_like(value) * 0.1 + (1.0 if key.endswith("running_var") else 0.0)
            value = value.abs() if key.endswith("running_var") else value
        else:
            value = torch.full_like(value, 123)
        state[key] = value
    for key, first in overrides.items():
        state[key].view(-1)[0] = first
    saved = {f"backbone.{k}": v for k, v in state.items()} | {"projector.0.weight": torch.randn(8, 8)}
    torch.save(
        {"epoch": 40, "arch": backbone, "method": "simclr", "normalization": NORMALIZATION, "state_dict": saved}, path
    )
    return state


def test_the_kept_file_is_the_snapshot_in_half_precision(keep_snapshot: ModuleType, tmp_path: Path, capsys) -> None:
    source, dest = tmp_path / "pretrained-epoch40.pth.tar", tmp_path / "pretrained-epoch40.fp16.pth.tar"
    state = _snapshot(source, **{"layer1.0.bn1.running_mean": 1e-9})  # below float16's smallest subnormal
    assert keep_snapshot.main([str(source), str(dest), "--backbone", "resnet18"]) == 0
    out = capsys.readouterr().out
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    flushed = sum(int(((v != 0) & (v.half() == 0)).sum()) for v in state.values() if v.is_floating_point())
    assert flushed >= 1 and f"sha256 {digest}" in out and f", {flushed} non-zero values to zero" in out
    assert dest.stat().st_size < 0.55 * source.stat().st_size

    raw = load_checkpoint_file(dest)
    assert {k: raw[k] for k in ("epoch", "arch", "method", "normalization")} == {
        "epoch": 40,
        "arch": "resnet18",
        "method": "simclr",
        "normalization": NORMALIZATION,
    }
    assert raw["kept_from"] == {
        "file": source.name,
        "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "dtype": "float16",
    }
    assert set(raw["state_dict"]) == {f"backbone.{k}" for k in state}  # the projector left out

    encoder = create_backbone("resnet18", verbose=False)
    report = load_pretrained(encoder, dest)
    assert report.layout == "backbone" and not report.missing and not report.unexpected
    for key, value in encoder.body.state_dict().items():
        original = state[key]
        if original.is_floating_point():
            assert raw["state_dict"][f"backbone.{key}"].dtype == torch.float16
            assert torch.equal(value, original.half().float()), key
            changed = (value - original).abs()
            assert bool((changed <= original.abs() * 2.0**-11 + 2.0**-25).all()), key  # float16's rounding
        else:
            assert torch.equal(value, original), key  # num_batches_tracked as it was
    assert float(encoder.body.state_dict()["layer1.0.bn1.running_mean"].view(-1)[0]) == 0.0


@pytest.mark.parametrize("problem", ["missing", "exists", "overflow", "other_network", "unwritable", "disk_full"])
def test_refusals_are_one_line_and_write_nothing(
    keep_snapshot: ModuleType, tmp_path: Path, capsys, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, dest = tmp_path / "snapshot.pth.tar", tmp_path / "kept.pth.tar"
    backbone = "small_cnn"
    if problem != "missing":
        _snapshot(source, "small_cnn", **({"layer1.0.weight": 7e4} if problem == "overflow" else {}))
    if problem == "exists":
        dest.write_text("someone's file\n")
    if problem == "other_network":
        backbone = "resnet18"
    if problem == "unwritable":  # a folder without write permission (chmod does not stop root, who runs the tests)
        access = keep_snapshot.os.access
        monkeypatch.setattr(keep_snapshot.os, "access", lambda p, mode: Path(p) != tmp_path and access(p, mode))
    if problem == "disk_full":

        def full(obj: object, path: Path) -> None:
            raise OSError(28, "No space left on device", str(path))

        monkeypatch.setattr(keep_snapshot, "atomic_torch_save", full)
    code = keep_snapshot.main([str(source), str(dest), "--backbone", backbone])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("keep_snapshot: "), err
    expected = {
        "missing": "not found",
        "exists": "writes new files only",
        "overflow": "beyond float16's range",
        "other_network": "resnet18",
        "unwritable": "is not writable",
        "disk_full": "No space left on device",
    }[problem]
    assert expected in err
    if problem == "exists":
        assert dest.read_text() == "someone's file\n"
    else:
        assert not dest.exists()
