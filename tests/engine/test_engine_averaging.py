"""Weight averaging (``coretune fit --averaging.*``, :mod:`coretune.engine.averaging`): EMA and SWA against slow
loops written from their equations, resumed runs, and what validation, checkpoints and ``results.json`` hold."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn

from coretune.cli import main
from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, make_trainer, read_metrics
from coretune.engine.averaging import AveragedWeights, Averaging, ema_multi_avg_fn
from coretune.objectives import create
from fit_flags import QUIET, TINY_FIT, StopAfterEpoch, error


class _Snapshots(L.Callback):
    """The model's state before the first step (``initial``), after every optimiser step (``steps``) and at every
    epoch's end (``epochs``), and each step's learning rates (``lrs``)."""

    def __init__(self) -> None:
        self.initial: dict[str, Tensor] = {}
        self.steps: list[dict[str, Tensor]] = []
        self.epochs: list[dict[str, Tensor]] = []
        self.lrs: list[list[float]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.lrs.append([g["lr"] for g in optimizer.param_groups])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self.steps.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after the averaging callback's epoch end: a validation swap is over, these are the trained weights
        self.epochs.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def _fit(
    tree: Path,
    run_dir: Path,
    averaging: Averaging | None,
    *callbacks: L.Callback,
    epochs: int = 3,
    ckpt_path: str | None = None,
    **trainer_options: Any,
) -> tuple[FineTuner, L.Trainer, ImageClassificationData]:
    L.seed_everything(3)
    data = ImageClassificationData(root=str(tree), image_size=16, batch_size=8, seed=3)
    model = FineTuner(create("ce"), backbone="small_cnn")
    averaged = [] if averaging is None else [AveragedWeights(averaging)]
    trainer = make_trainer(
        run_dir,
        progress=False,
        max_epochs=epochs,
        precision="32-true",
        callbacks=[*callbacks, *averaged],
        enable_model_summary=False,
        **trainer_options,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model, trainer, data


def _val_loss(model: FineTuner, data: ImageClassificationData) -> float:
    """The mean validation loss of ``model``'s weights, by hand."""
    model.eval()
    with torch.no_grad():
        losses = [(model.task.eval_loss(model(x), y), len(y)) for x, y in data.val_dataloader()]
    return float(sum(loss * n for loss, n in losses) / sum(n for _, n in losses))


def _floats(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, Tensor) and v.is_floating_point()}


def test_ema_after_k_steps_is_the_slow_loop_and_validation_scores_it(image_tree: Path, tmp_path: Path) -> None:
    """``ema_1 = w_1``, ``ema_k = d·ema_{k-1} + (1-d)·w_k`` after each optimiser step, over parameters and BatchNorm
    statistics (integer counters copied); the model ends the fit with it, the epoch's validation scores it, and
    ``best.ckpt``'s state_dict holds it (the trained weights beside it)."""
    d = 0.7
    snaps = _Snapshots()
    model, trainer, data = _fit(image_tree, tmp_path / "run", Averaging(ema_decay=d), snaps, epochs=2)
    assert len(snaps.steps) == trainer.global_step == 8
    ema = dict(snaps.steps[0])
    for w in snaps.steps[1:]:
        ema = {k: d * ema[k] + (1 - d) * w[k] if w[k].is_floating_point() else w[k] for k in w}
    final = model.state_dict()
    for key, value in ema.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert not torch.equal(final["backbone.body.layer1.0.weight"], snaps.steps[-1]["backbone.body.layer1.0.weight"])
    assert any("running_mean" in k for k in ema)  # BatchNorm statistics averaged too
    # the last epoch's val/loss is that of the EMA weights, evaluated here by hand
    logged = float(read_metrics(tmp_path / "run" / "metrics.csv")[-1]["val/loss"])
    assert logged == pytest.approx(_val_loss(model, data), rel=1e-5)
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    for key, value in _floats(ema).items():
        torch.testing.assert_close(last["state_dict"][key], value, rtol=1e-5, atol=1e-6)
        assert torch.equal(last["current_model_state"][key], snaps.steps[-1][key])
    assert last["coretune"]["averaging"] == {"weights": "ema", "ema_decay": d, "updates": 8}
    rebuilt = FineTuner.from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt").eval()
    x = next(iter(data.val_dataloader()))[0]
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), model(x))
    assert rebuilt.checkpoint_info["averaging"]["weights"] == "ema"


def test_the_ema_update_lerps_floats_and_copies_counters() -> None:
    """The multi-tensor EMA: floats lerp, integers (BatchNorm's counter) are copied."""
    update = ema_multi_avg_fn(0.9)
    a, b = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 4.0])]
    update(a, b, torch.tensor(1))
    torch.testing.assert_close(a[0], torch.tensor([1.2, 2.2]))
    count = [torch.tensor(5)]
    update(count, [torch.tensor(9)], torch.tensor(1))
    assert int(count[0]) == 9


