"""LightningCLI's conventions in ``coretune``: ``--trainer.default_root_dir``, settings from the checkpoint,
``validate``, ``--config`` for the commands that read a fitted run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from coretune.cli import main
from coretune.runs.layout import RunDir
from fit_flags import QUIET, TINY_FIT


@pytest.fixture(scope="module")
def fitted16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny image tree and a run fitted on it at 16 px."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("fit16")
    tree = make_image_tree(base / "data")
    run = base / "run"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={tree}", f"--run_dir={run}"])
    return tree, run


def test_default_root_dir_is_the_parent_of_the_run_directory(image_tree: Path, tmp_path: Path) -> None:
    # it was accepted and ignored: the run went to runs/<objective>-<time>
    parent = tmp_path / "experiments"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={image_tree}", f"--trainer.default_root_dir={parent}"])
    (run,) = parent.iterdir()
    assert run.name.startswith("cetuning-")
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "results.json").is_file()


def test_test_evaluates_at_the_checkpoints_image_size(
    fitted16: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # it evaluated at 224 px unless --data.image_size was given again
    tree, run = fitted16
    out = tmp_path / "t.json"
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={tree}", f"--output={out}"])
    data = json.loads(out.read_text())["data"]
    stored = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["coretune"]["data"]
    assert data["image_size"] == stored["image_size"] == 16
    assert data["mean"] == list(stored["mean"]) and data["std"] == list(stored["std"])
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={tree}", f"--output={out}",
          "--data.image_size=24"])  # fmt: skip
    assert json.loads(out.read_text())["data"]["image_size"] == 24  # the command line still wins


def test_test_refuses_data_with_other_classes(fitted16: tuple[Path, Path], tmp_path: Path) -> None:
    from image_trees import make_image_tree

    _, run = fitted16
    other = make_image_tree(tmp_path / "other", classes=("ant", "bee", "cow"), per_class=2, val_per_class=1)
    ckpt = run / "checkpoints" / "last.ckpt"
    message = (
        f"the data's classes (ant, bee, cow) are not those checkpoint {ckpt} was fine-tuned on (cat, dog, eel): "
        "score it on data with the same class folders"
    )
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["test", f"--ckpt_path={ckpt}", f"--data.root={other}", f"--output={tmp_path / 't.json'}"])
    assert not (tmp_path / "t.json").exists()


def test_validate_scores_the_validation_split_into_val_results(
    fitted16: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, fitted_run = fitted16
    run = Path(shutil.copytree(fitted_run, tmp_path / "run"))
    fit_results = RunDir(run).results.read_bytes()
    ckpt = RunDir(run).best_checkpoint
    capsys.readouterr()
    main(["validate", f"--ckpt_path={ckpt}", f"--data.root={tree}", "--data.val_fraction=0.25"])
    out = capsys.readouterr().out
    written = json.loads(RunDir(run).val_results.read_text())
    assert out.endswith(
        json.dumps(written, indent=2, sort_keys=True) + f"\nvalidate results: {RunDir(run).val_results}\n"
    )
    assert written["checkpoint"] == str(ckpt) and written["data"]["image_size"] == 16
    assert written["validated_on_test_images"] is False
    assert 0 <= written["validate"]["top1"] <= 1 and written["validate"]["loss"] > 0
    assert RunDir(run).results.read_bytes() == fit_results
    # the same split the fit validated on gives the same top-1 as its best epoch
    main(["validate", f"--ckpt_path={ckpt}", f"--data.root={tree}"])
    again = json.loads(RunDir(run).val_results.read_text())
    assert again["validated_on_test_images"] is True
    assert again["validate"]["top1"] == pytest.approx(json.loads(fit_results)["best_val_top1"], abs=1e-6)


def test_a_runs_config_yaml_works_for_test_validate_predict_export_and_eval(
    fitted16: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # test, predict, export and eval took no --config: a run's config.yaml could not be reused
    tree, run = fitted16
    config, ckpt = RunDir(run).config, RunDir(run).last_checkpoint
    assert {"trainer", "model", "objective", "data"} <= set(yaml.safe_load(config.read_text()))
    for command in ("test", "validate"):
        out = tmp_path / f"{command}.json"
        main([command, f"--config={config}", f"--ckpt_path={ckpt}", f"--output={out}"])
        data = json.loads(out.read_text())["data"]
        assert (data["root"], data["image_size"], data["batch_size"]) == (str(tree), 16, 8)  # the fit's data

    main(
        [
            "predict",
            "--config",
            str(config),
            f"--ckpt_path={ckpt}",
            f"--input={tree / 'val'}",
            f"--output={tmp_path / 'a.csv'}",
        ]
    )
    main(["predict", f"--ckpt_path={ckpt}", f"--input={tree / 'val'}", f"--output={tmp_path / 'b.csv'}"])
    predictions = (tmp_path / "a.csv").read_text()
    assert predictions == (tmp_path / "b.csv").read_text() and predictions.count("\n") == 13

    main(["export", f"--config={config}", f"--ckpt_path={ckpt}", f"--output={tmp_path / 'export'}"])
    assert json.loads((tmp_path / "export" / "config.json").read_text())["image_size"] == 16

    result = tmp_path / "knn.json"
    main(["eval", "knn", f"--config={config}", f"--model.weights={ckpt}", "--k=3", f"--output={result}"])
    knn = json.loads(result.read_text())
    assert (knn["backbone"], knn["num_train"], knn["num_test"]) == ("small_cnn", 36, 12)  # the fit's data folder


def test_a_config_whose_data_is_another_commands_is_refused(
    fitted16: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, run = fitted16
    pretrain_config = tmp_path / "config.yaml"  # coretune pretrain's data: augmentations fine-tuning has not
    pretrain_config.write_text(
        yaml.safe_dump({"trainer": {"max_epochs": 1}, "data": {"root": str(tree), "jitter_p": 0.8}})
    )
    out = tmp_path / "t.json"
    with pytest.raises(SystemExit) as exit_:
        main(["test", f"--config={pretrain_config}", f"--ckpt_path={RunDir(run).last_checkpoint}", f"--output={out}"])
    assert exit_.value.code == 2 and not out.exists()
    assert capsys.readouterr().err.splitlines() == [
        "coretune test: error: Group 'data' does not accept option 'jitter_p' (coretune test --help lists the options)"
    ]


def test_no_module_shadows_a_name_its_package_exports() -> None:
    """A submodule named as a function its package imports from another module (``coretune.sweeps.compare`` beside
    the stats function ``compare``) replaces that function on the package once anything imports the submodule:
    ``from coretune.sweeps import compare`` then gave a module, depending on the order the tests ran in."""
    import ast

    root = Path(__file__).resolve().parents[1] / "src" / "coretune"
    clashes = []
    for init in root.rglob("__init__.py"):
        modules = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                for alias in node.names:
                    bound = alias.asname or alias.name
                    if bound in modules and node.module != bound and (node.module or "") != "":
                        clashes.append(f"{init.parent.name}.{bound} (imported from .{node.module})")
    assert clashes == []
