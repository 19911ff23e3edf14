"""``coretune eval robust`` through the command line: a fitted tiny checkpoint, its clean and robust accuracy under
coretune's PGD, torchattacks' PGD and AutoAttack, the JSON file, ``--config``, and the one-line errors."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from coretune.apps.robustness import parse_threat
from coretune.cli import main
from coretune.runs.layout import RunDir
from coretune.sweeps.measures import robust_measures
from fit_flags import QUIET, TINY_FIT, error

# Three grey levels 6 apart with a little noise: learnable at 8 px, and ℓ∞ 8/255 can move any image past a
# neighbouring class's level, so an undefended model keeps (almost) nothing there.
GREYS = np.array([[122] * 3, [128] * 3, [134] * 3])


@pytest.fixture(scope="module")
def fitted_greys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A grey-level image tree (30 training and 10 test images per class) and a small CNN fitted on it at 8 px."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("greys")
    tree = make_image_tree(base / "data", per_class=30, val_per_class=10, size=16, palette=GREYS, noise=4)
    run = base / "run"
    main(["fit", *TINY_FIT, *QUIET, f"--data.root={tree}", f"--run_dir={run}", "--data.image_size=8",
          "--data.batch_size=10", "--trainer.max_epochs=5", "--model.optim.lr=0.02"])  # fmt: skip
    return tree, RunDir(run).last_checkpoint


def test_clean_and_robust_accuracy_of_a_checkpoint_under_both_pgds(
    fitted_greys: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, ckpt = fitted_greys
    capsys.readouterr()
    main(["eval", "robust", f"--ckpt_path={ckpt}", f"--data.root={tree}"])
    out = capsys.readouterr().out
    output = RunDir.of_checkpoint(ckpt).robust_results
    written = json.loads(output.read_text())
    pgd, referee = written["reports"]
    assert (pgd["attack"], referee["attack"]) == ("pgd", "torchattacks-pgd")
    assert written["checkpoint"] == str(ckpt) and written["split"] == "test"
    assert written["checkpoint_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()  # which weights it scored
    assert written["adversarial_training"] == {"enable": False, "norm": "linf", "eps": 8 / 255, "steps": 10,
                                               "step_size": None, "random_start": True}  # fmt: skip
    assert written["data"]["image_size"] == 8  # the checkpoint's size, and its normalisation inside the model
    assert written["data"]["mean"] == [0.485, 0.456, 0.406] and written["data"]["std"] == [0.229, 0.224, 0.225]
    # the paper's six threat models, PGD-10 with the step 2.5·ε/10
    assert [(r["norm"], r["eps"]) for r in pgd["results"]] == [
        parse_threat(t) for t in ("l2:0.5", "l2:1.5", "l2:2.5", "linf:2/255", "linf:4/255", "linf:8/255")
    ]
    assert pgd["steps"] == referee["steps"] == 10 and pgd["num_images"] == 30
    assert all(r["step_size"] == pytest.approx(r["eps"] / 4) for r in pgd["results"])
    # clean accuracy in pixel space equals the usual evaluation's
    main(["test", f"--ckpt_path={ckpt}", f"--data.root={tree}", f"--output={tmp_path / 't.json'}",
          "--trainer.precision=32-true"])  # fmt: skip
    assert (
        pgd["clean_accuracy"]
        == referee["clean_accuracy"]
        == pytest.approx(json.loads((tmp_path / "t.json").read_text())["test"]["top1"])
    )
    assert pgd["clean_accuracy"] >= 0.7
    # the two PGDs agree within noise (one image of 30); an undefended model keeps nothing at ℓ∞ 8/255
    for ours, theirs in zip(pgd["results"], referee["results"], strict=True):
        assert abs(ours["accuracy"] - theirs["accuracy"]) <= 1 / 30 + 1e-9, (ours, theirs)
    assert pgd["results"][-1]["accuracy"] <= 0.05 and referee["results"][-1]["accuracy"] <= 0.05
    lines = out.splitlines()
    assert lines[0] == f"{ckpt}: 30 test images, seed 0"
    assert lines[1].split() == ["pgd-10", "torchattacks-pgd-10"]
    assert lines[2].split()[:2] == ["clean", f"{100 * pgd['clean_accuracy']:.2f}%"]
    assert lines[8].split()[:3] == ["ℓ∞", "8/255", f"{100 * pgd['results'][-1]['accuracy']:.2f}%"]
    assert lines[-1] == f"robust results: {output}"


def test_autoattack_a_config_and_a_chosen_threat_model(fitted_greys: tuple[Path, Path], tmp_path: Path) -> None:
    """The grey images' model has 3 classes: AutoAttack's targeted attacks need 4 (their DLR loss), which the
    command says in one line before attacking (torchattacks' AutoAttack failed inside APGD-T whenever an image
    survived APGD-CE); coretune's PGD scores it. AutoAttack on 10 classes: tests/test_robustness.py."""
    _, ckpt = fitted_greys
    config = RunDir.of_checkpoint(ckpt).config  # the fit's data folder
    out = tmp_path / "aa.json"
    args = ["eval", "robust", f"--config={config}", f"--ckpt_path={ckpt}", "--threat_models", "linf:8/255",
            "--max_images=12", f"--output={out}"]  # fmt: skip
    assert error([*args, "--attack", "[pgd, autoattack]"]) == (
        "AutoAttack needs a model of 4 or more classes (its targeted attacks' DLR loss), this one has 3: use "
        "--attack pgd"
    )
    assert not out.exists()
    main([*args, "--attack", "pgd"])
    results = json.loads(out.read_text())
    (report,) = results["reports"]
    assert (report["attack"], report["num_images"], report["steps"]) == ("pgd", 12, 10)
    assert results["sample"] == {"max_images": 12, "seed": 0}


