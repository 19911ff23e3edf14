"""Reading checkpoint files safely, and finding the file of weights given by name.

Files are read with ``torch.load(weights_only=True)`` or safetensors (:func:`load_checkpoint_file`), so no code stored
in a checkpoint ever runs. Every failure is a :class:`CheckpointError` whose message names the cause and the fix.

Weights may also be named (:mod:`~coretune.models.hubnames` has the rules): a timm name ``<model>[.<tag>]`` (the
Hugging Face hub file timm's ``pretrained_cfg`` names), ``hf-hub:<org>/<repo>[@<revision>]``, or ``hub`` (the
backbone's own name). :func:`resolve_weights` finds the file in the local Hugging Face cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) without any network call; one missing from it is downloaded as timm
would, unless ``HF_HUB_OFFLINE=1`` or ``download=False`` (``--model.weights_options.download false``). The file is
then read like any other.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .errors import CheckpointError
from .hubnames import HF_HUB_PREFIX, OLD_WEIGHTS_PREFIX, downloads_allowed, hub_offline, is_timm_name, named_weights

__all__ = [
    "HUB_PREFIXES",
    "CheckpointError",
    "UnreadableCheckpointError",
    "check_weights",
    "hub_file",
    "is_weights_name",
    "load_checkpoint_file",
    "require_checkpoint_file",
    "resolve_weights",
    "weights_digest",
]

_SAFE_GLOBALS = [argparse.Namespace]
"""Allow-listed for ``weights_only`` loading: DINO, timm and many trainers store their ``args`` Namespace,
which only holds attributes and cannot run code."""


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
"""Prefixes of weights given by name (``timm:`` deprecated; a timm name needs none: :func:`is_weights_name`)."""


def is_weights_name(weights: str | Path) -> bool:
    """Whether ``weights`` (new spelling, ``hub`` replaced: :func:`~.hubnames.named_weights`) is a hub name rather
    than a file path: ``hf-hub:…``, or a timm model name that is no existing file."""
    text = str(weights)
    if text.startswith(HF_HUB_PREFIX):
        return True
    return not Path(text).exists() and is_timm_name(text)


def _hub_files(weights: str) -> tuple[str, str | None, tuple[str, ...]]:
    """``(repo_id, revision, file names to try)`` of a hub name, as timm resolves it (a timm name: the model's
    ``pretrained_cfg.hf_hub_id`` and ``hf_hub_filename``; ``hf-hub:``: timm's ``model.safetensors``, then
    ``pytorch_model.bin``). Raises :class:`CheckpointError` for a malformed name or a model without hub weights."""
    from timm.models import get_pretrained_cfg
    from timm.models._hub import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    default_files = (HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME)
    if weights.startswith(HF_HUB_PREFIX):
        repo_id, _, revision = weights[len(HF_HUB_PREFIX) :].partition("@")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id) or "@" in revision:
            raise CheckpointError(
                f"malformed weights name {weights!r}: write hf-hub:ORG/REPO or hf-hub:ORG/REPO@REVISION "
                "(e.g. hf-hub:timm/resnet18.a1_in1k), or give a file path"
            )
        return repo_id, revision or None, default_files
    name = weights
    try:
        cfg = get_pretrained_cfg(name) if name else None
    except RuntimeError as err:  # timm: "Invalid pretrained tag (x) for resnet18."
        raise CheckpointError(
            f"malformed weights name {weights!r}: {err} timm.list_pretrained('{name.partition('.')[0]}.*') lists "
            "the valid names"
        ) from err
    if cfg is None:
        raise CheckpointError(
            f"malformed weights name {weights!r}: {name!r} is not a timm model; write MODEL or MODEL.TAG "
            "(e.g. resnet50.a1_in1k; timm.list_pretrained() lists them), or give a file path"
        )
    if not cfg.hf_hub_id:
        raise CheckpointError(
            f"timm's weights {weights!r} are not on the Hugging Face hub (timm fetches them from "
            f"{cfg.url or cfg.file or 'nowhere'}): download that file and give its path as --model.weights"
        )
    repo_id, _, revision = cfg.hf_hub_id.partition("@")
    return repo_id, revision or None, (cfg.hf_hub_filename,) if cfg.hf_hub_filename else default_files


def resolve_weights(weights: str | Path, download: bool | None = None, backbone: str | None = None) -> Path:
    """The local file of ``weights``: a checkpoint path (checked to exist, like :func:`require_checkpoint_file`), or
    a hub name (:func:`is_weights_name`; ``hub``: the ``backbone``'s own, :func:`~.hubnames.named_weights`) found in
    the local Hugging Face cache with no network call. A name missing from the cache is fetched with
    ``huggingface_hub.hf_hub_download`` (network) when :func:`~.hubnames.downloads_allowed` (``download``: True,
    False, or None to follow ``HF_HUB_OFFLINE``).

    Raises:
        CheckpointError: a missing file, a malformed name, or a name missing from the cache that may not be
            downloaded (the message names the cache folder searched and the fixes) or fails to download.
    """
    found = _locate(weights, download, backbone, fetch=True)
    assert found is not None  # fetch=True: a path or an error
    return found


def check_weights(weights: str | Path, download: bool | None = None, backbone: str | None = None) -> None:
    """Raise what :func:`resolve_weights` would raise without downloading: a missing file, a malformed name, or a name
    missing from the cache that may not be downloaded (one that may is left to the download); no network call."""
    _locate(weights, download, backbone, fetch=False)


def _locate(weights: str | Path, download: bool | None, backbone: str | None, fetch: bool) -> Path | None:
    old = str(weights).startswith(OLD_WEIGHTS_PREFIX) and not Path(weights).exists()  # a name, whatever follows
    weights = named_weights(weights, backbone)
    if not (old or is_weights_name(weights)):
        return require_checkpoint_file(weights)
    repo_id, revision, files = _hub_files(str(weights))
    return hub_file(repo_id, revision, files, download, f"weights {weights}", fetch=fetch)


def hub_file(
    repo_id: str, revision: str | None, files: tuple[str, ...], download: bool | None, what: str, fetch: bool = True
) -> Path | None:
    """The first of ``files`` in hub repository ``repo_id`` found in the local Hugging Face cache (no network call),
    else downloaded when :func:`~.hubnames.downloads_allowed` and ``fetch`` (without ``fetch``: None). ``what`` names
    the file in messages (``weights X``, ``backbone hf-hub:ORG/REPO's config``).

    Raises:
        CheckpointError: not in the cache and no download allowed, or the download fails (the message names the
            cache folder and the fixes).
    """
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    for filename in files:  # the cache only: try_to_load_from_cache reads the folder, it never calls the network
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(found, str):
            return Path(found)
    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    label = f"{what} ({repo_id}{'@' + revision if revision else ''} ({' or '.join(files)}))"
    fill = f"download them into that cache (HF_HUB_CACHE) on a machine with network (e.g. hf download {repo_id})"
    if download is False:
        why, fix = "--model.weights_options.download false", "drop that option (needs network)"
    elif download is None and hub_offline():
        why, fix = "HF_HUB_OFFLINE=1", "unset HF_HUB_OFFLINE (needs network)"
    else:
        why = fix = ""
    if why:
        raise CheckpointError(
            f"{label} are not in the Hugging Face cache {folder}, and downloads are off ({why}): {fill}, {fix}, or "
            "give a checkpoint file path"
        )
    if not (downloads_allowed(download) and fetch):
        return None
    for filename in files:
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision))
        except (OSError, ValueError) as err:  # HfHubHTTPError (no network, unknown or gated repository) is an OSError
            if isinstance(err, EntryNotFoundError) and not isinstance(err, LocalEntryNotFoundError):
                continue  # the repository has the other weights file (LocalEntryNotFoundError: the hub unreachable)
            raise CheckpointError(
                f"cannot download {label} into {folder}: {' '.join(str(err).split())}; check the network and the "
                "name, or give a checkpoint file path"
            ) from err
    raise CheckpointError(f"hub repository {repo_id} has none of {', '.join(files)}: give a checkpoint file path")


def weights_digest(weights: str | Path | None, backbone: str | None = None) -> str | None:
    """The SHA-256 (hex) of the file ``weights`` names (:func:`resolve_weights`: a name is found in the cache or
    downloaded as it says), or None for None: a record of exactly which checkpoint a result came from, which a path
    alone is not once the file is re-made. ``backbone``: the one ``hub`` refers to."""
    if weights is None:
        return None
    digest = hashlib.sha256()
    with resolve_weights(weights, backbone=backbone).open("rb") as f:
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
