"""Contrastive losses of Core-tuning (Zhang et al., NeurIPS 2021, §3 Eq. 1 and §4.1 "Hard pair reweighting").

Pure tensor functions (no state, no framework) and :class:`FocalContrastiveLoss`, the focal contrastive loss as an
``nn.Module`` for any training loop. Computed in float32 (float64 stays float64) even under autocast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FocalContrastiveLoss",
    "contrastive_loss",
    "core_positive_mask",
    "image_label_positive_mask",
    "own_pairs_mask",
    "soft_cross_entropy",
    "supcon_positive_mask",
]


def _loss_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def contrastive_loss(
    features: Tensor,
    pos_mask: Tensor,
    temperature: float = 0.07,
    focal: bool = False,
    contrast_mask: Tensor | None = None,
    keys: Tensor | None = None,
) -> Tensor:
    r"""Supervised contrastive loss, optionally focal-reweighted (paper Eq. 1 and :math:`\mathcal{L}^f_{con}`).

    ``features`` ``v`` is ``(N, d)`` with L2-normalised rows; ``pos_mask`` is ``(M, N)`` and the anchors are rows
    ``0..M-1`` of ``v``. For anchor ``i``, ``A_i`` is every row but ``i`` (or, with ``contrast_mask``, the rows
    ``j != i`` with ``contrast_mask[i, j]``) and ``P_i = {j ∈ A_i : pos_mask[i, j]}`` (a self-pair is never a
    positive, since ``i`` is not in ``A_i``)::

        p_ij   = exp(v_i·v_j / τ) / Σ_{k ∈ A_i} exp(v_i·v_k / τ)
        loss_i = -(1/|P_i|) Σ_{j ∈ P_i} w_ij · log p_ij,   w_ij = 1 - p_ij if focal else 1

    The result is the mean of ``loss_i`` over anchors with ``|P_i| > 0``, and ``0`` (still in the graph, never
    NaN) when there is none. With ``focal=False`` and a same-class mask this is SupCon (Khosla et al., 2020).

    ``keys`` ``(K, d)`` are further rows after ``v`` (a memory's): in ``A_i`` and ``P_i`` like any row (the masks
    then have ``N + K`` columns), never anchors, and constants: no gradient is computed for them.

    Args:
        features: ``(N, d)`` L2-normalised embeddings.
        pos_mask: ``(M, N)`` boolean mask of positives, ``M <= N``.
        temperature: ``τ > 0``.
        focal: weight each positive term by ``1 - p_ij`` (the focal contrastive loss of Core-tuning, §4.1).
        contrast_mask: ``(M, N)`` boolean mask of the rows in each anchor's ``A_i``; ``None``: every row.
        keys: ``(K, d)`` L2-normalised constant rows after ``features``, or ``None``.

    Returns:
        A scalar tensor (float32, or float64 for float64 input).
    """
    if features.dim() != 2:
        raise ValueError(f"features must be (N, d), got shape {tuple(features.shape)}")
    n = features.shape[0]
    if keys is not None and (keys.dim() != 2 or keys.shape[1] != features.shape[1]):
        raise ValueError(f"keys must be (K, {features.shape[1]}), got shape {tuple(keys.shape)}")
    width = n if keys is None else n + keys.shape[0]
    if pos_mask.dim() != 2 or pos_mask.shape[1] != width or pos_mask.shape[0] > n:
        shape = "(M, N)" if keys is None else f"(M, N + K) = (M, {width})"
        raise ValueError(f"pos_mask must be {shape} with M <= N = {n}, got shape {tuple(pos_mask.shape)}")
    if contrast_mask is not None and contrast_mask.shape != pos_mask.shape:
        raise ValueError(
            f"contrast_mask must have pos_mask's shape {tuple(pos_mask.shape)}, got {tuple(contrast_mask.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    m = pos_mask.shape[0]
    dtype = _loss_dtype(features)
    with torch.autocast(device_type=features.device.type, enabled=False):
        v = features.to(dtype)
        logits = v[:m] @ v.T / temperature  # (M, N)
        if keys is not None:  # (M, N + K); a separate product: the backward computes no gradient for the keys
            logits = torch.cat([logits, v[:m] @ keys.detach().to(dtype).T / temperature], dim=1)
        excluded = torch.eye(m, width, dtype=torch.bool, device=v.device)  # j ∉ A_i
        if contrast_mask is not None:
            excluded = excluded | ~contrast_mask.to(device=v.device, dtype=torch.bool)
        # A finite fill keeps rows whose A_i is empty (N = 1) and their gradients free of NaN.
        logits = logits.masked_fill(excluded, torch.finfo(dtype).min)
        log_prob = (logits - torch.logsumexp(logits, dim=1, keepdim=True)).masked_fill(excluded, 0.0)
        positives = pos_mask.to(torch.bool) & ~excluded
        terms = -log_prob
        if focal:
            terms = terms * (1.0 - log_prob.exp())
        terms = torch.where(positives, terms, torch.zeros((), dtype=dtype, device=v.device))
        counts = positives.sum(dim=1)
        per_anchor = terms.sum(dim=1) / counts.clamp(min=1).to(dtype)
        has_pos = (counts > 0).to(dtype)
        return (per_anchor * has_pos).sum() / has_pos.sum().clamp(min=1.0)


def supcon_positive_mask(labels: Tensor) -> Tensor:
    """Same-class mask without the diagonal, ``(B, B)``: the positives of SupCon (paper Eq. 1)."""
    labels = labels.reshape(-1)
    same = labels[:, None] == labels[None, :]
    return same & ~torch.eye(labels.numel(), dtype=torch.bool, device=labels.device)


def image_label_positive_mask(labels: Tensor) -> Tensor:
    """``(B, B)`` bool positives from image-level labels, diagonal excluded (like :func:`supcon_positive_mask`):
    dense prediction's crops, labelled by a rule such as :func:`coretune.tasks.segmentation.image_labels`.

    - single labels ``(B,)``: ``i`` and ``j`` are positives when they have the same label;
    - multi-label ``(B, K)`` bool: when they share at least one class.

    A crop without a label (``-1``, or no class) is nobody's positive and has none: the contrastive loss then
    skips it as an anchor (it has no positive) and keeps it as a negative of the others.
    """
    if labels.dim() == 1:
        labelled = labels >= 0
        return supcon_positive_mask(labels) & labelled[:, None] & labelled[None, :]
    if labels.dim() == 2:
        hot = labels.to(torch.float32)
        eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
        return (hot @ hot.T > 0) & ~eye
    raise ValueError(f"labels must be (B,) class indices or (B, K) K-hot, got shape {tuple(labels.shape)}")


def core_positive_mask(labels: Tensor, original_positives: bool = True) -> Tensor:
    """Positives of Core-tuning for the row layout ``v = [originals (B); hard positives (B); hard negatives (B)]``.

    ``P_i = {j < B : j != i, y_j = y_i} ∪ {B + i}`` (§4.1, Algorithm 1 lines 5-7). The generated hard negative
    ``2B + i`` is in ``A_i`` only. With ``original_positives=False`` only the generated hard positive is a
    positive (Appendix E, "only the generated hard positive pairs").

    Returns:
        A boolean mask of shape ``(B, 3B)``.
    """
    b = labels.numel()
    eye = torch.eye(b, dtype=torch.bool, device=labels.device)
    originals = supcon_positive_mask(labels) if original_positives else torch.zeros_like(eye)
    return torch.cat([originals, eye, torch.zeros_like(eye)], dim=1)


def own_pairs_mask(b: int, extra: int = 0, device: torch.device | str | None = None) -> Tensor:
    """``A_i`` of Algorithm 1 read literally, for the rows ``[originals (B); z⁺ (B); z⁻ (B); extra rows]``.

    Each anchor contrasts with every original, its *own* generated pair ``B + i`` and ``2B + i`` (lines 6-7:
    "add it to ``P_i``, ``A_i``") and every extra row (a memory); the anchor itself is left out by
    :func:`contrastive_loss`. The default (no mask) puts every generated row into every ``A_i``, as the authors'
    code does.

    Returns:
        A boolean mask of shape ``(B, 3B + extra)``, for ``contrast_mask``.
    """
    eye = torch.eye(b, dtype=torch.bool, device=device)
    every = torch.ones(b, b, dtype=torch.bool, device=device)
    return torch.cat([every, eye, eye, torch.ones(b, extra, dtype=torch.bool, device=device)], dim=1)


def soft_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over rows of ``-Σ_k t_k · log softmax(logits)_k``: CE against soft labels (paper §4.2), in float32."""
    dtype = _loss_dtype(logits)
    log_p = torch.log_softmax(logits.to(dtype), dim=1)
    return -(targets.to(dtype) * log_p).sum(dim=1).mean()


