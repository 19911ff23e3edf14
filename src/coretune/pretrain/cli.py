"""``coretune pretrain``: a LightningCLI over the contrastive methods and :class:`PretrainData`.

``--method simclr|moco_v2`` picks the method (default SimCLR), ``--model.<param>`` its hyper-parameters,
``--data.<param>`` the images and augmentations, ``--trainer.<param>`` the loop; ``--trainer.logger NAME`` adds a
Lightning logger beside the run's own files, as for ``coretune fit`` (:mod:`coretune.engine.loggers`). Re-running
with the same ``--run_dir`` resumes from its ``checkpoints/last.ckpt``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ..engine import RunDirCLI, check_trainer_options, quiet_lightning, with_atomic_io
from ..engine.loggers import LOGGER_ALIAS, logger_args, place_loggers, translate_logger_config
from .data import PretrainData
from .module import (
    PRETRAINED_FILENAME,
    ContrastivePretrainer,
    MoCoV2,
    SimCLR,
    pretrain_callbacks,
    pretrain_trainer_defaults,
)

__all__ = ["METHODS", "PretrainCLI", "run", "translate_args"]

METHODS: dict[str, type[ContrastivePretrainer]] = {"simclr": SimCLR, "moco_v2": MoCoV2}


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def translate_args(args: list[str]) -> list[str]:
    """Rewrite ``--method NAME`` to ``--model=<class path>`` (first, so ``--model.*`` options apply to it),
    ``--seed N`` to ``--seed_everything=N``, ``--trainer.logger NAME`` to the logger's class path and settings
    (:func:`~coretune.engine.loggers.logger_args`; also inside ``--config`` files); without ``--method``/``--model``
    the method is SimCLR."""
    out: list[str] = []
    model: str | None = None
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--method", "--model"):
            value = value if eq else next(it, "")
            if key == "--method" and value not in METHODS:
                raise ValueError(f"unknown pre-training method {value!r}: choose one of {', '.join(METHODS)}")
            model = _class_path(METHODS[value]) if key == "--method" else value
        elif key == "--seed":
            out.append(f"--seed_everything={value if eq else next(it, '')}")
        elif key in ("--config", "-c"):
            out.append(f"--config={translate_logger_config(value if eq else next(it, ''))}")
        elif key == "--trainer.logger":
            out.extend(logger_args(value if eq else next(it, "")))
        else:
            out.append(arg)
    return [f"--model={model or _class_path(SimCLR)}", *out]


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

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        check_trainer_options(config["trainer"])
        self.settle_run_dir("pretrain-" + str(config["model"]["class_path"]).rsplit(".", 1)[-1].lower())
        place_loggers(config, resuming=config.get("ckpt_path") is not None)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer = self._get(self.config_init, "trainer", default={})
        # callbacks naming the run directory: given no folder, Lightning puts the checkpoints in a logger's
        self.trainer_defaults["callbacks"] = pretrain_callbacks(trainer["default_root_dir"])
        kwargs["plugins"] = with_atomic_io(trainer.get("plugins"))
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        if self.trainer.interrupted or not self.trainer.is_global_zero:
            return
        from rich.console import Console

        run_dir = Path(self.trainer.default_root_dir)
        weights = run_dir / PRETRAINED_FILENAME
        backbone = self.model.backbone.name
        console = Console()
        console.print(f"[bold]run directory[/bold]: {run_dir} (metrics.csv, learning curve, checkpoints/)")
        console.print(f"[bold]pre-trained encoder[/bold]: {weights}")
        console.print(
            f"fine-tune it:  coretune fit --model.backbone {backbone} --model.weights {weights} "
            "--data.root <image folder>",
            highlight=False,
        )
        console.print(
            f"evaluate it:   coretune eval knn --backbone {backbone} --weights {weights} --data.root <image folder>",
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
