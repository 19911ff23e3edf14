"""The interface every fine-tuning method implements, and the registry that names them.

An objective owns its new heads (classifier, projection head …), receives the encoder's features ``z`` (B, d)
and the labels of a batch, and returns the total loss with named terms for logging (DomainBed's ``update``
returning a dict of losses; pytorch-metric-learning's one-signature losses). The encoder stays outside, so any
backbone plugs in; methods that need more (the pre-trained weights, the images, an epoch counter) get it through
the optional hooks below instead of reaching into the training engine.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pydoc
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import world_size
from ..losses import soft_cross_entropy

__all__ = [
    "MovedSetting",
    "Objective",
    "ObjectiveOutput",
    "available",
    "create",
    "get",
    "label_smoothing_setting",
    "plain_setting",
    "preset_name",
    "register",
    "registered_class",
    "upgrade_objective_config",
]

MovedSetting = str | Callable[[Any], Mapping[str, Any]]
"""Where an older version's setting went (:attr:`Objective.moved_settings`): its current dotted path
(``"miner.lambda_n"``), or a function of its old value giving the current settings, by dotted path, that replace it
(``memory_size: 0`` is ``{"memory": None}``; ``None`` turns a component off, ``{}`` on at its defaults)."""


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

    Life cycle: construct with hyper-parameters, then :meth:`build` the heads with the feature dimension and number
    of classes (the engine does it once it knows the backbone and data; :func:`create` does it when given both).

    Every objective's constructor also takes the keyword-only ``num_classes`` and ``feature_dim``, for a plain
    PyTorch loop (they are not hyper-parameters: :meth:`hparams` and the command line's ``--objective.*`` leave them
    out, as ``coretune fit`` sizes the heads from its data and backbone):

    - ``CoreTuning(num_classes=10, feature_dim=512)`` builds the heads at once: hand ``objective.parameters()`` to
      the optimiser after it;
    - ``CoreTuning(num_classes=10)`` builds them at its first call (``objective(z, y)`` or ``objective.predict(z)``)
      from the width of ``z``, on ``z``'s device, in the objective's floating dtype (float32 unless cast, e.g.
      ``.double()``), like :class:`torch.nn.LazyLinear`. Its :meth:`parameters` are refused until then, so the
      optimiser never misses the heads: run one call (``objective.predict(encoder(images))``) before making it.

    Hooks (all optional, no-ops by default):
        :meth:`attach_backbone` — called once with the backbone before training (L2-SP/DELTA keep a frozen copy);
        :meth:`prepare` — called once with training batches before a new run starts (DELTA's channel attention);
        :meth:`observe_class_counts` — called before a fit with the training images per class (logit adjustment);
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

    #: The number of classes a lazily built objective (``num_classes`` without ``feature_dim``) will be built for
    #: at its first call; ``None`` once built, or when not made so.
    _lazy_num_classes: int | None = None
    #: The floating dtype that ``.to()``/``.double()`` … gave a lazily built objective before its first call.
    _lazy_dtype: torch.dtype | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not _HEAD_SIZES & set(inspect.signature(init).parameters):
            cls.__init__ = _taking_head_sizes(init)  # type: ignore[method-assign]

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
        pending = self._lazy_num_classes
        if pending is not None and pending != num_classes:
            raise ValueError(
                f"objective {self.name!r} was made with num_classes={pending}, but its heads are built for "
                f"{num_classes} classes (the data's): make it with num_classes={num_classes}, or without num_classes"
            )
        self.feature_dim, self.num_classes = feature_dim, num_classes
        self.classifier = nn.Linear(feature_dim, num_classes)
        self.build_heads(feature_dim, num_classes)
        if pending is not None:
            self._lazy_num_classes = None
            self._lazy_hook.remove()

    def _set_head_sizes(self, num_classes: int | None, feature_dim: int | None) -> None:
        """The constructor's ``num_classes``/``feature_dim``: build now (both) or at the first call (the classes)."""
        if num_classes is None:
            raise ValueError(
                f"{type(self).__name__}(feature_dim={feature_dim}) needs num_classes= too: give both, or neither "
                "and call .build(feature_dim, num_classes)"
            )
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
        if feature_dim is not None:
            self.build(feature_dim, num_classes)
            return
        self._lazy_num_classes = num_classes
        self._lazy_hook = self.register_forward_pre_hook(_build_at_first_call, with_kwargs=True)

    def _build_lazily(self, features: Tensor) -> None:
        """Build the heads of a lazily built objective for ``features``' width, on their device."""
        if features.dim() != 2:
            raise ValueError(
                f"objective {self.name!r} builds its heads at its first call from the features' width: expected "
                f"(B, d) features, got shape {tuple(features.shape)}"
            )
        dtype = self._lazy_dtype or torch.get_default_dtype()
        with features.device:  # made there: copies kept outside the module tree (Bi-tuning's key head) too
            self.build(features.shape[1], typing.cast(int, self._lazy_num_classes))
        self.to(device=features.device, dtype=dtype)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Objective:
        if self._lazy_num_classes is not None:  # .to()/.double() before the heads exist: their future dtype
            self._lazy_dtype = fn(torch.empty(0, dtype=self._lazy_dtype or torch.get_default_dtype())).dtype
        return super()._apply(fn, recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As :meth:`torch.nn.Module.named_parameters` (and so :meth:`parameters`); refused while a lazily built
        objective has no heads yet (an optimiser made then would never train them)."""
        if self._lazy_num_classes is not None:
            raise RuntimeError(
                f"objective {self.name!r} builds its heads at its first call (made with num_classes="
                f"{self._lazy_num_classes} and no feature_dim), so an optimiser made now would miss them: give "
                "feature_dim= when making it, or call it once (objective.predict(features)) before .parameters()"
            )
        return super().named_parameters(*args, **kwargs)

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

    #: Whether it needs the training split's images per class (:meth:`observe_class_counts`): ``coretune fit`` then
    #: refuses, before training, a data module whose training split does not list its labels.
    needs_class_counts: ClassVar[bool] = False

    def observe_class_counts(self, counts: Tensor) -> None:
        """Called before a fit's first step (a new or a resumed run) with the training split's images per class
        ``(K,)`` (int64), for objectives that use the label distribution (logit adjustment's class priors). In a
        plain PyTorch loop, call it once after the heads are built."""

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
        """Class logits ``G_y(z)`` for evaluation (a lazily built objective's first call builds its heads)."""
        if self._lazy_num_classes is not None:
            self._build_lazily(features)
        return self.classifier(features)

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        """The training loss of a batch: ``features`` (B, d), ``labels`` (B,), optionally the input images (a
        second augmented view of them when :attr:`input_views` is 2)."""
        raise NotImplementedError

    def _check_built(self) -> None:
        if self._lazy_num_classes is not None:
            raise RuntimeError(
                f"objective {self.name!r} builds its heads at its first call: call it once "
                "(objective.predict(features)) first"
            )
        if not self.is_built:
            raise RuntimeError(
                f"objective {self.name!r} has no heads yet: call .build(feature_dim, num_classes), or make it with "
                "num_classes="
            )

    #: Label smoothing ``s`` of the objective's cross-entropy on the classifier (``--objective.label_smoothing``,
    #: every built-in objective's setting): the target of class ``y`` is ``(1 - s) · onehot(y) + s / K``
    #: (:meth:`cross_entropy`, torch's ``label_smoothing``); a soft target ``t`` (mixed rows) is ``(1 - s) · t + s / K``
    #: (:meth:`soft_cross_entropy`, as timm's ``Mixup(label_smoothing=s)`` builds its targets for
    #: ``SoftTargetCrossEntropy``). 0 (default): none.
    label_smoothing: float = 0.0

    def cross_entropy(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The classifier's cross-entropy of ``logits`` ``(B, K)`` with class ``labels`` ``(B,)``, in float32, with
        :attr:`label_smoothing`."""
        return F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)

    def soft_cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The classifier's cross-entropy of ``logits`` ``(B, K)`` with soft ``targets`` ``(B, K)`` (mixed rows'),
        smoothed as timm's mixup smooths them: ``(1 - s) · targets + s / K`` (:attr:`label_smoothing`)."""
        s = self.label_smoothing
        return soft_cross_entropy(logits, targets if s == 0 else (1 - s) * targets + s / targets.shape[1])

    def hparams(self) -> dict[str, Any]:
        """The constructor's hyper-parameters (stored as attributes of the same names), for configs and logs; a
        component's settings (a dataclass such as Core-tuning's ``miner``) as a dict (:func:`plain_setting`)."""
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        missing = object()
        settings = {n: self.setting(n, missing) for n in names}
        return {n: plain_setting(v) for n, v in settings.items() if v is not missing}

    def setting(self, name: str, default: Any = None) -> Any:
        """The value of the constructor argument ``name``: the attribute of that name (override where another
        attribute keeps it)."""
        return getattr(self, name, default)

    #: Settings that older versions took under another name, still read for one release (a flag, a config's
    #: ``init_args``, a checkpoint's settings): old name → :data:`MovedSetting`. :meth:`upgrade_settings` applies it.
    moved_settings: ClassVar[Mapping[str, MovedSetting]] = {}

    @classmethod
    def moved_setting(cls, old: str, value: Any) -> dict[str, Any]:
        """The current settings, by dotted path, that the old setting ``old`` (one of :attr:`moved_settings`) with
        ``value`` stands for: ``lambda_n 0.5`` → ``{"miner.lambda_n": 0.5}``."""
        new = cls.moved_settings[old]
        return {new: value} if isinstance(new, str) else dict(new(value))

    @classmethod
    def upgrade_settings(cls, settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``settings`` (constructor arguments as a config or checkpoint records them: plain values, a component's
        as a dict) with each old one of :attr:`moved_settings` in its current place, and the old names found.

        A component an old setting turned off (``None``) drops the old settings beneath it (they had no effect);
        a setting given both ways keeps its current spelling's value."""
        old = [k for k in settings if k in cls.moved_settings]
        if not old:
            return dict(settings), []
        assigned: dict[str, Any] = {}
        for key in old:
            assigned |= cls.moved_setting(key, settings[key])
        current = {k: v for k, v in settings.items() if k not in cls.moved_settings}
        for key, value in _nested(assigned).items():
            given = current.get(key, value)
            current[key] = {**value, **given} if isinstance(value, dict) and isinstance(given, Mapping) else given
        return current, old

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Objective:
        """An instance with ``settings`` as a config or checkpoint records them (:meth:`hparams`): a component
        given as a dict becomes the dataclass its parameter is annotated with."""
        hints = typing.get_type_hints(cls.__init__)
        values = dict(settings)
        for name, value in settings.items():
            components = [
                t for t in typing.get_args(hints.get(name)) or (hints.get(name),) if dataclasses.is_dataclass(t)
            ]
            if isinstance(value, Mapping) and len(components) == 1:
                values[name] = components[0](**value)
        return cls(**values)


_HEAD_SIZES = {"num_classes", "feature_dim"}


def _taking_head_sizes(init: Callable[..., None]) -> Callable[..., None]:
    """An objective's constructor ``init`` that also takes the keyword-only ``num_classes`` and ``feature_dim``
    (:class:`Objective`'s life cycle). Its signature stays ``init``'s (``functools.wraps``), so the hyper-parameters
    that :meth:`Objective.hparams` records and the command line offers are its own."""

    @functools.wraps(init)
    def __init__(
        self: Objective, *args: Any, num_classes: int | None = None, feature_dim: int | None = None, **kwargs: Any
    ) -> None:
        init(self, *args, **kwargs)
        if num_classes is not None or feature_dim is not None:
            self._set_head_sizes(num_classes, feature_dim)

    return __init__


Objective.__init__ = _taking_head_sizes(Objective.__init__)  # type: ignore[method-assign]


def _build_at_first_call(objective: Objective, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The forward pre-hook of a lazily built objective: build its heads from the first call's features."""
    features = args[0] if args else kwargs.get("features")
    if objective._lazy_num_classes is not None and isinstance(features, Tensor):  # a copy's hook may outlive it
        objective._build_lazily(features)


def _nested(assigned: Mapping[str, Any]) -> dict[str, Any]:
    """Settings by dotted path (``{"miner.lambda_n": 0.5, "memory": None}``) as nested dicts; a path beneath one set
    to ``None`` (a component turned off) is dropped."""
    off = [path for path, value in assigned.items() if value is None]
    nested: dict[str, Any] = {}
    for path, value in sorted(assigned.items(), key=lambda item: item[0].count(".")):
        if any(path.startswith(f"{parent}.") for parent in off):
            continue
        *parents, leaf = path.split(".")
        node = nested
        for parent in parents:
            node = node.setdefault(parent, {})
        before = node.get(leaf)
        node[leaf] = {**before, **value} if isinstance(before, dict) and isinstance(value, dict) else value
    return nested


def label_smoothing_setting(value: float) -> float:
    """``value`` as an objective's :attr:`~Objective.label_smoothing`, checked: in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"label_smoothing must lie in [0, 1) (got {value!r}; 0.1 is the usual ViT recipe's)")
    return float(value)


def plain_setting(value: Any) -> Any:
    """A setting as a config records it: a component (a dataclass instance) as the dict of its fields."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


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
    """Instantiate the objective ``name`` (``hparams`` override its preset); build its heads when both dims are given,
    at its first call when only ``num_classes`` is (the constructor's keyword-only arguments, see
    :class:`Objective`)."""
    cls, defaults = get(name)
    defaults.update(hparams)
    sizes = {k: v for k, v in (("num_classes", num_classes), ("feature_dim", feature_dim)) if v is not None}
    objective = cls(**defaults, **sizes)
    objective.registered_name = name
    return objective


def registered_class(name: str) -> type[Objective] | None:
    """The registered objective class that ``name`` names: a registered name (``ce_con``), a class path (any module
    that exports it: ``coretune.objectives.CoreTuning``) or a class name (``CoreTuning``); None if none."""
    if name in _REGISTRY:
        return _REGISTRY[name][0]
    classes = {cls for cls, _, _ in _REGISTRY.values()}
    found = pydoc.locate(name) if "." in name else next((cls for cls in classes if cls.__name__ == name), None)
    return found if found in classes else None  # type: ignore[return-value]


def upgrade_objective_config(spec: Any) -> tuple[Any, list[str]]:
    """A configuration's ``objective`` entry (``{class_path: …, init_args: {…}}``, as ``config.yaml`` records it)
    with the moved settings of an older version in their current place (:meth:`Objective.upgrade_settings`), and
    the old names found; anything else as it is."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("init_args"), Mapping):
        return spec, []
    cls = registered_class(str(spec.get("class_path")))
    if cls is None:
        return spec, []
    init_args, old = cls.upgrade_settings(spec["init_args"])
    return ({**spec, "init_args": init_args} if old else spec), old
