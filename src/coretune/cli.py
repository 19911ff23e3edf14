"""The ``coretune`` command line. Thin: it parses, builds and hands over; Python can do all of it by the same names.

``coretune fit`` is a LightningCLI (YAML configs, ``--help`` with every default); ``--objective NAME`` takes a
registered objective name (``coretune objectives`` lists them) and ``--objective.<param>`` its hyper-parameters.
"""

from __future__ import annotations

import contextlib
import errno
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser

from . import __version__, objectives
from .bench import SweepInterrupted
from .data import ImageClassificationData
from .data.datasets import OnBadImage
from .engine import (
    FineTuner,
    NonFiniteLossError,
    RunDirCLI,
    TrainingInterrupted,
    check_trainer_options,
    default_callbacks,
    default_precision,
    quiet_lightning,
    with_atomic_io,
)
from .models import require_checkpoint_file
from .runclaim import RunInUse

__all__ = ["main"]

_USAGE = """usage: coretune COMMAND [options]

commands:
  fit         fine-tune a backbone on an image folder (coretune fit --help)
  test        evaluate a fine-tuned checkpoint on a data split
  predict     predict the classes of an image folder into a CSV
  export      export a fine-tuned checkpoint to safetensors + JSON config, torch.export, TorchScript (and ONNX)
  objectives  list the fine-tuning methods (objectives)
  pretrain    contrastive pre-training (SimCLR, MoCo v2) on an unlabelled image folder
  eval        kNN or linear-probe accuracy of a backbone and checkpoint (coretune eval knn|linear --help)
  demo        run the embedded demo end to end
  bench       run a grid of fit runs from a YAML spec; mean ± std tables and plots (coretune bench CONFIG.yaml)
  tune        choose η and α with an Optuna study on a validation split (coretune tune [options] -- FIT_ARGS)

options:
  -V, --version  print coretune's version
"""


def _objective_class_path(name: str) -> tuple[str, list[str]]:
    """Class path and preset arguments of a registered objective name (class paths pass through)."""
    if name in objectives.available():
        cls, preset = objectives.get(name)
        args = [f"--objective.{k}={_cli_value(v)}" for k, v in preset.items()]
        return f"{cls.__module__}.{cls.__qualname__}", args
    if "." not in name and name not in {objectives.get(n)[0].__name__ for n in objectives.available()}:
        objectives.get(name)  # neither a name nor a class (path): "unknown objective 'x'; choose one of: ..."
    return name, []


