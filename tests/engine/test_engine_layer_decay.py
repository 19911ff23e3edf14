"""Layer-wise learning-rate decay (``--model.optim.layer_decay``) on timm's ``param_groups_layer_decay``, checked
against MAE's formula (``util/lr_decay.py`` of facebookresearch/mae, after BEiT), written here as a slow loop."""

from pathlib import Path

import pytest
import torch

from coretune.engine import FineTuner
from coretune.engine.optim import OptimSettings
from coretune.objectives import create
from fit_flags import QUIET, error

VIT = {"img_size": 32, "patch_size": 8, "depth": 3}
"""A ViT-Tiny cut to 3 blocks on 32 px images of 8 px patches: 17 tokens."""


def mae_layer_id(name: str, num_layers: int) -> int:
    """MAE's ``get_layer_id_for_vit``: the class token, position embedding and patch embedding are layer 0, block
    ``i`` is layer ``i + 1``, anything else (the final norm, the heads) layer ``num_layers`` = blocks + 1."""
    if name in ("cls_token", "pos_embed") or name.startswith("patch_embed"):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers


def test_layer_decay_groups_follow_maes_formula() -> None:
    """Each backbone tensor trains at backbone_lr × decay ** (num_layers − layer_id) (MAE: num_layers = blocks + 1),
    without weight decay when 1-D or in the model's no_weight_decay (pos_embed, cls_token); the heads at lr × 1.0,
    their biases without weight decay; every trainable tensor in exactly one group."""
    decay, lr, backbone_lr, wd = 0.75, 1e-3, 5e-4, 0.05
    optim = OptimSettings(optimizer="adamw", lr=lr, backbone_lr=backbone_lr, weight_decay=wd, layer_decay=decay)
    model = FineTuner(create("core"), backbone="vit_tiny_patch16_224", backbone_args=VIT, optim=optim)
    model.build(4)
    groups = model.optimizer_groups()
    rate = {id(p): g["lr"] for g in groups for p in g["params"]}
    weight_decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert sum(len(g["params"]) for g in groups) == len(rate)  # no tensor twice
    num_layers = len(model.backbone.body.blocks) + 1
    no_decay = {"pos_embed", "cls_token", "dist_token"}
    for name, p in model.backbone.body.named_parameters():
        expected = backbone_lr * decay ** (num_layers - mae_layer_id(name, num_layers))
        assert rate[id(p)] == pytest.approx(expected), name
        assert weight_decay[id(p)] == (0.0 if p.ndim == 1 or name in no_decay else wd), name
    assert rate[id(model.backbone.body.patch_embed.proj.weight)] == pytest.approx(backbone_lr * decay**4)
    for name, p in model.objective.named_parameters():  # classifier and Core-tuning's projection head
        assert rate[id(p)] == lr and weight_decay[id(p)] == (0.0 if p.ndim == 1 else wd), name
    assert groups[-1]["lr"] == lr  # the lr metrics.csv logs is the heads'


def test_without_layer_decay_the_groups_are_as_before() -> None:
    model = FineTuner(create("ce"), backbone="small_cnn", optim=OptimSettings(backbone_lr=0.001))
    model.build(3)
    groups = model.optimizer_groups()
    assert [(g["lr"], len(g["params"]), "weight_decay" in g) for g in groups] == [
        (0.001, len(list(model.backbone.parameters())), False),
        (0.01, 2, False),
    ]


@pytest.mark.parametrize("backbone", ["resnet18", "resnet10t"])
def test_resnets_decay_by_timms_resnet_grouping(backbone: str) -> None:
    """A torchvision ResNet (through timm's ResNet matcher: the same names) and a timm ResNet: the stem at
    decay ** (L − 1), block j of stage s at decay ** (L − 1 − its index), the last block at decay ** 1."""
    model = FineTuner(create("ce"), backbone=backbone, optim=OptimSettings(layer_decay=0.5))
    model.build(3)
    rate = {id(p): g["lr"] for g in model.optimizer_groups() for p in g["params"]}
    body = model.backbone.body
    blocks = [
        f"{stage}.{i}" for stage in ("layer1", "layer2", "layer3", "layer4") for i in range(len(getattr(body, stage)))
    ]
    layers = len(blocks) + 1  # the stem, then each block; nothing above the last block
    stem = body.conv1[0].weight if isinstance(body.conv1, torch.nn.Sequential) else body.conv1.weight
    assert rate[id(stem)] == pytest.approx(0.01 * 0.5 ** (layers - 1))
    for index, block in enumerate(blocks, start=1):
        for p in body.get_submodule(block).parameters():
            assert rate[id(p)] == pytest.approx(0.01 * 0.5 ** (layers - 1 - index)), block


def test_layer_decay_is_refused_for_a_backbone_timm_cannot_group_and_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"optim.layer_decay needs a backbone whose layers timm can group .*'small_cnn'"
    ):
        FineTuner(create("ce"), backbone="small_cnn", optim=OptimSettings(layer_decay=0.75))
    message = error(
        ["fit", "--model.backbone=small_cnn", "--model.optim.layer_decay=1.5", f"--run_dir={tmp_path}", *QUIET]
    )
    assert "layer_decay must lie in (0, 1] (got 1.5" in message


def test_the_schedule_multiplies_every_groups_rate(tmp_path: Path) -> None:
    """A 1-epoch fit with warm-up and layer decay: after each step every group's lr is its base × the schedule's
    factor, so the ratios between layers stay decay ** k (LambdaLR keeps a base lr per group)."""
    import lightning as L

    from coretune.data import ImageClassificationData
    from coretune.engine import make_trainer
    from image_trees import make_image_tree

    seen: list[list[float]] = []

    class Lrs(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
            seen.append([g["lr"] for g in optimizer.param_groups])

    data = ImageClassificationData(root=str(make_image_tree(tmp_path / "data")), image_size=32, batch_size=4)
    optim = OptimSettings(optimizer="adamw", lr=1e-3, layer_decay=0.5, warmup_epochs=1.0)
    model = FineTuner(create("ce"), backbone="vit_tiny_patch16_224", backbone_args={**VIT, "depth": 1}, optim=optim)
    trainer = make_trainer(
        tmp_path / "run", progress=False, max_epochs=2, enable_model_summary=False, limit_train_batches=2,
        callbacks=[Lrs()], limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    base = seen[2]  # the first step after the warm-up: factor 1
    assert sorted({round(lr / base[-1], 6) for lr in base}) == [0.25, 0.5, 1.0]  # stem, block 0, norm and heads
    for step, lrs in enumerate(seen):
        factors = [lr / b for lr, b in zip(lrs, base, strict=True)]
        assert factors == pytest.approx([factors[0]] * len(factors)), step
    assert seen[0][-1] == pytest.approx(1e-3 * 0.5)  # warm-up step 1 of 2