def test_ema_updates_once_per_optimiser_step_under_gradient_accumulation(image_tree: Path, tmp_path: Path) -> None:
    _, trainer, _ = _fit(image_tree, tmp_path / "run", Averaging(ema_decay=0.9), epochs=1, accumulate_grad_batches=2)
    assert trainer.global_step == 2
    assert trainer.lightning_module.averaging == {"weights": "ema", "ema_decay": 0.9, "updates": 2}


@pytest.mark.parametrize(
    "averaging",
    [Averaging(ema_decay=0.8), Averaging(swa_start=0, swa_lr=0.005), Averaging(sma_start_step=3)],
    ids=["ema", "swa", "sma"],
)
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resuming into it, on purpose
def test_a_resumed_run_has_the_average_of_the_uninterrupted_one(
    image_tree: Path, tmp_path: Path, averaging: Averaging
) -> None:
    """Cut after the first of 2 epochs, with an average holding 4 steps (EMA), 1 epoch (SWA from epoch 0) or the
    weights of steps 2 to 4 (SMA from step 3)."""
    whole, _, _ = _fit(image_tree, tmp_path / "whole", averaging, epochs=2)
    _fit(image_tree, tmp_path / "cut", averaging, StopAfterEpoch(0), epochs=2)
    cut = torch.load(tmp_path / "cut" / "checkpoints" / "last.ckpt", weights_only=True)
    assert cut["epoch"] == 0 and cut["coretune"]["averaging"]["weights"] == averaging.kind
    resumed, _, _ = _fit(image_tree, tmp_path / "cut", averaging, ckpt_path="last", epochs=2)
    for key, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    a, b = (torch.load(tmp_path / r / "checkpoints" / "last.ckpt", weights_only=True) for r in ("whole", "cut"))
    for part in ("state_dict", "current_model_state"):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), (part, key)
    assert a["averaging_state"] == b["averaging_state"]
    # resumed without the averaging it was trained with: refused, not trained on from the average
    with pytest.raises(ValueError, match="holds averaged weights"):
        _fit(image_tree, tmp_path / "cut", None, ckpt_path=str(tmp_path / "cut" / "checkpoints" / "last.ckpt"))


def _first_bn_mean(model: FineTuner, data: ImageClassificationData) -> Tensor:
    """The running mean a pass over the training images gives the first BatchNorm layer (cumulative: the mean of
    the batch means), computed by hand from its inputs."""
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    means: list[Tensor] = []
    hook = bn.register_forward_hook(lambda _m, inp, _out: means.append(inp[0].mean(dim=(0, 2, 3))))
    model.train()
    with torch.no_grad():
        for x, _ in data.train_dataloader():
            model.backbone(x)
    hook.remove()
    return torch.stack(means).mean(dim=0)


def test_swa_is_the_mean_of_the_epochs_from_its_start_with_batch_norm_recomputed(
    image_tree: Path, tmp_path: Path
) -> None:
    """Epochs 1 and 2 of 3 averaged (``swa_start`` 1, and 1/3 as a fraction), BatchNorm statistics from a pass over
    the training data (not the last model's), epoch 0 validated on the trained weights, and the SWA lr from its
    start."""
    snaps = _Snapshots()
    model, trainer, data = _fit(image_tree, tmp_path / "run", Averaging(swa_start=1 / 3, swa_lr=0.005), snaps)
    final = model.state_dict()
    params = {name for name, _ in model.named_parameters()}
    for key in params:
        mean = (snaps.epochs[1][key] + snaps.epochs[2][key]) / 2
        torch.testing.assert_close(final[key], mean, rtol=1e-5, atol=1e-6, msg=key)
    bn = next(n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d))
    running = final[f"{bn}.running_mean"].clone()
    assert not torch.allclose(running, snaps.epochs[2][f"{bn}.running_mean"])
    torch.testing.assert_close(running, _first_bn_mean(model, data), rtol=1e-4, atol=1e-5)
    steps = trainer.num_training_batches
    assert all(max(lrs) == pytest.approx(0.005) for lrs in snaps.lrs[steps:])  # the heads' lr; others scaled
    assert max(snaps.lrs[0]) == pytest.approx(0.01)
    entry = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["coretune"]["averaging"]
    assert entry["weights"] == "swa" and entry["epochs_averaged"] == 2 and entry["start_epoch"] == 1
    # epoch 0 (before the start) validated the trained weights (not the initial ones the average was copied from)
    model.load_state_dict(snaps.epochs[0])
    logged = float(read_metrics(tmp_path / "run" / "metrics.csv")[0]["val/loss"])
    assert logged == pytest.approx(_val_loss(model, data), rel=1e-5)


