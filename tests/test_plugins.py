"""Adding an objective or a checkpoint layout is one class or function plus a decorator, from user code (this file)
alone: ``coretune fit --objective NAME`` trains with it, ``--model.weights_options.format NAME`` (and auto-detection)
loads with it, without any edit of coretune (issue 61; the task's counterpart is ``tests/tasks/test_tasks_plugin.py``).
docs/architecture.md shows these examples."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from coretune.cli import main
from coretune.engine import FineTuner
from coretune.models import checkpoints as layouts_registry
from coretune.models import create_backbone
from coretune.models.checkpoints import Extraction, extract_prefixed, register_layout
from coretune.objectives import Objective, ObjectiveOutput, register
from coretune.objectives import base as objectives_registry
from fit_flags import QUIET, TINY_FIT


@pytest.fixture
def restored_registries(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The objective and layout registries as they were, after the test (its registrations dropped)."""
    monkeypatch.setattr(objectives_registry, "_REGISTRY", dict(objectives_registry._REGISTRY))
    monkeypatch.setattr(layouts_registry, "_LAYOUTS", dict(layouts_registry._LAYOUTS))
    yield


class SmoothedCE(Objective):
    """A user's objective: ``L = CE_ε(G_y(z), y)``, label smoothing ε = ``smoothing``."""

    def __init__(self, smoothing: float = 0.1) -> None:
        super().__init__()
        self.smoothing = smoothing

    def forward(self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None) -> ObjectiveOutput:
        logits = self.classifier(features)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.smoothing)
        return ObjectiveOutput(loss, logits, {"ce": loss.detach(), "loss": loss.detach()})


def test_an_objective_registered_in_user_code_trains_through_the_cli(
    restored_registries: None, image_tree: Path, tmp_path: Path
) -> None:
    register("ce_smooth", doc="CE with label smoothing (a user's objective).")(SmoothedCE)  # @register in user code
    run = tmp_path / "run"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={image_tree}", f"--run_dir={run}", "--objective", "ce_smooth",
          "--objective.smoothing", "0.2"])  # fmt: skip
    results = json.loads((run / "results.json").read_text())
    assert results["test"]["top1"] is not None
    assert "smoothing: 0.2" in (run / "config.yaml").read_text()
    # the user's class, with the command line's setting, is what trained and what the checkpoint rebuilds
    model = FineTuner.from_checkpoint(run / "checkpoints" / "last.ckpt")
    assert type(model.objective) is SmoothedCE and model.objective.smoothing == 0.2
    features, labels = torch.randn(5, model.backbone.feature_dim), torch.tensor([0, 1, 2, 0, 1])
    expected = F.cross_entropy(model.objective.classifier(features), labels, label_smoothing=0.2)
    assert torch.allclose(model.objective(features, labels).loss, expected)


def test_a_checkpoint_layout_registered_in_user_code_loads_weights(restored_registries: None, tmp_path: Path) -> None:
    @register_layout("mytrainer", "MyTrainer: 'model' entry with 'student.backbone.'; its head dropped")
    def mytrainer(raw: Mapping[str, Any], encoder: Any) -> Extraction | None:
        return extract_prefixed(raw, ("model",), ("student.backbone.",), ("head",), encoder.body.state_dict().keys())

    source = create_backbone("small_cnn")
    state = {f"student.backbone.{k}": v for k, v in source.body.state_dict().items()}
    state["student.head.weight"] = torch.zeros(3, 3)
    path = tmp_path / "mytrainer.pth"
    torch.save({"model": state, "epoch": 7}, path)
    for weights_format in ("mytrainer", "auto"):
        loaded = create_backbone("small_cnn", weights=str(path), weights_format=weights_format)
        for key, value in source.body.state_dict().items():
            assert torch.equal(loaded.body.state_dict()[key], value), key
