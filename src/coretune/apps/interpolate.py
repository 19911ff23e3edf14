r"""``coretune interpolate``: WiSE-FT's weight-space ensembles (Wortsman et al., CVPR 2022, eq. 1) between a start
and a fine-tuned checkpoint,

.. math:: \theta(\alpha) = (1 - \alpha)\,\theta_0 + \alpha\,\theta_1,

scored on the validation split for each ``α`` of a grid; the best one (highest ``val/<monitor>``; ties: lower
validation loss, then the larger ``α``) is written as a new checkpoint, with a table of every ``α``.

* ``θ₁`` (``--ckpt_path``): a checkpoint of ``coretune fit`` (its ``state_dict``: the averaged weights of a run with
  ``--averaging.*``).
* ``θ₀`` (``--start``): another checkpoint of ``coretune fit`` of the same backbone and classes (the LP-FT start: a
  linear probe, ``--model.freeze_backbone true``; or an earlier checkpoint of the run), whose heads are interpolated
  too (for a linear probe: WiSE-FT's interpolation of the zero-shot/linear-classifier head with the fine-tuned one;
  an objective head the start lacks, such as Core-tuning's projector after a CE probe, is ``θ₁``'s); or
  pre-trained backbone weights (a file of any layout ``--model.weights`` loads, or a hub name), for the backbone
  alone: the fine-tuned head is every ``θ(α)``'s (a pre-trained file has no head for these classes).
* Every floating-point tensor is interpolated, BatchNorm's running statistics included (so ``α = 0`` and ``α = 1``
  are the two checkpoints exactly); integer ones (BatchNorm's batch counter) and an objective's extra state are
  ``θ₁``'s. ``--batch_norm recompute`` instead recomputes every ``θ(α)``'s statistics with one pass over the
  training images (:func:`torch.optim.swa_utils.update_bn`, as SWA does): the interpolated weights' own statistics,
  at the cost of a pass per ``α`` (the endpoints then differ from the checkpoints by their statistics).
* ``α`` is chosen on the validation split only: data whose validation split is the test images (no held-out
  validation) is refused. The split is the fine-tuned run's (its checkpoint's label and validation fractions and
  seed are the defaults).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from ..arguments import ArgumentParser
from ..engine import FineTuner, atomic_torch_save, atomic_write, default_precision
from ..engine.averaging import recompute_batch_norm
from ..models import load_checkpoint_file, weights_digest
from ..runs.atomic import strict_json
from ..runs.config import add_config_argument, parse_with_config
from ..runs.outputs import check_file_output, data_paths, trained_data_paths
from ..tasks import DEFAULT_TASK, TASKS, Task
from .devices import add_trainer_arguments
from .scoring import _trainer, arg_value, check_classes

__all__ = ["DEFAULT_ALPHAS", "interpolate", "interpolate_parser", "interpolated_state"]

BatchNorm = Literal["interpolate", "recompute"]

DEFAULT_ALPHAS = tuple(round(i / 10, 1) for i in range(11))
"""WiSE-FT's grid: 0, 0.1, …, 1."""

#: What the new checkpoint keeps of the fine-tuned one: the model, its settings, where it was written; not the
#: optimiser and loop states of a resumable fit (nor an average's trained weights).
_KEPT = ("epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "hparams_name",
         "datamodule_hparams_name", "datamodule_hyper_parameters", "coretune")  # fmt: skip


