"""Backbone plumbing shared by the objectives that look past the features (L2-SP, DELTA, Bi-tuning).

Frozen and momentum copies of the backbone are kept *out of* the objective's module registration (inside a
plain Python list), so they never reach ``objective.parameters()`` (the optimiser, DDP) or
``objective.to(device)``; :func:`move_to` places them lazily on the device of the data. Frozen copies of the
pre-trained backbone are rebuilt from it; Bi-tuning's momentum copies, which change, go into checkpoints as
the objective's extra state.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["capture_outputs", "frozen_copy", "l2_penalty", "mirror_modes", "move_to", "stage_names"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def stage_names(backbone: nn.Module) -> list[str]:
    """Qualified names (in ``backbone``) of its intermediate stages.

    The stages are ``backbone.stages()`` when the backbone has that method (:class:`coretune.models.Encoder`:
    ResNet ``layer1``..``layer4``), else its direct children that are ``nn.Sequential`` (a bare torchvision
    ResNet's ``layer1``..``layer4``).
    """
    stages_fn = getattr(backbone, "stages", None)
    if callable(stages_fn):
        stages = list(stages_fn())
    else:
        stages = [m for m in backbone.children() if isinstance(m, nn.Sequential)]
    if not stages:
        raise ValueError(
            f"cannot find the stages of backbone {type(backbone).__name__}: give it a stages() method "
            "returning its intermediate stage modules (coretune.models.Encoder has one), or nn.Sequential "
            "children"
        )
    names = {id(module): name for name, module in backbone.named_modules()}
    missing = [type(s).__name__ for s in stages if id(s) not in names]
    if missing:
        raise ValueError(f"backbone.stages() returned modules that are not submodules of the backbone: {missing}")
    return [names[id(s)] for s in stages]


def frozen_copy(backbone: nn.Module) -> nn.Module:
    """A deep copy with ``requires_grad=False`` whose BatchNorm layers never update their running statistics.

    In training mode the copy's BatchNorm layers normalise with batch statistics (like the trainable backbone,
    so a copy and an unchanged original give identical outputs) without touching their running estimates; in
    evaluation mode they use the running estimates copied from the original.
    """
    frozen = copy.deepcopy(backbone).requires_grad_(False)
    for module in frozen.modules():
        if isinstance(module, _BATCH_NORMS):
            module.track_running_stats = False
    return frozen


def mirror_modes(source: nn.Module, target: nn.Module) -> None:
    """Give each submodule of ``target`` the train/eval mode of its counterpart in ``source``."""
    for src, dst in zip(source.modules(), target.modules(), strict=True):
        dst.training = src.training


def move_to(module: nn.Module, device: torch.device) -> nn.Module:
    """Move ``module`` to ``device`` if its first parameter or buffer lives elsewhere (no-op otherwise)."""
    first = next(iter(module.parameters()), None)
    if first is None:
        first = next(iter(module.buffers()), None)
    if first is not None and first.device != device:
        module.to(device)
    return module


class _Capture:
    """Forward hook storing the output of ``target`` in ``sink[index]`` (a class: backbones stay picklable).

    Deep copies and pickles of a hooked network carry an inert hook (no target, an empty sink): they neither
    copy the captured activations nor write into the original ``sink``.
    """

    def __init__(self, target: nn.Module | None, sink: list[Tensor | None], index: int) -> None:
        self.target, self.sink, self.index = target, sink, index

    def __reduce__(self) -> tuple[type[_Capture], tuple[None, list[Tensor | None], int]]:
        return _Capture, (None, [None], 0)

    def __call__(self, module: nn.Module, args: object, output: Tensor) -> None:
        if module is self.target:
            self.sink[self.index] = output


def capture_outputs(modules: Iterable[nn.Module], sink: list[Tensor | None]) -> list[RemovableHandle]:
    """Hook the ``i``-th module so that its output is stored in ``sink[i]``; returns the hook handles."""
    return [module.register_forward_hook(_Capture(module, sink, i)) for i, module in enumerate(modules)]


def l2_penalty(parameters: Iterable[Tensor]) -> Tensor:
    """``½ Σ ‖w‖²`` over ``parameters`` in float32 (the ``β`` term of L2-SP and DELTA on the new heads)."""
    return 0.5 * torch.stack([p.float().pow(2).sum() for p in parameters]).sum()
