"""Learning-rate decay on a validation plateau (``--model.optim.plateau_patience``, :mod:`coretune.engine.plateau`):
the rates every optimiser step used against torch's ReduceLROnPlateau fed the same validation losses, the stop at
the N-th decay, a resumed run, ``results.json`` and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, make_trainer, read_metrics
from coretune.engine.optim import OptimSettings
from coretune.engine.plateau import PlateauDecay
from coretune.objectives import create
from fit_flags import QUIET, TINY_FIT, StopAfterEpoch, error

LR = 0.05


class _Rates(L.Callback):
    """The (epoch, heads' lr) of every optimiser step."""

    def __init__(self) -> None:
        self.rates: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.rates.append((trainer.current_epoch, optimizer.param_groups[-1]["lr"]))


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule reads ``LOSSES[epoch]`` as each epoch's validation loss instead of the logged one."""
    monkeypatch.setattr(PlateauDecay, "monitored", staticmethod(lambda trainer: LOSSES[trainer.current_epoch]))


def _fit(
    tree: Path,
    run_dir: Path,
    optim: OptimSettings,
    *callbacks: L.Callback,
    epochs: int,
    ckpt_path: str | None = None,
    objective: str = "ce",
    **objective_args: Any,
) -> tuple[FineTuner, L.Trainer]:
    L.seed_everything(3)
    data = ImageClassificationData(root=str(tree), image_size=16, batch_size=8, seed=3, val_fraction=0.25)
    model = FineTuner(create(objective, **objective_args), backbone="small_cnn", optim=optim)
    trainer = make_trainer(
        run_dir, progress=False, max_epochs=epochs, precision="32-true", callbacks=list(callbacks),
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model, trainer


def _torch_scales(losses: list[float], patience: int) -> list[float]:
    """The factor in force during each epoch: torch's ReduceLROnPlateau (DomainBed's settings) fed the losses of
    the epochs before, on an optimiser of lr 1."""
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    rule = torch.optim.lr_scheduler.ReduceLROnPlateau(holder, mode="min", factor=0.1, patience=patience)
    scales = []
    for loss in losses:
        scales.append(holder.param_groups[0]["lr"])
        rule.step(loss)
    return scales


LOSSES = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.4, 0.4]  # patience 1: decays after epochs 2 and 5


def test_each_step_runs_at_the_schedule_times_torchs_plateau_factor_and_the_run_stops_at_the_nth_decay(
    image_tree: Path, tmp_path: Path, scripted: None
) -> None:
    """A cosine schedule times the plateau factor, step by step; with plateau_stop 2 the run of 8 epochs ends after
    epoch 5, whose validation made the second decay."""
    script = _Rates()
    optim = OptimSettings(lr=LR, schedule="cosine", plateau_patience=1, plateau_stop=2)
    model, trainer = _fit(image_tree, tmp_path / "run", optim, script, epochs=8)
    assert trainer.current_epoch == 6  # epochs 0-5 ran
    scales = _torch_scales(LOSSES, patience=1)
    assert scales[:6] == [1.0, 1.0, 1.0, pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.1)]
    total = trainer.estimated_stepping_batches  # the cosine schedule's length: 8 epochs
    for step, (epoch, lr) in enumerate(script.rates):
        cosine = 0.5 * (1 + math.cos(math.pi * step / total))
        assert lr == pytest.approx(LR * cosine * scales[epoch], rel=1e-6), (step, epoch)
    assert model.plateau.entry() == {
        "patience": 1, "stop": 2, "factor": 0.1, "monitor": "val/loss", "decays": 2,
        "lr_scale": pytest.approx(0.01), "stopped": True, "skipped_warmup": 0,
    }  # fmt: skip


