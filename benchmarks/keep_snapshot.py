"""Keep a pre-trained encoder in git: its backbone tensors in half precision, nothing else (issue 65).

This project's machine is replaced between sessions and ``runs/`` goes with it (docs/records/README.md), so a
checkpoint that later sessions fine-tune has to travel in the repository. A ``coretune pretrain`` snapshot of a
ResNet-18 is ~46 MB (the projection head included); this copy is ~22 MB:

    .venv/bin/python benchmarks/keep_snapshot.py runs/pretrain/RUN/pretrained-epochE.pth.tar \\
        docs/records/cifar10-cpu-strength-pretrain/RUN/pretrained-epochE.fp16.pth.tar --backbone resnet18

The snapshot is loaded into ``--backbone`` as ``coretune fit --model.weights`` would load it (any layout the
loader knows; every backbone tensor must load), and the body's state is written in the ``backbone`` layout
(``state_dict`` with ``backbone.`` + the body's keys): floating-point tensors as float16, integer ones (BatchNorm's
``num_batches_tracked``) as they are. The snapshot's ``epoch``, ``steps``, ``arch``, ``method`` and
``normalization`` are copied; ``kept_from`` names the source file, its SHA-256 and the dtype. Heads, projectors and
momentum copies are left out: fine-tuning drops them anyway.

Rounding to float16 changes a weight by at most 2**-11 of its value (0.05%); a bf16-mixed fit computes with bf16
copies of the weights, whose rounding is 8 times coarser. A finite value beyond float16's range (65,504) stops the
command, nothing written. The kept file is the checkpoint: score it (``coretune eval knn``) and fine-tune it, and
record its SHA-256 (printed here; a fit's ``results.json`` names it as ``weights_sha256``), not the snapshot's.

DEST must not exist (no file is replaced) and its folder must be writable; the write is atomic (a disk that fills
mid-write leaves nothing and says so in one line). The command checks its own output: DEST is read back into a fresh
backbone and must equal the snapshot's tensors rounded to float16.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from coretune.engine.checkpoint_io import atomic_torch_save
from coretune.models import CheckpointError, create_backbone, load_checkpoint_file, load_pretrained, weights_digest

FLOAT16_MAX = float(torch.finfo(torch.float16).max)
METADATA = ("epoch", "steps", "arch", "method", "normalization")


class KeepError(ValueError):
    """A snapshot this command cannot keep: one line naming the problem and the fix."""


def check_paths(snapshot: Path, dest: Path) -> None:
    """Refuse a missing snapshot, an existing destination and a destination outside an existing, writable folder."""
    if not snapshot.is_file():
        raise KeepError(f"snapshot {snapshot} not found: give the pre-training's pretrained-epochE.pth.tar")
    if dest.exists():
        raise KeepError(f"{dest} exists: this command writes new files only; choose another name or remove it")
    if not dest.parent.is_dir():
        raise KeepError(f"folder {dest.parent} does not exist: create it first")
    if not os.access(dest.parent, os.W_OK | os.X_OK):
        raise KeepError(f"folder {dest.parent} is not writable: choose a folder you can write to")


def check_range(state: dict[str, torch.Tensor]) -> None:
    """Refuse a finite value that float16 cannot hold (it would become infinite)."""
    for key, value in state.items():
        if value.is_floating_point() and value.numel():
            peak = float(value.detach().abs().max())
            if peak > FLOAT16_MAX:
                raise KeepError(
                    f"{key} holds {peak:.4g}, beyond float16's range ({FLOAT16_MAX:g}): this snapshot cannot be kept "
                    "in half precision"
                )


def half_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The body's state in the ``backbone`` layout: floating-point tensors as float16, the others as they are."""
    return {
        "backbone." + key: (value.to(torch.float16) if value.is_floating_point() else value).detach().clone()
        for key, value in state.items()
    }


