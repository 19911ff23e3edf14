"""Reading pre-trained checkpoints safely and mapping their keys onto an :class:`~.encoder.Encoder`.

All checkpoint key handling lives here (like timm's ``_builder``/``_helpers``): self-supervised trainers
save the encoder under their own nested entry and prefix, next to heads, momentum copies and queues. A
*layout* knows one such convention and extracts the backbone state dict from the loaded object;
:func:`load_pretrained` detects the layout (or takes the one forced by ``weights_format``), checks names and
shapes against the encoder, and reports exactly what was loaded, missing, unexpected and dropped. Files are
read with ``torch.load(weights_only=True)`` or safetensors, so no code stored in a checkpoint ever runs.

Weights may also be named: ``timm:<model>[.<tag>]`` (the Hugging Face hub file timm's ``pretrained_cfg`` names) or
``hf-hub:<org>/<repo>[@<revision>]``. :func:`resolve_weights` finds the file in the local Hugging Face cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) without any network call; it downloads
only when asked to (``download=True``, ``--model.weights_download true``). The file is then read like any other.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import pickle
import re
import zipfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from .encoder import Encoder

__all__ = [
    "HUB_PREFIXES",
    "CheckpointError",
    "Extraction",
    "Layout",
    "LoadReport",
    "Normalization",
    "UnreadableCheckpointError",
    "extract_backbone_state",
    "list_layouts",
    "load_checkpoint_file",
    "load_pretrained",
    "normalization_of",
    "register_layout",
    "require_checkpoint_file",
    "resolve_weights",
    "weights_digest",
]

_SAFE_GLOBALS = [argparse.Namespace]
"""Allow-listed for ``weights_only`` loading: DINO, timm and many trainers store their ``args`` Namespace,
which only holds attributes and cannot run code."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the encoder; the message names cause and fix."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file that is truncated or corrupt, or not a PyTorch checkpoint (``reason``: what torch said)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(
            f"cannot read checkpoint {path} ({reason}): the file is truncated or corrupt, or not a PyTorch "
            "checkpoint; copy or download it again"
        )


