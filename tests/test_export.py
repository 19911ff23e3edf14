"""`coretune export --format …`: the formats asked for (safetensors, pt2, TorchScript, ONNX, timm) beside config.json,
onnxruntime computing the PyTorch logits, the deprecated `--onnx`/`--torchscript`/`--exported_program` flags, and a
segmentation model that every format runs at other sizes than its training crop."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from coretune.apps.export import (
    CHECK_TOLERANCE,
    EXPORT_FORMAT,
    ExportedClassifier,
    _classifier_program,
    _computes_eager,
    export_checkpoint,
    load_exported,
)
from coretune.cli import main
from coretune.engine import FineTuner
from coretune.models import create_backbone
from fit_flags import QUIET, error

ort = pytest.importorskip("onnxruntime")

ALL = ["model.safetensors", "model.pt2", "model.torchscript.pt", "model.onnx"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of one epoch of `coretune fit` of a ResNet-18 on a tiny tree, at 32 px (its last feature
    map is 1 × 1)."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("onnx")
    tree, run_dir = make_image_tree(base / "data"), base / "run"
    main(
        [
            "fit",
            f"--data.root={tree}",
            "--data.image_size=32",
            "--data.batch_size=8",
            "--model.backbone=resnet18",
            "--model.weights=null",
            "--trainer.max_epochs=1",
            f"--run_dir={run_dir}",
            *QUIET,
        ]
    )
    return run_dir / "checkpoints" / "last.ckpt"


def export(checkpoint: Path, out: Path, *options: str) -> list[str]:
    """Run `coretune export` into `out`; the names of the files it lists."""
    main(["export", f"--ckpt_path={checkpoint}", f"--output={out}", *options])
    return sorted(p.name for p in out.iterdir())


def test_format_onnx_matches_the_pytorch_model(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export"
    assert export(checkpoint, out, "--format", "onnx") == ["config.json", "model.onnx"]  # weights inside
    assert capsys.readouterr().out.splitlines() == [str(out / "model.onnx"), str(out / "config.json")]
    config = json.loads((out / "config.json").read_text())
    assert config["formats"] == ["onnx"] and config["input_shape"] == ["batch", 3, "height", "width"]

    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (images_input,), (logits_output,) = session.get_inputs(), session.get_outputs()
    assert (images_input.name, logits_output.name) == ("images", "logits")
    assert images_input.shape == ["batch", 3, "height", "width"]
    model = FineTuner.from_checkpoint(checkpoint).eval()
    generator = torch.Generator().manual_seed(0)
    for shape in ((1, 3, 32, 32), (3, 3, 32, 32), (2, 3, 72, 40), (1, 3, 17, 23)):
        images = torch.randn(shape, generator=generator)
        with torch.no_grad():
            expected = model(images)
        (logits,) = session.run(None, {"images": images.numpy()})
        assert logits.shape == (shape[0], 3)
        torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-4, rtol=1e-4)


def test_every_format_takes_any_image_size(checkpoint: Path, tmp_path: Path) -> None:
    """Trained at 32 px (a 1 × 1 last feature map), the classifier's pt2, TorchScript and safetensors exports compute
    the eager logits at the training size and at larger and smaller ones, batches of 1 and 2."""
    export(checkpoint, tmp_path, "--format=safetensors,pt2,torchscript")
    assert json.loads((tmp_path / "config.json").read_text())["input_shape"] == ["batch", 3, "height", "width"]
    model = FineTuner.from_checkpoint(checkpoint).eval()
    net, _ = load_exported(tmp_path)
    program = torch.export.load(tmp_path / "model.pt2").module()
    scripted = torch.jit.load(str(tmp_path / "model.torchscript.pt"))
    generator = torch.Generator().manual_seed(1)
    for shape in ((1, 3, 32, 32), (2, 3, 64, 48), (2, 3, 24, 31)):
        images = torch.randn(shape, generator=generator)
        with torch.no_grad():
            expected = model(images)
            for exported in (net, program, scripted):
                torch.testing.assert_close(exported(images), expected, atol=1e-4, rtol=1e-4)


def test_a_model_that_fixes_the_image_size_is_exported_at_its_training_size() -> None:
    """A graph that requires a size (a ViT's patch grid: multiples of 16) keeps the example's size and any batch
    size, where a CNN's takes any size."""
    vit = create_backbone("vit_tiny_patch16_224")
    program, (dynamic,) = _classifier_program(
        ExportedClassifier(vit, torch.nn.Linear(vit.feature_dim, 2)).eval(), (torch.zeros(2, 3, 32, 32),), 32
    )
    assert list(dynamic) == [0] and program.module()(torch.ones(3, 3, 32, 32)).shape == (3, 2)
    with pytest.raises(AssertionError, match="size"):
        program.module()(torch.ones(1, 3, 48, 48))
    nn = torch.nn
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    program, (dynamic,) = _classifier_program(cnn, (torch.zeros(2, 3, 8, 8),), 8)
    assert list(dynamic) == [0, 2, 3] and program.module()(torch.ones(1, 3, 21, 13)).shape == (1, 4)
    # what decides "any size": the logits at batch 1 and at another size, not the export succeeding
    assert _computes_eager(program.module(), cnn, 8)
    assert not _computes_eager(lambda x: cnn(x[..., :8, :8]), cnn, 8)  # right at 8 px only (a traced size)


@pytest.mark.parametrize(
    ("options", "files"),
    [
        ([], ALL[:2]),  # the default: TorchScript (deprecated by PyTorch) only when asked for
        (["--format=pt2,safetensors"], ALL[:2]),
        (["--format", "[torchscript, onnx]"], ALL[2:]),
        (["--format+", "onnx", "--format+", "torchscript", "--format+", "onnx"], ALL[2:]),
        (["--format", " safetensors , onnx "], [ALL[0], ALL[3]]),
    ],
    ids=["default", "comma", "list", "appended", "spaces"],
)
def test_format_selects_the_files(checkpoint: Path, tmp_path: Path, options: list[str], files: list[str]) -> None:
    with warnings.catch_warnings():  # torch's notice that jit.trace is deprecated is not the user's concern
        warnings.simplefilter("error", FutureWarning)
        assert export(checkpoint, tmp_path, *options) == sorted(["config.json", *files])
    order = [name for name in ("safetensors", "pt2", "torchscript", "onnx") if f"model.{name}" in " ".join(files)]
    assert json.loads((tmp_path / "config.json").read_text())["formats"] == order


@pytest.mark.parametrize(
    ("options", "files", "equivalent"),
    [
        (["--onnx=true"], ALL, "safetensors,pt2,torchscript,onnx"),
        (["--exported_program=false"], [ALL[0], ALL[2]], "safetensors,torchscript"),
        (["--torchscript=false", "--onnx=true"], [ALL[0], ALL[1], ALL[3]], "safetensors,pt2,onnx"),
        (["--torchscript=true", "--onnx=false"], ALL[:3], "safetensors,pt2,torchscript"),
    ],
    ids=["onnx", "no-pt2", "two", "defaults"],
)
def test_the_old_flags_keep_their_meaning_and_name_their_format(
    checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    files: list[str],
    equivalent: str,
) -> None:
    assert export(checkpoint, tmp_path, *options) == sorted(["config.json", *files])
    given = " and ".join(f"--{o[2:].replace('=', ' ')}" for o in options)
    deprecated = f"{given} is deprecated and will be removed in the next release: use --format {equivalent}"
    assert capsys.readouterr().err == f"coretune export: {deprecated}\n"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--format=tflite"],
            "unknown export format 'tflite': choose one or more of safetensors, pt2, torchscript, onnx, timm "
            "(--format onnx,pt2)",
        ),
        (["--format=[]"], "--format names no format: choose one or more of safetensors, pt2, torchscript, onnx, timm"),
        (
            ["--format=onnx", "--format", "pt2"],
            "--format is given more than once: list the formats in one (--format onnx,pt2) or append with "
            "--format+ (--format+ onnx --format+ pt2)",
        ),
        (
            ["--format=onnx", "--torchscript=false"],
            "--torchscript false and --format both given: --torchscript false is deprecated, list the formats in "
            "--format",
        ),
    ],
    ids=["unknown", "none", "repeated", "with-old-flag"],
)
def test_bad_formats_are_one_line_before_anything_is_written(
    checkpoint: Path, tmp_path: Path, options: list[str], message: str
) -> None:
    assert error(["export", f"--ckpt_path={checkpoint}", f"--output={tmp_path / 'export'}", *options]) == message
    assert not (tmp_path / "export").exists()


