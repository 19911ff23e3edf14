"""Optimisers and schedules (paper Appendix C): SGD + Nesterov, cosine / linear decay, warm-up."""

import itertools
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from coretune.cli import main
from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, build_optimizer, lr_factor, make_trainer, read_metrics
from coretune.engine.optim import optimizer_problems
from coretune.objectives import create
from fit_flags import QUIET, TINY_FIT


def test_cosine_schedule_matches_formula() -> None:
    total = 100
    for step in (0, 10, 50, 99, 100):
        assert lr_factor(step, total, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * step / total)))


def test_linear_schedule_and_warmup() -> None:
    assert lr_factor(0, 100, "linear") == 1.0
    assert lr_factor(50, 100, "linear") == pytest.approx(0.5)
    assert lr_factor(100, 100, "linear") == 0.0
    # warm-up rises linearly to 1, then decay starts from 1
    assert [lr_factor(s, 110, "linear", warmup_steps=10) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, 110, "linear", warmup_steps=10) == 1.0
    assert lr_factor(60, 110, "linear", warmup_steps=10) == pytest.approx(0.5)
    assert lr_factor(7, 100, "constant") == 1.0


def test_poly_schedule_is_deeplabs() -> None:
    assert [lr_factor(s, 100, "poly") for s in (0, 50, 75, 100)] == pytest.approx([1.0, 0.5**0.9, 0.25**0.9, 0.0])
    assert lr_factor(60, 110, "poly", warmup_steps=10) == pytest.approx(0.5**0.9)


def test_exponential_schedule_falls_tenfold_at_a_constant_rate() -> None:
    factors = [lr_factor(s, 200, "exponential") for s in range(201)]
    assert factors[0] == 1.0 and factors[100] == pytest.approx(0.1**0.5) and factors[200] == pytest.approx(0.1)
    ratios = [b / a for a, b in itertools.pairwise(factors)]
    assert ratios == pytest.approx([0.1 ** (1 / 200)] * 200)
    assert lr_factor(4, 110, "exponential", warmup_steps=10) == pytest.approx(0.5)  # warm-up first


def test_unknown_schedule_and_optimizer() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_factor(0, 10, "step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown optimizer 'lbfgs'"):
        build_optimizer([([torch.nn.Parameter(torch.zeros(1))], 0.1)], "lbfgs")  # type: ignore[arg-type]


def test_sgd_groups_have_their_own_lr_and_paper_settings() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([([a], 0.001), ([b], 0.01), ([], 0.5)], "sgd")
    assert isinstance(opt, torch.optim.SGD)
    assert [g["lr"] for g in opt.param_groups] == [0.001, 0.01]
    assert all(g["nesterov"] and g["momentum"] == 0.9 and g["weight_decay"] == 1e-4 for g in opt.param_groups)
    assert isinstance(build_optimizer([([a], 0.1)], "adam"), torch.optim.Adam)


def test_optimizer_problems_name_every_bad_setting() -> None:
    assert optimizer_problems(lr=0.01, weight_decay=0.0, momentum=0.0, warmup_epochs=0.0) == []
    assert optimizer_problems(lr=0.0, weight_decay=-1.0, momentum=1.0, warmup_epochs=-0.5) == [
        "lr must be > 0 (got 0.0)",
        "weight_decay must be >= 0 (got -1.0)",
        "momentum must lie in [0, 1) (got 1.0)",
        "warmup_epochs must be >= 0 (got -0.5)",
    ]


@pytest.mark.parametrize(("objective", "decay"), [("ce", 1e-4), ("l2sp", 0.0), ("delta", 0.0)])
def test_l2sp_and_delta_train_without_weight_decay(objective: str, decay: float, tmp_path: Path) -> None:
    """The reference implementations of L2-SP and DELTA use no weight decay (their penalties replace it): every
    parameter group of the fit's optimiser has none, whatever --model.optim.weight_decay says; other objectives keep
    it."""
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data")
    run = tmp_path / "run"
    main(["fit", f"--data.root={root}", *TINY_FIT, "--model.optim.weight_decay=1e-4", f"--objective={objective}",
          f"--run_dir={run}", *QUIET])  # fmt: skip
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    groups = state["optimizer_states"][0]["param_groups"]
    assert len(groups) == 2 and [g["weight_decay"] for g in groups] == [decay, decay]


class FirstStepLr(L.Callback):
    """Records the heads' learning rate of each optimiser step a fit takes (before the step)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[-1]["lr"])


@pytest.mark.parametrize("command", ["fit", "pretrain"])
def test_an_extended_run_steps_at_its_stretched_schedules_lr_from_the_first_step(command: str, tmp_path: Path) -> None:
    """A finished 2-epoch run (4 steps an epoch), extended to 4: its cosine schedule stretches to 16 steps, and the
    first step after the resume runs at its value for step 8, lr/2, as metrics.csv records for epoch 3. It ran at
    the restored lr of the old schedule's end, 0.0, and metrics.csv said 0.0."""
    from coretune.pretrain import PretrainData, SimCLR, make_pretrain_trainer
    from image_trees import make_image_folder, make_image_tree

    if command == "fit":
        data = ImageClassificationData(root=str(make_image_tree(tmp_path / "data")), image_size=16, batch_size=8)
        new_model = lambda: FineTuner(create("ce"), backbone="small_cnn")  # noqa: E731
        trainer = lambda epochs, *cb: make_trainer(tmp_path / "run", progress=False, max_epochs=epochs,  # noqa: E731
                                                   enable_model_summary=False, callbacks=list(cb))  # fmt: skip
    else:
        data = PretrainData(root=str(make_image_folder(tmp_path / "data", n=16)), image_size=16, batch_size=4)
        new_model = lambda: SimCLR(backbone="small_cnn", proj_dim=16)  # noqa: E731
        trainer = lambda epochs, *cb: make_pretrain_trainer(tmp_path / "run", max_epochs=epochs,  # noqa: E731
            enable_progress_bar=False, enable_model_summary=False, callbacks=list(cb))  # fmt: skip
    model = new_model()
    lr = model.optim.lr if command == "fit" else model.hparams.lr
    trainer(2).fit(new_model(), datamodule=data)
    steps = FirstStepLr()
    trainer(4, steps).fit(new_model(), datamodule=data, ckpt_path=str(tmp_path / "run" / "checkpoints" / "last.ckpt"))
    assert steps.lrs[0] == pytest.approx(lr * lr_factor(8, 16)) == pytest.approx(lr / 2)
    assert steps.lrs[1:4] == pytest.approx([lr * lr_factor(s, 16) for s in (9, 10, 11)])
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [4, 8, 12, 16]
    assert float(rows[2]["lr"]) == pytest.approx(lr / 2)
