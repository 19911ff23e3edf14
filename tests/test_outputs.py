"""No command replaces what it did not make (issue 60, principles 1 and 2): every command that writes is refused,
before any image is read and with nothing changed, when its output is its own checkpoint, a run's file, the data
or a file inside it, a folder of other files, or an unwritable folder. A new command that writes joins
:data:`COMMANDS`."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from PIL import Image

from coretune.cli import main
from fit_flags import QUIET, TINY_FIT, error
from image_trees import make_image_tree
from segmentation_sets import make_voc_set


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny image tree, a VOC set, and a classification and a segmentation run fitted on them."""
    tmp = tmp_path_factory.mktemp("outputs")
    data = make_image_tree(tmp / "data", per_class=4, val_per_class=2, size=16)
    voc = make_voc_set(tmp / "voc", {"train": 4, "val": 2}, size=(24, 32), class_names=["bg", "box", "disc", "tri"])
    run, seg = tmp / "run", tmp / "seg"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={data}", f"--run_dir={run}"])
    seg_args = ["--task", "segmentation", "--model.backbone=resnet18", "--model.weights=null", f"--data.root={voc}"]
    main(["fit", *seg_args, f"--run_dir={seg}", "--data.image_size=24", "--data.batch_size=2",
          "--trainer.max_epochs=1", *QUIET])  # fmt: skip
    return {"tmp": tmp, "data": data, "voc": voc, "run": run, "seg": seg}


def _digests(root: Path) -> dict[str, object]:
    """Each file under ``root``: its SHA-256 (files over 1 MB, checkpoints: that of their first MB with their inode,
    size and modification time, which any write or replacement changes)."""
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            stat = path.stat()
            with path.open("rb") as f:
                digest = hashlib.sha256(f.read(1 << 20)).hexdigest()
            found[str(path.relative_to(root))] = (
                digest if stat.st_size <= 1 << 20 else (digest, stat.st_ino, stat.st_size, stat.st_mtime_ns)
            )
    return found


@contextmanager
def _immutable(folder: Path) -> Iterator[None]:
    """``folder`` made read-only for every user, root too (``chattr +i``; a plain ``chmod`` does not stop root)."""
    folder.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here: no folder is read-only for root")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def _no_image_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an image was read before the output was checked")

    monkeypatch.setattr(Image, "open", refuse)


Command = Callable[[dict[str, Path], Path], list[str]]


def _spec(w: dict[str, Path], output: Path) -> list[str]:
    spec = w["tmp"] / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "output": str(output), "datasets": {"tiny": [f"--data.root={w['data']}", *TINY_FIT]}, "objectives": ["ce"],
        "seeds": [0],
    }))  # fmt: skip
    return ["bench", str(spec)]


def _best(w: dict[str, Path]) -> Path:
    return w["run"] / "checkpoints" / "best.ckpt"


def _test(w: dict[str, Path], o: Path) -> list[str]:
    return ["test", f"--ckpt_path={_best(w)}", f"--data.root={w['data']}", f"--output={o}"]


def _validate(w: dict[str, Path], o: Path) -> list[str]:
    return ["validate", f"--ckpt_path={_best(w)}", f"--data.root={w['data']}", f"--output={o}"]


def _predict(w: dict[str, Path], o: Path) -> list[str]:
    return ["predict", f"--ckpt_path={_best(w)}", f"--input={w['data'] / 'val'}", f"--output={o}"]


def _predict_masks(w: dict[str, Path], o: Path) -> list[str]:
    ckpt = w["seg"] / "checkpoints" / "last.ckpt"
    return ["predict", f"--ckpt_path={ckpt}", f"--input={w['voc'] / 'JPEGImages'}", f"--output={o}"]


def _eval(protocol: str) -> Command:
    def args(w: dict[str, Path], o: Path) -> list[str]:
        return ["eval", protocol, "--model.backbone=small_cnn", f"--model.weights={_best(w)}",
                f"--data.root={w['data']}", "--data.image_size=16", f"--output={o}"]  # fmt: skip

    return args


def _eval_robust(w: dict[str, Path], o: Path) -> list[str]:
    return ["eval", "robust", f"--ckpt_path={_best(w)}", f"--data.root={w['data']}", "--steps=1", f"--output={o}"]


def _export(w: dict[str, Path], o: Path) -> list[str]:
    return ["export", f"--ckpt_path={_best(w)}", "--format=safetensors", f"--output={o}"]


def _fit(w: dict[str, Path], o: Path) -> list[str]:
    return ["fit", *TINY_FIT, *QUIET, f"--data.root={w['data']}", f"--run_dir={o}"]


def _pretrain(w: dict[str, Path], o: Path) -> list[str]:
    return ["pretrain", f"--data.root={w['data']}", "--model.backbone=small_cnn", "--data.image_size=16",
            "--trainer.max_epochs=1", *QUIET, f"--run_dir={o}"]  # fmt: skip