def test_an_output_that_is_a_file_is_one_line_and_left_alone(checkpoint: Path, tmp_path: Path) -> None:
    output = tmp_path / "model.onnx"  # a file name given where the export's folder goes
    output.write_bytes(b"mine")
    assert error(["export", f"--ckpt_path={checkpoint}", f"--output={output}"]) == (
        f"--output {output} is a file: give a folder (the export writes its model files and config.json into it)"
    )
    assert output.read_bytes() == b"mine"


@pytest.mark.parametrize(
    "files", [{"config.json": '{"model_type": "resnet"}'}, {"model.safetensors": "weights"}, {"config.json": "{"}]
)
def test_a_folder_of_another_models_files_is_refused_and_left_alone(
    checkpoint: Path, tmp_path: Path, files: dict[str, str]
) -> None:
    """An export replaced a Hugging Face model folder's config.json and model.safetensors."""
    output = tmp_path / "hf-model"
    output.mkdir()
    for name, text in files.items():
        (output / name).write_text(text)
    assert error(["export", f"--ckpt_path={checkpoint}", f"--output={output}"]) == (
        f"--output {output} holds another model's files (its config.json, or model files, are not a coretune "
        "export's), which the export would replace: pass another --output folder (an interrupted coretune export "
        "leaves model files without config.json: delete them)"
    )
    assert {p.name: p.read_text() for p in output.iterdir()} == files


