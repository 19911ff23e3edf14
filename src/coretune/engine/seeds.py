"""The seeds of a run's random draws: every draw of a training step depends on the run's seed and the step only
(:func:`step_seed`), and every draw at an epoch's start on the seed and the epoch (:func:`epoch_seed`), so that a
resumed run repeats the uninterrupted one exactly."""

from __future__ import annotations

import os

__all__ = ["epoch_seed", "run_seed", "step_seed"]


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of training step ``step`` of a run seeded with ``seed``."""
    return (seed * 1_000_003 + step + 1) % 2**63


def epoch_seed(seed: int, epoch: int) -> int:
    """The RNG seed of the start of epoch ``epoch`` (objective hooks, e.g. RIFLE's re-initialisation), away from
    the step seeds."""
    return (seed * 1_000_003 + 2**40 + epoch) % 2**63


def run_seed() -> int:
    """The run's seed (Lightning's ``seed_everything`` exports it as ``PL_GLOBAL_SEED``)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
