"""LoRA (Hu et al., ICLR 2022) on a backbone through Hugging Face ``peft``: the pre-trained weights stay frozen and
each targeted layer ``W`` computes ``W x + (alpha / rank) · B A x`` with trainable low-rank ``A`` (rank × in) and
``B`` (out × rank, zero at the start, so the model starts as the pre-trained one).

:func:`apply_lora` injects peft's LoRA layers into an :class:`~coretune.models.Encoder`'s ``body`` in place
(``peft.inject_adapter_in_model``, not ``get_peft_model``: the latter wraps the model in a ``PeftModel`` whose
``base_model.model.`` prefix would rename every tensor, while the injection keeps the ``Encoder`` and timm's module
names; only a targeted layer gains a level, ``blocks.0.attn.qkv.weight`` → ``blocks.0.attn.qkv.base_layer.weight``
beside its ``lora_A.default.weight`` and ``lora_B.default.weight``). Everything of the body but the LoRA weights is
frozen (``requires_grad`` False: LayerNorm and BatchNorm affine parameters, biases, embeddings too; BatchNorm's
running statistics still update in training mode, as with ``--model.freeze_backbone``).

:func:`merge_lora` folds the low-rank updates into the weights (peft's own ``merge`` of each LoRA layer, then its
base layer back in its place, as ``merge_and_unload`` does for a ``PeftModel``): the body is again the plain timm
or torchvision network, with its original tensor names (``coretune export`` writes it so).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..extras import need

__all__ = ["LORA_OPTION", "LoRASettings", "apply_lora", "lora_layer_names", "merge_lora", "merged_lora_state"]

LORA_OPTION = "--model.optim.lora"
"""The ``coretune fit`` options of :class:`LoRASettings` (``--model.optim.lora.rank 8``)."""

#: The layer types LoRA adapts here (peft's ``lora.Linear`` and ``lora.Conv2d``).
ADAPTED_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class LoRASettings:
    """LoRA on the backbone (``coretune fit --model.optim.lora.<x>``; ``FineTuner(optim=OptimSettings(
    lora=LoRASettings(rank=8)))``). Off by default (``rank`` 0): the whole backbone trains, as without it.

    With a rank, only the LoRA weights of the backbone, the task's head and the objective's heads train (any
    objective); ``coretune export`` merges the LoRA weights into the backbone's.

    Args:
        rank: ``r``, the rank of each update ``B A`` (0: no LoRA). The LoRA paper's and peft's values are 4 to 16.
        alpha: the update's scale is ``alpha / rank`` (peft's ``lora_alpha``; 16, as peft's image-classification
            LoRA guide for ViTs).
        dropout: dropout on the input of the LoRA branch (peft's ``lora_dropout``; 0.1, as that guide).
        targets: the layers to adapt, comma-separated, as peft matches ``target_modules``: a layer whose name is
            one of them or ends with ``.`` and one of them. ``qkv`` (default): the fused query-key-value projection
            of every timm ViT block — peft's image-classification LoRA guide adapts a ViT's ``query`` and ``value``
            (the LoRA paper's §7.1 choice), which timm fuses with the key into ``qkv``. ``qkv,attn.proj`` adds the
            attention's output projection (``proj`` alone would also adapt ``patch_embed.proj``). ResNets'
            convolutions work too (peft's ``lora.Conv2d``): ``conv1,conv2,conv3``.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.1
    targets: str = "qkv"

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``rank`` above 0)."""
        return self.rank > 0

    @property
    def target_names(self) -> list[str]:
        """``targets`` as a list of names."""
        return [name.strip() for name in self.targets.split(",") if name.strip()]

    def problems(self) -> list[str]:
        """What is wrong with these settings (one sentence each, named ``lora.<setting>``; empty when valid)."""
        checks = (
            (isinstance(self.rank, int) and self.rank >= 0, f"lora.rank must be a whole number >= 0 (got {self.rank})"),
            (self.alpha > 0, f"lora.alpha must be > 0 (got {self.alpha})"),
            (0 <= self.dropout < 1, f"lora.dropout must lie in [0, 1) (got {self.dropout})"),
            (
                not self.enabled or bool(self.target_names),
                f"lora.targets must name at least one layer (got {self.targets!r}), e.g. qkv",
            ),
        )
        return [message for ok, message in checks if not ok]


def _short_name(name: str) -> str:
    """How a layer is named in ``targets``: its last name, with its parent's for a numbered one
    (``downsample.0``)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _matches(name: str, targets: list[str]) -> bool:
    """peft's rule for a list of ``target_modules``: the name itself, or a name ending with ``.`` + target."""
    return any(name == target or name.endswith(f".{target}") for target in targets)


def _targeted(body: nn.Module, settings: LoRASettings, backbone: str) -> list[str]:
    """The names of ``body``'s layers that ``settings.targets`` names, checked: at least one, each of a type LoRA
    adapts here.

    Raises:
        ValueError: one line naming the targets, the backbone and the layers it has.
    """
    targets = settings.target_names
    adaptable = [name for name, m in body.named_modules() if isinstance(m, ADAPTED_TYPES)]
    layers = ", ".join(dict.fromkeys(map(_short_name, adaptable)))
    matched = [name for name, _ in body.named_modules() if name and _matches(name, targets)]
    if not matched:
        raise ValueError(
            f"{LORA_OPTION}.targets {settings.targets!r} names no layer of backbone {backbone}: LoRA adapts its "
            f"linear and convolution layers, named {layers or '(none)'}"
        )
    if wrong := [name for name in matched if not isinstance(body.get_submodule(name), ADAPTED_TYPES)]:
        kind = type(body.get_submodule(wrong[0])).__name__
        raise ValueError(
            f"{LORA_OPTION}.targets {settings.targets!r} names {wrong[0]} of backbone {backbone}, a {kind}: LoRA "
            f"adapts linear and convolution layers only, named {layers or '(none)'}"
        )
    grouped = [name for name in matched if getattr(body.get_submodule(name), "groups", 1) > 1]
    if grouped:
        raise ValueError(
            f"{LORA_OPTION}.targets {settings.targets!r} names {grouped[0]} of backbone {backbone}, a grouped "
            "convolution: peft cannot merge its LoRA weights into it (coretune export merges them); choose other "
            f"layers among {layers}"
        )
    return matched


def apply_lora(encoder: nn.Module, settings: LoRASettings) -> None:
    """Inject peft's LoRA layers into ``encoder.body`` (an :class:`~coretune.models.Encoder`'s) at the layers
    ``settings.targets`` names, in place, and freeze every other tensor of the body.

    Raises:
        ValueError: the targets name no layer of the backbone, or one LoRA does not adapt (one line).
        MissingExtra: peft is not installed (``pip install 'coretune[peft]'``).
    """
    body = encoder.body
    backbone = getattr(encoder, "name", type(body).__name__)
    peft = need("peft", f"LoRA ({LORA_OPTION}.rank)")
    _targeted(body, settings, backbone)  # the user's mistakes, before peft's own errors
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_names,
        bias="none",
    )
    try:
        peft.inject_adapter_in_model(config, body)
    except (ValueError, TypeError) as err:  # a layer peft cannot adapt (a grouped convolution, …)
        raise ValueError(
            f"{LORA_OPTION}.targets {settings.targets!r} on backbone {backbone}: peft cannot adapt them "
            f"({' '.join(str(err).split())[:200]}); choose other layers"
        ) from None
    for name, parameter in body.named_parameters():  # peft freezes the rest already; said here, whatever its version
        parameter.requires_grad_("lora_" in name)


def lora_layer_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s LoRA layers (peft's tuner layers), empty without LoRA."""
    if "peft" not in sys.modules:  # no LoRA without peft imported
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, m in module.named_modules() if isinstance(m, BaseTunerLayer)]


#: What a LoRA layer's tensors are named in a state dict (peft's adapter ``default``).
_BASE, _A, _B = ".base_layer.", ".lora_A.default.", ".lora_B.default."


def merged_lora_state(state: dict[str, Tensor], alpha: float) -> tuple[dict[str, Tensor], int]:
    """A state dict with LoRA layers (``…qkv.base_layer.weight`` beside ``…qkv.lora_A.default.weight`` and
    ``…qkv.lora_B.default.weight``, as a LoRA fine-tuning's checkpoint holds them) turned into the plain network's:
    each ``W`` merged, ``W + (alpha / r) · B A`` (``r`` the rank, ``A``'s first dimension; peft's ``merge``: a
    linear layer's ``B @ A``, a convolution's ``A`` convolved with ``B``), its base layer's other tensors (``bias``)
    renamed back; what peft and torch need not be installed for. Returns the state and the number of layers merged.

    Raises:
        ValueError: a layer with a LoRA tensor but not the other, or without its base weight.
    """
    merged: dict[str, Tensor] = {}
    layers = {key.split(_A)[0] for key in state if _A in key} | {key.split(_B)[0] for key in state if _B in key}
    for layer in sorted(layers):
        names = (f"{layer}{_A}weight", f"{layer}{_B}weight", f"{layer}{_BASE}weight")
        if missing := [name for name in names if name not in state]:
            raise ValueError(f"LoRA layer {layer} lacks {missing[0]}: the checkpoint's LoRA tensors are incomplete")
        a, b, base = (state[name] for name in names)
        scale = alpha / a.shape[0]
        if base.ndim == 2:  # nn.Linear: (out, in) += B (out, r) @ A (r, in)
            delta = b.float() @ a.float()
        else:  # nn.Conv2d: A is (r, in, kh, kw), B is (out, r, 1, 1): peft's conv merge
            delta = torch.nn.functional.conv2d(a.float().permute(1, 0, 2, 3), b.float()).permute(1, 0, 2, 3)
        merged[f"{layer}.weight"] = (base.float() + scale * delta).to(base.dtype)
    for key, value in state.items():
        if any(part in key for part in (_A, _B)) or (_BASE in key and key.endswith(f"{_BASE}weight")):
            continue
        merged[key.replace(_BASE, ".") if _BASE in key else key] = value
    return merged, len(layers)


def merge_lora(module: nn.Module) -> int:
    """Merge every LoRA layer of ``module`` into its base layer and put the base layer back in its place (peft's
    ``merge`` of the layer, ``merge_and_unload``'s work): ``module`` computes the same outputs with the plain
    network's layers and tensor names. Returns the number of layers merged (0: no LoRA)."""
    names = lora_layer_names(module)
    for name in names:
        layer = module.get_submodule(name)
        layer.merge(safe_merge=True)  # refuses non-finite merged weights
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, layer.get_base_layer())
    for m in module.modules():  # the LoRA config peft left on the model it injected into
        if hasattr(m, "peft_config"):
            del m.peft_config
    return len(names)
