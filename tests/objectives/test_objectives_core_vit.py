"""Core-tuning on ViTs: the feature the objective gets from a timm ViT or DeiT is its pre-logits vector,
``forward_head(forward_features(x), pre_logits=True)`` (the class token after the final norm; the mean of the patch
tokens after ``fc_norm`` for ``global_pool='avg'``), and hardness-directed mixup mixes those vectors."""

from pathlib import Path
from typing import Any

import pytest
import torch

from coretune.data import ImageClassificationData
from coretune.engine import FineTuner, make_trainer
from coretune.engine.optim import OptimSettings
from coretune.mining import HardPairMiner
from coretune.objectives import create

TINY = {"img_size": 32, "patch_size": 8, "depth": 1}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("core_vit"), per_class=2, val_per_class=1)


@pytest.mark.parametrize(
    ("backbone", "options"),
    [("vit_tiny_patch16_224", {}), ("deit_tiny_patch16_224", {}), ("vit_tiny_patch16_224", {"global_pool": "avg"})],
)
def test_core_tuning_on_a_vit_contrasts_and_mixes_its_pre_logits_vector(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backbone: str, options: dict[str, Any]
) -> None:
    """One Core-tuning step of a tiny ViT (with layer decay): the features handed to the objective are the model's
    pre-logits vectors of the step's images, and the miner's z⁺ and z⁻ are mixtures of those rows."""
    seen: dict[str, Any] = {}
    mine = HardPairMiner.mine

    def recording_mine(self: HardPairMiner, features: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        pairs = mine(self, features, *args, **kwargs)
        seen.setdefault("pairs", (features.detach(), pairs))
        return pairs

    monkeypatch.setattr(HardPairMiner, "mine", recording_mine)
    model = FineTuner(
        create("core"),
        backbone=backbone,
        backbone_args={**TINY, **options},
        optim=OptimSettings(optimizer="adamw", lr=1e-3, layer_decay=0.75),
    )
    body = model.backbone.body

    def record(objective: Any, args: tuple, kwargs: dict) -> None:
        if "features" not in seen:
            with torch.no_grad():
                expected = body.forward_head(body.forward_features(kwargs["inputs"]), pre_logits=True)
            seen["features"], seen["expected"] = args[0].detach(), expected

    model.objective.register_forward_pre_hook(record, with_kwargs=True)
    data = ImageClassificationData(root=str(root), image_size=32, batch_size=6, num_workers=0)
    trainer = make_trainer(
        tmp_path / "run", progress=False, max_epochs=1, limit_train_batches=1, limit_val_batches=0,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    z = seen["features"]
    assert z.shape == (6, body.num_features) == (6, 192)
    torch.testing.assert_close(z, seen["expected"])
    if options.get("global_pool") == "avg":  # the patch tokens' mean after fc_norm, no class token
        tokens = body.forward_features(torch.zeros(1, 3, 32, 32))
        assert tokens.shape[1] == 17 and isinstance(body.fc_norm, torch.nn.LayerNorm)
    features, pairs = seen["pairs"]
    torch.testing.assert_close(features, z)
    lp, ln = pairs.lam_pos[:, None], pairs.lam_neg[:, None]
    torch.testing.assert_close(
        pairs.pos_features, lp * z[pairs.hardest_positive] + (1 - lp) * z[pairs.hardest_negative]
    )
    torch.testing.assert_close(pairs.neg_features, (1 - ln) * z + ln * z[pairs.random_negative])
    assert model.objective.projector is not None and model.objective.feature_dim == 192
