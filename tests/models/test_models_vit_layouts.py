"""ViT checkpoints of DINO, MoCo v3, MAE and DINOv2 into timm ViTs: each file is crafted from a tiny timm ViT with the
keys named as the official repositories save them (facebookresearch/dino main_dino.py and hubconf.py, moco-v3
main_moco.py and moco/builder.py, mae main_pretrain.py and models_mae.py, dinov2 hub/backbones.py, train/train.py and
models/vision_transformer.py); the position embedding is resized to the model's grid and reported; a patch-size
mismatch, MoCo v3's 12-head ViT-S in a 6-head model and an ambiguous file are one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from coretune.models import CheckpointError, Encoder, create_backbone, load_pretrained

State = dict[str, Tensor]


def randomised(encoder: Encoder, seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.rand(v.shape, generator=g) + 0.5 for k, v in encoder.body.state_dict().items()}


def prefixed(prefix: str, state: State) -> State:
    return {prefix + k: v for k, v in state.items()}


def some(*keys: str, width: int = 8) -> State:
    return {k: torch.randn(width, 4) for k in keys}


def save(obj: Any, path: Path) -> Path:
    torch.save(obj, path)
    return path


def vit(name: str = "vit_tiny_patch16_224", **options: Any) -> Encoder:
    """A one-block timm ViT (fast): ``img_size`` and other options as given."""
    return create_backbone(name, depth=1, **options)


def assert_loaded(encoder: Encoder, saved: State, skip: tuple[str, ...] = ()) -> None:
    state = encoder.body.state_dict()
    for key, value in saved.items():
        if key not in skip:
            assert torch.equal(state[key], value), key


def resized(pos_embed: Tensor, old: int, new: int, prefix: int = 1) -> Tensor:
    """A slow reference: the patch part of ``pos_embed`` interpolated bicubically (antialiased, as timm does), the
    prefix tokens' embeddings kept."""
    dim = pos_embed.shape[-1]
    grid = pos_embed[:, prefix:].reshape(1, old, old, dim).permute(0, 3, 1, 2)
    small = F.interpolate(grid, size=(new, new), mode="bicubic", antialias=True, align_corners=False)
    return torch.cat([pos_embed[:, :prefix], small.permute(0, 2, 3, 1).reshape(1, new * new, dim)], dim=1)


# ------------------------------------------------------------------------------------------------------------
# DINO
# ------------------------------------------------------------------------------------------------------------
def dino_training_checkpoint(teacher: State, student: State) -> dict[str, Any]:
    """main_dino.py's checkpoint.pth: the teacher (no DDP for a ViT: 'backbone.') and the DDP student, each a
    MultiCropWrapper of the ViT and its DINOHead (mlp, weight-normed last_layer)."""
    head = ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "last_layer.weight_g", "last_layer.weight_v")
    return {
        "student": {**prefixed("module.backbone.", student), **some(*(f"module.head.{k}" for k in head))},
        "teacher": {**prefixed("backbone.", teacher), **some(*(f"head.{k}" for k in head))},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.0005, "params": []}]},
        "epoch": 100,
        "args": argparse.Namespace(arch="vit_tiny", patch_size=16, out_dim=65536),
        "dino_loss": {"center": torch.randn(1, 16)},
    }


def test_a_dino_vit_training_checkpoint_loads_its_teacher(tmp_path: Path) -> None:
    encoder = vit(img_size=224)
    teacher, student = randomised(encoder, 1), randomised(encoder, 2)
    path = save(dino_training_checkpoint(teacher, student), tmp_path / "checkpoint.pth")

    report = load_pretrained(encoder, path)

    assert report.layout == "dino" and report.entry == "teacher['backbone.*']"
    assert sorted(report.loaded) == sorted(teacher) and report.missing == report.unexpected == []
    assert report.dropped == [f"head.{k}" for k in ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                                                    "last_layer.weight_g", "last_layer.weight_v")]  # fmt: skip
    assert_loaded(encoder, teacher)  # the teacher, not the student


