"""A real ``coretune tune`` worker process whose trials' fits are stand-ins, for the tests of workers sharing a study.

``tune_worker.py LOG [coretune tune arguments]`` runs ``coretune tune`` in this process with
``coretune.sweeps.launch.fit_command`` replaced: each trial's fit is this file again (``tune_worker.py fit LOG
COMMAND…``), which appends ``<worker pid> <trial folder> fresh|resume`` to LOG (``resume``: the command resumes from
``checkpoints/last.ckpt``), waits, and leaves what ``coretune fit`` leaves: ``metrics.csv`` with a final
``val/top1`` computed from the point, and ``results.json``. Environment of a worker:

- ``TUNE_STUB_WAIT``: a file each fit waits for before it finishes (the test's go-ahead), then ``TUNE_STUB_SLEEP``
  seconds more;
- ``TUNE_STUB_HANG=1``: the worker's first fit saves ``checkpoints/last.ckpt``, appends ``<pid> <folder> hang`` and
  never finishes (the test kills the worker and its fit, as a machine that dies).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


def _log(log: str, line: str) -> None:
    with open(log, "a") as f:  # one short write in append mode: lines of several processes do not interleave
        f.write(line + "\n")


def fit(log: str, command: list[str]) -> int:
    values = dict(word[2:].partition("=")[::2] for word in command if word.startswith("--") and "=" in word)
    run_dir, worker = Path(values["run_dir"]), os.getppid()
    resume = values.get("ckpt_path") == "last"
    if os.environ.get("TUNE_STUB_HANG") == "1" and not resume:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints" / "last.ckpt").write_text("weights after epoch 1")
        _log(log, f"{worker} {run_dir.name} hang")
        while True:
            time.sleep(1)
    _log(log, f"{worker} {run_dir.name} {'resume' if resume else 'fresh'}")
    if wait := os.environ.get("TUNE_STUB_WAIT"):
        while not Path(wait).exists():
            time.sleep(0.05)
    time.sleep(float(os.environ.get("TUNE_STUB_SLEEP", "0")))
    eta, alpha = float(values["objective.eta"]), float(values["objective.alpha"])
    score = 1 / (1 + abs(math.log10(eta)) + abs(math.log10(alpha)))  # distinct points: distinct values
    (run_dir / "metrics.csv").write_text(f"epoch,val/top1\n0,{score}\n")
    (run_dir / "results.json").write_text(json.dumps({"test": {"top1": score}}))
    return 0


def main() -> None:
    if sys.argv[1] == "fit":
        sys.exit(fit(sys.argv[2], sys.argv[3:]))
    log, args = sys.argv[1], sys.argv[2:]
    import coretune.sweeps.launch as launch
    from coretune.cli import main as coretune

    real = launch.fit_command
    launch.fit_command = lambda argv, run_dir, resume=None: [
        sys.executable, __file__, "fit", log, *real(argv, run_dir, resume)[3:]
    ]  # fmt: skip
    coretune(["tune", *args])


if __name__ == "__main__":
    main()
