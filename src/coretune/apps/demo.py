"""``coretune demo``: contrastive pre-training, then CE-tuning vs Core-tuning, end to end on a CPU in minutes.

On scikit-learn's handwritten digits (1,797 real 8×8 images shipped with scikit-learn; nothing is downloaded):

1. the digits are written as a small ImageFolder tree of PNGs (``<output>/data/{train,test}/<digit>/``), a
   stratified 80/20 split;
2. a ``small_cnn`` encoder is pre-trained with SimCLR on the training images, labels unused
   (:mod:`coretune.pretrain`), and its frozen features are scored by weighted kNN against a random encoder;
3. the pre-trained encoder is fine-tuned with CE-tuning and with Core-tuning on ``label_fraction`` (10%) of the
   training labels, once per seed, through the same :class:`~coretune.data.ImageClassificationData`,
   :class:`~coretune.engine.FineTuner` and :func:`~coretune.engine.make_trainer` as ``coretune fit``;
4. a table of test top-1 (mean ± std over seeds) and wall time is printed and saved to ``<output>/summary.md``
   and ``<output>/summary.json``, with the run directories (learning curves, metrics, checkpoints).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..extras import installed, need
from ..runs.atomic import strict_json
from ..runs.outputs import check_folder_output, mark_folder
from ..significance import PairedTest, paired_t_test

__all__ = ["DemoResult", "MethodResult", "main", "run_demo", "write_digits"]

METHODS = (("CE-tuning", "ce"), ("Core-tuning", "core"))
BACKBONE = "small_cnn"
PRETRAIN_EPOCHS = 30
FINETUNE_EPOCHS = 60
FINETUNE_LR = 0.01
FINETUNE_BATCH_SIZE = 32
FAST_PER_CLASS = 40


@dataclass
class MethodResult:
    """Test top-1 (in [0, 1]) and wall time of one fine-tuning method over seeds."""

    name: str
    objective: str
    top1: list[float] = field(default_factory=list)
    wall_time_s: list[float] = field(default_factory=list)
    run_dirs: list[str] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.top1)

    @property
    def std(self) -> float:
        return statistics.stdev(self.top1) if len(self.top1) > 1 else 0.0


@dataclass
class DemoResult:
    """Everything the demo measured; ``methods`` holds CE-tuning and Core-tuning."""

    output: str
    settings: dict[str, Any]
    pretrain_dir: str
    pretrain_time_s: float
    knn_random: float
    knn_pretrained: float
    methods: list[MethodResult]
    total_time_s: float = 0.0

    def paired(self) -> PairedTest:
        """Core-tuning's top-1 minus CE-tuning's, paired by seed (both methods train with the same seeds)."""
        return paired_t_test(self.methods[0].top1, self.methods[-1].top1)

    def paired_line(self) -> str:
        """``Core-tuning − CE-tuning: +0.65 points, paired over 3 seeds (t = 0.93, p = 0.45): within the seeds'
        noise``, as ``coretune bench`` reads a difference."""
        test, (a, b) = self.paired(), (self.methods[0].name, self.methods[-1].name)
        head = f"{b} − {a}: {100 * test.difference:+.2f} points, paired over {test.n} seed(s)"
        if test.n < 2:
            return f"{head}: one seed tells no noise from a difference"
        stat = (
            f"t = {test.t:.2f}, p = {test.p:.2g}" if not math.isnan(test.t) else f"every seed alike, p = {test.p:.2g}"
        )
        verdict = "beyond the seeds' noise" if test.beyond_noise() else "within the seeds' noise (a tie)"
        return f"{head} ({stat}): {verdict}"


def write_digits(root: str | Path, test_fraction: float = 0.2, seed: int = 0, per_class: int | None = None) -> Path:
    """Write scikit-learn's digits as ``root/{train,test}/<digit>/<index>.png`` (8×8 grey PNGs, 0–16 scaled to
    0–255), holding out a stratified ``test_fraction``; ``per_class`` keeps only the first images of each digit.
    A complete tree written with the same arguments is kept as it is."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from ..data import stratified_split

    root = Path(root)
    marker, stamp = root / ".complete", f"digits test_fraction={test_fraction} seed={seed} per_class={per_class}"
    if marker.is_file() and marker.read_text() == stamp:
        return root
    if marker.is_file() and marker.read_text().startswith("digits "):  # written before the demo marked its folders
        (root / _MARKER).touch()
    _fresh(root)
    digits = load_digits()
    rows = np.arange(len(digits.target))
    if per_class is not None:
        rows = np.concatenate([rows[digits.target == d][:per_class] for d in range(10)])
    keep, held = stratified_split(digits.target[rows], test_fraction, seed, name="test_fraction")
    pixels = np.rint(digits.images * 255 / 16).astype(np.uint8)
    for split, indices in (("train", rows[keep]), ("test", rows[held])):
        for i in indices:
            folder = root / split / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels[i], mode="L").save(folder / f"{i:04d}.png")
    marker.write_text(stamp)
    return root