@pytest.mark.parametrize("package", ["onnxscript", "onnxruntime"])
def test_missing_onnx_packages_are_one_line_naming_the_extra(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # `import PACKAGE` raises ImportError
    expected = f"ONNX export needs {package}, which is not installed: pip install 'coretune[onnx]'"
    for option in ("--format=pt2,onnx", "--onnx=true"):
        assert error(["export", f"--ckpt_path={checkpoint}", f"--output={tmp_path / 'export'}", option]) == expected
        assert not (tmp_path / "export").exists()  # refused before anything is written


def test_every_file_written_is_read_back_and_checked_against_the_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    """config.json records the check: the images' shapes, the tolerance and each format's largest logit difference
    from the checkpoint's model, read back from the files written."""
    export(checkpoint, tmp_path, "--format=safetensors,pt2,torchscript,onnx")
    config = json.loads((tmp_path / "config.json").read_text())
    check = config["check"]
    assert config["backbone_args"] == {}  # the constructor's options, load_exported's too
    assert check["images"] == [[1, 3, 32, 32], [2, 3, 64, 48]] and check["tolerance"] == CHECK_TOLERANCE
    differences = check["max_abs_logit_difference"]
    assert list(differences) == ["safetensors", "pt2", "torchscript", "onnx"]
    assert all(0 <= d < 1e-4 for d in differences.values()), differences


def _off_by_one(net: torch.nn.Module) -> torch.nn.Module:
    """``net`` whose logits are all one higher (a wrong graph or wrong weights written)."""

    class OffByOne(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.net(images) + 1

    return OffByOne().eval()


@pytest.mark.parametrize("fault", ["safetensors", "torchscript"])
def test_a_file_that_does_not_compute_the_checkpoints_logits_fails_the_export_and_writes_nothing(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    out = tmp_path / "export"
    export(checkpoint, out, "--format=safetensors,torchscript")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    if fault == "safetensors":  # the classifier's bias written one higher

        def save(tensors: dict[str, torch.Tensor], path: str) -> None:
            save_file({k: v + 1 if k == "classifier.bias" else v for k, v in tensors.items()}, path)

        monkeypatch.setattr("coretune.apps.export.save_file", save)
    else:
        trace = torch.jit.trace
        monkeypatch.setattr(torch.jit, "trace", lambda net, images: trace(_off_by_one(net), images))
    message = error(["export", f"--ckpt_path={checkpoint}", f"--output={out}", "--format=safetensors,torchscript"])
    name = "model.safetensors" if fault == "safetensors" else "model.torchscript.pt"
    assert message.startswith(f"export check failed: {name} read back computes logits 1 away from the checkpoint's")
    assert "so nothing was written and --output is as it was" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_load_exported_builds_the_backbone_with_its_constructor_options(tmp_path: Path) -> None:
    """A ViT fine-tuned with ``--model.backbone_args '{img_size: 32}'`` has 4 + 1 position embeddings, not 196 + 1:
    config.json records the options and the weights load into the model they built (the export's check reads
    model.safetensors back this way)."""
    vit = create_backbone("vit_tiny_patch16_224", verbose=False, img_size=32)
    net = ExportedClassifier(vit, torch.nn.Linear(vit.feature_dim, 3)).eval()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config = {
        "format": EXPORT_FORMAT, "task": "classification", "backbone": "vit_tiny_patch16_224",
        "backbone_args": {"img_size": 32}, "feature_dim": vit.feature_dim, "num_classes": 3,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_exported(tmp_path)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), net(images))


def test_load_exported_names_the_missing_weights(checkpoint: Path, tmp_path: Path) -> None:
    export(checkpoint, tmp_path, "--format=pt2")
    with pytest.raises(FileNotFoundError, match=r"holds no coretune export .*the safetensors format\)$"):
        load_exported(tmp_path)


def test_a_failed_export_leaves_the_previous_one_and_an_export_replaces_every_format(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A format that failed after ``model.safetensors`` was overwritten left new weights beside the previous
    ``config.json``, and an export of fewer formats left the previous export's other files."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    state["state_dict"]["objective.classifier.bias"] += 1.0  # another checkpoint of the same model
    other = tmp_path / "other.ckpt"
    torch.save(state, other)
    out = tmp_path / "export"
    export(checkpoint, out, "--format=safetensors,torchscript")
    (out / "notes.txt").write_text("mine")  # not a file of the export: kept
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("tracing failed")

    monkeypatch.setattr(torch.jit, "trace", fail)
    with pytest.raises(RuntimeError, match="tracing failed"):
        export_checkpoint(other, out, "safetensors,torchscript")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "other.ckpt"]  # no temporary folder left
    monkeypatch.undo()
    assert export(other, out, "--format=safetensors") == ["config.json", "model.safetensors", "notes.txt"]
    net, config = load_exported(out)
    assert config["formats"] == ["safetensors"] and (out / "notes.txt").read_text() == "mine"
    torch.testing.assert_close(net.classifier.bias, state["state_dict"]["objective.classifier.bias"])


@pytest.fixture(scope="module")
def segmentation_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of one epoch of a DeepLab-V3 (ResNet-18, output stride 8) on 32 px crops."""
    from segmentation_sets import make_voc_set

    base = tmp_path_factory.mktemp("seg")
    root = make_voc_set(base / "voc", {"train": 8, "val": 2}, size=(40, 48))
    main([
        "fit", "--task", "segmentation", "--model.backbone=resnet18", "--model.weights=null",
        "--model.output_stride=8", f"--data.root={root}", f"--run_dir={base / 'run'}", "--data.image_size=32",
        "--data.batch_size=4", "--trainer.max_epochs=1", "--trainer.precision=32-true", *QUIET,
    ])  # fmt: skip
    return base / "run" / "checkpoints" / "last.ckpt"


def test_segmentation_exports_run_at_any_size(segmentation_checkpoint: Path, tmp_path: Path) -> None:
    """Trained on 32 px crops, every format computes the eager model's logits at 104 × 120 (a feature map of 13 × 15,
    where ASPP's rate-12 convolution reads real pixels, as it does not at 32 px) and 17 × 33, batches of 1 and 3."""
    out = tmp_path / "exported"
    assert export(segmentation_checkpoint, out, "--format=safetensors,pt2,torchscript,onnx") == sorted(
        ["config.json", *ALL]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["input_shape"] == ["batch", 3, "height", "width"] and config["image_size"] == 32
    model = FineTuner.from_checkpoint(segmentation_checkpoint).eval()
    net, _ = load_exported(out)
    program = torch.export.load(out / "model.pt2").module()
    scripted = torch.jit.load(str(out / "model.torchscript.pt"))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [isinstance(d, str) for d in session.get_inputs()[0].shape] == [True, False, True, True]
    generator = torch.Generator().manual_seed(0)
    for shape in ((1, 3, 104, 120), (3, 3, 17, 33)):
        images = torch.randn(shape, generator=generator)
        with torch.no_grad():
            expected = model(images)
            assert expected.shape == (shape[0], 4, *shape[2:])
            for exported in (net, program, scripted):
                torch.testing.assert_close(exported(images), expected, atol=1e-4, rtol=1e-4)
        (logits,) = session.run(None, {"images": images.numpy()})
        torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-4, rtol=1e-4)


# -- --format timm: back into timm (issue 63) -----------------------------------------------------------------
def test_format_timm_is_a_model_timm_loads_with_the_checkpoints_logits(checkpoint: Path, tmp_path: Path) -> None:
    """A torchvision ResNet-18 fine-tuned by coretune goes out as timm's resnet18 (the same tensors and names):
    timm.create_model gives the checkpoint's logits, from the folder or by architecture with the file."""
    import timm

    out = tmp_path / "export"
    assert export(checkpoint, out, "--format=timm") == ["config.json", "timm"]
    assert sorted(p.name for p in (out / "timm").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["formats"] == ["timm"] and config["check"]["max_abs_logit_difference"]["timm"] == 0.0
    timm_config = json.loads((out / "timm" / "config.json").read_text())
    assert (timm_config["architecture"], timm_config["num_classes"]) == ("resnet18", 3)
    assert timm_config["label_names"] == config["class_names"]
    pretrained = timm_config["pretrained_cfg"]
    assert (pretrained["mean"], pretrained["std"]) == (config["mean"], config["std"])
    assert pretrained["input_size"] == [3, 32, 32]
    model = FineTuner.from_checkpoint(checkpoint).eval()
    file = str(out / "timm" / "model.safetensors")
    loaded = [
        timm.create_model(f"local-dir:{out / 'timm'}", pretrained=True),
        timm.create_model(
            "resnet18", pretrained=True, num_classes=3, pretrained_cfg_overlay={"file": file, "num_classes": 3}
        ),
    ]
    images = torch.randn(2, 3, 48, 40, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for net in loaded:
            torch.testing.assert_close(net.eval()(images), model(images), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["resnet10t", "convnext_atto", "vit_tiny_patch16_224"])
def test_a_timm_backbone_exports_as_its_own_timm_model(name: str, tmp_path: Path) -> None:
    import timm

    from coretune.apps.timm_export import load_timm_export, write_timm_export

    torch.manual_seed(0)
    encoder = create_backbone(name, verbose=False)
    net = ExportedClassifier(encoder, torch.nn.Linear(encoder.feature_dim, 4)).eval()
    write_timm_export(net, tmp_path, {"mean": [0.5] * 3, "std": [0.25] * 3, "class_names": list("abcd")}, 64)
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == name
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = net(images)
        for model in (load_timm_export(tmp_path), timm.create_model(f"local-dir:{tmp_path}", pretrained=True)):
            torch.testing.assert_close(model.eval()(images), expected, atol=1e-5, rtol=1e-5)


def test_format_timm_refuses_a_model_timm_has_none_of(tmp_path: Path) -> None:
    from coretune.apps.timm_export import check_timm_exportable

    cnn = create_backbone("small_cnn", verbose=False)
    with pytest.raises(ValueError) as info:
        check_timm_exportable(ExportedClassifier(cnn, torch.nn.Linear(cnn.feature_dim, 2)), dense=False)
    assert str(info.value) == (
        "--format timm needs a timm backbone or a torchvision ResNet without backbone_args, and backbone "
        "'small_cnn' has no timm model: choose other formats (--format safetensors,pt2,onnx)"
    )
    with pytest.raises(ValueError, match=r"^--format timm writes a classifier as a timm model, .* is none: choose"):
        check_timm_exportable(torch.nn.Identity(), dense=True)
