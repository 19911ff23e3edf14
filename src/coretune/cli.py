"""The ``coretune`` command line. Thin: it parses, builds and hands over; Python can do all of it by the same names.

Each command imports what it runs when it runs: ``coretune fit`` is :mod:`coretune.engine.fitcli` (a LightningCLI),
``bench``, ``tune`` and ``compare`` are :mod:`coretune.sweeps`, ``pretrain`` is :mod:`coretune.pretrain.cli`.
"""

from __future__ import annotations

import errno
import sys
from typing import Any

from .arguments import ArgumentParser
from .runs.atomic import strict_json

__all__ = ["main"]

_USAGE = """usage: coretune COMMAND [options]

commands:
  fit         fine-tune a backbone on an image folder (coretune fit --help)
  test        evaluate a fine-tuned checkpoint on the test split (test_results.json)
  validate    evaluate a fine-tuned checkpoint on the validation split (val_results.json)
  predict     predict an image folder: classes into a CSV, or segmentation masks into a folder
  interpolate WiSE-FT: interpolate a start and a fine-tuned checkpoint, α chosen on validation (a new .ckpt)
  export      export a fine-tuned checkpoint: safetensors + JSON config, torch.export, TorchScript, ONNX (--format)
  objectives  list the fine-tuning methods (objectives)
  pretrain    contrastive pre-training (SimCLR, MoCo v2) on an unlabelled image folder
  eval        kNN or linear-probe accuracy of a backbone and checkpoint (coretune eval knn|linear --help), or
              clean and robust accuracy of a fine-tuned checkpoint under PGD / AutoAttack (coretune eval robust)
  demo        run the embedded demo end to end
  bench       run a grid of fit runs from a YAML spec; mean ± std tables and plots (coretune bench CONFIG.yaml)
  tune        choose η and α with an Optuna study on a validation split (coretune tune [options] -- FIT_ARGS)
  compare     which method to use on your data: methods × seeds on a validation split, a paired table and a
              recommendation (coretune compare --data.root DIR --model.weights CKPT [--methods ce,ce_mix,core])

options:
  -V, --version  print coretune's version
"""


def fit(args: list[str]) -> None:
    from .engine.fitcli import fit as run_fit

    run_fit(args)


def test(args: list[str]) -> None:
    from .apps.scoring import score

    score("test", args)


def validate(args: list[str]) -> None:
    from .apps.scoring import score

    score("validate", args)


def _predict_parser() -> ArgumentParser:
    from .apps.devices import add_trainer_arguments
    from .apps.posthoc import add_posthoc_argument
    from .data.datasets import OnBadImage
    from .data.loading import NumWorkers
    from .runs.config import add_config_argument

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune predict",
        description="Predict every image under a folder as the checkpoint's task does: a CSV of classes and "
        "probabilities (classification), or one palette PNG mask per image (segmentation).",
    )
    add_config_argument(parser)
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt written by coretune fit.")
    parser.add_argument(
        "--input", type=str, required=True, help="Folder of images (searched recursively), or one image file."
    )
    parser.add_argument(
        "--output",
        type=str | None,
        default=None,
        help="CSV file to write (default predictions.csv); for segmentation, the folder of masks (default "
        "predictions/).",
    )
    parser.add_argument(
        "--overlay",
        type=bool,
        default=False,
        help="Segmentation: also write <image>_overlay.png, the image with its mask's colours blended in.",
    )
    parser.add_argument(
        "--data.image_size",
        type=int | None,
        default=None,
        help="Default: the training image size (segmentation: each image at its own size).",
    )
    parser.add_argument("--data.batch_size", type=int, default=64, help="Images predicted at a time, on the device.")
    parser.add_argument(
        "--data.num_workers",
        type=NumWorkers,
        default="auto",
        help="Loader processes: auto is none on the CPU, a worker per CPU core (up to 8) with pinned memory on CUDA.",
    )
    parser.add_argument(
        "--data.on_bad_image",
        type=OnBadImage,
        default="error",
        help="Unreadable image files: 'error' stops at the first (the output file is left as it was); 'skip' decodes "
        "every file first, leaves the unreadable ones out of the CSV and lists them in one warning.",
    )
    add_posthoc_argument(parser)
    add_trainer_arguments(parser, what="the model")
    return parser