def test_a_resumed_runs_config_leaves_the_scored_checkpoint_alone(
    fitted_greys: tuple[Path, Path], tmp_path: Path
) -> None:
    # a resumed fit's config.yaml records what it resumed from (ckpt_path: last); after --ckpt it overrode the
    # checkpoint to score, and eval robust looked for a file named "last"
    _, ckpt = fitted_greys
    recorded = yaml.safe_load(RunDir.of_checkpoint(ckpt).config.read_text())
    config, out = tmp_path / "config.yaml", tmp_path / "pgd.json"
    for resumed_from in ("last", str(tmp_path / "elsewhere.ckpt")):
        config.write_text(yaml.safe_dump({**recorded, "ckpt_path": resumed_from}))
        main(["eval", "robust", f"--ckpt_path={ckpt}", f"--config={config}", "--attack=pgd", "--steps=1",
              "--threat_models=linf:4/255", "--max_images=4", f"--output={out}"])  # fmt: skip
        assert json.loads(out.read_text())["checkpoint"] == str(ckpt)
    # the user's own YAML (no fit's trainer, run_dir or seed) may name the checkpoint to score
    config.write_text(yaml.safe_dump({"ckpt_path": str(ckpt), "data": recorded["data"]}))
    main(["eval", "robust", f"--config={config}", "--attack=pgd", "--steps=1", "--threat_models=linf:4/255",
          "--max_images=4", f"--output={out}"])  # fmt: skip
    assert json.loads(out.read_text())["checkpoint"] == str(ckpt)


def test_max_images_of_the_whole_test_set_is_recorded_as_the_whole_set(
    fitted_greys: tuple[Path, Path], tmp_path: Path
) -> None:
    """``--max_images`` at least the test set's size (30 images) scored every image but recorded a sample, which
    Table 8 tabulates in columns of its own (``clean [30 images]``) beside the same numbers of the whole set."""
    tree, ckpt = fitted_greys
    args = ["eval", "robust", f"--ckpt_path={ckpt}", f"--data.root={tree}", "--attack=pgd", "--steps=1",
            "--threat_models=linf:4/255"]  # fmt: skip
    main([*args, f"--output={tmp_path / 'whole.json'}"])
    whole = json.loads((tmp_path / "whole.json").read_text())
    for n in (30, 100):
        out = tmp_path / f"max{n}" / "robust_results.json"
        main([*args, f"--max_images={n}", f"--output={out}"])
        results = json.loads(out.read_text())
        assert results["sample"] is None and results["reports"] == whole["reports"]
        assert whole["reports"][0]["num_images"] == 30
        assert list(robust_measures(out.parent, {})) == ["clean", "pgd-1 ℓ∞ 4/255"]
    main([*args, "--max_images=29", f"--output={out}"])  # one image fewer: a sample
    assert json.loads(out.read_text())["sample"] == {"max_images": 29, "seed": 0}


