"""Core-tuning's flat settings of the previous release (``--objective.lambda_n``, ``memory_size`` …), moved into its
parts (``miner``, ``memory``): still read, with one deprecation line, from flags, ``--config`` files, run configs
(resume) and checkpoints; and the parts' spelling on the command line (issue 61)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from coretune import objectives
from coretune.cli import main
from coretune.engine import FineTuner
from coretune.engine.checkpoint import CheckpointMeta
from coretune.engine.fitargs import current_objective_args, translate_args
from coretune.engine.runcli import _current_spelling, setting_changes
from coretune.memory import CrossBatchMemory
from coretune.mining import HardPairMiner
from coretune.sweeps.records import OtherFitArgs, check_run_args


def resolved(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], list[str]]:
    """The objective's ``init_args`` of ``coretune fit ARGS --print_config``, and the lines fit wrote on stderr."""
    with pytest.raises(SystemExit) as done:
        main(["fit", *args, "--print_config"])
    assert done.value.code in (None, 0)
    out, err = capsys.readouterr()
    return yaml.safe_load(out)["objective"]["init_args"], err.splitlines()


def deprecated(old: str, use: str) -> str:
    return f"coretune fit: --objective.{old} is deprecated and will be removed in the next release: use {use}"


@pytest.mark.parametrize(
    ("old", "new", "use"),
    [
        (["--objective.lambda_n", "0.5"], ["--objective.miner.lambda_n=0.5"], "--objective.miner.lambda_n 0.5"),
        (["--objective.lambda_p=0.2"], ["--objective.miner.lambda_p=0.2"], "--objective.miner.lambda_p 0.2"),
        (
            ["--objective.original_positives=false"],
            ["--objective.miner.original_positives=false"],
            "--objective.miner.original_positives false",
        ),
        (
            ["--objective.generated_pairs=own"],
            ["--objective.miner.generated_pairs=own"],
            "--objective.miner.generated_pairs own",
        ),
        (
            ["--objective.mixing=none"],
            ["--objective.miner=null", "--objective.manifold_mixup=false"],
            "--objective.miner null --objective.manifold_mixup false",
        ),
        (
            ["--objective.mixing", "manifold"],
            ["--objective.miner=null", "--objective.manifold_mixup=true"],
            "--objective.miner null --objective.manifold_mixup true",
        ),
        (["--objective.memory_size=64"], ["--objective.memory.size=64"], "--objective.memory.size 64"),
        (["--objective.memory_size=0"], ["--objective.memory=null"], "--objective.memory null"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_a_deprecated_flag_works_as_its_new_spelling_and_says_so(
    old: list[str], new: list[str], use: str, capsys: pytest.CaptureFixture[str]
) -> None:
    got, err = resolved(["--objective", "core", *old], capsys)
    want, quiet = resolved(["--objective", "core", *new], capsys)
    assert got == want and quiet == []
    assert err == [deprecated(old[0].partition("=")[0].removeprefix("--objective."), use)]


def test_deprecated_memory_flags_in_either_order(capsys: pytest.CaptureFixture[str]) -> None:
    """The warm-up before the size (which turns the memory on): held until then, as the old flags meant."""
    new = ["--objective.memory.size=64", "--objective.memory.warmup_steps=5"]
    want = resolved(["--objective", "core", *new], capsys)[0]
    assert want["memory"] == {"size": 64, "warmup_steps": 5}
    for old in (["--objective.memory_warmup_steps=5", "--objective.memory_size=64"], list(reversed(
        ["--objective.memory_warmup_steps=5", "--objective.memory_size=64"]))):  # fmt: skip
        got, err = resolved(["--objective", "core", *old], capsys)
        assert got == want and len(err) == 2


def test_an_old_setting_of_a_part_that_is_off_keeps_having_no_effect(capsys: pytest.CaptureFixture[str]) -> None:
    """ce_con mines no hard pairs: its old --objective.lambda_n did nothing, and must not turn the miner on; given
    with --objective.mixing hard (the miner on), it applies."""
    off, err = resolved(["--objective", "ce_con", "--objective.lambda_n=0.5"], capsys)
    assert off["miner"] is None and err == [deprecated("lambda_n", "--objective.miner.lambda_n 0.5")]
    on, _ = resolved(["--objective", "ce_con", "--objective.lambda_n=0.5", "--objective.mixing=hard"], capsys)
    assert on["miner"]["lambda_n"] == 0.5 and on["focal"] is False


@pytest.mark.parametrize("class_path", ["core", "coretune.objectives.core.CoreTuning"])
def test_an_old_config_file_reads_as_the_new_with_one_line(
    class_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = {"eta": 0.5, "lambda_n": 0.6, "mixing": "hard", "memory_size": 32, "memory_warmup_steps": 4}
    new = {"eta": 0.5, "miner": {"lambda_n": 0.6}, "manifold_mixup": False, "memory": {"size": 32, "warmup_steps": 4}}
    config, current = tmp_path / "old.yaml", tmp_path / "new.yaml"
    config.write_text(yaml.safe_dump({"objective": {"class_path": class_path, "init_args": old}}, sort_keys=False))
    current.write_text(yaml.safe_dump({"objective": {"class_path": class_path, "init_args": new}}))
    got, err = resolved(["--config", str(config)], capsys)
    assert got == resolved(["--config", str(current)], capsys)[0]
    assert err == [
        f"coretune fit: {config}: objective settings lambda_n, mixing, memory_size, memory_warmup_steps are "
        "deprecated and will be removed in the next release: use miner.lambda_n: 0.6, miner: {}, manifold_mixup: "
        "false, memory.size: 32, memory.warmup_steps: 4 (nested under init_args)"
    ]


def test_an_old_runs_whole_config_reads_as_the_objective_it_trained(tmp_path: Path) -> None:
    """A config.yaml of the flat version records every setting: a ce_con run's (no mixing, no memory)."""
    flat = {
        "eta": 0.1, "temperature": 0.07, "alpha": 1.0, "lambda_n": 0.8, "lambda_p": 0.0, "proj_dim": 256,
        "proj_depth": 2, "focal": False, "mixing": "none", "smooth_classifier": True, "classifier_pairs": "both",
        "original_positives": True, "gather": True, "generated_pairs": "all", "memory_size": 0,
        "memory_warmup_steps": 1000, "same_domain_positives": False,
    }  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"objective": {"class_path": "coretune.objectives.core.CoreTuning",
                                                    "init_args": flat}}))  # fmt: skip
    (arg,) = translate_args(["--config", str(config)])
    init_args = yaml.safe_load(arg.removeprefix("--config="))["objective"]["init_args"]
    added = {"label_smoothing": 0.0, "logit_adjustment": 0.0}  # settings added since: their defaults apply (as then)
    assert not set(added) & set(init_args)
    assert init_args | added == objectives.create("ce_con").hparams()


def core_checkpoint(path: Path, objective: objectives.Objective, flat: dict[str, Any]) -> Path:
    """A fine-tuning checkpoint of ``objective`` whose objective settings are recorded as the flat version did."""
    model = FineTuner(objective, backbone="small_cnn")
    model.build(3, ["cat", "dog", "eel"])
    objective.train()
    objective(torch.randn(4, objective.feature_dim), torch.tensor([0, 1, 2, 0]))  # fills the memory, if any
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    model.on_save_checkpoint(checkpoint)
    checkpoint["coretune"]["objective_hparams"] = flat
    torch.save(checkpoint, path)
    return path


def test_an_old_checkpoint_loads_with_its_settings_and_memory(tmp_path: Path) -> None:
    objective = objectives.create("core", miner=HardPairMiner(lambda_n=0.5), memory=CrossBatchMemory(8, 0))
    flat = {"eta": 0.1, "lambda_n": 0.5, "mixing": "hard", "memory_size": 8, "memory_warmup_steps": 0}
    ckpt = core_checkpoint(tmp_path / "old.ckpt", objective, flat)
    model = CheckpointMeta.from_checkpoint(ckpt, FineTuner).build()
    assert model.objective.miner == HardPairMiner(lambda_n=0.5)
    assert model.objective.cross_batch == CrossBatchMemory(8, 0)
    torch.testing.assert_close(model.objective.memory.rows()[0], objective.memory.rows()[0])
    flat = {"eta": 0.1, "focal": False, "mixing": "none", "lambda_n": 0.8, "memory_size": 0}  # ce_con's
    ckpt = core_checkpoint(tmp_path / "ce_con.ckpt", objectives.create("ce_con"), flat)
    assert CheckpointMeta.from_checkpoint(ckpt, FineTuner).build().objective.miner is None


def test_resuming_an_old_run_compares_its_settings_in_the_new_spelling() -> None:
    old = {"objective": {"class_path": "coretune.objectives.core.CoreTuning",
                         "init_args": {"eta": 0.1, "lambda_n": 0.8, "mixing": "hard", "memory_size": 0}}}  # fmt: skip
    new = {"objective": {"class_path": "coretune.objectives.core.CoreTuning",
                         "init_args": {"eta": 0.1, "miner": {"lambda_n": 0.8}, "memory": None}}}  # fmt: skip
    assert setting_changes(_current_spelling(old), _current_spelling(new)) == ([], [])
    new["objective"]["init_args"]["miner"] = {"lambda_n": 0.5}
    assert setting_changes(_current_spelling(old), _current_spelling(new)) == (
        [], ["objective.miner.lambda_n 0.8 → 0.5"]
    )  # fmt: skip


def test_a_sweep_run_recorded_with_old_flags_is_the_spec_s_run(tmp_path: Path) -> None:
    """A bench spec now spelled --objective.memory.size keeps its records of --objective.memory_size runs."""
    old = ["--objective", "core", "--objective.eta=0.1", "--objective.memory_size=4096"]
    new = ["--objective", "core", "--objective.eta=0.1", "--objective.memory.size=4096"]
    assert current_objective_args(old) == new
    (tmp_path / "fit_args.json").write_text(json.dumps(old))
    check_run_args(new, tmp_path)
    with pytest.raises(OtherFitArgs):
        check_run_args([*new[:-1], "--objective.memory.size=2048"], tmp_path)


def test_objective_help_lists_the_parts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--objective.help", "core"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--objective.miner MINER hardness-directed mixup" in text
    assert "set as ``--objective.miner.lambda_n 0.8``; null: no hard pairs" in text
    assert "--objective.memory MEMORY the cross-batch memory" in text and "--objective.lambda_n" not in text
    main(["objectives"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("core", "ce_con", "ce_mix", "ce_con_mixh"))
