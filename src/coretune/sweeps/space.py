"""The search space of ``coretune tune``: the hyper-parameters an objective declares
(:attr:`~coretune.objectives.Objective.search_space`: Core-tuning's η and α over the paper's {0.1, 1, 10}, SCL's λ
and τ over its paper's sweep, BSS's η, L2-SP's α and β, DELTA's α …; empty for CE-tuning, which has none), with
the values ``--eta``/``--alpha`` or ``--space`` give instead; how a point names its trial folder and is printed.

A method becomes tunable by declaring its space on its class, e.g. ``search_space = {"lam": (0.5, 0.7, 0.9)}``;
``coretune tune --objective NAME`` then runs its grid (or TPE over its ranges) with ``--objective.lam=…`` per
trial, and ``--space '{lam: [0.1, 0.9]}'`` replaces the declared values.
"""

from __future__ import annotations

import inspect
import math
import random
from typing import Any

__all__ = ["objective_space", "point_label", "point_symbols", "resolve_space", "startup_points", "trial_folder"]

_SYMBOLS = {"eta": "η", "alpha": "α"}
"""How the summary line writes a hyper-parameter (its name for those not listed)."""

_OPTIONS = ("eta", "alpha")
"""The hyper-parameters of ``coretune tune``'s own options ``--eta`` and ``--alpha`` (Core-tuning's)."""


_NO_SPACE = "declares no hyper-parameter to tune (an empty search_space)"


def _why_not(name: str) -> str | None:
    """Why the registered objective ``name`` cannot be tuned, or None."""
    from .. import objectives

    cls, preset = objectives.get(name)
    space = cls.search_space
    if not space or not set(space) <= set(inspect.signature(cls).parameters):
        return _NO_SPACE
    if fixed := next((n for n in space if n in preset), None):
        return f"fixes {fixed} at {preset[fixed]} (it defines the method)"
    return cls.untunable(preset)


def objective_space(name: str) -> tuple[dict[str, Any], dict[str, tuple[float, ...]]]:
    """The preset and the declared search space of the registered objective ``name``; ValueError, naming the
    objectives that can be tuned, for one that declares no space, a preset that fixes a hyper-parameter of it
    (``ce_mix``: η = 0 is its definition) or that its class says leaves the space no effect (``ce_con``: α)."""
    from .. import objectives

    tunable = [n for n in objectives.available() if _why_not(n) is None]
    if name not in tunable:
        reason = _why_not(name) if name in objectives.available() else _NO_SPACE
        raise ValueError(f"--objective {name!r} {reason}; choose one of {', '.join(tunable)}")
    cls, preset = objectives.get(name)
    return preset, dict(cls.search_space)


def resolve_space(
    objective: str,
    eta: list[float] | None = None,
    alpha: list[float] | None = None,
    space: dict[str, list[float]] | None = None,
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The objective's preset and the study's search space: each declared hyper-parameter's values (sorted,
    distinct), those of ``eta``/``alpha`` (``--eta``/``--alpha``) or ``space`` (``--space``) in place of the
    declared ones. ValueError for an objective that cannot be tuned, a value for a hyper-parameter it does not
    tune, or values that cannot be a grid (none, not finite; Core-tuning: α <= 0 or η < 0)."""
    preset, declared = objective_space(objective)
    given = {name: list(values) for name, values in (space or {}).items()}
    for name, values in zip(_OPTIONS, (eta, alpha), strict=True):
        if values is None:
            continue
        if name in given:
            raise ValueError(f"--{name} and --space {name} both give values of {name}: pass one of them")
        given[name] = list(values)
    if unknown := [name for name in given if name not in declared]:
        option = f"--{unknown[0]}" if unknown[0] in _OPTIONS and unknown[0] not in (space or {}) else "--space"
        raise ValueError(
            f"{option}: --objective {objective} tunes {', '.join(declared)}, not {', '.join(unknown)}; give values "
            f"of those with --space, e.g. --space '{{{next(iter(declared))}: [...]}}'"
        )
    values = {name: given.get(name, list(default)) for name, default in declared.items()}
    if set(values) == set(_OPTIONS):  # Core-tuning's, with the messages of --eta and --alpha
        eta, alpha = values["eta"], values["alpha"]
        if not eta or not alpha:
            raise ValueError(f"--eta and --alpha need at least one value each (got eta {eta}, alpha {alpha})")
        if not all(math.isfinite(v) for v in [*eta, *alpha]) or min(alpha) <= 0 or min(eta) < 0:
            raise ValueError(f"α must be finite and > 0, η finite and >= 0 (got eta {eta}, alpha {alpha})")
    for name, grid in values.items():
        if not grid or not all(math.isfinite(v) for v in grid):
            raise ValueError(f"--space {name} needs one or more finite values (got {grid})")
    return preset, {name: sorted({float(v) for v in grid}) for name, grid in values.items()}


def trial_folder(params: dict[str, float]) -> str:
    """A grid point's trial folder: ``eta1_alpha0.1`` (the space's order)."""
    return "_".join(f"{name}{value:g}" for name, value in params.items())


def point_label(params: dict[str, float]) -> str:
    """A point in messages and ``best.yaml``'s comments: ``eta 1 alpha 0.1``."""
    return " ".join(f"{name} {value:g}" for name, value in params.items())


def point_symbols(params: dict[str, float]) -> str:
    """A point in the summary line: ``η = 1, α = 0.1``."""
    return ", ".join(f"{_SYMBOLS.get(name, name)} = {value:g}" for name, value in params.items())


def startup_points(space: dict[str, list[float]], count: int, seed: int) -> list[dict[str, float]]:
    """``count`` random points drawn from ``seed`` over the ranges a trial suggests from (log scale where the
    range starts above 0): the TPE sampler's start-up trials, which the study's creator queues."""
    rng = random.Random(seed)

    def draw(low: float, high: float) -> float:
        if low <= 0:
            return rng.uniform(low, high)
        return min(max(math.exp(rng.uniform(math.log(low), math.log(high))), low), high)  # exp(log(x)) may pass x

    return [{name: draw(v[0], v[-1]) for name, v in space.items()} for _ in range(count)]
