"""FTP (Tian et al., NeurIPS 2023): the projection after each step and γ's update, against a slow loop written from
the paper's Algorithm 1 (row by row, as the authors' ``SGDP`` computes it), and through a fit."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, make_trainer
from coretune.engine.ftp import FTP_BETAS, FTP_MU, FTPProjection
from coretune.engine.optim import OptimSettings
from coretune.objectives import create


class _SlowFTP:
    """Algorithm 1 for one tensor, with Python loops over rows and plain floats for γ and its Adam moments."""

    def __init__(self, w0: torch.Tensor, k: float) -> None:
        self.w0, self.k, self.t = w0.double().clone(), k, 0
        self.gamma, self.m, self.v = 0.0, 0.0, 0.0
        self.prev_c: torch.Tensor | None = None
        self.prev_norms: list[float] = []

    def rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x.reshape(-1)] if x.dim() <= 1 else [x[i].reshape(-1) for i in range(x.shape[0])]

    def project(self, w_tilde: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        self.t += 1
        c = w_tilde.double() - self.w0
        norms = [float(r.abs().sum()) + 1e-8 for r in self.rows(c)]
        if self.t == 1:
            self.gamma = 1e-8
        else:
            assert self.prev_c is not None
            g = sum(
                float((gr.double() * cr).sum()) / n
                for gr, cr, n in zip(self.rows(grad), self.rows(self.prev_c), self.prev_norms, strict=True)
            )
            g = g * self.k if g > 0 else g
            b1, b2 = FTP_BETAS
            self.m = b1 * self.m + (1 - b1) * g
            self.v = b2 * self.v + (1 - b2) * g * g
            m_hat, v_hat = self.m / (1 - b1**self.t), self.v / (1 - b2**self.t)
            self.gamma = min(max(self.gamma - FTP_MU * m_hat / (math.sqrt(v_hat) + 1e-8), 1e-8), max(norms))
        out = [self.rows(self.w0)[i] + min(max(self.gamma / n, 0.0), 1.0) * cr for i, (cr, n) in
               enumerate(zip(self.rows(c), norms, strict=True))]  # fmt: skip
        self.prev_c, self.prev_norms = c, norms
        return torch.stack(out).reshape(w_tilde.shape) if w_tilde.dim() > 1 else out[0]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("k", [1.0, 0.3])
def test_the_projection_and_gamma_follow_algorithm_1(optimizer: str, k: float) -> None:
    """A conv layer (4-D weight, 1-D bias) trained 12 steps: every step's weights are the slow loop's projection of
    the unconstrained step, and γ its γ (checked past the steps where it is clipped at 1e-8)."""
    torch.manual_seed(0)
    layer = nn.Conv2d(3, 4, 3)
    fast = FTPProjection(layer.parameters(), k=k)
    opt = (torch.optim.SGD(layer.parameters(), lr=0.5, momentum=0.9, nesterov=True) if optimizer == "sgd"
           else torch.optim.AdamW(layer.parameters(), lr=0.05, weight_decay=0.01))  # fmt: skip
    slow = [_SlowFTP(p.detach(), k) for p in layer.parameters()]
    x, target = torch.randn(8, 3, 6, 6), torch.randn(8, 4, 4, 4)
    gammas = []
    for _ in range(12):
        opt.zero_grad()
        ((layer(x) - target) ** 2).mean().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        opt.step()  # unconstrained
        w_tilde = [p.detach().clone() for p in layer.parameters()]
        fast(opt, (), {})
        for p, ref, w, g in zip(layer.parameters(), slow, w_tilde, grads, strict=True):
            expected = ref.project(w, g)
            torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
            assert float(opt.state[p]["ftp_gamma"]) == pytest.approx(ref.gamma, rel=1e-4, abs=1e-9)
            p.data.copy_(expected.float())  # the next step from the reference's weights: errors do not compound
        gammas.append(float(opt.state[layer.weight]["ftp_gamma"]))
    assert gammas[0] == pytest.approx(1e-8) and gammas[-1] > 1e-3  # γ is learned: it grows off its start


def test_the_first_step_keeps_the_pre_trained_weights_and_state_survives_a_checkpoint() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    start = [p.detach().clone() for p in layer.parameters()]
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    opt.register_step_post_hook(FTPProjection(layer.parameters()))
    layer(torch.randn(4, 5)).sum().backward()
    opt.step()
    for p, s in zip(layer.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), s, atol=1e-6, rtol=0)  # γ₁ = 1e-8: w₁ ≈ w₀
    state = opt.state_dict()["state"][0]
    assert {"ftp_t", "ftp_gamma", "ftp_m", "ftp_v", "ftp_prev_c", "ftp_prev_scale"} <= set(state)


def test_a_fit_with_ftp_keeps_every_backbone_row_within_gamma(image_tree: Path, tmp_path: Path) -> None:
    """LP-FT-free CE fit of small_cnn with --model.optim.ftp: each backbone tensor's rows stay within γ (MARS norm)
    of the pre-trained weights; the heads are not projected."""
    L.seed_everything(0)
    model = FineTuner(create("ce"), backbone="small_cnn", optim=OptimSettings(ftp=True, lr=0.1))
    start = {k: v.detach().clone() for k, v in model.backbone.named_parameters()}
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=8, seed=0)
    trainer = make_trainer(tmp_path, progress=False, max_epochs=1, enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    state = trainer.optimizers[0].state
    for name, p in model.backbone.named_parameters():
        gamma = float(state[p]["ftp_gamma"])
        diff = (p.detach() - start[name]).abs()
        rows = diff.reshape(diff.shape[0], -1).sum(1) if diff.dim() > 1 else diff.sum().reshape(1)
        assert float(rows.max()) <= gamma * (1 + 1e-4) + 1e-7, name
    assert not any("ftp_gamma" in state[p] for p in model.objective.parameters())


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"ftp_k": 0.5}, "optim.ftp_k is FTP's gradient annealing: give ftp true too"),
     ({"ftp": True, "ftp_k": 2.0}, "optim.ftp_k must lie in [0, 1] (got 2.0)")],
)  # fmt: skip
def test_bad_ftp_settings_are_one_line(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="invalid model settings") as info:
        FineTuner(backbone="small_cnn", optim=OptimSettings(**settings))  # type: ignore[arg-type]
    assert message in str(info.value)
