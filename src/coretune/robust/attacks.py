r"""Projected gradient descent (PGD) adversarial examples in ℓ∞ and ℓ2 (Madry et al., ICLR 2018), for the
adversarial training and robustness evaluation of the paper's §5.4 (Table 8).

Everything happens in **pixel space**: images are in ``[0, 1]`` and the model takes them as they are, so the
ε-ball is measured in pixel units (ℓ∞ 8/255 is eight grey levels). coretune's data pipeline normalises images
(:mod:`coretune.data.transforms`); to attack such a model, feed it unnormalised images and put the normalisation
inside the model with :class:`NormalizedModel`.

Pure torch: no state beyond the hyper-parameters, no framework.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from fractions import Fraction
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PGD", "Norm", "NormalizedModel", "check_pixel_images", "eval_mode", "pgd", "pixel_radius"]

Norm = Literal["linf", "l2"]
NORMS: tuple[str, ...] = get_args(Norm)

_TINY = 1e-12  # keeps the ℓ2 directions of an all-zero gradient or perturbation at zero instead of NaN


def pixel_radius(value: float | str, name: str = "eps") -> float:
    """A radius or step in ``[0, 1]`` pixel units as a number or as the fraction papers write: ``8/255``,
    ``"8/255"``, ``"0.5"`` and ``0.5`` all work (``"8/255"`` → 0.0313725…).

    Raises:
        ValueError: one line naming ``name`` when ``value`` is neither a number nor a fraction.
    """
    if isinstance(value, str):
        try:
            return float(Fraction(value.strip()))
        except (ValueError, ZeroDivisionError):
            raise ValueError(
                f"PGD {name} must be a number or a fraction in [0, 1] pixel units (e.g. 8/255 or 0.5), got {value!r}"
            ) from None
    return float(value)


class NormalizedModel(nn.Module):
    """``model((x - mean) / std)``: a model that takes ``[0, 1]`` pixel images.

    ``mean`` and ``std`` are per channel (e.g. :data:`coretune.data.IMAGENET_MEAN` / ``IMAGENET_STD``). They are
    non-persistent buffers, so the wrapper's ``state_dict`` is the wrapped model's under the prefix ``model.``.
    """

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if len(mean) != len(std) or not mean:
            raise ValueError(f"NormalizedModel needs one mean and one std per channel, got {mean} and {std}")
        if not all(s > 0 for s in std):
            raise ValueError(f"NormalizedModel std values must be > 0, got {std}")
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    def forward(self, images: Tensor) -> Tensor:
        return self.model((images - self.mean) / self.std)


def check_pixel_images(images: Tensor, who: str) -> None:
    """Raise a one-line ``ValueError`` naming ``who`` and the fix unless ``images`` lie in ``[0, 1]``."""
    if images.numel() and (images.min() < 0 or images.max() > 1):
        raise ValueError(
            f"{who} needs pixel images in [0, 1], got values in [{images.min():.3g}, {images.max():.3g}]: feed "
            "unnormalised images and wrap the model in coretune.robust.attacks.NormalizedModel(model, mean, std)"
        )


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule of ``model`` in eval mode (BatchNorm uses and keeps its running statistics, dropout
    is off) and give each submodule back its own ``training`` flag afterwards, even a mixed one."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


class PGD:
    r"""PGD with a random start, in pixel space (Madry et al., 2018; as torchattacks' ``PGD`` and ``PGDL2``).

    For clean images ``x ∈ [0, 1]`` with labels ``y`` and the cross-entropy ``L``, start from
    ``x_0 = clip_[0,1](x + δ_0)`` with ``δ_0`` random in the ε-ball (``random_start``; else ``x_0 = x``), then
    for ``t = 0 … steps-1`` ascend with step size ``α`` and project::

        ℓ∞:  x_{t+1} = clip_[0,1](x + clip_[-ε,ε](x_t + α·sign(∇ₓL(x_t, y)) - x))
        ℓ2:  x_{t+1} = clip_[0,1](x + Π_ε(x_t + α·g/‖g‖₂ - x)),   g = ∇ₓL(x_t, y),  Π_ε(δ) = δ·min(1, ε/‖δ‖₂)

    Norms are per example (over all of its pixels). Clipping to ``[0, 1]`` after the projection only shrinks
    ``|δ|`` pixel by pixel, so the result stays in both sets. The random start is, as in torchattacks, uniform
    per pixel in ``[-ε, ε]`` for ℓ∞, and for ℓ2 a uniform direction times a radius uniform in ``[0, ε]``.

    The default step size is ``α = 2.5·ε/steps`` (Madry et al.'s rule: ``steps`` steps can walk 2.5 radii;
    ε = 8/255 and 10 steps give torchattacks' default 2/255).

    The gradient is of the **summed** cross-entropy, so each example's perturbation is independent of the batch.
    While attacking, the whole model is in eval mode (BatchNorm normalises with, and does not update, its running
    statistics; dropout is off); afterwards every submodule gets its own mode back (:func:`eval_mode`). Only the
    images' gradient is computed: the parameters' ``.grad`` are untouched. The model runs under whatever autocast
    the caller has set (e.g. bf16); the perturbation is kept and updated in float32 (float64 for float64 images).
    Under float16 autocast (a GPU without bf16) each example's loss is scaled so that its gradient at the logits,
    ``softmax - onehot``, has largest entry 1: a confidently classified image's gradient (``1 - p`` of 1e-10, far
    below float16's smallest number) would otherwise underflow to zero in the backward pass and stall its attack
    (``sign(0) = 0``), and a fixed scale large enough for it would overflow an unsure image's. Both step
    directions are per example and ignore a positive scale, so the examples are those of float32 arithmetic.

    Args:
        norm: ``"linf"`` or ``"l2"``.
        eps: the radius ε >= 0 of the ball, in ``[0, 1]`` pixel units (ε = 0 returns the clean images); a number
            or a fraction (``"8/255"``, :func:`pixel_radius`). An ℓ∞ radius of 1 or more (``8`` for ``8/255``) is
            refused, and so is an ℓ2 radius above an image's diameter ``√(C·H·W)`` when attacking: either ball
            holds every image.
        steps: number of ascent steps, a whole number >= 1.
        step_size: ``α > 0`` (a number or a fraction); ``None`` for ``2.5·eps/steps``.
        random_start: start from a random point of the ball instead of the clean image.
    """

    def __init__(
        self,
        norm: Norm = "linf",
        eps: float | str = 8 / 255,
        steps: int = 10,
        step_size: float | str | None = None,
        random_start: bool = True,
    ) -> None:
        eps = pixel_radius(eps)
        step_size = None if step_size is None else pixel_radius(step_size, "step_size")
        if norm not in NORMS:
            raise ValueError(f"PGD norm must be one of {', '.join(NORMS)}; got {norm!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"PGD eps must be a finite radius >= 0 in [0, 1] pixel units (e.g. 8/255), got {eps:g}")
        if norm == "linf" and eps >= 1:
            raise ValueError(
                f"PGD linf eps must be < 1 in [0, 1] pixel units, got {eps:g}: a ball that holds every image. Write "
                f"grey levels as a fraction ({eps:g}/255)"
            )
        if isinstance(steps, bool) or not float(steps).is_integer():
            raise ValueError(f"PGD steps must be a whole number, got {steps!r}")
        if steps < 1:
            raise ValueError(f"PGD steps must be >= 1, got {steps}")
        if step_size is not None and not (math.isfinite(step_size) and step_size > 0):
            raise ValueError(f"PGD step_size must be > 0 (or None for 2.5·eps/steps), got {step_size}")
        self.norm, self.eps, self.steps, self.random_start = norm, float(eps), int(steps), random_start
        self.step_size = 2.5 * self.eps / self.steps if step_size is None else float(step_size)

    def __repr__(self) -> str:
        return (
            f"PGD(norm={self.norm!r}, eps={self.eps:g}, steps={self.steps}, step_size={self.step_size:g}, "
            f"random_start={self.random_start})"
        )

    def __call__(
        self, model: nn.Module, images: Tensor, labels: Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        """Adversarial versions of ``images`` ``(N, C, H, W)`` in ``[0, 1]`` against ``model``: a detached tensor
        of the same shape, float32 (float64 for float64 images). ``generator`` draws the random start (the global
        RNG when ``None``), so a seeded generator gives the same examples every run."""
        if images.dim() < 2 or images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"PGD needs images (N, ...) and labels (N,), got {tuple(images.shape)} and {tuple(labels.shape)}"
            )
        dtype = torch.float64 if images.dtype == torch.float64 else torch.float32
        x = images.detach().to(dtype)
        check_pixel_images(x, "PGD")
        labels = labels.detach()
        if self.eps == 0 or not x.numel():
            return x.clone()
        if self.norm == "l2" and self.eps > (diameter := math.sqrt(x[0].numel())):
            raise ValueError(
                f"PGD l2 eps {self.eps:g} is larger than the diameter of these images' [0, 1] pixel cube "
                f"({diameter:.4g} = √{x[0].numel()}): a ball that holds every image. Give ε in [0, 1] pixel units "
                "(the paper's l2 radii: 0.5, 1.5, 2.5)"
            )
        adv = (x + self._random_start(x, generator)).clamp(0, 1) if self.random_start else x.clone()
        device = x.device.type
        half = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16
        with eval_mode(model), torch.enable_grad():
            for _ in range(self.steps):
                grad = _loss_gradient(model, adv, labels, per_example_scale=half)
                adv = self._project(x, adv + self.step_size * self._direction(grad.to(dtype)))
        return adv

    def _random_start(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        """A random ``δ_0`` in the ε-ball (see the class docstring), drawn as torchattacks draws it."""
        device = generator.device if generator is not None else x.device
        if self.norm == "linf":
            delta = torch.rand(x.shape, generator=generator, device=device, dtype=x.dtype) * (2 * self.eps) - self.eps
        else:
            direction = torch.randn(x.shape, generator=generator, device=device, dtype=x.dtype)
            u = torch.rand((x.shape[0],), generator=generator, device=device, dtype=x.dtype)
            delta = direction * _per_example(u / _l2(direction).clamp_min(_TINY) * self.eps, x)
        return delta.to(x.device)

    def _direction(self, grad: Tensor) -> Tensor:
        """The steepest-ascent direction of unit norm: ``sign(g)`` (ℓ∞) or ``g/‖g‖₂`` (ℓ2)."""
        if self.norm == "linf":
            return grad.sign()
        return grad / _per_example(_l2(grad).clamp_min(_TINY), grad)

    def _project(self, x: Tensor, adv: Tensor) -> Tensor:
        """``adv`` projected onto the ε-ball around ``x``, then onto ``[0, 1]``."""
        delta = adv - x
        if self.norm == "linf":
            delta = delta.clamp(-self.eps, self.eps)
        else:
            delta = delta * _per_example((self.eps / _l2(delta).clamp_min(_TINY)).clamp(max=1), delta)
        return (x + delta).clamp(0, 1)


def pgd(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    norm: Norm,
    eps: float | str,
    steps: int = 10,
    step_size: float | str | None = None,
    random_start: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``PGD(norm, eps, steps, step_size, random_start)(model, images, labels, generator)``: see :class:`PGD`."""
    return PGD(norm, eps, steps, step_size, random_start)(model, images, labels, generator)


def _loss_gradient(model: nn.Module, adv: Tensor, labels: Tensor, per_example_scale: bool) -> Tensor:
    """``∇ₓ Σᵢ sᵢ·L(xᵢ, yᵢ)`` at ``x = adv``: ``sᵢ = 1``, or with ``per_example_scale`` (float16, see :class:`PGD`)
    ``sᵢ = 1 / maxₖ |softmax(zᵢ)ₖ - onehot(yᵢ)ₖ|``, which makes each example's largest logit gradient 1."""
    adv = adv.detach().requires_grad_(True)
    logits = model(adv).float()
    losses = F.cross_entropy(logits, labels, reduction="none")
    if per_example_scale:
        at_logits = logits.detach().softmax(1) - F.one_hot(labels, logits.shape[1]).to(logits.dtype)
        losses = losses / at_logits.abs().amax(1).clamp_min(1e-30)
    (grad,) = torch.autograd.grad(losses.sum(), adv)
    return grad


def _l2(t: Tensor) -> Tensor:
    """Per-example ℓ2 norms ``(N,)`` of ``t`` ``(N, ...)``."""
    return t.flatten(1).norm(dim=1)


def _per_example(values: Tensor, like: Tensor) -> Tensor:
    """``values`` ``(N,)`` shaped to broadcast over ``like`` ``(N, ...)``."""
    return values.view(-1, *([1] * (like.dim() - 1)))
