"""LoRA through ``coretune fit`` (issue 64): a tiny timm ViT fine-tuned with ``--model.optim.lora.rank`` from a
pre-trained file keeps that file's weights, its checkpoint tests, resumes and exports merged (a plain timm ViT).

The fits are the reason these tests take seconds: a ViT of 2 blocks on 32 px images, 1 epoch of 2 batches."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coretune.apps.export import load_exported
from coretune.cli import main
from coretune.engine import FineTuner, read_metrics
from coretune.models import create_backbone
from fit_flags import QUIET, error

TINY_VIT = {"img_size": 32, "patch_size": 8, "depth": 2}


def lora_fit(tree: Path, run_dir: Path, weights: Path, *extra: str) -> list[str]:
    return [
        "fit", f"--data.root={tree}", "--data.image_size=32", "--data.batch_size=6", "--data.num_workers=0",
        "--model.backbone=vit_tiny_patch16_224", f"--model.backbone_args={json.dumps(TINY_VIT)}",
        f"--model.weights={weights}", "--model.optim.lora.rank=4", "--model.optim.lr=0.1",
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        f"--run_dir={run_dir}", *QUIET, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("lora") / "data", per_class=4, val_per_class=2, size=32)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 'pre-trained' tiny ViT (random, seeded) as a timm state dict file."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lora_weights") / "vit.pth"
    torch.save(create_backbone("vit_tiny_patch16_224", verbose=False, **TINY_VIT).body.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def run(tree: Path, pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 1-epoch LoRA fit with CE-tuning."""
    run = tmp_path_factory.mktemp("lora_runs") / "ce"
    main(lora_fit(tree, run, pretrained))
    return run


def backbone_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    return {k.removeprefix("backbone.body."): v for k, v in state.items() if k.startswith("backbone.body.")}


def check_pretrained_kept(state: dict[str, torch.Tensor], pretrained: Path) -> None:
    """Every pre-trained tensor is in ``state`` (a LoRA layer's as its ``base_layer``), unchanged; LoRA's ``B``
    has moved from zero."""
    original = torch.load(pretrained, weights_only=True)
    for key, value in original.items():
        at = key.replace(".qkv.", ".qkv.base_layer.")
        assert torch.equal(state[at], value), key
    lora = {k for k in state if "lora_" in k}
    assert len(lora) == 4 and set(state) == {k.replace(".qkv.", ".qkv.base_layer.") for k in original} | lora
    assert all(state[k].abs().max() > 0 for k in lora if "lora_B" in k)


def test_a_lora_fit_trains_lora_only_and_keeps_the_pretrained_weights(run: Path, pretrained: Path) -> None:
    config = (run / "config.yaml").read_text()
    assert "lora:\n      rank: 4\n      alpha: 16.0\n      dropout: 0.1\n      targets: qkv" in config
    check_pretrained_kept(backbone_state(run / "checkpoints" / "last.ckpt"), pretrained)
    optimizer = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]
    assert sum(len(group["params"]) for group in optimizer["param_groups"]) == 4 + 2  # LoRA A, B x 2; classifier


def test_coretune_test_reads_a_lora_checkpoint(run: Path, tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "test.json"
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={tree}", f"--output={out}"])
    assert 0.0 <= json.loads(out.read_text())["test"]["top1"] <= 1.0


def test_export_merges_lora_into_a_plain_vit_with_the_same_logits(run: Path, tmp_path: Path) -> None:
    checkpoint = run / "checkpoints" / "last.ckpt"
    main(["export", f"--ckpt_path={checkpoint}", f"--output={tmp_path / 'export'}", "--format=safetensors"])
    weights = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert not [k for k in weights if "lora_" in k or "base_layer" in k]
    plain = create_backbone("vit_tiny_patch16_224", verbose=False, **TINY_VIT).body.state_dict()
    assert {k.removeprefix("backbone.body.") for k in weights if k.startswith("backbone.body.")} == set(plain)
    net, _ = load_exported(tmp_path / "export")  # a strict load into the plain timm ViT
    model = FineTuner.from_checkpoint(checkpoint).eval()  # LoRA unmerged
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(net(images), model(images), atol=1e-5, rtol=0)
        state = backbone_state(checkpoint)
        assert not torch.equal(
            weights["backbone.body.blocks.0.attn.qkv.weight"], state["blocks.0.attn.qkv.base_layer.weight"]
        )


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # the run's copy: its checkpoints moved
def test_a_lora_run_resumes_extended_and_refuses_another_rank(run: Path, pretrained: Path, tmp_path: Path) -> None:
    resumed = Path(shutil.copytree(run, tmp_path / "resumed"))
    config = (resumed / "config.yaml").read_text().replace(str(run), str(resumed))
    (resumed / "config.yaml").write_text(config)
    refused = error(["fit", f"--config={resumed / 'config.yaml'}", "--model.optim.lora.rank=8"])
    assert "model.optim.lora.rank 4 → 8" in refused, refused
    main(["fit", f"--config={resumed / 'config.yaml'}", "--trainer.max_epochs=2", *QUIET])
    assert [row["epoch"] for row in read_metrics(resumed / "metrics.csv")] == ["0", "1"]
    before, after = (
        backbone_state(run / "checkpoints" / "last.ckpt"),
        backbone_state(resumed / "checkpoints" / "last.ckpt"),
    )
    check_pretrained_kept(after, pretrained)
    assert not torch.equal(
        before["blocks.0.attn.qkv.lora_B.default.weight"], after["blocks.0.attn.qkv.lora_B.default.weight"]
    )


def test_core_tuning_with_lora_fits(tree: Path, pretrained: Path, tmp_path: Path) -> None:
    main(lora_fit(tree, tmp_path / "core", pretrained, "--objective=core"))
    rows = read_metrics(tmp_path / "core" / "metrics.csv")
    assert len(rows) == 1 and float(rows[0]["train/loss"]) > 0
    check_pretrained_kept(backbone_state(tmp_path / "core" / "checkpoints" / "last.ckpt"), pretrained)


def test_a_lora_fit_without_peft_is_one_line_before_any_work(
    tree: Path, pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import raises ImportError, as when it is not installed
    message = error(lora_fit(tree, tmp_path / "run", pretrained))
    assert message == "LoRA (--model.optim.lora.rank) needs peft, which is not installed: pip install 'coretune[peft]'"
    assert not (tmp_path / "run").exists()
