"""coretune.models.backbones: the factory, the registry and the Encoder contract (pooled (B, d) features)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from coretune.models import Encoder, backbones, create_backbone, list_backbones, register_backbone

TORCHVISION_DIMS = {
    "resnet18": 512,
    "resnet34": 512,
    "resnet50": 2048,
    "resnet101": 2048,
    "resnet152": 2048,
    "resnext50_32x4d": 2048,
    "resnext101_32x8d": 2048,
    "wide_resnet50_2": 2048,
}


def test_list_backbones_names_every_torchvision_resnet_and_small_cnn() -> None:
    assert list_backbones() == sorted([*TORCHVISION_DIMS, "small_cnn"])


@pytest.mark.parametrize("name", list(TORCHVISION_DIMS))
def test_torchvision_body_has_the_torchvision_keys_minus_fc(name: str) -> None:
    with torch.device("meta"):  # shapes and names only: no memory, no init cost for the big ones
        encoder = create_backbone(name)
        reference = getattr(torchvision.models, name)()
    assert encoder.feature_dim == TORCHVISION_DIMS[name] == reference.fc.in_features
    assert encoder.name == name and encoder.classifier_names == ("fc",)
    expected = {k: v.shape for k, v in reference.state_dict().items() if not k.startswith("fc.")}
    assert {k: v.shape for k, v in encoder.body.state_dict().items()} == expected
    assert isinstance(encoder.body.fc, nn.Identity)


def test_resnet18_at_32px_gives_pooled_512_features_equal_to_torchvision_penultimate() -> None:
    torch.manual_seed(0)
    encoder = create_backbone("resnet18").eval()
    reference = torchvision.models.resnet18().eval()
    reference.load_state_dict(encoder.body.state_dict(), strict=False)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        z = encoder(x)
        body = nn.Sequential(*list(reference.children())[:-1])  # everything up to avgpool
        expected = torch.flatten(body(x), 1)
    assert z.shape == (2, 512) and encoder.feature_dim == 512
    torch.testing.assert_close(z, expected)


def test_resnet_stages_are_layer1_to_layer4() -> None:
    encoder = create_backbone("resnet18")
    stages = encoder.stages()
    assert [id(s) for s in stages] == [id(getattr(encoder.body, f"layer{i}")) for i in range(1, 5)]
    shapes: list[tuple[int, ...]] = []
    handles = [s.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape))) for s in stages]
    encoder.eval()(torch.randn(1, 3, 32, 32))
    for handle in handles:
        handle.remove()
    assert shapes == [(1, 64, 8, 8), (1, 128, 4, 4), (1, 256, 2, 2), (1, 512, 1, 1)]


@pytest.mark.parametrize("size", [8, 32])
def test_small_cnn_gives_256_features_and_has_batchnorm(size: int) -> None:
    encoder = create_backbone("small_cnn")
    z = encoder(torch.randn(3, 3, size, size))
    assert z.shape == (3, 256) and encoder.feature_dim == 256
    keys = set(encoder.body.state_dict())
    assert {"layer1.1.running_mean", "layer1.1.running_var", "layer4.1.num_batches_tracked"} <= keys
    widths = [m.weight.shape[0] for m in encoder.body.modules() if isinstance(m, nn.Conv2d)]
    assert widths == [32, 64, 128, 256]
    stage_shapes = []
    x = torch.randn(2, 3, size, size)
    for stage in encoder.stages():
        x = stage(x)
        stage_shapes.append(tuple(x.shape[1:]))
    side = [size, size // 2, size // 4, size // 8]
    assert stage_shapes == [(c, s, s) for c, s in zip((32, 64, 128, 256), side, strict=True)]


def test_timm_resnet_by_name_and_stages_from_feature_info() -> None:
    encoder = create_backbone("resnet10t")
    assert encoder.name == "resnet10t" and encoder.is_timm and encoder.timm_model == ("resnet10t", {})
    assert encoder.feature_dim == 512 and encoder.classifier_names == ("fc",)
    assert encoder(torch.randn(2, 3, 32, 32)).shape == (2, 512)
    assert not any(k.startswith("fc.") for k in encoder.body.state_dict())
    names = ("act1", "layer1", "layer2", "layer3", "layer4")
    assert encoder.stages() == [encoder.body.get_submodule(n) for n in names]


def test_timm_vit_tiny_at_32px_through_img_size() -> None:
    encoder = create_backbone("vit_tiny_patch16_224", img_size=32)
    assert encoder.feature_dim == 192 and encoder.classifier_names == ("head",)
    assert encoder(torch.randn(2, 3, 32, 32)).shape == (2, 192)
    assert encoder.body.pos_embed.shape == (1, 1 + (32 // 16) ** 2, 192)
    assert len(encoder.stages()) == 12 and encoder.stages()[0] is encoder.body.blocks[0]


def test_timm_vits_take_any_image_size_by_default() -> None:
    encoder = create_backbone("vit_tiny_patch16_224")  # dynamic_img_size: pos_embed stays 14×14
    assert encoder.body.pos_embed.shape == (1, 1 + 14 * 14, 192)
    for size in (32, 64, 224):
        assert encoder(torch.randn(1, 3, size, size)).shape == (1, 192)


def test_backbone_args_reach_the_constructor_through_the_fine_tuner() -> None:
    from coretune.engine import FineTuner

    model = FineTuner(backbone="vit_tiny_patch16_224", backbone_args={"drop_path_rate": 0.1})
    assert model.backbone.body.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"timm model 'resnet10t' does not accept options \['img_size'\]"):
        FineTuner(backbone="resnet10t", backbone_args={"img_size": 32})


def test_unknown_backbone_lists_names_and_the_timm_form() -> None:
    with pytest.raises(ValueError, match=r"unknown backbone 'resnet19'") as info:
        create_backbone("resnet19")
    message = str(info.value)
    assert all(name in message for name in list_backbones())
    assert "a timm model name (e.g. 'vit_small_patch16_224.dino', 'resnet50.a1_in1k'" in message
    assert "'hf-hub:ORG/REPO'" in message and "\n" not in message


def test_unknown_timm_model_suggests_similar_names() -> None:
    similar = r"unknown backbone 'vit_tiny_patch16' \(similar timm models: vit_tiny_patch16_224"
    with pytest.raises(ValueError, match=similar):
        create_backbone("vit_tiny_patch16")
    with pytest.raises(ValueError, match=r"^backbone 'resnet10t.nope': Invalid pretrained tag \(nope\) for resnet10t"):
        create_backbone("resnet10t.nope")


@pytest.mark.parametrize("name", ["resnet18", "resnet10t"])
def test_unsupported_option_is_one_clear_value_error(name: str) -> None:
    with pytest.raises(ValueError, match=r"does not accept options \['img_size'\]"):
        create_backbone(name, img_size=32)


def test_register_backbone_adds_a_factory_and_refuses_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backbones, "_REGISTRY", dict(backbones._REGISTRY))

    @register_backbone("tiny_linear")
    def tiny_linear(width: int = 4) -> Encoder:
        return Encoder(nn.Sequential(nn.Flatten(), nn.LazyLinear(width)), width, "tiny_linear")

    assert "tiny_linear" in list_backbones()
    encoder = create_backbone("tiny_linear", width=6)
    assert encoder(torch.randn(2, 3, 4, 4)).shape == (2, 6) and encoder.stages() == []
    with pytest.raises(ValueError, match="already registered"):
        register_backbone("tiny_linear")(tiny_linear)
    for name in ("timm/mine", "hf-hub:me/mine"):
        with pytest.raises(ValueError, match="are timm's"):
            register_backbone(name)


def test_the_cifar_stem_keeps_32_px_images_at_full_resolution_into_layer1() -> None:
    """``cifar_stem``: SimCLR's and solo-learn's CIFAR ResNet stem (3×3 stride-1 conv1, no max pooling): layer1 sees
    32×32 and layer4 4×4 (ImageNet's stem: 8×8 and 1×1); the tensor names stay torchvision's."""
    sizes: dict[str, dict[str, tuple[int, ...]]] = {}
    for cifar in (False, True):
        encoder = create_backbone("resnet18", cifar_stem=cifar).eval()
        seen = sizes.setdefault(str(cifar), {})
        for name in ("layer1", "layer4"):
            getattr(encoder.body, name).register_forward_hook(
                lambda _m, _i, out, name=name, seen=seen: seen.__setitem__(name, tuple(out.shape[-2:]))
            )
        assert encoder(torch.randn(2, 3, 32, 32)).shape == (2, 512)
        names = {k: v.shape for k, v in encoder.body.state_dict().items()}
        reference = {
            k: v.shape for k, v in torchvision.models.resnet18().state_dict().items() if not k.startswith("fc.")
        }
        assert names.keys() == reference.keys()
        assert names["conv1.weight"] == ((64, 3, 3, 3) if cifar else (64, 3, 7, 7))
        assert isinstance(encoder.body.maxpool, nn.Identity) == cifar
        assert (encoder.timm_model is None) == cifar  # timm's resnet18 has ImageNet's stem
    assert sizes == {"False": {"layer1": (8, 8), "layer4": (1, 1)}, "True": {"layer1": (32, 32), "layer4": (4, 4)}}


def test_a_cifar_stem_checkpoint_loads_into_a_cifar_stem_and_not_into_imagenets(tmp_path: Path) -> None:
    source = create_backbone("resnet18", cifar_stem=True)
    path = tmp_path / "cifar_resnet18.pth"
    torch.save(source.body.state_dict(), path)
    loaded = create_backbone("resnet18", weights=path, verbose=False, cifar_stem=True)
    for key, value in source.body.state_dict().items():
        assert torch.equal(loaded.body.state_dict()[key], value), key
    with pytest.raises(ValueError, match=r"conv1\.weight"):
        create_backbone("resnet18", weights=path, verbose=False)


def test_the_cifar_stem_reaches_resnets_through_backbone_args_and_takes_only_a_bool() -> None:
    from coretune.engine import FineTuner

    model = FineTuner(backbone="resnet50", backbone_args={"cifar_stem": True})
    assert model.backbone.body.conv1.kernel_size == (3, 3) and model.backbone.feature_dim == 2048
    with pytest.raises(ValueError, match=r"backbone 'resnet18': cifar_stem must be true or false \(got 'yes'\)"):
        create_backbone("resnet18", cifar_stem="yes")


def test_a_cifar_stem_fit_is_tested_from_its_checkpoint_with_the_same_backbone(
    image_tree: Path, tmp_path: Path
) -> None:
    """``coretune fit --model.backbone_args '{cifar_stem: true}'`` records the option: ``coretune test`` of its
    checkpoint rebuilds the CIFAR stem and scores what the fit scored."""
    import json

    from coretune.cli import main
    from fit_flags import QUIET, TINY_FIT

    run, out = tmp_path / "run", tmp_path / "test.json"
    main(["fit", *TINY_FIT, *QUIET, "--model.backbone=resnet18", "--model.backbone_args={cifar_stem: true}",
          f"--data.root={image_tree}", f"--run_dir={run}"])  # fmt: skip
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={image_tree}", f"--output={out}"])
    fitted = json.loads((run / "results.json").read_text())["test"]
    assert json.loads(out.read_text())["test"]["top1"] == pytest.approx(fitted["top1"])
