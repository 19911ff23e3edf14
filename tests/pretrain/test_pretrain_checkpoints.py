"""Pre-training writes SimCLR / MoCo-v2 checkpoints in their reference layouts, and every backbone tensor of
them loads back through create_backbone; the MoCo key encoder follows the momentum update."""

import warnings
from pathlib import Path

import pytest
import torch
import yaml

from coretune.cli import main
from coretune.engine import checkpoint_io
from coretune.models import create_backbone, load_pretrained
from coretune.pretrain import (
    PRETRAINED_FILENAME,
    ContrastivePretrainer,
    MoCoV2,
    PretrainData,
    SimCLR,
    make_pretrain_trainer,
)
from coretune.pretrain.cli import translate_args
from image_trees import make_image_folder


def _roundtrip(module: ContrastivePretrainer, path: Path) -> None:
    torch.save(module.pretrained_checkpoint(), path)
    encoder = create_backbone(module.backbone.name, verbose=False)
    report = load_pretrained(encoder, path)
    expected = module.backbone.body.state_dict()
    assert report.loaded == list(expected) and report.total == len(expected)
    assert not report.missing and not report.unexpected
    for key, value in encoder.body.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("backbone", ["small_cnn", "resnet18", "resnet10t"])
def test_simclr_layout_round_trips(backbone: str, tmp_path: Path) -> None:
    module = SimCLR(backbone=backbone, proj_dim=16)
    ckpt = module.pretrained_checkpoint()
    assert set(ckpt) == {"epoch", "arch", "method", "state_dict"} and ckpt["arch"] == backbone
    keys = set(ckpt["state_dict"])
    assert {f"backbone.{k}" for k in module.backbone.body.state_dict()} | {
        "projector.0.weight",
        "projector.0.bias",
        "projector.2.weight",
        "projector.2.bias",
    } == keys
    if backbone == "resnet18":
        assert "backbone.conv1.weight" in keys and "backbone.layer4.1.bn2.running_var" in keys
    _roundtrip(module, tmp_path / "simclr.pth.tar")


@pytest.mark.parametrize("backbone", ["small_cnn", "resnet18", "resnet10t"])
def test_moco_layout_round_trips(backbone: str, tmp_path: Path) -> None:
    module = MoCoV2(backbone=backbone, proj_dim=16, queue_size=32)
    ckpt = module.pretrained_checkpoint()
    assert set(ckpt) == {"epoch", "arch", "state_dict", "optimizer"}
    state = ckpt["state_dict"]
    body = list(module.backbone.body.state_dict())
    for encoder in ("encoder_q", "encoder_k"):
        assert {f"module.{encoder}.{k}" for k in body} <= set(state)
        assert {f"module.{encoder}.fc.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")} <= set(state)
    assert state["module.queue"].shape == (16, 32) and state["module.queue_ptr"].tolist() == [0]
    if backbone == "resnet18":
        assert state["module.encoder_q.fc.0.weight"].shape == (512, 512)  # MoCo v2's MLP head on 512-d ResNet-18
    _roundtrip(module, tmp_path / "checkpoint_0001.pth.tar")
    report = load_pretrained(create_backbone(backbone, verbose=False), tmp_path / "checkpoint_0001.pth.tar")
    assert report.layout == "moco"


def test_momentum_update_follows_the_moco_rule() -> None:
    module = MoCoV2(backbone="small_cnn", proj_dim=8, queue_size=16, key_momentum=0.9)
    with torch.no_grad():
        for p in module.backbone.parameters():
            p.add_(1.0)
        for p in module.projector.parameters():
            p.add_(1.0)
    pairs = ((module.backbone, module.momentum_backbone), (module.projector, module.momentum_projector))
    before = [[p.clone() for p in key.parameters()] for _, key in pairs]
    module._momentum_update()
    for (query, key), old_values in zip(pairs, before, strict=True):  # the projection head follows too
        for p_k, old, p_q in zip(key.parameters(), old_values, query.parameters(), strict=True):
            assert torch.allclose(p_k, 0.9 * old + 0.1 * p_q)
        assert not any(p.requires_grad for p in key.parameters())


def test_moco_exports_the_query_encoder_not_the_key_encoder(tmp_path: Path) -> None:
    # a fresh module's key encoder is a copy of the query encoder: make them differ, or a swap goes unseen
    module = MoCoV2(backbone="small_cnn", proj_dim=8, queue_size=16)
    with torch.no_grad():
        for p in module.backbone.parameters():
            p.add_(1.0)
    _roundtrip(module, tmp_path / "moco.pth.tar")


