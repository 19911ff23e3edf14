"""The command line's friendly aliases: registry names for --objective (also in YAML configs), --seed."""

from pathlib import Path

import pytest
import yaml

from coretune.cli import main
from coretune.engine.fitargs import translate_args


def test_objective_names_become_class_paths_with_presets() -> None:
    assert translate_args(["--objective", "core"]) == ["--objective=coretune.objectives.core.CoreTuning"]
    assert translate_args(["--objective=ce"]) == ["--objective=coretune.objectives.ce.CETuning"]
    assert translate_args(["--objective", "ce_con", "--objective.eta", "1"]) == [
        "--objective=coretune.objectives.core.CoreTuning",
        "--objective.focal=false",
        "--objective.miner=null",
        "--objective.eta",
        "1",
    ]
    # class paths and names jsonargparse resolves itself pass through unchanged
    assert translate_args(["--objective", "CoreTuning"]) == ["--objective=CoreTuning"]


def test_seed_alias() -> None:
    assert translate_args(["--seed", "3", "--data.root", "x"]) == ["--seed_everything=3", "--data.root", "x"]


def test_registry_names_work_inside_yaml_configs(tmp_path: Path) -> None:
    config = tmp_path / "x.yaml"
    config.write_text("objective:\n  class_path: ce_con\n  init_args:\n    eta: 1.0\ntrainer:\n  max_epochs: 3\n")
    (arg,) = translate_args(["--config", str(config)])
    rewritten = yaml.safe_load(arg.removeprefix("--config="))
    assert rewritten["objective"] == {
        "class_path": "coretune.objectives.core.CoreTuning",
        "init_args": {"focal": False, "miner": None, "eta": 1.0},  # the preset, then the file's own values
    }
    assert rewritten["trainer"] == {"max_epochs": 3}
    config.write_text("objective: core\n")
    (arg,) = translate_args([f"--config={config}"])
    assert yaml.safe_load(arg.removeprefix("--config="))["objective"]["class_path"].endswith("CoreTuning")
    plain = tmp_path / "plain.yaml"
    plain.write_text("objective:\n  class_path: coretune.objectives.CETuning\n")
    assert translate_args(["--config", str(plain)]) == [f"--config={plain}"]


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "path",
    sorted([*CONFIGS.glob("*.yaml"), *CONFIGS.glob("cpu/*.yaml")]),
    ids=lambda p: str(p.relative_to(CONFIGS)),
)
def test_shipped_fit_configs_parse(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every shipped config is a valid `coretune fit --config` (class paths, option names and types)."""
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(path), "--print_config"])
    assert done.value.code in (None, 0)
    printed = capsys.readouterr()
    assert "deprecated" not in printed.err  # spelled as coretune spells it now (model: {optim: {lr: …}})
    config = yaml.safe_load(printed.out)
    written = yaml.safe_load(path.read_text())
    assert config["objective"]["class_path"].startswith("coretune.objectives.")
    assert config["model"]["backbone"] == written["model"]["backbone"]
    assert config["trainer"]["max_epochs"] == written["trainer"]["max_epochs"]
    # issue 41: lr 0.1 collapses
    if config["model"]["optim"]["lr"] >= 0.1 and config["model"]["task"] == "classification":
        assert config["trainer"]["gradient_clip_val"] == 1.0, "Core-tuning at lr 0.1 needs gradient clipping"


@pytest.mark.parametrize(
    "args",
    [
        ["fit", "--trainer.max_epoch=1"],
        ["pretrain", "--trainer.max_epoch=1"],
        ["test", "--ckpt_pat=x.ckpt"],
        ["predict", "--ckpt_path=x.ckpt", "--input=x", "--outp=y.csv"],
        ["export", "--ckpt_path=x.ckpt", "--out=y"],
        ["eval", "knn", "--temp=0.1"],
        ["demo", "--seed=1"],
        ["bench", "spec.yaml", "--dry"],
        ["tune", "--out=x", "--", "--trainer.max_epochs=1"],
    ],
    ids=lambda a: a[0],
)
def test_no_command_takes_an_abbreviated_option(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix of an option (`--trainer.max_epoch` for `--trainer.max_epochs`) is an error, not silently the option."""
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code not in (None, 0)
    assert "unrecognized arguments" in capsys.readouterr().err


CORE_CONFIG = (
    "model:\n  backbone: small_cnn\nobjective:\n  class_path: coretune.objectives.CoreTuning\n"
    "  init_args:\n    eta: 0.3\n    alpha: 5.0\n    temperature: 0.2\n"
)
"""A Core-tuning config whose hyper-parameters are none of the defaults (BSS's eta, L2-SP's alpha, Core's own)."""


def printed_objective(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    """The ``objective`` section of ``coretune fit ARGS --print_config``."""
    with pytest.raises(SystemExit) as done:
        main(["fit", *args, "--print_config"])
    assert done.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)["objective"]


def test_another_objective_after_a_config_takes_its_own_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # jsonargparse kept the config's init_args the new class also accepts: BSS ran with Core-tuning's eta 0.1
    # (configs/cpu/cifar10.yaml), 100 x the paper's 0.001, and L2-SP with its alpha
    shipped = str(CONFIGS / "cpu" / "cifar10.yaml")
    assert printed_objective(["--config", shipped, "--objective", "bss"], capsys) == {
        "class_path": "coretune.objectives.bss.BSS",
        "init_args": {"eta": 0.001, "k": 1, "label_smoothing": 0.0},
    }
    config = tmp_path / "core.yaml"
    config.write_text(CORE_CONFIG)
    assert printed_objective(["--config", str(config), "--objective=l2sp"], capsys)["init_args"] == {
        "alpha": 0.01,
        "beta": 0.01,
        "label_smoothing": 0.0,
    }
    bi_tuning = printed_objective(["--config", str(config), "--objective", "bi_tuning"], capsys)["init_args"]
    assert bi_tuning["temperature"] == 0.07  # its own default, not the config's Core-tuning temperature
    # the hyper-parameters given after --objective win; before it, they were the old objective's
    args = ["--config", str(config), "--objective.eta=0.5", "--objective", "bss", "--objective.eta", "0.01"]
    assert printed_objective(args, capsys)["init_args"] == {"eta": 0.01, "k": 1, "label_smoothing": 0.0}
    assert printed_objective(["--objective", "core", "--objective.eta=0.5", "--objective", "bss"], capsys)[
        "init_args"
    ] == {"eta": 0.001, "k": 1, "label_smoothing": 0.0}


def test_label_smoothing_given_before_another_objective_is_kept_as_without_a_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a bench column's --objective.label_smoothing comes before each row's --objective: after a --config, a row of
    # another class (ce after the config's Core-tuning) dropped it while the rows of the config's class kept it
    shipped = str(CONFIGS / "cpu" / "cifar10.yaml")
    for config in ([], ["--config", shipped]):
        for name, cls in (("ce", "ce.CETuning"), ("ce_mix", "core.CoreTuning"), ("bss", "bss.BSS")):
            objective = printed_objective([*config, "--objective.label_smoothing=0.1", "--objective", name], capsys)
            assert objective["class_path"] == f"coretune.objectives.{cls}"
            assert objective["init_args"]["label_smoothing"] == 0.1, (config, name)
    # the recipe's smoothing stays with another method; the method's own settings still reset (BSS's eta)
    bss = printed_objective(["--config", str(CONFIGS / "vit_s16_dino.yaml"), "--objective", "bss"], capsys)
    assert bss["init_args"] == {"eta": 0.001, "k": 1, "label_smoothing": 0.1}


def test_the_configs_own_objective_keeps_the_configs_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a re-run (resume compares the settings): the same objective, or a Table 2 row of its class, keeps them
    config = tmp_path / "core.yaml"
    config.write_text(CORE_CONFIG)
    for name in ("core", "CoreTuning", "coretune.objectives.core.CoreTuning"):
        core = printed_objective(["--config", str(config), "--objective", name], capsys)["init_args"]
        assert (core["eta"], core["alpha"], core["temperature"], core["focal"]) == (0.3, 5.0, 0.2, True)
    ce_con = printed_objective(["--config", str(config), "--objective", "ce_con"], capsys)["init_args"]
    assert (ce_con["eta"], ce_con["temperature"], ce_con["focal"], ce_con["miner"]) == (0.3, 0.2, False, None)


def test_a_runs_config_given_back_with_another_objective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fit_flags import QUIET, TINY_FIT
    from image_trees import make_image_tree

    config, run = tmp_path / "core.yaml", tmp_path / "run"
    config.write_text(CORE_CONFIG)
    tree = make_image_tree(tmp_path / "data", per_class=4, val_per_class=2, size=16)
    one_step = [
        *TINY_FIT,
        *QUIET,
        "--trainer.limit_train_batches=1",
        "--trainer.limit_val_batches=1",
        f"--run_dir={run}",
    ]
    main(["fit", "--config", str(config), "--objective", "bss", "--objective.k=2", *one_step, f"--data.root={tree}"])
    capsys.readouterr()
    recorded = yaml.safe_load((run / "config.yaml").read_text())["objective"]
    assert recorded == {
        "class_path": "coretune.objectives.bss.BSS",
        "init_args": {"eta": 0.001, "k": 2, "label_smoothing": 0.0},
    }
    again = ["--config", str(run / "config.yaml")]
    assert printed_objective([*again, "--objective", "bss"], capsys) == recorded  # the same objective: a re-run
    core = printed_objective([*again, "--objective", "core"], capsys)["init_args"]
    assert (core["eta"], core["alpha"]) == (0.1, 1.0)  # Core-tuning's own, not BSS's eta


def test_another_preset_of_the_same_class_drops_the_settings_the_first_preset_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a ce_mix run's config.yaml (eta 0, manifold mixup) given back with --objective core trained CE + mixup under
    # Core-tuning's name; a preset's own settings are reset to the class defaults, the user's tuned values stay
    config = tmp_path / "ce_mix.yaml"
    config.write_text(yaml.safe_dump({"objective": {"class_path": "coretune.objectives.core.CoreTuning", "init_args": {
        "eta": 0.0, "miner": None, "manifold_mixup": True, "alpha": 10.0, "temperature": 0.2}}}))  # fmt: skip
    core = printed_objective(["--config", str(config), "--objective", "core"], capsys)["init_args"]
    assert (core["eta"], core["miner"]["lambda_n"], core["manifold_mixup"], core["focal"], core["alpha"]) == (
        0.1, 0.8, False, True, 10.0
    )  # fmt: skip
    assert core["temperature"] == 0.2
    ce_con = printed_objective(["--config", str(config), "--objective", "ce_con"], capsys)["init_args"]
    assert (ce_con["eta"], ce_con["miner"], ce_con["manifold_mixup"], ce_con["focal"], ce_con["alpha"]) == (
        0.1, None, False, False, 10.0
    )  # fmt: skip
    assert printed_objective(["--config", str(config), "--objective", "ce_mix"], capsys)["init_args"]["eta"] == 0.0
    # on the command line too, and --objective.X after the second preset still wins
    core = printed_objective(["--objective", "ce_con", "--objective", "core"], capsys)["init_args"]
    assert (core["focal"], core["miner"]["lambda_n"]) == (True, 0.8)
    args = ["--objective", "ce_mix", "--objective", "core", "--objective.eta=0"]
    assert printed_objective(args, capsys)["init_args"]["eta"] == 0.0
    tuned = ["--config", str(config), "--objective.eta=0.5", "--objective", "core"]  # 0.5: no preset's value
    assert printed_objective(tuned, capsys)["init_args"]["eta"] == 0.5


def _batch_limits(root: Path, value: str) -> tuple[object, object]:
    from coretune.engine.fitcli import resolved_fit_config

    args = [f"--data.root={root}", f"--trainer.limit_val_batches={value}", f"--trainer.val_check_interval={value}"]
    trainer = resolved_fit_config(args)["trainer"]
    return trainer["limit_val_batches"], trainer["val_check_interval"]


def test_an_integer_batch_limit_counts_batches_whatever_union_python_cached(
    image_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was order-dependent: Python caches ``Optional[Union[…]]`` by a union that compares equal in any order, and
    Lightning builds ``Union[float, int]`` too; depending on what was imported first (scikit-learn, in the suite),
    the Trainer's ``Optional[Union[int, float]]`` came out float first and ``--trainer.limit_val_batches=1`` meant
    every batch instead of one."""
    import typing

    from lightning.pytorch import Trainer

    float_first = typing.Union[float, int, None]  # noqa: UP007 (typing's cached union: what went wrong)
    for name in ("limit_val_batches", "val_check_interval"):  # as seen after importing scikit-learn first
        monkeypatch.setitem(Trainer.__init__.__annotations__, name, float_first)
    expected = {"1": (1, 1), "1.0": (1.0, 1.0), "0.5": (0.5, 0.5), "3": (3, 3)}
    for value, limits in expected.items():
        parsed = _batch_limits(image_tree, value)
        assert parsed == limits and list(map(type, parsed)) == list(map(type, limits)), value