def predict(args: list[str]) -> None:
    from .apps.predict import predict_folder
    from .apps.vocabulary import translate
    from .runs.config import config_files, parse_with_config

    args = translate("predict", args)
    cfg = parse_with_config(_predict_parser(), args, loose=("data",))
    out = predict_folder(
        cfg.ckpt_path,
        cfg.input,
        cfg.output,
        image_size=cfg.data.image_size,
        batch_size=cfg.data.batch_size,
        num_workers=cfg.data.num_workers,
        on_bad_image=cfg.data.on_bad_image,
        overlay=cfg.overlay,
        config_files=config_files(args),
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        precision=cfg.trainer.precision,
        posthoc_adjustment=cfg.posthoc_adjustment,
    )
    print(f"predictions: {out}")


#: ``coretune export``'s options from before ``--format``: each adds (true) or drops (false) one format.
_LEGACY_EXPORT_FLAGS = {"exported_program": "pt2", "torchscript": "torchscript", "onnx": "onnx"}
#: The default formats of the versions those options come from: they keep writing the files they wrote then.
_LEGACY_DEFAULT_FORMATS = ("safetensors", "pt2", "torchscript")


def export(args: list[str]) -> None:
    import argparse

    from .apps.devices import add_trainer_arguments
    from .apps.export import DEFAULT_FORMATS, EXPORT_FORMATS, export_checkpoint
    from .apps.posthoc import add_posthoc_argument
    from .runs.config import add_config_argument, config_files, parse_with_config

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune export",
        description="Export a fine-tuned model: config.json plus model.safetensors, torch.export (model.pt2), "
        "TorchScript, ONNX and a timm model folder (timm/), as --format selects. Each file is read back and checked "
        "against the checkpoint's model, in float32, on --trainer.accelerator.",
    )
    add_config_argument(parser)
    parser.add_argument("--ckpt_path", type=str, required=True, help="A .ckpt written by coretune fit.")
    parser.add_argument("--output", type=str, required=True, help="Folder to write the exported files into.")
    parser.add_argument(
        "--format",
        type=list[str] | str | None,
        default=None,
        help=f"The formats to write, of {', '.join(EXPORT_FORMATS)}: one (--format onnx), several "
        "(--format onnx,pt2, or --format+ onnx --format+ pt2). Default: "
        f"{','.join(DEFAULT_FORMATS)}. ONNX needs pip install 'coretune[onnx]'.",
    )
    add_trainer_arguments(parser, what="the read-back check (ONNX's on the CPU; the files are float32 either way)")
    parser.set_defaults({"trainer.accelerator": "cpu"})
    add_posthoc_argument(parser)
    for flag in _LEGACY_EXPORT_FLAGS:  # deprecated: not in --help
        parser.add_argument(f"--{flag}", type=bool | None, default=None, help=argparse.SUPPRESS)
    if sum(arg == "--format" or arg.startswith("--format=") for arg in args) > 1:
        raise ValueError(
            "--format is given more than once: list the formats in one (--format onnx,pt2) or append with "
            "--format+ (--format+ onnx --format+ pt2)"
        )
    cfg = parse_with_config(parser, args)
    legacy = {flag: cfg[flag] for flag in _LEGACY_EXPORT_FLAGS if cfg[flag] is not None}
    formats = DEFAULT_FORMATS if cfg.format is None else cfg.format
    if legacy:
        given = " and ".join(f"--{flag} {str(on).lower()}" for flag, on in legacy.items())
        if cfg.format is not None:
            raise ValueError(f"{given} and --format both given: {given} is deprecated, list the formats in --format")
        drop = {_LEGACY_EXPORT_FLAGS[flag] for flag, on in legacy.items() if not on}
        add = {_LEGACY_EXPORT_FLAGS[flag] for flag, on in legacy.items() if on}
        formats = [
            name for name in EXPORT_FORMATS if name not in drop and (name in _LEGACY_DEFAULT_FORMATS or name in add)
        ]
        print(
            f"coretune export: {given} is deprecated and will be removed in the next release: use --format "
            f"{','.join(formats)}",
            file=sys.stderr,
        )
    trainer = cfg.trainer
    written = export_checkpoint(
        cfg.ckpt_path,
        cfg.output,
        formats=formats,
        config_files=config_files(args),
        accelerator=trainer.accelerator,
        devices=trainer.devices,
        precision=trainer.precision,
        posthoc_adjustment=cfg.posthoc_adjustment,
    )
    for path in written:
        print(path)


def interpolate(args: list[str]) -> None:
    from .apps.interpolate import interpolate as run_interpolate

    run_interpolate(args)


