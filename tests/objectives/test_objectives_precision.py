"""Every registered objective under mixed precision (issue 62): its loss and gradients under CPU autocast, float16
(``16-mixed``) and bfloat16 (``bf16-mixed``), match float32's within a stated tolerance, and the loss stays float32."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from coretune import objectives

Factory = Callable[..., nn.Module]

#: (loss, gradient) tolerance per autocast dtype: the loss's relative error, and the relative error (L2 norm) of the
#: backbone's and heads' gradients together. Measured on the tiny backbone at most 5e-4 and 2.4e-3 for float16 (a
#: 10-bit mantissa; ``mm`` the largest), 1e-3 and 0.1 for bfloat16 (7 bits).
TOLERANCE = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (5e-3, 0.2)}


def step(name: str, make: Factory, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One seeded forward and backward of objective ``name`` on a tiny CNN, under CPU autocast of ``dtype``
    (float32: none): the loss and every gradient, flat."""
    torch.manual_seed(0)
    backbone = make(16)
    obj = objectives.create(name, 16, 3)
    obj.generator = torch.Generator().manual_seed(0)  # the mixup objectives' draws
    obj.attach_backbone(backbone)
    if obj.needs_class_counts:  # logit adjustment: the training priors, as a fit observes them
        obj.observe_class_counts(torch.tensor([6, 3, 1]))
    torch.manual_seed(1)
    obj.on_train_epoch_start(0, 4)
    x = torch.randn(12, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2] * 4)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = obj(backbone(x), y, inputs=x)
    out.loss.backward()
    grads = [p.grad.flatten() for p in [*backbone.parameters(), *obj.parameters()] if p.grad is not None]
    return out.loss.detach(), torch.cat(grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_mixed_precision_matches_float32(name: str, dtype: torch.dtype, tiny_backbone: Factory) -> None:
    loss32, grads32 = step(name, tiny_backbone, torch.float32)
    loss, grads = step(name, tiny_backbone, dtype)
    assert loss.dtype == torch.float32 and bool(torch.isfinite(grads).all())
    loss_tol, grad_tol = TOLERANCE[dtype]
    assert abs(float(loss - loss32)) <= loss_tol * abs(float(loss32)), (float(loss), float(loss32))
    assert float((grads - grads32).norm() / grads32.norm()) <= grad_tol
