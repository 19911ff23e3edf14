"""Weights by name (``<timm model>[.<tag>]``, ``hf-hub:<org>/<repo>``, ``hub``; ``timm:<model>`` deprecated) from a
Hugging Face cache the test writes by hand: ``models--ORG--REPO/snapshots/<rev>/<file>`` and ``refs/main``. Nothing
touches the network: downloads are faked (``HF_HUB_OFFLINE=1`` for every test: tests/conftest.py).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
import timm
import torch
from safetensors.torch import save_file
from torch import Tensor

from coretune.cli import main
from coretune.engine import setting_changes
from coretune.engine.fitcli import FitArgsError, resolved_fit_config
from coretune.models import CheckpointError, create_backbone, resolve_weights
from fit_flags import QUIET

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache as HF_HUB_CACHE; any download or socket connection fails the test."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read at import, so set it too

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache


def cache_entry(cache: Path, repo_id: str, filename: str, state: dict[str, Tensor], ref: str | None = "main") -> Path:
    """Write ``state`` as the hub cache's ``repo_id`` file at :data:`REVISION` (``refs/<ref>`` points to it)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    path = snapshot / filename
    if filename.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        torch.save(state, path)
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / ref).write_text(REVISION)
    return path


def timm_resnet18_state() -> dict[str, Tensor]:
    """A random resnet18 as timm's hub file stores it (classifier ``fc`` included)."""
    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False).state_dict()


def test_timm_name_loads_the_file_its_pretrained_cfg_names(hub_cache: Path, capsys: pytest.CaptureFixture) -> None:
    state = timm_resnet18_state()
    path = cache_entry(hub_cache, "timm/resnet18.a1_in1k", "model.safetensors", state)
    assert resolve_weights("resnet18.a1_in1k") == path
    assert resolve_weights("resnet18") == path  # timm's default tag of resnet18 is a1_in1k
    assert resolve_weights("hub", backbone="resnet18.a1_in1k") == path  # the weights the backbone's name names
    encoder = create_backbone("resnet18.a1_in1k", weights="hub")
    loaded = encoder.body.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)
    assert (
        "resnet18.a1_in1k ← hub: layout 'timm' (checkpoint) — 120/120 tensors loaded, 0 missing, "
        "0 unexpected; dropped 2 non-backbone tensors (fc.*)" in capsys.readouterr().err
    )


def test_hf_hub_name_falls_back_to_pytorch_model_bin_and_takes_a_revision(hub_cache: Path) -> None:
    state = create_backbone("small_cnn", verbose=False).body.state_dict()
    path = cache_entry(hub_cache, "someone/tiny-cnn", "pytorch_model.bin", state, ref=None)
    assert resolve_weights(f"hf-hub:someone/tiny-cnn@{REVISION}") == path
    with pytest.raises(CheckpointError, match="are not in the Hugging Face cache"):
        resolve_weights("hf-hub:someone/tiny-cnn")  # no refs/main: the cache does not know which snapshot is main
    (path.parents[2] / "refs").mkdir()
    (path.parents[2] / "refs" / "main").write_text(REVISION)
    assert resolve_weights("hf-hub:someone/tiny-cnn") == path


