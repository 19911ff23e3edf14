"""The README's "In Python" example runs as written, given an encoder and a batch (a user's training loop)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_python_example_runs() -> None:
    text = README.read_text()
    (block,) = re.findall(r"## In Python\n\n```python\n(.*?)```", text, flags=re.S)
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2048))
    namespace = {
        "encoder": encoder,
        "images": torch.rand(12, 3, 8, 8),
        "labels": torch.arange(12) % 3,
        "test_images": torch.rand(5, 3, 8, 8),
        "device": "cpu",
    }
    before = encoder[1].weight.detach().clone()
    exec(compile(block, str(README), "exec"), namespace)
    assert namespace["logits"].shape == (5, 10)
    assert not torch.equal(encoder[1].weight, before)  # the optimiser stepped the encoder
    assert torch.isfinite(namespace["loss"]) and namespace["loss"].ndim == 0
