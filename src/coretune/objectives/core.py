"""Core-tuning: contrast-regularised fine-tuning (Zhang et al., NeurIPS 2021, §4, Algorithm 1)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..distributed import gather_batch, gather_rows
from ..heads import ProjectionHead
from ..losses import (
    contrastive_loss,
    core_positive_mask,
    image_label_positive_mask,
    own_pairs_mask,
    soft_cross_entropy,
    supcon_positive_mask,
)
from ..memory import FeatureMemory
from ..mining import beta_draws, mine_hard_pairs, mine_hard_positives, representable
from .base import Objective, ObjectiveOutput, register

__all__ = ["TABLE2_ROWS", "CoreTuning", "dense_contrastive_loss"]

Mixing = Literal["hard", "manifold", "none"]
ClassifierPairs = Literal["both", "negatives"]
GeneratedPairs = Literal["all", "own"]


@register("ce_con_mixh", {"focal": False}, "Table 2 row 4: CE + L_con + hardness-directed mixup.")
@register("ce_mix", {"eta": 0.0, "mixing": "manifold"}, "Table 2 row 3: CE + manifold mixup.")
@register("ce_con", {"focal": False, "mixing": "none"}, "Table 2 row 2: CE + L_con (SupCon).")
@register("core", doc="Core-tuning: focal contrastive loss + hardness-directed mixup + smooth classifier.")
class CoreTuning(Objective):
    r"""Core-tuning: :math:`\mathcal{L} = \mathcal{L}^m_{ce} + \eta\,\mathcal{L}^f_{con}` (paper §4.2).

    For a batch ``z = G_e(x)`` with labels ``y``:

    - hardness-directed mixup (§4.1) generates a hard positive ``z⁺`` and a hard negative ``z⁻`` per anchor
      (:func:`coretune.mine_hard_pairs`);
    - ``L^f_con = contrastive_loss(normalize(G_c([z; z⁺; z⁻])), core_positive_mask(y), τ, focal=True)``;
    - smooth classifier learning: ``L^m_ce = CE(G_y(z), y) + soft-CE(G_y(B), y_B)`` over the generated rows ``B``.

    Ablation switches (Table 2, Appendix E): ``focal`` (``L^f_con`` vs ``L_con``); ``mixing`` = ``"hard"``
    (mix-H), ``"manifold"`` (manifold mixup of random pairs, classifier only; the contrast then uses SupCon on
    the originals; one ``λ ~ Beta(α, α)`` per row and the CE on the originals kept, where
    :class:`~coretune.objectives.ManifoldMixup`, Verma et al.'s form, draws one ``λ`` per batch and trains on the
    mixed rows only) or ``"none"``; ``smooth_classifier`` (CE on the generated rows); ``classifier_pairs``
    (``"both"`` generated rows or only ``"negatives"``); ``original_positives`` (off: only ``z⁺`` is a
    positive). ``eta = 0`` drops the contrastive term and its projection head. ``generated_pairs``: ``"all"``
    puts every generated row of the batch into each anchor's ``A_i``, as the authors' code does; ``"own"`` is
    Algorithm 1 read literally, each anchor's ``A_i`` holds only its own ``z⁺_i`` and ``z⁻_i``
    (:func:`coretune.losses.own_pairs_mask`).

    Cross-batch memory (``memory_size = N > 0``, off by default, beyond the paper: "all hard pair generation is
    conducted within each sample batch"): a FIFO queue (:class:`coretune.memory.FeatureMemory`, buffers saved in
    checkpoints) of the encoder features ``z`` of the last ``N`` training samples, detached, with their labels.
    Under DDP it is filled with the batch gathered from every process, so all processes hold the same queue.
    At each training step its ``M <= N`` rows, from *earlier* steps (the batch is written after the loss, so an
    anchor never meets its own copy), are

    - candidates of the mining: hardest positives, hardest negatives and random negatives come from the pool
      ``[z; memory]`` (``B × (B + M)`` similarities at once), a memory row mixed into ``z⁺``/``z⁻`` being a
      constant;
    - extra rows of the contrastive loss after ``v = [z; z⁺; z⁻]``: in every ``A_i``, and in ``P_i`` when they
      share the anchor's class (unless ``original_positives=False``). Like MoCo's and XBM's memory they pass
      through the *current* projection head, without gradient (to the encoder or to the head): they are keys.

    Domains (domain generalization, whose batches carry domain labels, ``forward(..., domains=d)``): by default
    positives are by class across domains, as in the paper's DG experiments (§5.3). With
    ``same_domain_positives=True`` an anchor's positives among the batch's rows are its class's samples *of its own
    domain*, its hardest positive is mined among them, and samples of its class from other domains are left out of
    its contrast altogether (``A_i``, neither positive nor negative: as negatives they would push a class's domains
    apart, against what domain generalization wants); other classes' samples of every domain stay negatives. The
    rule concerns the batch's samples: the generated rows are treated as without domains (the anchor's own ``z⁺``
    is its positive; with ``generated_pairs=all`` the other anchors' ``z⁺``/``z⁻`` sit in ``A_i``, of whatever
    class or domain, as in the paper's setting). It needs no cross-batch memory (the memory keeps no domain
    labels).

    Memory rows go stale as the encoder trains. As XBM (Wang et al., CVPR 2020, whose sample configuration starts
    the memory at iteration 1,000 of 35,000 of fine-tuning an ImageNet-pretrained encoder, once the features
    drift slowly) the memory is neither read nor written during the first ``memory_warmup_steps`` training steps
    (default 1,000, XBM's number; counted in ``memory.steps``, one per training-mode call, i.e. per batch under
    gradient accumulation), and then fills from empty. The term
    ``memory`` logs how many memory rows a step used. The memory is only used in training mode; with
    ``memory_size = 0``, during the warm-up and while it is empty, the loss is exactly the in-batch one.

    Args:
        eta: trade-off ``η >= 0`` of the contrastive term.
        temperature: ``τ > 0``.
        alpha: Beta concentration ``α > 0`` of the mixup weights.
        lambda_n: clip ``λ_n ∈ [0, 1]`` of hard negatives.
        lambda_p: clip ``λ_p ∈ [0, 1]`` of hard positives.
        proj_dim: output width of ``G_c``.
        proj_depth: number of linear layers of ``G_c`` (1–3).
        gather: under DDP, compute the whole loss on the batch gathered from every process (global hard-pair
            mining, :func:`coretune.distributed.gather_batch`); ``False`` keeps it per process.
        generated_pairs: ``"all"`` or ``"own"`` generated rows in each anchor's ``A_i`` (see above).
        memory_size: rows ``N >= 0`` of the cross-batch memory; 0 turns it off.
        memory_warmup_steps: training steps before the memory is used and filled.
        same_domain_positives: restrict positives to the anchor's domain (see above; needs domain labels).
    """

    #: The paper's grid (§5.1, Appendix C): η and α from {0.1, 1, 10}.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"eta": (0.1, 1.0, 10.0), "alpha": (0.1, 1.0, 10.0)}

    @classmethod
    def untunable(cls, preset: dict[str, Any]) -> str | None:
        """A preset that mixes nothing (``ce_con``): α, the mixing's, would have no effect."""
        if preset.get("mixing") == "none":
            return "mixes nothing (mixing='none'): alpha would have no effect"
        return None

    def __init__(
        self,
        eta: float = 0.1,
        temperature: float = 0.07,
        alpha: float = 1.0,
        lambda_n: float = 0.8,
        lambda_p: float = 0.0,
        proj_dim: int = 256,
        proj_depth: int = 2,
        focal: bool = True,
        mixing: Mixing = "hard",
        smooth_classifier: bool = True,
        classifier_pairs: ClassifierPairs = "both",
        original_positives: bool = True,
        gather: bool = True,
        generated_pairs: GeneratedPairs = "all",
        memory_size: int = 0,
        memory_warmup_steps: int = 1000,
        same_domain_positives: bool = False,
    ) -> None:
        super().__init__()
        problems = []
        if eta < 0:
            problems.append(f"eta must be >= 0 (got {eta})")
        if temperature <= 0:
            problems.append(f"temperature must be > 0 (got {temperature})")
        if alpha <= 0:
            problems.append(f"alpha must be > 0 (got {alpha})")
        for name, value in (("lambda_n", lambda_n), ("lambda_p", lambda_p)):
            if not 0.0 <= value <= 1.0:
                problems.append(f"{name} must lie in [0, 1] (got {value})")
        if proj_dim < 1:
            problems.append(f"proj_dim must be >= 1 (got {proj_dim})")
        if not 1 <= proj_depth <= 3:
            problems.append(f"proj_depth must be 1, 2 or 3 (got {proj_depth})")
        if mixing not in ("hard", "manifold", "none"):
            problems.append(f"mixing must be 'hard', 'manifold' or 'none' (got {mixing!r})")
        if classifier_pairs not in ("both", "negatives"):
            problems.append(f"classifier_pairs must be 'both' or 'negatives' (got {classifier_pairs!r})")
        if mixing == "manifold" and not smooth_classifier:
            problems.append("mixing='manifold' only feeds the classifier: it needs smooth_classifier=True")
        if mixing != "hard" and not original_positives:
            problems.append("original_positives=False needs mixing='hard' (no generated positives otherwise)")
        if generated_pairs not in ("all", "own"):
            problems.append(f"generated_pairs must be 'all' or 'own' (got {generated_pairs!r})")
        elif generated_pairs == "own" and (mixing != "hard" or eta == 0):
            problems.append("generated_pairs='own' needs mixing='hard' and eta > 0 (no generated rows are contrasted)")
        if memory_size < 0:
            problems.append(f"memory_size must be >= 0 (got {memory_size}); 0 turns the memory off")
        elif memory_size > 0 and mixing != "hard" and eta == 0:
            problems.append("memory_size > 0 needs mixing='hard' or eta > 0 (nothing would use the memory)")
        if memory_warmup_steps < 0:
            problems.append(f"memory_warmup_steps must be >= 0 (got {memory_warmup_steps})")
        if same_domain_positives and memory_size > 0:
            problems.append("same_domain_positives needs memory_size 0 (the memory keeps no domain labels)")
        elif same_domain_positives and mixing != "hard" and eta == 0:
            problems.append("same_domain_positives needs mixing='hard' or eta > 0 (no positives are used)")
        if problems:
            raise ValueError("invalid Core-tuning settings: " + "; ".join(problems))
        self.eta, self.temperature, self.alpha = eta, temperature, alpha
        self.lambda_n, self.lambda_p = lambda_n, lambda_p
        self.proj_dim, self.proj_depth = proj_dim, proj_depth
        self.focal, self.mixing, self.smooth_classifier = focal, mixing, smooth_classifier
        self.classifier_pairs, self.original_positives = classifier_pairs, original_positives
        self.gather, self.generated_pairs = gather, generated_pairs
        self.memory_size, self.memory_warmup_steps = memory_size, memory_warmup_steps
        self.same_domain_positives = same_domain_positives
        self.generator: torch.Generator | None = None

    takes_domains = True  # same_domain_positives reads them
    dense = True  # segmentation: pixel-wise CE + η × dense_contrastive_loss

    def dense_problem(self) -> tuple[str, str] | None:
        if self.mixing == "manifold":
            return f"{self.name!r} with mixing='manifold' (as ce_mix)", (
                "it mixes features to train the classifier, which has no pixels to mix"
            )
        if self.memory_size > 0:
            what = f"{self.name!r} with memory_size {self.memory_size}"
            return what, "its cross-batch memory is for classification only"
        return None

    @property
    def dense_weight(self) -> float:
        return self.eta

    def dense_loss(self, pooled: Tensor, labels: Tensor) -> Tensor:
        """:func:`dense_contrastive_loss` of the pooled feature maps, drawing from :attr:`generator`."""
        return dense_contrastive_loss(self, pooled, labels, self.generator)

    def build_heads(self, feature_dim: int, num_classes: int) -> None:
        if self.eta > 0:
            self.projector = ProjectionHead(feature_dim, self.proj_dim, self.proj_depth)
        if self.memory_size > 0:
            self.memory = FeatureMemory(self.memory_size, feature_dim)

    def _memory_rows(self) -> tuple[Tensor, Tensor] | None:
        """The memory's rows for this step, or ``None`` (no memory, evaluation mode, warm-up, empty)."""
        if self.memory_size == 0 or not self.training or int(self.memory.steps) < self.memory_warmup_steps:
            return None
        return self.memory.rows() if len(self.memory) else None

    def _remember(self, features: Tensor, labels: Tensor, gathered: bool) -> None:
        """Count the training step; after the warm-up, write the batch of every process into the memory."""
        if self.memory_size == 0 or not self.training:
            return
        if int(self.memory.steps) >= self.memory_warmup_steps:
            features, labels = (features, labels) if gathered else (gather_rows(features.detach()), gather_rows(labels))
            self.memory.push(features, labels)
        self.memory.steps += 1

    def _manifold_mix(self, z: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Manifold mixup of random pairs (Verma et al., 2019) on the encoder features."""
        b = z.shape[0]
        perm = torch.randperm(b, generator=self.generator, device="cpu").to(z.device)
        lam = representable(beta_draws(b, self.alpha, self.generator, z.device), z.dtype)
        onehot = F.one_hot(labels, self.num_classes).float()
        mixed = lam.to(z.dtype)[:, None] * z + (1 - lam.to(z.dtype))[:, None] * z[perm]
        return mixed, lam[:, None] * onehot + (1 - lam[:, None]) * onehot[perm]

    def forward(
        self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None, domains: Tensor | None = None
    ) -> ObjectiveOutput:
        """The training loss; ``domains`` ``(B,)`` are the rows' domain labels (used by ``same_domain_positives``)."""
        self._check_built()
        if self.same_domain_positives and domains is None:
            raise ValueError(
                "same_domain_positives needs the batches' domain labels: fine-tune with --task domain_generalization"
            )
        features, labels, rows = gather_batch(features, labels) if self.gathers else (features, labels, slice(None))
        if self.same_domain_positives and self.gathers:
            domains = gather_rows(domains)
        domains = domains if self.same_domain_positives else None
        b = features.shape[0]
        generated: list[Tensor] = []
        targets: list[Tensor] = []
        memory = self._memory_rows()
        memory_features, memory_labels = memory if memory is not None else (None, None)
        contrast_rows, pos_mask = features, supcon_positive_mask(labels)
        if self.mixing == "hard":
            pairs = mine_hard_pairs(
                features,
                labels,
                self.num_classes,
                self.alpha,
                self.lambda_n,
                self.lambda_p,
                self.generator,
                memory_features,
                memory_labels,
                domains,
            )
            if self.classifier_pairs == "both":
                generated, targets = [pairs.pos_features], [pairs.pos_targets]
            generated.append(pairs.neg_features)
            targets.append(pairs.neg_targets)
            contrast_rows = torch.cat([features, pairs.pos_features, pairs.neg_features])
            pos_mask = core_positive_mask(labels, self.original_positives)
        elif self.mixing == "manifold":
            mixed, mixed_targets = self._manifold_mix(features, labels)
            generated, targets = [mixed], [mixed_targets]
        if not self.smooth_classifier:
            generated, targets = [], []

        all_logits = self.classifier(torch.cat([features, *generated]))
        logits = all_logits[:b]
        ce = F.cross_entropy(logits.float(), labels)
        loss = ce
        terms = {"ce": ce.detach()}
        if generated:
            ce_mix = soft_cross_entropy(all_logits[b:], torch.cat(targets))
            loss = loss + ce_mix
            terms["ce_mix"] = ce_mix.detach()
        if self.eta > 0:
            v = F.normalize(self.projector(contrast_rows).float(), dim=1)
            keys = None
            if memory is not None:
                with torch.no_grad():  # keys: through the current head, no gradient anywhere
                    keys = F.normalize(self.projector(memory_features.to(contrast_rows.dtype)).float(), dim=1)
                same = labels[:, None] == memory_labels[None, :]
                pos_mask = torch.cat([pos_mask, same if self.original_positives else torch.zeros_like(same)], dim=1)
            contrast = own_pairs_mask(b, pos_mask.shape[1] - 3 * b, v.device) if self.generated_pairs == "own" else None
            if domains is not None:
                kept = ~_other_domains_of_class(labels, domains, pos_mask.shape[1])
                pos_mask, contrast = pos_mask & kept, kept if contrast is None else contrast & kept
            con = contrastive_loss(v, pos_mask, self.temperature, self.focal, contrast, keys)
            loss = loss + self.eta * con
            terms["con"] = con.detach()
        if self.memory_size > 0:
            terms["memory"] = loss.new_tensor(0.0 if memory is None else float(memory_labels.numel()))
        terms["loss"] = loss.detach()
        self._remember(features.detach(), labels, self.gathers)
        return ObjectiveOutput(loss, logits[rows], terms)


def dense_contrastive_loss(
    objective: CoreTuning, pooled: Tensor, labels: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    """Core-tuning's contrastive regulariser for dense prediction, on ``pooled`` ``(B, C)`` (the backbone's last
    feature map, globally average-pooled) with image-level ``labels``
    (:func:`coretune.tasks.segmentation.image_labels`).

    - Positives: :func:`coretune.losses.image_label_positive_mask` of the labels (a crop without a label is nobody's
      positive and has none, so it is no anchor, only a negative of the others).
    - ``objective.mixing == "hard"``: one hard *positive* is generated per anchor
      (:func:`coretune.mining.mine_hard_positives`: its hardest positive mixed with its hardest negative) and is
      its positive; no hard negative is generated (the paper's source: for dense prediction only hard positive
      pairs are generated). A crop without a label gets no generated row. ``"none"`` (``ce_con``): the originals
      alone (SupCon).
    - The rows go through the objective's own projection head ``G_c`` and
      :func:`coretune.losses.contrastive_loss` (focal as ``objective.focal``, temperature ``τ``); with
      ``generated_pairs="own"`` each anchor's ``A_i`` holds the originals and its own generated row only.
    """
    b = pooled.shape[0]
    labelled = labels >= 0 if labels.dim() == 1 else labels.any(1)
    positives = image_label_positive_mask(labels)
    rows, pos_mask, contrast = pooled, positives, None
    if objective.mixing == "hard":
        generated = mine_hard_positives(pooled, positives, objective.alpha, objective.lambda_p, generator)
        own = torch.diag(labelled)
        originals = positives if objective.original_positives else torch.zeros_like(positives)
        rows, pos_mask = torch.cat([pooled, generated]), torch.cat([originals, own], dim=1)
        others = own if objective.generated_pairs == "own" else labelled[None, :].expand(b, b)
        contrast = torch.cat([torch.ones_like(positives), others], dim=1)
    v = F.normalize(objective.projector(rows).float(), dim=1)
    return contrastive_loss(v, pos_mask, objective.temperature, objective.focal, contrast)


def _other_domains_of_class(labels: Tensor, domains: Tensor, width: int) -> Tensor:
    """``(B, width)``: the batch's rows ``j < B`` of anchor ``i``'s class from another domain (later columns:
    generated rows, never set)."""
    b = labels.numel()
    same_class = labels[:, None] == labels[None, :]
    other_domain = domains.reshape(-1)[:, None] != domains.reshape(-1)[None, :]
    return torch.cat([same_class & other_domain, same_class.new_zeros(b, width - b)], dim=1)


TABLE2_ROWS: tuple[tuple[str, str], ...] = (
    ("CE", "ce"),
    ("CE + L_con", "ce_con"),
    ("CE + mix", "ce_mix"),
    ("CE + L_con + mix-H", "ce_con_mixh"),
    ("CE + L^f_con + mix-H (Core-tuning)", "core"),
)
"""Table 2's rows, in the paper's order: (row label, registered objective name)."""
