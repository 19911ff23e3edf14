"""One vocabulary for every command that loads a model (issues 62 and 63): ``--ckpt_path`` / ``--model.weights``,
``--data.*``, ``--trainer.accelerator/devices/precision``, ``-c/--config``; the older spellings still work for one
release, each with one deprecation line, and ``--help`` lists only the new ones; the device and precision are
resolved as ``coretune fit`` resolves them and applied where a command runs a model outside a Trainer (autocast seen
inside the model); a checkpoint saved on a GPU loads on a CPU."""

from __future__ import annotations

import csv
import json
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from coretune.apps.devices import Placement, placement
from coretune.apps.vocabulary import DEPRECATED, translate
from coretune.cli import main
from coretune.engine import FineTuner
from coretune.models import load_checkpoint_file
from fit_flags import QUIET, TINY_FIT, error

DEPRECATION = re.compile(r"^coretune \w+: (\S+) is deprecated and will be removed in the next release: use (.+)$")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small CNN fitted one epoch on a tiny tree: its data, last checkpoint, and a folder of images to predict."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("vocabulary")
    tree = make_image_tree(base / "data", size=16)
    main(["fit", f"--data.root={tree}", *TINY_FIT, f"--run_dir={base / 'run'}", *QUIET])
    return {"data": tree, "ckpt": base / "run" / "checkpoints" / "last.ckpt", "images": tree / "val" / "cat"}


def _deprecations(err: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for line in err.splitlines() if (m := DEPRECATION.match(line))]


# --- the table of old spellings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "old", "value", "new"),
    [
        (command, old, "cuda:1" if old == "--device" else "x", new)
        for command, table in DEPRECATED.items()
        for old, new in table.items()
    ],
)
def test_each_old_spelling_is_rewritten_with_one_line_however_often_given(
    capsys: pytest.CaptureFixture[str], command: str, old: str, value: str, new: object
) -> None:
    args = translate(command, ["--output=o", old, value, f"{old}={value}"])
    lines = _deprecations(capsys.readouterr().err)
    assert [old for old, _ in lines] == [old]  # once, though given twice
    if isinstance(new, str):
        assert args == ["--output=o", f"{new}={value}", f"{new}={value}"]
        assert lines[0][1] == new
    else:  # --device cuda:1
        assert args == ["--output=o", *(["--trainer.accelerator=gpu", "--trainer.devices=[1]"] * 2)]
        assert lines[0][1] == "--trainer.accelerator gpu --trainer.devices [1]"


def test_the_new_spellings_and_what_follows_a_double_dash_pass_as_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model.weights=w", "--ckpt_path", "c", "--", "--weights", "x"]
    assert translate("eval", args) == args
    assert capsys.readouterr().err == ""


# --- end to end: each old flag still works, and warns once ---------------------------------------------------------


def _cases() -> Iterator[tuple[str, list[str], str]]:
    yield "test", ["--precision", "32-true"], "--precision"
    yield "validate", ["--precision=32-true"], "--precision"
    for option, value in (("--image_size", "16"), ("--batch_size", "4"), ("--num_workers", "0"),
                          ("--on_bad_image", "skip")):  # fmt: skip
        yield "predict", [option, value], option
    yield "eval knn", ["--backbone", "small_cnn"], "--backbone"
    yield "eval knn", ["--weights", "{ckpt}"], "--weights"
    yield "eval knn", ["--weights_format", "auto"], "--weights_format"
    yield "eval knn", ["--weights_allow_cast", "false"], "--weights_allow_cast"
    yield "eval knn", ["--device", "cpu"], "--device"
    yield "eval robust", ["--ckpt", "{ckpt}"], "--ckpt"
    yield "eval robust", ["--device", "cpu"], "--device"


def _command(command: str, run: dict[str, Path], out: Path, given: list[str]) -> list[str]:
    """``command``'s arguments with ``given`` instead of its own spelling of the same option."""
    ckpt, data = str(run["ckpt"]), f"--data.root={run['data']}"
    base = {
        "test": ["test", f"--ckpt_path={ckpt}", data, f"--output={out}"],
        "validate": ["validate", f"--ckpt_path={ckpt}", data, f"--output={out}"],
        "predict": ["predict", f"--ckpt_path={ckpt}", f"--input={run['images']}", f"--output={out}"],
        "eval knn": ["eval", "knn", f"--model.weights={ckpt}", "--model.backbone=small_cnn", data,
                     "--data.image_size=16", f"--output={out}"],
        "eval robust": ["eval", "robust", f"--ckpt_path={ckpt}", data, "--attack=pgd", "--steps=1",
                        "--threat_models=linf:1/255", "--max_images=4", f"--output={out}"],
    }[command]  # fmt: skip
    old = given[0] if given else None
    replaced = {"--weights": "--model.weights=", "--backbone": "--model.backbone=", "--ckpt": "--ckpt_path="}
    if old in replaced:  # the command's own spelling of the option gives way to the old one
        base = [arg for arg in base if not arg.startswith(replaced[old])]
    return [*base, *(arg.format(ckpt=ckpt) for arg in given)]


