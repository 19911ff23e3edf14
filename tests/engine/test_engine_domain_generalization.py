"""Domain generalization through the real command line: ``coretune fit --task domain_generalization`` on tiny
generated multi-domain trees, every objective, domain labels reaching the objectives, the reports of each selection
rule, ``coretune test`` of its checkpoint, the configs, the one-line errors and a Table 7 bench sweep."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from PIL import Image

from coretune import objectives
from coretune.cli import main
from coretune.data import ImageFileDataset, eval_transform
from coretune.data.domains import DomainGeneralizationData
from coretune.data.transforms import resize_transform
from coretune.engine import FineTuner, read_metrics
from coretune.engine.fitcli import resolved_fit_config
from coretune.objectives import CETuning
from coretune.runs.layout import RunDir
from coretune.tasks import Batch, DomainGeneralizationTask
from domain_trees import make_domain_tree
from fit_flags import QUIET, error
from inprocess_fits import fits_in_process

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--task", "domain_generalization", "--model.backbone=small_cnn", "--data.image_size=16", "--data.batch_size=6",
    "--data.steps_per_epoch=3", *QUIET,
]  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 domains (art, cartoon, photo, sketch) × 3 shapes × 5 images of 16 px."""
    return make_domain_tree(tmp_path_factory.mktemp("dg") / "tree", size=16)


def fit(tree: Path, run_dir: Path, *args: str) -> dict[str, Any]:
    main(["fit", *TINY, f"--data.root={tree}", "--data.test_domains=photo", f"--run_dir={run_dir}", *args])
    return json.loads((run_dir / "results.json").read_text())


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_every_objective_fits_with_domain_batches(name: str, tree: Path, tmp_path: Path) -> None:
    results = fit(tree, tmp_path / name, "--objective", name, "--trainer.max_epochs=1")
    test = results["test"]
    assert set(test["test_domains"]) == {"photo"} and 0.0 <= test["top1"] <= 1.0
    assert set(test["training_domains_heldout"]) == {"art", "cartoon", "sketch"}
    assert len(read_metrics(tmp_path / name / "metrics.csv")) == 1


def test_domain_labels_reach_the_objectives_that_take_them(tree: Path, tmp_path: Path) -> None:
    # same-domain positives need the batches' domain labels: the fit would stop at its first step without them
    results = fit(tree, tmp_path / "run", "--objective", "core", "--objective.same_domain_positives=true",
                  "--trainer.max_epochs=1")  # fmt: skip
    assert results["test"]["top1"] >= 0.0
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["model"]["task"] == "domain_generalization"
    assert config["objective"]["init_args"]["same_domain_positives"] is True

    seen: dict[str, Any] = {}

    class Spy(CETuning):
        takes_domains = True  # declared: the task passes the domain labels to objectives that say they take them

        def forward(self, features: torch.Tensor, labels: torch.Tensor, *, inputs: Any = None, domains: Any = None):
            seen["domains"] = domains
            return super().forward(features, labels, inputs=inputs)

    task = DomainGeneralizationTask()
    batch = task.unpack((torch.zeros(4, 3, 8, 8), torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 2, 2])))
    assert batch.extras["domains"].tolist() == [0, 0, 2, 2]
    spy = Spy()
    spy.build(5, 2)
    task.loss(spy, torch.randn(4, 5), batch, batch.inputs)
    assert seen["domains"].tolist() == [0, 0, 2, 2]
    plain = objectives.create("ce", 5, 2)  # takes no domain labels: trained on images and labels alone
    task.loss(plain, torch.randn(4, 5), Batch(batch.inputs, batch.targets, batch.extras), batch.inputs)


