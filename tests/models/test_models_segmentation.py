"""DeepLab-V3 on coretune's ResNets: output and feature-map sizes at output stride 16 and 8, the dilation against
torchvision's own, pre-trained weights through the classification loader and its report, and refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torchvision

from coretune.models import CheckpointError, DeepLabV3, create_backbone, create_deeplabv3, dilate_resnet
from coretune.models.segmentation import DILATION_BY_OUTPUT_STRIDE


@pytest.mark.parametrize("backbone", ["resnet18", "resnet50"])
@pytest.mark.parametrize("output_stride", [16, 8])
def test_logits_have_the_input_size_and_the_feature_map_the_requested_stride(backbone: str, output_stride: int) -> None:
    torch.manual_seed(0)
    model = create_deeplabv3(backbone, num_classes=5, output_stride=output_stride).eval()
    assert isinstance(model, DeepLabV3) and model.output_stride == output_stride
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        logits, features = model.forward_with_features(x)
        assert torch.equal(model(x), logits)
        pooled = model.encoder(x)
    assert logits.shape == (2, 5, 64, 48)
    width = 512 if backbone == "resnet18" else 2048
    assert features.shape == (2, width, 64 // output_stride, 48 // output_stride)
    torch.testing.assert_close(features.mean((2, 3)), pooled)  # the regulariser's input: the pooled feature map


def test_a_training_step_reaches_the_backbone() -> None:
    model = create_deeplabv3("resnet18", num_classes=3, output_stride=8)
    logits = model(torch.randn(2, 3, 32, 32))
    torch.nn.functional.cross_entropy(logits, torch.randint(0, 3, (2, 32, 32))).backward()
    assert model.encoder.body.conv1.weight.grad.abs().sum() > 0
    assert model.head[-1].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("output_stride", [16, 8])
def test_dilation_matches_torchvision_replace_stride_with_dilation(output_stride: int) -> None:
    """For ResNet-50 (Bottleneck), where torchvision builds the dilated model itself, ``dilate_resnet`` gives the
    same convolutions and the same outputs; ResNet-18/34 (BasicBlock), which torchvision refuses, get the same
    treatment."""
    dilation = DILATION_BY_OUTPUT_STRIDE[output_stride]
    reference = torchvision.models.resnet50(replace_stride_with_dilation=dilation).eval()
    ours = torchvision.models.resnet50().eval()
    ours.load_state_dict(reference.state_dict())
    dilate_resnet(ours, dilation)
    assert str(ours) == str(reference)  # every stride, dilation and padding
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x))
    with pytest.raises(NotImplementedError, match="Dilation > 1 not supported in BasicBlock"):
        torchvision.models.resnet18(replace_stride_with_dilation=dilation)
    small = torchvision.models.resnet18()
    dilate_resnet(small, dilation)
    rates = {name: conv.dilation[0] for name, conv in small.named_modules() if name.endswith(("conv1", "conv2"))}
    last = 2 if output_stride == 16 else 4
    assert (rates["layer4.0.conv1"], rates["layer4.1.conv1"], rates["layer4.1.conv2"]) == (last // 2, last, last)
    assert small.layer4[0].downsample[0].stride == (1, 1)


def test_pretrained_weights_load_through_the_classification_loader_with_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = create_backbone("resnet18")
    with torch.no_grad():
        for p in source.body.parameters():
            p.uniform_(-1, 1)
    state = {f"module.encoder_q.{k}": v for k, v in source.body.state_dict().items()}
    state["module.encoder_q.fc.0.weight"] = torch.randn(4, 512)  # MoCo v2's MLP head: dropped
    path = tmp_path / "moco.pth.tar"
    torch.save({"state_dict": state, "epoch": 200}, path)

    model = create_deeplabv3("resnet18", num_classes=4, output_stride=16, weights=str(path))
    err = capsys.readouterr().err
    assert (
        f"resnet18 ← {path}: layout 'moco' (state_dict['module.encoder_q.*']) — 120/120 tensors loaded, 0 missing"
        in err
    )
    assert "dropped 1 non-backbone tensors (module.encoder_q.fc.*)" in err
    loaded = model.encoder.body.state_dict()
    for key, value in source.body.state_dict().items():
        assert torch.equal(loaded[key], value), key
    assert model.encoder.body.layer4[1].conv1.dilation == (2, 2)  # dilated after loading

    wrong = tmp_path / "resnet50.pth"
    torch.save(torchvision.models.resnet50().state_dict(), wrong)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {wrong} (layout 'torchvision') does not fit")):
        create_deeplabv3("resnet18", num_classes=4, weights=str(wrong))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backbone": "small_cnn"}, "DeepLab-V3 needs a ResNet backbone (resnet18, resnet34, "),
        ({"backbone": "resnet18.a1_in1k"}, "got 'resnet18.a1_in1k': its last stages are dilated"),
        ({"output_stride": 32}, "output_stride must be 16 or 8 for DeepLab-V3, got 32"),
        ({"num_classes": 1}, "segmentation needs at least 2 classes, got 1"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line(kwargs: dict[str, object], message: str) -> None:
    options = {"backbone": "resnet18", "num_classes": 3} | kwargs
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        create_deeplabv3(**options)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