def list_objectives(args: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from . import objectives

    ArgumentParser(prog="coretune objectives", description="List the fine-tuning methods (objectives).").parse_args(
        args
    )
    table = Table("name", "method")
    for name, doc in objectives.available().items():
        table.add_row(name, doc)
    Console().print(table)


def pretrain(args: list[str]) -> None:
    from .pretrain.cli import run

    run(args)


def _eval_parser() -> ArgumentParser:
    from typing import Literal

    from .apps.devices import add_trainer_arguments
    from .apps.evaluation import DEFAULT_WEIGHT_DECAYS
    from .data import ImageClassificationData
    from .runs.config import add_config_argument

    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune eval",
        description="Frozen-feature evaluation of a backbone and checkpoint (paper Appendix D): weighted kNN "
        "(InstDisc: cosine similarity, votes exp(s/τ)) or a linear probe (L2-regularised logistic regression "
        "on standardised features, λ chosen on a 20% hold-out of the training features). Features of the "
        "training split (evaluation transform) are the memory bank / probe data; the test split is scored.",
    )
    add_config_argument(parser)
    parser.add_argument(
        "protocol", type=Literal["knn", "linear"], help="knn or linear (robust: see coretune eval robust --help)."
    )
    parser.add_argument(
        "--ckpt_path",
        type=str | None,
        default=None,
        help="A .ckpt written by coretune fit: its fine-tuned backbone is evaluated (or --model.weights).",
    )
    parser.add_argument(
        "--model.backbone",
        type=str | None,
        default=None,
        help="Backbone name (default: the 'arch' or backbone stored in --model.weights or --ckpt_path).",
    )
    parser.add_argument(
        "--model.weights",
        type=str | None,
        default=None,
        help="Pre-trained weights (coretune pretrain, MoCo, SimCLR …, a file, hub or timm name).",
    )
    parser.add_argument(
        "--model.backbone_args",
        type=dict[str, Any] | None,
        default=None,
        help="Options of the backbone's constructor, as coretune fit's and pretrain's, e.g. a ViT pre-trained on "
        "32-px images with 4-px patches: '{img_size: 32, patch_size: 4}' (or --model.backbone_args.patch_size 4). "
        "Default: those a coretune .ckpt records when the backbone's name is read from it, else none.",
    )
    parser.add_argument("--model.weights_options.format", type=str, default="auto", help="Checkpoint layout (auto).")
    parser.add_argument(
        "--model.weights_options.allow_cast",
        type=bool,
        default=False,
        help="Load weights whose floating-point tensors are stored as integers (or quantised), converted.",
    )
    parser.add_class_arguments(ImageClassificationData, "data")
    parser.add_argument("--k", type=int, default=20, help="kNN: number of neighbours.")
    parser.add_argument("--temperature", type=float, default=0.07, help="kNN: temperature τ of the votes.")
    parser.add_argument(
        "--weight_decay",
        type=list[float],
        default=list(DEFAULT_WEIGHT_DECAYS),
        help="Linear probe: L2 strength λ, or a grid to choose from on a hold-out.",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of a backbone's random initialisation (without weights: the floor) and of the probe's hold-out.",
    )
    add_trainer_arguments(parser, what="the backbone extracts features")
    parser.add_argument("--output", type=str | None, default=None, help="Also write the result to this JSON.")
    return parser


def _stored_backbone(weights: str, option: str) -> tuple[str, dict[str, Any]]:
    """The backbone name a checkpoint records: MoCo/SimCLR ``arch``, or a coretune run's hyper-parameters (old
    spellings as now); for timm weights (``resnet50.a1_in1k``), that timm name; for ``hf-hub:ORG/REPO``, the same.
    With it, the constructor options the checkpoint records (a coretune ``.ckpt``'s ``backbone_args``, fit's or
    pretrain's; ``{}`` for the others)."""
    from .models import current_backbone_name, is_weights_name, load_checkpoint_file, named_weights, resolve_weights
    from .models.hubnames import timm_backbone

    name = str(named_weights(weights, None))
    if is_weights_name(name):
        return timm_backbone(name), {}  # the timm model (or hub repository) the weights are of
    raw = load_checkpoint_file(resolve_weights(weights))
    found, options = None, None
    if isinstance(raw, dict):
        hparams = raw.get("hyper_parameters") or {}
        found = raw.get("arch") or (hparams.get("backbone") if isinstance(hparams, dict) else None)
        options = hparams.get("backbone_args") if not raw.get("arch") and isinstance(hparams, dict) else None
    if not isinstance(found, str):
        raise ValueError(f"{option} {weights} does not record its backbone: pass --model.backbone (e.g. resnet50)")
    if options is not None and not (isinstance(options, dict) and all(isinstance(k, str) for k in options)):
        raise ValueError(
            f"{option} {weights} records backbone_args {options!r}, not options by name: pass --model.backbone and "
            "--model.backbone_args"
        )
    return current_backbone_name(found, warn=False), dict(options or {})