def test_each_unseen_domain_the_held_out_parts_and_the_chosen_checkpoint_are_reported(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    results = fit(tree, run, "--objective", "ce_con", "--trainer.max_epochs=3", "--model.optim.optimizer=adam",
                  "--model.optim.lr=0.003", "--model.optim.schedule=exponential", "--seed=1")  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    rows = read_metrics(run / "metrics.csv")
    assert len(rows) == 3 and {"val/art/top1", "val/cartoon/top1", "val/sketch/top1", "val/top1"} <= set(rows[0])
    for row in rows:  # val/top1 is the unweighted mean over the training domains' held-out parts
        parts = [float(row[f"val/{d}/top1"]) for d in ("art", "cartoon", "sketch")]
        assert float(row["val/top1"]) == pytest.approx(sum(parts) / 3)
    scores = [float(r["val/top1"]) for r in rows]
    best = scores.index(max(scores))  # ModelCheckpoint keeps the first of equal bests
    test = results["test"]
    selection = test["selection"]
    assert selection["rule"] == "training_domain_validation" and selection["oracle"] is False
    assert selection["checkpoint"] == "best.ckpt" and selection["path"].endswith("checkpoints/best.ckpt")
    assert (selection["epoch"], selection["step"]) == (best, int(rows[best]["step"]))
    assert selection["score"] == pytest.approx(max(scores))  # its held-out parts, scored again in the test
    assert test["training_domain_val_top1"] == pytest.approx(max(scores))
    assert test["training_domains_heldout"]["art"] == pytest.approx(float(rows[best]["val/art/top1"]))
    assert test["top1"] == test["test_domains"]["photo"] and "photo" in test["test_domains_heldout"]
    assert results["validated_on_test_images"] is False
    assert "unseen domain(s): photo" in out and "selection: training-domain validation set (best.ckpt, epoch" in out
    assert "ORACLE" not in out
    # coretune test of the chosen checkpoint: the same entry, its split drawn with the run's seed (1) and unseen
    # domain, both from the checkpoint (they used to default to seed 0 and none: held-out parts of other images)
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'best.ckpt'}", f"--data.root={tree}"])
    scored = json.loads((run / "test_results.json").read_text())
    assert scored["data"]["seed"] == 1 and scored["data"]["test_domains"] == "photo"
    for key in ("test_domains", "test_domains_heldout", "training_domains_heldout"):
        assert scored["test"][key] == pytest.approx(test[key]), key
    assert {k: v for k, v in scored["test"]["selection"].items() if k != "path"} == pytest.approx(
        {k: v for k, v in selection.items() if k != "path"}
    )
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={tree}"])
    last = json.loads((run / "test_results.json").read_text())["test"]["selection"]
    assert last["checkpoint"] == "last.ckpt" and last["epoch"] == 2  # the file it tested, not the rule's best.ckpt
    # a domain it trained on, named as unseen: refused (its training images would pass for new ones); data without
    # the checkpoint's unseen domain is another data set, whose domains are all new to the model
    with pytest.raises(SystemExit) as exit_:
        main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={tree}",
              "--data.test_domains=sketch"])  # fmt: skip
    assert str(exit_.value.code).startswith(
        f"coretune test: error: checkpoint {run / 'checkpoints' / 'last.ckpt'} trained on domain(s) ['sketch'] (its "
        "unseen domains are ['photo']): scored as unseen, their training images would pass for new ones; pass "
        "--data.test_domains photo"
    )
    other = Path(shutil.copytree(tree, tmp_path / "other", ignore=shutil.ignore_patterns("photo")))
    main(["test", f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"--data.root={other}",
          "--data.test_domains=sketch", f"--output={tmp_path / 'other.json'}"])  # fmt: skip


