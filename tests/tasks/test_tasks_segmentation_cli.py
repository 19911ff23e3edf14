"""``--task segmentation`` through the command line: a tiny generated VOC-layout set trains (MIoU well above
chance), its run outputs, test/predict/export following the checkpoint's task, the dense Core-tuning term, and
the bad inputs of docs/reliability.md (one line each)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from coretune.apps.export import load_exported
from coretune.cli import main
from coretune.data import read_mask
from coretune.engine import FineTuner, read_metrics
from coretune.losses import contrastive_loss
from coretune.mining import beta_draws, mine_hard_positives
from coretune.objectives import create
from coretune.tasks.segmentation import dense_contrastive_loss, positive_mask
from fit_flags import QUIET, error
from segmentation_sets import make_voc_set, save_mask

SEG = ["--task", "segmentation", "--model.backbone=resnet18", "--model.weights=null"]
TINY = ["--data.image_size=32", "--data.batch_size=4", "--trainer.max_epochs=1", *QUIET]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(VOC set, run directory) of a Core-tuning fit: 32 training images of 48×64 px, 40 steps of batch 8."""
    tmp = tmp_path_factory.mktemp("seg")
    root = make_voc_set(tmp / "voc", {"train": 32, "val": 8}, size=(48, 64), class_names=["bg", "box", "disc", "tri"])
    run = tmp / "run"
    main([
        "fit", *SEG, f"--data.root={root}", f"--run_dir={run}", "--objective=core", "--model.output_stride=8",
        "--model.optim.lr=0.05", "--model.optim.schedule=poly", "--data.image_size=48", "--data.batch_size=8",
        "--data.eval_mode=whole", "--trainer.max_epochs=10", "--trainer.check_val_every_n_epoch=5",
        "--trainer.precision=32-true", *QUIET,
    ])  # fmt: skip
    return root, run


def test_a_tiny_voc_set_trains_well_above_chance(trained: tuple[Path, Path]) -> None:
    _, run = trained
    rows = read_metrics(run / "metrics.csv")
    assert [bool(r["val/miou"]) for r in rows] == [False] * 4 + [True] + [False] * 4 + [True]
    assert {"train/ce", "train/con", "train/loss", "train/pixel_acc", "val/mpa", "val/fwiou", "val/pixel_acc"} <= set(
        rows[0]
    )
    results = json.loads((run / "results.json").read_text())
    test = results["test"]
    # Predicting background everywhere scores MIoU ≈ 0.15 here (its IoU over 4 classes), the untrained model 0.13.
    assert test["miou"] > 0.45 and float(rows[-1]["val/miou"]) == pytest.approx(test["miou"], abs=1e-6)
    assert results["best_val_miou"] >= float(rows[4]["val/miou"])
    assert set(test["per_class_iou"]) == {"bg", "box", "disc", "tri"}
    assert np.array(test["confusion_matrix"]).shape == (4, 4)
    assert test["pixel_acc"] > test["miou"] and 0 < test["fwiou"] <= 1 and 0 < test["mpa"] <= 1
    assert (run / "predictions.png").is_file() and (run / "learning_curve.png").is_file()
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["task"] == "segmentation" and config["data"]["eval_mode"] == "whole"


def test_whole_images_of_several_sizes_score_the_same_whatever_the_batch_size(tmp_path: Path) -> None:
    """Padded to a batch-mate's size, a whole image's prediction depended on its batch, and with batches of one size
    the output watch compared images of two sizes (a crash); fit, validate and test now run on a set of two image
    sizes, and the test MIoU is the same at evaluation batches of 1 and of 6 (row 199)."""
    root = make_voc_set(tmp_path / "voc", {"train": 8, "val": 3})
    make_voc_set(root, {"small": 3}, size=(30, 44), seed=1)
    order = ["small_000", "val_000", "small_001", "val_001", "val_002", "small_002"]
    (root / "ImageSets" / "Segmentation" / "val.txt").write_text("\n".join(order) + "\n")
    run = tmp_path / "run"
    main(["fit", *SEG, f"--data.root={root}", f"--run_dir={run}", "--data.eval_mode=whole",
          "--data.eval_batch_size=4", "--trainer.precision=32-true", *TINY])  # fmt: skip
    fitted = json.loads((run / "results.json").read_text())["test"]
    scores = []
    for size in (1, 6):
        out = tmp_path / f"test{size}.json"
        main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={root}",
              f"--data.eval_batch_size={size}", "--trainer.precision=32-true", "--output", str(out)])  # fmt: skip
        scores.append(json.loads(out.read_text())["test"])
    assert scores[0]["miou"] == pytest.approx(scores[1]["miou"], abs=1e-6)
    assert scores[0]["miou"] == pytest.approx(fitted["miou"], abs=1e-6)
    assert scores[0]["pixel_acc"] == pytest.approx(scores[1]["pixel_acc"], abs=1e-6)