def evaluate(args: list[str]) -> None:
    import warnings

    if args[:1] == ["robust"]:
        from .apps.robustness import evaluate_robust

        evaluate_robust(args[1:])
        return

    import torch
    from rich.console import Console

    from .apps.devices import placement_of
    from .apps.evaluation import evaluate_encoder
    from .apps.scoring import written_by
    from .apps.vocabulary import translate
    from .data import DataError, ImageClassificationData
    from .data.transforms import other_normalisation
    from .engine import atomic_write
    from .models import create_backbone, weights_digest
    from .runs.config import config_files, parse_with_config
    from .runs.outputs import check_file_output, data_paths

    args = translate("eval", args)
    cfg = parse_with_config(_eval_parser(), args)
    if cfg.ckpt_path is not None and cfg.model.weights is not None:
        raise ValueError(
            f"--ckpt_path {cfg.ckpt_path} and --model.weights {cfg.model.weights} both given: pass --ckpt_path for a "
            "fine-tuned checkpoint or --model.weights for pre-trained weights"
        )
    weights, option = (
        (cfg.ckpt_path, "--ckpt_path") if cfg.ckpt_path is not None else (cfg.model.weights, "--model.weights")
    )
    if cfg.model.backbone is None and weights is None:
        raise ValueError(
            "pass --model.backbone (and --model.weights for pre-trained weights), or --ckpt_path for a fine-tuned "
            "checkpoint"
        )
    place = placement_of(cfg, "eval")  # before any image is read or weights loaded
    if cfg.output:
        reads = [("the weights", weights), *(("a --config file", path) for path in config_files(args))]
        ours = written_by("backbone", "weights", "protocol", "top1")
        check_file_output(cfg.output, "eval", reads=reads, data=data_paths(cfg.data.as_dict()), ours=ours)
    data = ImageClassificationData(**cfg.data.as_dict())
    data.check_folders()  # before hours of feature extraction, not after
    data.require_test_split("no images to score: coretune eval fits on the training features and scores")
    if data.tests_on_training_folder():
        raise DataError(
            "coretune eval scores the test split, which reads the training folder here: every test image would be "
            "in the kNN memory bank (matching itself) and in the probe's training set, and the score would measure "
            "nothing; pass --data.test_dir (or a val/ or test/ folder beside train/) with images kept out of training"
        )
    if shared := data.test_files_in_training():
        raise DataError(
            f"{len(shared)} of the test split's images are training images too (the same files, e.g. {shared[0]}): "
            "each would find itself in the kNN memory bank and be in the probe's training set; keep the test images "
            "out of the training folder (a symlink into it counts)"
        )
    backbone, built = cfg.model.backbone, dict(cfg.model.backbone_args or {})
    if backbone is None:  # the file names its backbone, and a coretune .ckpt its constructor's options
        backbone, stored = _stored_backbone(weights, option)
        built = built if cfg.model.backbone_args is not None else stored
    digest = weights_digest(weights, backbone)  # of the file read next (it may be re-made while this runs)
    torch.manual_seed(cfg.seed)  # a random initialisation is the same network on every call
    options = cfg.model.weights_options
    encoder = create_backbone(
        backbone, weights=weights, weights_format=options.format, allow_cast=options.allow_cast, **built
    )
    trained = getattr(encoder, "pretrained_normalization", None)
    if (why := other_normalisation(trained, data.mean, data.std, weights, option=option)) is not None:
        warnings.warn(why, UserWarning, stacklevel=1)
    result = evaluate_encoder(
        encoder,
        data,
        cfg.protocol,
        k=cfg.k,
        temperature=cfg.temperature,
        weight_decay=cfg.weight_decay,
        device=place.device,
        precision=place.precision,
        seed=cfg.seed,
    )
    top5 = f", top-5 {100 * result.top5:.2f}%" if result.top5 is not None else ""
    Console().print(
        f"[bold]{cfg.protocol}[/bold] {backbone} ({weights or 'random init'}): top-1 "
        f"{100 * result.top1:.2f}%{top5} on {result.num_test} test images "
        f"({result.num_train} training images; {result.settings})",
        highlight=False,
    )
    if cfg.output:
        recorded = {"backbone": backbone, "backbone_args": built, "weights": weights, "weights_sha256": digest}
        recorded |= {"image_size": data.image_size, "mean": list(data.mean), "std": list(data.std)}  # as scored
        with atomic_write(cfg.output) as f:
            f.write(strict_json({**recorded, "seed": cfg.seed, **result.__dict__}, indent=2) + "\n")


