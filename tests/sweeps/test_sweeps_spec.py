"""``coretune bench``'s spec: the grid of runs and their fit arguments, and the errors of a bad spec."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from sweep_helpers import data_root, spec_of

from coretune.cli import main
from coretune.sweeps import BenchSpec, BenchSpecError, fit_command


def test_runs_of_the_grid_and_their_fit_arguments(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path,
        base_args=["--trainer.max_epochs=2"],
        objectives=["ce", {"name": "core_eta1", "objective": "core", "args": ["--objective.eta=1"]}],
        label_fractions=[0.1, 1.0],
        seeds=[0, 1],
    )
    runs = spec.runs()
    assert len(runs) == 2 * 2 * 2
    run = runs[-1]
    assert run.run_dir == tmp_path / "out" / "tiny" / "core_eta1" / "frac1" / "seed1"
    assert run.args == (
        "--trainer.max_epochs=2",
        f"--data.root={tmp_path / 'data'}",
        "--objective",
        "core",
        "--objective.eta=1",
        "--data.label_fraction=1.0",
        "--seed=1",
    )
    assert runs[0].run_dir.parent.name == "frac0.1"
    cmd = fit_command(run.args, run.run_dir)
    assert cmd[1:4] == ["-m", "coretune.cli", "fit"] and cmd[-1] == f"--run_dir={run.run_dir}"
    (run.run_dir / "checkpoints").mkdir(parents=True)
    (run.run_dir / "checkpoints" / "last.ckpt").touch()
    assert fit_command(run.args, run.run_dir)[-1] == "--ckpt_path=last"  # a started run resumes
    subset = spec.subset(objectives=["core_eta1"], seeds=[1])
    assert [r.run_dir for r in subset.runs()] == [r.run_dir for r in runs if r.objective == "core_eta1" and r.seed == 1]
    assert [r.args for r in subset.runs()] == [r.args for r in runs if r.objective == "core_eta1" and r.seed == 1]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"epochs": 3}, "unknown key(s) epochs"),
        ({"objectives": ["ce", "nope"]}, "unknown objective 'nope'"),
        ({"objectives": ["ce", "ce"]}, "objective names must be unique"),
        ({"label_fractions": [0.0, 1.0]}, "label_fractions must lie in (0, 1]"),
        ({"seeds": [0, 0]}, "seeds lists a value twice"),
        ({"table": "table3"}, "table must be one of table1, table2, table4"),
        ({"table": "table2", "objectives": ["ce", "l2sp"]}, "table2 takes the Table 2 rows only"),
        ({"datasets": {"a/b": []}}, "dataset name 'a/b' must be a non-empty folder name"),
        ({"base_args": "--trainer.max_epochs=3"}, "base_args must be a list of command-line arguments"),
        ({"baseline": "l2sp"}, "baseline 'l2sp' is not one of the objectives"),
        ({"metric": "train"}, "metric must be one of test, val (got 'train')"),
    ],
)
def test_spec_errors_name_the_problem(tmp_path: Path, entries: dict, message: str) -> None:
    with pytest.raises(BenchSpecError, match=r"^bench spec: .*" + re.escape(message)):
        spec_of(tmp_path, **entries)


@pytest.mark.parametrize(("what", "name"), [("dataset", ".."), ("dataset", "."), ("objective", "..")])
def test_a_name_that_leads_out_of_the_output_folder_is_refused(tmp_path: Path, what: str, name: str) -> None:
    """`..` or `.` passed the letters-and-dots check, and `OUT/..` put the runs beside the output folder."""
    datasets = {name if what == "dataset" else "tiny": [f"--data.root={data_root(tmp_path)}"]}
    objectives = [{"name": name, "objective": "ce"}] if what == "objective" else ["ce"]
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({"output": str(tmp_path / "out"), "datasets": datasets, "objectives": objectives}))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(config)])
    assert str(info.value.code) == (
        f"coretune bench: error: {config}: {what} name {name!r} must be a non-empty folder name of "
        "letters, digits and _ . + - (not . or .., which would lead out of the output folder)"
    )
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    ("seeds", "message"),
    [
        ([0, 1.9], "1.9 is not (got [0, 1.9])"),
        (2.0, "2.0 is not (got 2.0)"),
        ([1, True], "True is not (got [1, True])"),
    ],
    ids=["float", "one-float", "bool"],
)
def test_a_seed_that_is_not_an_integer_is_refused(tmp_path: Path, seeds: object, message: str) -> None:
    """``seeds: [1.9]`` ran seed 1 (``int`` truncated it)."""
    config = tmp_path / "bench.yaml"
    datasets = {"tiny": [f"--data.root={data_root(tmp_path)}"]}
    raw = {"output": str(tmp_path / "out"), "datasets": datasets, "objectives": ["ce"], "seeds": seeds}
    config.write_text(yaml.safe_dump(raw))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as info:
        main(["bench", str(config)])
    assert str(info.value.code) == f"coretune bench: error: {config}: seeds must be integers, e.g. [0, 1, 2]; {message}"
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[2].glob("configs/bench/*.yaml")), ids=lambda p: p.name)
def test_shipped_bench_specs_parse(path: Path) -> None:
    spec = BenchSpec.from_yaml(path)
    assert spec.runs() and all("--run_dir" not in " ".join(r.args) for r in spec.runs())


def test_table1_shares_its_ce_and_core_runs_with_the_memory_spec() -> None:
    """configs/bench/cifar10_cpu_10pct_table1.yaml's header copies the memory spec's ce_b64 / core_b64 records as its
    ce / core runs: the sweep reuses them only if every fit argument is the same (check_run_args)."""
    bench = Path(__file__).parents[2] / "configs" / "bench"
    table1 = {
        (r.objective, r.seed): r.args for r in BenchSpec.from_yaml(bench / "cifar10_cpu_10pct_table1.yaml").runs()
    }
    memory = {
        (r.objective, r.seed): r.args for r in BenchSpec.from_yaml(bench / "cifar10_cpu_10pct_memory.yaml").runs()
    }
    for seed in (0, 1, 2):
        assert table1["ce", seed] == memory["ce_b64", seed]
        assert table1["core", seed] == memory["core_b64", seed]
    assert all("--data.batch_size=64" in args for args in table1.values())


def test_the_strength_columns_read_the_snapshots_their_headers_pretrain() -> None:
    """configs/bench/cifar10_cpu_strength.yaml's columns made by `coretune pretrain` read an epoch snapshot its
    header's commands write (``pretrained-epoch<E>.pth.tar``, only there once epoch E ended), never the
    ``pretrained.pth.tar`` rewritten every epoch, which a pre-training stopped early leaves behind."""
    from coretune.pretrain import PRETRAINED_FILENAME, snapshot_path

    bench = Path(__file__).parents[2] / "configs" / "bench"
    text = (bench / "cifar10_cpu_strength.yaml").read_text()
    header = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    written = set()
    for command in header.split("coretune pretrain")[1:]:
        words = shlex.split(command.split(" # ")[0].replace("\\", " "))
        run_dir = Path(words[words.index("--run_dir") + 1])
        epochs = yaml.safe_load(words[words.index("--snapshot_epochs") + 1])
        assert max(epochs) == int(words[words.index("--trainer.max_epochs") + 1])
        written |= {str(snapshot_path(run_dir / PRETRAINED_FILENAME, e)) for e in epochs}
    read = set()
    for name in ("cifar10_cpu_strength.yaml", "cifar10_cpu_strength_1pct.yaml"):
        spec = BenchSpec.from_yaml(bench / name)
        for args in spec.datasets.values():
            read |= {a.split("=", 1)[1] for a in args if a.startswith("--model.weights=runs/pretrain/")}
    assert read and read <= written and len(written) == 3  # SimCLR after 5 and 15 epochs, MoCo v2 after 15


def test_the_table4_spec_fine_tunes_the_strength_studys_resnet_and_the_moco_v3_vit_its_config_pretrains() -> None:
    """configs/bench/cifar10_cpu_10pct_table4.yaml (issue 64): 2 checkpoints × {ce, ce_mix, core} × 3 seeds at 10% of
    the labels; the ResNet-18 cells are the strength study's simclr_e15 runs (every fit argument the same), the ViT
    column reads the snapshot configs/pretrain/cifar10_vit_tiny_moco_v3.yaml writes, built as it was pre-trained."""
    from coretune.pretrain import PRETRAINED_FILENAME, snapshot_path

    root = Path(__file__).parents[2]
    spec = BenchSpec.from_yaml(root / "configs" / "bench" / "cifar10_cpu_10pct_table4.yaml")
    runs = spec.runs()
    cells = {(r.dataset, r.objective, r.label_fraction, r.seed) for r in runs}
    assert len(runs) == len(cells) == 18 and {c[0] for c in cells} == {"resnet18_simclr_e15", "vit_tiny_moco_v3"}
    assert {c[1] for c in cells} == {"ce", "ce_mix", "core"} and {c[2:] for c in cells} == {(0.1, s) for s in range(3)}
    strength = BenchSpec.from_yaml(root / "configs" / "bench" / "cifar10_cpu_strength.yaml").runs()
    simclr_e15 = {(r.objective, r.seed): r.args for r in strength if r.dataset == "simclr_e15"}
    for r in runs:
        if r.dataset == "resnet18_simclr_e15":
            assert r.args == simclr_e15[r.objective, r.seed]
    pretrain = yaml.safe_load((root / "configs" / "pretrain" / "cifar10_vit_tiny_moco_v3.yaml").read_text())
    assert pretrain["snapshot_epochs"] == [pretrain["trainer"]["max_epochs"]]
    written = snapshot_path(Path(pretrain["run_dir"]) / PRETRAINED_FILENAME, pretrain["snapshot_epochs"][0])
    vit = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in spec.datasets["vit_tiny_moco_v3"]}
    assert (
        vit["--model.weights"] == str(written) and vit["--model.backbone"] == pretrain["model"]["init_args"]["backbone"]
    )
    assert yaml.safe_load(vit["--model.backbone_args"]) == pretrain["model"]["init_args"]["backbone_args"]
    assert vit["--model.optim.optimizer"] == "adamw"


def test_the_table4_specs_vit_column_fine_tunes_with_the_vit_recipe_in_every_row(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAE's main_finetune.py recipe scaled to the budget (the spec's header): layer decay, drop path, label smoothing
    and RandAugment as each ViT fit parses them; the column's label smoothing reaches the ce row too (another class
    than its --config's Core-tuning)."""
    root = Path(__file__).parents[2]
    monkeypatch.chdir(root)  # the spec's --config path
    spec = BenchSpec.from_yaml(root / "configs" / "bench" / "cifar10_cpu_10pct_table4.yaml")
    for run in spec.subset(seeds=[0], datasets=["vit_tiny_moco_v3"]).runs():
        args = [a for a in run.args if not a.startswith("--model.weights=")]  # not on this machine
        with pytest.raises(SystemExit) as done:
            main(["fit", *args, "--print_config"])
        assert done.value.code in (None, 0)
        config = yaml.safe_load(capsys.readouterr().out)
        model = config["model"]
        assert model["backbone_args"] == {"img_size": 32, "patch_size": 4, "drop_path_rate": 0.1}
        optim = model["optim"]
        assert (optim["optimizer"], optim["lr"], optim["weight_decay"], optim["layer_decay"]) == (
            "adamw",
            1.25e-4,
            0.05,
            0.75,
        )
        assert optim["warmup_epochs"] == 1.5 and config["data"]["auto_augment"] == "rand-m9-mstd0.5-inc1"
        assert config["objective"]["init_args"]["label_smoothing"] == 0.1, run.objective


