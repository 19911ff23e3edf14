"""``coretune interpolate`` (WiSE-FT, :mod:`coretune.apps.interpolate`): the endpoints, the α chosen on the
validation split, BatchNorm statistics, pre-trained starts and the outputs it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coretune.apps.interpolate import _start_state, interpolated_state
from coretune.cli import main
from coretune.data import ImageClassificationData
from coretune.engine import FineTuner
from coretune.objectives import create
from fit_flags import QUIET, TINY_FIT, error


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tree, a fine-tuned checkpoint (a quarter of train/ held out for validation) and a start checkpoint of the
    same network: the untrained model (random heads and backbone), as a crafted coretune checkpoint."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("wise")
    tree = make_image_tree(base / "data")
    main(["fit", f"--data.root={tree}", *TINY_FIT, *QUIET, f"--run_dir={base / 'run'}", "--data.val_fraction=0.25"])
    end = base / "run" / "checkpoints" / "last.ckpt"
    raw = torch.load(end, weights_only=True)
    torch.manual_seed(1)
    fresh = FineTuner(backbone="small_cnn")
    fresh.build(3, ["cat", "dog", "eel"])
    raw["state_dict"] = fresh.state_dict()
    start = base / "start.ckpt"
    torch.save(raw, start)
    return tree, end, start


def _model_and_images(ckpt: Path, tree: Path) -> tuple[FineTuner, torch.Tensor]:
    model = FineTuner.from_checkpoint(ckpt).eval()
    data = ImageClassificationData(root=str(tree), batch_size=8, **model.trained_data)
    data.setup("validate")
    return model, next(iter(data.val_dataloader()))[0]


def test_alpha_0_and_1_are_the_endpoints_and_batch_norm_statistics_are_interpolated(
    run: tuple[Path, Path, Path],
) -> None:
    tree, end, start = run
    model, x = _model_and_images(end, tree)
    theta1 = {k: v.clone() for k, v in model.state_dict().items()}
    theta0 = FineTuner.from_checkpoint(start).state_dict()
    with torch.no_grad():
        fine_tuned = model(x)
        model.load_state_dict(interpolated_state(theta0, theta1, 0.0))
        at_0 = model(x)
        model.load_state_dict(interpolated_state(theta0, theta1, 1.0))
        torch.testing.assert_close(model(x), fine_tuned, rtol=0, atol=0)
        started, _ = _model_and_images(start, tree)
        torch.testing.assert_close(at_0, started(x), rtol=0, atol=0)
    half = interpolated_state(theta0, theta1, 0.5)
    for key in ("backbone.body.layer1.1.running_mean", "backbone.body.layer1.0.weight"):
        torch.testing.assert_close(half[key], (theta0[key] + theta1[key]) / 2)
    counter = "backbone.body.layer1.1.num_batches_tracked"
    assert torch.equal(half[counter], theta1[counter])  # an integer buffer: the fine-tuned one's


def test_alpha_is_chosen_on_the_validation_split_and_written_as_a_new_checkpoint(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    tree, end, start = run
    output = tmp_path / "wise.ckpt"
    args = ["interpolate", f"--ckpt_path={end}", f"--start={start}", "--alphas=[0,0.5,1]", f"--output={output}",
            f"--data.root={tree}", "--trainer.precision=32-true"]  # fmt: skip
    main(args)
    table = json.loads(output.with_suffix(".json").read_text())
    # every α scored by hand on the fine-tuned run's validation split (its held-out quarter of train/)
    model, _ = _model_and_images(end, tree)
    theta1 = {k: v.clone() for k, v in model.state_dict().items()}
    theta0 = FineTuner.from_checkpoint(start).state_dict()
    data = ImageClassificationData(root=str(tree), batch_size=8, **model.trained_data)
    data.setup("validate")
    scores = []
    for alpha in (0.0, 0.5, 1.0):
        model.load_state_dict(interpolated_state(theta0, theta1, alpha))
        with torch.no_grad():
            batches = [(model(x), y) for x, y in data.val_dataloader()]
        logits, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        top1 = float((logits.argmax(1) == labels).float().mean())
        loss = float(torch.nn.functional.cross_entropy(logits, labels))
        scores.append((top1, -loss, alpha))
    assert [r["val"]["top1"] for r in table["alphas"]] == pytest.approx([s[0] for s in scores])
    assert [r["val"]["loss"] for r in table["alphas"]] == pytest.approx([-s[1] for s in scores], rel=1e-4)
    assert table["alpha"] == max(scores)[2] and table["start_kind"] == "checkpoint"
    rebuilt = FineTuner.from_checkpoint(output)
    assert rebuilt.checkpoint_info["interpolation"]["alpha"] == table["alpha"]
    assert "optimizer_states" not in torch.load(output, weights_only=True)  # a model, not a resumable fit
    # never over an existing file: the checkpoint, or its table
    assert "exists and was not written by coretune interpolate" in error(args)


def test_a_pre_trained_start_interpolates_the_backbone_and_keeps_the_fine_tuned_head(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    tree, end, start = run
    pretrained = tmp_path / "pretrained.pth"
    body = FineTuner.from_checkpoint(start).backbone.body.state_dict()
    torch.save({k: v for k, v in body.items() if not k.startswith("fc.")}, pretrained)
    output = tmp_path / "lp.ckpt"
    main(["interpolate", f"--ckpt_path={end}", f"--start={pretrained}", "--alphas=[0]", f"--output={output}",
          f"--data.root={tree}", "--batch_norm=recompute", "--trainer.precision=32-true"])  # fmt: skip
    state, fine_tuned = FineTuner.from_checkpoint(output).state_dict(), FineTuner.from_checkpoint(end).state_dict()
    assert torch.equal(state["backbone.body.layer1.0.weight"], body["layer1.0.weight"])
    heads = [k for k in fine_tuned if k.startswith("objective.")]
    assert heads and all(torch.equal(state[k], fine_tuned[k]) for k in heads)
    # recomputed statistics: neither the pre-trained file's nor the fine-tuned ones
    key = "layer1.1.running_mean"
    assert not torch.allclose(state[f"backbone.body.{key}"], body[key])
    assert not torch.allclose(state[f"backbone.body.{key}"], fine_tuned[f"backbone.body.{key}"])
    assert json.loads(output.with_suffix(".json").read_text())["start_kind"] == "pre-trained backbone"


def test_an_objective_head_the_start_lacks_is_the_fine_tuned_ones(run: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A CE start (a linear probe's: a classifier) for a Core-tuning fine-tuning (a classifier and a projector): the
    classifier and backbone are interpolated, the projector is the fine-tuned one for every α."""
    _, end, start = run
    raw = torch.load(end, weights_only=True)
    core = create("core")
    crafted = FineTuner(core, backbone="small_cnn")
    crafted.build(3, ["cat", "dog", "eel"])
    raw["state_dict"] = crafted.state_dict()
    cls = f"{type(core).__module__}.{type(core).__qualname__}"
    raw["coretune"] |= {"objective": "core", "objective_class": cls, "objective_hparams": core.hparams()}
    torch.save(raw, tmp_path / "core.ckpt")
    fine_tuned = FineTuner.from_checkpoint(tmp_path / "core.ckpt")
    theta0, kind, kept = _start_state(str(start), fine_tuned, "auto", "core.ckpt")
    assert kind == "checkpoint" and kept and all(k.startswith("objective.projector.") for k in kept)
    at_0, probe = interpolated_state(theta0, fine_tuned.state_dict(), 0.0), FineTuner.from_checkpoint(start)
    assert torch.equal(at_0["objective.classifier.weight"], probe.state_dict()["objective.classifier.weight"])
    assert all(torch.equal(at_0[k], fine_tuned.state_dict()[k]) for k in kept)
    with pytest.raises(ValueError, match="another network"):  # another backbone: refused
        other = FineTuner(backbone="small_cnn", backbone_args={"widths": (8, 16, 32, 64)})
        other.build(3, ["cat", "dog", "eel"])
        _start_state(str(start), other, "auto", "narrow.ckpt")


def test_interpolate_refuses_to_choose_alpha_on_the_test_images(run: tuple[Path, Path, Path], tmp_path: Path) -> None:
    tree, end, start = run
    base = ["interpolate", f"--ckpt_path={end}", f"--start={start}", f"--output={tmp_path / 'w.ckpt'}"]
    assert "α must not be chosen on them" in error([*base, f"--data.root={tree}", "--data.val_fraction=0"])
    assert "--alphas must lie in [0, 1] (got 1.5)" in error([*base, f"--data.root={tree}", "--alphas=[0,1.5]"])