# ------------------------------------------------------------------------------------------------------------
# reading files
# ------------------------------------------------------------------------------------------------------------
def require_checkpoint_file(path: str | Path) -> Path:
    """``path`` as a Path if it is an existing file, else :class:`CheckpointError` naming the fix; reads nothing."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist: check the path given as --model.weights")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory: pass the checkpoint file inside it")
    return path


HUB_PREFIXES = ("timm:", "hf-hub:")
"""Prefixes of weights given by name (:func:`resolve_weights`) rather than as a file path."""


def _hub_files(weights: str) -> tuple[str, str | None, tuple[str, ...]]:
    """``(repo_id, revision, file names to try)`` of a hub name, as timm resolves it (``timm:``: the model's
    ``pretrained_cfg.hf_hub_id`` and ``hf_hub_filename``; else timm's ``model.safetensors``, then
    ``pytorch_model.bin``). Raises :class:`CheckpointError` for a malformed name or a model without hub weights."""
    from timm.models import get_pretrained_cfg
    from timm.models._hub import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    default_files = (HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME)
    scheme, _, name = weights.partition(":")
    if scheme == "hf-hub":
        repo_id, _, revision = name.partition("@")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id) or "@" in revision:
            raise CheckpointError(
                f"malformed weights name {weights!r}: write hf-hub:ORG/REPO or hf-hub:ORG/REPO@REVISION "
                "(e.g. hf-hub:timm/resnet18.a1_in1k), or give a file path"
            )
        return repo_id, revision or None, default_files
    try:
        cfg = get_pretrained_cfg(name) if name else None
    except RuntimeError as err:  # timm: "Invalid pretrained tag (x) for resnet18."
        raise CheckpointError(
            f"malformed weights name {weights!r}: {err} timm.list_pretrained('{name.partition('.')[0]}.*') lists "
            "the valid names"
        ) from err
    if cfg is None:
        raise CheckpointError(
            f"malformed weights name {weights!r}: {name!r} is not a timm model; write timm:MODEL or timm:MODEL.TAG "
            "(e.g. timm:resnet50.a1_in1k; timm.list_pretrained() lists them), or give a file path"
        )
    if not cfg.hf_hub_id:
        raise CheckpointError(
            f"timm's weights {weights!r} are not on the Hugging Face hub (timm fetches them from "
            f"{cfg.url or cfg.file or 'nowhere'}): download that file and give its path as --model.weights"
        )
    repo_id, _, revision = cfg.hf_hub_id.partition("@")
    return repo_id, revision or None, (cfg.hf_hub_filename,) if cfg.hf_hub_filename else default_files


def resolve_weights(weights: str | Path, download: bool = False) -> Path:
    """The local file of ``weights``: a checkpoint path (checked to exist, like :func:`require_checkpoint_file`), or
    a hub name (:data:`HUB_PREFIXES`) found in the local Hugging Face cache with no network call. Only with
    ``download=True`` is a name missing from the cache fetched with ``huggingface_hub.hf_hub_download`` (network).

    Raises:
        CheckpointError: a missing file, a malformed name, or a name missing from the cache (the message names the
            cache folder searched and the fixes) or failing to download.
    """
    if not str(weights).startswith(HUB_PREFIXES):
        return require_checkpoint_file(weights)
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    repo_id, revision, files = _hub_files(str(weights))
    for filename in files:  # the cache only: try_to_load_from_cache reads the folder, it never calls the network
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(found, str):
            return Path(found)
    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    what = f"{repo_id}{'@' + revision if revision else ''} ({' or '.join(files)})"
    if not download:
        raise CheckpointError(
            f"weights {weights} ({what}) are not in the Hugging Face cache {folder}, and coretune does not download "
            "by default: download them into that cache (HF_HUB_CACHE) on a machine with network (e.g. hf download "
            f"{repo_id}), pass --model.weights_download true (needs network), or give a checkpoint file path"
        )
    for filename in files:
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision))
        except (OSError, ValueError) as err:  # HfHubHTTPError (no network, unknown or gated repository) is an OSError
            if isinstance(err, EntryNotFoundError) and not isinstance(err, LocalEntryNotFoundError):
                continue  # the repository has the other weights file (LocalEntryNotFoundError: the hub unreachable)
            raise CheckpointError(
                f"cannot download weights {weights} ({what}) into {folder}: {' '.join(str(err).split())}; check "
                "the network and the name, or give a checkpoint file path"
            ) from err
    raise CheckpointError(f"hub repository {repo_id} has none of {', '.join(files)}: give a checkpoint file path")


def weights_digest(weights: str | Path | None) -> str | None:
    """The SHA-256 (hex) of the file ``weights`` names (:func:`resolve_weights`, no download), or None for None: a
    record of exactly which checkpoint a result came from, which a path alone is not once the file is re-made."""
    if weights is None:
        return None
    digest = hashlib.sha256()
    with resolve_weights(weights).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_checkpoint_file(path: str | Path) -> Any:
    """Read a checkpoint without executing code: safetensors, else ``torch.load(..., weights_only=True)``.

    Raises:
        CheckpointError: the path is missing or a directory, the file is truncated/corrupt, or it is a pickle
            that needs code execution (refused by ``weights_only``).
    """
    path = require_checkpoint_file(path)
    if path.suffix == ".safetensors" or _is_safetensors(path):  # also saved under another name (model.bin, .pth)
        try:
            return load_file(path)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"cannot read safetensors checkpoint {path} ({err}): the file is truncated or corrupt; "
                "copy or download it again"
            ) from err
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # the weights-only unpickler also refuses bytes that are no pickle at all (a text or HTML file: "Unsupported
        # operand 60"): those are unreadable, not unsafe
        if "unsupported operand" in str(err).lower():
            with path.open("rb") as file:
                head = file.read(16)
            raise UnreadableCheckpointError(path, f"no pickle or zip archive: it starts with {head!r}") from err
        if "weights only" not in str(err).lower():
            raise _corrupt(path, err) from err
        # torch words it "Unsupported global: GLOBAL x" or "Trying to load unsupported GLOBAL x", by version
        found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", str(err), re.IGNORECASE)
        what = f" (it stores {found.group(1)})" if found else ""
        raise CheckpointError(
            f"checkpoint {path} holds Python objects that torch.load(weights_only=True) refuses to unpickle"
            f"{what}, because unpickling them could run arbitrary code. If you trust its source, re-save "
            "just the tensors: torch.save(torch.load(path, weights_only=False)['state_dict'], new_path) (or "
            "torch.save(model.state_dict(), new_path)), or convert it to .safetensors"
        ) from err
    except PermissionError as err:
        raise CheckpointError(f"checkpoint {path} is not readable ({err}): fix its permissions") from err
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as err:
        raise _corrupt(path, err) from err


def _is_safetensors(path: Path) -> bool:
    """Whether the file starts as safetensors do: an 8-byte little-endian header length, then the JSON header."""
    try:
        with path.open("rb") as file:
            head = file.read(9)
    except OSError:
        return False  # torch.load names the problem
    return len(head) == 9 and 2 <= int.from_bytes(head[:8], "little") < 100_000_000 and head[8:] == b"{"


def _corrupt(path: Path, err: BaseException) -> CheckpointError:
    return UnreadableCheckpointError(path, f"{type(err).__name__}: {err or 'unexpected end of file'}")


# ------------------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Extraction:
    """The backbone tensors a layout found in a checkpoint.

    Attributes:
        state: backbone state dict with keys as in ``Encoder.body`` (prefix stripped, heads removed).
        dropped: original keys of tensors the layout set aside (heads, projectors, momentum copies, queues).
        entry: where the backbone was found, e.g. ``state_dict['module.encoder_q.*']`` or ``checkpoint``.
        prefix: the stripped prefix (used to group dropped keys in messages).
    """

    state: dict[str, Tensor]
    dropped: list[str]
    entry: str
    prefix: str = ""


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


def _prefixed(
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


def _add_prefixed(
    name: str, doc: str, entries: tuple[str | None, ...], prefixes: tuple[str, ...], heads: tuple[str, ...]
) -> None:
    register_layout(name, doc)(
        lambda raw, encoder: _prefixed(raw, entries, prefixes, heads, encoder.body.state_dict().keys())
    )


@register_layout("torchvision", "a plain state dict of a torchvision-style model (torch.save(model.state_dict()))")
def _torchvision(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    if encoder.is_timm:
        return None
    return _prefixed(raw, (None,), ("",), encoder.classifier_names)


@register_layout(
    "timm",
    "a timm state dict: flat (pytorch_model.bin / model.safetensors) or timm train.py's checkpoint "
    "(state_dict, else model, state_dict_ema, model_ema; 'module.' stripped as timm's clean_state_dict does)",
)
def _timm(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    if not encoder.is_timm:
        return None
    entries = ("state_dict", "model", "state_dict_ema", "model_ema", None)
    return _prefixed(raw, entries, ("module.", ""), encoder.classifier_names)


_add_prefixed(
    "backbone",
    "state_dict (or flat) with 'backbone.' + torchvision/timm keys and a 'projector.' head (solo-style "
    "trainers, the shared simclr_resnet18_in20_64px checkpoint)",
    ("state_dict", "model", None),
    ("module.backbone.", "backbone."),
    ("fc",),
)
_add_prefixed(
    "moco",
    "MoCo v1/v2 (facebookresearch/moco): state_dict with 'module.encoder_q.'; fc MLP head, encoder_k and queue dropped",
    ("state_dict",),
    ("module.encoder_q.", "encoder_q."),
    ("fc",),
)
_add_prefixed(
    "moco_v3",
    "MoCo v3 (facebookresearch/moco-v3): state_dict with 'module.base_encoder.'; fc/head projector, "
    "predictor and momentum_encoder dropped",
    ("state_dict",),
    ("module.base_encoder.", "base_encoder."),
    ("fc", "head"),
)
_add_prefixed(
    "pycontrast",
    "PyContrast (InsDis/PIRL/CMC/InfoMin): 'model' (else 'model_ema') with 'module.encoder.'; head, fc and "
    "memory banks dropped",
    ("model", "model_ema"),
    ("module.encoder.", "encoder."),
    ("fc",),
)
_add_prefixed(
    "simsiam",
    "SimSiam (facebookresearch/simsiam): state_dict with 'module.encoder.'; its fc projector and the predictor dropped",
    ("state_dict",),
    ("module.encoder.", "encoder."),
    ("fc",),
)
_add_prefixed(
    "simclr",
    "SimCLR v1/v2 converted to PyTorch (tonylins/simclr-converter): state_dict with torchvision keys; fc dropped",
    ("state_dict",),
    ("",),
    ("fc",),
)
_add_prefixed(
    "byol",
    "BYOL: 'online_network.encoder.' / 'online_encoder.net.' / 'online_backbone.' / 'encoder.' prefixes "
    "(in state_dict, online_network_state_dict or flat); projector, predictor and target network dropped",
    ("state_dict", "online_network_state_dict", None),
    (
        "module.online_network.encoder.",
        "online_network.encoder.",
        "online_encoder.net.",
        "online_backbone.",
        "encoder.",
    ),
    ("fc", "projector", "projection", "predictor"),
)
_add_prefixed(
    "swav",
    "SwAV / DeepCluster-v2 / SeLa-v2 (facebookresearch/swav): flat or state_dict, 'module.' prefix; "
    "projection_head and prototypes dropped",
    ("state_dict", None),
    ("module.", ""),
    ("projection_head", "prototypes", "fc"),
)
_add_prefixed(
    "dino",
    "DINO (facebookresearch/dino): 'teacher' (else 'student') with 'backbone.' / 'module.backbone.', head "
    "dropped; or a bare backbone file",
    ("teacher", "student", None),
    ("module.backbone.", "backbone.", ""),
    ("head", "fc"),
)


@register_layout(
    "sequential",
    "a backbone saved as nn.Sequential(*list(model.children())[:-1]) (sthalles/PyTorch-BYOL's "
    "online_network_state_dict, many tutorials): keys '0.' … 'N.' are the model's children in order "
    "(ResNet: 0 conv1, 1 bn1, 4-7 layer1-4), under 'encoder.' / 'online_network.encoder.' / 'features.' / "
    "'backbone.' or flat; the rest (projection heads) dropped",
)
def _sequential(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    entries = ("online_network_state_dict", "state_dict", "model", None)
    prefixes = ("module.online_network.encoder.", "online_network.encoder.", "encoder.", "features.", "backbone.", "")
    extraction = _prefixed(raw, entries, prefixes, ())
    if extraction is None:
        return None
    children = [name for name, _ in encoder.body.named_children()]
    state, dropped = {}, list(extraction.dropped)
    for key, value in extraction.state.items():
        index, _, rest = key.partition(".")
        if index.isdigit() and int(index) < len(children) and rest:
            state[f"{children[int(index)]}.{rest}"] = value
        else:
            dropped.append(extraction.prefix + key)
    return Extraction(state, dropped, extraction.entry, extraction.prefix) if state else None


_TF_RESNET_BLOCK = re.compile(r"net\.([1-4])\.blocks\.(\d+)\.(.+)")
_TF_RESNET_PROJECTION = {"projection.shortcut.": "downsample.0.", "projection.bn.0.": "downsample.1."}


def _tf_resnet_name(key: str) -> str | None:
    """The torchvision name of a TF-style ResNet tensor (SimCLRv2 converter: ``net.0`` stem = conv, BN-ReLU;
    ``net.1``–``net.4`` stages of bottleneck blocks whose ``net`` is conv, BN-ReLU, conv, BN-ReLU, conv, BN and
    whose ``projection`` is the shortcut conv and its BN), or None."""
    if key == "net.0.0.weight":
        return "conv1.weight"
    if key.startswith("net.0.1.0."):
        return "bn1." + key.removeprefix("net.0.1.0.")
    block = _TF_RESNET_BLOCK.fullmatch(key)
    if block is None:
        return None
    stage, index, rest = block.groups()
    base = f"layer{stage}.{index}."
    for old, new in _TF_RESNET_PROJECTION.items():
        if rest.startswith(old):
            return base + new + rest.removeprefix(old)
    if (conv := re.fullmatch(r"net\.([024])\.weight", rest)) is not None:
        return f"{base}conv{int(conv[1]) // 2 + 1}.weight"
    if (bn := re.fullmatch(r"net\.([135])\.0\.(.+)", rest)) is not None:
        return f"{base}bn{(int(bn[1]) + 1) // 2}.{bn[2]}"
    return None


@register_layout(
    "simclrv2",
    "SimCLR v2 converted by Separius/SimCLRv2-Pytorch (r50_1x_sk0.pth …): 'resnet' with a TF-style ResNet's "
    "names ('net.0' stem, 'net.1'-'net.4' stages of 'blocks.N.net.K' and 'blocks.N.projection'), mapped to "
    "torchvision's; fc and the 'head' projector dropped. Only sk0 models (no selective kernels) and width 1x "
    "have a torchvision/timm ResNet to load into",
)
def _simclrv2(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    extraction = _prefixed(raw, ("resnet", "state_dict", None), ("module.", ""), ("fc",))
    if extraction is None or not any(k.startswith("net.1.blocks.") for k in extraction.state):
        return None
    if any(".mixing_conv." in k or k.startswith("net.0.2.") for k in extraction.state):
        raise CheckpointError(
            "this SimCLR v2 checkpoint has selective kernels (an sk1 model: 'mixing_conv' tensors, a 3-conv stem), "
            "which no torchvision or timm ResNet has: use the sk0 checkpoint of the same depth (r50_1x_sk0, …)"
        )
    state, dropped = {}, list(extraction.dropped)
    for key, value in extraction.state.items():
        name = _tf_resnet_name(key)
        if name is None:
            dropped.append(extraction.prefix + key)
        else:
            state[name] = value
    return Extraction(state, dropped, extraction.entry, extraction.prefix) if state else None


@register_layout(
    "lightning",
    "a Lightning .ckpt: state_dict with 'backbone.body.' (coretune), 'model.backbone.', 'backbone.', "
    "'encoder.' or 'model.' prefixes; other modules dropped",
)
def _lightning(raw: Mapping[str, Any], encoder: Encoder) -> Extraction | None:
    if "pytorch-lightning_version" not in raw:
        return None
    prefixes = ("backbone.body.", "model.backbone.", "backbone.", "encoder.", "model.")
    heads = ("fc", "head", *encoder.classifier_names)
    return _prefixed(raw, ("state_dict",), prefixes, heads, encoder.body.state_dict().keys())


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
        resampled: position embeddings interpolated to the model's patch grid (``key: old grid → new grid``),
            e.g. a ViT pre-trained at 224 px loaded into one built for 64 px.
        cast: loaded keys stored in a non-floating dtype (integer, quantised) where the backbone has floats,
            converted because ``allow_cast`` was given.
        normalization: the input ``(mean, std)`` the weights were trained with, when known (:func:`normalization_of`).
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
            text += "; resampled " + ", ".join(self.resampled)
        if self.cast:
            text += f"; cast {len(self.cast)} non-floating tensors to floating point (allow_cast)"
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
    """Pick the layout: the forced one, else most backbone keys matched, fewest unexpected, first in order.

    Raises:
        CheckpointError: unknown ``weights_format``, ``raw`` is not a dict, or no layout matches any key.
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
    for layout in candidates:
        extraction = layout.extract(raw, encoder)
        matched, unexpected = _match_count(extraction, model_keys)
        if extraction is None:
            tried.append(f"{layout.name} (not applicable: its entries/prefixes are absent)")
        else:
            tried.append(f"{layout.name} ({matched}/{len(model_keys)} keys matched via {extraction.entry})")
        if matched and (best is None or (matched, -unexpected) > best[0]):
            best = ((matched, -unexpected), layout, extraction)
    if best is None:
        raise CheckpointError(
            f"no tensor of checkpoint {path} matches backbone {encoder.name!r}. Layouts tried: "
            f"{'; '.join(tried)}. Checkpoint starts with {_describe_keys(raw)}. If the layout is known, "
            f"force it with --model.weights_format (one of {', '.join(_LAYOUTS)}); otherwise re-save the "
            "backbone's state_dict with torchvision/timm key names"
        )
    return best[1], best[2]


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


