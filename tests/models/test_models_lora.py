"""LoRA through peft (issue 64, :mod:`coretune.models.lora`): which tensors train, a step leaves the pre-trained
weights as they were, the merge is the LoRA paper's ``W + (alpha / r) B A``, and each bad setting is one line."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

from coretune import objectives
from coretune.engine import FineTuner, OptimSettings
from coretune.extras import MissingExtra
from coretune.models import Encoder, create_backbone
from coretune.models.lora import LoRASettings, apply_lora, lora_layer_names, merge_lora, merged_lora_state

DEPTH = 2
TINY_VIT = {"img_size": 32, "patch_size": 8, "depth": DEPTH}
"""A timm ViT-Tiny of 2 blocks on 32 px images in 8 px patches (16 tokens + CLS): a fraction of a second."""


def lora_vit(settings: LoRASettings, objective: Any = None) -> FineTuner:
    model = FineTuner(objective, "vit_tiny_patch16_224", backbone_args=TINY_VIT, optim=OptimSettings(lora=settings))
    model.build(3)
    return model


def trainable(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def lora_names(layers: tuple[str, ...]) -> set[str]:
    return {
        f"backbone.body.blocks.{block}.attn.{layer}.lora_{ab}.default.weight"
        for block in range(DEPTH)
        for layer in layers
        for ab in "AB"
    }


@pytest.mark.parametrize(("targets", "layers"), [("qkv", ("qkv",)), ("qkv,attn.proj", ("qkv", "proj"))])
def test_only_lora_the_classifier_and_the_objective_heads_train(targets: str, layers: tuple[str, ...]) -> None:
    model = lora_vit(LoRASettings(rank=4, targets=targets), objectives.CoreTuning())
    heads = {f"objective.{name}" for name, _ in model.objective.named_parameters()}
    assert heads >= {"objective.classifier.weight", "objective.classifier.bias"}
    assert trainable(model) == lora_names(layers) | heads
    body = model.backbone.body  # the LayerNorms, biases and embeddings: frozen, as every other pre-trained tensor
    frozen = (body.norm.weight, body.blocks[0].norm1.bias, body.blocks[0].attn.qkv.base_layer.bias, body.pos_embed)
    assert not any(p.requires_grad for p in (*frozen, body.cls_token, body.patch_embed.proj.weight))
    assert lora_layer_names(model.backbone.body) == [
        f"blocks.{b}.attn.{layer}" for b in range(DEPTH) for layer in layers
    ]
    assert model.hparams["optim"]["lora"] == {"rank": 4, "alpha": 16.0, "dropout": 0.1, "targets": targets}


def test_rank_0_is_the_plain_backbone_every_tensor_training() -> None:
    model = FineTuner(backbone="vit_tiny_patch16_224", backbone_args=TINY_VIT)
    plain = create_backbone("vit_tiny_patch16_224", verbose=False, **TINY_VIT)
    assert OptimSettings().lora == LoRASettings() and not LoRASettings().enabled
    assert list(model.backbone.state_dict()) == list(plain.state_dict())
    assert trainable(model.backbone) == {name for name, _ in plain.named_parameters()}
    assert lora_layer_names(model.backbone) == []


def test_a_step_changes_lora_b_only_then_lora_a_and_never_the_pretrained_weights() -> None:
    """``B`` starts at zero, so the first step's gradient of ``A`` (``B^T`` times the rest) is zero: only ``B``
    moves; from the second step ``A`` too. The pre-trained tensors never do."""
    torch.manual_seed(0)
    model = lora_vit(LoRASettings(rank=4, dropout=0.0), objectives.CoreTuning())
    model.objective.attach_backbone(model.backbone)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    images, labels = torch.randn(6, 3, 32, 32), torch.tensor([0, 0, 1, 1, 2, 2])

    def step() -> dict[str, torch.Tensor]:
        optimizer.zero_grad()
        model.objective(model.backbone(images), labels, inputs=images).loss.backward()
        optimizer.step()
        return model.state_dict()

    after = step()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {k for k in changed if k.startswith("backbone.")} == {k for k in lora_names(("qkv",)) if "lora_B" in k}
    assert "objective.classifier.weight" in changed
    after = step()
    changed = {k for k in before if not torch.equal(before[k], after[k]) and k.startswith("backbone.")}
    assert changed == lora_names(("qkv",))


def _with_random_b(encoder: Encoder) -> Encoder:
    """LoRA's ``B`` drawn at random (it starts at zero): a merge then has an update to fold in."""
    for name, p in encoder.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    return encoder.eval()


