"""Frozen-feature evaluation of an encoder: weighted kNN and linear probing (the paper's Appendix D tables).

- :func:`knn_predict` — the weighted kNN classifier of InstDisc (Wu et al., CVPR 2018, §3.4): cosine
  similarity ``s_i`` to the ``k`` nearest training features, each neighbour votes for its class with weight
  ``exp(s_i / τ)``; k = 20 and τ = 0.07 by default, DINO's settings (Caron et al., ICCV 2021; InstDisc used
  k = 200).
- :func:`linear_probe` — multinomial logistic regression on standardised frozen features, fitted full-batch
  with L-BFGS in torch (any device), minimising ``mean CE + λ/2 ‖W‖²`` (bias not penalised): scikit-learn's
  ``LogisticRegression(C)`` objective with ``λ = 1 / (C · n)``; ``λ`` is picked from a grid on a stratified
  hold-out of the training features, then the probe is refitted on all of them.

Features come from :func:`extract_features` (encoder in eval mode, no augmentation); :func:`evaluate_encoder`
runs the whole protocol on an :class:`~coretune.data.ImageClassificationData`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from .devices import PRECISIONS, Placement

__all__ = [
    "DEFAULT_WEIGHT_DECAYS",
    "EvalResult",
    "LinearProbe",
    "evaluate_encoder",
    "extract_features",
    "knn_predict",
    "linear_probe",
    "top_k_accuracy",
]

DEFAULT_WEIGHT_DECAYS: tuple[float, ...] = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
"""The L2 grid of :func:`linear_probe` (per-sample scale: ``λ = 1 / (C · n)`` in scikit-learn terms)."""


@torch.no_grad()
def extract_features(
    encoder: nn.Module, loader: Iterable[Any], device: torch.device | str | None = None, precision: str = "32-true"
) -> tuple[Tensor, Tensor]:
    """Features ``(N, d)`` (float32, CPU) and labels ``(N,)`` of every ``(images, labels, ...)`` batch.

    The encoder runs in eval mode (BatchNorm running statistics) on ``device`` (default: its own) at ``precision``
    (``32-true``, or ``bf16-mixed`` / ``16-mixed`` under autocast: :class:`~coretune.apps.devices.Placement`), and is
    put back in its previous mode after.
    """
    device = torch.device(device) if device is not None else next(encoder.parameters()).device
    place = Placement(device, PRECISIONS.get(str(precision), str(precision)))
    was_training = encoder.training
    encoder.eval().to(device)
    features, labels = [], []
    try:
        for batch in loader:
            with place.autocast():
                features.append(encoder(batch[0].to(device)).float().cpu())
            labels.append(torch.as_tensor(batch[1]).long().cpu())
    finally:
        encoder.train(was_training)
    if not features:
        raise ValueError("extract_features got an empty loader: the split holds no images")
    return torch.cat(features), torch.cat(labels)


def _num_classes(labels: Tensor, num_classes: int | None) -> int:
    return int(labels.max()) + 1 if num_classes is None else num_classes


@torch.no_grad()
def knn_predict(
    train_feats: Tensor,
    train_labels: Tensor,
    test_feats: Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
    chunk_size: int = 1024,
) -> Tensor:
    """Weighted kNN predictions ``(M,)`` (InstDisc): class scores ``Σ_{i ∈ top-k} exp(s_i/τ)·[y_i = c]``.

    ``s_i`` is the cosine similarity between a test feature and training feature ``i``; ``k`` is capped at the
    number of training features. Test features are processed ``chunk_size`` at a time.
    """
    if k < 1 or temperature <= 0:
        raise ValueError(f"k must be >= 1 and temperature > 0, got k={k}, temperature={temperature}")
    if train_feats.shape[0] != train_labels.shape[0]:
        raise ValueError(f"{train_feats.shape[0]} training features but {train_labels.shape[0]} labels")
    classes = _num_classes(train_labels, num_classes)
    bank = F.normalize(train_feats.float(), dim=1)
    labels = train_labels.to(bank.device).long()
    k = min(k, bank.shape[0])
    predictions = []
    for chunk in test_feats.float().to(bank.device).split(chunk_size):
        sims, idx = (F.normalize(chunk, dim=1) @ bank.T).topk(k, dim=1)
        scores = torch.zeros(chunk.shape[0], classes, device=bank.device)
        scores.scatter_add_(1, labels[idx], (sims / temperature).exp())
        predictions.append(scores.argmax(dim=1))
    return torch.cat(predictions)


class LinearProbe(nn.Module):
    """A linear classifier on standardised features: ``logits = W ((x - mean) / std) + b``."""

    def __init__(self, mean: Tensor, std: Tensor, num_classes: int, weight_decay: float) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.linear = nn.Linear(mean.numel(), num_classes)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.weight_decay = weight_decay
        self.iterations = 0  # the L-BFGS iterations of its fit (:func:`_fit`)
        self.converged = True  # False: the fit stopped at its iteration (or evaluation) cap

    def forward(self, features: Tensor) -> Tensor:
        return self.linear((features.float() - self.mean) / self.std)


def _fit(probe: LinearProbe, feats: Tensor, labels: Tensor, max_iter: int) -> LinearProbe:
    """Minimise ``mean CE + λ/2 ‖W‖²`` full-batch with L-BFGS (strong-Wolfe line search)."""
    optimizer = torch.optim.LBFGS(
        probe.linear.parameters(),
        lr=1,
        max_iter=max_iter,
        history_size=20,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(probe(feats), labels)
        loss = loss + probe.weight_decay / 2 * probe.linear.weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    state = optimizer.state_dict()["state"][0]
    probe.iterations = int(state["n_iter"])
    # L-BFGS also stops at 1.25 × max_iter loss evaluations (its default max_eval); either cap is no convergence
    probe.converged = probe.iterations < max_iter and int(state["func_evals"]) < max_iter * 5 // 4
    return probe


def linear_probe(
    train_feats: Tensor,
    train_labels: Tensor,
    num_classes: int | None = None,
    weight_decay: float | Sequence[float] = DEFAULT_WEIGHT_DECAYS,
    holdout_fraction: float = 0.2,
    max_iter: int = 500,
    seed: int = 0,
) -> LinearProbe:
    """Fit a :class:`LinearProbe` (multinomial logistic regression) on frozen features.

    Args:
        train_feats: ``(N, d)`` features.
        train_labels: their ``(N,)`` labels.
        num_classes: number of classes (default: ``max label + 1``).
        weight_decay: ``λ``, or a grid of values: each is fitted on a stratified ``1 - holdout_fraction`` of
            the training features and scored on the rest; the best (ties: the larger ``λ``) is refitted on
            all of them.
        holdout_fraction: share of each class held out to choose ``λ`` (grid only).
        max_iter: L-BFGS iterations per fit (the probe records how many it ran, ``iterations``, and whether it
            stopped before this cap, ``converged``).
        seed: seed of the hold-out split.
    """
    from ..data import stratified_split

    classes = _num_classes(train_labels, num_classes)
    feats, labels = train_feats.float(), train_labels.long().to(train_feats.device)
    values = [weight_decay] if isinstance(weight_decay, int | float) else weight_decay
    grid = [float(w) for w in values]
    if not grid or any(w < 0 for w in grid):
        raise ValueError(f"weight_decay must be >= 0 (a value or a non-empty grid), got {weight_decay}")

    def fit(rows: Tensor, wd: float) -> LinearProbe:
        x = feats[rows]
        std = x.std(dim=0)
        std = torch.where(std > 1e-6, std, torch.ones_like(std))  # constant features: scale 1, as StandardScaler
        probe = LinearProbe(x.mean(dim=0), std, classes, wd).to(feats.device)
        return _fit(probe, x, labels[rows], max_iter)

    best = grid[0]
    if len(grid) > 1:
        fit_idx, held_idx = (
            torch.tensor(i, dtype=torch.long, device=feats.device)
            for i in stratified_split(labels.cpu().numpy(), holdout_fraction, seed, name="holdout_fraction")
        )
        scores = {
            wd: (fit(fit_idx, wd)(feats[held_idx]).argmax(1) == labels[held_idx]).float().mean().item() for wd in grid
        }
        best = max(sorted(grid, reverse=True), key=lambda wd: scores[wd])
    return fit(torch.arange(feats.shape[0], device=feats.device), best)


def top_k_accuracy(logits: Tensor, labels: Tensor, k: int = 1) -> float:
    """Share of rows whose label is among the ``k`` highest logits."""
    top = logits.topk(min(k, logits.shape[1]), dim=1).indices
    return (top == labels[:, None].to(top.device)).any(dim=1).float().mean().item()


@dataclass
class EvalResult:
    """Outcome of :func:`evaluate_encoder`: top-1 (and top-5 for the probe) on the test split, in [0, 1]."""

    protocol: str
    top1: float
    top5: float | None = None
    num_train: int = 0
    num_test: int = 0
    settings: dict[str, Any] = field(default_factory=dict)


def evaluate_encoder(
    encoder: nn.Module,
    data: Any,
    protocol: Literal["knn", "linear"],
    *,
    k: int = 20,
    temperature: float = 0.07,
    weight_decay: float | Sequence[float] = DEFAULT_WEIGHT_DECAYS,
    device: torch.device | str | None = None,
    precision: str = "32-true",
    seed: int = 0,
) -> EvalResult:
    """kNN or linear-probe accuracy of ``encoder`` on an :class:`~coretune.data.ImageClassificationData`.

    Features of its training split (after ``label_fraction`` / ``val_fraction``; evaluation transform, no
    augmentation) are the kNN memory bank / probe training set; its test split is scored. ``device`` and
    ``precision``: where and how the features are extracted (:func:`extract_features`; the kNN and the probe run in
    float32). ``seed``: the linear probe's hold-out split (:func:`linear_probe`).
    """
    data.setup("test")  # with cache_images: the test split decoded, and the training split as evaluated below
    train_set = data.train_as_evaluated()
    loading = data.loader_settings()  # auto: for this machine (no trainer)
    loader = DataLoader(train_set, batch_size=data.eval_batch_size, num_workers=loading.num_workers,
                        pin_memory=loading.pin_memory)  # fmt: skip
    train_f, train_y = extract_features(encoder, loader, device, precision)
    test_f, test_y = extract_features(encoder, data.test_dataloader(), device, precision)
    classes = data.num_classes
    if protocol == "knn":
        pred = knn_predict(train_f, train_y, test_f, k=k, temperature=temperature, num_classes=classes)
        top1 = (pred == test_y).float().mean().item()
        used = {"k": min(k, len(train_y)), "temperature": temperature}  # k as used: at most the bank's size
        return EvalResult("knn", top1, None, len(train_y), len(test_y), used)
    if protocol == "linear":
        probe = linear_probe(train_f, train_y, classes, weight_decay, seed=seed)
        if not probe.converged:
            warnings.warn(
                f"the linear probe's L-BFGS fit (λ = {probe.weight_decay:g}) stopped at its iteration cap after "
                f"{probe.iterations} iterations, before converging: its top-1 may be a little low",
                UserWarning,
                stacklevel=2,
            )
        with torch.no_grad():
            logits = probe(test_f)
        return EvalResult(
            "linear",
            top_k_accuracy(logits, test_y, 1),
            top_k_accuracy(logits, test_y, 5),
            len(train_y),
            len(test_y),
            {"weight_decay": probe.weight_decay, "lbfgs_iterations": probe.iterations},
        )
    raise ValueError(f"unknown protocol {protocol!r}: choose 'knn' or 'linear'")