def test_the_released_dino_vit_file_is_a_timm_state_dict(tmp_path: Path) -> None:
    # dino_deitsmall16_pretrain.pth is the bare ViT (hubconf.py loads it strictly into num_classes=0): timm's names,
    # read alike by the 'timm' and 'dino' layouts (the same tensors, so no ambiguity): the first in order names it
    encoder = vit(img_size=224)
    saved = randomised(encoder, 1)
    path = save(saved, tmp_path / "dino_deitsmall16_pretrain.pth")
    report = load_pretrained(encoder, path)
    assert report.layout == "timm" and len(report.loaded) == report.total and report.dropped == []
    assert load_pretrained(vit(img_size=224), path, "dino").layout == "dino"
    assert_loaded(encoder, saved)


def test_a_dino_vit_at_32_px_gets_its_position_embedding_resized_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = randomised(vit(img_size=224), 1)  # pre-trained at 224 px: 14×14 patches
    path = save(dino_training_checkpoint(teacher, randomised(vit(img_size=224), 2)), tmp_path / "checkpoint.pth")

    encoder = create_backbone("vit_tiny_patch16_224", weights=path, depth=1, img_size=32)  # the Python API

    assert "pos_embed resized 14×14 → 2×2 for img_size 32" in capsys.readouterr().err
    torch.testing.assert_close(encoder.body.pos_embed.detach(), resized(teacher["pos_embed"], 14, 2))
    assert_loaded(encoder, teacher, skip=("pos_embed",))
    assert encoder(torch.randn(2, 3, 32, 32)).shape == (2, 192)


def test_the_fine_tuner_loads_a_dino_vit_as_model_weights_does(tmp_path: Path) -> None:
    from coretune.engine import FineTuner

    teacher = randomised(vit(img_size=224), 1)
    path = save(dino_training_checkpoint(teacher, randomised(vit(img_size=224), 2)), tmp_path / "checkpoint.pth")
    model = FineTuner(backbone="vit_tiny_patch16_224", weights=str(path), backbone_args={"depth": 1})
    assert_loaded(model.backbone, teacher)  # dynamic_img_size (the default): pos_embed kept, resized per forward


def test_a_patch_size_mismatch_is_refused_in_one_line(tmp_path: Path) -> None:
    # DINO's ViT-S/8 (dino_deitsmall8_pretrain.pth) into a /16 model: not resampled (timm's resample_patch_embed
    # would change what the weights compute); the message names the fix
    eight = randomised(vit(patch_size=8, img_size=32), 1)
    path = save(eight, tmp_path / "dino_deitsmall8_pretrain.pth")
    with pytest.raises(CheckpointError) as info:
        load_pretrained(vit(img_size=32), path)
    message = str(info.value)
    assert "\n" not in message and "has 8×8 patches but backbone 'vit_tiny_patch16_224' 16×16" in message
    assert "--model.backbone_args '{patch_size: 8}'" in message
    assert load_pretrained(vit(img_size=32, patch_size=8), path).loaded  # the fix works


# ------------------------------------------------------------------------------------------------------------
# MoCo v3
# ------------------------------------------------------------------------------------------------------------
def moco_v3_checkpoint(base: State, momentum: State, arch: str = "vit_small") -> dict[str, Any]:
    """main_moco.py's checkpoint of MoCo_ViT under DDP: base_encoder (a timm VisionTransformer whose head is the
    3-layer projector MLP with BatchNorm1d), momentum_encoder, predictor."""
    projector = ("0.weight", "1.weight", "1.bias", "1.running_mean", "1.running_var", "3.weight", "4.weight",
                 "4.bias", "6.weight", "7.running_mean")  # fmt: skip
    return {
        "epoch": 300,
        "arch": arch,
        "state_dict": {
            **prefixed("module.base_encoder.", base),
            **some(*(f"module.base_encoder.head.{k}" for k in projector)),
            **prefixed("module.momentum_encoder.", momentum),
            **some(*(f"module.momentum_encoder.head.{k}" for k in projector)),
            **some("module.predictor.0.weight", "module.predictor.1.weight", "module.predictor.3.weight"),
        },
        "optimizer": {"state": {}, "param_groups": []},
        "scaler": {"scale": 65536.0},
    }