def test_the_merge_is_w_plus_alpha_over_r_b_a_and_leaves_the_plain_vit() -> None:
    torch.manual_seed(0)
    settings = LoRASettings(rank=4, alpha=8.0, targets="qkv,attn.proj")
    encoder = create_backbone("vit_tiny_patch16_224", verbose=False, **TINY_VIT)
    plain_keys = list(encoder.state_dict())
    apply_lora(encoder, settings)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        pretrained = encoder.eval()(images)  # B = 0: the pre-trained ViT's features
    _with_random_b(encoder)
    state = encoder.state_dict()
    expected = {}  # the LoRA paper's eq. (3) with §4.1's scale, layer by layer: W0 + (alpha / r) B A
    for block in range(DEPTH):
        for layer in ("qkv", "proj"):
            at = f"body.blocks.{block}.attn.{layer}"
            a, b = state[f"{at}.lora_A.default.weight"], state[f"{at}.lora_B.default.weight"]
            expected[f"{at}.weight"] = state[f"{at}.base_layer.weight"] + settings.alpha / settings.rank * b @ a
    with torch.no_grad():
        unmerged = encoder(images)
        assert merge_lora(encoder) == 2 * DEPTH
        merged = encoder(images)
    assert list(encoder.state_dict()) == plain_keys  # timm's own names, no lora_ tensor
    assert not any(isinstance(m, nn.Dropout) and "lora" in n for n, m in encoder.named_modules())
    for key, weight in expected.items():
        torch.testing.assert_close(encoder.state_dict()[key], weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    assert (merged - pretrained).abs().max() > 1e-2  # the merged update is not nil
    assert merge_lora(encoder) == 0


def test_resnet_convolutions_take_lora_and_merge_as_a_1x1_after_a_kxk_convolution() -> None:
    """peft's ``lora.Conv2d``: ``A`` a k×k convolution to ``r`` channels, ``B`` a 1×1 one back; merged, the kernel
    gains ``(alpha / r) B A`` (``B``'s matrix times ``A``'s kernels)."""
    torch.manual_seed(0)
    settings = LoRASettings(rank=2, alpha=4.0, targets="conv1,conv2")
    encoder = create_backbone("resnet18", verbose=False)
    plain_keys = list(encoder.state_dict())
    apply_lora(encoder, settings)
    layers = lora_layer_names(encoder.body)
    assert "conv1" in layers and "layer1.0.conv2" in layers and "layer4.1.conv1" in layers
    assert not any("downsample" in name for name in layers)
    assert {n for n, p in encoder.named_parameters() if p.requires_grad} == {
        n for n, _ in encoder.named_parameters() if "lora_" in n
    }  # BatchNorm's weights and biases frozen too
    state = _with_random_b(encoder).state_dict()
    at = "body.layer2.0.conv2"
    a, b = state[f"{at}.lora_A.default.weight"], state[f"{at}.lora_B.default.weight"]
    update = (b.flatten(1) @ a.flatten(1)).view_as(state[f"{at}.base_layer.weight"])
    expected = state[f"{at}.base_layer.weight"] + settings.alpha / settings.rank * update
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        unmerged = encoder(images)
        merge_lora(encoder)
        merged = encoder(images)
    assert list(encoder.state_dict()) == plain_keys
    torch.testing.assert_close(encoder.state_dict()[f"{at}.weight"], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_every_objective_trains_lora_and_its_heads_only(name: str) -> None:
    """Any objective combines with LoRA: its loss's gradient reaches the LoRA weights and its own heads, and no
    other tensor of the backbone has one."""
    torch.manual_seed(0)
    cls, preset = objectives.get(name)
    model = lora_vit(LoRASettings(rank=2), cls(**preset))
    if model.objective.needs_class_counts:  # logit adjustment: the training priors, as a fit observes them
        model.objective.observe_class_counts(torch.tensor([2, 2, 2]))
    if name == "erm_pp":  # its head-only warm-up holds the backbone for linear_steps + 1 steps: start after it
        model.objective.steps.fill_(model.objective.linear_steps + 1)
    model.objective.attach_backbone(model.backbone)
    model.objective.prepare([])
    images, labels = torch.randn(6, 3, 32, 32), torch.tensor([0, 0, 1, 1, 2, 2])
    inputs = images.flip(-1) if model.objective.input_views == 2 else images
    model.objective(model.backbone(images), labels, inputs=inputs).loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert {n for n in with_grad if n.startswith("backbone.")} <= lora_names(("qkv",))
    assert {n for n in with_grad if "lora_B" in n} == {n for n in lora_names(("qkv",)) if "lora_B" in n}
    assert trainable(model) == lora_names(("qkv",)) | {f"objective.{n}" for n, _ in model.objective.named_parameters()}


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"rank": -1}, "optim.lora.rank must be a whole number >= 0 (got -1)"),
        ({"rank": 4, "alpha": 0.0}, "optim.lora.alpha must be > 0 (got 0.0)"),
        ({"rank": 4, "dropout": 1.0}, "optim.lora.dropout must lie in [0, 1) (got 1.0)"),
        ({"rank": 4, "targets": " , "}, "optim.lora.targets must name at least one layer (got ' , '), e.g. qkv"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else "",
)
def test_bad_lora_settings_are_named_before_any_model_is_built(settings: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError) as info:
        FineTuner(backbone="small_cnn", optim=OptimSettings(lora=LoRASettings(**settings)))
    assert str(info.value) == f"invalid model settings: {problem}"