def _domainbed_sma(steps: list[dict[str, Tensor]], start: int) -> dict[str, Tensor]:
    """DomainBed's ``ErmPlusPlusMovingAvg.update_sma``, written from its recurrence: after update ``t`` (1-based),
    the average is a copy of the weights while ``t < start``, else ``(count·avg + w_t) / (count + 1)`` with
    ``count`` incremented first (1 at ``t = start``); ``num_batches_tracked`` not averaged. ``steps[0]`` holds the
    initial weights, ``steps[t]`` those after update ``t``."""
    avg, count = dict(steps[0]), 0
    for t in range(1, len(steps)):
        if t >= start:
            count += 1
            avg = {k: (avg[k] * count + w) / (1.0 + count) if w.is_floating_point() else w for k, w in steps[t].items()}
        else:
            avg = dict(steps[t])
    return avg


@pytest.mark.parametrize("start", [3, 1], ids=["from-step-3", "from-step-1"])
def test_sma_is_domainbeds_moving_average_of_every_step(image_tree: Path, tmp_path: Path, start: int) -> None:
    """``--averaging.sma_start_step s`` is DomainBed's ERM++ average (buffers included) against its recurrence over
    per-step snapshots; the last validation scores it and the checkpoint records it. Without DomainBed's BatchNorm
    pass (``sma_bn_pass`` False) the BatchNorm statistics are the plain mean too."""
    snaps = _Snapshots()
    settings = Averaging(sma_start_step=start, sma_bn_pass=False)
    model, trainer, data = _fit(image_tree, tmp_path / "run", settings, snaps, epochs=2)
    assert len(snaps.steps) == trainer.global_step == 8
    thetas = [snaps.initial, *snaps.steps]  # thetas[t]: the weights after optimiser step t
    expected = _domainbed_sma(thetas, start)
    window = thetas[start - 1 :]  # the same uniform mean written out: the weights after steps s-1 .. 8
    final = model.state_dict()
    for key, value in expected.items():
        if not value.is_floating_point():
            continue
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=key)
        mean = torch.stack([w[key] for w in window]).mean(dim=0)
        torch.testing.assert_close(final[key], mean, rtol=1e-5, atol=1e-6, msg=key)
    assert any("running_var" in k for k in expected)  # BatchNorm statistics averaged too
    counter = next(k for k in final if k.endswith("num_batches_tracked"))
    assert torch.equal(final[counter], snaps.steps[-1][counter])  # counters: the trained model's
    logged = float(read_metrics(tmp_path / "run" / "metrics.csv")[-1]["val/loss"])
    assert logged == pytest.approx(_val_loss(model, data), rel=1e-5)
    entry = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["coretune"]["averaging"]
    assert entry == {"weights": "sma", "sma_start_step": start, "sma_bn_pass": False, "steps_averaged": len(window)}


class _Batches(L.Callback):
    """Each optimiser step's training images, as the network took them."""

    def __init__(self) -> None:
        self.images: list[Tensor] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *_: Any
    ) -> None:
        self.images.append(pl_module.task.unpack(batch).inputs.detach().clone())


def _domainbed_sma_with_batch_norm_pass(
    model: FineTuner, steps: list[dict[str, Tensor]], images: list[Tensor], start: int
) -> dict[str, Tensor]:
    """DomainBed's ``ERMPlusPlus.update`` after each optimiser step, written out: ``update_sma`` (a copy of the
    weights before ``start``, then ``(count·sma + w_t) / (count + 1)`` over the averaged network's *current* state,
    BatchNorm statistics included; counters not averaged), then ``network_sma.train(); network_sma(x_t)``, which
    moves the averaged network's running statistics toward its own statistics of batch ``t``."""
    sma = copy.deepcopy(model)
    sma.load_state_dict(steps[0])
    count = 0
    for t in range(1, len(steps)):
        current = sma.state_dict()
        if t >= start:
            count += 1
            new = {k: (current[k] * count + w) / (1.0 + count) if w.is_floating_point() else current[k]
                   for k, w in steps[t].items()}  # fmt: skip
        else:
            new = {k: w.clone() if w.is_floating_point() else current[k] for k, w in steps[t].items()}
        sma.load_state_dict(new)
        sma.train()
        with torch.no_grad():
            sma(images[t - 1])
    return sma.state_dict()


