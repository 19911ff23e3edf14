"""A backbone's blocks by name, for surgical fine-tuning (Lee et al., ICLR 2023: train one block, freeze the rest).

The blocks of an :class:`~coretune.models.Encoder` are its stages (``Encoder.stage_names``: ResNet ``layer1`` …
``layer4``; a timm ViT's ``blocks.0`` … ``blocks.{depth-1}``), with ``stem`` for what comes before the first stage
(the paper's "input-level" layers: a ResNet's ``conv1``/``bn1``; a ViT's patch embedding, class token and position
embedding) and ``final`` for what comes after the last (a ViT's last ``norm``). A parameter between two stages
belongs to the stage before it. A selection (``--model.optim.train_blocks``) names blocks separated by commas, and a
range of numbered ones with ``-``: ``layer1-2`` is ``layer1,layer2``; ``blocks.0-3`` is ``blocks.0`` … ``blocks.3``.
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["FINAL", "STEM", "backbone_blocks", "parse_blocks", "selected_parameters"]

STEM = "stem"
"""The block of the parameters before a backbone's first stage (the input-level layers)."""
FINAL = "final"
"""The block of the parameters after a backbone's last stage (a ViT's last norm)."""

_RANGE = re.compile(r"^(.*?)(\d+)-(\d+)$")
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def backbone_blocks(backbone: nn.Module) -> dict[str, list[str]]:
    """The blocks of ``backbone`` in order, each with the qualified names of its parameters (those of
    ``backbone.named_parameters()``); blocks without parameters (a ResNet without stem params: ``small_cnn``) are
    left out.

    Raises:
        ValueError: the backbone names no stages (``stage_names``).
    """
    stages = tuple(getattr(backbone, "stage_names", ()) or ())
    if not stages:
        raise ValueError(f"backbone {type(backbone).__name__} names no stages (stage_names): it has no blocks")
    prefix = "body." if hasattr(backbone, "body") else ""
    blocks: dict[str, list[str]] = {STEM: []}
    blocks.update({stage: [] for stage in stages})
    blocks[FINAL] = []
    current = STEM
    for name, _ in backbone.named_parameters():
        inner = name.removeprefix(prefix)
        stage = next((s for s in stages if inner.startswith(s + ".")), None)
        if stage is not None:
            current = stage
        elif current == stages[-1] or current == FINAL:
            current = FINAL  # after the last stage
        blocks[current].append(name)
    return {block: names for block, names in blocks.items() if names}


def parse_blocks(selection: str) -> list[str]:
    """The block names of a selection: comma-separated names, ``<prefix><i>-<j>`` for ``<prefix><i>`` …
    ``<prefix><j>`` (``blocks.0-3``, ``layer1-2``).

    Raises:
        ValueError: an empty selection or a reversed range.
    """
    names: list[str] = []
    for part in (p.strip() for p in selection.split(",")):
        if not part:
            raise ValueError(f"train_blocks {selection!r} has an empty block name (blocks are separated by commas)")
        match = _RANGE.match(part)
        if match is None:
            names.append(part)
            continue
        prefix, first, last = match.group(1), int(match.group(2)), int(match.group(3))
        if last < first:
            raise ValueError(f"train_blocks range {part!r} runs backwards: write {prefix}{last}-{first}")
        names += [f"{prefix}{i}" for i in range(first, last + 1)]
    return names


def selected_parameters(backbone: nn.Module, selection: str) -> set[str]:
    """The qualified names of the parameters of the blocks a selection names (:func:`parse_blocks`).

    Raises:
        ValueError: a name that is no block of the backbone (one line listing the valid ones).
    """
    blocks = backbone_blocks(backbone)
    wanted = parse_blocks(selection)
    unknown = [name for name in wanted if name not in blocks]
    if unknown:
        name = getattr(backbone, "name", type(backbone).__name__)
        raise ValueError(
            f"train_blocks names {', '.join(map(repr, unknown))}, not a block of backbone {name}: choose among "
            f"{', '.join(blocks)} (comma-separated; a range such as {_range_example(list(blocks))})"
        )
    return {param for block in wanted for param in blocks[block]}


def _range_example(blocks: list[str]) -> str:
    """A range of the backbone's own numbered blocks, for the error message (``layer1-2``, ``blocks.0-1``)."""
    numbered = [m for m in map(_NUMBERED.match, blocks) if m is not None]
    if len(numbered) < 2:
        return "layer1-2"
    return f"{numbered[0].group(1)}{numbered[0].group(2)}-{numbered[1].group(2)}"
