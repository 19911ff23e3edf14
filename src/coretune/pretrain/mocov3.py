"""MoCo v3 (Chen, Xie, He, ICCV 2021, "An Empirical Study of Training Self-Supervised Vision Transformers").

A base encoder with a projection MLP and a prediction MLP is trained to match, for two views of each image, the
projections of the *other* view by a momentum encoder (the base encoder and its projector, followed by an
exponential moving average), with the symmetric loss ``ctr(q1, k2) + ctr(q2, k1)``
(:func:`~coretune.pretrain.losses.moco_v3_infonce`: InfoNCE against the keys of the batch, no queue). The details
follow facebookresearch/moco-v3 (``moco/builder.py``, ``main_moco.py``, ``vits.py``):

- the MLPs (``_build_mlp``): linear layers without bias, each hidden one followed by BatchNorm and ReLU, the last
  by a BatchNorm without affine parameters; the projector has 3 layers on a ViT and 2 on a ResNet (hidden width
  ``mlp_dim``, 4096, output ``proj_dim``, 256), the predictor 2 (``proj_dim → mlp_dim → proj_dim``), its last
  BatchNorm on a ViT only;
- the momentum ``m`` rises from ``key_momentum`` (0.99) to 1 along a half cosine over the run's optimiser steps
  (``--moco-m-cos``, used by every published recipe): ``m_t = 1 − ½(1 + cos(π t / T))(1 − m)``;
- on a ViT, the patch projection is a frozen random projection (``--stop-grad-conv1``, the paper's Sec. 5 trick
  for stable training), initialised as the official code does (Xavier-uniform weight, zero bias), and the position
  embedding is the fixed 2-D sine-cosine one of ``vits.py``;
- each view goes through the encoders separately (the MLPs' BatchNorm sees one view at a time), the keys of every
  process are gathered under DDP (their positives offset by the process's rank), and the loss is in float32.

Export (:meth:`MoCoV3.pretrained_checkpoint`): ``{'epoch', 'arch', 'state_dict': {'module.base_encoder.<timm or
torchvision keys>', 'module.base_encoder.head.*' (ViT) or '.fc.*' (ResNet), 'module.momentum_encoder.…',
'module.predictor.*'}, 'optimizer'}``, the layout ``main_moco.py`` saves and the ``moco_v3`` checkpoint layout reads.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..engine.optim import OptimizerName, Schedule
from ..momentum import momentum_update
from .losses import global_moco_v3_infonce
from .module import ContrastivePretrainer

__all__ = ["MoCoV3", "moco_v3_mlp", "momentum_at", "sincos_2d_position_embedding"]

MomentumSchedule = Literal["cosine", "constant"]


def moco_v3_mlp(layers: int, in_dim: int, hidden_dim: int, out_dim: int, last_bn: bool = True) -> nn.Sequential:
    """MoCo v3's MLP: ``layers`` bias-free linear layers, BatchNorm + ReLU after each hidden one and, with
    ``last_bn``, a BatchNorm without affine parameters after the last (the module indices of the official
    ``_build_mlp``, so a state dict's names match: ``0`` linear, ``1`` BN, ``2`` ReLU, ``3`` linear, …)."""
    if layers < 1:
        raise ValueError(f"an MLP needs >= 1 layer, got {layers}")
    modules: list[nn.Module] = []
    for i in range(layers):
        d_in, d_out = in_dim if i == 0 else hidden_dim, out_dim if i == layers - 1 else hidden_dim
        modules.append(nn.Linear(d_in, d_out, bias=False))
        if i < layers - 1:
            modules += [nn.BatchNorm1d(d_out), nn.ReLU(inplace=True)]
        elif last_bn:
            modules.append(nn.BatchNorm1d(d_out, affine=False))
    return nn.Sequential(*modules)


def momentum_at(step: int, total_steps: float, base: float, schedule: MomentumSchedule = "cosine") -> float:
    """The momentum of the key encoder's update before optimiser step ``step`` of ``total_steps``: ``base``
    throughout (``constant``), or rising from ``base`` to 1 along a half cosine (``cosine``, ``main_moco.py``'s
    ``adjust_moco_momentum``; a run without a length keeps ``base``)."""
    if schedule == "constant" or not math.isfinite(total_steps) or total_steps <= 0:
        return base
    progress = min(1.0, step / total_steps)
    return 1.0 - 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - base)


