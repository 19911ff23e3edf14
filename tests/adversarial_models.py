"""A tiny undefended classifier of scikit-learn's 8×8 digits, for the attack and robustness tests."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import Tensor, nn

from coretune.robust.attacks import NormalizedModel

DIGITS_MEAN, DIGITS_STD = (0.3,), (0.4,)


@functools.cache
def digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Train images (1400, 1, 8, 8) in [0, 1] and labels, then the 397 test images and labels."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16
    labels = torch.tensor(data.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    return images[order[:1400]], labels[order[:1400]], images[order[1400:]], labels[order[1400:]]


def small_cnn() -> NormalizedModel:
    """Conv → BatchNorm → ReLU → max-pool → linear, taking [0, 1] pixels (normalisation inside)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
    return NormalizedModel(net, DIGITS_MEAN, DIGITS_STD)


@functools.cache
def _trained_state() -> dict[str, Tensor]:
    model = small_cnn()
    x, y, _, _ = digits()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread, above all on a shared machine
    try:
        for _ in range(200):
            idx = torch.randint(0, len(y), (64,), generator=g)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.clone() for k, v in model.state_dict().items()}


def trained_digits_cnn() -> NormalizedModel:
    """A fresh copy of :func:`small_cnn` trained for 200 Adam steps (about 95% test accuracy), in train mode."""
    model = small_cnn()
    model.load_state_dict(_trained_state())
    return model
