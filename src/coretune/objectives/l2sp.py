"""L2-SP: cross-entropy plus an L2 pull towards the pre-trained weights (Li et al., ICML 2018)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ._backbone import l2_penalty
from .base import Objective, ObjectiveOutput, label_smoothing_setting, register

__all__ = ["L2SP"]


@register("l2sp", doc="L2-SP (Li et al., 2018): CE + α/2‖w − w⁰‖² on the backbone + β/2‖w‖² on new heads.")
class L2SP(Objective):
    r"""L2-SP, "Explicit inductive bias for transfer learning with convolutional networks" (Li et al., 2018).

    .. math:: \mathcal{L} = CE(G_y(z), y) + \frac{\alpha}{2}\lVert w_S - w_S^0\rVert_2^2
              + \frac{\beta}{2}\lVert w_{\bar S}\rVert_2^2

    ``w_S`` are the backbone's parameters and ``w_S⁰`` their values when :meth:`attach_backbone` is called
    (the pre-trained starting point, SP); ``w_S̄`` are the objective's new heads (the classifier, weight and
    bias). The penalty is a loss term, not optimiser weight decay. It covers *every* backbone parameter —
    convolution and linear weights and biases and the BatchNorm affine parameters — as the reference
    implementations (the DELTA authors' ``reg_l2sp`` and tllib's ``SPRegularization``) do; BatchNorm running
    statistics are buffers, not weights, and are not penalised. Defaults ``α = β = 0.01`` are those of the
    reference implementations (the paper selects them by cross-validation).

    Optimiser: the reference implementations train L2-SP *without* weight decay (the DELTA authors'
    ``train.py`` uses 1e-4 for plain fine-tuning only; tllib's ``delta.py`` example, which runs L2-SP too,
    defaults to 0), and the paper replaces weight decay by the penalty: :attr:`optimizer_weight_decay` is 0, so
    the engine gives this objective's run no weight decay whatever ``--model.optim.weight_decay`` says. The reference
    settings otherwise (DELTA's ``train.py`` defaults): SGD with momentum 0.9 (not Nesterov), lr 0.01, batch
    64, 9,000 iterations with the lr divided by 10 after two thirds (its ``run.sh``: 6,000 iterations with an
    exponential decay).

    Differences from the reference code: none in the loss (checked against tllib to float precision). The
    optimiser and schedule are the engine's (``--model.*``: Nesterov momentum and a cosine or linear decay by
    default), not the reference's step decay.

    The starting point is a detached snapshot held outside the module registration: it is not a parameter
    (never seen by the optimiser), not in ``state_dict()`` (re-attach the pre-trained backbone when resuming)
    and is moved lazily to the device of the backbone's parameters.

    Terms (penalties unweighted): ``ce``, ``l2sp`` (``½‖w_S − w_S⁰‖²``), ``l2_new`` (``½‖w_S̄‖²``), ``loss``.

    Args:
        alpha: weight ``α >= 0`` of the starting-point penalty on the backbone.
        beta: weight ``β >= 0`` of the L2 penalty on the new heads.
        label_smoothing: label smoothing of the classifier's cross-entropy, in [0, 1) (0: none;
            :attr:`Objective.label_smoothing`).
    """

    optimizer_weight_decay = 0.0

    #: ``coretune tune``'s grid: α and β, which the paper selects by cross-validation, a decade either side of the
    #: reference implementations' 0.01.
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"alpha": (0.001, 0.01, 0.1), "beta": (0.001, 0.01, 0.1)}

    def __init__(self, alpha: float = 0.01, beta: float = 0.01, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing_setting(label_smoothing)
        problems = [f"{n} must be >= 0 (got {v})" for n, v in (("alpha", alpha), ("beta", beta)) if v < 0]
        if problems:
            raise ValueError("invalid L2-SP settings: " + "; ".join(problems))
        self.alpha, self.beta = alpha, beta
        self._backbone: list[nn.Module] = []  # a list keeps the backbone out of this module's registration
        self._starting_point: dict[str, Tensor] = {}

    def attach_backbone(self, backbone: nn.Module) -> None:
        """Snapshot the pre-trained parameters ``w_S⁰`` of ``backbone`` and track it for the penalty."""
        self._backbone = [backbone]
        self._starting_point = {name: p.detach().clone() for name, p in backbone.named_parameters()}

    def starting_point_penalty(self) -> Tensor:
        """``½ Σ ‖w − w⁰‖²`` over the attached backbone's parameters, in float32."""
        if not self._backbone:
            raise RuntimeError("l2sp needs the pre-trained backbone: call objective.attach_backbone(backbone) first")
        squares = []
        for name, p in self._backbone[0].named_parameters():
            start = self._starting_point.get(name)
            if start is None:
                raise RuntimeError(
                    f"backbone parameter {name!r} did not exist when the backbone was attached: "
                    "attach the backbone after its architecture is final"
                )
            if start.device != p.device:
                start = self._starting_point[name] = start.to(p.device)
            squares.append((p.float() - start.float()).pow(2).sum())
        return 0.5 * torch.stack(squares).sum()

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        self._check_built()
        logits = self.classifier(features)
        ce = self.cross_entropy(logits, labels)
        sp = self.starting_point_penalty().to(ce.device)
        new = l2_penalty(self.parameters())
        loss = ce + self.alpha * sp + self.beta * new
        terms = {"ce": ce.detach(), "l2sp": sp.detach(), "l2_new": new.detach(), "loss": loss.detach()}
        return ObjectiveOutput(loss, logits, terms)