def sincos_2d_position_embedding(grid: tuple[int, int], dim: int, prefix_tokens: int = 1) -> Tensor:
    """The fixed position embedding of MoCo v3's ViTs (``vits.py``): ``(1, prefix_tokens + h·w, dim)``, zeros for the
    class token, and for the patch in row ``r``, column ``c`` (timm's row-major token order)
    ``[sin(r ω), cos(r ω), sin(c ω), cos(c ω)]`` with ``ω_i = 10000^(−i / (dim/4))``, ``i < dim/4``."""
    h, w = grid
    if dim % 4:
        raise ValueError(f"a 2-D sine-cosine position embedding needs a width divisible by 4, got {dim}")
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    rows, cols = torch.meshgrid(
        torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
    )
    out_r, out_c = rows.flatten()[:, None] * omega, cols.flatten()[:, None] * omega
    patches = torch.cat([out_r.sin(), out_r.cos(), out_c.sin(), out_c.cos()], dim=1)
    return torch.cat([torch.zeros(prefix_tokens, dim), patches])[None]


def _is_vit(body: nn.Module) -> bool:
    return isinstance(getattr(getattr(body, "patch_embed", None), "proj", None), nn.Conv2d)


class MoCoV3(ContrastivePretrainer):
    """MoCo v3: the symmetric InfoNCE of a base encoder + projector + predictor against a momentum encoder's keys of
    the other view (Chen, Xie, He 2021, Algorithm 1; details in this module's docstring).

    Defaults are the paper's ViT recipe (facebookresearch/moco-v3 ``CONFIG.md``: AdamW, weight decay 0.1,
    τ = 0.2, m = 0.99 with the cosine schedule to 1, MLPs of width 4096 → 256); its learning rate is
    ``1.5e-4 × batch / 256`` (``main_moco.py`` scales ``--lr`` by the batch): ``--model.lr`` here is the rate itself,
    1.5e-4 for a batch of 256. The published recipes warm up for 40 of 300 epochs (``--model.warmup_epochs``).
    ResNets are pre-trained with LARS there (lr 0.3–0.6 × batch/256, weight decay 1e-6-1.5e-6, τ = 1), which
    coretune does not offer: use ``sgd`` with a warm-up.

    Args:
        mlp_dim: hidden width of the projector and predictor MLPs.
        key_momentum: momentum ``m`` of the update ``θ_k ← m θ_k + (1 − m) θ_q`` (at the first step, with
            ``momentum_schedule cosine``).
        momentum_schedule: ``cosine``: ``m`` rises to 1 along a half cosine over the run's optimiser steps;
            ``constant``: ``m`` throughout.
        freeze_patch_embed: keep a ViT's patch projection at its random initialisation (stop-gradient; None: on for
            ViTs, as the paper; a backbone without ``patch_embed.proj`` refuses True).
        sincos_pos_embed: replace a ViT's learned position embedding by the fixed 2-D sine-cosine one (None: on for
            ViTs with one class token and a width divisible by 4, as ``vits.py``).
    """

    method = "moco_v3"

    def __init__(
        self,
        backbone: str = "resnet18",
        weights: str | None = None,
        proj_dim: int = 256,
        temperature: float = 0.2,
        optimizer: OptimizerName = "adamw",
        lr: float = 1.5e-4,
        momentum: float = 0.9,
        weight_decay: float = 0.1,
        schedule: Schedule = "cosine",
        warmup_epochs: float = 0.0,
        channels_last: bool = False,
        mlp_dim: int = 4096,
        key_momentum: float = 0.99,
        momentum_schedule: MomentumSchedule = "cosine",
        freeze_patch_embed: bool | None = None,
        sincos_pos_embed: bool | None = None,
        weights_allow_cast: bool = False,
        backbone_args: dict[str, Any] | None = None,
    ) -> None:
        problems = []
        if mlp_dim < 1:
            problems.append(f"mlp_dim must be >= 1 (got {mlp_dim})")
        if not 0 <= key_momentum <= 1:
            problems.append(f"key_momentum must lie in [0, 1] (got {key_momentum})")
        if momentum_schedule not in ("cosine", "constant"):
            problems.append(f"momentum_schedule must be cosine or constant (got {momentum_schedule!r})")
        if problems:
            raise ValueError(f"invalid {self.method} settings: " + "; ".join(problems))
        super().__init__(
            backbone=backbone,
            weights=weights,
            proj_dim=proj_dim,
            temperature=temperature,
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            schedule=schedule,
            warmup_epochs=warmup_epochs,
            channels_last=channels_last,
            weights_allow_cast=weights_allow_cast,
            backbone_args=backbone_args,
        )
        body = self.backbone.body
        vit = _is_vit(body)
        self._vit_stability(body, vit, freeze_patch_embed, sincos_pos_embed, fresh=weights is None)
        feature_dim = self.backbone.feature_dim
        self.projector = moco_v3_mlp(3 if vit else 2, feature_dim, mlp_dim, proj_dim)
        self.predictor = moco_v3_mlp(2, proj_dim, mlp_dim, proj_dim, last_bn=vit)
        self.momentum_backbone = copy.deepcopy(self.backbone).requires_grad_(False)
        self.momentum_projector = copy.deepcopy(self.projector).requires_grad_(False)
        self._updated_at: int | None = None  # the optimiser step the momentum encoder last followed at
        self._total_steps = math.inf

    def _vit_stability(self, body: nn.Module, vit: bool, freeze: bool | None, sincos: bool | None, fresh: bool) -> None:
        """The frozen random patch projection and the fixed sine-cosine position embedding (see the class)."""
        name = self.backbone.name
        if freeze and not vit:
            raise ValueError(
                f"--model.freeze_patch_embed true needs a ViT, but backbone {name!r} has no patch_embed.proj: "
                "leave it unset (on for ViTs only)"
            )
        pos = getattr(body, "pos_embed", None)
        fits = (
            vit
            and isinstance(pos, nn.Parameter)
            and getattr(body, "num_prefix_tokens", None) == 1
            and not getattr(body, "no_embed_class", False)
            and pos.shape[-1] % 4 == 0
            and pos.shape[1] == 1 + math.prod(body.patch_embed.grid_size)
        )
        if sincos and not fits:
            raise ValueError(
                f"--model.sincos_pos_embed true needs a ViT with one class token, its position embedding covering "
                f"it and a width divisible by 4, which backbone {name!r} is not: leave it unset"
            )
        if freeze if freeze is not None else vit:
            proj = body.patch_embed.proj
            if fresh:  # vits.py: Xavier-uniform over the patch's 3·p² inputs and the width; zero bias
                bound = math.sqrt(6.0 / (proj.weight[0].numel() + proj.weight.shape[0]))
                nn.init.uniform_(proj.weight, -bound, bound)
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)
            proj.requires_grad_(False)
        if (sincos if sincos is not None else fits) and fits:
            assert isinstance(pos, nn.Parameter)
            with torch.no_grad():
                pos.copy_(sincos_2d_position_embedding(tuple(body.patch_embed.grid_size), pos.shape[-1]))
            pos.requires_grad_(False)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._total_steps = float(self.trainer.estimated_stepping_batches)

    def current_key_momentum(self) -> float:
        """The momentum of this step's update of the momentum encoder (:func:`momentum_at`)."""
        step = self.trainer.global_step if self._trainer is not None else 0
        return momentum_at(step, self._total_steps, self.hparams.key_momentum, self.hparams.momentum_schedule)

    @torch.no_grad()
    def _momentum_update(self, m: float) -> None:
        momentum_update(self.backbone, self.momentum_backbone, m)
        momentum_update(self.projector, self.momentum_projector, m)

    def queries(self, x: Tensor) -> Tensor:
        """The predictor's outputs ``q`` of a batch of views."""
        return self.predictor(self(x))

    @torch.no_grad()
    def keys(self, x: Tensor) -> Tensor:
        """The momentum encoder's projections ``k`` of a batch of views."""
        return self.momentum_projector(self.momentum_backbone(self._views(x)))

    def contrastive_loss(self, view1: Tensor, view2: Tensor) -> Tensor:
        step = self.trainer.global_step if self._trainer is not None else None
        if step is None or step != self._updated_at:  # once per optimiser step (accumulate_grad_batches: not per batch)
            self._momentum_update(self.current_key_momentum())
            self._updated_at = step
        q1, q2 = self.queries(view1), self.queries(view2)
        k1, k2 = self.keys(view1), self.keys(view2)
        tau = self.hparams.temperature  # under DDP every process's keys are negatives
        return global_moco_v3_infonce(q1, k2, tau) + global_moco_v3_infonce(q2, k1, tau)

    def pretrained_checkpoint(self) -> dict[str, Any]:
        head = "head." if _is_vit(self.backbone.body) else "fc."
        state = (
            self._prefixed(self.backbone.body, "module.base_encoder.")
            | self._prefixed(self.projector, "module.base_encoder." + head)
            | self._prefixed(self.momentum_backbone.body, "module.momentum_encoder.")
            | self._prefixed(self.momentum_projector, "module.momentum_encoder." + head)
            | self._prefixed(self.predictor, "module.predictor.")
        )
        optimizer = self.optimizers(use_pl_optimizer=False) if self._trainer is not None else None
        return {
            "epoch": self.current_epoch + 1,
            "arch": self.backbone.name,
            "state_dict": state,
            "optimizer": optimizer.state_dict() if optimizer is not None else {},
        }
