"""Bi-tuning: classifier and projector heads contrasted against per-class key queues (Zhong et al., 2020)."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import batch_sizes, gather_rows, gather_with_grad, rank
from ..losses import soft_cross_entropy
from ..momentum import momentum_update
from ._backbone import frozen_copy, mirror_modes, move_to
from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["BiTuning"]


@register("bi_tuning", doc="Bi-tuning (Zhong et al., 2020): CE + contrastive CE to prototypes + categorical CL.")
class BiTuning(Objective):
    r"""Bi-tuning, "Bi-tuning of pre-trained representations" (Zhong et al., 2020; arXiv:2011.06182).

    .. math:: \mathcal{L} = CE(G_y(h), y) + \gamma\,(\mathcal{L}_{CCE} + \mathcal{L}_{CCL})

    Per class ``c`` two FIFO queues hold the last ``K`` keys of that class: ``Q^h_c`` (``ĥ = normalize([h;
    1])``, the features augmented with a 1 for the bias) and ``Q^z_c`` (``ẑ = normalize(G_z(h))``, the
    projector output). For a sample ``i`` of class ``c = y_i``, with uniform targets ``1/(K+1)`` on the ``K +
    1`` positives:

    - contrastive cross-entropy (classifier head): the prototype ``w_c = normalize([W_c; b_c])`` (the
      classifier's row, detached as in the authors' code) is contrasted against ``ĥ_i`` and ``Q^h_c``
      (positives) and the other classes' queues (negatives):
      ``L_CCE = −(1/(K+1)) Σ_{k ∈ {ĥ_i} ∪ Q^h_c} log softmax(w_c·k/τ)`` over the ``1 + C·K`` candidates;
    - categorical contrastive learning (projector head): the query ``ẑ_i`` against its own key ``ẑ^k_i`` and
      ``Q^z_c`` (positives) and the other classes' queues (negatives), same form.

    The keys ``ĥ^k``, ``ẑ^k`` come from a momentum key encoder (``θ_k ← m θ_k + (1−m) θ_q`` after every
    optimiser step, :meth:`on_after_optimizer_step`) and are enqueued in their class's queue between the two
    terms, in the order of tllib's ``BiTuning.forward``: ``L_CCL`` reads ``Q^z`` before the batch's keys are
    enqueued, ``L_CCE`` reads ``Q^h`` after (so the batch's own keys ``ĥ^k`` are among its positives and
    negatives). With ``momentum_backbone=True`` (default) the key encoder is a momentum copy of the backbone
    and projector, run without gradient on ``inputs``; with ``key_view="second"`` (default, as the authors'
    tllib code) ``inputs`` is a second, independently augmented view of the batch's images (the engine asks the
    data module for two views, :attr:`input_views`), with ``key_view="same"`` the query's own images (one
    view: cheaper data loading, but the own key ``ẑ^k_i`` then differs from ``ẑ_i`` only by the momentum
    lag). Either way this costs one extra no-grad forward and a backbone copy in memory. With
    ``momentum_backbone=False`` the key is a momentum copy of the projector over the detached current features
    (``ĥ^k = ĥ`` detached): no extra forward or view, but the queued features come from the live backbone.
    The losses are soft-label cross-entropies; the authors' KL divergence differs by the constant
    ``log(K+1)`` and has the same gradients. Defaults ``K = 40`` per class, ``m = 0.999``, ``τ =
    0.07``, projector ``Linear(d, 128)``, ``γ = 1`` are the authors' (tllib).

    The queues are buffers (``queue_h`` ``(C, K, d+1)``, ``queue_z`` ``(C, K, proj_dim)``, initialised with
    random unit vectors, and ``queue_ptr`` ``(C,)``), saved in checkpoints. The momentum copies are held
    outside the module registration (not in ``parameters()``, so the optimiser and DDP never see them; moved
    lazily to the data's device); :meth:`attach_backbone` starts them from the backbone and projector, and
    they are saved in checkpoints as the module's extra state (``objective._extra_state``), so a resumed run
    continues with the key encoder it had (a checkpoint without it restarts the key encoder, with a warning).

    The authors' settings (tllib's ``bi_tuning.py``): SGD with momentum 0.9, batch 48, weight decay 5e-4; for
    a supervised pre-trained backbone lr 0.01 with the backbone and projector at 0.1× (``--finetune``), 20
    epochs of 500 iterations, lr ÷ 10 at epoch 12; for a MoCo (contrastive) backbone lr 0.1 for every layer,
    12 epochs of 2,000 iterations, lr ÷ 10 at epochs 3, 6 and 9. ``K = 40``, ``m = 0.999``, ``τ = 0.07``,
    projection 128, ``γ = 1`` in both.

    Differences from the reference code (tllib's ``tllib/regularization/bi_tuning.py`` and example):

    - the key encoder's momentum update runs after each optimiser step, where tllib runs it at the start of
      each forward: the same sequence of updates (tllib's first is a no-op);
    - the classifier is PyTorch's default ``nn.Linear`` initialisation, tllib draws ``N(0, 0.01²)`` weights and
      zero biases;
    - one learning rate for backbone and heads unless ``--model.optim.backbone_lr`` is given (tllib's ``--finetune``
      puts the backbone *and the projector* at 0.1× the classifier's lr; coretune's ``backbone_lr`` leaves the
      projector at the heads' lr);
    - soft-label cross-entropies instead of KL divergences (the same gradients, see above);
    - under DDP the loss and the queues use the batch gathered from every process (``gather``);
    - tllib's example trains with weight decay 5e-4, batch 48, a step learning-rate schedule and, for a MoCo
      backbone, lr 0.1 on every layer; coretune uses the recipe a run is given (the Table 1 spec: lr 0.01,
      weight decay 1e-4, batch 64, cosine), as for every method: the same recipe for every row is what makes
      the table a comparison of methods.

    Terms: ``ce``, ``cce``, ``ccl``, ``loss``.

    Args:
        queue_size: keys per class ``K >= 1``.
        momentum: key-encoder momentum ``m ∈ [0, 1]``.
        temperature: ``τ > 0``.
        proj_dim: output width of the projector ``G_z``.
        contrast_weight: weight ``γ >= 0`` of ``L_CCE + L_CCL``.
        momentum_backbone: run a momentum copy of the backbone on ``inputs`` for the keys (see above).
        key_view: with ``momentum_backbone``, the keys' images: ``"second"`` augmented view or the ``"same"``
            images as the query.
        gather: under DDP, compute the loss on the batch gathered from every process and enqueue every
            process's keys, so the queues stay identical across processes (MoCo's ``concat_all_gather``);
            ``False`` keeps the loss per process (DDP then keeps rank 0's queues, broadcast as buffers).
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    #: ``coretune tune``'s grid: the weight γ of the two contrastive terms a decade either side of the authors' 1;
    #: the queue size ``K`` (an integer, which tune does not search) stays at their 40.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"contrast_weight": (0.1, 1.0, 10.0)}

    def __init__(
        self,
        queue_size: int = 40,
        momentum: float = 0.999,
        temperature: float = 0.07,
        proj_dim: int = 128,
        contrast_weight: float = 1.0,
        momentum_backbone: bool = True,
        key_view: Literal["second", "same"] = "second",
        gather: bool = True,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        problems = []
        if queue_size < 1:
            problems.append(f"queue_size must be >= 1 (got {queue_size})")
        if not 0.0 <= momentum <= 1.0:
            problems.append(f"momentum must lie in [0, 1] (got {momentum})")
        if temperature <= 0:
            problems.append(f"temperature must be > 0 (got {temperature})")
        if proj_dim < 1:
            problems.append(f"proj_dim must be >= 1 (got {proj_dim})")
        if contrast_weight < 0:
            problems.append(f"contrast_weight must be >= 0 (got {contrast_weight})")
        if key_view not in ("second", "same"):
            problems.append(f"key_view must be 'second' or 'same' (got {key_view!r})")
        if problems:
            raise ValueError("invalid Bi-tuning settings: " + "; ".join(problems))
        self.queue_size, self.momentum, self.temperature = queue_size, momentum, temperature
        self.proj_dim, self.contrast_weight = proj_dim, contrast_weight
        self.momentum_backbone, self.key_view, self.gather = momentum_backbone, key_view, gather
        # Lists keep these out of the module registration (see the class docstring).
        self._backbone: list[nn.Module] = []
        self._key_backbone: list[nn.Module] = []
        self._key_projector: list[nn.Module] = []
        self._pending_keys: dict[str, Any] | None = None  # loaded before attach_backbone made the copies

    @property
    def input_views(self) -> int:
        return 2 if self.momentum_backbone and self.key_view == "second" else 1

    def build_heads(self, feature_dim: int, num_classes: int) -> None:
        self.projector = nn.Linear(feature_dim, self.proj_dim)
        self._key_projector = [frozen_copy(self.projector)]
        k = self.queue_size
        self.register_buffer("queue_h", F.normalize(torch.randn(num_classes, k, feature_dim + 1), dim=2))
        self.register_buffer("queue_z", F.normalize(torch.randn(num_classes, k, self.proj_dim), dim=2))
        self.register_buffer("queue_ptr", torch.zeros(num_classes, dtype=torch.long))

    def attach_backbone(self, backbone: nn.Module) -> None:
        """Start the momentum key encoder from ``backbone`` (and the current projector), or from the key encoder
        of a checkpoint loaded before (``FineTuner.from_checkpoint`` then ``fit``)."""
        self._backbone = [backbone]
        self._key_backbone = [frozen_copy(backbone)] if self.momentum_backbone else []
        if self.is_built:
            self._key_projector = [frozen_copy(self.projector)]
        if self._pending_keys is not None:
            self.set_extra_state(self._pending_keys)

    def get_extra_state(self) -> dict[str, Any]:
        """The momentum key encoder's weights, for checkpoints (see the class docstring)."""
        state: dict[str, Any] = {}
        if self._key_projector:
            state["key_projector"] = self._key_projector[0].state_dict()
        if self._key_backbone:
            state["key_backbone"] = self._key_backbone[0].state_dict()
        return state

    def set_extra_state(self, state: Any) -> None:
        """Restore the key encoder saved by :meth:`get_extra_state` (kept until :meth:`attach_backbone` when the
        copies do not exist yet)."""
        needs_backbone = self.momentum_backbone and "key_backbone" in state
        if not self._key_projector or (needs_backbone and not self._key_backbone):
            self._pending_keys = state
            return
        if "key_projector" in state:
            self._key_projector[0].load_state_dict(state["key_projector"])
        if needs_backbone:
            self._key_backbone[0].load_state_dict(state["key_backbone"])
        self._pending_keys = None

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if prefix + "_extra_state" in missing_keys:  # a checkpoint from before the key encoder was saved
            missing_keys.remove(prefix + "_extra_state")
            warnings.warn(
                "this Bi-tuning checkpoint has no momentum key encoder (written by an earlier coretune): the key "
                "encoder restarts from the current backbone and projector",
                stacklevel=2,
            )

    @property
    def key_projector(self) -> nn.Module:
        """The momentum copy of the projector."""
        self._check_built()
        return self._key_projector[0]

    @property
    def key_backbone(self) -> nn.Module | None:
        """The momentum copy of the backbone (``None`` if not attached or ``momentum_backbone=False``)."""
        return self._key_backbone[0] if self._key_backbone else None

    def on_after_optimizer_step(self) -> None:
        """Momentum update of the key projector (and key backbone)."""
        self._check_built()
        momentum_update(self.projector, self._key_projector[0], self.momentum)
        if self._key_backbone:
            momentum_update(self._backbone[0], self._key_backbone[0], self.momentum)

    @torch.no_grad()
    def keys(self, features: Tensor, inputs: Tensor | None) -> tuple[Tensor, Tensor]:
        """The key embeddings ``(ĥ^k (B, d+1), ẑ^k (B, proj_dim))`` of the batch, without gradient."""
        if self.momentum_backbone:
            if not self._key_backbone:
                raise RuntimeError(
                    "bi_tuning with momentum_backbone=True needs objective.attach_backbone(backbone) before "
                    "training (or set momentum_backbone=False)"
                )
            if inputs is None:
                view = "a second augmented view of the images" if self.key_view == "second" else "the images"
                raise ValueError(
                    f"bi_tuning with momentum_backbone=True needs the batch's images for its keys: call "
                    f"objective(features, labels, inputs=...) with {view} (key_view={self.key_view!r}), or set "
                    "momentum_backbone=False"
                )
            key_backbone = move_to(self._key_backbone[0], inputs.device)
            mirror_modes(self._backbone[0], key_backbone)
            h = key_backbone(inputs).float()
        else:
            h = features.detach().float()
        key_projector = move_to(self._key_projector[0], features.device)
        z = F.normalize(key_projector(h.to(key_projector.weight.dtype)).float(), dim=1)
        return _augment(h), z

    @torch.no_grad()
    def enqueue(self, h_keys: Tensor, z_keys: Tensor, labels: Tensor) -> None:
        """Write each key into its class's queue, FIFO (oldest overwritten first), in batch order."""
        k = self.queue_size
        onehot = F.one_hot(labels, self.num_classes)
        rank = (onehot.cumsum(0) - onehot).gather(1, labels[:, None]).squeeze(1)  # index within its class
        count = onehot.sum(0)
        keep = rank >= count[labels] - k  # only a class's last K keys of the batch survive
        slot = (self.queue_ptr[labels] + rank) % k
        self.queue_h[labels[keep], slot[keep]] = h_keys[keep].to(self.queue_h.dtype)
        self.queue_z[labels[keep], slot[keep]] = z_keys[keep].to(self.queue_z.dtype)
        self.queue_ptr.copy_((self.queue_ptr + count) % k)

    def _contrast(self, cur: Tensor, against_queue: Tensor, labels: Tensor) -> Tensor:
        """Soft-CE of ``[cur (B,), queue logits (B, C·K)] / τ``; uniform targets on the K + 1 positives."""
        queue_class = torch.arange(self.num_classes, device=labels.device).repeat_interleave(self.queue_size)
        positives = torch.cat(
            [torch.ones_like(labels, dtype=torch.bool)[:, None], queue_class[None, :] == labels[:, None]],
            dim=1,
        )
        logits = torch.cat([cur[:, None], against_queue], dim=1) / self.temperature
        return soft_cross_entropy(logits, positives.float() / (self.queue_size + 1))

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        h_keys, z_keys = self.keys(features, inputs)
        rows = slice(None)
        if self.gathers:
            sizes = batch_sizes(features.shape[0], features.device)
            start = sum(sizes[: rank()])
            rows = slice(start, start + features.shape[0])
            features, labels = gather_with_grad(features, sizes), gather_rows(labels, sizes)
            h_keys, z_keys = gather_rows(h_keys, sizes), gather_rows(z_keys, sizes)
        logits = self.classifier(features)
        ce = self.cross_entropy(logits, labels)

        # Snapshots (the queues change in place, after autograd saved them for the backward pass), in tllib's
        # order: the projector head reads the queues before the batch's keys are enqueued, the classifier head after.
        queue_z = self.queue_z.flatten(0, 1).clone()
        z = F.normalize(self.projector(features).float(), dim=1)
        ccl = self._contrast((z * z_keys).sum(1), z @ queue_z.float().T, labels)

        self.enqueue(h_keys, z_keys, labels)
        queue_h = self.queue_h.flatten(0, 1).clone()
        h = _augment(features.float())
        weight, bias = self.classifier.weight.detach(), self.classifier.bias.detach()
        prototypes = F.normalize(torch.cat([weight, bias[:, None]], dim=1).float(), dim=1)
        w = prototypes[labels]  # (B, d+1): the prototype of each sample's class
        cce = self._contrast((w * h).sum(1), w @ queue_h.float().T, labels)

        loss = ce + self.contrast_weight * (cce + ccl)
        terms = {"ce": ce.detach(), "cce": cce.detach(), "ccl": ccl.detach(), "loss": loss.detach()}
        return ObjectiveOutput(loss, logits[rows], terms)


def _augment(h: Tensor) -> Tensor:
    """``normalize([h; 1])``: the features with a constant 1 for the classifier's bias, L2-normalised."""
    return F.normalize(torch.cat([h, h.new_ones(h.shape[0], 1)], dim=1), dim=1)
