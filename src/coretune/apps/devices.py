"""Where and at what precision a command runs a model: ``--trainer.accelerator``, ``--trainer.devices`` and
``--trainer.precision``, as ``coretune fit`` takes them.

``coretune test`` and ``validate`` hand them to a Lightning ``Trainer``. The commands that run a model outside a
Trainer — ``predict``, ``eval knn|linear|robust`` and ``export``'s read-back check — resolve them here
(:func:`placement`): ``auto`` is CUDA when it is available, else the CPU (``gpu``/``cuda`` without CUDA, or more than
one device, is a one-line ``ValueError``); ``32-true`` runs as it is, ``16-mixed`` and ``bf16-mixed`` under
``torch.autocast`` (:meth:`Placement.autocast`, :class:`Autocast`), which Lightning applies in a Trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PRECISIONS", "Autocast", "Placement", "add_trainer_arguments", "placement", "placement_of"]

#: Lightning's spellings of the precisions a command runs outside a Trainer, and the one each stands for.
PRECISIONS: dict[str, str] = {
    "32": "32-true",
    "32-true": "32-true",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
}
_AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def add_trainer_arguments(parser: Any, precision: str = "32-true", what: str = "the model") -> None:
    """Give ``parser`` the ``--trainer.accelerator``, ``--trainer.devices`` and ``--trainer.precision`` options of
    ``coretune fit`` (``precision``: the default; ``what``: what runs there, for the help)."""
    parser.add_argument(
        "--trainer.accelerator",
        type=str,
        default="auto",
        help=f"Where {what} runs: auto (cuda if available, else cpu), cpu, gpu (cuda) or mps.",
    )
    parser.add_argument(
        "--trainer.devices",
        type=int | str | list[int],
        default="auto",
        help="Which device: auto or 1 (the first), [N] (device N); one device.",
    )
    parser.add_argument(
        "--trainer.precision",
        type=int | str,
        default=precision,
        help="32-true, bf16-mixed or 16-mixed (torch.autocast), as coretune fit takes it.",
    )


@dataclass(frozen=True)
class Placement:
    """A device and a precision (:data:`PRECISIONS`' names) to run a model at."""

    device: torch.device
    precision: str = "32-true"

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype (None: float32 as stored)."""
        return _AUTOCAST.get(self.precision)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` on the device at the precision's dtype; nothing at ``32-true``."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` running under :meth:`autocast` (:class:`Autocast`), or ``module`` itself at ``32-true``."""
        return module if self.dtype is None else Autocast(module, self)


class Autocast(nn.Module):
    """``module`` whose forward runs under ``placement``'s autocast and returns float32 (gradients flow through)."""

    def __init__(self, module: nn.Module, placement: Placement) -> None:
        super().__init__()
        self.module, self.placement = module, placement
        self.train(module.training)

    def forward(self, images: Tensor) -> Tensor:
        with self.placement.autocast():
            return self.module(images).float()


def _device_index(devices: Any, command: str) -> int | None:
    """The device index ``--trainer.devices`` picks (None: the first, or the default one)."""
    one = f"coretune {command} runs on one device: pass --trainer.devices 1 (the first) or [N] (device N)"
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "1"):
            return None
        if text.endswith(",") and text[:-1].strip().isdigit():  # Lightning's "N,": device N
            return int(text[:-1])
        if text.startswith("[") and text.endswith("]"):
            devices = [int(d) for d in text[1:-1].split(",") if d.strip()]
        elif text.lstrip("-").isdigit():
            devices = int(text)
        else:
            raise ValueError(f"--trainer.devices {devices}: not a device count or list: pass 1 or [N]")
    if isinstance(devices, list | tuple):
        if len(devices) != 1:
            raise ValueError(f"--trainer.devices {list(devices)}: {one}")
        return int(devices[0])
    if devices == 1:
        return None
    raise ValueError(f"--trainer.devices {devices}: {one}")


def placement(
    accelerator: str = "auto", devices: Any = "auto", precision: Any = "32-true", *, command: str
) -> Placement:
    """The device and precision ``--trainer.accelerator``, ``--trainer.devices`` and ``--trainer.precision`` name,
    for ``coretune <command>``, which runs a model outside a Trainer.

    Raises:
        ValueError: an accelerator that is not on this machine (or unknown), more than one device, or a precision
            other than 32-true, 16-mixed or bf16-mixed (Lightning's spellings of them too).
    """
    chosen = PRECISIONS.get(str(precision))
    if chosen is None:
        raise ValueError(
            f"--trainer.precision {precision}: coretune {command} runs a model at 32-true, bf16-mixed or 16-mixed "
            "(autocast): pass one of them"
        )
    name = str(accelerator).lower()
    index = _device_index(devices, command)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"--trainer.accelerator {accelerator}: no CUDA device here: pass --trainer.accelerator cpu"
            )
        count = torch.cuda.device_count()
        if index is not None and not 0 <= index < count:
            raise ValueError(f"--trainer.devices [{index}]: this machine has CUDA devices 0 to {count - 1}")
        return Placement(torch.device("cuda", index or 0), chosen)
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--trainer.accelerator {accelerator}: no MPS device here: pass --trainer.accelerator cpu")
        return Placement(torch.device("mps"), chosen)
    if name == "cpu":
        return Placement(torch.device("cpu"), chosen)
    raise ValueError(f"--trainer.accelerator {accelerator}: choose auto, cpu, gpu (cuda) or mps")


def placement_of(cfg: Any, command: str) -> Placement:
    """:func:`placement` of a parsed command line's ``trainer`` group."""
    trainer = cfg.trainer
    return placement(trainer.accelerator, trainer.devices, trainer.precision, command=command)