def _cli_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _translate_config(path: str) -> str:
    """A ``--config`` value whose ``objective`` names a registered objective (``objective: core`` or
    ``objective: {class_path: ce_con, init_args: {...}}``), rewritten as the YAML text of the same config with the
    class path and the preset's settings (the file's own ``init_args`` win). Other configs pass through."""
    file = Path(path)
    if not file.is_file():
        return path
    config = yaml.safe_load(file.read_text())
    spec = config.get("objective") if isinstance(config, dict) else None
    name = spec if isinstance(spec, str) else spec.get("class_path") if isinstance(spec, dict) else None
    if not isinstance(name, str) or name not in objectives.available():
        return path
    cls, preset = objectives.get(name)
    init_args = {**preset, **(spec.get("init_args") or {} if isinstance(spec, dict) else {})}
    config["objective"] = {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
    return yaml.safe_dump(config, sort_keys=False)


def translate_args(args: list[str]) -> list[str]:
    """Rewrite the friendly aliases: ``--objective NAME`` (registry names and Table 2 presets, also inside
    ``--config`` files), ``--seed N``."""
    out: list[str] = []
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--config", "-c"):
            out.append(f"--config={_translate_config(value if eq else next(it, ''))}")
        elif key in ("--objective", "--objective.help"):
            value = value if eq else next(it, "")
            class_path, preset = _objective_class_path(value)
            out.append(f"{key}={class_path}")
            if key == "--objective":
                out.extend(preset)
        elif key == "--seed":
            out.append(f"--seed_everything={value if eq else next(it, '')}")
        else:
            out.append(arg)
    return out


class FitCLI(RunDirCLI):
    """``coretune fit``: a LightningCLI over :class:`FineTuner` and :class:`ImageClassificationData`."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_subclass_arguments(
            objectives.Objective,
            "objective",
            default={"class_path": "coretune.objectives.CETuning"},
            help="Fine-tuning method: a registered name (" + ", ".join(objectives.available()) + ") or class path.",
        )
        parser.link_arguments("objective", "model.objective", apply_on="instantiate")
        parser.link_arguments("seed_everything", "data.seed")
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help="Run directory (default: runs/<objective>-<date>-<time>). Reuse it to resume from its "
            "checkpoints/last.ckpt (a finished run is only tested again), with the settings it was trained with "
            "(--config RUN/config.yaml; only max_epochs, hardware, precision, progress and loader options may "
            "change). Refused while another fit or sweep runs it (its claim, fit.pid).",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        check_trainer_options(config["trainer"])
        self.settle_run_dir(str(config["objective"]["class_path"]).rsplit(".", 1)[-1].lower())

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer = self._get(self.config_init, "trainer", default={})
        show_progress = trainer.get("enable_progress_bar") is not False
        self.trainer_defaults["callbacks"] = default_callbacks(None, progress=show_progress)
        kwargs["plugins"] = with_atomic_io(trainer.get("plugins"))
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            return
        self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.is_global_zero:
            _print_run_summary(Path(self.trainer.default_root_dir))


def _print_run_summary(run_dir: Path) -> None:
    import json

    from rich.console import Console

    results = json.loads((run_dir / "results.json").read_text())
    test = results.get("test", {})
    console = Console()
    console.print(f"[bold]run directory[/bold]: {run_dir}")
    if test:
        console.print(
            f"top-1 {100 * test['top1']:.2f}%  top-5 {100 * test['top5']:.2f}%  "
            f"({results.get('train_images_per_s')} train images/s, {results.get('wall_time_s')} s)"
        )
    console.print(f"metrics: {run_dir / 'metrics.csv'}   curves: {run_dir / 'learning_curve.png'}")
    if results.get("validated_on_test_images") and results.get("best_checkpoint"):
        console.print(
            "[yellow]note[/yellow]: validation read the test images (no separate val/ folder and no "
            "--data.val_fraction), so best.ckpt and best_val_top1 were chosen on the test set; the top-1 above is "
            "the final model's. To choose a checkpoint or setting, hold out a validation split: --data.val_fraction "
            "0.1",
            highlight=False,
        )


def fit(args: list[str]) -> None:
    quiet_lightning()
    FitCLI.run(
        FineTuner,
        ImageClassificationData,
        args=["fit", *translate_args(args)],
        seed_everything_default=0,
        trainer_defaults={"precision": default_precision(), "logger": False},
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"allow_abbrev": False, "fit": {"default_env": False, "allow_abbrev": False}},
        auto_configure_optimizers=False,
    )


class FitArgsError(ValueError):
    """``coretune fit`` would refuse these arguments at its start; the message is its error."""


def resolved_fit_config(args: Sequence[str]) -> dict[str, Any]:
    """The configuration ``coretune fit ARGS`` would run with (its ``--print_config``, configs and presets applied),
    without running it. Raises :class:`FitArgsError` with fit's own message when it would refuse the arguments (an
    unknown option or objective, a value of the wrong type, an unreadable config file, a data folder or
    ``--model.weights`` file that does not exist; no image or checkpoint is read)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            fit([*args, "--print_config"])
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            message = err.getvalue().rpartition("error:")[2] or f"it exits with {exit_.code}"
            raise FitArgsError(" ".join(message.split())) from None
    except (ValueError, OSError, yaml.YAMLError) as error:
        raise FitArgsError(" ".join(str(error).split())) from None
    config = yaml.safe_load(out.getvalue()) or {}
    try:
        _check_local_paths(config)
    except ValueError as error:
        raise FitArgsError(" ".join(str(error).split())) from None
    return config


def _check_local_paths(config: dict[str, Any]) -> None:
    """The data folders and the pre-trained checkpoint file of a resolved fit config exist (DataError or
    CheckpointError, both ValueErrors, otherwise)."""
    if "data" in config:
        ImageClassificationData(**config["data"]).check_folders()
    if weights := config.get("model", {}).get("weights"):
        require_checkpoint_file(weights)


def _test_parser() -> ArgumentParser:
    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune test",
        description="Evaluate a fine-tuned checkpoint on a data split; writes the results to a JSON file of their own "
        "(the run's results.json, the fit's, is left as it is).",
    )
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt written by coretune fit.")
    parser.add_class_arguments(ImageClassificationData, "data")
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help="JSON file to write the results to (default: test_results.json in the checkpoint's run directory, the "
        "folder holding its checkpoints/ folder, or beside the checkpoint).",
    )
    parser.add_argument("--precision", type=str, default=default_precision())
    return parser