@pytest.mark.parametrize("rule", ["test_domain_validation", "last_checkpoint"])
def test_the_oracle_and_the_last_checkpoint_test_the_last_weights(
    rule: str, tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = fit(tree, tmp_path / rule, "--objective", "ce", "--trainer.max_epochs=2", f"--data.selection={rule}")
    out = " ".join(capsys.readouterr().out.split())
    selection = results["test"]["selection"]
    assert selection["checkpoint"] == "last.ckpt" and (selection["epoch"], selection["step"]) == (1, 6)
    if rule == "test_domain_validation":
        assert selection["oracle"] is True and selection["name"] == "test-domain validation set (oracle)"
        assert selection["score"] == results["test"]["test_domain_val_top1"]
        assert "ORACLE: its score reads the unseen domains' held-out images" in out
    else:
        assert selection["oracle"] is False and "ORACLE" not in out


@pytest.mark.parametrize("never", ["--trainer.limit_val_batches=0", "--trainer.check_val_every_n_epoch=2"])
def test_a_fit_that_would_never_validate_is_refused_before_training(never: str, tree: Path, tmp_path: Path) -> None:
    """The training-domain rule tests the best.ckpt validation chooses: a fit that cannot validate is refused before
    any training (it tested an earlier run's best.ckpt, or failed on a missing file after training)."""
    what = (
        "--trainer.limit_val_batches 0"
        if "limit" in never
        else ("--trainer.check_val_every_n_epoch 2 beyond --trainer.max_epochs 1")
    )
    run = tmp_path / "run"
    assert error(["fit", *TINY, f"--data.root={tree}", "--data.test_domains=photo", "--trainer.max_epochs=1",
                  f"--run_dir={run}", never]) == (
        f"{what} runs no validation, but this fit ends by testing the checkpoints/best.ckpt that validation chooses "
        "(--data.selection training_domain_validation): let it validate, or test the last weights (--data.selection "
        "last_checkpoint)"
    )  # fmt: skip
    assert not run.exists()


@pytest.mark.filterwarnings("ignore:`ModelCheckpoint\\(monitor='val/top1'\\)` could not find")  # last_checkpoint
@pytest.mark.parametrize(
    ("options", "first"),
    [(["--trainer.max_steps=2"], 3), (["--trainer.max_steps=5", "--trainer.check_val_every_n_epoch=2"], 6)],
)
def test_a_fit_whose_max_steps_end_before_its_first_validation_is_refused_before_training(
    options: list[str], first: int, tree: Path, tmp_path: Path
) -> None:
    """--trainer.max_steps 2 of an epoch's 3 steps trained, then failed: "no validation … chose its
    checkpoints/best.ckpt … (the best checkpoint the resumed run chose is …/last.ckpt …)", of a run never resumed."""
    run = tmp_path / "run"
    steps = options[0].partition("=")[2]
    assert error(["fit", *TINY, f"--data.root={tree}", "--data.test_domains=photo", f"--run_dir={run}", *options]) == (
        f"--trainer.max_steps {steps} ends this fit before its first validation, after {first} optimiser steps, so no "
        "validation would choose the checkpoints/best.ckpt it ends by testing (--data.selection "
        f"training_domain_validation): pass --trainer.max_steps {first} or more, or test the last weights "
        "(--data.selection last_checkpoint)"
    )
    assert not run.exists()
    # the fix it names: the last weights, tested after the steps asked for
    selection = fit(tree, run, *options, "--data.selection=last_checkpoint")["test"]["selection"]
    assert selection["checkpoint"] == "last.ckpt" and selection["step"] == int(steps)


def test_a_fit_never_tests_another_runs_best_ckpt(tree: Path, tmp_path: Path) -> None:
    """A finished run re-run in its folder is tested again from its own best.ckpt; resumed into another folder
    without validating (``--ckpt_path`` of the first run's last.ckpt, nothing left to train), the best.ckpt the
    restored callback names is the first run's, and the new folder's (an earlier, unfinished run's) is not tested."""
    first = tmp_path / "first"
    tested = fit(tree, first, "--trainer.max_epochs=1")["test"]
    assert fit(tree, first, "--trainer.max_epochs=1")["test"] == tested  # re-run: tested again, same checkpoint
    second = tmp_path / "second"
    (second / "checkpoints").mkdir(parents=True)
    (second / "checkpoints" / "best.ckpt").write_bytes(b"an earlier run's")
    last = first / "checkpoints" / "last.ckpt"  # nothing left to train: no last.ckpt in the second folder
    args = [f"--ckpt_path={last}", f"--run_dir={second}", "--trainer.max_epochs=1"]
    assert error(["fit", *TINY, f"--data.root={tree}", "--data.test_domains=photo", *args]) == (
        "no validation of this run chose its checkpoints/best.ckpt (the file there is an earlier run's), and this "
        "fit ends by testing it (--data.selection training_domain_validation): the trained weights are in "
        f"{last}; test them with coretune test --ckpt_path {last} (the best checkpoint the resumed run chose is "
        f"{(first / 'checkpoints' / 'best.ckpt').resolve()}: test that one), or fit again into a new --run_dir with "
        "--trainer.check_val_every_n_epoch at most --trainer.max_epochs"
    )
    assert (second / "checkpoints" / "best.ckpt").read_bytes() == b"an earlier run's"


def test_predict_reads_new_images_as_the_test_split_does(tree: Path, tmp_path: Path) -> None:
    """A DG model is tested on whole images resized to a square (DomainBed's evaluation): ``coretune predict`` must
    read a folder the same way, not resize-and-centre-crop as classification does (which cuts a wide image's sides)."""
    fit(tree, tmp_path / "run", "--objective", "ce", "--trainer.max_epochs=1")
    ckpt = RunDir(tmp_path / "run").last_checkpoint
    folder = tmp_path / "new"
    folder.mkdir()
    for i, shape in enumerate(("disc", "square", "triangle")):  # wide images: the shape at the left edge
        left = Image.open(sorted((tree / "photo" / shape).iterdir())[0]).convert("RGB")
        wide = Image.new("RGB", (48, 16), (255, 255, 255))
        wide.paste(left, (0, 0))
        wide.save(folder / f"{i}.png")
    out = tmp_path / "preds.csv"
    main(["predict", f"--ckpt_path={ckpt}", f"--input={folder}", f"--output={out}"])
    model = FineTuner.from_checkpoint(ckpt).eval()
    rows = list(csv.DictReader(out.open()))
    predicted = torch.tensor([[float(r[f"p_{n}"]) for n in model.class_names] for r in rows])

    def probs(transform: Any) -> torch.Tensor:
        files = ImageFileDataset(str(folder), transform)
        with torch.no_grad():
            return torch.softmax(model(torch.stack([files[i][0] for i in range(len(files))])), dim=1)

    assert torch.allclose(predicted, probs(resize_transform(16)), atol=1e-5)
    assert not torch.allclose(predicted, probs(eval_transform(16)), atol=1e-3)  # the crop would differ


@pytest.mark.parametrize(
    ("change", "args", "message"),
    [
        ("remove_class", [], "domain 'sketch' (ROOT/sketch) is missing class folder(s) ['triangle'] that 'art' has"),
        (None, ["--data.test_domains=foto"],
         "unknown test domain(s) ['foto']: the domains under the data root are ['art', 'cartoon', 'photo', 'sketch']"),
        ("one_domain", ["--data.test_domains=art"], "data root ROOT holds one domain folder ('art')"),
        (None, ["--data.batch_size=8"], "batch_size 8 does not split equally over the 3 training domains"),
        # the loaders read one domain after another: part of them would leave whole domains out of the scores
        (None, ["--trainer.limit_val_batches=0.5"],
         "--trainer.limit_val_batches=0.5: domain_generalization scores each domain on all its images, and the "
         "validation loader reads one domain after another, so part of it would leave whole domains out of the "
         "score: pass 1.0 (all batches)"),
        (None, ["--trainer.limit_test_batches=1"], "--trainer.limit_test_batches=1: domain_generalization scores"),
    ],
)  # fmt: skip
def test_bad_layouts_are_one_line_errors(change: str | None, args: list[str], message: str, tmp_path: Path) -> None:
    root = make_domain_tree(tmp_path / "tree", size=16)
    if change == "remove_class":
        shutil.rmtree(root / "sketch" / "triangle")
    elif change == "one_domain":
        for domain in ("cartoon", "photo", "sketch"):
            shutil.rmtree(root / domain)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *TINY, f"--data.root={root}", "--data.test_domains=photo", "--trainer.max_epochs=1", *args,
              f"--run_dir={tmp_path / 'r'}"])  # fmt: skip
    error = str(exit_.value.code)  # sys.exit(message): printed to stderr, exit status 1
    assert error.startswith("coretune fit: error: ") and "\n" not in error
    assert message.replace("ROOT", str(root)) in error