def test_a_name_missing_from_the_cache_names_the_folder_and_the_fixes(hub_cache: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        resolve_weights("resnet18.a1_in1k")
    assert str(info.value) == (
        "weights resnet18.a1_in1k (timm/resnet18.a1_in1k (model.safetensors or pytorch_model.bin)) are not in "
        f"the Hugging Face cache {hub_cache / 'models--timm--resnet18.a1_in1k'}, and downloads are off "
        "(HF_HUB_OFFLINE=1): download them into that cache (HF_HUB_CACHE) on a machine with network (e.g. hf "
        "download timm/resnet18.a1_in1k), unset HF_HUB_OFFLINE (needs network), or give a checkpoint file path"
    )
    off = r"downloads are off \(--model.weights_options.download false\): .*, drop that option"
    with pytest.raises(CheckpointError, match=off):
        resolve_weights("resnet18.a1_in1k", download=False)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("hf-hub:no-organisation", "malformed weights name 'hf-hub:no-organisation': write hf-hub:ORG/REPO or "),
        ("hf-hub:", "malformed weights name 'hf-hub:': write hf-hub:ORG/REPO"),
        ("timm:no_such_model", "malformed weights name 'no_such_model': 'no_such_model' is not a timm model"),
        ("resnet18.nope", "malformed weights name 'resnet18.nope': Invalid pretrained tag (nope) for "),
    ],
)
def test_a_malformed_name_is_refused_naming_the_syntax(name: str, expected: str, hub_cache: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        resolve_weights(name)
    assert str(info.value).startswith(expected), info.value
    assert "\n" not in str(info.value)


def test_download_follows_hf_hub_offline_and_the_flag(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, str | None]] = []
    fetched = hub_cache / "fetched.safetensors"

    def fake_download(repo_id: str, filename: str, revision: str | None = None) -> str:
        calls.append((repo_id, filename, revision))
        if filename == "model.safetensors":
            response = SimpleNamespace(headers={}, request=None, status_code=404)  # what the error reads of it
            raise huggingface_hub.errors.RemoteEntryNotFoundError("404 model.safetensors", response=response)
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(CheckpointError, match=r"not in the Hugging Face cache .*downloads are off \(HF_HUB_OFFLINE=1"):
        resolve_weights("hf-hub:someone/tiny-cnn")  # HF_HUB_OFFLINE=1 (conftest)
    assert calls == []
    assert resolve_weights("hf-hub:someone/tiny-cnn@v1", download=True) == fetched
    assert calls == [("someone/tiny-cnn", "model.safetensors", "v1"), ("someone/tiny-cnn", "pytorch_model.bin", "v1")]
    monkeypatch.delenv("HF_HUB_OFFLINE")  # as timm: a name missing from the cache is downloaded by default
    calls.clear()
    assert resolve_weights("hf-hub:someone/tiny-cnn@v2") == fetched and len(calls) == 2
    with pytest.raises(CheckpointError, match=r"downloads are off \(--model.weights_options.download false\)"):
        resolve_weights("hf-hub:someone/tiny-cnn", download=False)
    assert len(calls) == 2

    def offline(repo_id: str, filename: str, revision: str | None = None) -> str:
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach the hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(CheckpointError, match=r"cannot download weights hf-hub:someone/tiny-cnn .*cannot reach the"):
        resolve_weights("hf-hub:someone/tiny-cnn", download=True)


def test_fit_with_a_timm_name_from_the_cache(hub_cache: Path, image_tree: Path, tmp_path: Path) -> None:
    cache_entry(hub_cache, "timm/resnet18.a1_in1k", "model.safetensors", timm_resnet18_state())
    run = tmp_path / "run"
    main(
        [
            "fit",
            f"--data.root={image_tree}",
            "--model.backbone=resnet18.a1_in1k",
            "--model.weights=hub",
            "--data.image_size=16",
            "--data.batch_size=8",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            f"--run_dir={run}",
            *QUIET,
        ]
    )
    assert 0.0 <= json.loads((run / "results.json").read_text())["test"]["top1"] <= 1.0


def test_fit_eval_and_sweeps_refuse_a_name_missing_from_the_cache(
    hub_cache: Path, image_tree: Path, tmp_path: Path
) -> None:
    folder = hub_cache / "models--timm--resnet18.a1_in1k"
    name = "resnet18.a1_in1k"
    fit = [f"--data.root={image_tree}", "--model.backbone=resnet18.a1_in1k", f"--model.weights={name}"]
    for args in (["fit", *fit, f"--run_dir={tmp_path / 'run'}"], ["eval", "knn", f"--model.weights={name}", *fit[:1]]):
        with pytest.raises(SystemExit) as info:
            main(args)
        message = str(info.value.code)
        assert message.startswith(f"coretune {args[0]}: error: weights resnet18.a1_in1k "), message
        assert f"are not in the Hugging Face cache {folder}," in message and "\n" not in message
    assert not list((tmp_path / "run").glob("*"))  # nothing written
    with pytest.raises(FitArgsError, match="are not in the Hugging Face cache"):
        resolved_fit_config(fit)
    config = resolved_fit_config([*fit, "--model.weights_options.download=true"])
    assert config["model"]["weights_options"]["download"] is True


def test_a_resume_may_switch_the_download_flag() -> None:
    recorded = {"model": {"weights_options": {"download": True}}}
    current = {"model": {"weights_options": {"download": False}}}
    assert setting_changes(recorded, current) == (["model.weights_options.download True → False"], [])