def test_test_predict_and_export_follow_the_checkpoint(trained: tuple[Path, Path], tmp_path: Path) -> None:
    root, run = trained
    ckpt = run / "checkpoints" / "last.ckpt"
    main(
        [
            "test",
            f"--ckpt_path={ckpt}",
            f"--data.root={root}",  # no --data.eval_mode: the checkpoint's (whole images), not the default crop
            "--trainer.precision=32-true",  # as the fit
            "--output",
            str(tmp_path / "t.json"),
        ]
    )
    written = json.loads((tmp_path / "t.json").read_text())
    tested = written["test"]
    assert written["data"]["eval_mode"] == "whole"
    assert tested["miou"] == pytest.approx(json.loads((run / "results.json").read_text())["test"]["miou"], abs=1e-6)

    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    for name in ("val_000.jpg", "val_001.jpg"):
        (images / "sub" / name).write_bytes((root / "JPEGImages" / name).read_bytes())
    Image.open(root / "JPEGImages" / "val_002.jpg").resize((40, 32)).save(images / "small.png")  # another size
    main(["predict", f"--ckpt_path={ckpt}", f"--input={images}", f"--output={tmp_path / 'masks'}", "--overlay=true",
          "--data.batch_size=2"])  # fmt: skip
    model = FineTuner.from_checkpoint(ckpt).eval()
    mask = read_mask(str(tmp_path / "masks" / "sub" / "val_000.png"))
    assert mask.shape == (48, 64) and (tmp_path / "masks" / "sub" / "val_001_overlay.png").is_file()
    assert read_mask(str(tmp_path / "masks" / "small.png")).shape == (32, 40)  # its own batch, its own size
    with torch.inference_mode():
        x = torch.from_numpy(np.array(Image.open(images / "sub" / "val_000.jpg"))).float()
        mean, std = torch.tensor(model.trained_data["mean"]), torch.tensor(model.trained_data["std"])
        x = ((x / 255 - mean) / std).permute(2, 0, 1)[None]
        expected = model(x).argmax(1)[0].numpy()
    assert (mask == expected).mean() > 0.99  # the same prediction (JPEG decoding aside)
    main(["predict", f"--ckpt_path={ckpt}", f"--input={images / 'small.png'}", f"--output={tmp_path / 'one'}"])
    # one image file: named as in a folder (beside the marker that lets predict write into the folder again)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [".coretune-predict", "small.png"]

    main(["export", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'exported'}", "--format=safetensors,pt2"])
    net, config = load_exported(tmp_path / "exported")
    assert config["task"] == "segmentation" and config["output_stride"] == 8
    with torch.inference_mode():
        assert torch.allclose(net(x), model(x), atol=1e-5)
        program = torch.export.load(tmp_path / "exported" / "model.pt2").module()
        crops = torch.randn(3, 3, 48, 48)
        assert torch.allclose(program(crops), model(crops), atol=1e-4)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_logits_on_ignored_pixels_only_fail_the_test(
    value: float, trained: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NaN logits only where every mask is ignored leave the loss finite, and the logits' size check used to miss
    # them (NaN compares False): the run ended with a score
    root, run = trained
    copy = Path(shutil.copytree(root, tmp_path / "voc"))
    for path in (copy / "SegmentationClass").glob("val_*.png"):
        mask = read_mask(str(path))
        mask[0, 0] = 255
        save_mask(mask, path, palette=True)
    forward = FineTuner.forward

    def poisoned(self: FineTuner, x: torch.Tensor) -> torch.Tensor:
        logits = forward(self, x).clone()
        logits[:, :, 0, 0] = value
        return logits

    monkeypatch.setattr(FineTuner, "forward", poisoned)
    ckpt = run / "checkpoints" / "last.ckpt"
    message = error(["test", f"--ckpt_path={ckpt}", f"--data.root={copy}", "--data.eval_mode=whole",
                     "--trainer.precision=32-true", "--output", str(tmp_path / "t.json")])  # fmt: skip
    assert re.match(r"the model diverged at epoch \d+, step \d+: its test logits are not finite \(a trained", message)
    assert not (tmp_path / "t.json").exists()


def test_config_of_another_task_is_refused(trained: tuple[Path, Path], image_tree: Path, tmp_path: Path) -> None:
    _, run = trained
    config = run / "config.yaml"
    assert error(["fit", f"--config={config}", "--task=classification", f"--data.root={image_tree}"]) == (
        f"--config {config} is the configuration of a segmentation run (model.task: segmentation) but --task "
        "classification was given: drop --task to run it as segmentation, or pass a classification configuration"
    )
    classifier = tmp_path / "cls"
    main(["fit", f"--data.root={image_tree}", f"--run_dir={classifier}", "--model.backbone=small_cnn",
          "--data.image_size=16", "--trainer.max_epochs=1", *QUIET])  # fmt: skip
    ckpt = classifier / "checkpoints" / "last.ckpt"
    expected = (
        f"--config {config} is the configuration of a segmentation run (model.task: segmentation) but checkpoint "
        f"{ckpt} is a classification model: pass the config.yaml of a classification run, or the --data.* options "
        "alone"
    )
    for command in (["test"], ["validate"], ["predict", f"--input={image_tree}"], ["export", "--output=x"]):
        assert error([*command, f"--ckpt_path={ckpt}", f"--config={config}"]) == expected
    # predict's options of the other task
    assert error(["predict", f"--ckpt_path={ckpt}", f"--input={image_tree}", "--overlay=true"]) == (
        "--overlay true is for segmentation checkpoints (it draws masks over images): drop it"
    )
    segmenter = run / "checkpoints" / "last.ckpt"
    assert error(["predict", f"--ckpt_path={segmenter}", f"--input={image_tree}", "--data.image_size=32"]) == (
        "--data.image_size 32: a segmentation model predicts each image at its own size (its mask has the image's "
        "size); drop --data.image_size"
    )
    for command in (["predict", f"--input={image_tree}"], ["export", f"--output={run / 'x'}"]):
        assert error([*command, f"--ckpt_path={segmenter}", "--posthoc_adjustment=1"]) == (
            f"--posthoc_adjustment applies to classifiers; checkpoint {segmenter} is a segmentation model (its logits "
            "are per pixel): drop --posthoc_adjustment"
        )
    assert not (run / "x").exists()


# -- bad inputs through coretune fit ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "what", "reason"),
    [
        (["--objective=l2sp"], "'l2sp'", "it is a classification method"),
        (["--objective=bi_tuning"], "'bi_tuning'", "it is a classification method"),
        (
            ["--objective=ce_mix"],
            "'core' with manifold_mixup (as ce_mix)",
            "it mixes features to train the classifier, which has no pixels to mix",
        ),
        (
            ["--objective=core", "--objective.memory.size=64"],
            "'core' with a cross-batch memory (memory.size 64)",
            "its cross-batch memory is for classification only",
        ),
        (
            ["--objective=core", "--objective.logit_adjustment=1"],
            "'core' with logit_adjustment 1",
            "it adjusts the classifier's cross-entropy by the class prior, not the pixel-wise one",
        ),
    ],
)
def test_objectives_that_cannot_apply_are_refused(
    voc_set: Path, tmp_path: Path, args: list[str], what: str, reason: str
) -> None:
    message = error(["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={tmp_path / 'r'}", *args])
    assert message == f"objective {what} does not apply to --task segmentation ({reason}): use ce, ce_con or core"


def test_a_batch_of_one_and_another_ignore_index_are_refused(voc_set: Path, tmp_path: Path) -> None:
    message = error(
        ["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={tmp_path / 'r'}", *TINY, "--data.batch_size=1"]
    )
    assert message.startswith("--data.batch_size 1: DeepLab-V3's ASPP pools each image to one value per channel")
    assert "use --data.batch_size 2 or more" in message
    message = error(
        ["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={tmp_path / 'r'}", *TINY, "--data.ignore_index=254"]
    )
    assert message == (
        "--data.ignore_index 254: the segmentation task leaves out mask value 255 only; remap the masks' ignored value "
        "to 255"
    )


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("size", r"mask {R}/SegmentationClass/val_002.png is 56×30 px but its image {R}/JPEGImages/val_002.jpg is "),
        ("value", r"mask {R}/SegmentationClass/train_004.png holds value 9, out of range for 4 classes \(0–3, 255"),
        ("missing mask", r"image {R}/JPEGImages/train_001.jpg has no mask: expected {R}/SegmentationClass/train_001"),
        ("missing image", r"list file {R}/ImageSets/Segmentation/val.txt names image 'val_003', but {R}/JPEG"),
    ],
)
def test_bad_data_is_one_line_naming_the_file(voc_set: Path, tmp_path: Path, damage: str, expected: str) -> None:
    if damage == "size":
        save_mask(np.zeros((30, 56), dtype=np.uint8), voc_set / "SegmentationClass" / "val_002.png", palette=True)
    elif damage == "value":
        mask = voc_set / "SegmentationClass" / "train_004.png"
        values = read_mask(str(mask)).copy()
        values[0, 0] = 9
        save_mask(values, mask, palette=False)
    elif damage == "missing mask":
        (voc_set / "SegmentationClass" / "train_001.png").unlink()
    else:
        (voc_set / "JPEGImages" / "val_003.jpg").unlink()
    extra = ["--data.num_classes=4"] if damage == "value" else []
    message = error(["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={tmp_path / 'r'}", *TINY, *extra])
    assert re.match(expected.replace("{R}", re.escape(str(voc_set))), message), message
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_class_count_inferred_from_the_masks_stays_within_limits(voc_set: Path, tmp_path: Path) -> None:
    """16-bit masks whose ignored pixels are 65535 made a 65536-class model (a traceback allocating 34 GB for its
    confusion matrix); one stray pixel of value 37 in masks of classes 0–3 a silent 38-class model. Both are refused
    before anything is written, naming the file and the value; a given class count still takes a rare class."""
    masks = voc_set / "SegmentationClass"
    wide = read_mask(str(masks / "train_003.png")).astype(np.uint16)
    wide[wide == 255] = 65535
    Image.fromarray(wide).save(masks / "train_003.png")  # an "I;16" PNG
    assert read_mask(str(masks / "train_003.png")).max() == 65535
    run = tmp_path / "r"
    assert error(["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={run}", *TINY]) == (
        f"mask {masks / 'train_003.png'} holds value 65535, above the ignored value 255: inferred from the masks, the "
        "classes would be 0–65535 (65536 classes, when class indices must stay below 255). If 65535 marks pixels to "
        "ignore, remap it to 255 in the masks; else fix the mask, or give the classes (--data.num_classes, or a "
        "classes.txt)"
    )
    # with the class count given, the ignored value must be the task's: the same value is out of range
    message = error(["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={run}", *TINY, "--data.num_classes=4"])
    assert message.startswith(f"mask {masks / 'train_003.png'} holds value 65535, out of range for 4 classes")
    wide[wide == 65535] = 255
    save_mask(wide.astype(np.uint8), masks / "train_003.png", palette=False)
    stray = read_mask(str(masks / "val_001.png")).copy()
    stray[0, 0] = 37
    save_mask(stray, masks / "val_001.png", palette=True)
    assert error(["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={run}", *TINY]) == (
        f"mask {masks / 'val_001.png'} holds value 37, but no mask holds 4–36: inferred from the masks, the classes "
        "would be 0–37, 33 of which never occur. If 37 is a stray value, fix the mask; else give the classes: "
        "--data.num_classes 38 (or a classes.txt naming them)"
    )
    assert not run.exists()
    message = error(["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={run}", *TINY, "--data.num_classes=4"])
    assert message.startswith(f"mask {masks / 'val_001.png'} holds value 37, out of range for 4 classes")