@pytest.mark.parametrize("config", ["dg/pacs.yaml", "dg/vlcs.yaml", "dg/office_home.yaml", "cpu/pacs.yaml"])
def test_the_configs_resolve_to_appendix_c(config: str, tree: Path) -> None:
    resolved = resolved_fit_config(
        [f"--config={REPO / 'configs' / config}", f"--data.root={tree}", "--data.test_domains=photo"]
    )
    model, data = resolved["model"], resolved["data"]
    assert model["task"] == "domain_generalization"
    optim = model["optim"]
    assert (optim["optimizer"], optim["lr"], optim["schedule"], optim["weight_decay"]) == (
        "adam", 5e-5, "exponential", 0.0,
    )  # fmt: skip
    assert data["selection"] == "training_domain_validation" and data["holdout_fraction"] == 0.2
    steps = resolved["trainer"]["max_epochs"] * data["steps_per_epoch"]
    if config.startswith("dg/"):
        assert (model["backbone"], data["image_size"], data["batch_size"], steps) == ("resnet50", 224, 96, 20_000)
    else:
        assert (model["backbone"], data["image_size"], data["batch_size"], steps) == ("resnet18", 64, 48, 1_500)
    DomainGeneralizationData(**data).check_folders()


def test_a_bench_spec_runs_every_split_objective_and_seed_in_table7(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fits_in_process(monkeypatch)  # the six fits: what the table reads of them, not their processes
    root = make_domain_tree(tmp_path / "tree", domains=("art", "photo", "sketch"), per_class=4, size=16)
    spec = {
        "name": "dg-tiny",
        "output": str(tmp_path / "out"),
        "base_args": [*TINY, f"--data.root={root}", "--data.batch_size=4", "--data.steps_per_epoch=2",
                      "--trainer.max_epochs=1"],
        "datasets": {d: [f"--data.test_domains={d}"] for d in ("art", "photo", "sketch")},
        "objectives": ["ce", "core"],
        "seeds": [0],
        "table": "table7",
    }  # fmt: skip
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(spec))
    main(["bench", str(path)])
    out = capsys.readouterr().out
    assert "| Method | art | photo | sketch | Avg. |" in out and "as in the paper's Table 7" in out
    assert "| CE |" in out and "| Core-tuning |" in out
    assert "Model selection: training-domain validation set (tests best.ckpt; chosen at epoch 1)." in out
    assert "## Held-out accuracy of the training domains" in out  # what the real runs' results.json hold
    for domain in ("art", "photo", "sketch"):
        for name in ("ce", "core"):
            results = json.loads((tmp_path / "out" / domain / name / "frac1" / "seed0" / "results.json").read_text())
            assert list(results["test"]["test_domains"]) == [domain]