def test_a_fractional_step_size_is_recorded_as_a_number(fitted_greys: tuple[Path, Path], tmp_path: Path) -> None:
    tree, ckpt = fitted_greys
    out = tmp_path / "pgd.json"
    main(["eval", "robust", f"--ckpt_path={ckpt}", f"--data.root={tree}", "--attack=pgd", "--threat_models=linf:4/255",
          "--steps=2", "--step_size=2/255", "--max_images=4", f"--output={out}"])  # fmt: skip
    (report,) = json.loads(out.read_text())["reports"]
    assert report["results"][0]["step_size"] == 2 / 255 and report["steps"] == 2
    # one labelled folder without training data (tree/val's class folders) is scored too
    main(["eval", "robust", f"--ckpt_path={ckpt}", f"--data.root={tree / 'val'}", "--attack=pgd", "--steps=2",
          "--threat_models=linf:4/255", f"--output={out}"])  # fmt: skip
    assert json.loads(out.read_text())["reports"][0]["num_images"] == 30


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--threat_models=linf:-0.1"], "PGD eps must be a finite radius >= 0 in [0, 1] pixel units (e.g. 8/255), got"),
        (["--threat_models=[l2:0.5, l1:0.5]"], "PGD norm must be one of linf, l2; got 'l1'"),
        (["--threat_models=linf8"], "threat model 'linf8' is not NORM:EPS: write e.g. linf:8/255 or l2:0.5"),
        (["--steps=0"], "PGD steps must be >= 1, got 0"),
        (["--step_size=0"], "PGD step_size must be > 0 (or None for 2.5·eps/steps), got 0.0"),
        (
            ["--step_size=2/O"],
            "PGD step_size must be a number or a fraction in [0, 1] pixel units (e.g. 8/255 or 0.5), got '2/O'",
        ),
        (["--attack=fgsm"], "unknown attack 'fgsm': choose one of pgd, torchattacks-pgd, autoattack"),
        (["--attack=[]"], "--attack names no attack: choose one or more of pgd, torchattacks-pgd, autoattack"),
        (["--max_images=0"], "max_images must be >= 1 (or None for every image), got 0"),
    ],
)
def test_bad_settings_are_one_line_before_the_checkpoint_is_read(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.ckpt"  # the settings are checked first: no "checkpoint not found"
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "robust", f"--ckpt_path={missing}", f"--data.root={tmp_path}", *options])
    assert exit_.value.code.startswith(f"coretune eval: error: {message}") and "\n" not in exit_.value.code
    assert not list(tmp_path.iterdir())


def test_a_missing_robust_extra_is_one_line(
    fitted_greys: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree, ckpt = fitted_greys
    monkeypatch.setitem(sys.modules, "torchattacks", None)  # as if it were not installed
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit, match=re.escape(
        "coretune eval: error: this attack needs torchattacks, which is not installed: pip install 'coretune[robust]'"
    )):  # fmt: skip
        main(["eval", "robust", f"--ckpt_path={ckpt}", f"--data.root={tree}", f"--output={out}"])
    assert not out.exists()
    # coretune's own PGD needs nothing
    main(["eval", "robust", f"--ckpt_path={ckpt}", f"--data.root={tree}", f"--output={out}", "--attack=pgd",
          "--threat_models=l2:0.5", "--steps=2"])  # fmt: skip
    assert [r["attack"] for r in json.loads(out.read_text())["reports"]] == ["pgd"]


def test_eval_robust_help_names_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "robust", "--help"])
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: coretune eval robust")
    assert "--attack" in help_text and "--threat_models" in help_text and "--ckpt_path CKPT_PATH" in help_text
    assert "--ckpt " not in help_text and "--device" not in help_text  # deprecated: not listed
