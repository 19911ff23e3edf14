"""Surgical fine-tuning (Lee et al., ICLR 2023): ``--model.optim.train_blocks`` trains the blocks it names and the
heads, the rest of the backbone frozen."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, make_trainer
from coretune.engine.optim import OptimSettings
from coretune.models.blocks import backbone_blocks, parse_blocks
from coretune.objectives import create
from fit_flags import TINY_FIT, error

VIT = {"img_size": 32, "patch_size": 8, "depth": 4}  # a tiny timm ViT: 4 blocks of 16 tokens


def _trainable(model: FineTuner) -> set[str]:
    """The backbone's trainable parameters, by their names in the network timm or torchvision made."""
    return {n.removeprefix("body.") for n, p in model.backbone.named_parameters() if p.requires_grad}


def _resnet(train_blocks: str) -> FineTuner:
    return FineTuner(create("ce"), backbone="resnet18", optim=OptimSettings(train_blocks=train_blocks))


def test_resnet18_blocks() -> None:
    every = {n.removeprefix("body.") for n, _ in FineTuner(backbone="resnet18").backbone.named_parameters()}
    assert _trainable(_resnet("layer2")) == {n for n in every if n.startswith("layer2.")}
    assert _trainable(_resnet("stem")) == {"conv1.weight", "bn1.weight", "bn1.bias"}  # the paper's input level
    assert _trainable(_resnet("layer3-4")) == {n for n in every if n.startswith(("layer3.", "layer4."))}
    assert _trainable(_resnet("stem, layer1")) == {n for n in every if not n.startswith(("layer2", "layer3", "layer4"))}


def test_a_tiny_vit_blocks() -> None:
    model = FineTuner(backbone="vit_tiny_patch16_224", backbone_args=VIT, optim=OptimSettings(train_blocks="stem"))
    assert _trainable(model) == {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"}
    two_blocks = OptimSettings(train_blocks="blocks.1-2")
    model = FineTuner(backbone="vit_tiny_patch16_224", backbone_args=VIT, optim=two_blocks)
    assert {n.split(".")[1] for n in _trainable(model)} == {"1", "2"}
    assert all(n.startswith(("blocks.1.", "blocks.2.")) for n in _trainable(model))
    assert list(backbone_blocks(model.backbone)) == ["stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "final"]
    model = FineTuner(backbone="vit_tiny_patch16_224", backbone_args=VIT, optim=OptimSettings(train_blocks="final"))
    assert _trainable(model) == {"norm.weight", "norm.bias"}  # the last LayerNorm, after the blocks


def test_parse_blocks() -> None:
    assert parse_blocks("layer1") == ["layer1"]
    assert parse_blocks("stem,blocks.0-2") == ["stem", "blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(ValueError, match="runs backwards: write layer1-3"):
        parse_blocks("layer3-1")


def test_only_the_chosen_block_and_the_heads_train(image_tree: Path, tmp_path: Path) -> None:
    """A fit of small_cnn with layer2: the other blocks' parameters are bit-identical afterwards, layer2's and every
    head's moved (the heads always train). BatchNorm running statistics of frozen blocks follow the data, as in the
    authors' code (the network stays in training mode)."""
    L.seed_everything(0)
    model = FineTuner(create("core"), backbone="small_cnn", optim=OptimSettings(train_blocks="layer2"))
    start = {k: v.clone() for k, v in model.backbone.named_parameters()}
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=8, seed=0)
    make_trainer(tmp_path, progress=False, max_epochs=1, enable_model_summary=False).fit(model, datamodule=data)
    moved = {k for k, v in model.backbone.named_parameters() if not torch.equal(v, start[k])}
    assert moved == {k for k in start if k.startswith("body.layer2.")}
    assert all(p.requires_grad for p in model.objective.parameters())


def test_a_bad_block_name_is_one_line_listing_the_valid_ones(image_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        _resnet("layer5")
    assert str(info.value) == (
        "invalid model settings: optim.train_blocks names 'layer5', not a block of backbone resnet18: choose among "
        "stem, layer1, layer2, layer3, layer4 (comma-separated; a range such as layer1-2)"
    )
    message = error(["fit", f"--data.root={image_tree}", f"--run_dir={tmp_path / 'run'}", *TINY_FIT,
                     "--model.optim.train_blocks=blocks.0"])  # fmt: skip
    assert "names 'blocks.0', not a block of backbone small_cnn: choose among layer1, layer2, layer3, layer4" in message
    assert not (tmp_path / "run").exists()


def test_a_frozen_backbone_trains_no_block() -> None:
    with pytest.raises(ValueError, match=r"freeze_backbone true trains no backbone block: drop optim\.train_blocks"):
        FineTuner(backbone="small_cnn", freeze_backbone=True, optim=OptimSettings(train_blocks="layer1"))
    with pytest.raises(ValueError, match=r"optim\.train_blocks is empty"):
        FineTuner(backbone="small_cnn", optim=OptimSettings(train_blocks=" "))
