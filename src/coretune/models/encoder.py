"""The :class:`Encoder` every backbone is wrapped in: images ``(B, 3, H, W)`` to pooled features ``(B, d)``.

Its own module so that :mod:`~coretune.models.checkpoints` (which maps checkpoint keys onto an encoder) and
:mod:`~coretune.models.backbones` (which builds encoders and loads checkpoints into them) import it without importing
each other both ways.
"""

from __future__ import annotations

from typing import Any

import torchvision
from torch import Tensor, nn

__all__ = ["TIMM_PREFIX", "Encoder"]

TIMM_PREFIX = "timm/"
"""Deprecated: names of the form ``timm/<model>`` build a timm model; write the timm name as it is
(``deit_small_patch16_224``, ``resnet50.a1_in1k``: :mod:`~coretune.models.hubnames`)."""


class Encoder(nn.Module):
    """A backbone producing pooled features: ``forward(x (B, 3, H, W)) -> (B, feature_dim)``.

    Attributes:
        body: the wrapped torchvision / timm / coretune network with its classifier removed; its
            ``state_dict`` keys are the library's own keys, so checkpoints load into it.
        feature_dim: width ``d`` of the pooled features.
        name: the name the encoder was created with, as written now (``resnet18``, ``vit_tiny_patch16_224``,
            ``resnet50.a1_in1k``, ``hf-hub:ORG/REPO`` …).
        classifier_names: names of the classifier module(s) that were removed from ``body`` (``("fc",)`` for
            ResNets); checkpoint tensors under these names are dropped when loading.
        stage_names: qualified names (in ``body``) of the intermediate stages returned by :meth:`stages`.
        is_timm: whether ``body`` is a timm model (checkpoint layouts differ between libraries).
        timm_model: ``(name, kwargs)`` such that ``timm.create_model(name, num_classes=K, **kwargs)`` is ``body``
            with a classifier, the same tensors under the same names (``coretune export --format timm``); None for
            a body timm has no model of.
    """

    def __init__(
        self,
        body: nn.Module,
        feature_dim: int,
        name: str,
        classifier_names: tuple[str, ...] = (),
        stage_names: tuple[str, ...] = (),
        *,
        is_timm: bool = False,
        timm_model: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.body = body
        self.feature_dim = feature_dim
        self.name = name
        self.classifier_names = classifier_names
        self.stage_names = stage_names
        self.is_timm = is_timm
        self.timm_model = timm_model
        self.pretrained_normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # see load_pretrained

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def stages(self) -> list[nn.Module]:
        """The intermediate stage modules (ResNet ``layer1``..``layer4``; timm ``feature_info`` modules).

        Feature-map regularisers such as DELTA (Li et al., ICLR 2019) register forward hooks on them.
        """
        return [self.body.get_submodule(n) for n in self.stage_names]

    def layer_matcher(self) -> dict[str, Any] | None:
        """The regular expressions that assign the body's parameters to its layers, as timm's
        ``group_matcher(coarse=False)`` writes them (the stem, each block, the final norm): the body's own for a
        timm model, timm's ResNet's for a torchvision ResNet (the same parameter names); None for a body timm has
        no grouping of (``small_cnn``). Layer-wise learning-rate decay needs it."""
        if callable(matcher := getattr(self.body, "group_matcher", None)):
            return dict(matcher(coarse=False))
        if isinstance(self.body, torchvision.models.ResNet):
            from timm.models.resnet import ResNet

            return dict(ResNet.group_matcher(self.body, coarse=False))  # type: ignore[arg-type]  (reads no attribute)
        return None

    def no_weight_decay(self) -> set[str]:
        """Names of the body's parameters timm trains without weight decay (a ViT's ``pos_embed``, ``cls_token``):
        the body's ``no_weight_decay()``, empty for a body without one."""
        names = getattr(self.body, "no_weight_decay", None)
        return set(names()) if callable(names) else set()

    def extra_repr(self) -> str:
        return f"name={self.name!r}, feature_dim={self.feature_dim}"
