"""``coretune bench --export``: the small files of a spec's finished (or diverged) runs, copied out to keep (in git,
say)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..runs.layout import RunDir
from .records import check_run_args
from .spec import BenchSpec

__all__ = ["export_records"]


def export_records(spec: BenchSpec, dest: str | Path) -> list[Path]:
    """Copy the records (:meth:`RunDir.records`) of every finished run of ``spec``, and of every run that diverged
    (its ``results.json`` says so: a result too), into ``dest``, in the layout of ``spec.output`` and without
    checkpoints or logs: a few KB per run to keep (in git, say) after the output folder is gone. Copying them back
    into ``spec.output`` makes the sweep skip those runs, count the finished ones in its tables and list the
    diverged ones under them. A ``robust_results*.json`` of an earlier export that the run no longer has (moved out
    of it, as a table refusing it says to) is removed from ``dest``; the other record files are only replaced.

    Returns the run directories written under ``dest``."""
    dest = Path(dest)
    if dest.resolve() == spec.output.resolve():
        raise ValueError(f"--export {dest} is the spec's output folder; give another folder to copy the records into")
    written = []
    for run in spec.runs():
        if not RunDir(run.run_dir).is_finished() and RunDir(run.run_dir).divergence() is None:
            continue
        check_run_args(run.job)  # a record of other settings than the spec's would mislead
        target = dest / run.run_dir.relative_to(spec.output)
        target.mkdir(parents=True, exist_ok=True)
        sources = [source for source in RunDir(run.run_dir).records() if source.is_file()]
        for source in sources:
            shutil.copy2(source, target / source.name)
        kept = {source.name for source in sources}
        for stale in target.glob("robust_results*.json"):  # an earlier export's the run no longer has (moved out)
            if stale.name not in kept:
                stale.unlink()
        written.append(target)
    return written