def test_the_table4_resnet_records_are_the_runs_of_its_resnet_column() -> None:
    """The ResNet column's committed records (copied from the strength study) have exactly the fit arguments of the
    spec's runs, so a sweep given them skips those cells (docs/records/README.md, "Copies")."""
    root = Path(__file__).parents[2]
    spec = BenchSpec.from_yaml(root / "configs" / "bench" / "cifar10_cpu_10pct_table4.yaml")
    records = root / "docs" / "records" / "cifar10-cpu-10pct-table4"
    resnet = [r for r in spec.runs() if r.dataset == "resnet18_simclr_e15"]
    assert len(resnet) == 9
    for run in resnet:
        folder = records / run.label
        assert json.loads((folder / "fit_args.json").read_text()) == list(run.args), run.label
        assert json.loads((folder / "results.json").read_text())["test"]["top1"] > 0


def test_the_table4_lora_spec_is_the_vit_column_with_lora_at_its_own_rate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """configs/bench/cifar10_cpu_10pct_table4_lora.yaml: the ViT column of Table 4's spec (same data, checkpoint,
    epochs, recipe) with peft's LoRA (rank 16 on qkv) at 2.5e-3 and without layer decay, rows LoRA-CE and LoRA-Core
    as each fit parses them."""
    root = Path(__file__).parents[2]
    monkeypatch.chdir(root)
    table4 = BenchSpec.from_yaml(root / "configs" / "bench" / "cifar10_cpu_10pct_table4.yaml")
    lora = BenchSpec.from_yaml(root / "configs" / "bench" / "cifar10_cpu_10pct_table4_lora.yaml")
    assert lora.base_args == table4.base_args and list(lora.datasets) == ["vit_tiny_moco_v3"]
    changed = {"--model.optim.lr", "--model.optim.layer_decay", "--model.optim.lora.rank"}
    full = [a for a in table4.datasets["vit_tiny_moco_v3"] if a.split("=", 1)[0] not in changed]
    assert [a for a in lora.datasets["vit_tiny_moco_v3"] if a.split("=", 1)[0] not in changed] == full
    runs = lora.runs()
    assert {(r.objective, r.seed) for r in runs} == {(o, s) for o in ("lora_ce", "lora_core") for s in range(3)}
    for run in lora.subset(seeds=[0]).runs():
        args = [a for a in run.args if not a.startswith("--model.weights=")]  # not on this machine
        with pytest.raises(SystemExit) as done:
            main(["fit", *args, "--print_config"])
        assert done.value.code in (None, 0)
        config = yaml.safe_load(capsys.readouterr().out)
        optim = config["model"]["optim"]
        assert (optim["lr"], optim["layer_decay"], optim["lora"]["rank"], optim["lora"]["targets"]) == (
            2.5e-3,
            None,
            16,
            "qkv",
        )
        assert config["objective"]["init_args"]["label_smoothing"] == 0.1, run.objective