def interpolate_parser(task: type[Task] | Task = TASKS[DEFAULT_TASK]) -> ArgumentParser:
    """The command line of ``coretune interpolate`` for a checkpoint of ``task`` (its data module's options)."""
    parser = ArgumentParser(
        allow_abbrev=False,
        prog="coretune interpolate",
        description="WiSE-FT: interpolate the weights of a start (--start) and a fine-tuned checkpoint "
        "(--ckpt_path), (1 - α)·start + α·fine-tuned for each α of --alphas, choose α on the validation split and "
        "write that model as a new checkpoint (--output) with a table of every α (its .json beside it).",
    )
    add_config_argument(parser)
    parser.add_argument("--ckpt_path", type=str, required=True, help="The fine-tuned .ckpt (coretune fit): α = 1.")
    parser.add_argument(
        "--start",
        type=str,
        required=True,
        help="α = 0: a .ckpt of coretune fit of the same network (an LP-FT linear probe; its head is interpolated "
        "too), or pre-trained backbone weights (a file or hub name, as --model.weights; the fine-tuned head kept).",
    )
    parser.add_argument(
        "--start_format", type=str, default="auto", help="The layout of pre-trained --start weights (auto detects)."
    )
    parser.add_argument(
        "--alphas",
        type=list[float],
        default=list(DEFAULT_ALPHAS),
        help="The grid of α in [0, 1] (default 0, 0.1, …, 1).",
    )
    parser.add_argument(
        "--batch_norm",
        type=BatchNorm,
        default="interpolate",
        help="BatchNorm statistics: interpolate them as the weights (α = 0 and 1 are the checkpoints exactly), or "
        "recompute them on the training images for each α (update_bn).",
    )
    parser.add_argument(
        "--output",
        type=str,
        required=True,
        help="The new checkpoint (never an existing file); the table of every α goes beside it as .json.",
    )
    parser.add_class_arguments(task.data_class, "data")
    add_trainer_arguments(parser, precision=default_precision(), what="each α is scored")
    return parser


def interpolated_state(start: dict[str, Any], end: dict[str, Any], alpha: float) -> dict[str, Any]:
    """``(1 - alpha)·start + alpha·end`` for every floating-point tensor of ``end`` (a model's ``state_dict``);
    ``end``'s other entries (integer buffers, an objective's extra state) as they are."""
    out: dict[str, Any] = {}
    for key, value in end.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            out[key] = torch.lerp(start[key].to(value.dtype), value, alpha)
        else:
            out[key] = value
    return out


def _start_state(start: str, model: FineTuner, layout: str, ckpt_path: str) -> tuple[dict[str, Any], str, list[str]]:
    """``θ₀`` as a ``state_dict`` of ``model`` (the fine-tuned one), what it is (``checkpoint``: a coretune fit's;
    ``pre-trained backbone``: these backbone weights), and the tensors it takes from ``model`` (``θ₁``'s for every
    α): a pre-trained file's heads, or the objective heads a start checkpoint lacks (a CE linear probe's start for a
    Core-tuning fine-tuning: its projector)."""
    end = model.state_dict()
    tensors = [k for k, v in end.items() if isinstance(v, Tensor)]
    raw = load_checkpoint_file(start) if Path(start).is_file() else None
    if isinstance(raw, dict) and "coretune" in raw:
        other = FineTuner.from_checkpoint(start)
        state = other.state_dict()
        differ = [k for k in tensors if k in state and getattr(state[k], "shape", None) != end[k].shape]
        differ += [k for k in tensors if k.startswith("backbone.") and k not in state]
        if differ or other.class_names != model.class_names:
            what = f"{len(differ)} tensors differ, e.g. {differ[0]}" if differ else "other classes"
            raise ValueError(
                f"--start {start} is another network than --ckpt_path {ckpt_path} ({what}): interpolate two "
                "checkpoints of the same backbone and classes, or pass pre-trained backbone weights as --start"
            )
        kept = [k for k in tensors if k not in state]
        return {**end, **{k: state[k] for k in tensors if k in state}}, "checkpoint", kept
    hparams = model.hparams
    backbone = model.task.build_backbone(
        hparams.backbone,
        weights=start,
        weights_format=layout,
        allow_cast=model.weights_options.allow_cast,
        weights_download=False,
        **(hparams.get("backbone_args") or {}),
    )
    state = {**end, **{f"backbone.{k}": v for k, v in backbone.state_dict().items()}}
    return state, "pre-trained backbone", [k for k in tensors if not k.startswith("backbone.")]


def _never(_: Path) -> bool:
    """An existing file is never one ``coretune interpolate`` may replace."""
    return False


def _chosen(rows: Sequence[dict[str, Any]], monitor: str) -> dict[str, Any]:
    """The row of the best α: highest ``monitor``, then lowest loss, then the larger α."""
    return max(rows, key=lambda r: (r["val"][monitor], -r["val"].get("loss", 0.0), r["alpha"]))


