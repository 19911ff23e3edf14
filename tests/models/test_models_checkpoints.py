"""coretune.models.checkpoints: every layout with its real key names, detection, and each user error.

Each fake checkpoint holds the backbone (random values, BN buffers included) under the layout's real entry
and prefix, plus the tensors the layout must drop: heads/projectors and *decoys* with the same backbone keys
(MoCo's encoder_k, BYOL's target network, DINO's student …) filled with other values, so loading the wrong
copy fails.
"""

from __future__ import annotations

import argparse
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor

from coretune.models import (
    CheckpointError,
    Encoder,
    create_backbone,
    list_layouts,
    load_checkpoint_file,
    load_pretrained,
)

State = dict[str, Tensor]


def randomised(encoder: Encoder, seed: int) -> State:
    """The encoder's state dict with every tensor (parameters and BN buffers) set to seeded random values."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in encoder.body.state_dict().items():
        if value.is_floating_point():
            state[key] = torch.rand(value.shape, generator=g) + 0.5
        else:
            state[key] = torch.randint(1, 10_000, value.shape, generator=g)
    return state


def prefixed(prefix: str, state: State) -> State:
    return {prefix + k: v for k, v in state.items()}


def head(*keys: str) -> State:
    return {k: torch.randn(4, 3) for k in keys}


def mlp_head(prefix: str) -> State:
    """A 2-layer MLP projector as torch writes it: Linear (0), BatchNorm (1, buffers included), Linear (3)."""
    return {
        f"{prefix}0.weight": torch.randn(8, 4),
        f"{prefix}0.bias": torch.randn(8),
        f"{prefix}1.weight": torch.randn(8),
        f"{prefix}1.bias": torch.randn(8),
        f"{prefix}1.running_mean": torch.randn(8),
        f"{prefix}1.running_var": torch.rand(8),
        f"{prefix}1.num_batches_tracked": torch.tensor(7),
        f"{prefix}3.weight": torch.randn(4, 8),
    }


def as_children(state: State) -> State:
    """A torchvision ResNet's keys as ``nn.Sequential(*list(resnet.children())[:-1])`` writes them."""
    order = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
    return {f"{order.index(k.split('.')[0])}.{k.partition('.')[2]}": v for k, v in state.items()}


def as_tf_style(state: State) -> State:
    """A torchvision ResNet-50's keys as Separius/SimCLRv2-Pytorch's TF-style ResNet names them: ``net.0`` the
    stem (conv 0, BatchNormRelu 1 = ``1.0``), ``net.S`` stage S of ``blocks.N`` with ``net`` = conv 0, BN-ReLU 1,
    conv 2, BN-ReLU 3, conv 4, BN 5 and ``projection`` = ``shortcut`` conv + ``bn.0``."""
    out = {}
    for key, value in state.items():
        module, _, tensor = key.rpartition(".")
        parts = module.split(".")
        if module == "conv1":
            name = "net.0.0"
        elif module == "bn1":
            name = "net.0.1.0"
        else:
            stage, block, layer = parts[0].removeprefix("layer"), parts[1], parts[2:]
            if layer == ["downsample", "0"]:
                inner = "projection.shortcut"
            elif layer == ["downsample", "1"]:
                inner = "projection.bn.0"
            elif layer[0].startswith("conv"):
                inner = f"net.{2 * (int(layer[0][4]) - 1)}"
            else:
                inner = f"net.{2 * int(layer[0][2]) - 1}.0"
            name = f"net.{stage}.blocks.{block}.{inner}"
        out[f"{name}.{tensor}"] = value
    return out


def sgd_state() -> dict[str, Any]:
    return {"state": {0: {"momentum_buffer": torch.randn(3)}}, "param_groups": [{"lr": 0.03, "params": [0]}]}


@dataclass
class Case:
    """A checkpoint in one layout: ``build(backbone, decoy)`` returns the object to save."""

    layout: str
    build: Callable[[State, State], dict[str, Any]]
    n_dropped: Callable[[int], int]  # number of dropped tensors given the backbone size
    backbone: str = "resnet18"
    safetensors: bool = False
    options: dict[str, Any] | None = None  # of the backbone (a one-block ViT)


