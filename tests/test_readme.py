"""The README's "In Python" examples run as written: the training loop (a real timm backbone, random batches standing
for a user's DataLoader), then the pieces on their own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F

import coretune as ct

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    text = README.read_text()
    (section,) = re.findall(r"## In Python\n(.*?)\n## ", text, flags=re.S)
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_training_loop_is_eight_lines() -> None:
    loop, _ = _python_blocks()
    assert len(loop.strip().splitlines()) == 8
    assert "CoreTuning(num_classes=10" in loop and "timm.create_model" in loop


def test_the_readme_python_examples_run() -> None:
    loop, pieces = _python_blocks()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    loader = [(torch.rand(8, 3, 32, 32, generator=generator), torch.arange(8) % 4) for _ in range(2)]
    namespace: dict[str, object] = {"loader": loader}
    exec(compile(loop, str(README), "exec"), namespace)
    encoder, objective = namespace["encoder"], namespace["objective"]
    assert isinstance(objective, ct.objectives.CoreTuning) and objective.classifier.weight.shape == (10, 512)
    optimised = {id(p) for group in namespace["opt"].param_groups for p in group["params"]}  # type: ignore[attr-defined]
    assert {id(p) for p in objective.parameters()} <= optimised  # the heads, projector included, are trained
    assert all(p.grad is not None for p in objective.projector.parameters())
    assert torch.isfinite(namespace["loss"]) and namespace["loss"].ndim == 0  # type: ignore[attr-defined]
    torch.manual_seed(0)
    untrained = timm.create_model("resnet18", num_classes=0)  # the loop's encoder before its two steps
    assert not torch.equal(encoder.conv1.weight, untrained.conv1.weight)  # type: ignore[attr-defined]

    exec(compile(pieces, str(README), "exec"), namespace)
    assert namespace["logits"].shape == (8, 10)  # type: ignore[attr-defined]
    z, labels, v = namespace["z"], namespace["labels"], namespace["v"]
    assert v.shape == (24, 512)  # type: ignore[attr-defined]
    projected = F.normalize(objective.projector(v), dim=1)  # type: ignore[arg-type]
    want = ct.contrastive_loss(projected, ct.core_positive_mask(labels), 0.07, focal=True)  # type: ignore[arg-type]
    torch.testing.assert_close(namespace["loss"], want)
    assert z.requires_grad  # type: ignore[attr-defined]


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 120
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first is not None and [line.split()[:2] for line in first.group(1).splitlines()] == [
        ["make", "demo"], ["make", "test"],
    ]  # fmt: skip


def _readme_commands() -> list[list[str]]:
    """Each ``coretune …`` command of the README's shell blocks (continuation lines joined, comments dropped)."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.partition(" #")[0].split()
            if words[:1] == ["coretune"]:
                commands.append(words[1:])
    return commands


def test_every_option_the_readme_shows_is_one_its_command_takes(capsys) -> None:
    """The quickstart's commands name real commands and options (``--help`` lists each; fit's aliases too)."""
    from coretune.cli import COMMANDS, main

    helps: dict[str, str] = {}
    commands = _readme_commands()
    assert len(commands) >= 6
    for words in commands:
        command = words[0]
        assert command in COMMANDS, command
        if command not in helps:
            with pytest.raises(SystemExit):
                main([command, "--help"])
            helps[command] = capsys.readouterr().out
        for option in (w.partition("=")[0] for w in words[1:] if w.startswith("--")):
            assert option in helps[command], f"coretune {command} {option}"