def test_a_moco_v3_vit_small_needs_its_12_heads(tmp_path: Path) -> None:
    source = vit("vit_small_patch16_224", img_size=32, num_heads=12)
    base, momentum = randomised(source, 1), randomised(source, 2)
    path = save(moco_v3_checkpoint(base, momentum), tmp_path / "vit-s-300ep.pth.tar")
    with pytest.raises(CheckpointError) as info:  # timm's ViT-S has 6 heads: same shapes, another attention
        load_pretrained(vit("vit_small_patch16_224", img_size=32), path)
    assert "\n" not in str(info.value)
    assert "MoCo v3 checkpoint's vit_small has 12 attention heads but backbone 'vit_small_patch16_224' has 6" in str(
        info.value
    ) and "--model.backbone_args '{num_heads: 12}'" in str(info.value)

    encoder = vit("vit_small_patch16_224", img_size=32, num_heads=12)
    report = load_pretrained(encoder, path)
    assert report.layout == "moco_v3" and report.entry == "state_dict['module.base_encoder.*']"
    assert sorted(report.loaded) == sorted(base) and report.missing == report.unexpected == []
    assert len(report.dropped) == 10 + len(momentum) + 10 + 3
    assert_loaded(encoder, base)


def test_moco_v3_converted_to_deit_format_loads_as_timm(tmp_path: Path) -> None:
    # convert_to_deit.py: {'model': base_encoder without module.base_encoder. and without its head}
    encoder = vit(img_size=32)
    saved = randomised(encoder, 1)
    report = load_pretrained(encoder, save({"model": saved}, tmp_path / "linear-vit-s.pth.tar"))
    assert report.layout == "timm" and len(report.loaded) == report.total
    assert_loaded(encoder, saved)


# ------------------------------------------------------------------------------------------------------------
# MAE
# ------------------------------------------------------------------------------------------------------------
def mae_checkpoint(encoder_state: State) -> dict[str, Any]:
    """main_pretrain.py's checkpoint of MaskedAutoencoderViT: the encoder (timm's names), the decoder and the
    mask token (1, 1, decoder width)."""
    decoder = {
        "mask_token": torch.randn(1, 1, 16),
        "decoder_pos_embed": torch.randn(1, 5, 16),
        **some("decoder_embed.weight", "decoder_embed.bias", "decoder_blocks.0.norm1.weight"),
        **some("decoder_blocks.0.attn.qkv.weight", "decoder_norm.weight", "decoder_pred.weight"),
    }
    return {"model": {**encoder_state, **decoder}, "optimizer": {}, "epoch": 799, "scaler": {}, "args": None}


def test_mae_with_token_pooling_loads_the_encoder_and_its_norm(tmp_path: Path) -> None:
    encoder = vit(img_size=32)  # timm's default: the CLS token after norm (MAE's --cls_token, its linear probe)
    saved = randomised(encoder, 1)
    report = load_pretrained(encoder, save(mae_checkpoint(saved), tmp_path / "checkpoint-799.pth"))
    assert report.layout == "mae" and report.entry == "model"
    assert sorted(report.loaded) == sorted(saved) and report.missing == report.unexpected == []
    assert len(report.dropped) == 8 and "mask_token" in report.dropped
    assert_loaded(encoder, saved)


def test_mae_with_global_pooling_drops_norm_and_starts_fc_norm_fresh(tmp_path: Path) -> None:
    # MAE's fine-tuning default (main_finetune.py --global_pool): mean of the patch tokens, a new fc_norm; the
    # pre-trained norm is not used (its load_state_dict(strict=False) leaves fc_norm missing, norm unexpected)
    saved = randomised(vit(img_size=32), 1)  # the pre-trained encoder has norm
    encoder = vit(img_size=32, global_pool="avg")
    report = load_pretrained(encoder, save(mae_checkpoint(saved), tmp_path / "mae_pretrain_vit_base.pth"))
    assert report.layout == "mae"
    assert report.missing == ["fc_norm.weight", "fc_norm.bias"] and report.unexpected == []
    assert {"norm.weight", "norm.bias"} <= set(report.dropped)
    assert "norm dropped and fc_norm left at its initial values" in report.summary()
    assert torch.equal(encoder.body.fc_norm.weight, torch.ones(192)) and not encoder.body.fc_norm.bias.any()
    assert_loaded(encoder, {k: v for k, v in saved.items() if not k.startswith("norm.")})


