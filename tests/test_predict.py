"""``coretune predict``'s batching of segmentation images (one forward pass per group of images of one size), and
its refusal of two images whose masks would have one name."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from coretune.cli import main
from fit_flags import QUIET, error


@pytest.fixture(scope="module")
def segmenter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of one epoch of a DeepLab-V3 (ResNet-18) on four 32 px images."""
    from segmentation_sets import make_voc_set

    base = tmp_path_factory.mktemp("seg")
    root = make_voc_set(base / "voc", {"train": 4, "val": 2}, size=(32, 32))
    main([
        "fit", "--task", "segmentation", "--model.backbone=resnet18", "--model.weights=null", f"--data.root={root}",
        f"--run_dir={base / 'run'}", "--data.image_size=32", "--data.batch_size=4", "--trainer.max_epochs=1", *QUIET,
    ])  # fmt: skip
    return base / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize(
    ("names", "options", "target"),
    [
        (["a.jpg", "a.png"], [], "sub/a.png"),
        (["a.png", "a_overlay.jpg"], ["--overlay=true"], "sub/a_overlay.png"),  # a.png's overlay, the other's mask
    ],
    ids=["extensions", "overlay"],
)
def test_two_images_of_one_mask_name_are_refused_and_the_output_is_left_alone(
    segmenter: Path, tmp_path: Path, names: list[str], options: list[str], target: str
) -> None:
    """The second mask overwrote the first in the staging folder, and moving it then failed with the output folder
    partly replaced."""
    images, output = tmp_path / "images", tmp_path / "masks"
    (images / "sub").mkdir(parents=True)
    for name in ["b.png", *names]:
        Image.new("RGB", (32, 32), (90, 120, 150)).save(images / "sub" / name)
    (output / "sub").mkdir(parents=True)
    (output / "sub" / "b.png").write_bytes(b"an earlier mask")
    (output / ".coretune-predict").write_text("")  # an earlier prediction's folder
    first, second = sorted(names)
    assert error(["predict", f"--ckpt_path={segmenter}", f"--input={images}", f"--output={output}", *options]) == (
        f"images {images / 'sub' / first} and {images / 'sub' / second} would both be written to {output / target} "
        "(each image's files are named after it without its extension): rename one of them"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "masks"]  # no staging folder left
    assert sorted(p.relative_to(output) for p in output.rglob("*")) == [
        Path(".coretune-predict"),
        Path("sub"),
        Path("sub/b.png"),
    ]
    assert (output / "sub" / "b.png").read_bytes() == b"an earlier mask"


def test_segmentation_predicts_photos_stored_sideways_on_their_stored_pixels(segmenter: Path, tmp_path: Path) -> None:
    # a landscape photo beside a portrait one stored sideways (EXIF orientation 6), both 48×32 in their headers:
    # batched together by those sizes, the second loaded turned (32×48), and the batch could not be stacked
    images = tmp_path / "photos"
    images.mkdir()
    Image.new("RGB", (48, 32), (200, 30, 30)).save(images / "landscape.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (48, 32), (30, 30, 200)).save(images / "portrait.jpg", exif=exif)
    main(["predict", f"--ckpt_path={segmenter}", f"--input={images}", f"--output={tmp_path / 'masks'}",
          "--data.batch_size=2"])  # fmt: skip
    for name in ("landscape", "portrait"):  # masks of the stored size, as the model was trained and ground truth is
        assert Image.open(tmp_path / "masks" / f"{name}.png").size == (48, 32)


def test_an_output_that_would_replace_inputs_or_run_files_is_refused(segmenter: Path, tmp_path: Path) -> None:
    """``--output`` naming the input folder wrote each mask ``a.png`` over the input image ``a.png``; one inside it
    was read back as images by the next run; a CSV could replace the checkpoint or a run's results.json."""
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (32, 32), (90, 120, 150)).save(images / "a.png")
    before = (images / "a.png").read_bytes()
    run = segmenter.parent.parent
    cases = {
        str(images): f"is inside {images}, data this command reads",
        str(images / "masks"): f"is inside {images}, data this command reads",
        str(segmenter): "is the checkpoint this command reads",
        str(run / "results.json"): "is a file: coretune predict fills a folder",
    }
    for output, why in cases.items():
        message = error(["predict", f"--ckpt_path={segmenter}", f"--input={images}", f"--output={output}"])
        assert message.startswith(f"--output {output} {why}"), message
    message = error(["predict", f"--ckpt_path={segmenter}", f"--input={images / 'a.png'}", f"--output={images}"])
    assert message.startswith(f"--output {images} holds files coretune predict did not make"), message
    assert (images / "a.png").read_bytes() == before and sorted(p.name for p in images.iterdir()) == ["a.png"]
    main(["predict", f"--ckpt_path={segmenter}", f"--input={images / 'a.png'}", f"--output={tmp_path / 'masks'}"])
    assert (tmp_path / "masks" / "a.png").is_file()


def test_a_checkpoint_without_data_settings_predicts_with_a_warning(segmenter: Path, tmp_path: Path) -> None:
    """A model saved without coretune's data module: predict fell back to ImageNet's normalisation silently."""
    import torch

    checkpoint = torch.load(segmenter, weights_only=True)
    checkpoint["coretune"].pop("data", None)
    checkpoint.pop("datamodule_hyper_parameters", None)
    bare = tmp_path / "bare.ckpt"
    torch.save(checkpoint, bare)
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (32, 32), (90, 120, 150)).save(images / "a.png")
    with pytest.warns(UserWarning, match=rf"^checkpoint {bare} does not record its mean, std: predicting with "
                      r"ImageNet's normalisation, which may not be what the model was trained on$"):  # fmt: skip
        main(["predict", f"--ckpt_path={bare}", f"--input={images}", f"--output={tmp_path / 'masks'}"])
    assert (tmp_path / "masks" / "a.png").is_file()


@pytest.mark.parametrize(
    ("device", "given", "expected"),
    [
        ("cpu", "auto", {"num_workers": 0, "pin_memory": False}),  # as before on the CPU: the main process loads
        ("cuda", "auto", {"num_workers": 6, "pin_memory": True}),  # a worker per core (6 here), up to 8, pinned
        ("cuda", 2, {"num_workers": 2, "pin_memory": True}),  # an explicit count wins
    ],
)
def test_predict_loads_as_the_data_modules_do_for_its_device(
    device: str, given: object, expected: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from coretune.apps.devices import Placement
    from coretune.apps.predict import _loader_options

    monkeypatch.setattr("coretune.data.loading.cpu_cores", lambda: 6)
    assert _loader_options(given, Placement(torch.device(device))) == expected  # type: ignore[arg-type]


def test_a_negative_worker_count_is_refused_in_one_line(segmenter: Path, tmp_path: Path) -> None:
    args = ["predict", f"--ckpt_path={segmenter}", f"--input={tmp_path}", "--data.num_workers=-1"]
    assert error(args) == "--data.num_workers must be >= 0 or auto (got -1)"  # before the checkpoint is read