@pytest.mark.parametrize(("command", "given", "old"), list(_cases()), ids=lambda v: str(v).replace(" ", "-"))
def test_an_old_flag_still_works_and_warns_once(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, given: list[str], old: str
) -> None:
    out = tmp_path / ("out.csv" if command == "predict" else "out.json")
    args = _command(command, run, out, [*given, *given])  # twice: one line
    main(args)
    assert out.is_file()
    lines = _deprecations(capsys.readouterr().err)
    assert [found for found, _ in lines] == [old]
    assert lines[0][1].startswith(("--trainer.", "--data.", "--model.", "--ckpt_path"))


# --- --help lists the new names alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["test", "validate", "predict", "export", "eval knn", "eval robust"])
def test_help_lists_only_the_new_names(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    text = capsys.readouterr().out
    for option in ("--ckpt_path", "--trainer.accelerator", "--trainer.devices", "--trainer.precision", "-c CONFIG"):
        assert option in text, option
    table = DEPRECATED.get(command, DEPRECATED["eval"] if command == "eval knn" else {})
    legacy = [*table, *(["--exported_program", "--torchscript", "--onnx"] if command == "export" else [])]
    for old in legacy:
        assert not re.search(rf"(?<![\w.]){re.escape(old)}(?![\w.])", text), old


def test_pretrain_takes_the_same_trainer_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    text = capsys.readouterr().out
    assert all(f"--trainer.{name}" in text for name in ("accelerator", "devices", "precision"))


# --- the device and precision --------------------------------------------------------------------------------------


def test_auto_is_cuda_when_available_else_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement(command="predict") == Placement(torch.device("cpu"), "32-true")
    assert error_of(lambda: placement("gpu", command="predict")) == (
        "--trainer.accelerator gpu: no CUDA device here: pass --trainer.accelerator cpu"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a fake CUDA machine of two devices
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert placement(command="predict").device == torch.device("cuda", 0)
    assert placement("gpu", "[1]", "bf16", command="eval") == Placement(torch.device("cuda", 1), "bf16-mixed")
    assert placement("cuda", [1], "16", command="eval").device == torch.device("cuda", 1)
    assert placement("auto", "1,", command="eval").device == torch.device("cuda", 1)
    assert placement("cpu", 1, 32, command="eval") == Placement(torch.device("cpu"), "32-true")
    assert error_of(lambda: placement("gpu", [3], command="eval")) == (
        "--trainer.devices [3]: this machine has CUDA devices 0 to 1"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"devices": 2},
            "--trainer.devices 2: coretune predict runs on one device: pass --trainer.devices 1 (the "
            "first) or [N] (device N)",
        ),
        ({"devices": [0, 1]}, "--trainer.devices [0, 1]: coretune predict runs on one device"),
        (
            {"precision": "bf16-true"},
            "--trainer.precision bf16-true: coretune predict runs a model at 32-true, "
            "bf16-mixed or 16-mixed (autocast): pass one of them",
        ),
        ({"accelerator": "tpu"}, "--trainer.accelerator tpu: choose auto, cpu, gpu (cuda) or mps"),
    ],
    ids=["two-devices", "a-list-of-two", "true-half", "tpu"],
)
def test_a_device_or_precision_it_cannot_run_is_named(options: dict, message: str) -> None:
    assert error_of(lambda: placement(**options, command="predict")).startswith(message)


def error_of(call: object) -> str:
    with pytest.raises(ValueError) as info:
        call()  # type: ignore[operator]
    return str(info.value)


