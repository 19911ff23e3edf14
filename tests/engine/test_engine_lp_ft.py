"""LP-FT (Kumar et al., ICLR 2022): ``--model.optim.lp_epochs`` probes linearly on the frozen backbone first, then
fine-tunes from the probe; with any objective, across a resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from coretune.cli import main
from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, make_trainer, read_metrics
from coretune.engine.optim import OptimSettings, lp_ft_factor, lr_factor
from coretune.objectives import create
from fit_flags import QUIET, TINY_FIT, StopAfterEpoch


def _reference_factor(step: int, total: int, schedule: str, warmup: int, lp: int, scale: float) -> float:
    """The two phases written out: a cosine/linear decay of the probe over its own steps at ``scale``, then the
    fine-tuning's warm-up and decay over the rest, both from the paper's "LP, then FT with its own schedule"."""
    if step < lp:
        progress = step / max(1, lp)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return scale * decay
    step, total = step - lp, total - lp
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_schedule_restarts_after_the_probe(schedule: Any) -> None:
    for step in range(30):
        got = lp_ft_factor(step, 30, schedule, warmup_steps=3, lp_steps=10, lp_scale=5.0)
        assert got == pytest.approx(_reference_factor(step, 30, schedule, 3, 10, 5.0)), step
        assert lp_ft_factor(step, 30, schedule, 3, lp_steps=0) == lr_factor(step, 30, schedule, 3)  # no probe


class _HeadsAtStart(L.Callback):
    """The objective's parameters when training starts (built in setup, after the backbone)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.heads = {k: v.detach().clone() for k, v in pl_module.objective.named_parameters()}


def _fit(
    tree: Path, run_dir: Path, epochs: int, ckpt_path: str | None = None, callbacks: list[L.Callback] | None = None
) -> FineTuner:
    L.seed_everything(3)
    data = ImageClassificationData(root=str(tree), image_size=16, batch_size=8, seed=3)
    model = FineTuner(create("core"), backbone="small_cnn", optim=OptimSettings(lp_epochs=1, lp_lr=0.05))
    trainer = make_trainer(run_dir, progress=False, max_epochs=epochs, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model


def _backbone_state(model: FineTuner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.backbone.state_dict().items()}  # BatchNorm running statistics included


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resuming into it, on purpose
def test_the_probe_leaves_the_backbone_bit_identical_and_fine_tuning_then_moves_it(
    image_tree: Path, tmp_path: Path
) -> None:
    """LP-FT + Core-tuning: the linear-probing epoch trains the objective's heads only (the classifier and the
    projection head) on a frozen backbone in evaluation mode (its BatchNorm statistics unchanged); the fine-tuning
    epoch, reached on a resume from the probe's last.ckpt (a run cut at the phase boundary), trains the backbone,
    and the resumed run repeats the uninterrupted one (which caught a backbone left in evaluation mode)."""
    L.seed_everything(3)
    start = _backbone_state(FineTuner(create("core"), backbone="small_cnn"))  # the same seed: the same init
    at_start = _HeadsAtStart()
    probed = _fit(image_tree, tmp_path / "cut", epochs=2, callbacks=[at_start, StopAfterEpoch(0)])
    for key, value in probed.backbone.state_dict().items():
        assert torch.equal(value, start[key]), key
    assert all(p.requires_grad is False for p in probed.backbone.parameters())  # frozen in the probe's epoch
    # every head trained: the classifier and Core-tuning's projection head
    moved = {k.split(".")[0] for k, v in probed.objective.named_parameters() if not torch.equal(v, at_start.heads[k])}
    assert moved == {k.split(".")[0] for k in at_start.heads} and {"classifier"} < moved
    whole = _fit(image_tree, tmp_path / "whole", epochs=2)
    resumed = _fit(image_tree, tmp_path / "cut", epochs=2, ckpt_path="last")
    assert any(not torch.equal(v, start[k]) for k, v in resumed.backbone.state_dict().items() if v.is_floating_point())
    assert all(p.requires_grad for p in resumed.backbone.parameters())
    for key, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_the_probe_fits_the_head(image_tree: Path, tmp_path: Path) -> None:
    """Two probing epochs of CE at lp_lr 0.05: the head's training loss falls, the backbone does not change."""
    L.seed_everything(3)
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=8, seed=3)
    model = FineTuner(create("ce"), backbone="small_cnn", optim=OptimSettings(lp_epochs=2, lp_lr=0.05))
    start = _backbone_state(model)
    make_trainer(tmp_path, progress=False, max_epochs=2, enable_model_summary=False).fit(model, datamodule=data)
    losses = [float(r["train/ce"]) for r in read_metrics(tmp_path / "metrics.csv")]
    assert losses[-1] < losses[0]
    assert all(torch.equal(v, start[k]) for k, v in model.backbone.state_dict().items())


def test_lp_epochs_through_the_command_line(image_tree: Path, tmp_path: Path) -> None:
    main(["fit", f"--data.root={image_tree}", f"--run_dir={tmp_path / 'run'}", *TINY_FIT, *QUIET,
          "--model.optim.lp_epochs=1", "--objective=ce"])  # fmt: skip
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "lp_epochs: 1" in config


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lp_epochs": -1}, "optim.lp_epochs must be >= 0 (got -1)"),
        ({"lp_lr": 0.1}, "optim.lp_lr is the linear-probing phase's learning rate: give lp_epochs > 0 too"),
        ({"lp_epochs": 1, "lp_lr": 0.0}, "optim.lp_lr must be > 0 (got 0.0)"),
    ],
)
def test_bad_lp_settings_are_one_line(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="invalid model settings: ") as info:
        FineTuner(backbone="small_cnn", optim=OptimSettings(**settings))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_frozen_backbone_has_no_fine_tuning_phase() -> None:
    with pytest.raises(ValueError, match=r"freeze_backbone true trains no backbone block: drop optim\.lp_epochs"):
        FineTuner(backbone="small_cnn", freeze_backbone=True, optim=OptimSettings(lp_epochs=1))
