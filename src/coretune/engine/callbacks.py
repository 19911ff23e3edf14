"""What every run writes into its run directory: per-epoch ``metrics.csv``, ``results.json`` and a learning curve."""

from __future__ import annotations

import contextlib
import csv
import math
import numbers
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..data import TaskData
from ..extras import EXTRAS, installed
from ..models import weights_digest
from ..runs.atomic import atomic_write, strict_json
from ..runs.layout import RunDir
from ..tasks import DEFAULT_TASK, TASKS, Task
from .health import grad_scaler_record
from .module import FineTuner, NonFiniteLossError

__all__ = [
    "ChanceLevelGuard",
    "RunArtifacts",
    "chance_verdict",
    "epoch_summary",
    "plot_learning_curves",
    "read_metrics",
    "task_of",
    "update_results",
]


FIGURES_NEED = f"matplotlib is not installed (pip install 'coretune[{EXTRAS['matplotlib']}]')"
"""Why a run's figures (learning curves, a task's figures) were not drawn; the run itself is complete without them."""
_figures_skipped: list[Path] = []  # the runs whose figures were skipped, once told


def _validated_on_test(trainer: L.Trainer, pl_module: L.LightningModule) -> bool | None:
    """Whether a fine-tuning's validation read the test images (its data module's ``validates_on_test``, a
    :class:`~coretune.data.TaskData` that ``FineTuner.setup`` checked); None without a data module and for
    pre-training, which does not validate."""
    if not isinstance(pl_module, FineTuner) or trainer.datamodule is None:
        return None
    return cast(TaskData, trainer.datamodule).validates_on_test


def task_of(pl_module: L.LightningModule) -> type[Task] | Task:
    """The task of a module (:class:`~coretune.engine.FineTuner`'s ``task``), else (a pre-training module) the
    default task's class: what names its monitored value and its log line's columns."""
    return getattr(pl_module, "task", None) or TASKS[DEFAULT_TASK]