def test_the_erm_pp_recipe_parses_and_a_tiny_fit_evaluates_its_moving_average(tree: Path, tmp_path: Path) -> None:
    """configs/dg/erm_pp.yaml (ERM++ as one recipe: the erm_pp objective, the SMA from step 600, DomainBed's Adam
    settings), scaled to 6 steps of a small CNN: the warm-up holds the backbone for 2 steps, the average starts at
    step 4 (the last checkpoint: the weights of steps 3 to 6), and the test scores the average the checkpoint chosen
    on the held-out parts holds."""
    config = REPO / "configs" / "dg" / "erm_pp.yaml"
    raw = yaml.safe_load(config.read_text())
    assert raw["objective"] == {"class_path": "coretune.objectives.ERMPlusPlus", "init_args": {"linear_steps": 500}}
    assert raw["averaging"] == {"sma_start_step": 600}
    assert raw["model"]["optim"] == {
        "optimizer": "adam", "lr": 5e-5, "weight_decay": 0.0, "schedule": "constant",
        "plateau_patience": 1, "plateau_stop": 3,  # train_autolr.py's first run
    }  # fmt: skip
    assert raw["trainer"]["max_epochs"] * raw["data"]["steps_per_epoch"] == 20_000  # 4x DomainBed's 5,001
    run = tmp_path / "run"
    main(["fit", f"--config={config}", *TINY, f"--data.root={tree}", "--data.test_domains=photo", f"--run_dir={run}",
          "--trainer.max_epochs=2", "--objective.linear_steps=1", "--averaging.sma_start_step=4"])  # fmt: skip
    results = json.loads((run / "results.json").read_text())
    # the test scores the checkpoint the training domains' held-out parts chose (best.ckpt), with its average
    tested = torch.load(results["best_checkpoint"], weights_only=True)["coretune"]["averaging"]
    assert results["averaging"] == tested
    assert tested["weights"] == "sma" and tested["sma_start_step"] == 4 and tested["sma_bn_pass"] is True
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["coretune"]["averaging"]
    assert last["steps_averaged"] == 4  # steps 3 to 6
    assert set(results["test"]["test_domains"]) == {"photo"}
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["model"]["optim"]["schedule"] == "constant" and written["model"]["backbone"] == "small_cnn"