def _bench_export(w: dict[str, Path], o: Path) -> list[str]:
    return [*_spec(w, w["tmp"] / "bench-out"), f"--export={o}"]


def _tune(w: dict[str, Path], o: Path) -> list[str]:
    return ["tune", f"--output={o}", "--eta", "1", "--alpha", "1", "--", *TINY_FIT, f"--data.root={w['data']}"]


def _compare(w: dict[str, Path], o: Path) -> list[str]:
    return ["compare", f"--output={o}", "--methods=ce,ce_mix", "--seeds=2", *TINY_FIT, f"--data.root={w['data']}"]


COMMANDS: dict[str, tuple[str, str, Command]] = {
    # name: (what it writes: a file or a folder, the data it reads, its command line given the output)
    "test": ("file", "data", _test),
    "validate": ("file", "data", _validate),
    "predict": ("file", "data", _predict),
    "predict-segmentation": ("folder", "voc", _predict_masks),
    "eval-knn": ("file", "data", _eval("knn")),
    "eval-linear": ("file", "data", _eval("linear")),
    "eval-robust": ("file", "data", _eval_robust),
    "export": ("folder", "data", _export),  # the data its checkpoint was trained on
    "fit": ("folder", "data", _fit),
    "pretrain": ("folder", "data", _pretrain),
    "bench": ("folder", "data", _spec),
    "bench-export": ("folder", "data", _bench_export),
    "tune": ("folder", "data", _tune),
    "compare": ("folder", "data", _compare),
}