def test(args: list[str]) -> None:
    import json

    import lightning as L

    from .engine import atomic_write

    cfg = _test_parser().parse_args(args)
    ckpt = Path(cfg.ckpt_path).resolve()
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    output = Path(cfg.output) if cfg.output else run_dir / "test_results.json"
    if output.name == "results.json" and output.is_file():
        raise ValueError(
            f"--output {output} would overwrite a fit's results.json, which coretune test leaves as it is: "
            "give another file name"
        )
    model = FineTuner.from_checkpoint(cfg.ckpt_path)
    data = ImageClassificationData(**cfg.data.as_dict())
    trainer = L.Trainer(
        default_root_dir=str(output.parent), precision=cfg.precision, logger=False, enable_checkpointing=False
    )
    trainer.test(model, datamodule=data)
    results = {"checkpoint": str(ckpt), "data": cfg.data.as_dict(), "test": model.test_results}
    with atomic_write(output) as f:
        f.write(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"test results: {output}")


def _predict_parser() -> ArgumentParser:
    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune predict",
        description="Predict every image under a folder; write a CSV of classes and probabilities.",
    )
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt written by coretune fit.")
    parser.add_argument("--input", type=str, required=True, help="Folder of images (searched recursively).")
    parser.add_argument("--output", type=str, default="predictions.csv", help="CSV file to write.")
    parser.add_argument("--image_size", type=int | None, default=None, help="Default: the training image size.")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument(
        "--on_bad_image",
        "--data.on_bad_image",
        type=OnBadImage,
        default="error",
        help="Unreadable image files: 'error' stops at the first (the output file is left as it was); 'skip' decodes "
        "every file first, leaves the unreadable ones out of the CSV and lists them in one warning.",
    )
    return parser


def predict(args: list[str]) -> None:
    from .predict import predict_folder

    cfg = _predict_parser().parse_args(args)
    out = predict_folder(
        cfg.ckpt_path,
        cfg.input,
        cfg.output,
        image_size=cfg.image_size,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        on_bad_image=cfg.on_bad_image,
    )
    print(f"predictions: {out}")


def export(args: list[str]) -> None:
    from .export import export_checkpoint

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune export",
        description="Export a fine-tuned model: model.safetensors + config.json, torch.export, TorchScript and ONNX.",
    )
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt written by coretune fit.")
    parser.add_argument("--output", type=str, required=True, help="Folder to write the exported files into.")
    parser.add_argument(
        "--exported_program", type=bool, default=True, help="Also write model.pt2 (torch.export, dynamic batch)."
    )
    parser.add_argument("--torchscript", type=bool, default=True, help="Also write model.torchscript.pt.")
    parser.add_argument(
        "--onnx", type=bool, default=False, help="Also write model.onnx (dynamic batch; pip install 'coretune[onnx]')."
    )
    cfg = parser.parse_args(args)
    for path in export_checkpoint(
        cfg.ckpt_path, cfg.output, torchscript=cfg.torchscript, exported_program=cfg.exported_program, onnx=cfg.onnx
    ):
        print(path)


def list_objectives(args: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "method")
    for name, doc in objectives.available().items():
        table.add_row(name, doc)
    Console().print(table)


def pretrain(args: list[str]) -> None:
    from .pretrain.cli import run

    run(args)


def _eval_parser() -> ArgumentParser:
    from typing import Literal

    from .evaluation import DEFAULT_WEIGHT_DECAYS

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune eval",
        description="Frozen-feature evaluation of a backbone and checkpoint (paper Appendix D): weighted kNN "
        "(InstDisc: cosine similarity, votes exp(s/τ)) or a linear probe (L2-regularised logistic regression "
        "on standardised features, λ chosen on a 20% hold-out of the training features). Features of the "
        "training split (evaluation transform) are the memory bank / probe data; the test split is scored.",
    )
    parser.add_argument("protocol", type=Literal["knn", "linear"], help="knn or linear.")
    parser.add_argument(
        "--backbone",
        type=str | None,
        default=None,
        help="Backbone name (default: the 'arch' or backbone stored in --weights).",
    )
    parser.add_argument(
        "--weights",
        type=str | None,
        default=None,
        help="Checkpoint: pre-trained (coretune pretrain, MoCo, SimCLR …) or fine-tuned.",
    )
    parser.add_argument("--weights_format", type=str, default="auto", help="Checkpoint layout (auto).")
    parser.add_class_arguments(ImageClassificationData, "data")
    parser.add_argument("--k", type=int, default=20, help="kNN: number of neighbours.")
    parser.add_argument("--temperature", type=float, default=0.07, help="kNN: temperature τ of the votes.")
    parser.add_argument(
        "--weight_decay",
        type=list[float],
        default=list(DEFAULT_WEIGHT_DECAYS),
        help="Linear probe: L2 strength λ, or a grid to choose from on a hold-out.",
    )
    parser.add_argument("--device", type=str | None, default=None, help="Default: cuda if available, or cpu.")
    parser.add_argument("--output", type=str | None, default=None, help="Also write the result to this JSON.")
    return parser