def test_an_evaluation_split_whose_masks_are_all_ignored_scores_null_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Validation and test masks all 255: the fit exited 0 printing `MIoU nan%`, results.json held NaN and
    `best_val_miou: -Infinity` (not JSON). The scores are now null, a warning names each split, and the summary
    says the MIoU is undefined."""
    root = make_voc_set(tmp_path / "voc", {"train": 8, "val": 4})
    for mask in (root / "SegmentationClass").glob("val_*.png"):
        save_mask(np.full((40, 56), 255, dtype=np.uint8), mask, palette=True)
    run = tmp_path / "run"
    with pytest.warns(UserWarning) as caught:
        main(["fit", *SEG, f"--data.root={root}", f"--run_dir={run}", "--trainer.precision=32-true", *TINY])
    said = {str(w.message) for w in caught if "hold no pixel to score" in str(w.message)}
    assert said == {
        "the validation split's masks hold no pixel to score (every pixel is 255 = ignore): its MIoU, MPA, FWIoU and "
        "pixel accuracy are undefined (null in the results' JSON); best.ckpt cannot be chosen on it; give the "
        "validation images masks with labelled pixels",
        "the test split's masks hold no pixel to score (every pixel is 255 = ignore): its MIoU, MPA, FWIoU and pixel "
        "accuracy are undefined (null in the results' JSON); give the test images masks with labelled pixels",
    }
    printed = capsys.readouterr().out
    assert "MIoU undefined: the test masks hold no pixel to score" in printed and "nan%" not in printed
    results = json.loads((run / "results.json").read_text(), parse_constant=_refuse_constant)
    assert results["best_val_miou"] is None
    assert {k: results["test"][k] for k in ("miou", "mpa", "fwiou", "pixel_acc")} == dict.fromkeys(
        ("miou", "mpa", "fwiou", "pixel_acc")
    )
    assert read_metrics(run / "metrics.csv")[0]["val/miou"] == "nan"  # the epoch's row: undefined, not a score


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"{name} in a JSON file: not strict JSON")


# -- the dense contrastive term -----------------------------------------------------------------------------
def test_dense_contrastive_term_positives_and_generated_rows() -> None:
    torch.manual_seed(0)
    core = create("core", feature_dim=8, num_classes=3)
    pooled = torch.randn(5, 8)
    labels = torch.tensor([0, 0, 1, -1, -1])  # two crops without a label: never each other's positives
    assert positive_mask(labels).tolist() == [
        [False, True, False, False, False],
        [True, False, False, False, False],
        [False, False, False, False, False],
        [False, False, False, False, False],
        [False, False, False, False, False],
    ]
    generator = torch.Generator().manual_seed(1)
    loss = dense_contrastive_loss(core, pooled, labels, generator)
    # by hand: rows [originals; one generated hard positive each], P_i = same label ∪ {own generated row} for the
    # 3 labelled crops; the unlabelled crops' generated rows are left out of every A_i
    again = torch.Generator().manual_seed(1)
    generated = mine_hard_positives(pooled, positive_mask(labels), core.alpha, core.miner.lambda_p, again)
    v = torch.nn.functional.normalize(core.projector(torch.cat([pooled, generated])).float(), dim=1)
    labelled = torch.tensor([True, True, True, False, False])
    pos = torch.cat([positive_mask(labels), torch.diag(labelled)], dim=1)
    contrast = torch.cat([torch.ones(5, 5, dtype=torch.bool), labelled[None, :].expand(5, 5)], dim=1)
    assert loss.item() == pytest.approx(contrastive_loss(v, pos, core.temperature, True, contrast).item(), rel=1e-6)
    # ce_con: SupCon on the originals alone
    con = create("ce_con", feature_dim=8, num_classes=3)
    v = torch.nn.functional.normalize(con.projector(pooled).float(), dim=1)
    assert dense_contrastive_loss(con, pooled, labels).item() == pytest.approx(
        contrastive_loss(v, positive_mask(labels), con.temperature, False).item(), rel=1e-6
    )


def test_hard_positive_mixes_the_hardest_positive_and_hardest_negative() -> None:
    z = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, -0.8]])
    pos = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    generator = torch.Generator().manual_seed(0)
    out = mine_hard_positives(z, pos, alpha=1.0, lambda_p=1.0, generator=generator)  # λ clipped to 1: z_hp itself
    # anchor 0: positives 1 (cos 0.8) and 3 (cos 0.6) → the least similar, 3; anchor 2 has none → itself
    assert out.tolist() == [z[3].tolist(), z[0].tolist(), z[2].tolist(), z[0].tolist()]
    out = mine_hard_positives(z, pos, alpha=1.0, lambda_p=0.0, generator=torch.Generator().manual_seed(0))
    lam = beta_draws(4, 1.0, torch.Generator().manual_seed(0))
    # anchor 0's hardest negative: 2 (cos 0), the only one
    assert torch.allclose(out[0], lam[0] * z[3] + (1 - lam[0]) * z[2])


def test_image_label_rule_multilabel_trains(voc_set: Path, tmp_path: Path) -> None:
    run = tmp_path / "r"
    main(["fit", *SEG, f"--data.root={voc_set}", f"--run_dir={run}", *TINY, "--objective=core",
          "--model.image_labels=multilabel", "--trainer.precision=32-true"])  # fmt: skip
    row = read_metrics(run / "metrics.csv")[-1]
    assert float(row["train/con"]) > 0 and "miou" in json.loads((run / "results.json").read_text())["test"]


def test_an_older_runs_records_of_the_task_settings_still_load_and_resume(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Older versions recorded the task's settings among the model's (``model.output_stride`` in ``config.yaml``,
    ``output_stride`` in the checkpoint's hyper-parameters); they are the task's now (``task_settings``, issue 61):
    such a checkpoint still loads with its settings, and its run still resumes with them (given back as the old
    ``--config``, or as ``--task.output_stride``), while another stride is refused."""
    from coretune.engine.runcli import check_resume

    _, run = trained
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["task_settings"] == {"output_stride": 8}  # --model.output_stride=8 (deprecated spelling)
    old = tmp_path / "old"
    shutil.copytree(run, old)
    for ckpt in (old / "checkpoints").glob("*.ckpt"):  # each checkpoint written in the old form
        checkpoint = torch.load(ckpt, weights_only=True)
        hparams = checkpoint["hyper_parameters"]
        assert hparams.pop("task_settings") == {"output_stride": 8}
        hparams.update(output_stride=8, image_labels="majority")
        torch.save(checkpoint, ckpt)
    old_config = {**config, "model": {**config["model"], "output_stride": 8, "image_labels": "majority"}}
    del old_config["model"]["task_settings"]
    (old / "config.yaml").write_text(yaml.safe_dump(old_config, sort_keys=False))

    model = FineTuner.from_checkpoint(old / "checkpoints" / "last.ckpt")
    assert (model.task.output_stride, model.task.image_labels) == (8, "majority")
    assert model.hparams.task_settings == {"output_stride": 8, "image_labels": "majority"}

    resume = {"run_dir": str(old), "ckpt_path": "last"}
    assert check_resume(resume, {**config, "run_dir": str(old)}) == []
    given = {**config["model"], "task_settings": {"output_stride": 8, "image_labels": "majority"}}
    assert check_resume(resume, {**config, "model": given}) == []
    other = {**config, "model": {**config["model"], "task_settings": {"output_stride": 16}}}
    with pytest.raises(ValueError, match=r"other settings than these: model\.task_settings\.output_stride 8 → 16\."):
        check_resume(resume, other)
    # the whole command: the old config.yaml given back resumes the (finished) run, which is only tested again
    capsys.readouterr()
    main(["fit", f"--config={old / 'config.yaml'}", f"--run_dir={old}", *QUIET])
    assert "deprecated" not in capsys.readouterr().err
    assert yaml.safe_load((old / "config.yaml").read_text())["model"]["task_settings"]["output_stride"] == 8
