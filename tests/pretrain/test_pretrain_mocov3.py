"""MoCo v3 pre-training: the loss against the paper's Algorithm 1 written as loops, the momentum encoder and its cosine
schedule, the MLPs and the ViT stability tricks of facebookresearch/moco-v3, and a ViT-Tiny run whose export (the
official layout) ``coretune fit`` loads in full."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from coretune.cli import main
from coretune.models import create_backbone, load_pretrained
from coretune.pretrain import PRETRAINED_FILENAME, MoCoV3, moco_v3_infonce
from coretune.pretrain.cli import translate_args
from coretune.pretrain.mocov3 import momentum_at, sincos_2d_position_embedding
from fit_flags import QUIET
from image_trees import make_image_folder, make_image_tree

VIT_32PX = {"img_size": 32, "patch_size": 4}  # ViT-Tiny on CIFAR's 32-px images: an 8×8 grid of 4-px patches


def ctr_loop(q: torch.Tensor, k: torch.Tensor, tau: float, offset: int = 0) -> torch.Tensor:
    """Algorithm 1's ``ctr(q, k)``, one query and one key at a time: ``2τ`` × the mean over queries ``i`` of
    ``−log(exp(q_i·k_{i+offset}/τ) / Σ_j exp(q_i·k_j/τ))``, with ``q``, ``k`` L2-normalised (the paper's note)."""
    losses = []
    for i in range(q.shape[0]):
        qi = q[i] / q[i].norm()
        terms = [torch.exp(qi @ (k[j] / k[j].norm()) / tau) for j in range(k.shape[0])]
        losses.append(-torch.log(terms[i + offset] / sum(terms)))
    return 2 * tau * sum(losses) / len(losses)


@pytest.mark.parametrize(("n", "m", "offset"), [(6, 6, 0), (3, 9, 3)])  # (3, 9, 3): process 1 of 3's queries
def test_the_loss_is_algorithm_1s_ctr_in_value_and_gradient(n: int, m: int, offset: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(n, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(m, 8, dtype=torch.float64, requires_grad=True)
    loss = moco_v3_infonce(q.float(), k.float(), 0.2, offset)
    (grad,) = torch.autograd.grad(loss, q)
    q_ref = q.detach().clone().requires_grad_(True)
    reference = ctr_loop(q_ref, k.detach(), 0.2, offset)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(grad.double(), q_ref.grad, rtol=1e-4, atol=1e-6)
    assert moco_v3_infonce(q, k, 0.2, offset).grad_fn is not None and k.grad is None  # keys: stop-gradient
    with pytest.raises(ValueError, match=f"offset 7 puts the positives of {n} queries outside the {m} keys"):
        moco_v3_infonce(q, k, 0.2, 7)


def test_the_loss_is_2tau_times_the_cross_entropy_as_the_official_code() -> None:
    # at τ = 1 the 2τ factor is 2: the cross-entropy of the cosine logits, doubled
    q, k = torch.randn(5, 4), torch.randn(5, 4)
    ce = F.cross_entropy(F.normalize(q) @ F.normalize(k).T, torch.arange(5))
    assert moco_v3_infonce(q, k, 1.0).item() == pytest.approx(2 * ce.item(), rel=1e-6)


def test_momentum_rises_from_m_to_1_along_a_half_cosine() -> None:
    # main_moco.py's adjust_moco_momentum at epoch e of E: 1 − ½(1 + cos(π e/E))(1 − m), here per optimiser step
    assert momentum_at(0, 100, 0.99) == pytest.approx(0.99)
    assert momentum_at(50, 100, 0.99) == pytest.approx(0.995)
    assert momentum_at(100, 100, 0.99) == pytest.approx(1.0)
    for step in range(0, 101, 7):
        expected = 1 - 0.5 * (1 + math.cos(math.pi * step / 100)) * (1 - 0.99)
        assert momentum_at(step, 100, 0.99) == pytest.approx(expected)
    assert momentum_at(50, 100, 0.99, "constant") == momentum_at(7, math.inf, 0.99) == 0.99


def small_moco(**options: object) -> MoCoV3:
    return MoCoV3(backbone="small_cnn", proj_dim=8, mlp_dim=16, **options)


def test_a_step_updates_the_momentum_encoder_then_scores_algorithm_1s_symmetric_loss() -> None:
    torch.manual_seed(0)
    module = small_moco(key_momentum=0.9)
    with torch.no_grad():  # the base encoder ahead of the momentum encoder, so the update shows
        for p in [*module.backbone.parameters(), *module.projector.parameters()]:
            p.add_(0.1 * torch.randn_like(p))
    base = [p.detach().clone() for p in [*module.backbone.parameters(), *module.projector.parameters()]]
    old = [p.clone() for p in [*module.momentum_backbone.parameters(), *module.momentum_projector.parameters()]]
    x1, x2 = torch.randn(6, 3, 16, 16), torch.randn(6, 3, 16, 16)
    loss = module.contrastive_loss(x1, x2)  # no trainer: step 0, momentum 0.9

    new = [*module.momentum_backbone.parameters(), *module.momentum_projector.parameters()]
    for p_k, p_old, p_q in zip(new, old, base, strict=True):
        torch.testing.assert_close(p_k, 0.9 * p_old + 0.1 * p_q)
        assert not p_k.requires_grad
    # Algorithm 1 on the updated encoders: f_q = predictor ∘ projector ∘ backbone, f_k = the momentum pair
    f_q = lambda x: module.predictor(module.projector(module.backbone(x)))  # noqa: E731
    f_k = lambda x: module.momentum_projector(module.momentum_backbone(x))  # noqa: E731
    with torch.no_grad():
        expected = ctr_loop(f_q(x1), f_k(x2), 0.2) + ctr_loop(f_q(x2), f_k(x1), 0.2)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    loss.backward()
    assert all(p.grad is not None for p in module.predictor.parameters())  # the predictor trains, unmirrored


def test_the_mlps_follow_the_official_build_mlp() -> None:
    vit = MoCoV3(backbone="vit_tiny_patch16_224", backbone_args={**VIT_32PX, "depth": 1})
    resnet = small_moco()
    assert [type(m).__name__ for m in vit.projector] == ["Linear", "BatchNorm1d", "ReLU"] * 2 + [
        "Linear",
        "BatchNorm1d",
    ]  # ViT: 3 layers
    assert vit.projector[0].weight.shape == (4096, 192) and vit.projector[6].weight.shape == (256, 4096)
    assert all(m.bias is None for m in vit.projector if isinstance(m, torch.nn.Linear))
    assert not vit.projector[7].affine and vit.predictor[0].weight.shape == (4096, 256) and len(vit.predictor) == 5
    assert len(resnet.projector) == 5 and len(resnet.predictor) == 4  # ResNet: 2-layer projector, predictor no last BN
    assert resnet.hparams.optimizer == "adamw" and resnet.hparams.lr == 1.5e-4 and resnet.hparams.weight_decay == 0.1


def test_a_vits_patch_projection_is_frozen_and_its_position_embedding_fixed_sin_cos() -> None:
    module = MoCoV3(backbone="vit_tiny_patch16_224", backbone_args={**VIT_32PX, "depth": 1}, mlp_dim=16)
    body = module.backbone.body
    frozen = {n for n, p in module.backbone.named_parameters() if not p.requires_grad}
    assert frozen == {"body.pos_embed", "body.patch_embed.proj.weight", "body.patch_embed.proj.bias"}
    assert torch.count_nonzero(body.patch_embed.proj.bias) == 0
    bound = math.sqrt(6 / (3 * 4 * 4 + 192))  # vits.py's Xavier-uniform bound over 3·p² inputs and the width
    assert 0.97 * bound < body.patch_embed.proj.weight.abs().max() <= bound  # not timm's 1/√48 = 0.91 × bound
    # vits.py's embedding, token by token: zeros for [cls], then [sin(rω), cos(rω), sin(cω), cos(cω)] per patch
    omega = [1 / 10000 ** (i / 48) for i in range(48)]
    expected = [[0.0] * 192]
    for r in range(8):
        for c in range(8):
            expected.append(
                [math.sin(r * w) for w in omega]
                + [math.cos(r * w) for w in omega]
                + [math.sin(c * w) for w in omega]
                + [math.cos(c * w) for w in omega]
            )
    torch.testing.assert_close(body.pos_embed.detach()[0], torch.tensor(expected))
    torch.testing.assert_close(sincos_2d_position_embedding((8, 8), 192), body.pos_embed.detach())
    learned = MoCoV3(
        backbone="vit_tiny_patch16_224",
        backbone_args={**VIT_32PX, "depth": 1},
        mlp_dim=16,
        freeze_patch_embed=False,
        sincos_pos_embed=False,
    )
    assert all(p.requires_grad for p in learned.backbone.parameters())
    assert all(p.requires_grad for p in small_moco().backbone.parameters())  # a CNN: nothing frozen by default


def test_vit_options_on_a_cnn_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"freeze_patch_embed true needs a ViT, but backbone 'small_cnn' has no"):
        small_moco(freeze_patch_embed=True)
    with pytest.raises(ValueError, match=r"sincos_pos_embed true needs a ViT with one class token"):
        small_moco(sincos_pos_embed=True)
    with pytest.raises(ValueError, match=r"invalid moco_v3 settings: mlp_dim must be >= 1 \(got 0\); key_momentum"):
        MoCoV3(mlp_dim=0, key_momentum=1.5)


def test_moco_v3_is_a_method_of_the_pretrain_command() -> None:
    assert translate_args(["--method", "moco_v3"]) == ["--model=coretune.pretrain.mocov3.MoCoV3"]


def test_a_vit_tiny_pretrains_exports_moco_v3s_layout_and_fine_tunes_from_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the hint and the load report on one line each
    images, run_dir = make_image_folder(tmp_path / "images", n=8), tmp_path / "run"
    vit_args = json.dumps(VIT_32PX)
    vit = f"--model.backbone vit_tiny_patch16_224 --model.backbone_args {vit_args.replace(' ', '')}".split()
    pretrain = (
        "pretrain --method moco_v3 --model.mlp_dim 32 --model.proj_dim 16 --data.image_size 32 --data.batch_size 4"
    )
    options = f"--data.root {images} --run_dir {run_dir} --trainer.max_steps 2 --trainer.precision 32-true"
    main([*pretrain.split(), *vit, *options.split(), *QUIET])
    printed = " ".join(capsys.readouterr().out.split())  # the commands that fine-tune and evaluate it
    assert f"coretune fit --model.backbone vit_tiny_patch16_224 --model.backbone_args '{vit_args}'" in printed
    assert f"coretune eval knn --model.backbone vit_tiny_patch16_224 --model.backbone_args '{vit_args}'" in printed
    ckpt = torch.load(run_dir / PRETRAINED_FILENAME, weights_only=True)
    assert {"epoch", "arch", "state_dict", "optimizer"} <= set(ckpt) and ckpt["arch"] == "vit_tiny_patch16_224"
    state = ckpt["state_dict"]
    encoder = create_backbone("vit_tiny_patch16_224", verbose=False, **VIT_32PX)
    body = list(encoder.body.state_dict())
    for part in ("base_encoder", "momentum_encoder"):  # main_moco.py's model.state_dict() under DDP ('module.')
        assert {f"module.{part}.{k}" for k in body} | {f"module.{part}.head.{i}.weight" for i in (0, 3, 6)} <= set(
            state
        )
    assert {"module.predictor.0.weight", "module.predictor.4.running_mean"} <= set(state)
    assert not {k for k in state if not k.startswith(("module.base_encoder.", "module.momentum_encoder.", "module.p"))}
    report = load_pretrained(encoder, run_dir / PRETRAINED_FILENAME)
    assert report.layout == "moco_v3" and report.loaded == body and not report.missing and not report.unexpected
    for key, value in encoder.body.state_dict().items():
        assert torch.equal(value, state[f"module.base_encoder.{key}"]), key

    data = make_image_tree(tmp_path / "labelled", per_class=2, val_per_class=1)
    weights = run_dir / PRETRAINED_FILENAME
    fit = f"fit --data.root {data} --model.weights {weights} --data.image_size 32 --data.batch_size 6"
    main([*fit.split(), *vit, "--trainer.max_steps=1", f"--run_dir={tmp_path / 'fit'}", *QUIET])
    loaded = f"layout 'moco_v3' (state_dict['module.base_encoder.*']) — {len(body)}/{len(body)} tensors loaded, "
    assert loaded + "0 missing, 0 unexpected" in capsys.readouterr().err


def test_the_cifar10_vit_tiny_config_is_moco_v3s_vit_recipe_at_batch_256(capsys: pytest.CaptureFixture[str]) -> None:
    config = Path(__file__).parents[2] / "configs" / "pretrain" / "cifar10_vit_tiny_moco_v3.yaml"
    with pytest.raises(SystemExit) as done:
        main(["pretrain", "--config", str(config), "--print_config"])
    assert done.value.code in (None, 0)
    printed = yaml.safe_load(capsys.readouterr().out)
    model, data = printed["model"], printed["data"]
    assert model["class_path"] == "coretune.pretrain.mocov3.MoCoV3"
    settings = {k: model["init_args"][k] for k in ("optimizer", "lr", "weight_decay", "temperature", "key_momentum")}
    assert settings == {"optimizer": "adamw", "lr": 1.5e-4 * 256 / 256, "weight_decay": 0.1, "temperature": 0.2,
                        "key_momentum": 0.99}  # fmt: skip
    assert model["init_args"]["backbone_args"] == VIT_32PX and data["batch_size"] == 256 and data["image_size"] == 32
    epochs = printed["trainer"]["max_epochs"]
    assert model["init_args"]["warmup_epochs"] == pytest.approx(40 / 300 * epochs, abs=0.01)  # the recipe's fraction
