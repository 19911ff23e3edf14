"""``coretune pretrain``: a LightningCLI over the contrastive methods and :class:`PretrainData`.

``--method simclr|moco_v2|moco_v3`` picks the method (default SimCLR), ``--model.<param>`` its hyper-parameters,
``--data.<param>`` the images and augmentations, ``--trainer.<param>`` the loop; ``--trainer.logger NAME`` adds a
Lightning logger beside the run's own files, as for ``coretune fit`` (:mod:`coretune.engine.loggers`). Re-running
with the same ``--run_dir`` resumes from its ``checkpoints/last.ckpt``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import pydoc
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import yaml

from ..data.transforms import option_values
from ..engine import RunDirCLI, check_trainer_options, quiet_lightning, with_atomic_io
from ..engine.loggers import LOGGER_ALIAS, logger_args, place_loggers, translate_logger_config
from .augment import IMAGENET_MEAN, IMAGENET_STD
from .data import PretrainData
from .mocov3 import MoCoV3
from .module import (
    PRETRAINED_FILENAME,
    ContrastivePretrainer,
    MoCoV2,
    SimCLR,
    check_snapshot_epochs,
    pretrain_callbacks,
    pretrain_trainer_defaults,
)

__all__ = ["METHODS", "PretrainCLI", "run", "translate_args"]

METHODS: dict[str, type[ContrastivePretrainer]] = {"simclr": SimCLR, "moco_v2": MoCoV2, "moco_v3": MoCoV3}


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _config_method(path: str) -> type[ContrastivePretrainer] | None:
    """The method (class) a ``--config`` file's ``model.class_path`` names, else None."""
    with contextlib.suppress(OSError, yaml.YAMLError):
        model = (yaml.safe_load(Path(path).read_text()) or {}).get("model")
        if isinstance(model, dict) and isinstance(name := model.get("class_path"), str):
            found = pydoc.locate(name) if "." in name else None
            return found if found in METHODS.values() else None
    return None


def _model_arg(cls: type[ContrastivePretrainer], previous: type[ContrastivePretrainer] | None) -> str:
    """``--model`` switching to method ``cls`` after a config of method ``previous``: the settings whose defaults
    differ between the two (the methods' own optimiser, lr, ...) are ``cls``'s defaults, which jsonargparse would
    otherwise take from the config; the shared ones (backbone, temperature, ...) stay the config's."""
    if previous is None or previous is cls:
        return f"--model={_class_path(cls)}"
    old = inspect.signature(previous).parameters
    init_args = {
        k: p.default
        for k, p in inspect.signature(cls).parameters.items()
        if k in old and p.default is not p.empty and old[k].default != p.default
    }
    return f"--model={json.dumps({'class_path': _class_path(cls), 'init_args': init_args})}"


def translate_args(args: list[str]) -> list[str]:
    """Rewrite ``--method NAME`` to ``--model=<class path>`` (right after the ``--config`` before it, else first, so
    ``--model.*`` options apply to it, and with :func:`_model_arg`'s settings when that config is the other
    method's), ``--seed N`` to ``--seed_everything=N``, ``--trainer.logger NAME`` to the logger's class path and
    settings (:func:`~coretune.engine.loggers.logger_args`; also inside ``--config`` files); without
    ``--method``/``--model`` the method is SimCLR."""
    out: list[str] = []
    model: str | None = None  # a --model class path that is not one of METHODS
    method: type[ContrastivePretrainer] | None = None
    config_method: type[ContrastivePretrainer] | None = None  # the method of the last --config before it
    at = 0  # where --model goes: after that config
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--method", "--model"):
            value = value if eq else next(it, "")
            if key == "--method" and value not in METHODS:
                raise ValueError(f"unknown pre-training method {value!r}: choose one of {', '.join(METHODS)}")
            cls = METHODS[value] if key == "--method" else pydoc.locate(value)
            model, method = (None, cls) if cls in METHODS.values() else (value, None)
        elif key == "--seed":
            out.append(f"--seed_everything={value if eq else next(it, '')}")
        elif key in ("--config", "-c"):
            value = value if eq else next(it, "")
            if (method or model) is None:
                at, config_method = len(out) + 1, _config_method(value) or config_method
            out.append(f"--config={translate_logger_config(value)}")
        elif key == "--trainer.logger":
            out.extend(logger_args(value if eq else next(it, "")))
        else:
            out.append(arg)
    if method is None and model is None:
        return [f"--model={_class_path(SimCLR)}", *out]
    return [*out[:at], model or _model_arg(method, config_method), *out[at:]]