def test_freezing_the_backbone_and_lora_together_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^invalid model settings: freeze_backbone would freeze the LoRA weights "):
        FineTuner(backbone="small_cnn", freeze_backbone=True, optim=OptimSettings(lora=LoRASettings(rank=4)))


@pytest.mark.parametrize(
    ("backbone", "targets", "message"),
    [
        (
            "resnet18",
            "qkv",
            "--model.optim.lora.targets 'qkv' names no layer of backbone resnet18: LoRA adapts its linear and "
            "convolution layers, named conv1, conv2, downsample.0",
        ),
        (
            "vit",
            "norm1",
            "--model.optim.lora.targets 'norm1' names blocks.0.norm1 of backbone vit_tiny_patch16_224, a LayerNorm: "
            "LoRA adapts linear and convolution layers only, named proj, qkv, fc1, fc2",
        ),
        (
            "grouped",
            "1",
            "--model.optim.lora.targets '1' names 1 of backbone grouped, a grouped convolution: peft cannot merge its "
            "LoRA weights into it (coretune export merges them); choose other layers among 0, 1",
        ),
    ],
    ids=["no-such-layer", "a-layernorm", "grouped-convolution"],
)
def test_targets_that_lora_cannot_adapt_are_one_line(backbone: str, targets: str, message: str) -> None:
    if backbone == "grouped":  # a ResNeXt's 3x3 convolutions, in small
        body = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 3, groups=2))
        encoder = Encoder(body, 4, "grouped")
    elif backbone == "vit":
        encoder = create_backbone("vit_tiny_patch16_224", verbose=False, **TINY_VIT)
    else:
        encoder = create_backbone(backbone, verbose=False)
    with pytest.raises(ValueError) as info:
        apply_lora(encoder, LoRASettings(rank=2, targets=targets))
    assert str(info.value) == message
    assert lora_layer_names(encoder) == []


