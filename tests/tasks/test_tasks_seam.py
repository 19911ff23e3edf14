"""The task seam: extras reach the objective, the batch-transform hook, ``--task`` recorded and followed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from coretune.cli import main
from coretune.data import TaskDataDefaults
from coretune.engine import FineTuner, make_trainer
from coretune.engine.fitargs import task_of_args
from coretune.objectives import CETuning, ObjectiveOutput
from coretune.tasks import TASKS, Batch, ClassificationTask, get_task
from fit_flags import QUIET, TINY_FIT


class _DomainData(TaskDataDefaults, L.LightningDataModule):
    """Random 16 px images, 3 classes, a domain label per image: batches ``(x, y, d)``."""

    num_classes, class_names, image_size, batch_size = 3, ["a", "b", "c"], 16, 4
    mean = std = (0.5, 0.5, 0.5)

    def _loader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y, d = torch.randn(8, 3, 16, 16, generator=g), torch.arange(8) % 3, torch.arange(8) % 2
        return DataLoader(TensorDataset(x, y, d), batch_size=4)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()


class _DomainTask(ClassificationTask):
    def unpack(self, batch: Any) -> Batch:
        return Batch(batch[0], batch[1], {"domains": batch[2]})


class _DomainCE(CETuning):
    """CE-tuning that records the domain labels it is given."""

    def forward(
        self, features: Tensor, labels: Tensor, *, inputs: Tensor | None = None, domains: Tensor | None = None
    ) -> ObjectiveOutput:
        self.seen.append(domains)
        return super().forward(features, labels, inputs=inputs)


def test_batch_extras_reach_the_objective_and_the_batch_transform_replaces_the_batch(tmp_path: Path) -> None:
    objective = _DomainCE()
    objective.seen = []
    model = FineTuner(objective, backbone="small_cnn", channels_last=False)
    model.task = _DomainTask()
    transformed: list[int] = []

    def double(module: FineTuner, batch: Batch) -> Batch:  # e.g. adversarial training's clean + attacked images
        assert module is model and module.training
        transformed.append(len(batch))
        return Batch(torch.cat([batch.inputs, -batch.inputs]), batch.targets.repeat(2), batch.extras)

    model.batch_transform = double
    trainer = make_trainer(tmp_path, progress=False, max_epochs=1, enable_model_summary=False)
    trainer.fit(model, datamodule=_DomainData())
    assert transformed == [4, 4]
    assert [d.tolist() for d in objective.seen] == [[0, 1, 0, 1], [0, 1, 0, 1]]


def test_task_registry_and_the_task_of_a_command_line(tmp_path: Path) -> None:
    assert list(TASKS) == ["classification", "segmentation", "domain_generalization"]
    with pytest.raises(
        ValueError,
        match=r"^unknown task 'detection'; choose one of: classification, segmentation, domain_generalization$",
    ):
        get_task("detection")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"task": "segmentation"}}))
    assert task_of_args([]) == "classification"
    assert task_of_args(["--task", "segmentation"]) == "segmentation"
    assert task_of_args([f"--config={config}"]) == "segmentation"
    assert task_of_args(["--config", str(config), "--task=segmentation"]) == "segmentation"
    with pytest.raises(ValueError) as info:
        task_of_args(["--config", str(config), "--task", "classification"])
    assert str(info.value) == (
        f"--config {config} is the configuration of a segmentation run (model.task: segmentation) but --task "
        "classification was given: drop --task to run it as segmentation, or pass a classification configuration"
    )


def test_fit_records_the_task_in_config_yaml_and_the_checkpoint(image_tree: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    main(["fit", "--task", "classification", f"--data.root={image_tree}", f"--run_dir={run}", *TINY_FIT, *QUIET])
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["task"] == "classification"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["coretune"]["task"] == ckpt["hyper_parameters"]["task"] == "classification"
    assert FineTuner.from_checkpoint(run / "checkpoints" / "last.ckpt").task.name == "classification"


@pytest.mark.parametrize("task_name", ["classification", "domain_generalization"])
def test_predict_reads_images_as_the_tasks_test_split_does(task_name: str, tmp_path: Path) -> None:
    """``Task.image_transform`` (what ``coretune predict`` uses) is the data module's own test-split reading: same
    tensor from a wide image, same draft size — one definition, not two that can drift apart."""
    from PIL import Image

    from coretune.data import DomainGeneralizationData, ImageClassificationData
    from domain_trees import make_domain_tree
    from image_trees import make_image_tree

    if task_name == "classification":
        data: Any = ImageClassificationData(str(make_image_tree(tmp_path / "t", size=24)), image_size=16)
    else:
        data = DomainGeneralizationData(str(make_domain_tree(tmp_path / "t")), test_domains="photo", image_size=16)
    data.setup()
    split = data.test_dataset.parts[0] if task_name == "domain_generalization" else data.test_dataset
    transform, draft = get_task(task_name)().image_transform(16, data.mean, data.std)
    assert draft == split.draft_size
    wide = Image.fromarray(torch.randint(0, 255, (16, 48, 3), dtype=torch.uint8).numpy())
    assert torch.equal(transform(wide), split.transform(wide))