@pytest.mark.parametrize("start", [3, 1], ids=["from-step-3", "from-step-1"])
def test_sma_passes_each_batch_through_the_average_as_domainbed(image_tree: Path, tmp_path: Path, start: int) -> None:
    """With the BatchNorm pass (the default, DomainBed's ``freeze_bn`` False) the weights are still the plain mean
    of every step's, and the running statistics are DomainBed's: its update and pass written out step by step."""
    snaps, batches = _Snapshots(), _Batches()
    model, trainer, _ = _fit(image_tree, tmp_path / "run", Averaging(sma_start_step=start), snaps, batches, epochs=2)
    assert len(batches.images) == trainer.global_step == 8
    thetas = [snaps.initial, *snaps.steps]
    expected = _domainbed_sma_with_batch_norm_pass(model, thetas, batches.images, start)
    plain = _domainbed_sma(thetas, start)
    final = model.state_dict()
    statistics = [k for k in final if "running_" in k]
    assert statistics
    for key, value in expected.items():
        if value.is_floating_point():
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=key)
    for key in (k for k in final if k.endswith("weight") or k.endswith("bias")):
        torch.testing.assert_close(final[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)  # weights: plain mean
    assert any(not torch.allclose(final[k], plain[k], rtol=1e-4, atol=1e-5) for k in statistics)  # the pass counts


def test_the_batch_norm_pass_moves_statistics_and_leaves_the_random_state_and_mode_alone() -> None:
    """The pass runs the batch through the averaged network in training mode (its running statistics move by the
    layer's momentum toward the batch's), forks the random state (a dropout in the network draws nothing from the
    run's stream) and puts the network back in the mode it was in."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.drop = nn.BatchNorm1d(4), nn.Dropout(0.5)
            self.task = SimpleNamespace(unpack=lambda batch: SimpleNamespace(inputs=batch[0]))

        def forward(self, x: Tensor) -> Tensor:
            return self.drop(self.bn(x))

    net = Net().eval()
    x = torch.randn(16, 4) * 3 + 1
    state = torch.random.get_rng_state()
    AveragedWeights._batch_norm_pass(SimpleNamespace(precision_plugin=Precision()), net, (x, torch.zeros(16)))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not net.training
    torch.testing.assert_close(net.bn.running_mean, 0.1 * x.mean(dim=0))
    torch.testing.assert_close(net.bn.running_var, 0.9 + 0.1 * x.var(dim=0, unbiased=True))


def test_sma_before_its_start_validates_the_trained_weights(image_tree: Path, tmp_path: Path) -> None:
    """Starting at step 6 of 8: epoch 0 (4 steps) validates and checkpoints the trained weights."""
    snaps = _Snapshots()
    model, _, data = _fit(image_tree, tmp_path / "run", Averaging(sma_start_step=6), snaps, epochs=2)
    model.load_state_dict(snaps.epochs[0])
    logged = float(read_metrics(tmp_path / "run" / "metrics.csv")[0]["val/loss"])
    assert logged == pytest.approx(_val_loss(model, data), rel=1e-5)
    assert model.averaging == {"weights": "sma", "sma_start_step": 6, "sma_bn_pass": True, "steps_averaged": 4}


def test_coretune_fit_records_which_weights_it_tested(image_tree: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["fit", f"--data.root={image_tree}", *TINY_FIT, *QUIET, f"--run_dir={run}", "--averaging.ema_decay=0.5"]
    main(args)
    results = json.loads((run / "results.json").read_text())
    assert results["averaging"] == {"weights": "ema", "ema_decay": 0.5, "updates": 4}
    main(args)  # the finished run, tested again: the average again (its checkpoint restored the trained weights)
    again = json.loads((run / "results.json").read_text())
    assert (again["averaging"], again["test"]) == (results["averaging"], results["test"])
    plain = tmp_path / "plain"
    main(["fit", f"--data.root={image_tree}", *TINY_FIT, *QUIET, f"--run_dir={plain}"])
    assert "averaging" not in json.loads((plain / "results.json").read_text())
    ckpt = torch.load(plain / "checkpoints" / "last.ckpt", weights_only=True)
    assert "averaging" not in ckpt["coretune"] and "current_model_state" not in ckpt  # off: checkpoints as before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--averaging.ema_decay=1.5"], "ema_decay must lie in (0, 1) (got 1.5)"),
        (["--averaging.ema_decay=0.9", "--averaging.swa_start=0.5"], "choose one"),
        (["--averaging.sma_start_step=600", "--averaging.swa_start=0.5"], "swa_start and sma_start_step are 2"),
        (["--averaging.sma_start_step=0"], "sma_start_step must be an optimiser step >= 1 (got 0)"),
        (["--averaging.sma_bn_pass=false"], "sma_bn_pass false needs sma_start_step"),
        (["--averaging.swa_lr=0.1"], "swa_lr needs swa_start"),
        (["--averaging.swa_start=2.5"], "swa_start must be a whole number"),
        (["--averaging.swa_start=1"], "at or after the run's last epoch"),
    ],
)
def test_bad_averaging_settings_are_one_line(image_tree: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    args = ["fit", f"--data.root={image_tree}", *TINY_FIT, *QUIET, f"--run_dir={tmp_path / 'run'}", *flags]
    assert message in error(args)
