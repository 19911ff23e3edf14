"""Load the shared SimCLR ResNet-18 checkpoint into ``resnet18`` and check that every backbone tensor loaded.

Run: ``python benchmarks/check_shared_checkpoint.py [path]``; exits 0 with a skip message if the file is
absent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from coretune.models import create_backbone, load_checkpoint_file, load_pretrained

DEFAULT = Path("/work/shared/checkpoints/simclr_resnet18_in20_64px.pth.tar")


def main(path: Path = DEFAULT) -> int:
    if not path.is_file():
        print(f"SKIP: {path} not found (the shared checkpoint is only on the project machines)")
        return 0
    encoder = create_backbone("resnet18", verbose=False)
    report = load_pretrained(encoder, path)
    print(report.summary())
    expected = len(encoder.body.state_dict())  # resnet18 without fc: 60 parameters + 60 BN buffers
    assert report.layout == "backbone", report.layout
    assert len(report.loaded) == expected and not report.missing and not report.unexpected, report.summary()
    saved = load_checkpoint_file(path)["state_dict"]
    for key, value in encoder.body.state_dict().items():
        assert torch.equal(value, saved["backbone." + key]), key
    encoder.eval()
    with torch.no_grad():
        features = encoder(torch.randn(4, 3, 64, 64))
    shape = tuple(features.shape)
    print(f"OK: all {expected} backbone tensors (incl. BN buffers) equal the file; features {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