def _resample_position_embeddings(
    body: nn.Module, state: dict[str, Tensor], model_state: dict[str, Tensor]
) -> list[str]:
    """Interpolate (bicubic, in place in ``state``) a ViT's absolute position embedding ``pos_embed`` whose patch
    grid differs from the model's, as timm does for its own checkpoints; the class/register tokens' embeddings
    are kept. Returns ``["pos_embed: 14×14 → 4×4"]`` or ``[]``."""
    key = "pos_embed"
    grid = getattr(getattr(body, "patch_embed", None), "grid_size", None)
    if key not in state or key not in model_state or grid is None:
        return []
    old, new = state[key], model_state[key]
    if old.shape == new.shape or old.dim() != 3 or old.shape[-1] != new.shape[-1]:
        return []  # same grid, or not a (1, tokens, dim) embedding of the same width: the shape check reports it
    from timm.layers import resample_abs_pos_embed

    prefix = 0 if getattr(body, "no_embed_class", False) else int(getattr(body, "num_prefix_tokens", 1))
    side = math.isqrt(old.shape[1] - prefix)
    if side * side != old.shape[1] - prefix:
        return []
    state[key] = resample_abs_pos_embed(old, new_size=list(grid), old_size=[side, side], num_prefix_tokens=prefix)
    return [f"{key}: {side}×{side} → {grid[0]}×{grid[1]}"]


