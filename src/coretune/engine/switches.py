"""Options of ``coretune fit`` that act only behind another one (a switch): given without it, they would change
nothing, and a run would train otherwise than its command line reads (``--adversarial.eps 8/255 --adversarial.steps
3`` without ``--adversarial.enable true`` trained clean, without a word). Such a command is refused with one line.

An option counts as given when the command line names it (even at its default value), or when its value differs
from the default (a ``--config`` file's; a run's own ``config.yaml`` spells out every default, which is not a
choice).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from ..robust.training import AdversarialTraining
from .modelsettings import moved_option

__all__ = ["check_switched_options", "given_options"]


@dataclass(frozen=True)
class _Switched:
    """``options`` (``section.name``) act only when ``acts(config)``; ``without`` says when they do not, ``fix`` what
    to do (``{them}``: "it" or "them", the options given)."""

    options: tuple[str, ...]
    acts: Callable[[Mapping[str, Any]], bool]
    without: Callable[[Mapping[str, Any]], str]
    fix: str


_ADVERSARIAL = ("norm", "eps", "steps", "step_size", "random_start")

_RULES = (
    _Switched(
        tuple(f"adversarial.{name}" for name in _ADVERSARIAL),
        lambda c: bool(c["adversarial"].get("enable")),
        lambda c: "without --adversarial.enable true",
        "add it, or drop {them}",
    ),
    _Switched(
        ("model.optim.momentum", "model.optim.nesterov"),
        lambda c: _optim(c).get("optimizer", "sgd") == "sgd",
        lambda c: f"with --model.optim.optimizer {_optim(c).get('optimizer')} (they are SGD's)",
        "use --model.optim.optimizer sgd, or drop {them}",
    ),
    _Switched(
        ("model.optim.backbone_lr",),
        lambda c: not c["model"].get("freeze_backbone"),
        lambda c: "with --model.freeze_backbone true (the backbone does not train)",
        "drop {them}, or let the backbone train",
    ),
    _Switched(
        ("model.weights_options.format", "model.weights_options.allow_cast", "model.weights_options.download"),
        lambda c: bool(c["model"].get("weights")),
        lambda c: "without --model.weights (a random initialisation reads no file)",
        "pass the pre-trained weights with --model.weights, or drop {them}",
    ),
)


def _optim(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The optimiser's settings of a configuration (``model.optim``)."""
    return config["model"].get("optim") or {}


def _flat_model(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model's settings as ``model.<name>``, a group's as ``model.<group>.<name>`` (``model.optim.lr``)."""
    flat: dict[str, Any] = {}
    for key, value in model.items():
        value = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
        if key in ("optim", "weights_options") and isinstance(value, Mapping):
            flat |= {f"model.{key}.{k}": v for k, v in value.items()}
        else:
            flat[f"model.{key}"] = value
    return flat


def given_options(args: Iterable[str]) -> set[str]:
    """The options a command line names, as ``section.name`` (``--adversarial.eps=8/255`` and ``--adversarial.eps
    8/255`` give ``adversarial.eps``), an older version's spelling as the current one (``--model.lr``:
    ``model.optim.lr``)."""
    names = {arg[2:].partition("=")[0] for arg in args if arg.startswith("--")}
    return {f"model.{moved_option(n[6:])}" if n.startswith("model.") and moved_option(n[6:]) else n for n in names}


def _plain(config: Any) -> dict[str, Any]:
    """A parsed configuration (a jsonargparse ``Namespace`` or a dict) as nested dicts."""
    if hasattr(config, "as_dict"):
        config = config.as_dict()
    return {k: _plain(v) if hasattr(v, "as_dict") or isinstance(v, dict) else v for k, v in dict(config).items()}


def _defaults() -> dict[str, Any]:
    """The defaults of the switched options (``section.name``), adversarial fractions as numbers."""
    from .module import FineTuner

    model = {k: p.default for k, p in inspect.signature(FineTuner).parameters.items() if p.default is not p.empty}
    adversarial = AdversarialTraining().hparams()
    return {**_flat_model(model), **{f"adversarial.{k}": v for k, v in adversarial.items()}}


def _values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The switched options' values in ``config``, adversarial fractions as numbers (``8/255``)."""
    adversarial = {k: v for k, v in config["adversarial"].items() if k in _ADVERSARIAL}
    values = _flat_model(config["model"])
    return {**values, **{f"adversarial.{k}": v for k, v in AdversarialTraining(**adversarial).hparams().items()}}


def check_switched_options(config: Any, given: Sequence[str] | set[str] = ()) -> None:
    """Refuse (``ValueError``, one line) options of a ``coretune fit`` configuration that act only behind a switch
    that is off (:data:`_RULES`), when given: named in ``given`` (:func:`given_options` of the command line) or set to
    another value than the default (a ``--config`` file's)."""
    plain = _plain(config)
    plain.setdefault("adversarial", {})
    plain.setdefault("model", {})
    defaults, values = _defaults(), _values(plain)
    for rule in _RULES:
        if rule.acts(plain):
            continue
        named = [o for o in rule.options if o in given or (o in values and values[o] != defaults.get(o, values[o]))]
        if named:
            them = "it" if len(named) == 1 else "them"
            options = ", ".join(f"--{o}" for o in named)
            raise ValueError(
                f"{options} {'has' if len(named) == 1 else 'have'} no effect {rule.without(plain)}: "
                f"{rule.fix.format(them=them)}"
            )
