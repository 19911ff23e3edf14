"""``--model.drop_path R``: the alias of ``--model.backbone_args.drop_path_rate R`` (timm's stochastic depth), in
flags and ``--config`` files; refused in one line for a backbone without drop path or a rate outside [0, 1)."""

import re
from pathlib import Path

import pytest

from coretune.engine.fitcli import resolved_fit_config
from fit_flags import QUIET, error


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("drop_path"), per_class=2, val_per_class=1)


def test_drop_path_is_backbone_args_drop_path_rate(root: Path, tmp_path: Path) -> None:
    base = [f"--data.root={root}", "--model.backbone=vit_tiny_patch16_224", f"--run_dir={tmp_path / 'run'}"]
    config = resolved_fit_config([*base, "--model.backbone_args={img_size: 32}", "--model.drop_path", "0.1"])
    assert config["model"]["backbone_args"] == {"img_size": 32, "drop_path_rate": 0.1}
    file = tmp_path / "vit.yaml"
    file.write_text("model:\n  drop_path: 0.2\n  backbone_args: {patch_size: 8}\n")
    config = resolved_fit_config([f"--config={file}", *base])
    assert config["model"]["backbone_args"] == {"patch_size": 8, "drop_path_rate": 0.2}
    assert "drop_path" not in config["model"]


def test_the_vit_built_takes_the_rate() -> None:
    from coretune.engine import FineTuner

    model = FineTuner(
        backbone="vit_tiny_patch16_224", backbone_args={"img_size": 32, "depth": 2, "drop_path_rate": 0.1}
    )
    rates = [getattr(block.drop_path1, "drop_prob", 0.0) for block in model.backbone.body.blocks]
    assert rates == pytest.approx([0.0, 0.1])  # timm's linear rule over the depth (0: an Identity)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.backbone=small_cnn", "--model.drop_path=0.1"], r"backbone 'small_cnn' has no drop path .*drop it"),
        (["--model.backbone=resnet18", "--model.drop_path=0.1"], r"backbone 'resnet18' has no drop path"),
        (["--model.drop_path=1.5"], r"--model.drop_path must be a rate in \[0, 1\) \(got '1.5'"),
        (["--model.drop_path=lots"], r"--model.drop_path must be a rate in \[0, 1\) \(got 'lots'"),
    ],
)
def test_a_bad_drop_path_is_refused_in_one_line(root: Path, tmp_path: Path, args: list[str], message: str) -> None:
    assert re.search(message, error(["fit", f"--data.root={root}", f"--run_dir={tmp_path}", *args, *QUIET]))