@pytest.mark.parametrize(
    ("spec_file", "shared_file", "shared", "new"),
    [
        (
            "pacs_cpu_dg_new_methods.yaml",
            "pacs_cpu_dg_lr5e-4.yaml",
            {"ce", "ce_con", "core"},
            {"lp_ft", "erm_pp", "swa"},
        ),
        (
            "cifar10_cpu_10pct_new_methods.yaml",
            "cifar10_cpu_10pct_table1.yaml",
            {"ce", "ce_mix", "core"},
            {"lp_ft", "lp_ft_ce_mix", "lp_ft_core", "swa_ce_mix", "ftp"} | {f"surgical_layer{i}" for i in range(1, 5)},
        ),
    ],
)
def test_issue_66s_specs_expand_and_share_the_runs_their_headers_copy(
    spec_file: str, shared_file: str, shared: set[str], new: set[str]
) -> None:
    """configs/bench/{pacs_cpu_dg,cifar10_cpu_10pct}_new_methods.yaml (issue 66): every row × split × seed, the rows
    their headers copy from the lr5e-4 / Table 1 spec's records the same fit arguments (so the sweep reuses them), and
    every new row the shared settings plus its own switch."""
    bench = Path(__file__).parents[2] / "configs" / "bench"
    spec, base = BenchSpec.from_yaml(bench / spec_file), BenchSpec.from_yaml(bench / shared_file)
    runs = {(r.dataset, r.objective, r.seed): r.args for r in spec.runs()}
    copied = {(r.dataset, r.objective, r.seed): r.args for r in base.runs()}
    assert {o for _, o, _ in runs} == shared | new and {s for *_, s in runs} == {0, 1, 2}
    assert len(runs) == len(spec.datasets) * len(shared | new) * 3
    for key, args in runs.items():
        if key[1] in shared:
            assert args == copied[key], key
        else:
            assert tuple(args[: len(spec.base_args)]) == tuple(base.base_args), key  # the shared settings first
    assert spec.base_args == base.base_args and spec.datasets == base.datasets