def test_a_moco_step_scores_against_the_queue_before_its_own_keys_then_enqueues_them() -> None:
    from coretune.pretrain import moco_infonce

    torch.manual_seed(0)
    module = MoCoV2(backbone="small_cnn", proj_dim=8, queue_size=16, bn_splits=2, key_momentum=0.5).eval()
    with torch.no_grad():  # eval mode: batch norm's running statistics, so the keys do not depend on the shuffle
        for p in module.backbone.parameters():
            p.add_(0.1 * torch.randn_like(p))
    view1, view2 = torch.randn(6, 3, 16, 16), torch.randn(6, 3, 16, 16)
    queue = module.queue.queue.clone()
    loss = module.contrastive_loss(view1, view2)  # updates the key encoder first, then computes the keys
    keys = module.keys(view2)
    assert loss.item() == pytest.approx(moco_infonce(module(view1), keys, queue, 0.2).item(), rel=1e-5)
    assert int(module.queue.queue_ptr) == 6
    torch.testing.assert_close(module.queue.queue[:, :6], keys.T)
    torch.testing.assert_close(module.queue.queue[:, 6:], queue[:, 6:])


def test_invalid_settings_are_reported_together() -> None:
    with pytest.raises(ValueError, match=r"invalid simclr settings: temperature must be > 0 \(got 0\); lr must"):
        SimCLR(temperature=0, lr=-1)
    with pytest.raises(ValueError, match=r"invalid moco_v2 settings: queue_size must be >= 1 \(got 0\)"):
        MoCoV2(queue_size=0)


def test_method_alias_and_default() -> None:
    assert translate_args(["--method", "moco_v2", "--model.queue_size", "8"]) == [
        "--model=coretune.pretrain.module.MoCoV2",
        "--model.queue_size",
        "8",
    ]
    assert translate_args(["--seed=3"]) == ["--model=coretune.pretrain.module.SimCLR", "--seed_everything=3"]
    with pytest.raises(ValueError, match="unknown pre-training method 'byol': choose one of simclr, moco_v2, moco_v3"):
        translate_args(["--method", "byol"])


def printed_model(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    """The ``model`` section of ``coretune pretrain ARGS --print_config``."""
    with pytest.raises(SystemExit) as done:
        main(["pretrain", *args, "--print_config"])
    assert done.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)["model"]


def test_method_after_a_config_of_another_method_takes_its_own_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --method after a SimCLR config was ignored (--model went first, the config overrode it); a method's own
    # settings (optimiser, lr, weight decay) are its defaults, the shared ones (backbone) stay the config's
    config = tmp_path / "simclr.yaml"
    init_args = {"backbone": "small_cnn", "lr": 0.002, "temperature": 0.3}
    config.write_text(
        yaml.safe_dump({"model": {"class_path": "coretune.pretrain.module.SimCLR", "init_args": init_args}})
    )
    moco = printed_model(["--config", str(config), "--method", "moco_v2"], capsys)
    assert moco["class_path"] == "coretune.pretrain.module.MoCoV2"
    moco_args = moco["init_args"]
    assert (moco_args["optimizer"], moco_args["lr"], moco_args["weight_decay"]) == ("sgd", 0.06, 5e-4)
    assert (moco_args["backbone"], moco_args["temperature"]) == ("small_cnn", 0.3)
    options = ["--model.lr=0.5", "--method", "moco_v2", "--model.weight_decay", "0.001"]  # options after a config win
    moco_args = printed_model(["--config", str(config), *options], capsys)["init_args"]
    assert (moco_args["lr"], moco_args["weight_decay"]) == (0.5, 0.001)
    simclr = printed_model(["--config", str(config), "--method", "simclr"], capsys)  # the same method: a re-run
    assert simclr["class_path"] == "coretune.pretrain.module.SimCLR"
    assert {k: simclr["init_args"][k] for k in init_args} == init_args
    assert printed_model(["--config", str(config)], capsys)["init_args"]["lr"] == 0.002


def _cli(line: str) -> list[str]:
    """Command-line words (the test paths hold no spaces)."""
    return line.split()