CASES = {
    "moco": Case(
        "moco",
        lambda sd, decoy: {
            "epoch": 200,
            "arch": "resnet18",
            "state_dict": {
                **prefixed("module.encoder_q.", sd),
                **head(
                    "module.encoder_q.fc.0.weight",
                    "module.encoder_q.fc.0.bias",
                    "module.encoder_q.fc.2.weight",
                    "module.encoder_q.fc.2.bias",
                ),
                **prefixed("module.encoder_k.", decoy),
                "module.queue": torch.randn(128, 16),
                "module.queue_ptr": torch.zeros(1, dtype=torch.long),
            },
            "optimizer": sgd_state(),
        },
        lambda n: 4 + n + 2,
    ),
    "moco_v3": Case(
        "moco_v3",
        lambda sd, decoy: {
            "epoch": 100,
            "arch": "resnet18",
            "state_dict": {
                **prefixed("module.base_encoder.", sd),
                **mlp_head("module.base_encoder.fc."),
                **prefixed("module.momentum_encoder.", decoy),
                **mlp_head("module.momentum_encoder.fc."),
                **mlp_head("module.predictor."),
            },
            "optimizer": sgd_state(),
            "scaler": {"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 10},
        },
        lambda n: 8 + n + 8 + 8,
    ),
    "pycontrast": Case(
        "pycontrast",
        lambda sd, decoy: {
            "opt": argparse.Namespace(method="InfoMin", arch="resnet18", nce_k=16384),
            "model": {**prefixed("module.encoder.", sd), **mlp_head("module.head.")},
            "contrast": {"memory": torch.randn(32, 16), "params": torch.tensor([-1.0, 0.2])},
            "model_ema": {**prefixed("module.encoder.", decoy), **mlp_head("module.head.")},
            "optimizer": sgd_state(),
            "epoch": 800,
        },
        lambda n: 8,
    ),
    "simsiam": Case(  # facebookresearch/simsiam main_simsiam.py under DDP: encoder (fc = projector), predictor
        "simsiam",
        lambda sd, decoy: {
            "epoch": 100,
            "arch": "resnet18",
            "state_dict": {
                **prefixed("module.encoder.", sd),
                **mlp_head("module.encoder.fc."),
                **mlp_head("module.predictor."),
            },
            "optimizer": sgd_state(),
        },
        lambda n: 16,
    ),
    "simclr": Case(
        "simclr",
        lambda sd, decoy: {"state_dict": {**sd, "fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)}},
        lambda n: 2,
    ),
    "byol": Case(
        "byol",
        lambda sd, decoy: {
            "state_dict": {
                **prefixed("online_network.encoder.", sd),
                **mlp_head("online_network.projector.net."),
                **mlp_head("predictor.net."),
                **prefixed("target_network.encoder.", decoy),
                **mlp_head("target_network.projector.net."),
            },
            "epoch": 300,
        },
        lambda n: 8 + 8 + n + 8,
    ),
    "byol_online_network_state_dict": Case(
        "byol",
        lambda sd, decoy: {
            "online_network_state_dict": {**prefixed("encoder.", sd), **mlp_head("projection.net.")},
            "target_network_state_dict": {**prefixed("encoder.", decoy), **mlp_head("projection.net.")},
            "optimizer_state_dict": sgd_state(),
        },
        lambda n: 8,
    ),
    "byol_lucidrains": Case(
        "byol",
        lambda sd, decoy: {
            **prefixed("online_encoder.net.", sd),
            **head("online_encoder.net.fc.weight", "online_encoder.net.fc.bias"),
            **mlp_head("online_encoder.projector.net."),
            **mlp_head("online_predictor.net."),
            **prefixed("target_encoder.net.", decoy),
        },
        lambda n: 2 + 8 + 8 + n,
    ),
    "swav": Case(
        "swav",
        lambda sd, decoy: {
            **prefixed("module.", sd),
            **mlp_head("module.projection_head."),
            "module.prototypes.weight": torch.randn(30, 4),
        },
        lambda n: 9,
    ),
    "swav_safetensors": Case(
        "swav",
        lambda sd, decoy: {
            **prefixed("module.", sd),
            **mlp_head("module.projection_head."),
            "module.prototypes.weight": torch.randn(30, 4),
        },
        lambda n: 9,
        safetensors=True,
    ),
    "dino": Case(
        "dino",
        lambda sd, decoy: {
            "student": {**prefixed("module.backbone.", decoy), **mlp_head("module.head.mlp.")},
            "teacher": {
                **prefixed("backbone.", sd),
                **mlp_head("head.mlp."),
                **head("head.last_layer.weight_g", "head.last_layer.weight_v"),
            },
            "optimizer": sgd_state(),
            "epoch": 100,
            "args": argparse.Namespace(arch="resnet18", out_dim=65536),
            "dino_loss": {"center": torch.randn(1, 16)},
        },
        lambda n: 10,
    ),
    "backbone": Case(
        "backbone",
        lambda sd, decoy: {
            "epoch": 34,
            "arch": "resnet18",
            "method": "simclr",
            "state_dict": {
                **prefixed("backbone.", sd),
                **head("projector.0.weight", "projector.0.bias", "projector.2.weight", "projector.2.bias"),
            },
        },
        lambda n: 4,
    ),
    "lightning": Case(
        "lightning",
        lambda sd, decoy: {
            "epoch": 3,
            "global_step": 120,
            "pytorch-lightning_version": "2.6.6",
            "state_dict": {
                **prefixed("backbone.body.", sd),
                **head("objective.classifier.weight", "objective.classifier.bias"),
                **mlp_head("objective.projector."),
            },
            "loops": {},
            "callbacks": {},
            "optimizer_states": [sgd_state()],
            "lr_schedulers": [],
            "hyper_parameters": {"lr": 0.01, "backbone": "resnet18"},
        },
        lambda n: 10,
    ),
    "torchvision": Case(
        "torchvision",
        lambda sd, decoy: {**sd, "fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)},
        lambda n: 2,
    ),
    "torchvision_safetensors": Case(
        "torchvision",
        lambda sd, decoy: {**sd, "fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)},
        lambda n: 2,
        safetensors=True,
    ),
    "torchvision_small_cnn": Case(
        "torchvision", lambda sd, decoy: {**sd, **head("fc.weight", "fc.bias")}, lambda n: 2, "small_cnn"
    ),
    "backbone_small_cnn": Case(
        "backbone",
        lambda sd, decoy: {"state_dict": {**prefixed("backbone.", sd), **mlp_head("projector.")}},
        lambda n: 8,
        "small_cnn",
    ),
    "sequential": Case(  # sthalles/PyTorch-BYOL: encoder = nn.Sequential(*list(resnet.children())[:-1])
        "sequential",
        lambda sd, decoy: {
            "online_network_state_dict": {**prefixed("encoder.", as_children(sd)), **mlp_head("projetion.net.")},
            "target_network_state_dict": {**prefixed("encoder.", as_children(decoy)), **mlp_head("projetion.net.")},
            "optimizer_state_dict": sgd_state(),
        },
        lambda n: 8,
    ),
    "simclrv2": Case(  # Separius/SimCLRv2-Pytorch convert.py: torch.save({"resnet": ..., "head": ...})
        "simclrv2",
        lambda sd, decoy: {
            "resnet": {**as_tf_style(sd), "fc.weight": torch.randn(1000, 2048), "fc.bias": torch.randn(1000)},
            "head": {k.replace("projetion.net.", "layers."): v for k, v in mlp_head("projetion.net.").items()},
        },
        lambda n: 2,
        "resnet50",
    ),
    "timm": Case(
        "timm",
        lambda sd, decoy: {
            "epoch": 10,
            "arch": "resnet10t",
            "state_dict": {**sd, "fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)},
            "optimizer": sgd_state(),
            "version": 2,
            "args": argparse.Namespace(model="resnet10t", lr=0.1),
            "state_dict_ema": {**decoy, "fc.weight": torch.randn(1000, 512), "fc.bias": torch.randn(1000)},
        },
        lambda n: 2,
        "resnet10t",
    ),
    "mae": Case(  # main_pretrain.py: {'model': MaskedAutoencoderViT} (ViT checkpoints: test_models_vit_layouts.py)
        "mae",
        lambda sd, decoy: {"model": {**sd, "mask_token": torch.randn(1, 1, 8), **head("decoder_pred.weight")}},
        lambda n: 2,
        "vit_tiny_patch16_224",
        options={"depth": 1, "img_size": 32},
    ),
    "dinov2": Case(  # a hub state dict (dinov2_vits14_pretrain.pth)
        "dinov2",
        lambda sd, decoy: {**sd, "mask_token": torch.randn(1, 384)},
        lambda n: 1,
        "vit_small_patch14_dinov2",
        options={"depth": 1, "img_size": 28},
    ),
}


def write(case: Case, raw: dict[str, Any], directory: Path) -> Path:
    if case.safetensors:
        path = directory / "model.safetensors"
        save_file(raw, str(path))
    else:
        path = directory / "checkpoint.pth.tar"
        torch.save(raw, path)
    return path


def test_every_layout_has_a_case() -> None:
    assert {case.layout for case in CASES.values()} == set(list_layouts())


@pytest.mark.parametrize("weights_format", ["auto", "forced"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_layout_loads_every_backbone_tensor(case_name: str, weights_format: str, tmp_path: Path) -> None:
    case = CASES[case_name]
    encoder = create_backbone(case.backbone, **(case.options or {}))
    saved, decoy = randomised(encoder, seed=1), randomised(encoder, seed=2)
    path = write(case, case.build(saved, decoy), tmp_path)

    report = load_pretrained(encoder, path, case.layout if weights_format == "forced" else "auto")

    assert report.layout == case.layout
    state = encoder.body.state_dict()
    assert sorted(report.loaded) == sorted(state) == sorted(saved)
    assert report.missing == [] and report.unexpected == []
    assert len(report.dropped) == case.n_dropped(len(saved))
    for key, value in state.items():
        assert torch.equal(value, saved[key]), key  # parameters and BN buffers, not the decoy


def test_summary_of_the_shared_checkpoint_layout(tmp_path: Path) -> None:
    encoder = create_backbone("resnet18")
    path = write(CASES["backbone"], CASES["backbone"].build(randomised(encoder, 1), {}), tmp_path)
    assert load_pretrained(encoder, path).summary() == (
        "layout 'backbone' (state_dict['backbone.*']) — 120/120 tensors loaded, 0 missing, 0 unexpected; "
        "dropped 4 non-backbone tensors (projector.*)"
    )


def test_summary_groups_moco_head_momentum_encoder_and_queue(tmp_path: Path) -> None:
    encoder = create_backbone("small_cnn")
    path = write(CASES["moco"], CASES["moco"].build(randomised(encoder, 1), randomised(encoder, 2)), tmp_path)
    assert load_pretrained(encoder, path).summary() == (
        "layout 'moco' (state_dict['module.encoder_q.*']) — 24/24 tensors loaded, 0 missing, 0 unexpected; "
        "dropped 30 non-backbone tensors (module.encoder_q.fc.*, module.encoder_k.*, module.queue, "
        "module.queue_ptr)"
    )


def test_create_backbone_with_weights_loads_and_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = randomised(create_backbone("small_cnn"), 3)
    path = write(CASES["backbone_small_cnn"], CASES["backbone_small_cnn"].build(saved, {}), tmp_path)
    encoder = create_backbone("small_cnn", weights=path)
    assert all(torch.equal(v, saved[k]) for k, v in encoder.body.state_dict().items())
    err = capsys.readouterr().err
    assert f"small_cnn ← {path}: layout 'backbone'" in err and "24/24 tensors loaded" in err
    create_backbone("small_cnn", weights=path, verbose=False)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------------------------
# errors a user can cause
# ------------------------------------------------------------------------------------------------------------
def test_simclrv2_selective_kernel_checkpoint_is_refused_with_the_fix(tmp_path: Path) -> None:
    encoder = create_backbone("resnet50")
    tf_style = as_tf_style(randomised(encoder, 1))
    tf_style["net.1.blocks.0.net.2.mixing_conv.0.weight"] = torch.randn(32, 64, 1, 1)
    torch.save({"resnet": tf_style}, tmp_path / "r50_1x_sk1.pth")
    with pytest.raises(CheckpointError, match=r"selective kernels .* use the sk0 checkpoint of the same depth"):
        load_pretrained(encoder, tmp_path / "r50_1x_sk1.pth")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.pth"
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} does not exist: check the path"):
        create_backbone("small_cnn", weights=path)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path} is a directory"):
        load_checkpoint_file(tmp_path)


@pytest.mark.parametrize("name", ["ckpt.pth", "legacy.pth", "model.safetensors", "empty.pt", "page.pth"])
def test_truncated_file(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    state = {f"t{i}": torch.randn(64, 64) for i in range(4)}
    if name.endswith(".safetensors"):
        save_file(state, str(path))
    else:
        torch.save(state, path, _use_new_zipfile_serialization=name != "legacy.pth")
    data = path.read_bytes()
    # page.pth: no checkpoint at all (an HTML error page saved under the checkpoint's name), not an unsafe pickle
    path.write_bytes({"empty.pt": b"", "page.pth": b"<html>404 Not Found</html>\n"}.get(name, data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=rf"cannot read .*checkpoint {path} .*truncated or corrupt"):
        load_checkpoint_file(path)


class WriteFile:
    """A pickle payload: unpickling it calls ``open(target, "w")``, creating the file."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.target), "w"))


def test_malicious_pickle_is_refused_without_running(tmp_path: Path) -> None:
    witness, marker = tmp_path / "witness", tmp_path / "pwned"
    # the payload is real: a plain pickle load runs it
    pickle.loads(pickle.dumps({"x": WriteFile(witness)}))["x"].close()
    assert witness.exists()

    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}, "hook": WriteFile(marker)}, path)
    with pytest.raises(CheckpointError, match=r"weights_only=True\) refuses") as info:
        create_backbone("resnet18", weights=path)
    assert not marker.exists()
    message = str(info.value)
    assert str(path) in message and "io.open" in message and "safetensors" in message
    assert "torch.save(model.state_dict(), new_path)" in message


def test_not_a_dict(tmp_path: Path) -> None:
    path = tmp_path / "tensor.pt"
    torch.save(torch.randn(3), path)
    with pytest.raises(CheckpointError, match=r"holds a Tensor, not a dict of tensors"):
        create_backbone("small_cnn", weights=path)


def test_unknown_layout_lists_layouts_tried_and_first_keys(tmp_path: Path) -> None:
    path = tmp_path / "odd.pth"
    torch.save({"epoch": 1, "weights": {"net.0.0.weight": torch.randn(2), "net.0.1.weight": torch.randn(2)}}, path)
    with pytest.raises(CheckpointError, match=r"no tensor of checkpoint .* matches backbone 'small_cnn'") as info:
        create_backbone("small_cnn", weights=path)
    message = str(info.value)
    for layout in list_layouts():
        assert f"{layout} (" in message
    assert "weights: {net.0.0.weight, net.0.1.weight}" in message and "--model.weights_options.format" in message


def test_every_layout_is_one_module_of_the_layouts_package_in_detection_order() -> None:
    """Adding a layout is one file in coretune/models/layouts/ (its @register_layout) named in DETECTION_ORDER."""
    import pkgutil

    from coretune.models import layouts

    modules = {m.name for m in pkgutil.iter_modules(layouts.__path__)}
    assert modules == set(layouts.DETECTION_ORDER)
    assert list_layouts()[: len(layouts.DETECTION_ORDER)] == list(layouts.DETECTION_ORDER)
    assert list_layouts()[:3] == ["torchvision", "timm", "backbone"] and list_layouts()[-1] == "lightning"


def test_forced_layout_that_does_not_fit(tmp_path: Path) -> None:
    encoder = create_backbone("small_cnn")
    path = write(CASES["dino"], CASES["dino"].build(randomised(encoder, 1), randomised(encoder, 2)), tmp_path)
    with pytest.raises(CheckpointError, match=r"Layouts tried: moco \(not applicable"):
        load_pretrained(encoder, path, "moco")


def test_unknown_weights_format(tmp_path: Path) -> None:
    encoder = create_backbone("small_cnn")
    path = write(CASES["torchvision"], randomised(encoder, 1), tmp_path)
    with pytest.raises(CheckpointError, match=r"unknown weights_format 'mocov2': choose 'auto' or one of torch"):
        load_pretrained(encoder, path, "mocov2")


def test_wrong_architecture_names_key_and_both_shapes(tmp_path: Path) -> None:
    path = tmp_path / "r50.pth"
    torch.save({"state_dict": prefixed("module.encoder_q.", create_backbone("resnet50").body.state_dict())}, path)
    expected = (
        r"does not fit backbone 'resnet18': checkpoint layer1\.0\.conv1\.weight \(64, 64, 1, 1\) vs model "
        r"\(64, 64, 3, 3\) \(and \d+ more mismatched tensors\): wrong architecture\? pass the matching "
        r"--model\.backbone"
    )
    with pytest.raises(CheckpointError, match=expected):
        create_backbone("resnet18", weights=path)


def test_missing_backbone_tensors_are_an_error_unless_allowed(tmp_path: Path) -> None:
    encoder = create_backbone("small_cnn")
    saved = randomised(encoder, 1)
    path = tmp_path / "partial.pth"
    torch.save({k: v for k, v in saved.items() if not k.startswith("layer4.")}, path)
    with pytest.raises(CheckpointError, match=r"lacks 5 tensors of backbone 'small_cnn' \(e\.g\. layer4\.0\.weight"):
        load_pretrained(encoder, path)
    untouched = {k: v.clone() for k, v in encoder.body.state_dict().items()}

    report = load_pretrained(encoder, path, allow_missing=True)
    assert report.missing == [k for k in saved if k.startswith("layer4.")] and len(report.missing) == 6
    assert "18/24 tensors loaded, 6 missing" in report.summary()
    for key, value in encoder.body.state_dict().items():
        assert torch.equal(value, untouched[key] if key.startswith("layer4.") else saved[key]), key


def test_checkpoint_without_num_batches_tracked_loads(tmp_path: Path) -> None:
    encoder = create_backbone("small_cnn")
    saved = {k: v for k, v in randomised(encoder, 1).items() if not k.endswith("num_batches_tracked")}
    path = write(CASES["torchvision"], saved, tmp_path)
    report = load_pretrained(encoder, path)
    assert report.missing == [f"layer{i}.1.num_batches_tracked" for i in range(1, 5)]
    assert all(torch.equal(encoder.body.state_dict()[k], v) for k, v in saved.items())


def test_unexpected_backbone_tensors_are_an_error_unless_allowed(tmp_path: Path) -> None:
    path = tmp_path / "r34.pth"
    resnet34 = create_backbone("resnet34").body.state_dict()
    torch.save(resnet34, path)
    encoder = create_backbone("resnet18")
    with pytest.raises(CheckpointError, match=r"has 96 tensors that backbone 'resnet18' lacks \(e\.g\. layer1\.2\."):
        load_pretrained(encoder, path)
    report = load_pretrained(encoder, path, allow_unexpected=True)
    assert len(report.loaded) == 120 and len(report.unexpected) == 96
    assert all(torch.equal(v, resnet34[k]) for k, v in encoder.body.state_dict().items())


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated in torch, still loadable
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")  # torch.save of a quantised tensor
def test_quantised_weights_are_refused_unless_the_cast_is_allowed(tmp_path: Path) -> None:
    encoder = create_backbone("small_cnn")
    state = encoder.body.state_dict()
    key = next(k for k, v in state.items() if v.is_floating_point())
    quantised = torch.quantize_per_tensor(state[key].float(), 0.01, 0, torch.qint8)
    path = tmp_path / "q.pth"
    torch.save({**state, key: quantised}, path)
    with pytest.raises(
        CheckpointError, match=rf"stores 1 floating-point tensors of backbone 'small_cnn' as qint8 \(e\.g\. {key}\)"
    ):
        load_pretrained(create_backbone("small_cnn"), path)
    report = load_pretrained(encoder, path, allow_cast=True)
    assert report.cast == [key] and encoder.body.state_dict()[key].dtype == torch.float32


def test_vit_position_embedding_is_resampled_to_the_models_grid(tmp_path: Path) -> None:
    """A ViT pre-trained at 224 px (14×14 patches) loads into one built for 64 px (4×4): the grid part of
    ``pos_embed`` is interpolated bicubically (as timm does), the class token's embedding is kept."""
    import torch.nn.functional as F

    pretrained = create_backbone("vit_tiny_patch16_224", img_size=224)
    saved = randomised(pretrained, seed=1)
    path = tmp_path / "vit.pth"
    torch.save({"state_dict": saved}, path)
    encoder = create_backbone("vit_tiny_patch16_224", img_size=64)

    report = load_pretrained(encoder, path)

    assert report.resampled == ["pos_embed resized 14×14 → 4×4 for img_size 64"]
    assert "; pos_embed resized 14×14 → 4×4 for img_size 64" in report.summary()
    assert sorted(report.loaded) == sorted(saved) and report.missing == report.unexpected == []
    old = saved["pos_embed"]
    grid = old[:, 1:].reshape(1, 14, 14, 192).permute(0, 3, 1, 2)
    small = F.interpolate(grid, size=(4, 4), mode="bicubic", antialias=True, align_corners=False)
    expected = torch.cat([old[:, :1], small.permute(0, 2, 3, 1).reshape(1, 16, 192)], dim=1)
    torch.testing.assert_close(encoder.body.pos_embed.detach(), expected)
    state = encoder.body.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items() if k != "pos_embed")
    assert encoder(torch.randn(2, 3, 64, 64)).shape == (2, 192)


def test_the_normalisation_a_checkpoint_was_trained_with_is_reported(tmp_path: Path) -> None:
    # coretune pretrain records it; a timm name's pretrained config gives it (a ViT of augreg: mean = std = 0.5)
    from coretune.models.checkpoints import normalization_of

    recorded = {"state_dict": {}, "normalization": {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.2]}}
    assert normalization_of(recorded, tmp_path / "w.pth") == ((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))
    assert normalization_of({"state_dict": {}}, tmp_path / "w.pth") is None
    fitted = {"state_dict": {}, "datamodule_hyper_parameters": {"mean": (0.5, 0.4, 0.3), "std": (0.2, 0.2, 0.2)}}
    assert normalization_of(fitted, tmp_path / "run.ckpt") == ((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))  # a run's .ckpt
    assert normalization_of({"datamodule_hyper_parameters": {"root": "data"}}, tmp_path / "run.ckpt") is None
    assert normalization_of({}, "vit_tiny_patch16_224.augreg_in21k") == ((0.5,) * 3, (0.5,) * 3)
    assert normalization_of({}, "resnet18.a1_in1k") == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    from coretune.pretrain import SimCLR

    weights = tmp_path / "pretrained.pth.tar"
    torch.save({**SimCLR(backbone="small_cnn").pretrained_checkpoint(), "normalization": recorded["normalization"]},
               weights)  # fmt: skip
    encoder = create_backbone("small_cnn", weights=str(weights))
    assert encoder.pretrained_normalization == ((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))
    assert create_backbone("small_cnn").pretrained_normalization is None


@pytest.mark.parametrize("prefix", ["backbone.body.", "model.backbone."])
def test_a_lightning_checkpoint_of_a_convnext_keeps_its_head_norm(tmp_path: Path, prefix: str) -> None:
    # timm's ConvNeXt without a classifier keeps head.norm (its final LayerNorm; head.fc is the classifier): the
    # lightning layout dropped every head.* key, and the load failed with "lacks 2 tensors … pass the matching
    # --model.backbone", which it was
    source = create_backbone("convnext_atto")
    state = randomised(source, 3)
    assert {"head.norm.weight", "head.norm.bias"} <= state.keys()
    checkpoint = {"pytorch-lightning_version": "2.6.0", "state_dict": {prefix + k: v for k, v in state.items()}}
    checkpoint["state_dict"][prefix + "head.fc.weight"] = torch.zeros(10, source.feature_dim)  # a classifier
    torch.save(checkpoint, tmp_path / "run.ckpt")
    encoder = create_backbone("convnext_atto")
    report = load_pretrained(encoder, tmp_path / "run.ckpt")
    assert report.layout == "lightning" and len(report.loaded) == report.total and not report.missing
    assert report.dropped == [prefix + "head.fc.weight"]
    for key, value in encoder.body.state_dict().items():
        assert torch.equal(value, state[key].to(value.dtype)), key


@pytest.mark.parametrize("name", ["pytorch_model.bin", "weights.pth"])
def test_safetensors_saved_under_another_name_are_read_as_safetensors(tmp_path: Path, name: str) -> None:
    # torch.load failed on them, and the message called a good file "truncated or corrupt: copy or download it again"
    encoder = create_backbone("resnet18")
    state = randomised(encoder, 4)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / name))
    assert load_checkpoint_file(tmp_path / name).keys() == state.keys()
    report = load_pretrained(encoder, tmp_path / name)
    assert len(report.loaded) == report.total
