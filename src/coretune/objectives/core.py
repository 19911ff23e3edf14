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
    supcon_positive_mask,
)
from ..memory import CrossBatchMemory, FeatureMemory
from ..mining import HardPairMiner, beta_draws, mine_hard_positives, representable
from ._prior import ClassPrior
from .base import MovedSetting, Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["TABLE2_ROWS", "CoreTuning", "dense_contrastive_loss"]

Mixing = Literal["hard", "manifold", "none"]
ClassifierPairs = Literal["both", "negatives"]


def _old_mixing(mixing: Any) -> dict[str, Any]:
    """The settings an older version's ``mixing`` stands for (``hard``: the miner on; else off, ``manifold``
    mixing random pairs instead)."""
    if mixing == "hard":
        return {"miner": {}, "manifold_mixup": False}
    return {"miner": None, "manifold_mixup": mixing == "manifold"} if mixing in ("manifold", "none") else {}


@register("ce_con_mixh", {"focal": False}, "Table 2 row 4: CE + L_con + hardness-directed mixup.")
@register("ce_mix", {"eta": 0.0, "miner": None, "manifold_mixup": True}, "Table 2 row 3: CE + manifold mixup.")
@register("ce_con", {"focal": False, "miner": None}, "Table 2 row 2: CE + L_con (SupCon).")
@register("core", doc="Core-tuning: focal contrastive loss + hardness-directed mixup + smooth classifier.")
class CoreTuning(ClassPrior, Objective):
    r"""Core-tuning: :math:`\mathcal{L} = \mathcal{L}^m_{ce} + \eta\,\mathcal{L}^f_{con}` (paper §4.2).

    For a batch ``z = G_e(x)`` with labels ``y``:

    - hardness-directed mixup (§4.1), the ``miner`` (:class:`coretune.mining.HardPairMiner`), generates a hard
      positive ``z⁺`` and a hard negative ``z⁻`` per anchor (:func:`coretune.mine_hard_pairs`);
    - ``L^f_con = contrastive_loss(normalize(G_c([z; z⁺; z⁻])), core_positive_mask(y), τ, focal=True)``;
    - smooth classifier learning: ``L^m_ce = CE(G_y(z), y) + soft-CE(G_y(B), y_B)`` over the generated rows ``B``.

    The method is composed of parts, each a small component that checks its own settings: the ``miner``
    (``HardPairMiner(lambda_n, lambda_p, original_positives, generated_pairs)``; ``None``: no hard pairs) and the
    cross-batch ``memory`` (``CrossBatchMemory(size, warmup_steps)``; ``None``, the default: none). What the class
    itself checks are the rules that join them (e.g. ``manifold_mixup`` replaces the miner).

    Ablation switches (Table 2, Appendix E): ``focal`` (``L^f_con`` vs ``L_con``); the mixing: the ``miner``
    (mix-H), ``manifold_mixup`` (manifold mixup of random pairs, classifier only, with ``miner=None``; the contrast
    then uses SupCon on the originals; one ``λ ~ Beta(α, α)`` per row and the CE on the originals kept, where
    :class:`~coretune.objectives.ManifoldMixup`, Verma et al.'s form, draws one ``λ`` per batch and trains on the
    mixed rows only) or neither; ``smooth_classifier`` (CE on the generated rows); ``classifier_pairs``
    (``"both"`` generated rows or only ``"negatives"``); the miner's ``original_positives`` (off: only ``z⁺`` is a
    positive). ``eta = 0`` drops the contrastive term and its projection head. The miner's ``generated_pairs``:
    ``"all"`` puts every generated row of the batch into each anchor's ``A_i``, as the authors' code does;
    ``"own"`` is Algorithm 1 read literally, each anchor's ``A_i`` holds only its own ``z⁺_i`` and ``z⁻_i``
    (:func:`coretune.losses.own_pairs_mask`). :attr:`mixing` names the choice (``"hard"``, ``"manifold"``,
    ``"none"``).

    Cross-batch memory (``memory=CrossBatchMemory(N)``, off by default, beyond the paper: "all hard pair generation is
    conducted within each sample batch"): a FIFO queue (:class:`coretune.memory.FeatureMemory`, buffers saved in
    checkpoints) of the encoder features ``z`` of the last ``N`` training samples, detached, with their labels.
    Under DDP it is filled with the batch gathered from every process, so all processes hold the same queue.
    At each training step its ``M <= N`` rows, from *earlier* steps (the batch is written after the loss, so an
    anchor never meets its own copy), are

    - candidates of the mining: hardest positives, hardest negatives and random negatives come from the pool
      ``[z; memory]`` (``B × (B + M)`` similarities at once), a memory row mixed into ``z⁺``/``z⁻`` being a
      constant;
    - extra rows of the contrastive loss after ``v = [z; z⁺; z⁻]``: in every ``A_i``, and in ``P_i`` when they
      share the anchor's class (unless the miner's ``original_positives=False``). Like MoCo's and XBM's memory they pass
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
    drift slowly) the memory is neither read nor written during the first ``warmup_steps`` training steps
    (default 1,000, XBM's number; counted in ``memory.steps``, one per training-mode call, i.e. per batch under
    gradient accumulation), and then fills from empty. The term
    ``memory`` logs how many memory rows a step used. The memory is only used in training mode; with
    no memory, during the warm-up and while it is empty, the loss is exactly the in-batch one.

    Class-imbalanced data (beyond the paper, whose §5.1 fine-tunes on iNaturalist-18 with plain CE): with
    ``logit_adjustment=τ_a > 0`` both cross-entropies of ``L^m_ce`` read the logits shifted by ``τ_a · log π``, ``π``
    the training split's class prior (Menon et al., ICLR 2021, eq. 10, as :class:`~coretune.objectives.LogitAdjusted`;
    for a generated row of soft target ``t``, ``−Σ_k t_k log softmax(G_y(b) + τ_a log π)_k``); the contrastive term is
    unchanged, and evaluation and prediction read the plain logits (the balanced posterior). ``τ_a = 1`` is the
    balanced softmax. ``coretune fit`` counts ``π`` from the training split; the priors are kept in checkpoints. Not
    for segmentation (the pixel-wise cross-entropy is the task's).

    Args:
        eta: trade-off ``η >= 0`` of the contrastive term.
        temperature: ``τ > 0``.
        alpha: Beta concentration ``α > 0`` of the mixup weights (the miner's and manifold mixup's).
        miner: hardness-directed mixup, :class:`~coretune.mining.HardPairMiner`: lambda_n and lambda_p (clips in
            [0, 1] of z⁻'s and z⁺'s mixing weights), original_positives, generated_pairs (all, own), each set as
            ``--objective.miner.lambda_n 0.8``; null: no hard pairs.
        memory: the cross-batch memory, :class:`~coretune.memory.CrossBatchMemory`: size (rows) and warmup_steps
            (1000), set as ``--objective.memory.size 4096``; null (the default): none.
        proj_dim: output width of ``G_c``.
        proj_depth: number of linear layers of ``G_c`` (1–3).
        focal: focal contrastive loss ``L^f_con`` (False: SupCon's ``L_con``).
        manifold_mixup: mix random pairs for the classifier instead (Table 2's "CE + mix"; needs miner null).
        smooth_classifier: train the classifier on the generated rows too (soft-label CE).
        classifier_pairs: the generated rows the classifier trains on: ``both`` or only the ``negatives``.
        gather: under DDP, compute the whole loss on the batch gathered from every process (global hard-pair
            mining, :func:`coretune.distributed.gather_batch`); ``False`` keeps it per process.
        same_domain_positives: restrict positives to the anchor's domain (see above; needs domain labels).
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`): ``CE(G_y(z), y)`` with torch's ``label_smoothing``, the generated
            rows' soft targets ``t`` as ``(1 - s) · t + s / K`` (timm's ``Mixup(label_smoothing=s)`` targets).
        logit_adjustment: the logit adjustment ``τ_a >= 0`` of both cross-entropies (see above; 0, the default: none;
            1: balanced softmax), for class-imbalanced data.
    """

    #: The flat settings of earlier versions, read for one release (``--objective.lambda_n`` …).
    moved_settings: ClassVar[dict[str, MovedSetting]] = {
        "lambda_n": "miner.lambda_n",
        "lambda_p": "miner.lambda_p",
        "original_positives": "miner.original_positives",
        "generated_pairs": "miner.generated_pairs",
        "mixing": _old_mixing,
        "memory_size": lambda size: {"memory": None} if size == 0 else {"memory.size": size},
        "memory_warmup_steps": "memory.warmup_steps",
    }

    #: The paper's grid (§5.1, Appendix C): η and α from {0.1, 1, 10}.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"eta": (0.1, 1.0, 10.0), "alpha": (0.1, 1.0, 10.0)}

    @classmethod
    def untunable(cls, preset: dict[str, Any]) -> str | None:
        """A preset that mixes nothing (``ce_con``): α, the mixing's, would have no effect."""
        if "miner" in preset and preset["miner"] is None and not preset.get("manifold_mixup"):
            return "mixes nothing (miner null, no manifold_mixup): alpha would have no effect"
        return None

    def __init__(
        self,
        eta: float = 0.1,
        temperature: float = 0.07,
        alpha: float = 1.0,
        miner: HardPairMiner | None = HardPairMiner(),  # noqa: B008 - frozen, so shared safely
        memory: CrossBatchMemory | None = None,
        proj_dim: int = 256,
        proj_depth: int = 2,
        focal: bool = True,
        manifold_mixup: bool = False,
        smooth_classifier: bool = True,
        classifier_pairs: ClassifierPairs = "both",
        gather: bool = True,
        same_domain_positives: bool = False,
        label_smoothing: float = 0.0,
        logit_adjustment: float = 0.0,
    ) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        problems = []
        if isinstance(logit_adjustment, bool) or not isinstance(logit_adjustment, int | float) or logit_adjustment < 0:
            problems.append(f"logit_adjustment must be >= 0 (got {logit_adjustment!r}; 1: balanced softmax, 0: none)")
        if eta < 0:
            problems.append(f"eta must be >= 0 (got {eta})")
        if temperature <= 0:
            problems.append(f"temperature must be > 0 (got {temperature})")
        if alpha <= 0:
            problems.append(f"alpha must be > 0 (got {alpha})")
        if proj_dim < 1:
            problems.append(f"proj_dim must be >= 1 (got {proj_dim})")
        if not 1 <= proj_depth <= 3:
            problems.append(f"proj_depth must be 1, 2 or 3 (got {proj_depth})")
        if classifier_pairs not in ("both", "negatives"):
            problems.append(f"classifier_pairs must be 'both' or 'negatives' (got {classifier_pairs!r})")
        # the rules that join the parts
        if manifold_mixup and miner is not None:
            problems.append("manifold_mixup replaces the hard-pair miner: it needs miner null")
        elif manifold_mixup and not smooth_classifier:
            problems.append("manifold_mixup only feeds the classifier: it needs smooth_classifier=True")
        if miner is not None and miner.generated_pairs == "own" and eta == 0:
            problems.append("the miner's generated_pairs='own' needs eta > 0 (no generated rows are contrasted)")
        unused = miner is None and eta == 0  # nothing mines or contrasts: no positive and no memory row is read
        if same_domain_positives and memory is not None:
            problems.append("same_domain_positives needs memory null (the memory keeps no domain labels)")
        elif memory is not None and unused:
            problems.append("memory needs a miner or eta > 0 (nothing would use the memory)")
        if same_domain_positives and unused:
            problems.append("same_domain_positives needs a miner or eta > 0 (no positives are used)")
        if problems:
            raise ValueError("invalid Core-tuning settings: " + "; ".join(problems))
        self.eta, self.temperature, self.alpha = eta, temperature, alpha
        self.miner, self.cross_batch = miner, memory
        self.proj_dim, self.proj_depth = proj_dim, proj_depth
        self.focal, self.manifold_mixup, self.smooth_classifier = focal, manifold_mixup, smooth_classifier
        self.classifier_pairs, self.gather = classifier_pairs, gather
        self.same_domain_positives = same_domain_positives
        self.logit_adjustment = float(logit_adjustment)
        self.generator: torch.Generator | None = None

    takes_domains = True  # same_domain_positives reads them
    dense = True  # segmentation: pixel-wise CE + η × dense_contrastive_loss

    @property  # type: ignore[override]
    def needs_class_counts(self) -> bool:
        """Whether ``coretune fit`` must count the training images per class: for ``logit_adjustment > 0``."""
        return self.logit_adjustment > 0

    @property
    def mixing(self) -> Mixing:
        """How generated rows are made: ``"hard"`` (the miner), ``"manifold"`` (manifold mixup) or ``"none"``."""
        return "hard" if self.miner is not None else "manifold" if self.manifold_mixup else "none"

    @property
    def memory_size(self) -> int:
        """Rows of the cross-batch memory (0: none)."""
        return 0 if self.cross_batch is None else self.cross_batch.size

    def setting(self, name: str, default: Any = None) -> Any:
        # self.memory is the built FeatureMemory (its buffers' names in checkpoints); its settings are cross_batch
        return self.cross_batch if name == "memory" else super().setting(name, default)

    def dense_problem(self) -> tuple[str, str] | None:
        if self.logit_adjustment > 0:
            what = f"{self.name!r} with logit_adjustment {self.logit_adjustment:g}"
            return what, "it adjusts the classifier's cross-entropy by the class prior, not the pixel-wise one"
        if self.manifold_mixup:
            return f"{self.name!r} with manifold_mixup (as ce_mix)", (
                "it mixes features to train the classifier, which has no pixels to mix"
            )
        if self.memory_size > 0:
            what = f"{self.name!r} with a cross-batch memory (memory.size {self.memory_size})"
            return what, "its cross-batch memory is for classification only"
        return None

    @property
    def dense_weight(self) -> float:
        return self.eta

    def dense_loss(self, pooled: Tensor, labels: Tensor) -> Tensor:
        """:func:`dense_contrastive_loss` of the pooled feature maps, drawing from :attr:`generator`."""
        return dense_contrastive_loss(self, pooled, labels, self.generator)

    def build_heads(self, feature_dim: int, num_classes: int) -> None:
        if self.logit_adjustment > 0:
            self.build_prior(num_classes)
        if self.eta > 0:
            self.projector = ProjectionHead(feature_dim, self.proj_dim, self.proj_depth)
        if self.cross_batch is not None:
            self.memory = FeatureMemory(self.cross_batch.size, feature_dim)

    def _memory_rows(self) -> tuple[Tensor, Tensor] | None:
        """The memory's rows for this step, or ``None`` (no memory, evaluation mode, warm-up, empty)."""
        if self.cross_batch is None or not self.training or int(self.memory.steps) < self.cross_batch.warmup_steps:
            return None
        return self.memory.rows() if len(self.memory) else None

    def _remember(self, features: Tensor, labels: Tensor, gathered: bool) -> None:
        """Count the training step; after the warm-up, write the batch of every process into the memory."""
        if self.cross_batch is None or not self.training:
            return
        if int(self.memory.steps) >= self.cross_batch.warmup_steps:
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
        if self.logit_adjustment > 0:
            self.require_prior()
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
        if self.miner is not None:
            pairs = self.miner.mine(
                features, labels, self.num_classes, self.alpha, self.generator, memory_features, memory_labels, domains
            )
            if self.classifier_pairs == "both":
                generated, targets = [pairs.pos_features], [pairs.pos_targets]
            generated.append(pairs.neg_features)
            targets.append(pairs.neg_targets)
            contrast_rows = torch.cat([features, pairs.pos_features, pairs.neg_features])
            pos_mask = core_positive_mask(labels, self.miner.original_positives)
        elif self.manifold_mixup:
            mixed, mixed_targets = self._manifold_mix(features, labels)
            generated, targets = [mixed], [mixed_targets]
        if not self.smooth_classifier:
            generated, targets = [], []

        all_logits = self.classifier(torch.cat([features, *generated]))
        logits = all_logits[:b]
        # the cross-entropies' logits (+ τ log π at logit_adjustment τ > 0); evaluation reads the plain `logits`
        trained = self.prior_adjusted(all_logits, self.logit_adjustment)
        ce = self.cross_entropy(trained[:b], labels)
        loss = ce
        terms = {"ce": ce.detach()}
        if generated:
            ce_mix = self.soft_cross_entropy(trained[b:], torch.cat(targets))
            loss = loss + ce_mix
            terms["ce_mix"] = ce_mix.detach()
        if self.eta > 0:
            v = F.normalize(self.projector(contrast_rows).float(), dim=1)
            keys = None
            if memory is not None:
                with torch.no_grad():  # keys: through the current head, no gradient anywhere
                    keys = F.normalize(self.projector(memory_features.to(contrast_rows.dtype)).float(), dim=1)
                same = labels[:, None] == memory_labels[None, :]
                originals = self.miner is None or self.miner.original_positives
                pos_mask = torch.cat([pos_mask, same if originals else torch.zeros_like(same)], dim=1)
            own = self.miner is not None and self.miner.generated_pairs == "own"
            contrast = own_pairs_mask(b, pos_mask.shape[1] - 3 * b, v.device) if own else None
            if domains is not None:
                kept = ~_other_domains_of_class(labels, domains, pos_mask.shape[1])
                pos_mask, contrast = pos_mask & kept, kept if contrast is None else contrast & kept
            con = contrastive_loss(v, pos_mask, self.temperature, self.focal, contrast, keys)
            loss = loss + self.eta * con
            terms["con"] = con.detach()
        if self.cross_batch is not None:
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
    - with the objective's ``miner``: one hard *positive* is generated per anchor
      (:func:`coretune.mining.mine_hard_positives`: its hardest positive mixed with its hardest negative) and is
      its positive; no hard negative is generated (the paper's source: for dense prediction only hard positive
      pairs are generated). A crop without a label gets no generated row. Without (``ce_con``): the originals
      alone (SupCon).
    - The rows go through the objective's own projection head ``G_c`` and
      :func:`coretune.losses.contrastive_loss` (focal as ``objective.focal``, temperature ``τ``); with
      the miner's ``generated_pairs="own"`` each anchor's ``A_i`` holds the originals and its own generated row only.
    """
    b = pooled.shape[0]
    labelled = labels >= 0 if labels.dim() == 1 else labels.any(1)
    positives = image_label_positive_mask(labels)
    rows, pos_mask, contrast = pooled, positives, None
    if (miner := objective.miner) is not None:
        generated = mine_hard_positives(pooled, positives, objective.alpha, miner.lambda_p, generator)
        own = torch.diag(labelled)
        originals = positives if miner.original_positives else torch.zeros_like(positives)
        rows, pos_mask = torch.cat([pooled, generated]), torch.cat([originals, own], dim=1)
        others = own if miner.generated_pairs == "own" else labelled[None, :].expand(b, b)
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
