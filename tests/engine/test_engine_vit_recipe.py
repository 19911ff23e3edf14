"""The ViT fine-tuning recipe's CPU config (configs/cpu/vit_s16_dino.yaml) runs end to end: one epoch of a few
images, with AdamW, layer decay, drop path, label smoothing, warm-up and RandAugment as the config sets them."""

from pathlib import Path

import torch
import yaml

from coretune.cli import main
from fit_flags import QUIET

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cpu" / "vit_s16_dino.yaml"


def test_the_cpu_vit_recipe_runs_end_to_end(tmp_path: Path) -> None:
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "data", per_class=3, val_per_class=1)
    run = tmp_path / "run"
    # 2 of the 12 blocks: the recipe as configured, on a shallower ViT-Tiny (seconds on a CPU)
    main(["fit", f"--config={CONFIG}", f"--data.root={root}", "--model.backbone_args.depth=2", "--trainer.max_epochs=1",
          "--data.batch_size=4", "--data.num_workers=0", f"--run_dir={run}", *QUIET])  # fmt: skip
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["backbone_args"] == {"img_size": 32, "patch_size": 4, "drop_path_rate": 0.1, "depth": 2}
    assert config["model"]["optim"]["layer_decay"] == 0.75 and config["model"]["optim"]["optimizer"] == "adamw"
    assert config["objective"]["init_args"]["label_smoothing"] == 0.1
    assert config["data"]["auto_augment"] == "rand-m9-mstd0.5-inc1"
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    groups = state["optimizer_states"][0]["param_groups"]
    scales = sorted({round(g["initial_lr"] / 0.00025, 6) for g in groups})
    assert scales == [0.75**3, 0.75**2, 0.75, 1.0]  # stem, blocks 0 and 1, the final norm and the heads
    assert (run / "results.json").is_file()