def demo(args: list[str]) -> None:
    from .apps.demo import main as demo_main

    demo_main(args)


def bench(args: list[str]) -> None:
    from .sweeps.bench import main as bench_main

    bench_main(args)


def tune(args: list[str]) -> None:
    from .sweeps.tune import main as tune_main

    tune_main(args)


def compare(args: list[str]) -> None:
    from .sweeps.comparison import main as compare_main

    compare_main(args)


COMMANDS = {
    "fit": fit,
    "test": test,
    "validate": validate,
    "predict": predict,
    "export": export,
    "interpolate": interpolate,
    "objectives": list_objectives,
    "pretrain": pretrain,
    "eval": evaluate,
    "demo": demo,
    "bench": bench,
    "tune": tune,
    "compare": compare,
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"coretune {__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        sys.exit(f"coretune: unknown command {command!r}\n\n{_USAGE}")
    try:
        COMMANDS[command](rest)
    except Exception as err:
        _exit_on(command, err)
        raise  # a bug, not a user error: keep the traceback


def _exit_on(command: str, err: Exception) -> None:
    """Exit with a signal's code after an interrupted fit or sweep, or with the message alone after an error a user
    can cause and fix (:func:`_user_errors`; any ``RuntimeError`` too, except from ``fit`` and ``pretrain``). Returns
    on anything else. The exception classes are imported here, once a command failed."""
    from .distributed import is_distributed, outlive_rank_zero, rank
    from .engine import NonFiniteLossError, TrainingInterrupted
    from .sweeps.launch import SweepInterrupted

    if isinstance(err, (TrainingInterrupted, SweepInterrupted)):
        print(f"coretune {command}: {err}", file=sys.stderr)
        sys.exit(128 + err.signum)  # the shell convention for "ended by signal N"
    user_error = isinstance(err, _user_errors())
    if user_error or (isinstance(err, RuntimeError) and command not in ("fit", "pretrain")):
        message = f"coretune {command}: error: {_error_message(err)}"
        if isinstance(err, NonFiniteLossError) and is_distributed():  # every DDP process raises it together
            # one write per line: print and sys.exit write the newline apart, and two processes sharing stderr
            # then run their lines together
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            if rank() != 0:
                outlive_rank_zero()
            sys.exit(1)
        sys.exit(message)


def _user_errors() -> tuple[type[Exception], ...]:
    """What a user can cause and fix: bad options, data, checkpoints (all ``ValueError``s), files and disks
    (``OSError``), a diverging loss, a run directory another process is running. ``coretune`` prints their message
    alone; anything else keeps its traceback."""
    from .engine import NonFiniteLossError
    from .extras import MissingExtra
    from .runs.claim import RunInUse

    return ValueError, OSError, NonFiniteLossError, RunInUse, MissingExtra


def _error_message(err: BaseException) -> str:
    text = str(err)
    if "\nOriginal Traceback" in text:  # re-raised from a DataLoader worker: keep the original exception's line
        text = text.rstrip().splitlines()[-1].partition(": ")[2] or text
    if text.startswith("Does not validate against any of the Union subtypes"):
        # jsonargparse wraps the error of a class chosen by class_path (`coretune pretrain --method …`, a
        # `--trainer.callbacks` class) in the errors of every type it tried; keep the class's own message.
        tried = [line.strip()[2:] for line in text.splitlines() if line.startswith("  - ")]
        generic = ("Expected a <class 'NoneType'>", "Expected a <class 'list'>", "Not a valid subclass of")
        own = [m for m in tried if not m.startswith(generic)]
        text = "; ".join(own or [m for m in tried if not m.startswith(generic[0])]) or text
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        text += " — free disk space, then run the same command again to resume (the last complete checkpoint is intact)"
    return text


if __name__ == "__main__":
    main()