TARGETS: dict[str, Callable[[dict[str, Path], str, Path], Path]] = {
    # name: the protected output, given the world, the command's kind (file or folder) and its data
    "own-checkpoint": lambda w, kind, data: _best(w) if kind == "file" else w["run"] / "checkpoints",
    "config.yaml": lambda w, kind, data: w["run"] / "config.yaml",
    "metrics.csv": lambda w, kind, data: w["run"] / "metrics.csv",
    "results.json": lambda w, kind, data: w["run"] / "results.json",
    "last.ckpt": lambda w, kind, data: w["run"] / "checkpoints" / "last.ckpt",
    "data-root": lambda w, kind, data: data,
    "inside-data-root": lambda w, kind, data: data / "train" / ("out.json" if kind == "file" else "out"),
    "an-image": lambda w, kind, data: next((w["data"] / "train" / "cat").iterdir()),
    "a-mask": lambda w, kind, data: next((w["voc"] / "SegmentationClass").iterdir()),
    "foreign-folder": lambda w, kind, data: w["tmp"] / "mine" / ("notes.txt" if kind == "file" else ""),
    "read-only-folder": lambda w, kind, data: w["tmp"] / "locked" / ("out.json" if kind == "file" else "out"),
}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_writes_over_what_it_did_not_make(
    world: dict[str, Path], command: str, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind, data, args_of = COMMANDS[command]
    mine = world["tmp"] / "mine"
    mine.mkdir(exist_ok=True)
    (mine / "notes.txt").write_text("my own notes\n")
    output = TARGETS[target](world, kind, world[data])
    args = args_of(world, output)
    before = _digests(world["tmp"])
    _no_image_read(monkeypatch)
    if target == "read-only-folder":
        with _immutable(world["tmp"] / "locked"):
            message = error(args)
        assert "cannot write into" in message, message
    else:
        message = error(args)
    assert str(output).rstrip("/") in message or str(output.parent) in message, message
    assert _digests(world["tmp"]) == before  # nothing written, nothing replaced


def test_a_command_replaces_its_own_earlier_output(world: dict[str, Path], tmp_path: Path) -> None:
    """What a command wrote it may write again: test's JSON, predict's CSV and masks, an export, a run resumed."""
    main(["test", f"--ckpt_path={_best(world)}", f"--data.root={world['data']}", f"--output={tmp_path / 't.json'}"])
    main(["test", f"--ckpt_path={_best(world)}", f"--data.root={world['data']}", f"--output={tmp_path / 't.json'}"])
    assert json.loads((tmp_path / "t.json").read_text())["test"]
    for _ in range(2):
        main(["predict", f"--ckpt_path={_best(world)}", f"--input={world['data'] / 'val'}",
              f"--output={tmp_path / 'p.csv'}"])  # fmt: skip
        main(["predict", f"--ckpt_path={world['seg'] / 'checkpoints' / 'last.ckpt'}",
              f"--input={world['voc'] / 'JPEGImages'}", f"--output={tmp_path / 'masks'}"])  # fmt: skip
    assert (tmp_path / "masks" / ".coretune-predict").is_file()
    # validate's file is not test's: each command tells its own files by their content
    assert "was not written by coretune validate" in error(
        ["validate", f"--ckpt_path={_best(world)}", f"--data.root={world['data']}", f"--output={tmp_path / 't.json'}"]
    )


def test_case_1_test_output_onto_its_checkpoint_is_refused(world: dict[str, Path]) -> None:
    ckpt = _best(world)
    before = ckpt.read_bytes()
    message = error(["test", f"--ckpt_path={ckpt}", f"--data.root={world['data']}", f"--output={ckpt}"])
    assert message == f"--output {ckpt} is the checkpoint this command reads: pass another --output"
    assert ckpt.read_bytes() == before
    message = error(["validate", f"--ckpt_path={ckpt}", f"--data.root={world['data']}",
                     f"--output={world['run'] / 'metrics.csv'}"])  # fmt: skip
    assert "is the run file metrics.csv of" in message


def test_case_2_predicted_masks_never_replace_ground_truth(world: dict[str, Path]) -> None:
    masks = world["voc"] / "SegmentationClass"
    before = _digests(masks)
    message = error(["predict", f"--ckpt_path={world['seg'] / 'checkpoints' / 'last.ckpt'}",
                     f"--input={world['voc'] / 'JPEGImages'}", f"--output={masks}"])  # fmt: skip
    assert message.startswith(f"--output {masks} "), message
    assert _digests(masks) == before


def test_case_3_a_folder_of_the_users_own_files_is_no_run_dir(world: dict[str, Path], tmp_path: Path) -> None:
    mycfg = tmp_path / "mycfg"
    mycfg.mkdir()
    (mycfg / "config.yaml").write_text("trainer:\n  max_epochs: 7\n")
    (mycfg / "metrics.csv").write_text("epoch,mine\n0,1\n")
    before = _digests(mycfg)
    message = error(["fit", *TINY_FIT, *QUIET, f"--data.root={world['data']}", f"--run_dir={mycfg}"])
    assert message == (
        f"--run_dir {mycfg} holds files coretune fit did not make (it has no .coretune-fit), which it could replace: "
        "pass a new or empty folder as --run_dir"
    )
    assert _digests(mycfg) == before


def test_a_run_dir_fit_made_is_resumed_and_a_pretraining_run_is_refused(world: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={world['data']}", f"--run_dir={run}"])
    assert (run / ".coretune-fit").is_file()
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={world['data']}", f"--run_dir={run}"])  # a finished run: tested again
    (run / ".coretune-fit").unlink()  # a run from before the marker: recognised by its layout
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={world['data']}", f"--run_dir={run}"])
    (run / ".coretune-fit").unlink()
    (run / ".coretune-pretrain").write_text("")  # another command's folder, checkpoints/ and all
    assert "has no .coretune-fit" in error(["fit", *TINY_FIT, *QUIET, f"--data.root={world['data']}",
                                             f"--run_dir={run}"])  # fmt: skip


def test_case_9_evaluations_fail_up_front_on_a_read_only_run_folder(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``test``, ``validate`` and ``eval robust`` on a checkpoint in a read-only run folder: refused before any
    evaluation (whose result would be lost at the write)."""
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    ckpt = run / "checkpoints" / "best.ckpt"
    _no_image_read(monkeypatch)
    with _immutable(run):
        for command in (["test"], ["validate"], ["eval", "robust"]):
            message = error([*command, f"--ckpt_path={ckpt}", f"--data.root={world['data']}"])
            assert message.startswith("--output ") and f"cannot write into {run} (" in message, message


#: Commands that write nothing a user names, or whose output has a test of its own.
EXEMPT = {"objectives": "prints a table, writes nothing", "demo": "tests/test_demo.py (its --output is checked too)"}


def test_every_command_that_writes_is_in_the_table() -> None:
    from coretune.cli import COMMANDS as CLI_COMMANDS

    tabled = {name.split("-")[0] for name in COMMANDS}
    assert set(CLI_COMMANDS) == tabled | set(EXEMPT), "a new command joins COMMANDS (or EXEMPT, with the reason)"


def test_a_checkpoint_whose_run_config_is_not_yaml_names_no_training_data(tmp_path: Path) -> None:
    from coretune.runs.outputs import trained_data_paths

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("data: {root: [unclosed\n")  # a hand edit gone wrong: not YAML
    assert trained_data_paths(run / "checkpoints" / "best.ckpt") == []
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"root": str(tmp_path), "image_size": 16}}))
    assert trained_data_paths(run / "checkpoints" / "best.ckpt") == [tmp_path]


def test_a_folder_holding_only_another_process_probe_counts_as_empty(tmp_path: Path) -> None:
    """Workers of one study start at once on one --output: each probes that the folder is writable, and another's
    probe file, there for an instant, is no file of the user's."""
    from coretune.runs.outputs import check_folder_output

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".coretune-probe-x1y2").write_text("")
    assert check_folder_output(tmp_path / "out", "tune") == tmp_path / "out"
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files coretune tune did not make"):
        check_folder_output(tmp_path / "out", "tune")