def test_the_validations_of_erm_pp_s_head_only_warm_up_do_not_count(
    image_tree: Path, tmp_path: Path, scripted: None
) -> None:
    """DomainBed's ``set_lr`` steps the rule only once ``global_iter > linear_steps``: with a warm-up of two epochs'
    steps, the validations after epochs 0 and 1 are skipped and the rule reads the losses from epoch 2 on."""
    probe = _Rates()
    _fit(image_tree, tmp_path / "probe", OptimSettings(lr=LR), probe, epochs=1)
    per_epoch = len(probe.rates)
    rates = _Rates()
    optim = OptimSettings(lr=LR, schedule="constant", plateau_patience=1)
    model, _ = _fit(
        image_tree, tmp_path / "run", optim, rates, epochs=8, objective="erm_pp", linear_steps=2 * per_epoch
    )
    assert model.objective.steps == 8 * per_epoch
    scales = [1.0, 1.0, *_torch_scales(LOSSES[2:], patience=1)]  # epoch e >= 2: the rule fed epochs 2 to e-1
    assert scales[:8] == [1.0] * 6 + [pytest.approx(0.1)] * 2  # LOSSES[2:]: one decay, after epoch 5
    for epoch, lr in rates.rates:
        assert lr == pytest.approx(LR * scales[epoch], rel=1e-6), epoch
    entry = model.plateau.entry()
    assert entry["skipped_warmup"] == 2 and entry["decays"] == 1


def test_real_validation_losses_drive_the_factor_as_torchs_rule(image_tree: Path, tmp_path: Path) -> None:
    """Without a script: the rates of each epoch follow torch's rule fed the logged ``val/loss`` of the epochs
    before (patience 0: any epoch without a better loss decays)."""
    rates = _Rates()
    optim = OptimSettings(lr=0.2, schedule="constant", plateau_patience=0)
    model, _ = _fit(image_tree, tmp_path / "run", optim, rates, epochs=5)
    losses = [float(row["val/loss"]) for row in read_metrics(tmp_path / "run" / "metrics.csv")]
    assert len(losses) == 5
    scales = _torch_scales(losses, patience=0)
    for epoch, lr in rates.rates:
        assert lr == pytest.approx(0.2 * scales[epoch], rel=1e-5), epoch
    final = _torch_scales([*losses, 0.0], patience=0)[-1]  # in force after the last validation
    assert model.plateau.scale == pytest.approx(final)
    assert model.plateau.scale == pytest.approx(0.1**model.plateau.decays)


def test_a_resumed_run_goes_on_with_the_factor_and_decays_of_the_interrupted_one(
    image_tree: Path, tmp_path: Path, scripted: None
) -> None:
    optim = OptimSettings(lr=LR, schedule="constant", plateau_patience=1)
    whole = _Rates()
    _fit(image_tree, tmp_path / "whole", optim, whole, epochs=7)
    first = _Rates()
    _fit(image_tree, tmp_path / "part", optim, first, StopAfterEpoch(3), epochs=7)
    second = _Rates()
    last = str(tmp_path / "part" / "checkpoints" / "last.ckpt")
    model, _ = _fit(image_tree, tmp_path / "part", optim, second, epochs=7, ckpt_path=last)
    assert first.rates + second.rates == whole.rates
    assert model.plateau.decays == 2 and model.plateau.scale == pytest.approx(0.01)


def test_coretune_fit_records_the_plateau_in_results(image_tree: Path, tmp_path: Path) -> None:
    from coretune.cli import main

    run = tmp_path / "run"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={image_tree}", "--data.val_fraction=0.25", f"--run_dir={run}",
          "--trainer.max_epochs=2", "--model.optim.plateau_patience=1"])  # fmt: skip
    plateau = json.loads((run / "results.json").read_text())["plateau"]
    assert plateau["patience"] == 1 and plateau["stop"] is None and plateau["stopped"] is False
    assert plateau["lr_scale"] == 0.1 ** plateau["decays"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model.optim.plateau_stop=3"], "plateau_stop counts plateau decays: give plateau_patience too"),
        (["--model.optim.plateau_patience=-1"], "plateau_patience must be an int >= 0 (got -1)"),
        (["--model.optim.plateau_patience=1", "--model.optim.plateau_stop=0"], "plateau_stop must be an int >= 1"),
        (["--model.optim.plateau_patience=1"], "this run validates on the test images: hold out part of the"),
        (
            ["--model.optim.plateau_patience=1", "--data.val_fraction=0.25", "--averaging.swa_start=0",
             "--averaging.swa_lr=0.01"],
            "--model.optim.plateau_patience and --averaging.swa_lr both set the learning rate",
        ),
    ],
)  # fmt: skip
def test_bad_plateau_settings_are_one_line(image_tree: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    run = tmp_path / "run"
    assert message in error(["fit", *TINY_FIT, *QUIET, f"--data.root={image_tree}", f"--run_dir={run}", *flags])
    assert not (run / "results.json").exists()