@contextlib.contextmanager
def _demo_environment(num_threads: int | None) -> Iterator[None]:
    """torch CPU threads set to ``num_threads``, Lightning's per-run info messages and a known deprecation
    notice of Lightning silenced; all restored on exit."""
    import torch

    from ..engine import LIGHTNING_PYTREE_DEPRECATION

    previous_threads = torch.get_num_threads()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LIGHTNING_PYTREE_DEPRECATION)
            yield
    finally:
        torch.set_num_threads(previous_threads)
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


_MARKER = ".coretune-demo"
"""The file in every folder the demo makes: the only folders it removes to make them again."""


def _an_earlier_demo(output: Path) -> bool:
    """Whether ``output`` holds a demo from before the demo marked its output folder: its ``summary.json`` (naming
    its ``pretrain_dir``) or a folder it marked."""
    try:
        summary = json.loads((output / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    return (isinstance(summary, dict) and "pretrain_dir" in summary) or any(output.glob(f"*/{_MARKER}"))


def _adopt_earlier_demo(output: Path) -> None:
    """Mark the folders of a demo run before the demo marked its folders (its ``summary.json`` names its
    ``pretrain_dir``), so that ``make demo`` re-runs over them after an upgrade: ``data``, ``pretrain`` and the
    ``finetune/<objective>-seed<k>`` folders of its methods, not other folders a user put there."""
    try:
        summary = json.loads((output / "summary.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict) or "pretrain_dir" not in summary or "methods" not in summary:
        return
    finetuned = output / "finetune"
    runs = re.compile(rf"({'|'.join(objective for _, objective in METHODS)})-seed\d+")
    ours = [f for f in finetuned.iterdir() if runs.fullmatch(f.name)] if finetuned.is_dir() else []
    for folder in [output / "data", output / "pretrain", *ours]:
        if folder.is_dir() and not (folder / _MARKER).exists():
            (folder / _MARKER).write_text("made by coretune demo (an earlier version)\n")


def _fresh(folder: Path) -> Path:
    """An empty ``folder`` marked as the demo's: a previous demo folder of the same name is removed so its
    checkpoints and metrics do not mix in; a folder the demo did not make (no :data:`_MARKER`; ``--output`` naming
    a folder of other runs) is refused, never deleted.

    Raises:
        ValueError: ``folder`` holds files and was not made by the demo.
    """
    if folder.is_dir() and any(folder.iterdir()) and not (folder / _MARKER).is_file():
        raise ValueError(
            f"{folder} exists and was not made by coretune demo (it has no {_MARKER} file), which would replace it: "
            "pass another --output (a new or empty folder), or delete that folder first"
        )
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / _MARKER).write_text("made by coretune demo; it deletes and remakes this folder on its next run\n")
    return folder


def _knn_top1(weights: str | None, data_dir: Path, image_size: int) -> float:
    """Weighted kNN top-1 of the frozen encoder (all training labels, test split)."""
    from ..data import ImageClassificationData
    from ..models import create_backbone
    from .evaluation import evaluate_encoder

    encoder = create_backbone(BACKBONE, weights=weights, verbose=False)
    data = ImageClassificationData(root=str(data_dir), image_size=image_size, eval_batch_size=512)
    return evaluate_encoder(encoder, data, "knn").top1


def run_demo(
    output: str | Path = "runs/demo",
    seeds: int = 3,
    pretrain_epochs: int = PRETRAIN_EPOCHS,
    finetune_epochs: int = FINETUNE_EPOCHS,
    label_fraction: float = 0.1,
    image_size: int = 16,
    fast: bool = False,
    progress: bool = True,
    num_threads: int | None = 1,
) -> DemoResult:
    """Run the whole demo (see the module docstring) and return what it measured.

    ``fast`` shrinks it to 40 images per digit, 1 pre-training epoch, 2 fine-tuning epochs and at most 2 seeds
    (for tests).
    ``num_threads`` sets torch's CPU threads for the run (restored after): one thread is the fastest for these
    tiny models and, unlike several, does not slow down by orders of magnitude when other processes keep the
    cores busy. ``None`` keeps torch's setting.
    """
    import torch
    from rich.console import Console

    if fast:
        seeds, pretrain_epochs, finetune_epochs = min(seeds, 2), 1, 2
    if seeds < 1 or pretrain_epochs < 1 or finetune_epochs < 1:
        raise ValueError(
            f"seeds, pretrain_epochs and finetune_epochs must be >= 1, got {seeds}, {pretrain_epochs}, "
            f"{finetune_epochs}"
        )
    start = time.perf_counter()
    with _demo_environment(num_threads):
        console = Console()
        output = Path(output)
        check_folder_output(output, "demo", ours=_an_earlier_demo)
        _adopt_earlier_demo(output)
        mark_folder(output, "demo")
        data_dir = write_digits(output / "data", per_class=FAST_PER_CLASS if fast else None)
        settings = {
            "seeds": seeds,
            "pretrain_epochs": pretrain_epochs,
            "finetune_epochs": finetune_epochs,
            "label_fraction": label_fraction,
            "image_size": image_size,
            "backbone": BACKBONE,
            "num_threads": torch.get_num_threads(),
        }
        trainer_options = {"enable_model_summary": False, "enable_progress_bar": progress}
        console.print(f"data: {data_dir}/{{train,test}}/<digit>/*.png (scikit-learn's digits, 20% held out)")
        console.rule(f"[bold]1/3 SimCLR pre-training of {BACKBONE}, labels unused")
        pretrain_dir = output / "pretrain"
        t0 = time.perf_counter()
        weights = _pretrain(data_dir / "train", pretrain_dir, pretrain_epochs, image_size, trainer_options)
        pretrain_time = time.perf_counter() - t0
        knn_random = _knn_top1(None, data_dir, image_size)
        knn_pretrained = _knn_top1(weights, data_dir, image_size)
        console.print(
            f"kNN top-1 of frozen features: random encoder {100 * knn_random:.1f}%, "
            f"SimCLR encoder {100 * knn_pretrained:.1f}% (pre-training {pretrain_time:.0f} s)"
        )
        results = [MethodResult(name, objective) for name, objective in METHODS]
        for step, result in enumerate(results, start=2):
            console.rule(f"[bold]{step}/3 {result.name} on {label_fraction:.0%} of the labels, {seeds} seed(s)")
            for seed in range(seeds):
                run_dir = output / "finetune" / f"{result.objective}-seed{seed}"
                run = _finetune(
                    result.objective, weights, data_dir, run_dir, seed, finetune_epochs, label_fraction, image_size,
                    trainer_options,
                )  # fmt: skip
                result.top1.append(run["test"]["top1"])
                result.wall_time_s.append(run["wall_time_s"])
                result.run_dirs.append(str(run_dir))
                console.print(
                    f"{result.name} seed {seed}: test top-1 {100 * run['test']['top1']:.2f}% "
                    f"({run['wall_time_s']:.0f} s)  {run_dir}"
                )
        demo = DemoResult(
            str(output), settings, str(pretrain_dir), round(pretrain_time, 1), knn_random, knn_pretrained, results,
            round(time.perf_counter() - start, 1),
        )  # fmt: skip
        _report(demo, console)
        return demo


def _pretrain(images: Path, run_dir: Path, epochs: int, image_size: int, trainer_options: dict[str, Any]) -> str:
    """SimCLR on the unlabelled ``images``; returns the exported encoder checkpoint."""
    import lightning as L

    from ..pretrain import PRETRAINED_FILENAME, PretrainData, SimCLR, make_pretrain_trainer

    L.seed_everything(0, verbose=False)
    _fresh(run_dir)
    model = SimCLR(backbone=BACKBONE, temperature=0.2, lr=2e-3)
    # digits are not mirror-symmetric and have no hue: no flips, no hue jitter
    data = PretrainData(
        str(images), image_size=image_size, batch_size=256, crop_scale=(0.3, 1.0), flip_p=0.0, hue=0.0,
        cache_images=True,
    )  # fmt: skip
    make_pretrain_trainer(run_dir, max_epochs=epochs, **trainer_options).fit(model, data)
    return str(run_dir / PRETRAINED_FILENAME)


def _finetune(
    objective: str,
    weights: str,
    data_dir: Path,
    run_dir: Path,
    seed: int,
    epochs: int,
    label_fraction: float,
    image_size: int,
    trainer_options: dict[str, Any],
) -> dict[str, Any]:
    """One ``coretune fit``-equivalent run (validation once, at the end); returns its ``results.json``."""
    import lightning as L

    from .. import objectives
    from ..data import ImageClassificationData
    from ..engine import FineTuner, OptimSettings, make_trainer
    from ..runs.layout import RunDir

    L.seed_everything(seed, verbose=False)
    _fresh(run_dir)
    data = ImageClassificationData(
        root=str(data_dir), image_size=image_size, batch_size=FINETUNE_BATCH_SIZE, eval_batch_size=512,
        label_fraction=label_fraction, seed=seed,
    )  # fmt: skip
    model = FineTuner(
        objectives.create(objective),
        backbone=BACKBONE,
        weights=weights,
        optim=OptimSettings(lr=FINETUNE_LR, weight_decay=5e-4),
    )
    trainer = make_trainer(
        run_dir, progress=trainer_options["enable_progress_bar"], max_epochs=epochs, check_val_every_n_epoch=epochs,
        num_sanity_val_steps=0, **trainer_options,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)
    return json.loads(RunDir(run_dir).results.read_text())


def _summary_markdown(demo: DemoResult) -> str:
    s = demo.settings
    lines = [
        f"small_cnn pre-trained with SimCLR ({s['pretrain_epochs']} epochs, {demo.pretrain_time_s:.0f} s) on the "
        f"digits training images; kNN top-1 of frozen features: random encoder {100 * demo.knn_random:.1f}%, "
        f"pre-trained {100 * demo.knn_pretrained:.1f}%.",
        "",
        f"Fine-tuned on {s['label_fraction']:.0%} of the training labels for {s['finetune_epochs']} epochs at "
        f"{s['image_size']} px; test top-1 on the held-out 20% ({len(demo.methods[0].top1)} seeds):",
        "",
        "| method | top-1 (%) mean ± std | per seed | wall time per run (s) |",
        "|---|---|---|---|",
    ]
    for m in demo.methods:
        seeds = ", ".join(f"{100 * a:.1f}" for a in m.top1)
        lines.append(
            f"| {m.name} | {100 * m.mean:.2f} ± {100 * m.std:.2f} | {seeds} | {statistics.fmean(m.wall_time_s):.1f} |"
        )
    lines += ["", demo.paired_line() + ".", "", f"Total demo time: {demo.total_time_s:.0f} s."]
    return "\n".join(lines) + "\n"


def _report(demo: DemoResult, console: Any) -> None:
    from rich.table import Table

    output = Path(demo.output)
    table = Table(
        title=f"digits, {demo.settings['label_fraction']:.0%} labels, {len(demo.methods[0].top1)} seed(s): test top-1"
    )
    for column in ("method", "top-1 (%)", "per seed", "wall time / run"):
        table.add_column(column)
    for m in demo.methods:
        table.add_row(
            m.name,
            f"{100 * m.mean:.2f} ± {100 * m.std:.2f}",
            ", ".join(f"{100 * a:.1f}" for a in m.top1),
            f"{statistics.fmean(m.wall_time_s):.1f} s",
        )
    console.print(table)
    console.print(demo.paired_line(), highlight=False)
    summary = asdict(demo)
    for entry, m in zip(summary["methods"], demo.methods, strict=True):
        entry.update(mean_top1=m.mean, std_top1=m.std)
    summary["paired_difference"] = asdict(demo.paired()) | {"beyond_noise": demo.paired().beyond_noise()}
    (output / "summary.json").write_text(strict_json(summary, indent=2) + "\n")
    (output / "summary.md").write_text(_summary_markdown(demo))
    curve = "learning_curve.png, " if installed("matplotlib") else ""  # drawn with the plots extra only
    console.print(f"pre-training run: {demo.pretrain_dir} (pretrained.pth.tar, {curve}metrics.csv)")
    console.print(
        f"fine-tuning runs: {output / 'finetune'}/<method>-seed<k>/ ({curve}metrics.csv, results.json, checkpoints/)"
    )
    console.print(f"summary: {output / 'summary.md'}, {output / 'summary.json'}   total time {demo.total_time_s:.0f} s")


def _parser() -> Any:
    from jsonargparse import ActionYesNo

    from ..arguments import ArgumentParser

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune demo",
        description="SimCLR pre-training on scikit-learn's digits, then CE-tuning vs Core-tuning on 10% of "
        "the labels over several seeds (a few minutes on a CPU; nothing is downloaded).",
    )
    parser.add_argument("--output", type=str, default="runs/demo", help="Folder for the data, runs and summary.")
    parser.add_argument("--seeds", type=int, default=3, help="Number of fine-tuning seeds per method.")
    parser.add_argument("--pretrain_epochs", type=int, default=PRETRAIN_EPOCHS, help="SimCLR epochs.")
    parser.add_argument("--finetune_epochs", type=int, default=FINETUNE_EPOCHS, help="Fine-tuning epochs per run.")
    parser.add_argument("--label_fraction", type=float, default=0.1, help="Share of training labels used.")
    parser.add_argument("--image_size", type=int, default=16, help="Network input side (digits are 8 px).")
    parser.add_argument(
        "--fast",
        action=ActionYesNo,
        default=False,
        help="A shrunken run for tests: 40 images per digit, 1 pre-training epoch, 2 fine-tuning epochs, <= 2 seeds.",
    )
    parser.add_argument("--progress", action=ActionYesNo, default=True, help="Show progress bars (--no_progress).")
    parser.add_argument(
        "--num_threads", type=int | None, default=1, help="torch CPU threads (1: fastest for these tiny models)."
    )
    return parser


def main(args: list[str] | None = None) -> DemoResult:
    """Entry point of ``coretune demo``."""
    cfg = _parser().parse_args(args if args is not None else [])
    need("sklearn", "coretune demo")  # its data: scikit-learn's digits
    return run_demo(
        cfg.output, cfg.seeds, cfg.pretrain_epochs, cfg.finetune_epochs, cfg.label_fraction, cfg.image_size,
        cfg.fast, cfg.progress, cfg.num_threads,
    )  # fmt: skip