@pytest.mark.parametrize(
    ("config_file", "epochs", "snapshots"),
    [("cifar10_r18_simclr_long.yaml", 200, list(range(25, 201, 25))), ("cifar10_r18_simclr_e40.yaml", 40, [20, 40])],
)
def test_the_long_simclr_pretrainings_are_the_strength_studys_recipe_run_longer(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    config_file: str,
    epochs: int,
    snapshots: list[int],
) -> None:
    """configs/pretrain/cifar10_r18_simclr_long.yaml and _e40.yaml (issue 65): every model and data setting of the
    strength study's SimCLR pre-training (its committed config.yaml) but the length and the snapshots."""
    root = Path(__file__).parents[2]
    monkeypatch.chdir(root)
    with pytest.raises(SystemExit) as done:
        main(["pretrain", "--config", f"configs/pretrain/{config_file}", "--print_config"])
    assert done.value.code in (None, 0)
    config = yaml.safe_load(capsys.readouterr().out)
    record = root / "docs" / "records" / "cifar10-cpu-strength-pretrain" / "cifar10-simclr-r18-32px" / "config.yaml"
    recorded = yaml.safe_load(record.read_text())
    assert config["model"] == recorded["model"] | {
        "init_args": recorded["model"]["init_args"] | {"backbone_args": None}
    }
    # how images are loaded, not which (the loader defaults since; decoding once, added at a resume: the same pixels)
    loading = {"num_workers", "pin_memory", "persistent_workers", "cache_images"}
    assert {k: v for k, v in config["data"].items() if k not in loading} == {
        k: v for k, v in recorded["data"].items() if k not in loading
    }
    assert (config["seed_everything"], config["trainer"]["precision"]) == (0, recorded["trainer"]["precision"])
    assert config["trainer"]["max_epochs"] == epochs and config["snapshot_epochs"] == snapshots