# ------------------------------------------------------------------------------------------------------------
# DINOv2
# ------------------------------------------------------------------------------------------------------------
def dinov2(name: str = "vit_small_patch14_dinov2", depth: int = 1, **options: Any) -> Encoder:
    """A DINOv2 ViT of ``depth`` blocks 64 wide (fast)."""
    return create_backbone(name, depth=depth, embed_dim=64, num_heads=2, **options)


def test_a_dinov2_hub_state_dict_loads_with_layer_scale(tmp_path: Path) -> None:
    # dinov2_vits14's *_pretrain.pth: DinoVisionTransformer(block_chunks=0) with LayerScale ls1/ls2.gamma, mask_token
    encoder = dinov2(img_size=28)
    saved = randomised(encoder, 1)
    assert "blocks.0.ls1.gamma" in saved
    path = save({**saved, "mask_token": torch.randn(1, 64)}, tmp_path / "dinov2_vits14_pretrain.pth")
    report = load_pretrained(encoder, path)
    assert report.layout == "dinov2" and report.dropped == ["mask_token"]
    assert len(report.loaded) == report.total and report.missing == report.unexpected == report.resampled == []
    assert_loaded(encoder, saved)


def test_dinov2_giants_swiglu_is_renamed_by_timms_filter(tmp_path: Path) -> None:
    # dinov2_vitg14: ffn_layer 'swiglufused' saves mlp.w12 / mlp.w3, timm's SwiGLUPacked names them fc1 / fc2
    encoder = dinov2("vit_giant_patch14_dinov2", img_size=28, mlp_ratio=4)  # SwiGLU halves an even width
    saved = randomised(encoder, 1)
    renamed = {k.replace("mlp.fc1.", "mlp.w12.").replace("mlp.fc2.", "mlp.w3."): v for k, v in saved.items()}
    assert "blocks.0.mlp.w12.weight" in renamed
    report = load_pretrained(encoder, save({**renamed, "mask_token": torch.randn(1, 64)}, tmp_path / "vitg14.pth"))
    assert report.layout == "dinov2" and len(report.loaded) == report.total and report.unexpected == []
    assert_loaded(encoder, saved)


def test_dinov2_registers_become_timms_reg_token_as_timms_filter_maps_them(tmp_path: Path) -> None:
    # dinov2_vits14_reg: register_tokens, and pos_embed covering the class token; timm's reg4 model embeds neither
    source = dinov2(img_size=28)
    saved = randomised(source, 1)
    registers = torch.randn(1, 4, 64)
    path = save({**saved, "register_tokens": registers, "mask_token": torch.randn(1, 64)}, tmp_path / "reg.pth")
    with pytest.raises(CheckpointError, match=r"has 4 register tokens but backbone 'vit_small_patch14_dinov2' none"):
        load_pretrained(dinov2(img_size=28), path)

    encoder = dinov2("vit_small_patch14_reg4_dinov2", img_size=28)
    with pytest.raises(CheckpointError, match=r"no register tokens but backbone .* has 4: pick .* without"):
        load_pretrained(encoder, save({**saved, "mask_token": torch.randn(1, 64)}, tmp_path / "no_reg.pth"))
    report = load_pretrained(encoder, path)

    body = encoder.body
    assert report.layout == "dinov2" and len(report.loaded) == report.total and report.unexpected == []
    assert torch.equal(body.reg_token, registers)
    assert torch.equal(body.cls_token, saved["cls_token"] + saved["pos_embed"][:, 0])
    assert torch.equal(body.pos_embed, saved["pos_embed"][:, 1:])
    assert_loaded(encoder, saved, skip=("cls_token", "pos_embed"))