def test_a_missing_peft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import raises ImportError, as when it is not installed
    with pytest.raises(MissingExtra) as info:
        FineTuner(backbone="small_cnn", optim=OptimSettings(lora=LoRASettings(rank=4, targets="conv1")))
    assert str(info.value) == (
        "LoRA (--model.optim.lora.rank) needs peft, which is not installed: pip install 'coretune[peft]'"
    )


@pytest.mark.parametrize(
    ("backbone", "options", "targets"),
    [("vit_tiny_patch16_224", TINY_VIT, "qkv,attn.proj"), ("resnet18", {}, "conv1,conv2")],
    ids=["vit-linear", "resnet-conv"],
)
def test_the_state_dict_merge_is_pefts_merge(backbone: str, options: dict[str, Any], targets: str) -> None:
    """:func:`merged_lora_state` (a checkpoint's LoRA tensors merged without peft) gives the tensors, names and
    outputs of peft's own merge (:func:`merge_lora`), for linear layers and convolutions."""
    torch.manual_seed(0)
    settings = LoRASettings(rank=3, alpha=6.0, targets=targets)
    encoder = create_backbone(backbone, verbose=False, **options)
    apply_lora(encoder, settings)
    state = {k: v.clone() for k, v in _with_random_b(encoder).body.state_dict().items()}
    merged, layers = merged_lora_state(state, settings.alpha)
    assert layers == len(lora_layer_names(encoder.body)) > 0
    merge_lora(encoder)
    reference = encoder.body.state_dict()
    assert merged.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, atol=1e-6, rtol=1e-6, msg=key)


def test_incomplete_lora_tensors_are_named() -> None:
    state = {"qkv.base_layer.weight": torch.zeros(6, 2), "qkv.lora_A.default.weight": torch.zeros(1, 2)}
    with pytest.raises(ValueError, match=r"LoRA layer qkv lacks qkv\.lora_B\.default\.weight"):
        merged_lora_state(state, 1.0)


def test_a_lora_fine_tunings_checkpoint_starts_another_fit_with_the_merged_weights(tmp_path: Any) -> None:
    """``--model.weights`` of a LoRA run's ``last.ckpt``: its LoRA is merged into the backbone's weights (the load
    report says so), as ``coretune export`` would, and the new fit starts from them."""
    from coretune.cli import main
    from coretune.models.checkpoints import load_pretrained
    from fit_flags import QUIET
    from image_trees import make_image_tree

    tree = make_image_tree(tmp_path / "data", size=32)
    run = tmp_path / "lora"
    vit = ["--model.backbone=vit_tiny_patch16_224", f"--model.backbone_args={TINY_VIT}", "--data.image_size=32",
           "--data.batch_size=8", "--trainer.max_epochs=1", f"--data.root={tree}", *QUIET]  # fmt: skip
    main(["fit", *vit, "--model.optim.lora.rank=4", "--model.optim.lora.alpha=8", "--model.optim.lr=0.05",
          f"--run_dir={run}", "--test=false"])  # fmt: skip
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    body = {k[len("backbone.body.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("backbone.body.")}
    expected, layers = merged_lora_state(body, 8.0)
    assert layers == DEPTH
    encoder = create_backbone("vit_tiny_patch16_224", verbose=False, **TINY_VIT)
    report = load_pretrained(encoder, run / "checkpoints" / "last.ckpt")
    assert any("LoRA merged into the weights of 2 layers" in note for note in report.notes)
    for key, value in encoder.body.state_dict().items():
        torch.testing.assert_close(value, expected[key], msg=key)
    main(["fit", *vit, f"--model.weights={run / 'checkpoints' / 'last.ckpt'}", f"--run_dir={tmp_path / 'next'}",
          "--test=false"])  # fmt: skip
    assert (tmp_path / "next" / "results.json").is_file()
