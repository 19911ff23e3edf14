"""Mapping the keys of a pre-trained checkpoint onto an :class:`~.encoder.Encoder`, and loading it.

All checkpoint key handling lives here (like timm's ``_builder``/``_helpers``): self-supervised trainers
save the encoder under their own nested entry and prefix, next to heads, momentum copies and queues. A
*layout* (:class:`Layout`, one file each in :mod:`coretune.models.layouts`, registered with :func:`register_layout`)
knows one such convention and extracts the backbone state dict from the loaded object; :func:`load_pretrained`
detects the layout (or takes the one forced by ``weights_format``), checks names and shapes against the encoder, and
reports exactly what was loaded, missing, unexpected and dropped. The file is read by
:mod:`~coretune.models.checkpoint_files` (safely: no code stored in a checkpoint ever runs), which also resolves
weights given by name (a timm name, ``hf-hub:…``, ``hub``: :mod:`~coretune.models.hubnames`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from .checkpoint_files import (
    HUB_PREFIXES,
    CheckpointError,
    UnreadableCheckpointError,
    check_weights,
    is_weights_name,
    load_checkpoint_file,
    require_checkpoint_file,
    resolve_weights,
    weights_digest,
)
from .encoder import Encoder
from .hubnames import HF_HUB_PREFIX, current_weights_name, named_weights

__all__ = [
    "HUB_PREFIXES",
    "CheckpointError",
    "Extraction",
    "Layout",
    "LoadReport",
    "Normalization",
    "UnreadableCheckpointError",
    "check_patch_size",
    "check_weights",
    "extract_backbone_state",
    "extract_prefixed",
    "list_layouts",
    "load_checkpoint_file",
    "load_pretrained",
    "normalization_of",
    "register_layout",
    "require_checkpoint_file",
    "resized_note",
    "resolve_weights",
    "weights_digest",
]


# ------------------------------------------------------------------------------------------------------------
# layouts and their registry (the layouts themselves: coretune.models.layouts)
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Extraction:
    """The backbone tensors a layout found in a checkpoint.

    Attributes:
        state: backbone state dict with keys as in ``Encoder.body`` (prefix stripped, heads removed).
        dropped: original keys of tensors the layout set aside (heads, projectors, momentum copies, queues).
        entry: where the backbone was found, e.g. ``state_dict['module.encoder_q.*']`` or ``checkpoint``.
        prefix: the stripped prefix (used to group dropped keys in messages).
        fresh: backbone keys the convention leaves at their initial values on purpose (MAE's ``fc_norm`` for a
            global-pool ViT): reported as missing, never an error.
        resampled: position embeddings the layout resized (through timm's ``checkpoint_filter_fn``), as
            :attr:`LoadReport.resampled` words them.
        notes: lines for the load report saying what else the layout changed (a norm dropped for a fresh one).
    """

    state: dict[str, Tensor]
    dropped: list[str]
    entry: str
    prefix: str = ""
    fresh: tuple[str, ...] = ()
    resampled: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Layout:
    """A checkpoint convention: ``extract(raw, encoder)`` gives the backbone tensors, or None if n/a."""

    name: str
    extract: Callable[[Mapping[str, Any], Encoder], Extraction | None]
    doc: str


_LAYOUTS: dict[str, Layout] = {}


def register_layout(name: str, doc: str) -> Callable[[Callable[..., Extraction | None]], Layout]:
    """Register ``extract(raw, encoder) -> Extraction | None`` as layout ``name``; order = detection order."""

    def decorator(extract: Callable[..., Extraction | None]) -> Layout:
        if name in _LAYOUTS:
            raise ValueError(f"checkpoint layout {name!r} is already registered")
        _LAYOUTS[name] = layout = Layout(name, extract, doc)
        return layout

    return decorator


def list_layouts() -> list[str]:
    """Layout names in auto-detection order (``weights_format`` accepts these and ``"auto"``)."""
    return list(_LAYOUTS)


def _tensors(obj: Any) -> dict[str, Tensor] | None:
    """``obj`` as a flat ``{name: tensor}`` dict (non-tensor entries such as ``epoch`` ignored), or None."""
    if not isinstance(obj, Mapping):
        return None
    found = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, Tensor)}
    return found or None


def extract_prefixed(
    raw: Mapping[str, Any],
    entries: tuple[str | None, ...],
    prefixes: tuple[str, ...],
    heads: tuple[str, ...],
    backbone: Collection[str] = (),
) -> Extraction | None:
    """The common extraction: the first present entry (``None`` = ``raw`` itself), the first prefix any key
    has (``""`` only as a listed fallback); backbone = prefixed keys not under a head, the rest is dropped. A key
    the ``backbone`` has is never a head's: a timm ConvNeXt's ``head.norm`` belongs to the backbone (only
    ``head.fc`` is its classifier)."""
    for entry in entries:
        sd = _tensors(raw if entry is None else raw.get(entry))
        if sd is None:
            continue
        prefix = next((p for p in prefixes if p and any(k.startswith(p) for k in sd)), None)
        if prefix is None:
            if "" not in prefixes:
                continue
            prefix = ""
        state, dropped = {}, []
        for key, value in sd.items():
            rest = key[len(prefix) :]
            headed = rest not in backbone and any(rest == h or rest.startswith(h + ".") for h in heads)
            if key.startswith(prefix) and not headed:
                state[rest] = value
            else:
                dropped.append(key)
        where = "checkpoint" if entry is None else entry
        return Extraction(state, dropped, f"{where}['{prefix}*']" if prefix else where, prefix)
    return None


# ------------------------------------------------------------------------------------------------------------
# matching and loading
# ------------------------------------------------------------------------------------------------------------
Normalization = tuple[tuple[float, ...], tuple[float, ...]]
"""An input normalisation, ``(mean, std)`` per RGB channel of [0, 1] pixels."""


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did; every backbone tensor is in exactly one of ``loaded`` / ``missing``.

    Attributes:
        layout: name of the layout used.
        entry: where in the checkpoint the backbone was found.
        loaded: backbone keys copied from the checkpoint (parameters and BN buffers).
        missing: backbone keys the checkpoint lacks (left at their initial values).
        unexpected: extracted checkpoint keys that the backbone does not have (not loaded).
        dropped: checkpoint keys the layout set aside (heads, projectors, momentum encoders, queues).
        total: number of tensors in the backbone's state dict.
        prefix: the prefix the layout stripped (groups ``dropped`` in :meth:`summary`).
        resampled: position embeddings interpolated to the model's patch grid (``pos_embed resized 14×14 → 4×4 for
            img_size 64``), e.g. a ViT pre-trained at 224 px loaded into one built for 64 px.
        cast: loaded keys stored in a non-floating dtype (integer, quantised) where the backbone has floats,
            converted because ``allow_cast`` was given.
        normalization: the input ``(mean, std)`` the weights were trained with, when known (:func:`normalization_of`).
        notes: what the layout changed beyond renaming (:attr:`Extraction.notes`).
    """

    layout: str
    entry: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    total: int = 0
    prefix: str = ""
    resampled: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    normalization: Normalization | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line, e.g. ``layout 'moco' (state_dict['module.encoder_q.*']) — 120/120 tensors loaded, …``."""
        text = (
            f"layout '{self.layout}' ({self.entry}) — {len(self.loaded)}/{self.total} tensors loaded, "
            f"{len(self.missing)} missing, {len(self.unexpected)} unexpected"
        )
        if self.dropped:
            groups = _groups(self.dropped, self.prefix)
            shown = ", ".join(groups[:4]) + (", …" if len(groups) > 4 else "")
            text += f"; dropped {len(self.dropped)} non-backbone tensors ({shown})"
        if self.resampled:
            text += "; " + ", ".join(self.resampled)
        if self.cast:
            text += f"; cast {len(self.cast)} non-floating tensors to floating point (allow_cast)"
        for note in self.notes:
            text += f"; {note}"
        return text


def _groups(keys: list[str], prefix: str) -> list[str]:
    """Readable groups of dropped keys: ``prefix + next part`` under the backbone prefix, else top module."""
    groups: dict[str, None] = {}
    for key in keys:
        if prefix and key.startswith(prefix):
            head, rest = prefix, key[len(prefix) :]
        else:
            head, rest = ("module.", key[7:]) if key.startswith("module.") else ("", key)
        part = rest.split(".", 1)[0]
        groups[head + part + (".*" if "." in rest else "")] = None
    return list(groups)


def _match_count(extraction: Extraction | None, model_keys: set[str]) -> tuple[int, int]:
    if extraction is None:
        return 0, 0
    matched = sum(k in model_keys for k in extraction.state)
    return matched, len(extraction.state) - matched


def extract_backbone_state(
    raw: Any, encoder: Encoder, weights_format: str = "auto", path: str | Path = "checkpoint"
) -> tuple[Layout, Extraction]:
    """Pick the layout: the forced one, else most backbone keys matched, fewest unexpected, first in order
    among layouts that extract the same tensors.

    Raises:
        CheckpointError: unknown ``weights_format``, ``raw`` is not a dict, no layout matches any key, or the file
            is ambiguous: two layouts match equally well but would load different tensors (``format`` picks one).
    """
    if weights_format != "auto" and weights_format not in _LAYOUTS:
        raise CheckpointError(
            f"unknown weights_format {weights_format!r}: choose 'auto' or one of {', '.join(_LAYOUTS)}"
        )
    if not isinstance(raw, Mapping):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(raw).__name__}, not a dict of tensors: save "
            "model.state_dict() (a dict), not the model or a single tensor"
        )
    model_keys = set(encoder.body.state_dict())
    candidates = [_LAYOUTS[weights_format]] if weights_format != "auto" else list(_LAYOUTS.values())
    tried: list[str] = []
    best: tuple[tuple[int, int], Layout, Extraction] | None = None
    ties: list[tuple[Layout, Extraction]] = []
    for layout in candidates:
        extraction = layout.extract(raw, encoder)
        matched, unexpected = _match_count(extraction, model_keys)
        if extraction is None:
            tried.append(f"{layout.name} (not applicable: its entries/prefixes are absent)")
        else:
            tried.append(f"{layout.name} ({matched}/{len(model_keys)} keys matched via {extraction.entry})")
        if matched and (best is None or (matched, -unexpected) > best[0]):
            best, ties = ((matched, -unexpected), layout, extraction), []
        elif best is not None and extraction is not None and (matched, -unexpected) == best[0]:
            ties.append((layout, extraction))
    if best is None:
        raise CheckpointError(
            f"no tensor of checkpoint {path} matches backbone {encoder.name!r}. Layouts tried: "
            f"{'; '.join(tried)}. Checkpoint starts with {_describe_keys(raw)}. If the layout is known, "
            f"force it with --model.weights_options.format (one of {', '.join(_LAYOUTS)}); otherwise re-save the "
            "backbone's state_dict with torchvision/timm key names"
        )
    rivals = [(layout, e) for layout, e in ties if not _same_tensors(best[2], e, model_keys)]
    if rivals:
        names = [best[1].name, *(layout.name for layout, _ in rivals)]
        found = ", ".join(f"'{layout.name}' ({e.entry})" for layout, e in [(best[1], best[2]), *rivals])
        raise CheckpointError(
            f"checkpoint {path} is ambiguous: layouts {found} each match {best[0][0]}/{len(model_keys)} tensors of "
            f"backbone {encoder.name!r} but hold different weights; force one with --model.weights_options.format "
            f"({' or '.join(names)})"
        )
    return best[1], best[2]


def _same_tensors(a: Extraction, b: Extraction, model_keys: set[str]) -> bool:
    """Whether two extractions would load the same backbone tensors (the same objects, or equal values)."""
    keys = model_keys & a.state.keys()
    if keys != model_keys & b.state.keys():
        return False
    return all(
        a.state[k] is b.state[k] or (a.state[k].shape == b.state[k].shape and bool((a.state[k] == b.state[k]).all()))
        for k in keys
    )


def _describe_keys(raw: Mapping[str, Any], limit: int = 6) -> str:
    parts = []
    for key, value in list(raw.items())[:limit]:
        if isinstance(value, Mapping):
            inner = [str(k) for k in list(value)[:3]]
            parts.append(f"{key!s}: {{{', '.join(inner)}{', …' if len(value) > 3 else ''}}}")
        else:
            parts.append(str(key))
    return "[" + "; ".join(parts) + (", …" if len(raw) > limit else "") + "]"


def _is_required(key: str) -> bool:
    """Missing tensors that matter: all but ``num_batches_tracked`` (absent from old checkpoints)."""
    return not key.endswith("num_batches_tracked")


def _pos_embed_prefix(body: nn.Module) -> int:
    """Tokens of a timm ViT's ``pos_embed`` that are no patch's (class/register tokens; none if ``no_embed_class``)."""
    return 0 if getattr(body, "no_embed_class", False) else int(getattr(body, "num_prefix_tokens", 1))


def resized_note(side: int, body: nn.Module) -> str:
    """The report line of a ``pos_embed`` of a ``side``×``side`` patch grid resized to the body's:
    ``pos_embed resized 14×14 → 2×2 for img_size 32``."""
    grid, size = body.patch_embed.grid_size, body.patch_embed.img_size
    img = size[0] if size[0] == size[1] else f"{size[0]}×{size[1]}"
    return f"pos_embed resized {side}×{side} → {grid[0]}×{grid[1]} for img_size {img}"


def check_patch_size(state: Mapping[str, Tensor], body: nn.Module, what: str, name: str) -> None:
    """Refuse a ViT checkpoint whose patch embedding has another patch size than the body's (``what``: the
    checkpoint's description, ``name``: the backbone's). timm's ``resample_patch_embed`` (FlexiViT) could resize the
    kernel, but that changes what the weights compute: the matching backbone is the fix."""
    key = "patch_embed.proj.weight"
    weight = getattr(getattr(getattr(body, "patch_embed", None), "proj", None), "weight", None)
    if key not in state or weight is None or state[key].dim() != 4 or weight.dim() != 4:
        return
    old, new = tuple(state[key].shape[-2:]), tuple(weight.shape[-2:])
    if old != new:
        raise CheckpointError(
            f"{what} has {old[0]}×{old[1]} patches but backbone {name!r} {new[0]}×{new[1]}: pick the backbone of "
            f"the checkpoint's patch size (--model.backbone_args '{{patch_size: {old[0]}}}', or its timm name with "
            f"patch{old[0]}); patch embeddings are not resampled"
        )


def _resample_position_embeddings(
    body: nn.Module, state: dict[str, Tensor], model_state: dict[str, Tensor]
) -> list[str]:
    """Interpolate (bicubic, in place in ``state``) a ViT's absolute position embedding ``pos_embed`` whose patch
    grid differs from the model's with timm's ``resample_abs_pos_embed``, as timm does for its own checkpoints; the
    class/register tokens' embeddings are kept. Returns ``["pos_embed resized 14×14 → 4×4 for img_size 64"]`` or
    ``[]``."""
    key = "pos_embed"
    grid = getattr(getattr(body, "patch_embed", None), "grid_size", None)
    if key not in state or key not in model_state or grid is None:
        return []
    old, new = state[key], model_state[key]
    if old.shape == new.shape or old.dim() != 3 or old.shape[-1] != new.shape[-1]:
        return []  # same grid, or not a (1, tokens, dim) embedding of the same width: the shape check reports it
    from timm.layers import resample_abs_pos_embed

    prefix = _pos_embed_prefix(body)
    side = math.isqrt(old.shape[1] - prefix)
    if side * side != old.shape[1] - prefix:
        return []
    state[key] = resample_abs_pos_embed(old, new_size=list(grid), old_size=[side, side], num_prefix_tokens=prefix)
    return [resized_note(side, body)]


def normalization_of(raw: Any, weights: str | Path) -> Normalization | None:
    """The input normalisation checkpoint ``raw`` was trained with, when it says: its ``normalization`` entry
    (``{"mean": […], "std": […]}``, written by ``coretune pretrain``), the data module's ``mean`` and ``std`` a
    Lightning checkpoint of coretune saves (``datamodule_hyper_parameters``: a fine-tuned or pre-training run's
    ``.ckpt``), or a timm name's pretrained config (``vit_base_patch16_224.augreg_in21k`` was trained on inputs
    scaled to [-1, 1], mean = std = 0.5; the old spelling ``timm:<name>`` too)."""
    for key in ("normalization", "datamodule_hyper_parameters"):
        entry = raw.get(key) if isinstance(raw, Mapping) else None
        if isinstance(entry, Mapping) and entry.get("mean") is not None and entry.get("std") is not None:
            return tuple(map(float, entry["mean"])), tuple(map(float, entry["std"]))
    name = str(current_weights_name(weights, warn=False))
    if is_weights_name(name) and not name.startswith(HF_HUB_PREFIX):
        from timm.models import get_pretrained_cfg

        cfg = get_pretrained_cfg(name)
        if cfg is not None and cfg.mean and cfg.std:
            return tuple(map(float, cfg.mean)), tuple(map(float, cfg.std))
    return None


def load_pretrained(
    encoder: Encoder,
    path: str | Path,
    weights_format: str = "auto",
    *,
    allow_missing: bool = False,
    allow_unexpected: bool = False,
    allow_cast: bool = False,
    download: bool | None = None,
) -> LoadReport:
    """Load the backbone tensors of checkpoint ``path`` into ``encoder.body`` and report what happened.

    ``path`` may be a hub name (``resnet18.a1_in1k``, ``hf-hub:ORG/REPO``, ``hub``: the name of ``encoder``):
    :func:`resolve_weights` finds its file in the local Hugging Face cache, or downloads it as ``download`` says (None:
    unless ``HF_HUB_OFFLINE=1``).

    Names, shapes and dtypes are checked first; only then is ``load_state_dict(strict=False)`` called with the
    matched tensors (BN running statistics included). Floating-point tensors of another precision (fp16, bf16)
    are converted; integer or quantised tensors where the backbone has floats are refused unless ``allow_cast``.

    Raises:
        CheckpointError: a hub name missing from the cache, unreadable file, no layout matches, a shape differs
            (wrong architecture), the checkpoint lacks backbone tensors (unless ``allow_missing``), has extra ones
            (unless ``allow_unexpected``) or stores floating-point weights as integers (unless ``allow_cast``).
    """
    path_or_name = named_weights(path, encoder.name)
    path = resolve_weights(path, download, encoder.name)
    raw = load_checkpoint_file(path)
    layout, extraction = extract_backbone_state(raw, encoder, weights_format, path)
    model_state = encoder.body.state_dict()
    check_patch_size(extraction.state, encoder.body, f"checkpoint {path} (layout '{layout.name}')", encoder.name)
    resampled = extraction.resampled + _resample_position_embeddings(encoder.body, extraction.state, model_state)
    loaded = [k for k in model_state if k in extraction.state]
    missing = [k for k in model_state if k not in extraction.state]
    unexpected = [k for k in extraction.state if k not in model_state]
    mismatched = [k for k in loaded if extraction.state[k].shape != model_state[k].shape]
    if mismatched:
        key = mismatched[0]
        more = f" (and {len(mismatched) - 1} more mismatched tensors)" if len(mismatched) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} (layout '{layout.name}') does not fit backbone {encoder.name!r}: checkpoint "
            f"{key} {tuple(extraction.state[key].shape)} vs model {tuple(model_state[key].shape)}{more}: "
            "wrong architecture? pass the matching --model.backbone"
        )
    cast = [k for k in loaded if model_state[k].is_floating_point() and not extraction.state[k].is_floating_point()]
    if cast and not allow_cast:
        dtypes = sorted({str(extraction.state[k].dtype).removeprefix("torch.") for k in cast})
        raise CheckpointError(
            f"checkpoint {path} stores {len(cast)} floating-point tensors of backbone {encoder.name!r} as "
            f"{', '.join(dtypes)} (e.g. {', '.join(cast[:3])}): integer or quantised weights are not the float "
            "weights the model needs. Dequantise the checkpoint or export its float weights; if the integers are "
            "the real values, force the conversion with --model.weights_options.allow_cast true (allow_cast=True "
            "in Python)"
        )
    for key in cast:  # allowed: quantised tensors by their real values, integers as they are
        if extraction.state[key].is_quantized:
            extraction.state[key] = extraction.state[key].dequantize()
    report = LoadReport(
        layout.name,
        extraction.entry,
        loaded,
        missing,
        unexpected,
        extraction.dropped,
        len(model_state),
        extraction.prefix,
        resampled,
        cast,
        normalization_of(raw, path_or_name),
        list(extraction.notes),
    )
    required = [k for k in missing if _is_required(k) and k not in extraction.fresh]
    if required and not allow_missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(required)} tensors of backbone {encoder.name!r} "
            f"(e.g. {', '.join(required[:5])}); {report.summary()}. Pass the matching --model.backbone, or "
            "allow_missing=True to keep those tensors randomly initialised"
        )
    if unexpected and not allow_unexpected:
        raise CheckpointError(
            f"checkpoint {path} has {len(unexpected)} tensors that backbone {encoder.name!r} lacks "
            f"(e.g. {', '.join(unexpected[:5])}); {report.summary()}. Pass the matching --model.backbone, or "
            "allow_unexpected=True to ignore them"
        )
    encoder.body.load_state_dict({k: extraction.state[k] for k in loaded}, strict=False)
    return report