# -- names as their owners write them (issue 63) ---------------------------------------------------------------
def test_coretune_names_keep_their_meaning_and_timm_names_build_timm_models() -> None:
    import torchvision

    torchvision_resnet = create_backbone("resnet18", verbose=False)
    assert isinstance(torchvision_resnet.body, torchvision.models.ResNet) and not torchvision_resnet.is_timm
    for name, tag in (
        ("resnet18.a1_in1k", "a1_in1k"),
        ("resnet10t", "c3_in1k"),
        ("vit_tiny_patch16_224.augreg_in21k", "augreg_in21k"),
    ):
        encoder = create_backbone(name, verbose=False)
        assert encoder.is_timm and encoder.name == name
        assert isinstance(encoder.body, timm.models.ResNet | timm.models.VisionTransformer)
        assert encoder.body.pretrained_cfg["tag"] == tag  # the tag (else timm's default one) picks the config


def test_old_spellings_work_warn_once_and_build_the_same(
    hub_cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from coretune.models import hubnames

    monkeypatch.setattr(hubnames, "_WARNED", set())
    torch.manual_seed(0)
    new = create_backbone("resnet10t").body.state_dict()
    for _ in range(2):
        torch.manual_seed(0)
        old = create_backbone("timm/resnet10t")
        assert old.name == "resnet10t" and all(torch.equal(old.body.state_dict()[k], v) for k, v in new.items())
    assert create_backbone("timm/resnet18").name == "resnet18.a1_in1k"  # coretune's resnet18 is torchvision's
    path = cache_entry(hub_cache, "timm/resnet18.a1_in1k", "model.safetensors", timm_resnet18_state())
    assert resolve_weights("timm:resnet18.a1_in1k") == resolve_weights("timm:resnet18.a1_in1k") == path
    assert capsys.readouterr().err.splitlines() == [
        "coretune: backbone name 'timm/resnet10t' is deprecated and will be removed in the next release: use "
        "'resnet10t'",
        "coretune: backbone name 'timm/resnet18' is deprecated and will be removed in the next release: use "
        "'resnet18.a1_in1k'",
        "coretune: weights name 'timm:resnet18.a1_in1k' is deprecated and will be removed in the next release: use "
        "'resnet18.a1_in1k'",
    ]


def test_recorded_old_spellings_are_read_as_now_silently(capsys: pytest.CaptureFixture[str]) -> None:
    from coretune.engine.modelsettings import grouped_model_settings

    recorded = {"backbone": "timm/resnet18", "weights": "timm:resnet18.a1_in1k", "weights_download": False}
    assert grouped_model_settings(recorded) == {
        "backbone": "resnet18.a1_in1k",
        "weights": "resnet18.a1_in1k",
        "weights_options": {"download": False},
    }
    assert capsys.readouterr().err == ""


def test_a_file_that_exists_wins_over_a_name(hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save(timm_resnet18_state(), tmp_path / "resnet18.a1_in1k")
    assert resolve_weights("resnet18.a1_in1k") == Path("resnet18.a1_in1k")  # not the (absent) hub file
    assert create_backbone("resnet18.a1_in1k", weights="resnet18.a1_in1k", verbose=False).is_timm
    with pytest.raises(CheckpointError, match=r"checkpoint resnet18\.pth does not exist"):
        resolve_weights("resnet18.pth")  # a checkpoint suffix: a path, never a name


def test_hub_weights_of_a_coretune_backbone_are_refused_in_one_line(hub_cache: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        create_backbone("resnet50", weights="hub")
    assert str(info.value) == (
        "--model.weights hub loads the weights the backbone's name names, and the coretune backbone 'resnet50' (not "
        "a timm model) names none: give a timm backbone (e.g. --model.backbone resnet50.a1_in1k) or the weights' name "
        "or file as --model.weights (e.g. resnet50.a1_in1k, hf-hub:ORG/REPO)"
    )


def test_an_hf_hub_backbone_is_built_from_its_cached_config_and_loads_its_weights(
    hub_cache: Path, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    source = timm.create_model("resnet10t", num_classes=5)
    timm.models.save_for_hf(source, tmp_path / "repo", safe_serialization=True)  # config.json + model.safetensors
    snapshot = cache_entry(hub_cache, "someone/tuned-resnet", "model.safetensors", source.state_dict()).parent
    (snapshot / "config.json").write_text((tmp_path / "repo" / "config.json").read_text())
    encoder = create_backbone("hf-hub:someone/tuned-resnet", weights="hub", verbose=False)
    assert encoder.is_timm and encoder.name == "hf-hub:someone/tuned-resnet"
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(encoder.eval()(images), source.eval().forward_head(source.forward_features(images), True))
    with pytest.raises(CheckpointError, match=r"the config of backbone hf-hub:someone/other \(someone/other \(config"):
        create_backbone("hf-hub:someone/other")