def _kept_snapshots() -> dict[str, str]:
    """configs/pretrain/cifar10_r18_simclr_e40.yaml's header: each ``keep_snapshot.py SNAPSHOT DEST`` command, DEST →
    SNAPSHOT, where SNAPSHOT must be an epoch snapshot the pre-training writes."""
    from coretune.pretrain import PRETRAINED_FILENAME, snapshot_path

    text = (Path(__file__).parents[2] / "configs" / "pretrain" / "cifar10_r18_simclr_e40.yaml").read_text()
    pretraining = yaml.safe_load(text)
    header = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    pretrained = Path(pretraining["run_dir"]) / PRETRAINED_FILENAME
    written = {str(snapshot_path(pretrained, e)) for e in pretraining["snapshot_epochs"]}
    kept = {}
    for command in header.split("benchmarks/keep_snapshot.py")[1:]:
        source, dest = command.replace("\\", " ").split()[:2]  # paths without spaces
        assert source in written, source
        kept[dest] = source
    assert kept
    return kept


@pytest.mark.parametrize(
    ("spec_file", "study_file"),
    [
        ("cifar10_cpu_strength_long.yaml", "cifar10_cpu_strength.yaml"),
        ("cifar10_cpu_strength_long_1pct.yaml", "cifar10_cpu_strength_1pct.yaml"),
    ],
)
def test_the_long_checkpoints_specs_extend_the_strength_study(spec_file: str, study_file: str) -> None:
    """Issue 65's specs: the strength study's base arguments and rows, argument for argument (their points extend its
    series), plus LP-FT probing for an eighth of the run; every column reads the kept (half-precision) copy of a
    snapshot the 40-epoch pre-training writes, as its header's keep_snapshot.py command makes it."""
    root = Path(__file__).parents[2]
    spec, study = (BenchSpec.from_yaml(root / "configs" / "bench" / name) for name in (spec_file, study_file))
    assert spec.base_args == study.base_args and tuple(spec.seeds) == tuple(study.seeds) == (0, 1, 2)
    assert spec.label_fractions == study.label_fractions
    shared = {o.name: o for o in study.objectives}
    assert [o.name for o in spec.objectives] == [*shared, "lp_ft"]
    for objective in spec.objectives[:-1]:
        assert objective == shared[objective.name]
    lp_ft = spec.objectives[-1]
    epochs = int(next(a for a in spec.base_args if a.startswith("--trainer.max_epochs=")).split("=")[1])
    assert lp_ft.objective == "ce" and lp_ft.args == (f"--model.optim.lp_epochs={round(epochs / 8)}",)
    kept = _kept_snapshots()
    for name, args in spec.datasets.items():
        (weights,) = [a.split("=", 1)[1] for a in args if a.startswith("--model.weights=")]
        assert weights in kept and name == f"simclr_e{weights.rsplit('epoch', 1)[1].split('.')[0]}", name
        assert Path(weights).parent.name == Path(kept[weights]).parent.name  # the record folder is the run's
