"""ERM++'s head-only warm-up (DomainBed's ``ERMPlusPlus``): the backbone is held for the updates DomainBed makes with
its linear optimiser, then trains; the step count survives a checkpoint."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, make_trainer
from coretune.objectives import ERMPlusPlus, create


def _domainbed_linear_updates(linear_steps: int, updates: int) -> list[bool]:
    """DomainBed's loop: ``update`` picks the linear optimiser unless ``global_iter > linear_steps``, and
    ``update_sma`` counts ``global_iter += 1`` after each update."""
    linear = []
    for global_iter in range(updates):  # the updates made before this one
        linear.append(not global_iter > linear_steps)
    return linear


@pytest.mark.parametrize("linear_steps", [0, 2, 5])
def test_the_warm_up_holds_the_features_for_domainbeds_linear_updates(linear_steps: int) -> None:
    torch.manual_seed(0)
    objective = ERMPlusPlus(linear_steps=linear_steps, num_classes=3, feature_dim=4)
    held = []
    for _ in range(8):
        z = torch.randn(6, 4, requires_grad=True)
        out = objective(z, torch.randint(0, 3, (6,)))
        out.loss.backward()
        held.append(z.grad is None)
        assert float(out.terms["warmup"]) == float(held[-1])
        assert objective.classifier.weight.grad is not None  # the head always trains
        objective.zero_grad()
        objective.on_after_optimizer_step()
    assert held == _domainbed_linear_updates(linear_steps, 8)
    assert int(objective.state_dict()["steps"]) == 8  # in checkpoints: a resumed run goes on counting


def test_a_fit_holds_the_backbone_then_trains_it(image_tree: Path, tmp_path: Path) -> None:
    """small_cnn, batches of 4: the backbone's parameters are unchanged by the first linear_steps + 1 = 2 steps and
    move at each step after; its BatchNorm statistics follow the data throughout (training mode, as DomainBed)."""

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.moved: list[bool] = []

        def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
            self.before = [p.detach().clone() for p in module.backbone.parameters()]

        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
            now = list(module.backbone.parameters())
            self.moved.append(any(not torch.equal(a, b) for a, b in zip(self.before, now, strict=True)))

    L.seed_everything(0)
    model = FineTuner(create("erm_pp", linear_steps=1), backbone="small_cnn")
    stats = [b.clone() for n, b in model.backbone.named_buffers() if "running_mean" in n]
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=4, seed=0)
    watch = Watch()
    make_trainer(tmp_path, progress=False, max_epochs=1, enable_model_summary=False, callbacks=[watch]).fit(
        model, datamodule=data
    )
    assert len(watch.moved) >= 3
    assert watch.moved == [False, False] + [True] * (len(watch.moved) - 2)
    after = [b for n, b in model.backbone.named_buffers() if "running_mean" in n]
    assert all(not torch.equal(a, b) for a, b in zip(stats, after, strict=True))


def test_a_bad_linear_steps_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"invalid ERM\+\+ settings: linear_steps must be an int >= 0 \(got -1\)"):
        ERMPlusPlus(linear_steps=-1)