def provenance() -> dict[str, Any]:
    """Which code and machine made a run (``results.json``'s ``provenance``): coretune's version and, when it runs
    from a git checkout, the commit (``+dirty`` with uncommitted changes to the package's files); the host, CPU model,
    torch version and CPU threads (a bf16 result depends on the kind of CPU and the thread count)."""
    source = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:  # without optional locks: never the index lock a concurrent commit needs
        command = ["git", "--no-optional-locks", "-C", str(source), *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # only a checkout that tracks this file is coretune's (not an outer repository holding a virtualenv)
    commit = git("rev-parse", "HEAD") if git("ls-files", "--error-unmatch", Path(__file__).name) is not None else None
    if commit and git("status", "--porcelain", "--untracked-files=no", "--", str(source.parent)):
        commit += "+dirty"  # the package's own files differ from the commit
    cpu = platform.processor() or None
    with contextlib.suppress(OSError):
        models = [line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")]  # fmt: skip
        cpu = models[0] if models else cpu
    return {
        "coretune": version("coretune"),
        "commit": commit,
        "host": platform.node(),
        "cpu": cpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _seen(commits: Sequence[str | None], commit: str | None) -> list[str | None]:
    """``commits`` with ``commit`` appended unless it is the last one already (the commits a run was made from)."""
    return [*commits, commit] if not commits or commits[-1] != commit else list(commits)


def read_metrics(path: str | Path) -> list[dict[str, str]]:
    """The rows of a run's ``metrics.csv`` (empty when absent)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def update_results(run_dir: str | Path, drop: Sequence[str] = (), **entries: Any) -> dict[str, Any]:
    """Merge ``entries`` into ``run_dir/results.json`` without the keys ``drop`` (atomic write) and return the
    merged content."""
    results = RunDir(run_dir).read_results()
    results.update(entries)
    for key in drop:
        results.pop(key, None)
    with atomic_write(RunDir(run_dir).results) as f:
        f.write(strict_json(results, indent=2, sort_keys=True) + "\n")
    return results


def epoch_summary(row: dict[str, Any], max_epochs: int | None, keys: Sequence[str] | None = None) -> str:
    """One log line for a finished epoch, from its ``metrics.csv`` row: ``"epoch 5 of 20 (step 3905, 6.7 min):
    train/loss 1.2345, train/top1 45.62%, val/loss 0.8123, val/top1 72.30%"`` (epochs counted from 1).

    ``keys``: the columns shown where the row has them (default: the default task's ``summary_keys``); losses as
    numbers, the others (fractions) as percentages."""
    length = f" of {max_epochs}" if max_epochs is not None and max_epochs > 0 else ""
    values = [
        f"{key} undefined"  # NaN: a score without anything to score (a split whose masks are all ignored)
        if math.isnan(float(row[key]))
        else f"{key} {float(row[key]):.4f}"
        if key.endswith("loss")
        else f"{key} {100 * float(row[key]):.2f}%"
        for key in (TASKS[DEFAULT_TASK].summary_keys if keys is None else keys)
        if row.get(key) not in (None, "")
    ]
    when = f"step {row['step']}, {float(row['epoch_time_s']) / 60:.1f} min"
    return f"epoch {int(row['epoch']) + 1}{length} ({when}): " + ", ".join(values)


def plot_learning_curves(metrics_csv: str | Path, out_png: str | Path, task: type[Task] | Task | None = None) -> None:
    """Loss terms and the task's score (``train/<monitor>``, ``val/<monitor>``: top-1 accuracy, MIoU …) against
    epoch, as a two-panel PNG (``task``: default, the default task's)."""
    task = task or TASKS[DEFAULT_TASK]
    score, score_label = task.monitor, task.monitor_label
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_csv)
    if not rows:
        return
    epochs = [int(r["epoch"]) for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key in rows[0]:
        points = [(e, float(r[key])) for e, r in zip(epochs, rows, strict=True) if r.get(key) not in (None, "")]
        xs, values = [e for e, _ in points], [v for _, v in points]  # val/* only where validation ran
        if (key.startswith("train/") and key.partition("/")[2] not in task.metric_names) or key == "val/loss":
            ax_loss.plot(xs, values, marker=".", label=key)
        elif key.endswith(f"/{score}"):
            ax_acc.plot(xs, [100 * v for v in values], marker=".", label=key)
    ax_loss.set(xlabel="epoch", ylabel="loss", title="losses")
    ax_acc.set(xlabel="epoch", ylabel=f"{score_label} (%)", title=score_label)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.lines:  # a pre-training run logs no accuracy
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


class RunArtifacts(L.Callback):
    """Writes ``metrics.csv`` (one row per epoch), ``results.json`` and ``learning_curve.png`` into ``run_dir``.

    ``metrics.csv`` holds every logged epoch-level value (each loss term, lr, train and val top-1/top-5; ``val/*``
    only on the epochs that ran validation, empty on the others) and ``epoch_time_s``, the epoch's wall-clock
    seconds with its validation (for the epoch a run resumed in the middle of: from the resume on); a resumed run
    rewrites the rows from its restart epoch on, so the file always describes one uninterrupted history. Without a
    progress bar (``--trainer.enable_progress_bar=false``: batch jobs, the fits of ``coretune bench``) each epoch
    also logs one line (:func:`epoch_summary`), so a job's log shows how far it got. A run that ends with
    :class:`NonFiniteLossError` (a NaN loss, collapsed or exploding logits, training top-1 at chance) records its
    message as ``diverged`` in ``results.json`` (:meth:`on_exception`).
    """

    def __init__(self, run_dir: str | Path | None = None) -> None:
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self._train_time = 0.0
        self._images = 0
        self._epoch_start = 0.0  # excludes validation: the training time behind images/s
        self._epoch_wall_start = 0.0
        self._val_start = 0.0
        self._fit_start = 0.0
        self._earlier_wall = 0.0  # the wall time of the sessions before a resume (their train time is in _train_time)
        self._cpu_start = 0.0
        self._earlier_cpu: float | None = 0.0  # the CPU time of the sessions before a resume (None: not recorded)
        self._in_epoch = False
        self._epoch_lr = float("nan")
        self._validated = False  # this epoch ran validation (Lightning keeps the last val/* in callback_metrics)
        self._commits: list[str | None] = []  # the commit at each session's start (a resumed run's earlier ones too)

    def run_dir(self, trainer: L.Trainer) -> Path:
        return self._run_dir if self._run_dir is not None else Path(trainer.default_root_dir)

    # -- timing ---------------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = self._epoch_start = self._epoch_wall_start = time.perf_counter()
        self._cpu_start = time.process_time()
        self._in_epoch = True  # until the first epoch ends (a mid-epoch resume skips on_train_epoch_start)
        if trainer.is_global_zero:  # the code that trains: read now, not when the run ends (HEAD may move meanwhile)
            self._commits = _seen(self._commits, provenance()["commit"])
        if trainer.is_global_zero and RunDir(self.run_dir(trainer)).results.is_file():
            # fit again after a failure, or extend a finished run (--trainer.max_epochs): until this fit tests
            # again, the run is not finished, and its old test score must not stand for the weights it trains on
            # (and this fit's speed records: compiled or not, the 16-mixed scaler's skipped steps; and which
            # averaged weights the test scored)
            update_results(
                self.run_dir(trainer),
                drop=("diverged", "collapsed", "test", "test_skipped", "compile", "grad_scaler", "averaging"),
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = self._epoch_wall_start = time.perf_counter()
        self._in_epoch = True
        self._epoch_lr = trainer.optimizers[-1].param_groups[-1]["lr"] if trainer.optimizers else float("nan")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += len(batch[1])  # labels: batch[0] may hold several views of the images

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self._epoch_start += time.perf_counter() - self._val_start
            self._validated = True

    def state_dict(self) -> dict[str, Any]:
        """The row's lr when a run resumes mid-epoch, and the times and images so far: a resumed run's
        ``results.json`` counts every session, not the last one alone."""
        now = time.perf_counter()
        return {
            "epoch_lr": self._epoch_lr,
            "train_time_s": self._train_time + (now - self._epoch_start if self._in_epoch else 0.0),
            "wall_time_s": self._earlier_wall + now - self._fit_start,
            "cpu_time_s": self._cpu_time(),
            "train_images": self._images,
            "commits": self._commits,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch_lr = state_dict["epoch_lr"]
        # absent from the checkpoints of older versions: those runs count from the resume, as they did
        self._train_time = state_dict.get("train_time_s", 0.0)
        self._earlier_wall = state_dict.get("wall_time_s", 0.0)
        # a checkpoint of older code has no CPU time: unknown, rather than the last session's alone
        self._earlier_cpu = state_dict.get("cpu_time_s")
        self._images = state_dict.get("train_images", 0)
        # on_fit_start runs after a resume restores this: the first session's commit comes first
        self._commits = list(state_dict.get("commits", []))

    def _cpu_time(self) -> float | None:
        """The CPU seconds this process has spent fitting (from fit start to fit end, as ``wall_time_s``), every
        session of a resumed run: all its threads (so at most the threads running at once × the wall time), not
        the time it was stopped or waiting (a paused run's wall time grows, this does not), not DataLoader worker
        processes; on several processes, rank 0's. ``None`` for a run resumed from a checkpoint of older code,
        which did not count it."""
        if self._earlier_cpu is None:
            return None
        return self._earlier_cpu + time.process_time() - self._cpu_start

    # -- outputs --------------------------------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_time += time.perf_counter() - self._epoch_start
        self._in_epoch = False
        # Every process reads the metrics: the first read reduces them over processes (collective calls).
        metrics = sorted(trainer.callback_metrics.items())
        validated, self._validated = self._validated, False
        if not trainer.is_global_zero:
            return
        row: dict[str, Any] = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        row["lr"] = self._epoch_lr  # the heads' learning rate at the epoch's first step
        row["epoch_time_s"] = round(time.perf_counter() - self._epoch_wall_start, 2)
        for key, value in metrics:
            if key.startswith("train/") or (validated and key.startswith("val/")):
                row[key] = float(value)
        path = RunDir(self.run_dir(trainer)).metrics
        rows = [r for r in read_metrics(path) if int(r["epoch"]) < trainer.current_epoch] + [row]
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with atomic_write(path, newline="") as f:  # whole: sweeps and the curve read it while the run goes on
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        if trainer.progress_bar_callback is None:
            rank_zero_info(epoch_summary(row, trainer.max_epochs, task_of(pl_module).summary_keys))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mine = torch.tensor(float(self._images), device=trainer.strategy.root_device)
        images = int(trainer.strategy.reduce(mine, reduce_op="sum"))  # every process's: the run's training images
        if not trainer.is_global_zero:
            return
        run_dir = self.run_dir(trainer)
        task = task_of(pl_module)
        if installed("matplotlib"):
            plot_learning_curves(RunDir(run_dir).metrics, RunDir(run_dir).learning_curve, task)
            if isinstance(task, Task) and trainer.datamodule is not None:
                task.write_figures(pl_module, trainer.datamodule, run_dir)
        elif not _figures_skipped:  # once per process: a demo or a sweep runs several fits
            print(f"coretune: figures not drawn: {FIGURES_NEED}", file=sys.stderr)
            _figures_skipped.append(run_dir)
        best = trainer.checkpoint_callback
        best_score = float(best.best_model_score) if best and best.best_model_score is not None else None
        update_results(
            run_dir,
            wall_time_s=round(self._earlier_wall + time.perf_counter() - self._fit_start, 2),
            cpu_time_s=None if (cpu := self._cpu_time()) is None else round(cpu, 2),
            train_time_s=round(self._train_time, 2),
            train_images=images,
            train_images_per_s=round(images / self._train_time, 1) if self._train_time > 0 else None,
            epochs=trainer.current_epoch,
            **{f"best_val_{task.monitor}": best_score},
            best_checkpoint=str(best.best_model_path) if best and best.best_model_path else None,
            validated_on_test_images=_validated_on_test(trainer, pl_module),
            **_train_class_counts(pl_module),
            # a fine-tuning's pre-trained file (None: a random initialisation); pre-training records none
            **({"weights_sha256": pl_module.weights_sha256} if hasattr(pl_module, "weights_sha256") else {}),
            provenance=self._provenance(),
            # --model.optim.plateau_patience: the decays made, the final factor, whether plateau_stop ended the run
            **({"plateau": plateau.entry()} if (plateau := getattr(pl_module, "plateau", None)) else {}),
            # --model.compile: "compiled", or "eager: <why compilation failed>"; 16-mixed: the scaler's skipped steps
            **({"compile": status} if (status := getattr(pl_module, "compile_status", None)) else {}),
            **({"grad_scaler": record} if (record := grad_scaler_record(trainer)) else {}),
            # the final weights (what the test scores, and what coretune eval robust scores after it: Table 8
            # tables a robustness file only for the last.ckpt it was scored on)
            last_checkpoint_sha256=weights_digest(last)
            if (last := RunDir(run_dir).last_checkpoint).is_file()
            else None,
        )

    def _provenance(self) -> dict[str, Any]:
        """:func:`provenance` with ``commit`` the one the run started from (a resumed run: its first session's),
        and ``commits``, every session's start commit and the one at the end in order, when they are not all one."""
        made = provenance()
        commits = _seen(self._commits, made["commit"])
        made["commit"] = commits[0]
        return made | ({"commits": commits} if len(commits) > 1 else {})

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        results = getattr(pl_module, "test_results", None)
        if trainer.is_global_zero and results is not None:
            update_results(self.run_dir(trainer), drop=("test_skipped",), test=results)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Record a run that diverged or collapsed (:class:`NonFiniteLossError`, from training, validation or the
        final test) in ``results.json`` as ``diverged``, its one-line message: a result, which a sweep does not run
        again."""
        if not isinstance(exception, NonFiniteLossError):
            return
        try:
            if trainer.is_global_zero:
                update_results(self.run_dir(trainer), diverged=str(exception))
        finally:
            # Every process raises it together (the decision is reduced over them), and a launcher kills the rest
            # as soon as one process ends: the others wait here until rank 0 has recorded it (or failed to).
            trainer.strategy.barrier("coretune-diverged")


def _train_class_counts(pl_module: L.LightningModule) -> dict[str, Any]:
    """``{"train_class_counts": {class: images}}``: a fine-tuning's training split (after its long-tailed,
    label-fraction and validation subsets), when known; nothing otherwise (a pre-training)."""
    counts, names = getattr(pl_module, "train_class_counts", None), getattr(pl_module, "class_names", None)
    if counts is None or names is None or len(names) != len(counts):
        return {}
    return {"train_class_counts": dict(zip(names, counts, strict=True))}


def chance_verdict(top1: float, counts: torch.Tensor, mean_ce: float | None = None) -> str | None:
    """Why an epoch's training accuracy is at chance, or ``None`` (:class:`ChanceLevelGuard`).

    With ``K`` classes and ``counts`` the epoch's training labels per class (``n`` in all), a model that learned
    nothing scores ``floor = max(1/K, the most frequent class's share)``. The epoch is at chance when its training
    top-1 is within 3 binomial standard errors of that, ``top1 <= floor + 3·√(floor(1 - floor)/n)``; or when it is
    at most ``min(2·floor, (1 + floor)/2)`` while the classifier's mean cross-entropy on the training rows,
    ``mean_ce``, is at least 95% of that of predicting the class frequencies, their entropy ``H = -Σ p_k ln p_k``
    (``ln K`` for balanced classes): a collapsed run's features shrink to nothing, its logits to the classifier's
    bias, and its cross-entropy settles just under ``H`` while its top-1 wanders a little above chance (Core-tuning
    at lr 0.1 on CIFAR-10: 11.5% and 2.28 against ln 10 = 2.30, docs/benchmarks.md, "Why Core-tuning collapses at
    lr 0.1"; issue 41's ImageNet20 run: 7.8% on 20 classes, above the 3σ bound of its ~1,850 images per epoch).
    A run that learns leaves that corner: CE-tuning at lr 0.1 damaged, 21.9% (CE 2.38); clipped, 35.8% (2.05).
    """
    seen = int(counts.sum())
    shares = counts[counts > 0].double() / seen
    floor = max(1 / len(counts), float(shares.max()))
    learned_nothing = f"a model that learned nothing scores {100 * floor:.1f}% on these labels"
    if top1 <= floor + 3 * math.sqrt(floor * (1 - floor) / seen):
        return f"chance level ({learned_nothing})"
    entropy = guessing_entropy(counts)
    if mean_ce is not None and top1 <= min(2 * floor, (1 + floor) / 2) and mean_ce >= 0.95 * entropy:
        return (
            f"no better than chance: its cross-entropy {mean_ce:.3g} is at least 95% of that of guessing the class "
            f"frequencies ({entropy:.3g}), and {learned_nothing}"
        )
    return None


def guessing_entropy(counts: torch.Tensor) -> float:
    """The cross-entropy of predicting the class frequencies of labels counted ``counts`` per class: their entropy
    ``H = -Σ p_k ln p_k`` (a model that learned nothing from the images gets no lower)."""
    shares = counts[counts > 0].double() / int(counts.sum())
    return float(-(shares * shares.log()).sum())


def _whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class ChanceLevelGuard(L.Callback):
    """Stops a fine-tuning run whose training accuracy has collapsed to chance, instead of letting it end looking
    like a success.

    An epoch is *at chance* as :func:`chance_verdict` decides from its training top-1 (``train/top1``), its
    training labels and the classifier's mean cross-entropy on the training rows (from the logits
    ``training_step`` returns). From the second epoch, ``min_steps`` optimiser steps and ``min_fraction`` of the
    run's steps on (a slow start, e.g. from a random initialisation on a few hundred images, is not a collapse),
    the first such epoch warns; ``patience`` consecutive ones, or the last epoch of the run, raise
    :class:`NonFiniteLossError` (``coretune fit`` then exits with one line naming the fix), after ``results.json``
    has recorded ``collapsed``; with ``stop=False`` the guard only warns. Runs that log no ``train/top1``
    (pre-training) are left alone.

    Every trainer coretune makes has one (:func:`~coretune.engine.default_callbacks`); a guard among the caller's own
    callbacks replaces it, e.g. for a run that learns slowly on purpose: ``coretune fit ... --trainer.callbacks+=
    coretune.engine.ChanceLevelGuard --trainer.callbacks.min_fraction 0.5`` (or ``--trainer.callbacks.stop false``).
    """

    def __init__(
        self,
        run_dir: str | Path | None = None,
        min_steps: int = 50,
        patience: int = 5,
        min_fraction: float = 0.1,
        stop: bool = True,
    ) -> None:
        problems = [
            f"{name} must be {rule} (got {value!r})"
            for name, value, ok, rule in [
                ("min_steps", min_steps, _whole(min_steps) and min_steps >= 0, "a whole number >= 0"),
                ("patience", patience, _whole(patience) and patience >= 1, "a whole number >= 1"),
                ("min_fraction", min_fraction, _real(min_fraction) and 0 <= min_fraction <= 1, "a number in [0, 1]"),
                ("stop", stop, isinstance(stop, bool), "true or false"),
            ]
            if not ok
        ]
        if problems:
            raise ValueError(f"ChanceLevelGuard: {'; '.join(problems)}")
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self.min_steps, self.patience, self.min_fraction, self.stop = min_steps, patience, min_fraction, stop
        self._counts: torch.Tensor | None = None
        self._ce_sum: torch.Tensor | float = 0.0  # a tensor on the logits' device: no sync per step
        self._ce_rows = 0
        self._streak = 0
        self._warned = False
        self._loss_fell = False  # an epoch's training cross-entropy fell below that of guessing (this fit)
        self._guessing = math.nan

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loss_fell, self._guessing = False, math.nan

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts = None
        self._ce_sum, self._ce_rows = 0.0, 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        task = getattr(pl_module, "task", None)
        labels = task.unpack(batch).targets if task is not None else None
        if isinstance(outputs, dict) and isinstance(outputs.get("targets"), torch.Tensor):
            labels = outputs["targets"]  # the rows train/top1 scores (adversarial training: clean + adversarial)
        classes = getattr(pl_module, "num_classes", None)
        if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or not classes:
            return
        counts = torch.bincount(labels.detach().cpu(), minlength=classes)
        self._counts = counts if self._counts is None else self._counts + counts
        if isinstance(outputs, dict) and isinstance(outputs.get("logits"), torch.Tensor):
            logits, targets = outputs["logits"], outputs["targets"]
            ce = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
            self._ce_sum, self._ce_rows = self._ce_sum + ce, self._ce_rows + len(targets)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        top1 = trainer.callback_metrics.get("train/top1")
        if top1 is None or self._counts is None or trainer.sanity_checking:
            return
        mean_ce = float(self._ce_sum) / self._ce_rows if self._ce_rows else None
        self._guessing = guessing_entropy(self._counts)
        self._loss_fell = self._loss_fell or mean_ce is None or mean_ce < 0.95 * self._guessing
        verdict = chance_verdict(float(top1), self._counts, mean_ce)
        total = trainer.estimated_stepping_batches  # inf for an unbounded run
        first_step = max(self.min_steps, self.min_fraction * total if math.isfinite(total) else 0)
        started = trainer.current_epoch >= 1 and trainer.global_step >= first_step
        at_chance = trainer.strategy.reduce_boolean_decision(bool(started and verdict is not None), all=True)
        self._streak = self._streak + 1 if at_chance else 0
        if not at_chance:
            return
        epoch, length = trainer.current_epoch, trainer.max_epochs or 0
        last = length > 0 and epoch + 1 >= length  # max_epochs -1 (unbounded): no last epoch
        what = (
            f"the training top-1 is {100 * float(top1):.1f}% at epoch {epoch + 1}, step {trainer.global_step}: "
            f"{verdict}"  # not None: every process found its epoch at chance (all=True)
        )
        fix = (
            f"the run collapsed or is not learning{self._no_signal()} the gradients (--trainer.gradient_clip_val 1.0) "
            "or lower the learning rate (--model.optim.lr); docs/results.md, section 7"
        )
        if self.stop:
            fix += (
                ". If it learns slowly on purpose, give it more time with a guard of your own: --trainer.callbacks+="
                "coretune.engine.ChanceLevelGuard --trainer.callbacks.min_fraction 0.5 (or --trainer.callbacks.stop "
                "false to only warn)"
            )
        if self.stop and (self._streak >= self.patience or last):
            when = f"for {self._streak} epochs" if self._streak > 1 else "at the end of training"
            message = f"{what}, {when}: {fix}"
            if trainer.is_global_zero:
                try:
                    update_results(self._run_dir or trainer.default_root_dir, collapsed=what)
                except OSError as err:  # every process raises the same error, which RunArtifacts records
                    raise NonFiniteLossError(f"{message} (not recorded in results.json: {err})") from err
            raise NonFiniteLossError(message)
        if not self._warned:
            self._warned = True
            rank_zero_warn(f"{what}: {fix}")

    def _no_signal(self) -> str:
        """When no epoch's training loss fell below guessing's: the data, or the weights, as causes before the
        optimisation (the images may hold no signal, as images all alike, or labels that do not depend on them)."""
        if self._loss_fell or not self._guessing > 0:
            return ". Clip"
        return (
            f", and its training loss never fell below that of guessing the class frequencies (cross-entropy "
            f"{self._guessing:.3g}): check that the training images hold signal (not blank or all alike) and that "
            "their labels match them, and the pre-trained weights; if they do, clip"
        )