def rounding_summary(state: dict[str, torch.Tensor]) -> tuple[float, int]:
    """The largest relative change float16 makes to a non-zero value, and how many non-zero values become zero."""
    worst, flushed = 0.0, 0
    for value in state.values():
        if not value.is_floating_point():
            continue
        full = value.detach().double()
        rounded = value.detach().to(torch.float16).double()
        nonzero = full != 0
        flushed += int((nonzero & (rounded == 0)).sum())
        kept = nonzero & (rounded != 0)
        if kept.any():
            worst = max(worst, float(((rounded - full).abs()[kept] / full.abs()[kept]).max()))
    return worst, flushed


def keep(snapshot: Path, dest: Path, backbone: str) -> dict[str, object]:
    """Write ``dest`` from ``snapshot`` (see the module's docstring) and return what was kept."""
    check_paths(snapshot, dest)
    encoder = create_backbone(backbone, verbose=False)
    report = load_pretrained(encoder, snapshot)
    if report.missing:
        raise KeepError(
            f"{snapshot} lacks {len(report.missing)} tensors of {backbone} (e.g. {report.missing[0]}): "
            "is --backbone the network it pre-trained?"
        )
    state = encoder.body.state_dict()
    check_range(state)
    raw = load_checkpoint_file(snapshot)
    kept = {key: raw[key] for key in METADATA if isinstance(raw, dict) and key in raw}
    source_sha256 = weights_digest(snapshot)
    kept["kept_from"] = {"file": snapshot.name, "sha256": source_sha256, "dtype": "float16"}
    kept["state_dict"] = half_state(state)
    atomic_torch_save(kept, dest)
    try:
        check_written(dest, state, backbone)
    except BaseException:
        dest.unlink()  # this command's own file, which did not read back as written
        raise
    worst, flushed = rounding_summary(state)
    return {
        "tensors": len(state),
        "bytes": dest.stat().st_size,
        "source_bytes": snapshot.stat().st_size,
        "sha256": weights_digest(dest),
        "source_sha256": source_sha256,
        "layout": report.layout,
        "max_relative_change": worst,
        "flushed_to_zero": flushed,
    }


def check_written(dest: Path, state: dict[str, torch.Tensor], backbone: str) -> None:
    """Read ``dest`` back as a fit would and compare every tensor with the snapshot's, rounded to float16."""
    encoder = create_backbone(backbone, verbose=False)
    report = load_pretrained(encoder, dest)
    if report.layout != "backbone" or report.missing or report.unexpected:
        raise RuntimeError(f"{dest} does not read back as a whole backbone: {report.summary()}")
    for key, value in encoder.body.state_dict().items():
        expected = state[key].to(torch.float16).to(value.dtype) if state[key].is_floating_point() else state[key]
        if not torch.equal(value, expected):
            raise RuntimeError(f"{dest}: {key} does not read back as the snapshot's tensor rounded to float16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "snapshot", type=Path, help="a pre-trained encoder (coretune pretrain's pretrained-epochE.pth.tar)"
    )
    parser.add_argument("dest", type=Path, help="the new file (must not exist)")
    parser.add_argument("--backbone", default="resnet18", help="the network it pre-trained (default resnet18)")
    args = parser.parse_args(argv)
    try:
        kept = keep(args.snapshot, args.dest, args.backbone)
    except (KeepError, CheckpointError, OSError) as err:  # OSError: a disk that fills or fails mid-write
        print(f"keep_snapshot: {err}", file=sys.stderr)
        return 2
    print(
        f"kept {kept['tensors']} backbone tensors of {args.snapshot} (layout '{kept['layout']}', "
        f"{kept['source_bytes'] / 1e6:.1f} MB) in {args.dest} ({kept['bytes'] / 1e6:.1f} MB, float16): largest "
        f"relative change {kept['max_relative_change']:.2e}, {kept['flushed_to_zero']} non-zero values to zero\n"
        f"sha256 {kept['sha256']} (source {kept['source_sha256']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