def interpolate(args: Sequence[str]) -> Path:
    """Run ``coretune interpolate`` with ``args``; print the table and return the new checkpoint's path."""
    ckpt_path = arg_value(args, "--ckpt_path")
    if ckpt_path is None:  # the parser's own error (or --help)
        parse_with_config(interpolate_parser(), args)
        raise ValueError("pass --ckpt_path, a .ckpt written by coretune fit")
    model = FineTuner.from_checkpoint(ckpt_path)
    parser = interpolate_parser(model.task)
    parser.set_defaults({f"data.{key}": value for key, value in model.trained_data.items()})
    cfg = parse_with_config(parser, args, task=model.task.name, checkpoint=ckpt_path)
    if bad := [a for a in cfg.alphas if not 0 <= a <= 1]:
        raise ValueError(f"--alphas must lie in [0, 1] (got {bad[0]}): 0 is --start, 1 the fine-tuned checkpoint")
    if not cfg.alphas:
        raise ValueError("--alphas is empty: give the grid of α to choose from, e.g. --alphas [0,0.5,1]")
    reads = [("the checkpoint", ckpt_path), ("--start", cfg.start)]
    data_read = [*data_paths(cfg.data.as_dict()), *trained_data_paths(Path(ckpt_path))]
    output = check_file_output(cfg.output, "interpolate", reads=reads, data=data_read, ours=_never)
    if output.suffix == ".json":
        raise ValueError(f"--output {cfg.output} is the table's name: give the checkpoint a .ckpt name")
    table = check_file_output(output.with_suffix(".json"), "interpolate", reads=reads, data=data_read, ours=_never)
    trainer = _trainer(cfg.trainer, output.parent)  # its settings checked before any image is read
    data = model.task.data_class(**cfg.data.as_dict())
    data.setup("validate")
    check_classes(model, data, ckpt_path)
    if data.validates_on_test:
        raise ValueError(
            "the data has no validation split apart from the test images, and α must not be chosen on them: hold "
            "out one (--data.val_fraction 0.1, or a val/ folder beside test/)"
        )
    start, kind, kept = _start_state(cfg.start, model, cfg.start_format, ckpt_path)
    end = {k: v.clone() if isinstance(v, Tensor) else v for k, v in model.state_dict().items()}
    rows: list[dict[str, Any]] = []
    for alpha in cfg.alphas:
        model.load_state_dict(interpolated_state(start, end, alpha))
        if cfg.batch_norm == "recompute":
            recompute_batch_norm(model, data.train_dataloader(), model.device)
        (logged,) = trainer.validate(model, datamodule=data, verbose=False)
        rows.append({"alpha": alpha, "val": {k.removeprefix("val/"): v for k, v in logged.items()}})
    monitor = model.task.monitor
    best = _chosen(rows, monitor)
    model.load_state_dict(interpolated_state(start, end, best["alpha"]))
    if cfg.batch_norm == "recompute":
        recompute_batch_norm(model, data.train_dataloader(), model.device)
    raw = load_checkpoint_file(ckpt_path)
    entry = {
        "start": str(cfg.start),
        "start_kind": kind,
        "start_sha256": weights_digest(cfg.start, model.hparams.backbone),
        "fine_tuned": str(ckpt_path),
        "alpha": best["alpha"],
        "batch_norm": cfg.batch_norm,
        "fine_tuned_only": kept,  # θ₁'s for every α: the tensors the start has none of
    }
    checkpoint = {k: raw[k] for k in _KEPT if k in raw}
    checkpoint["state_dict"] = {
        k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in model.state_dict().items()
    }
    checkpoint["coretune"] = {**raw["coretune"], "interpolation": entry}
    atomic_torch_save(checkpoint, output)
    results = {**entry, "monitor": monitor, "output": str(output), "data": cfg.data.as_dict(), "alphas": rows}
    with atomic_write(table) as f:
        f.write(strict_json(results, indent=2, sort_keys=True) + "\n")
    print(f"α      val/{monitor}   val/loss   (start: {kind}, BatchNorm: {cfg.batch_norm})")
    for row in rows:
        mark = "  ← chosen" if row is best else ""
        print(f"{row['alpha']:<6} {row['val'][monitor]:<12.4f} {row['val'].get('loss', float('nan')):<10.4f}{mark}")
    print(f"interpolated checkpoint (α = {best['alpha']}): {output}\ntable: {table}")
    return output
