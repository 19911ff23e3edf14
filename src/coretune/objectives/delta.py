"""DELTA: feature-map regularisation with channel attention (Li et al., ICLR 2019)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._backbone import capture_outputs, frozen_copy, l2_penalty, move_to, stage_names
from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["DELTA", "channel_attention"]


def _zero_channel_hook(channel: int) -> Callable[[nn.Module, object, Tensor], Tensor]:
    """A forward hook replacing channel ``channel`` of the module's output by zeros."""

    def hook(module: nn.Module, args: object, output: Tensor) -> Tensor:
        output = output.clone()
        output[:, channel] = 0
        return output

    return hook


@torch.no_grad()
def channel_attention(
    backbone: nn.Module,
    stages: Sequence[nn.Module],
    classifier: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    temperature: float = 5.0,
) -> list[Tensor]:
    r"""DELTA's supervised channel attention of every stage output, computed once from the pre-trained model.

    For stage ``j`` and channel ``c``, ``Δ_jc`` is the cross-entropy increase of ``classifier(backbone(x))``
    when channel ``c`` of the stage output is zeroed, averaged over ``batches``; the weights are
    ``softmax_c(standardise(Δ_j) / temperature)`` — the paper's softmax over channels of the loss increase,
    standardised and tempered by 5 as in the authors' code (``channel_eval.py`` / ``train.py``). A stage whose
    channels all give the same increase gets uniform weights.

    The backbone runs in evaluation mode (restored afterwards); this costs one forward pass per channel and
    batch.

    Args:
        backbone: the pre-trained network mapping images to ``(B, d)`` features.
        stages: its stage modules whose outputs are ``(B, C_j, *spatial)``.
        classifier: a head on the backbone's features trained for the target task (a linear probe).
        batches: ``(images, labels)`` pairs; the authors use 4 batches of 32.
        temperature: softmax temperature (5 in the authors' code).

    Returns:
        One ``(C_j,)`` float32 tensor per stage, summing to 1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    modes = [m.training for m in backbone.modules()], [m.training for m in classifier.modules()]
    backbone.eval()
    classifier.eval()
    sink: list[Tensor | None] = [None] * len(stages)
    handles = capture_outputs(stages, sink)
    try:
        sums: list[Tensor] | None = None
        n_batches = 0
        for images, labels in batches:
            base = F.cross_entropy(classifier(backbone(images)).float(), labels)
            if sums is None:
                sums = [torch.zeros(out.shape[1], dtype=torch.float64) for out in sink]
            for stage, total in zip(stages, sums, strict=True):
                for c in range(total.numel()):
                    handle = stage.register_forward_hook(_zero_channel_hook(c))
                    try:
                        ablated = F.cross_entropy(classifier(backbone(images)).float(), labels)
                    finally:
                        handle.remove()
                    total[c] += float(ablated - base)
            n_batches += 1
    finally:
        for handle in handles:
            handle.remove()
        for mods, flags in zip((backbone.modules(), classifier.modules()), modes, strict=True):
            for m, flag in zip(mods, flags, strict=True):
                m.training = flag
    if sums is None:
        raise ValueError("channel_attention needs at least one (images, labels) batch")
    weights = []
    for total in sums:
        increase = total / n_batches
        std = increase.std(unbiased=False)
        if std == 0:
            weights.append(torch.full_like(increase, 1.0 / increase.numel()).float())
        else:
            weights.append(torch.softmax((increase - increase.mean()) / std / temperature, dim=0).float())
    return weights


@register("delta", doc="DELTA (Li et al., 2019): CE + attention-weighted feature-map distance + L2 on heads.")
class DELTA(Objective):
    r"""DELTA: keep the stage feature maps near the pre-trained ones, weighted by channel attention.

    "DELTA: DEep Learning Transfer using Feature Map with Attention for Convolutional Networks" (Li et al.,
    ICLR 2019).

    .. math:: \mathcal{L} = CE(G_y(z), y) + \alpha\,\Omega_{FM} + \frac{\beta}{2}\lVert w_{\bar S}\rVert_2^2,
              \Omega_{FM} = \sum_j \sum_{b=1}^{B} \frac{1}{2} \sum_{c=1}^{C_j}
              \frac{C_j\, a_{jc}}{H_j W_j} \lVert FM_{jc}(w, x_b) - FM_{jc}(w^0, x_b)\rVert_2^2

    ``FM_j(w, x)`` is the output of backbone stage ``j`` (``(C_j, H_j, W_j)``; ResNet ``layer1``..``layer4``,
    see :func:`coretune.objectives._backbone.stage_names`) of the backbone being fine-tuned and
    ``FM_j(w⁰, x)`` that of a frozen copy of the pre-trained backbone on the same images; ``a_j`` are the
    channel attention weights (:func:`channel_attention`, summing to 1 over a stage's channels); ``w_S̄`` are
    the new heads. The per-channel normalisation ``C_j/(H_j W_j)``, the factor ½ and the *sum* over the batch
    follow the authors' ``train.py`` (so the effective strength grows with the batch size, as in their code);
    defaults ``α = β = 0.01`` are the authors' (``train.py``, ``run.sh``).

    Until :meth:`compute_channel_attention` (or :meth:`set_channel_attention`) is called the attention is
    **uniform** (``a_jc = 1/C_j``): the per-channel weight ``C_j a_jc/(H_j W_j)`` is then ``1/(H_j W_j)``, so
    the term is the unweighted feature-map distance of each stage divided by its ``H_j W_j``. The authors'
    "DELTA w/o attention" (``fea_map`` in their ``train.py``) does not divide: ``½ Σ_b ‖FM_j(w, x_b) −
    FM_j(w⁰, x_b)‖²``, so with the same ``α`` uniform attention here is weaker by ``H_j W_j`` per stage (an
    ``α`` of ``fea_map`` maps to ``α·H_j W_j`` here only for a single stage, or when all stages have the same
    size).

    Optimiser: the authors' ``train.py`` trains DELTA (and L2-SP) *without* weight decay (it uses 1e-4 for
    plain fine-tuning only): :attr:`optimizer_weight_decay` is 0, so the engine gives this objective's run no
    weight decay whatever ``--model.optim.weight_decay`` says (the ``β`` term on the new heads replaces it). The
    authors' other settings: SGD with momentum 0.9 (not Nesterov), lr 0.01, batch 64, 9,000 iterations with
    the lr divided by 10 after two thirds (``train.py``'s defaults; ``run.sh`` runs 6,000 with an exponential
    decay), ``α = β = 0.01``, attention temperature 5 (both).

    Differences from the reference code (``train.py`` and ``channel_eval.py`` of the authors; tllib's
    ``BehavioralRegularization`` and ``AttentionBehavioralRegularization``):

    - features are taken at the stage outputs (after the last block's residual addition and ReLU) rather than
      at the last convolution of each stage (``layer1.2.conv3`` … in ``train.py``), and the attention ablates
      a channel of the stage output;
    - the attention's linear probe is fitted by L-BFGS on ``probe_batches`` batches of frozen features, where
      the authors train the new layer for 10 epochs on the frozen backbone first; it is computed on
      ``attention_batches`` batches (the authors: 4 of 32 images);
    - uniform attention divides by ``H_j W_j`` (see above);
    - stage outputs are read as channel-first maps ``(B, C, *spatial)``, as CNNs produce (a transformer
      block's ``(B, N, C)`` tokens would be taken for ``N`` channels);
    - the optimiser and schedule are the engine's (``--model.*``), not the authors' step decay;
    - under bf16 autocast (coretune's default where the hardware supports it) both models' feature maps are
      bf16; their difference and its squared norm are taken in float32. The reference trains in float32.

    Wiring: :meth:`attach_backbone` keeps a frozen copy of the pre-trained backbone (outside the module
    registration: not trainable, not in ``parameters()`` or ``state_dict()``, moved lazily to the data's
    device) and registers forward hooks on the trainable backbone's stages, so the engine still runs the
    trainable backbone once per step; :meth:`forward` needs ``inputs`` (the images of the batch, for the
    frozen copy's own no-grad forward). The frozen copy always runs in evaluation mode, BatchNorm normalising
    with the pre-trained running statistics (which never change), as the authors' ``model_source.eval()`` and
    tllib: in training mode the penalty is therefore not 0 before the first update (the trainable backbone
    normalises with batch statistics); in evaluation mode it is. The attention weights are buffers ``attention_0``,
    ``attention_1`` … (created at the first forward or when set, saved in checkpoints and re-created when a
    checkpoint is loaded); the buffer ``attention_ready`` tells whether they were computed or set (else they
    are uniform).

    Terms (penalties unweighted): ``ce``, ``delta`` (``Ω_FM``), ``l2_new`` (``½‖w_S̄‖²``), ``loss``.

    Args:
        alpha: weight ``α >= 0`` of the feature-map term.
        beta: weight ``β >= 0`` of the L2 penalty on the new heads.
        attention_temperature: softmax temperature of :func:`channel_attention` (5 in the authors' code).
        attention_batches: training batches the attention is computed on before training (:meth:`prepare`;
            the authors use 4 of 32 images); 0 keeps uniform attention. Costs one forward pass per channel and
            batch (960 channels for a ResNet-18, 3,840 for a ResNet-50).
        probe_batches: training batches the linear probe used by the attention is fitted on.
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    optimizer_weight_decay = 0.0
    #: ``coretune tune``'s grid: the feature-map weight α a decade either side of the authors' 0.01; β, the new
    #: heads' L2 in place of weight decay, stays at their 0.01.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"alpha": (0.001, 0.01, 0.1)}

    def __init__(
        self,
        alpha: float = 0.01,
        beta: float = 0.01,
        attention_temperature: float = 5.0,
        attention_batches: int = 2,
        probe_batches: int = 8,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        problems = [f"{n} must be >= 0 (got {v})" for n, v in (("alpha", alpha), ("beta", beta)) if v < 0]
        if attention_temperature <= 0:
            problems.append(f"attention_temperature must be > 0 (got {attention_temperature})")
        if attention_batches < 0 or probe_batches < 1:
            problems.append(
                f"attention_batches must be >= 0 and probe_batches >= 1 (got {attention_batches}, {probe_batches})"
            )
        if problems:
            raise ValueError("invalid DELTA settings: " + "; ".join(problems))
        self.alpha, self.beta, self.attention_temperature = alpha, beta, attention_temperature
        self.attention_batches, self.probe_batches = attention_batches, probe_batches
        # Lists keep these out of the module registration (see the class docstring).
        self._backbone: list[nn.Module] = []
        self._reference: list[nn.Module] = []
        self._stage_names: list[str] = []
        self._current: list[Tensor | None] = []
        self._frozen: list[Tensor | None] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.register_buffer("attention_ready", torch.tensor(False))

    # -- set-up ---------------------------------------------------------------------------------------------
    def attach_backbone(self, backbone: nn.Module) -> None:
        """Keep a frozen copy of the pre-trained ``backbone`` and hook the outputs of its stages."""
        for handle in self._handles:
            handle.remove()
        names = stage_names(backbone)
        reference = frozen_copy(backbone).eval()  # the source model keeps its running statistics (authors)
        self._backbone, self._reference, self._stage_names = [backbone], [reference], names
        self._current = [None] * len(names)
        self._frozen = [None] * len(names)
        self._handles = capture_outputs([backbone.get_submodule(n) for n in names], self._current)
        self._handles += capture_outputs([reference.get_submodule(n) for n in names], self._frozen)

    def _load_from_state_dict(self, state_dict: dict[str, Tensor], prefix: str, *args: object) -> None:
        # The attention buffers appear lazily (their sizes come from the backbone): create them first.
        for key, value in state_dict.items():
            name = key[len(prefix) :]
            lazy = key.startswith(prefix) and name.startswith("attention_") and name[10:].isdigit()
            if lazy and name not in self._buffers:
                self.register_buffer(name, torch.empty_like(value))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def attention(self, stage: int, channels: int, device: torch.device) -> Tensor:
        """Channel weights ``a_j`` of stage ``j``: buffer ``attention_j``, uniform until computed or set."""
        name = f"attention_{stage}"
        weights = self._buffers.get(name)
        if weights is None:
            weights = torch.full((channels,), 1.0 / channels, device=device)
            self.register_buffer(name, weights)
        elif weights.numel() != channels:
            raise ValueError(
                f"delta has {weights.numel()} attention weights for stage {stage}, whose output has "
                f"{channels} channels: the attention was computed for another backbone"
            )
        return weights

    def set_channel_attention(self, weights: Sequence[Tensor]) -> None:
        """Use precomputed channel weights: one ``(C_j,)`` tensor per stage (:func:`channel_attention`)."""
        self._require_backbone()
        if len(weights) != len(self._stage_names):
            raise ValueError(f"expected channel weights for {len(self._stage_names)} stages, got {len(weights)}")
        for j, w in enumerate(weights):
            if w.dim() != 1 or bool((w < 0).any()):
                raise ValueError(f"channel weights must be 1-D and >= 0; stage {j} has shape {tuple(w.shape)}")
            self.attention(j, w.numel(), w.device).copy_(w.detach())
        self.attention_ready.fill_(True)

    def compute_channel_attention(
        self, batches: Iterable[tuple[Tensor, Tensor]], classifier: nn.Module | None = None
    ) -> list[Tensor]:
        """Compute the attention once from the frozen pre-trained copy (:func:`channel_attention`) and use it.

        ``classifier`` should be a head trained on the pre-trained features (the authors first train the new
        fully-connected layer for 10 epochs on the frozen backbone); it defaults to this objective's
        classifier, which is only meaningful once trained. ``batches`` are ``(images, labels)`` pairs (a few
        suffice).
        """
        reference = self._require_backbone()
        head = self.classifier if classifier is None else classifier
        device = next(iter(head.parameters())).device
        move_to(reference, device)
        weights = channel_attention(
            reference,
            [reference.get_submodule(n) for n in self._stage_names],
            head,
            ((x.to(device), y.to(device)) for x, y in batches),
            self.attention_temperature,
        )
        self.set_channel_attention(weights)
        return weights

    def prepare(self, batches: Iterable[tuple[Tensor, Tensor]]) -> None:
        """Before training: fit a linear probe on the frozen pre-trained features of ``probe_batches`` batches
        (the authors first train the new layer on the frozen backbone), then compute the channel attention from
        the first ``attention_batches`` of them. ``attention_batches = 0`` keeps uniform attention."""
        if self.attention_batches == 0 or bool(self.attention_ready):
            return
        reference = self._require_backbone()
        taken = list(itertools.islice(batches, max(self.attention_batches, self.probe_batches)))
        if not taken:
            return
        device = next(iter(self.classifier.parameters())).device
        move_to(reference, device)
        with torch.no_grad():
            feats = torch.cat([reference(x.to(device)).float() for x, _ in taken])
        labels = torch.cat([y for _, y in taken]).to(device)
        probe = nn.Linear(feats.shape[1], self.num_classes).to(device)
        optimizer = torch.optim.LBFGS(probe.parameters(), max_iter=100, line_search_fn="strong_wolfe")

        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = F.cross_entropy(probe(feats), labels) + 1e-4 * probe.weight.square().sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        self.compute_channel_attention(taken[: self.attention_batches], classifier=probe)

    @property
    def reference_backbone(self) -> nn.Module:
        """The frozen copy of the pre-trained backbone (``FM_j(w⁰, ·)``)."""
        return self._require_backbone()

    def _require_backbone(self) -> nn.Module:
        if not self._reference:
            raise RuntimeError("delta needs the pre-trained backbone: call objective.attach_backbone(backbone) first")
        return self._reference[0]

    # -- computation ----------------------------------------------------------------------------------------
    def feature_map_penalty(self, inputs: Tensor) -> Tensor:
        """``Ω_FM`` between the trainable backbone's last captured stage outputs and the frozen copy's."""
        reference = self._require_backbone()
        current = list(self._current)
        self._current[:] = [None] * len(current)  # release the activations once used
        if any(fm is None or fm.shape[0] != inputs.shape[0] for fm in current):
            raise RuntimeError(
                "delta found no stage outputs of this batch: run the attached backbone on the batch's "
                "images just before calling the objective"
            )
        with torch.no_grad():
            move_to(reference, inputs.device)(inputs)
        frozen = list(self._frozen)
        self._frozen[:] = [None] * len(frozen)
        total = inputs.new_zeros((), dtype=torch.float32)
        for j, (fm, fm0) in enumerate(zip(current, frozen, strict=True)):
            b, c = fm.shape[:2]
            spatial = fm[0, 0].numel()
            weights = self.attention(j, c, fm.device).to(fm.device, torch.float32)
            diff = (fm.float() - fm0.float()).reshape(b, c, spatial)
            per_channel = diff.pow(2).sum(dim=2)  # (B, C): ‖FM_jc(w, x_b) − FM_jc(w⁰, x_b)‖²
            total = total + 0.5 * (c * weights * per_channel / spatial).sum()
        return total

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        if inputs is None:
            raise ValueError("delta needs the batch's images: call objective(features, labels, inputs=images)")
        logits = self.classifier(features)
        ce = self.cross_entropy(logits, labels)
        fm = self.feature_map_penalty(inputs).to(ce.device)
        new = l2_penalty(self.parameters())
        loss = ce + self.alpha * fm + self.beta * new
        terms = {"ce": ce.detach(), "delta": fm.detach(), "l2_new": new.detach(), "loss": loss.detach()}
        return ObjectiveOutput(loss, logits, terms)