def normalization_of(raw: Any, weights: str | Path) -> Normalization | None:
    """The input normalisation checkpoint ``raw`` was trained with, when it says: its ``normalization`` entry
    (``{"mean": […], "std": […]}``, written by ``coretune pretrain``), the data module's ``mean`` and ``std`` a
    Lightning checkpoint of coretune saves (``datamodule_hyper_parameters``: a fine-tuned or pre-training run's
    ``.ckpt``), or a timm name's pretrained config (``timm:vit_base_patch16_224.augreg_in21k`` was trained on inputs
    scaled to [-1, 1], mean = std = 0.5)."""
    for key in ("normalization", "datamodule_hyper_parameters"):
        entry = raw.get(key) if isinstance(raw, Mapping) else None
        if isinstance(entry, Mapping) and entry.get("mean") is not None and entry.get("std") is not None:
            return tuple(map(float, entry["mean"])), tuple(map(float, entry["std"]))
    scheme, _, name = str(weights).partition(":")
    if scheme == "timm" and name:
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
    download: bool = False,
) -> LoadReport:
    """Load the backbone tensors of checkpoint ``path`` into ``encoder.body`` and report what happened.

    ``path`` may be a hub name (``timm:resnet18.a1_in1k``, ``hf-hub:ORG/REPO``): :func:`resolve_weights` finds its
    file in the local Hugging Face cache (and downloads it only with ``download=True``).

    Names, shapes and dtypes are checked first; only then is ``load_state_dict(strict=False)`` called with the
    matched tensors (BN running statistics included). Floating-point tensors of another precision (fp16, bf16)
    are converted; integer or quantised tensors where the backbone has floats are refused unless ``allow_cast``.

    Raises:
        CheckpointError: a hub name missing from the cache, unreadable file, no layout matches, a shape differs
            (wrong architecture), the checkpoint lacks backbone tensors (unless ``allow_missing``), has extra ones
            (unless ``allow_unexpected``) or stores floating-point weights as integers (unless ``allow_cast``).
    """
    path_or_name, path = path, resolve_weights(path, download)
    raw = load_checkpoint_file(path)
    layout, extraction = extract_backbone_state(raw, encoder, weights_format, path)
    model_state = encoder.body.state_dict()
    resampled = _resample_position_embeddings(encoder.body, extraction.state, model_state)
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
            "the real values, force the conversion with --model.weights_allow_cast true (coretune eval: "
            "--weights_allow_cast true; allow_cast=True in Python)"
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
    )
    required = [k for k in missing if _is_required(k)]
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