@pytest.fixture
def conv_dtypes() -> Iterator[list[torch.dtype]]:
    """The dtypes of every ``nn.Conv2d`` output while the test runs (a global forward hook)."""
    seen: list[torch.dtype] = []

    def hook(module: nn.Module, _: object, output: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            seen.append(output.dtype)

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


BF16 = ["--trainer.accelerator=cpu", "--trainer.precision=bf16-mixed"]


@pytest.mark.parametrize("precision", [[], BF16], ids=["default-32", "bf16-mixed"])
@pytest.mark.parametrize("command", ["predict", "eval knn", "eval robust"])
def test_the_precision_applies_inside_the_model(
    run: dict[str, Path], tmp_path: Path, conv_dtypes: list[torch.dtype], command: str, precision: list[str]
) -> None:
    out = tmp_path / ("out.csv" if command == "predict" else "out.json")
    main([*_command(command, run, out, []), *precision])
    expected = torch.bfloat16 if precision else torch.float32
    assert conv_dtypes and set(conv_dtypes) == {expected}
    if command == "predict":  # float32 probabilities that sum to 1 whatever the precision
        rows = list(csv.DictReader(out.open()))
        assert rows and all(abs(sum(float(v) for k, v in row.items() if k.startswith("p_")) - 1) < 1e-4 for row in rows)
    else:
        assert json.loads(out.read_text())


def test_test_and_validate_hand_the_trainer_options_to_lightning(run: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    main(["test", f"--ckpt_path={run['ckpt']}", f"--data.root={run['data']}", f"--output={out}", *BF16])
    assert json.loads(out.read_text())["test"]
    assert error(["validate", f"--ckpt_path={run['ckpt']}", "--trainer.accelerator=tpu"]).startswith(
        "invalid trainer settings"
    )


def test_export_checks_in_float32_and_refuses_another_precision(run: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert error(["export", f"--ckpt_path={run['ckpt']}", f"--output={out}", "--trainer.precision=bf16-mixed"]) == (
        "--trainer.precision bf16-mixed: coretune export writes float32 files and checks them in float32 against the "
        "checkpoint's model: pass --trainer.precision 32-true (or leave it out)"
    )
    assert not out.exists()
    main(["export", f"--ckpt_path={run['ckpt']}", f"--output={out}", "--format=safetensors", "--trainer.devices=1"])
    assert json.loads((out / "config.json").read_text())["check"]["max_abs_logit_difference"]["safetensors"] < 1e-4


def test_a_short_config_option_reads_a_runs_config(run: dict[str, Path], tmp_path: Path) -> None:
    config = run["ckpt"].parent.parent / "config.yaml"
    out = tmp_path / "p.csv"
    main(["predict", "-c", str(config), f"--ckpt_path={run['ckpt']}", f"--input={run['images']}", f"--output={out}"])
    assert len(list(csv.DictReader(out.open()))) == 4


def test_eval_scores_a_fine_tuned_checkpoint_by_ckpt_path(run: dict[str, Path], tmp_path: Path) -> None:
    data = [f"--data.root={run['data']}", "--data.image_size=16", "--k=3"]
    by_weights, by_ckpt = tmp_path / "w.json", tmp_path / "c.json"
    main(["eval", "knn", f"--model.weights={run['ckpt']}", *data, f"--output={by_weights}"])
    main(["eval", "knn", f"--ckpt_path={run['ckpt']}", *data, f"--output={by_ckpt}"])
    assert json.loads(by_ckpt.read_text()) == json.loads(by_weights.read_text())
    assert error(["eval", "knn", f"--ckpt_path={run['ckpt']}", f"--model.weights={run['ckpt']}", *data]).startswith(
        f"--ckpt_path {run['ckpt']} and --model.weights {run['ckpt']} both given"
    )


# --- a checkpoint saved on a GPU loads on a CPU ---------------------------------------------------------------------


def _as_if_saved_on_cuda(source: Path, target: Path) -> None:
    """``source`` (a ``torch.save`` zip) with every storage tagged ``cuda:0``, as a GPU run saves it: its pickle's
    location string rewritten (protocol 2's ``X`` opcode: 4-byte length, then the text)."""
    with zipfile.ZipFile(source) as z, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            data = z.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            out.writestr(info, data)


def test_a_checkpoint_saved_on_a_gpu_loads_on_the_cpu(run: dict[str, Path], tmp_path: Path) -> None:
    cuda = tmp_path / "cuda.ckpt"
    _as_if_saved_on_cuda(run["ckpt"], cuda)
    if not torch.cuda.is_available():  # the file really is CUDA-tagged: torch refuses it without map_location
        with pytest.raises(RuntimeError, match="CUDA device"):
            torch.load(cuda, weights_only=True)
    raw = load_checkpoint_file(cuda)  # map_location="cpu"
    assert {t.device.type for t in raw["state_dict"].values()} == {"cpu"}
    on_cpu, original = FineTuner.from_checkpoint(cuda), FineTuner.from_checkpoint(run["ckpt"])
    for (name, a), (_, b) in zip(on_cpu.state_dict().items(), original.state_dict().items(), strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b), name
    # and the commands read it as they read the CPU one
    out = tmp_path / "p.csv"
    main(["predict", f"--ckpt_path={cuda}", f"--input={run['images']}", f"--output={out}", "--trainer.accelerator=cpu"])
    assert len(list(csv.DictReader(out.open()))) == 4
    # the other way round: a CPU checkpoint's model moved to another device (meta: no GPU needed) and back
    moved = FineTuner.from_checkpoint(run["ckpt"], map_location="meta")
    assert {p.device.type for p in moved.parameters()} == {"meta"}


def test_a_predict_config_of_the_old_flat_options_still_applies(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "predict.yaml"
    config.write_text("image_size: 8\nbatch_size: 2\ndata:\n  batch_size: 3\n")  # data's own wins
    seen: list[tuple[int, ...]] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, inputs, _: seen.append(tuple(inputs[0].shape)) if isinstance(m, FineTuner) else None
    )
    try:
        main(["predict", f"--config={config}", f"--ckpt_path={run['ckpt']}", f"--input={run['images']}",
              f"--output={tmp_path / 'p.csv'}"])  # fmt: skip
    finally:
        handle.remove()
    assert seen == [(3, 3, 8, 8), (1, 3, 8, 8)]
    line = (
        f"coretune predict: --config {config} sets image_size, batch_size, which is deprecated and will be removed in "
        "the next release: use data: {image_size: …, batch_size: …}"
    )
    assert line in capsys.readouterr().err.splitlines()