def _stored_backbone(weights: str) -> str:
    """The backbone name a checkpoint records: MoCo/SimCLR ``arch``, or a coretune run's hyper-parameters."""
    from .models import load_checkpoint_file

    raw = load_checkpoint_file(weights)
    name = None
    if isinstance(raw, dict):
        name = raw.get("arch") or raw.get("hyper_parameters", {}).get("backbone")
    if not isinstance(name, str):
        raise ValueError(f"{weights} does not record its backbone: pass --backbone (e.g. resnet50)")
    return name


def evaluate(args: list[str]) -> None:
    import json

    import torch
    from rich.console import Console

    from .evaluation import evaluate_encoder
    from .models import create_backbone

    cfg = _eval_parser().parse_args(args)
    if cfg.backbone is None and cfg.weights is None:
        raise ValueError("pass --backbone (and --weights for a pre-trained checkpoint)")
    backbone = cfg.backbone or _stored_backbone(cfg.weights)
    encoder = create_backbone(backbone, weights=cfg.weights, weights_format=cfg.weights_format)
    data = ImageClassificationData(**cfg.data.as_dict())
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = evaluate_encoder(
        encoder,
        data,
        cfg.protocol,
        k=cfg.k,
        temperature=cfg.temperature,
        weight_decay=cfg.weight_decay,
        device=device,
    )
    top5 = f", top-5 {100 * result.top5:.2f}%" if result.top5 is not None else ""
    Console().print(
        f"[bold]{cfg.protocol}[/bold] {backbone} ({cfg.weights or 'random init'}): top-1 "
        f"{100 * result.top1:.2f}%{top5} on {result.num_test} test images "
        f"({result.num_train} training images; {result.settings})",
        highlight=False,
    )
    if cfg.output:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(
            json.dumps({"backbone": backbone, "weights": cfg.weights, **result.__dict__}, indent=2) + "\n"
        )


def demo(args: list[str]) -> None:
    from .demo import main as demo_main

    demo_main(args)


def bench(args: list[str]) -> None:
    from .bench import main as bench_main

    bench_main(args)


def tune(args: list[str]) -> None:
    from .tune import main as tune_main

    tune_main(args)


COMMANDS = {
    "fit": fit,
    "test": test,
    "predict": predict,
    "export": export,
    "objectives": list_objectives,
    "pretrain": pretrain,
    "eval": evaluate,
    "demo": demo,
    "bench": bench,
    "tune": tune,
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return
    if argv[0] in ("-V", "--version"):
        print(f"coretune {__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        sys.exit(f"coretune: unknown command {command!r}\n\n{_USAGE}")
    try:
        COMMANDS[command](rest)
    except (TrainingInterrupted, SweepInterrupted) as err:
        print(f"coretune {command}: {err}", file=sys.stderr)
        sys.exit(128 + err.signum)  # the shell convention for "ended by signal N"
    except (*_USER_ERRORS, RuntimeError) as err:
        if command in ("fit", "pretrain") and not isinstance(err, _USER_ERRORS):
            raise  # a bug, not a user error: keep the traceback
        sys.exit(f"coretune {command}: error: {_error_message(err)}")


_USER_ERRORS = (ValueError, OSError, NonFiniteLossError, RunInUse)
"""What a user can cause and fix: bad options, data, checkpoints (all ``ValueError``s), files and disks
(``OSError``), a diverging loss, a run directory another process is running. ``coretune`` prints their message
alone; anything else keeps its traceback."""


def _error_message(err: BaseException) -> str:
    text = str(err)
    if "\nOriginal Traceback" in text:  # re-raised from a DataLoader worker: keep the original exception's line
        text = text.rstrip().splitlines()[-1].partition(": ")[2] or text
    if text.startswith("Does not validate against any of the Union subtypes"):
        # jsonargparse wraps the error of a class chosen by class_path (`coretune pretrain --method …`) in the
        # errors of every type it tried; keep the class's own message.
        tried = [line.strip()[2:] for line in text.splitlines() if line.startswith("  - ")]
        text = "; ".join(m for m in tried if not m.startswith("Expected a <class 'NoneType'>")) or text
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        text += " — free disk space, then run the same command again to resume (the last complete checkpoint is intact)"
    return text


if __name__ == "__main__":
    main()