class FocalContrastiveLoss(nn.Module):
    r"""Core-tuning's focal contrastive loss :math:`\mathcal{L}^f_{con}` (§4.1) as a module, as
    pytorch-metric-learning's losses are: ``loss_fn = FocalContrastiveLoss(); loss = loss_fn(embeddings, labels)``.

    For embeddings ``v`` (rows L2-normalised here unless ``normalize=False``), with ``A_i`` every row but ``i`` and
    ``P_i`` the rows of ``A_i`` with ``i``'s label::

        p_ij = exp(v_i·v_j / τ) / Σ_{k ∈ A_i} exp(v_i·v_k / τ)
        L    = -(1/n) Σ_i (1/|P_i|) Σ_{j ∈ P_i} (1 - p_ij) · log p_ij

    the mean over the ``n`` anchors that have a positive (one alone in its class is no anchor, only a negative of
    the others; no positive at all gives ``0``, in the graph, never NaN). ``focal=False`` drops the weight
    ``1 - p_ij``: SupCon's :math:`\mathcal{L}_{con}` (Eq. 1). Computed by :func:`contrastive_loss`, in float32
    for fp16/bf16 embeddings, even under autocast.

    Instead of labels, ``positive_mask`` ``(M, N)`` names the positives (anchors: the first ``M`` rows), for row
    layouts with generated rows such as Core-tuning's ``[z; z⁺; z⁻]`` (:func:`core_positive_mask`);
    ``contrast_mask`` ``(M, N)`` restricts each ``A_i`` (:func:`own_pairs_mask`).

    Args:
        temperature: ``τ > 0``.
        focal: weight each positive by ``1 - p_ij`` (``False``: SupCon).
        normalize: L2-normalise the embeddings' rows first (``False``: they already are).
    """

    def __init__(self, temperature: float = 0.07, focal: bool = True, normalize: bool = True) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature, self.focal, self.normalize = temperature, focal, normalize

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor | None = None,
        *,
        positive_mask: Tensor | None = None,
        contrast_mask: Tensor | None = None,
    ) -> Tensor:
        """The loss of ``embeddings`` ``(N, d)`` with ``labels`` ``(N,)`` or a ``positive_mask`` ``(M, N)``
        (exactly one of them); a scalar, float32 (float64 for float64 embeddings)."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be (N, d), got shape {tuple(embeddings.shape)}")
        if (labels is None) == (positive_mask is None):
            raise ValueError(
                "FocalContrastiveLoss takes labels (N,) or positive_mask=(M, N), not "
                + ("both" if labels is not None else "neither")
            )
        if labels is not None:
            if labels.dim() != 1 or labels.numel() != embeddings.shape[0]:
                raise ValueError(
                    f"labels must be ({embeddings.shape[0]},), one per embedding, got shape {tuple(labels.shape)}"
                )
            positive_mask = supcon_positive_mask(labels)
        v = embeddings.to(_loss_dtype(embeddings))
        if self.normalize:
            v = F.normalize(v, dim=1)
        return contrastive_loss(v, positive_mask, self.temperature, self.focal, contrast_mask)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, focal={self.focal}, normalize={self.normalize}"