class PretrainCLI(RunDirCLI):
    """Pre-training runs write into ``--run_dir`` (default ``runs/pretrain-<method>-<date>-<time>``)."""

    command = "pretrain"
    aliases: ClassVar[Mapping[str, str]] = {
        "--method NAME": f"the pre-training method, {' or '.join(METHODS)} (default simclr)",
        "--seed N": "--seed_everything N",
        LOGGER_ALIAS[0]: LOGGER_ALIAS[1],
    }

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("seed_everything", "data.seed")
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help="Run directory (default: <--trainer.default_root_dir, or runs>/pretrain-<method>-<date>-<time>; "
            "it wins over --trainer.default_root_dir). Reuse it to resume from its checkpoints/last.ckpt. Refused "
            "while another run uses it (its claim, fit.pid).",
        )
        parser.add_argument(
            "--snapshot_epochs",
            type=list[int],
            default=[],
            help="Also keep the encoder after each of these epochs (counted from 1) as pretrained-epoch<E>.pth.tar in "
            "the run directory: checkpoints of graded strength from one run (e.g. [10, 25, 50]).",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        model = config.get("model") or {}
        check_trainer_options(config["trainer"], (model.get("init_args") or model).get("schedule"), "--model.schedule")
        check_snapshot_epochs(config["snapshot_epochs"], config["trainer"].get("max_epochs"))
        self.settle_run_dir("pretrain-" + str(config["model"]["class_path"]).rsplit(".", 1)[-1].lower())
        place_loggers(config, resuming=config.get("ckpt_path") is not None)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer = self._get(self.config_init, "trainer", default={})
        # callbacks naming the run directory: given no folder, Lightning puts the checkpoints in a logger's
        snapshots = self._get(self.config_init, "snapshot_epochs", default=[])
        self.trainer_defaults["callbacks"] = pretrain_callbacks(trainer["default_root_dir"], snapshots)
        kwargs["plugins"] = with_atomic_io(trainer.get("plugins"))
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        if self.trainer.interrupted or not self.trainer.is_global_zero:
            return
        from rich.console import Console

        run_dir = Path(self.trainer.default_root_dir)
        weights = run_dir / PRETRAINED_FILENAME
        backbone = self.model.backbone.name
        options = self.model.hparams.get("backbone_args")  # a ViT's img_size/patch_size: the same to fine-tune
        built = f" --model.backbone_args '{json.dumps(options)}'" if options else ""
        console = Console()
        console.print(f"[bold]run directory[/bold]: {run_dir} (metrics.csv, learning curve, checkpoints/)")
        console.print(f"[bold]pre-trained encoder[/bold]: {weights}")
        mean, std = self.datamodule.mean, self.datamodule.std
        scale = (
            ""
            if (mean, std) == (IMAGENET_MEAN, IMAGENET_STD)
            else f" --data.mean {option_values(mean)} --data.std {option_values(std)}"
        )
        console.print(
            f"fine-tune it:  coretune fit --model.backbone {backbone}{built} --model.weights {weights}{scale} "
            "--data.root <image folder>",
            highlight=False,
        )
        console.print(
            f"evaluate it:   coretune eval knn --model.backbone {backbone}{built} --model.weights {weights}{scale} "
            "--data.root <image folder>",
            highlight=False,
        )


def run(args: list[str]) -> None:
    """Entry point of ``coretune pretrain``."""
    quiet_lightning()
    PretrainCLI.run(
        ContrastivePretrainer,
        PretrainData,
        args=["fit", *translate_args(args)],
        subclass_mode_model=True,
        seed_everything_default=0,
        trainer_defaults=pretrain_trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"allow_abbrev": False, "fit": {"default_env": False, "allow_abbrev": False}},
        auto_configure_optimizers=False,
    )
