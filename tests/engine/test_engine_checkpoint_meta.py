"""The pieces split out of FineTuner (issue 61): its checkpoint entry (``engine/checkpoint.py``) and the output
health callback every FineTuner installs (``engine/health.py``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from coretune.data import ImageClassificationData
from coretune.engine import CheckpointMeta, FineTuner, NonFiniteLossError, OutputHealth
from coretune.objectives import create


def test_the_checkpoint_entry_round_trips_and_keeps_other_versions_entries() -> None:
    model = FineTuner(create("core"), backbone="small_cnn")
    model.build(3, ["a", "b", "c"])
    entry = CheckpointMeta.of(model).as_dict()
    assert list(entry) == [
        "task", "data", "objective", "objective_class", "objective_hparams", "num_classes", "class_names",
        "train_class_counts", "feature_dim", "adversarial", "weights_sha256",
    ]  # fmt: skip
    assert entry["objective"] == "core" and entry["class_names"] == ["a", "b", "c"] and entry["data"] == {}
    later = {**entry, "data": {"image_size": 16, "mean": (0.5, 0.5, 0.5)}, "added_later": 1}
    meta = CheckpointMeta.from_entry(later)
    assert meta.as_dict() == later and meta.extra == {"added_later": 1}
    assert meta.trained_data == {"image_size": 16, "mean": [0.5, 0.5, 0.5]}
    assert model.checkpoint_info == {} and model.trained_data == {}  # not loaded from a checkpoint


def test_a_plain_trainer_gets_one_output_health_check_across_fit_and_test(image_tree: Path, tmp_path: Path) -> None:
    model = FineTuner(create("ce"), backbone="small_cnn")
    data = ImageClassificationData(root=str(image_tree), image_size=16, batch_size=9)
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)
    assert sum(isinstance(c, OutputHealth) for c in trainer.callbacks) == 1
    # a collapsed model (the same logits for every image) fails the test epoch
    torch.nn.init.zeros_(model.objective.classifier.weight)
    model.backbone.requires_grad_(False)
    for p in model.backbone.parameters():
        torch.nn.init.zeros_(p)
    with pytest.raises(NonFiniteLossError, match=r"^the model collapsed at epoch \d+, step 1: all \d+ test images"):
        trainer.test(model, datamodule=data, verbose=False)
