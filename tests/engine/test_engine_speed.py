"""Speed options (issue 62): channels_last by architecture, ``--model.compile`` with its eager fallback and eager-key
checkpoints, and the 16-mixed gradient scaler's skipped steps reported."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from coretune.cli import main
from coretune.engine import FineTuner, make_trainer
from coretune.engine.health import GradScalerWatch
from coretune.engine.speed import compile_in_place, conv_share, prefers_channels_last
from coretune.objectives import create
from fit_flags import QUIET, TINY_FIT

# -- channels_last ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backbone", ["small_cnn", "resnet18"])
def test_auto_channels_last_is_on_for_cnns_as_before(backbone: str) -> None:
    """The default stays channels-last for the CNNs (their seeded pins hold: tests/engine/test_engine_fit.py)."""
    model = FineTuner(backbone=backbone)
    assert model.hparams.channels_last == "auto" and model.channels_last
    assert conv_share(model.backbone) > 0.99
    weight = next(p for p in model.backbone.parameters() if p.dim() == 4)
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert model._images(torch.zeros(2, 3, 8, 8)).is_contiguous(memory_format=torch.channels_last)


def test_auto_channels_last_is_off_for_a_vit() -> None:
    pytest.importorskip("timm")
    model = FineTuner(backbone="timm/vit_tiny_patch16_224", backbone_args={"img_size": 32})
    assert not model.channels_last and not prefers_channels_last(model.backbone)
    x = torch.zeros(2, 3, 32, 32)
    assert model._images(x) is x  # no copy into another layout


def test_channels_last_given_is_obeyed_and_a_bad_value_is_named() -> None:
    assert not FineTuner(backbone="small_cnn", channels_last=False).channels_last
    assert prefers_channels_last(nn.Sequential(nn.Conv2d(3, 8, 3))) and not prefers_channels_last(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.MultiheadAttention(8, 2))
    )
    with pytest.raises(ValueError, match=r"^invalid model settings: channels_last must be true, false or auto"):
        FineTuner(backbone="small_cnn", channels_last="yes")  # type: ignore[arg-type]


# -- compile: the fallback, without a compiler (a backend that fails) ---------------------------------------------


def failing_backend(gm: Any, example_inputs: Any) -> Any:
    raise RuntimeError("no working C++ compiler found\nsecond line")


def test_a_failed_compilation_falls_back_to_eager_with_one_line() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    x = torch.randn(5, 4)
    expected = module(x)
    lines: list[str] = []
    guard = compile_in_place(module, "the backbone", lines.append, backend=failing_backend)
    assert list(module.state_dict()) == ["0.weight", "0.bias"]  # in place: the eager keys
    assert torch.equal(module(x), expected)
    assert guard.status == "eager: BackendCompilerFailed, RuntimeError: no working C++ compiler found"
    assert len(lines) == 1 and "torch.compile of the backbone failed" in lines[0] and "\n" not in lines[0]
    assert torch.equal(module(x), expected) and len(lines) == 1  # eager from then on: said once
    assert module._compiled_call_impl is None


def test_a_bad_input_is_the_eager_error_and_a_copy_runs_eager() -> None:
    module = nn.Linear(4, 3)
    lines: list[str] = []
    guard = compile_in_place(module, "the backbone", lines.append, backend="eager")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        module(torch.randn(2, 5))
    assert guard.status == "compiled" and module._compiled_call_impl is guard and not lines
    copied = copy.deepcopy(module)  # e.g. Bi-tuning's key encoder: its own weights, not the original's call
    assert copied._compiled_call_impl is None
    with torch.no_grad():
        copied.weight.zero_()
        copied.bias.zero_()
    assert torch.equal(copied(torch.ones(1, 4)), torch.zeros(1, 3))
    assert compile_in_place(module) is guard  # compiled once


# -- compile: a real (inductor) fit, its checkpoint in an eager `coretune test` ----------------------------------


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_a_compiled_fit_writes_eager_checkpoints(image_tree: Path, tmp_path: Path) -> None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile's inductor needs a C++ compiler on CPU (g++): apt-get install g++")
    run = tmp_path / "run"
    main(["fit", f"--data.root={image_tree}", *TINY_FIT, "--model.compile=true", f"--run_dir={run}", *QUIET])
    results = json.loads((run / "results.json").read_text())
    assert results["compile"] == "compiled"
    ckpt = torch.load(run / "checkpoints" / "best.ckpt", weights_only=True)
    eager = FineTuner(create("ce"), backbone="small_cnn")
    eager.build(3)
    assert set(ckpt["state_dict"]) == set(eager.state_dict())  # no _orig_mod. prefix
    assert ckpt["hyper_parameters"]["compile"] is True
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'best.ckpt'}", f"--data.root={image_tree}"])
    tested = json.loads((run / "test_results.json").read_text())["test"]  # eager: the compiled fit's own test's
    assert tested["top1"] == pytest.approx(results["test"]["top1"])


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_a_fit_without_a_working_compiler_trains_eager_and_says_so(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("/nonexistent/g++",))  # as on a machine without a C++ compiler
    monkeypatch.setattr(config, "fx_graph_cache", False)  # compiled kernels of another test would need none
    torch._dynamo.reset()  # nor would the graphs this process compiled for small_cnn in another test
    run = tmp_path / "run"
    main(["fit", f"--data.root={image_tree}", *TINY_FIT, "--model.compile=true", f"--run_dir={run}", *QUIET])
    status = json.loads((run / "results.json").read_text())["compile"]
    assert status.startswith("eager: ") and "/nonexistent/g++" in status, status
    lines = [line for line in capsys.readouterr().err.splitlines() if "torch.compile" in line]
    assert len(lines) == 1 and lines[0].startswith("coretune: torch.compile of the backbone failed"), lines


# -- 16-mixed: a scaler that keeps skipping steps ---------------------------------------------------------------


class InfiniteGradients(L.Callback):
    """Every gradient infinite: each optimiser step is skipped by the scaler."""

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.fill_(float("inf"))


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")  # the skipped steps
@pytest.mark.filterwarnings("ignore:.*could not find the monitored key")  # max_steps=4: no validation
def test_a_scaler_that_keeps_skipping_steps_is_reported(
    image_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coretune.data import ImageClassificationData

    data = ImageClassificationData(str(image_tree), image_size=16, batch_size=4, num_workers=0)
    model = FineTuner(create("ce"), backbone="small_cnn")
    before = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    trainer = make_trainer(
        tmp_path,
        progress=False,
        max_steps=4,
        precision=None,  # the plugin says it
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        plugins=[MixedPrecision("16-mixed", "cpu")],  # Lightning's Trainer turns 16-mixed on a CPU into bf16
        callbacks=[InfiniteGradients(), GradScalerWatch(streak=3)],
    )
    trainer.fit(model, datamodule=data)
    lines = [line for line in capsys.readouterr().err.splitlines() if "gradient scaler" in line]
    assert len(lines) == 1 and "skipped the last 3 optimiser steps in a row" in lines[0]
    record = json.loads((tmp_path / "results.json").read_text())["grad_scaler"]
    assert record == {"skipped_steps": 4, "longest_skipped_run": 4, "scale": 2.0**12}  # 2^16 halved at each step
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if "running" not in k and "num_batches" not in k)


def test_the_scaler_watch_counts_runs_of_skips_and_resets() -> None:
    watch = GradScalerWatch(streak=2)

    class Scaler:
        scale = 8.0

        def is_enabled(self) -> bool:
            return True

        def get_scale(self) -> float:
            return self.scale

    class Trainer:
        precision_plugin = type("P", (), {"scaler": Scaler()})()
        global_step, current_epoch, is_global_zero = 0, 0, False

    trainer: Any = Trainer()
    for step, scale in enumerate([8.0, 4.0, 4.0, 2.0, 1.0, 0.5, 1.0], start=1):
        trainer.global_step, trainer.precision_plugin.scaler.scale = step, scale
        watch.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
        watch.on_train_batch_end(trainer, None, None, None, 1)  # type: ignore[arg-type]  (no step: not counted)
    assert watch.record() == {"skipped_steps": 4, "longest_skipped_run": 3, "scale": 1.0}
    assert GradScalerWatch().record() is None
    trainer.precision_plugin = None  # 32-true, bf16-mixed: no scaler, nothing to watch
    watch.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    assert watch.record() == {"skipped_steps": 4, "longest_skipped_run": 3, "scale": 1.0}
    with pytest.raises(ValueError, match="streak must be >= 1"):
        GradScalerWatch(streak=0)