@pytest.mark.parametrize("method", ["simclr", "moco_v2"])
def test_pretrain_command_writes_loadable_checkpoints_and_resumes(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    atomic: list[str] = []
    save = checkpoint_io.atomic_torch_save
    monkeypatch.setattr(
        checkpoint_io, "atomic_torch_save", lambda obj, path: (atomic.append(Path(path).name), save(obj, path))
    )
    images = make_image_folder(tmp_path / "images")
    run_dir = tmp_path / "run"
    args = _cli(
        f"pretrain --method {method} --model.backbone small_cnn --model.proj_dim 16 --data.image_size 16 "
        f"--data.batch_size 4 --trainer.enable_progress_bar false --data.root {images} --run_dir {run_dir}"
    )
    if method == "moco_v2":
        args += ["--model.queue_size", "8", "--model.bn_splits", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*args, "--trainer.max_epochs", "1"])
    assert not [w for w in caught if "Unable to serialize" in str(w.message)]  # jsonargparse and the IO plugin
    assert "last.ckpt" in atomic  # Lightning's checkpoints go through AtomicCheckpointIO
    weights = run_dir / PRETRAINED_FILENAME
    ckpt = torch.load(weights, weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["arch"] == "small_cnn"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "metrics.csv").is_file()
    for path in (weights, run_dir / "checkpoints" / "last.ckpt"):
        report = load_pretrained(create_backbone("small_cnn", verbose=False), path)
        assert len(report.loaded) == report.total and not report.missing
    main([*args, "--trainer.max_epochs", "2"])  # the same run directory: resumes from checkpoints/last.ckpt
    assert torch.load(weights, weights_only=True)["epoch"] == 2
    # the input normalisation goes with the weights (a fine-tuning that feeds another scale is warned about)
    assert ckpt["normalization"] == {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    assert create_backbone("small_cnn", weights=str(weights)).pretrained_normalization == (
        (0.485, 0.456, 0.406),
        (0.229, 0.224, 0.225),
    )
    assert [row.split(",")[0] for row in (run_dir / "metrics.csv").read_text().splitlines()[1:]] == ["0", "1"]


def test_keys_come_from_bn_splits_sub_batches_that_differ_by_at_most_one_image() -> None:
    """7 images in 3 Shuffle BN sub-batches are 3 + 2 + 2 (``chunk`` made 3 + 3 + 1), and each key returns to its
    image's place (checked in eval mode, where batch norm does not mix the images)."""
    module = MoCoV2(backbone="small_cnn", proj_dim=8, queue_size=16, bn_splits=3)
    sizes: list[int] = []
    module.momentum_backbone.register_forward_pre_hook(lambda _, args: sizes.append(args[0].shape[0]))
    x = torch.rand(7, 3, 16, 16)
    module.keys(x)
    assert sorted(sizes) == [2, 2, 3]
    module.eval()
    expected = torch.nn.functional.normalize(module.momentum_projector(module.momentum_backbone(x)), dim=1)
    torch.testing.assert_close(module.keys(x), expected)


def test_queue_larger_than_the_data_is_refused(tmp_path: Path) -> None:
    images = make_image_folder(tmp_path / "images", n=6)
    with pytest.raises(SystemExit, match="queue_size 4096 exceeds the 6 training images"):
        main(
            _cli(
                "pretrain --method moco_v2 --model.backbone small_cnn --data.image_size 16 --data.batch_size 4 "
                f"--trainer.max_epochs 1 --trainer.enable_progress_bar false --data.root {images} "
                f"--run_dir {tmp_path / 'r'}"
            )
        )


@pytest.mark.filterwarnings("ignore:Precision bf16-mixed is not supported by the model summary")
@pytest.mark.parametrize("method", [SimCLR, MoCoV2])
def test_the_model_summary_counts_the_flops_of_one_view_at_the_datas_size(
    method: type[ContrastivePretrainer], tmp_path: Path
) -> None:
    from lightning.pytorch.utilities.model_summary import ModelSummary
    from torch.utils.flop_counter import FlopCounterMode

    data = PretrainData(str(make_image_folder(tmp_path / "images")), image_size=16, batch_size=4)
    extra = {"queue_size": 8, "bn_splits": 2} if method is MoCoV2 else {}
    model = method(backbone="small_cnn", proj_dim=16, **extra)
    trainer = make_pretrain_trainer(
        tmp_path / "run", max_epochs=1, limit_train_batches=1, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(model, datamodule=data)
    summary = ModelSummary(model)
    assert summary.in_sizes[summary.layer_names.index("backbone")] == [1, 3, 16, 16]
    with torch.no_grad(), FlopCounterMode(display=False) as reference:
        model.eval()(torch.zeros(1, 3, 16, 16))  # one view through the encoder and the projection head
    assert summary.total_flops == reference.get_total_flops() > 0


def test_snapshot_epochs_keep_the_encoder_of_those_epochs_beside_the_final_one(tmp_path: Path) -> None:
    """``--snapshot_epochs [1, 2]`` of a 3-epoch run: ``pretrained-epoch1/2.pth.tar``, each that epoch's encoder
    (epoch 2's equals the resumable checkpoint's weights after epoch 2), loadable like ``pretrained.pth.tar``."""
    from fit_flags import pretrain_args

    run = tmp_path / "run"
    images = make_image_folder(tmp_path / "images")
    main(pretrain_args(images, run, "--trainer.max_epochs=2", "--snapshot_epochs=[1, 2]"))
    second = torch.load(run / "pretrained-epoch2.pth.tar", weights_only=True)
    assert torch.load(run / "pretrained-epoch1.pth.tar", weights_only=True)["epoch"] == 1 and second["epoch"] == 2
    final = torch.load(run / PRETRAINED_FILENAME, weights_only=True)
    assert all(torch.equal(second["state_dict"][k], v) for k, v in final["state_dict"].items())
    main(pretrain_args(images, run, "--trainer.max_epochs=3", "--snapshot_epochs=[1, 2]"))  # resumed: epoch 3
    assert torch.load(run / PRETRAINED_FILENAME, weights_only=True)["epoch"] == 3
    first = torch.load(run / "pretrained-epoch1.pth.tar", weights_only=True)  # kept, not overwritten
    assert first["epoch"] == 1 and sorted(p.name for p in run.glob("pretrained*")) == [
        "pretrained-epoch1.pth.tar", "pretrained-epoch2.pth.tar", PRETRAINED_FILENAME
    ]  # fmt: skip
    for name in ("pretrained-epoch1.pth.tar", "pretrained-epoch2.pth.tar"):
        report = load_pretrained(create_backbone("small_cnn", verbose=False), run / name)
        assert report.loaded and not report.missing
    assert not all(torch.equal(first["state_dict"][k], v) for k, v in second["state_dict"].items())


def test_a_stop_inside_an_epoch_writes_no_snapshot_of_it(tmp_path: Path) -> None:
    """``--trainer.max_steps 4`` (3 steps an epoch) stops inside epoch 2: its snapshot is not written from a third of
    it; pretrained.pth.tar holds the encoder as it stopped, labelled with 1 complete epoch and 4 steps."""
    from fit_flags import pretrain_args

    run = tmp_path / "run"
    args = pretrain_args(make_image_folder(tmp_path / "images"), run, "--trainer.max_epochs=2",
                         "--snapshot_epochs=[1, 2]", "--trainer.max_steps=4")  # fmt: skip
    with pytest.warns(
        UserWarning,
        match=r"pre-training stopped inside epoch 2 \(1 of 3 steps\): pretrained\.pth\.tar "
        r"holds the encoder as it stopped \(its 'epoch' counts the 1 complete epoch\(s\), 'steps' the 4 "
        r"optimiser steps\) and no snapshot of epoch 2 is written",
    ):
        main(args)  # fmt: skip
    assert sorted(p.name for p in run.glob("pretrained*")) == ["pretrained-epoch1.pth.tar", PRETRAINED_FILENAME]
    stopped = torch.load(run / PRETRAINED_FILENAME, weights_only=True)
    assert (stopped["epoch"], stopped["steps"]) == (1, 4)
    first = torch.load(run / "pretrained-epoch1.pth.tar", weights_only=True)
    assert "steps" not in first  # a complete epoch's file as before
    assert not all(torch.equal(first["state_dict"][k], v) for k, v in stopped["state_dict"].items())


def test_the_fine_tune_hint_names_a_normalisation_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # the hint on one line
    images = make_image_folder(tmp_path / "images")
    main(_cli(
        "pretrain --method simclr --model.backbone small_cnn --model.proj_dim 16 --data.image_size 16 "
        f"--data.batch_size 4 --trainer.enable_progress_bar false --data.root {images} --run_dir {tmp_path / 'run'} "
        "--trainer.max_epochs 1 --data.mean [0.5,0.5,0.5] --data.std [0.25,0.25,0.25]"
    ))  # fmt: skip
    weights = tmp_path / "run" / PRETRAINED_FILENAME
    assert (
        f"coretune fit --model.backbone small_cnn --model.weights {weights} --data.mean [0.5,0.5,0.5] --data.std "
        "[0.25,0.25,0.25] --data.root <image folder>"
    ) in " ".join(capsys.readouterr().out.split())
    assert torch.load(weights, weights_only=True)["normalization"] == {"mean": [0.5] * 3, "std": [0.25] * 3}
