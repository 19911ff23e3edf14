"""The interface every fine-tuning method implements, and the registry that names them.

An objective owns its new heads (classifier, projection head …), receives the encoder's features ``z`` (B, d)
and the labels of a batch, and returns the total loss with named terms for logging (DomainBed's ``update``
returning a dict of losses; pytorch-metric-learning's one-signature losses). The encoder stays outside, so any
backbone plugs in; methods that need more (the pre-trained weights, the images, an epoch counter) get it through
the optional hooks below instead of reaching into the training engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..distributed import world_size

__all__ = ["Objective", "ObjectiveOutput", "available", "create", "get", "preset_name", "register"]


@dataclass
class ObjectiveOutput:
    """What an objective returns for a training batch.

    Attributes:
        loss: the scalar to back-propagate.
        logits: ``(B, K)`` classifier outputs on the original rows (for training metrics).
        terms: named scalar loss terms, detached, for logging (always includes ``"loss"``).
    """

    loss: Tensor
    logits: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)


class Objective(nn.Module):
    """Base class of a fine-tuning method.

    Life cycle: construct with hyper-parameters only, then :meth:`build` with the feature dimension and number of
    classes (the engine does it once it knows the backbone and data; :func:`create` does it when given both).

    Hooks (all optional, no-ops by default):
        :meth:`attach_backbone` — called once with the backbone before training (L2-SP/DELTA keep a frozen copy);
        :meth:`prepare` — called once with training batches before a new run starts (DELTA's channel attention);
        :meth:`on_train_epoch_start` — called at each epoch start (RIFLE re-initialises on a schedule);
        :meth:`on_after_optimizer_step` — called after each optimiser step (momentum encoders).
    """

    name: ClassVar[str] = ""
    #: Whether the loss is computed on the batch gathered from every process under DDP (the ``gather``
    #: hyper-parameter of the objectives that offer it; see :attr:`gathers`).
    gather: bool = False
    #: Whether ``forward`` takes the batch's domain labels (``domains=``): a task whose batches carry them
    #: (domain generalization) passes them to such objectives only.
    takes_domains: ClassVar[bool] = False
    #: Whether it trains dense prediction (segmentation: a per-pixel classifier on the backbone's feature map);
    #: :meth:`dense_problem` may still refuse some of its settings.
    dense: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.feature_dim: int | None = None
        self.num_classes: int | None = None
        #: The registry name the objective was made under (:func:`create`, a checkpoint): a preset such as
        #: ``ce_con`` shares its class with ``core``. The class's :attr:`name` when built from a class path.
        self.registered_name: str = self.name

    # -- dense prediction -----------------------------------------------------------------------------------
    def dense_problem(self) -> tuple[str, str] | None:
        """Why this objective cannot train dense prediction: ``(what, problem)``, ``what`` naming it (with the
        setting at fault), or ``None`` when it can."""
        return None if self.dense else (repr(self.name), "it is a classification method")

    @property
    def dense_weight(self) -> float:
        """The weight of :meth:`dense_loss` beside the pixel-wise cross-entropy (0: none is computed)."""
        return 0.0

    def dense_loss(self, pooled: Tensor, labels: Tensor) -> Tensor:
        """The objective's regulariser for dense prediction on the pooled feature maps ``(B, C)`` of a batch of
        crops with image-level ``labels`` (``(B,)`` indices, ``-1`` for none, or ``(B, K)`` K-hot)."""
        raise NotImplementedError(f"objective {self.name!r} has no dense-prediction regulariser")

    # -- set-up ---------------------------------------------------------------------------------------------
    def build(self, feature_dim: int, num_classes: int) -> None:
        """Create the heads for features of width ``feature_dim`` and ``num_classes`` classes."""
        if feature_dim < 1 or num_classes < 1:
            raise ValueError(f"feature_dim and num_classes must be >= 1, got {feature_dim} and {num_classes}")
        self.feature_dim, self.num_classes = feature_dim, num_classes
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.build_heads(feature_dim, num_classes)

    def build_heads(self, feature_dim: int, num_classes: int) -> None:
        """Create heads beyond the classifier ``G_y`` (override in subclasses)."""

    @property
    def is_built(self) -> bool:
        return self.num_classes is not None

    def attach_backbone(self, backbone: nn.Module) -> None:
        """Receive the (pre-trained, not yet fine-tuned) backbone before training starts."""

    def prepare(self, batches: Iterable[tuple[Tensor, Tensor]]) -> None:
        """Called once before the first training step of a new (not resumed) run with a lazy iterable of
        ``(images, labels)`` training batches, for objectives that need data before training (DELTA's attention)."""

    def on_train_epoch_start(self, epoch: int, max_epochs: int) -> None:
        """Called at the start of every training epoch (0-based)."""

    def on_after_optimizer_step(self) -> None:
        """Called after every optimiser step."""

    #: The hyper-parameters ``coretune tune`` chooses for the method, each with its default grid (DomainBed's
    #: ``_hparams``): names of constructor arguments, in the order of the trial folders' names
    #: (``eta1_alpha0.1``). With ``--sampler tpe`` a hyper-parameter ranges from its first to its last value, on a
    #: log scale where the range starts above 0. Empty: the method is not tunable.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {}

    @classmethod
    def untunable(cls, preset: dict[str, Any]) -> str | None:
        """Why ``coretune tune`` cannot tune the registered preset ``preset`` (its hyper-parameters) although it
        fixes none of :attr:`search_space` (one that fixes one is refused by ``coretune tune`` itself); None when it
        can."""
        return None

    #: The optimiser weight decay the method trains with, in place of the engine's ``weight_decay`` (``None``: the
    #: engine's). L2-SP and DELTA set 0: their reference implementations train without weight decay, their
    #: penalties replace it.
    optimizer_weight_decay: ClassVar[float | None] = None

    #: Set by an objective that re-initialised heads, so the engine calls :meth:`reset_optimizer_state`.
    needs_optimizer_reset: bool = False
    #: Rows of the cross-batch feature memory it keeps (0: none; Core-tuning's ``memory_size``): the engine warns
    #: when the memory holds an epoch of training rows.
    memory_size: int = 0

    def reset_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop ``optimizer``'s state (momentum buffers …) of re-initialised parameters."""

    @property
    def input_views(self) -> int:
        """How many augmented views of each training image the objective needs: 1 (``forward``'s ``inputs`` are
        the images the features came from) or 2 (``inputs`` are a second, independently augmented view; the
        engine then asks the data module for two views, see ``ImageClassificationData.train_views``)."""
        return 1

    @property
    def gathers(self) -> bool:
        """Whether the loss is computed on the batch gathered from every process (an objective's ``gather``
        hyper-parameter, under a ``torch.distributed`` run of 2+ processes); the engine then rescales the
        backbone's gradient (:func:`coretune.distributed.scale_grad`)."""
        return bool(self.gather) and world_size() > 1

    # -- computation ----------------------------------------------------------------------------------------
    def predict(self, features: Tensor) -> Tensor:
        """Class logits ``G_y(z)`` for evaluation."""
        return self.classifier(features)

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        """The training loss of a batch: ``features`` (B, d), ``labels`` (B,), optionally the input images (a
        second augmented view of them when :attr:`input_views` is 2)."""
        raise NotImplementedError

    def _check_built(self) -> None:
        if not self.is_built:
            raise RuntimeError(f"objective {self.name!r} has no heads yet: call .build(feature_dim, num_classes)")

    def hparams(self) -> dict[str, Any]:
        """The constructor's hyper-parameters (stored as attributes of the same names), for configs and logs."""
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {n: getattr(self, n) for n in names if hasattr(self, n)}


_REGISTRY: dict[str, tuple[type[Objective], dict[str, Any], str]] = {}


def register(name: str, defaults: dict[str, Any] | None = None, doc: str = "") -> Callable[[type], type]:
    """Class decorator registering an objective under ``name`` with preset hyper-parameters ``defaults``.

    Stacked, it registers named presets of one class (Table 2's rows); the decorator nearest the class gives the
    class its :attr:`~Objective.name`.
    """

    def wrap(cls: type[Objective]) -> type[Objective]:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} is already registered")
        _REGISTRY[name] = (cls, dict(defaults or {}), doc or (cls.__doc__ or "").strip().splitlines()[0])
        if not cls.name:
            cls.name = name
        return cls

    return wrap


def available() -> dict[str, str]:
    """Registered objective names with a one-line description."""
    return {name: doc for name, (_, _, doc) in sorted(_REGISTRY.items())}


def preset_name(objective: Objective) -> str:
    """The registered name of ``objective``'s settings: of the names registered for its class, the one whose preset
    its hyper-parameters match, the most specific (``ce_con`` for a :class:`CoreTuning` without focal weighting or
    mixing, which ``--objective ce_con`` builds through the class path); its :attr:`~Objective.registered_name` when
    none matches."""
    settings = objective.hparams()
    matches = [
        (len(preset), name)
        for name, (cls, preset, _) in _REGISTRY.items()
        if cls is type(objective) and all(settings.get(k) == v for k, v in preset.items())
    ]
    return max(matches)[1] if matches else objective.registered_name


def get(name: str) -> tuple[type[Objective], dict[str, Any]]:
    """The class and preset hyper-parameters registered under ``name``."""
    try:
        cls, defaults = _REGISTRY[name][:2]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}") from None
    return cls, dict(defaults)


def create(name: str, feature_dim: int | None = None, num_classes: int | None = None, **hparams: Any) -> Objective:
    """Instantiate the objective ``name`` (``hparams`` override its preset); build it if both dims are given."""
    cls, defaults = get(name)
    defaults.update(hparams)
    objective = cls(**defaults)
    objective.registered_name = name
    if feature_dim is not None and num_classes is not None:
        objective.build(feature_dim, num_classes)
    return objective
