"""Runs on disk: a run directory's layout (:class:`RunDir`, :mod:`.layout`), the claim of the process running it
(:mod:`.claim`), the stop file a sweep signals it through (:mod:`.stopfile`), files written whole
(:mod:`.atomic`), the ``--config`` files of a command (:mod:`.config`), and the check that no command writes over
what it did not make (:mod:`.outputs`). Pure Python below everything else: the engine, the applications and the
sweeps read and write runs through these names only."""

from .atomic import atomic_write
from .layout import RunDir

__all__ = ["RunDir", "atomic_write"]
