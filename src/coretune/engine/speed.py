"""Speed options of a fine-tuning run, which leave what it computes alone: the channels-last memory format where it is
faster (:func:`resolve_channels_last`, ``--model.channels_last auto``) and ``torch.compile`` of the backbone, with a
fallback to eager when compilation fails (:func:`compile_in_place`, ``--model.compile true``).

Compilation is in place (``nn.Module.compile``): the backbone stays the same module, so its ``state_dict`` keys are
those of an eager run (no ``_orig_mod.`` prefix) and checkpoints, exports, resumes and ``--model.weights`` work the
same with or without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal

from torch import nn

from ..distributed import rank

__all__ = [
    "ChannelsLast",
    "CompileGuard",
    "channels_last_problem",
    "compile_in_place",
    "conv_share",
    "prefers_channels_last",
    "resolve_channels_last",
]

ChannelsLast = bool | Literal["auto"]


def conv_share(module: nn.Module) -> float:
    """The share of ``module``'s parameter elements that are 2-d convolutions' (0 for a module without parameters)."""
    total = sum(p.numel() for p in module.parameters())
    convs = sum(p.numel() for m in module.modules() if isinstance(m, nn.Conv2d) for p in m.parameters(recurse=False))
    return convs / total if total else 0.0


def _has_attention(module: nn.Module) -> bool:
    """Whether ``module`` holds an attention block (``nn.MultiheadAttention``, or a class named ``*Attention``, as
    timm's ViTs, DeiT and Swin name theirs)."""
    return any(isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention") for m in module.modules())


def prefers_channels_last(backbone: nn.Module) -> bool:
    """Whether the channels-last memory format speeds ``backbone`` up: a CNN (most of its weights in 2-d convolutions
    and no attention: the ResNets, ``small_cnn``, DeepLab's encoder) yes; a ViT or another transformer (a patch
    embedding convolution, then attention and linear layers) no: channels-last would only add a copy of the images."""
    return not _has_attention(backbone) and conv_share(backbone) > 0.5


def channels_last_problem(value: Any) -> str | None:
    """Why ``value`` is no ``channels_last`` setting, or None."""
    if isinstance(value, bool) or value == "auto":
        return None
    return f"channels_last must be true, false or auto (got {value!r})"


def resolve_channels_last(value: ChannelsLast, backbone: nn.Module) -> bool:
    """``channels_last`` as used for ``backbone``: ``auto`` is :func:`prefers_channels_last`."""
    return prefers_channels_last(backbone) if value == "auto" else bool(value)


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else 'no message'}"


def _reason(err: BaseException) -> str:
    """One line naming why compilation failed: the error's class, and its root cause's class and first line (the
    compiler's wrapper names only the backend)."""
    root = err
    while (cause := getattr(root, "inner_exception", None) or root.__cause__) is not None and cause is not root:
        root = cause
    why = _first_line(err) if root is err else f"{type(err).__name__}, {_first_line(root)}"
    return why[:300]


class CompileGuard:
    """The compiled call of a module compiled in place, which falls back to the module's eager call when compilation
    fails (a missing C++ compiler for inductor on CPU, an operation the compiler cannot handle).

    A call that raises is repeated eagerly: if the eager call works, the failure was the compiler's, and the module
    stays eager from then on (:attr:`status` names why; ``report`` gets the one line); if it raises too, the error
    is the eager one (bad input), and the module stays compiled. A deep copy of the module (Bi-tuning's key
    encoder, L2-SP's frozen source) is eager: the compiled function would still call the original module.
    """

    def __init__(
        self, module: nn.Module, compiled: Callable[..., Any], report: Callable[[str], None], what: str
    ) -> None:
        self.module, self.compiled, self.report, self.what = module, compiled, report, what
        self.status = "compiled"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except Exception as err:
            self.module._compiled_call_impl = None  # eager from now on, unless the eager call fails too
            try:
                out = self.module._call_impl(*args, **kwargs)
            except Exception:
                self.module._compiled_call_impl = self
                raise
            self.status = f"eager: {_reason(err)}"
            self.report(
                f"coretune: torch.compile of {self.what} failed ({_reason(err)}); it runs "
                "uncompiled (eager) instead: the same numbers, without the speed-up"
            )
            return out

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


def _stderr_line(line: str) -> None:
    if rank() == 0:
        print(line, file=sys.stderr)


def compile_in_place(
    module: nn.Module, what: str = "the backbone", report: Callable[[str], None] = _stderr_line, **options: Any
) -> CompileGuard:
    """Compile ``module`` (``what`` it is, for the fallback's line) in place, ``nn.Module.compile(**options)``: its
    parameters, buffers and ``state_dict`` keys stay as they are. Behind a :class:`CompileGuard`, which is returned
    (a module already behind one keeps it). The compilation itself happens at the first call."""
    current = module._compiled_call_impl
    if isinstance(current, CompileGuard):
        return current
    module.compile(**options)
    guard = CompileGuard(module, module._compiled_call_impl, report, what)
    module._compiled_call_impl = guard
    return guard
