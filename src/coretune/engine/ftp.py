r"""FTP, Fast Trainable Projection (Tian et al., NeurIPS 2023, "Fast Trainable Projection for Robust Fine-Tuning"):
after each optimiser step, every backbone tensor is projected back to within a learned distance ``γ`` of its
pre-trained value; ``--model.optim.ftp true`` (any optimiser, any objective).

For a backbone tensor with pre-trained value :math:`w_0`, the optimiser's unconstrained update :math:`\tilde w_t`
(SGD's or Adam's step from :math:`w_{t-1}`) and :math:`c_t = \tilde w_t - w_0`, the paper's Algorithm 1 (the
authors' ``util/FTP.py``, ``FTP.step``) does, per tensor:

.. math::

    n_t &= \lVert c_t \rVert_{\mathrm{MARS}} + 10^{-8}
        \quad\text{(per output row: the sum of } |c_t| \text{ over the other dimensions; a 1-D tensor is one row)} \\
    g_t &= \sum_{\text{rows}} \frac{\langle \nabla_w L(w_{t-1}),\, c_{t-1} \rangle_{\text{row}}}{n_{t-1}}
        \quad\text{(the gradient of the loss w.r.t. } \gamma \text{ through the last projection, Eq. 5)} \\
    g_t &\leftarrow k\, g_t \ \text{ if } g_t > 0 \quad\text{(gradient annealing: } k \in [0, 1]
        \text{ slows the growth of } \gamma \text{)} \\
    \gamma_t &= \operatorname{clip}\bigl(\operatorname{Adam}_{\mu}(\gamma_{t-1}, g_t),\ 10^{-8},\ \max n_t\bigr) \\
    w_t &= w_0 + \operatorname{clip}\bigl(\gamma_t / n_t,\ 0,\ 1\bigr)\, c_t

with :math:`\gamma_1 = 10^{-8}` (the first step keeps the tensor at its pre-trained value) and the update of
:math:`\gamma` an Adam step of learning rate :math:`\mu = 10^{-2}`, betas (0.9, 0.999), bias-corrected with the
tensor's step count :math:`t` (the authors' ``_adam_util``). ``γ`` is a scalar per tensor ("per layer"); the
constraint is on each output row's L1 norm (the "maximum absolute row sum" norm).

Which tensors: the backbone's trainable parameters (the authors' ``exclude_set`` leaves out the new head; the
objective's heads are new here too). The state (``γ``, its Adam moments, :math:`c_{t-1}`, :math:`1/n_{t-1}`, the
step count) lives in the optimiser's per-parameter state, so checkpoints keep it and a resumed run goes on
exactly; the anchors :math:`w_0` are the backbone's weights when the optimiser is made (before a resume restores
the fine-tuned ones: the pre-trained weights, as L2-SP's starting point).

Differences from the authors' code: the projection is a step hook on any torch optimiser rather than their
``SGDP``/``AdamP`` copies of SGD and Adam (the same update: their step computes :math:`\tilde w_t` as SGD/AdamW do,
then projects); the step count is per tensor (theirs is one counter for the optimiser, the same while every tensor
trains at every step: here a tensor frozen for a while, LP-FT's probe, starts its count when it starts training).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["FTP_BETAS", "FTP_MU", "FTPProjection", "ftp_update"]

FTP_MU = 1e-2
"""The learning rate of γ's Adam update (the authors' ``FTP.mu``)."""
FTP_BETAS = (0.9, 0.999)
"""The betas of γ's Adam update (the authors' ``FTP.beta1``, ``FTP.beta2``)."""
_EPS = 1e-8


def _row_norms(c: Tensor) -> Tensor:
    """The MARS norm of each output row of ``c`` plus 1e-8, shaped to broadcast against ``c``."""
    if c.dim() <= 1:
        return c.abs().sum().reshape([1] * max(1, c.dim())) + _EPS
    return c.abs().sum(dim=tuple(range(1, c.dim())), keepdim=True) + _EPS


@torch.no_grad()
def ftp_update(param: Tensor, anchor: Tensor, grad: Tensor, state: dict[str, Any], k: float = 1.0) -> None:
    """Project ``param`` (holding the optimiser's unconstrained update :math:`\\tilde w_t`) in place, with
    ``grad`` the gradient the step was made from and ``state`` its per-parameter optimiser state (read and updated:
    ``ftp_t``, ``ftp_gamma``, ``ftp_m``, ``ftp_v``, ``ftp_prev_c``, ``ftp_prev_scale``); see the module's maths."""
    c = param.float() - anchor.float()
    norms = _row_norms(c)
    t = int(state.get("ftp_t", 0)) + 1
    if t == 1:
        gamma = torch.tensor(_EPS, device=param.device)
        m = v = torch.zeros((), device=param.device)
    else:
        g = (grad.float() * state["ftp_prev_c"] * state["ftp_prev_scale"]).sum()  # Σ_rows <∇, c_{t-1}>_row / n_{t-1}
        if g > 0:
            g = g * k
        beta1, beta2 = FTP_BETAS
        m = beta1 * state["ftp_m"] + (1 - beta1) * g
        v = beta2 * state["ftp_v"] + (1 - beta2) * g**2
        step = (m / (1 - beta1**t)) / (torch.sqrt(v / (1 - beta2**t)) + _EPS)
        gamma = (state["ftp_gamma"] - FTP_MU * step).clamp(_EPS, norms.max())
    scale = 1.0 / norms
    param.copy_((anchor.float() + (gamma * scale).clamp(0, 1) * c).to(param.dtype))
    state.update(ftp_t=t, ftp_gamma=gamma, ftp_m=m, ftp_v=v, ftp_prev_c=c, ftp_prev_scale=scale)


class FTPProjection:
    """FTP as a step hook of an optimiser over ``params`` (``optimizer.register_step_post_hook(FTPProjection(…))``):
    after every step, each of ``params`` that had a gradient is projected (:func:`ftp_update`) towards its value
    now, the anchor.

    Args:
        params: the tensors to constrain (the backbone's trainable parameters), at their pre-trained values.
        k: the gradient-annealing factor ``k`` (the authors' default 1: no annealing).
    """

    def __init__(self, params: Iterable[nn.Parameter], k: float = 1.0) -> None:
        self.pairs = [(p, p.detach().clone()) for p in params]
        self.k = k

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for i, (param, anchor) in enumerate(self.pairs):
            if param.grad is None:
                continue
            if anchor.device != param.device:
                anchor = anchor.to(param.device)
                self.pairs[i] = (param, anchor)
            ftp_update(param, anchor, param.grad, optimizer.state[param], self.k)