def test_a_dinov2_teacher_checkpoint_with_block_chunks_and_another_grid(tmp_path: Path) -> None:
    # train.py's eval/N/teacher_checkpoint.pth: {'teacher': backbone (block_chunks=2: blocks.<chunk>.<block>) and
    # the heads}, at 56 px (4×4 patches of 14) into a model for 28 px (2×2): resized by timm's filter, reported
    saved = randomised(dinov2(depth=2, img_size=56), 1)
    chunked = {k.replace("blocks.1.", "blocks.1.1.").replace("blocks.0.", "blocks.0.0."): v for k, v in saved.items()}
    teacher = {**prefixed("backbone.", {**chunked, "mask_token": torch.randn(1, 64)}),
               **some("dino_head.mlp.0.weight", "ibot_head.mlp.0.weight")}  # fmt: skip
    path = save({"teacher": teacher}, tmp_path / "teacher_checkpoint.pth")
    encoder = dinov2(depth=2, img_size=28)

    report = load_pretrained(encoder, path)

    assert report.layout == "dinov2" and report.entry == "teacher['backbone.*']"
    assert report.resampled == ["pos_embed resized 4×4 → 2×2 for img_size 28"]
    assert "pos_embed resized 4×4 → 2×2 for img_size 28" in report.summary()
    assert sorted(report.dropped) == ["backbone.mask_token", "dino_head.mlp.0.weight", "ibot_head.mlp.0.weight"]
    torch.testing.assert_close(encoder.body.pos_embed.detach(), resized(saved["pos_embed"], 4, 2))
    assert_loaded(encoder, saved, skip=("pos_embed",))


def test_a_dinov2_checkpoint_of_another_patch_size_is_refused_before_timm_resamples_it(tmp_path: Path) -> None:
    sixteen = randomised(dinov2(img_size=32, patch_size=16), 1)
    path = save({**sixteen, "mask_token": torch.randn(1, 64)}, tmp_path / "dinov2_p16.pth")
    with pytest.raises(CheckpointError, match=r"DINOv2 checkpoint has 16×16 patches but backbone .* 14×14"):
        load_pretrained(dinov2(img_size=28), path)


# ------------------------------------------------------------------------------------------------------------
# detection
# ------------------------------------------------------------------------------------------------------------
def test_a_file_two_layouts_read_differently_is_ambiguous(tmp_path: Path) -> None:
    # a MoCo v3 state_dict and a DeiT-format 'model' of other weights: each layout matches every tensor
    encoder = vit(img_size=32)
    first, second = randomised(encoder, 1), randomised(encoder, 2)
    raw = {"state_dict": prefixed("module.base_encoder.", first), "model": second}
    path = save(raw, tmp_path / "both.pth")
    with pytest.raises(CheckpointError) as info:
        load_pretrained(encoder, path)
    message = str(info.value)
    assert "\n" not in message and "is ambiguous: layouts 'moco_v3'" in message and "'mae' (model)" in message
    assert "force one with --model.weights_options.format (moco_v3 or mae)" in message
    assert load_pretrained(encoder, path, "mae").layout == "mae"
    assert_loaded(encoder, second)


def test_model_weights_with_a_wrong_head_count_stops_fit_in_one_line(tmp_path: Path, image_tree: Path) -> None:
    from fit_flags import error

    source = vit("vit_small_patch16_224", img_size=32, num_heads=12)
    path = save(moco_v3_checkpoint(randomised(source, 1), randomised(source, 2)), tmp_path / "vit-s-300ep.pth.tar")
    vit_small = ["--model.backbone=vit_small_patch16_224", "--model.backbone_args={depth: 1}", "--data.image_size=32"]
    run = tmp_path / "run"
    message = error(["fit", f"--data.root={image_tree}", *vit_small, f"--model.weights={path}", f"--run_dir={run}"])
    assert "MoCo v3 checkpoint's vit_small has 12 attention heads" in message and "{num_heads: 12}" in message
    assert not (run / "checkpoints").exists()
