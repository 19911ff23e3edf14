"""coretune tune over the search space an objective declares (``Objective.search_space``), not only Core-tuning's η
and α: a method becomes tunable by declaring its space, without a change to coretune tune."""

from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

import coretune.sweeps.tune as tune_module
from coretune import objectives
from coretune.cli import main
from coretune.engine.fitcli import resolved_fit_config
from coretune.objectives import SCL, base, register
from coretune.runs.layout import RunDir
from coretune.sweeps.space import resolve_space
from coretune.sweeps.tune import tune

pytest.importorskip("optuna")


class TunableSCL(SCL):
    """SCL whose λ (``lam``) coretune tune chooses: a search space of one hyper-parameter other than η and α."""

    name: ClassVar[str] = "scl_lam"
    search_space: ClassVar[dict[str, tuple[float, ...]]] = {"lam": (0.5, 0.9)}


@pytest.fixture
def scl_lam(monkeypatch: pytest.MonkeyPatch) -> str:
    """``scl_lam`` registered for the test only (the registry is restored afterwards)."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register("scl_lam", doc="SCL with a declared search space (a test objective).")(TunableSCL)
    return "scl_lam"


@pytest.fixture
def data_arg(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("data")
    (root / "train").mkdir()
    return f"--data.root={root}"


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The fit arguments of every trial; each fake fit finishes with a final val/top1 that grows with λ."""
    calls: list[list[str]] = []

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        calls.append(list(args))
        lam = float(next(a for a in args if a.startswith("--objective.lam=")).partition("=")[2])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.csv").write_text(f"epoch,val/top1\n0,0.1\n1,{lam / 2}\n")
        (run_dir / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        RunDir(run_dir).fit_args.write_text(json.dumps(list(args)))
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    return calls


def test_an_objective_is_tuned_over_the_space_it_declares(
    scl_lam: str, data_arg: str, launched: list[list[str]], tmp_path: Path
) -> None:
    study = tune([data_arg], output=tmp_path, objective=scl_lam)
    assert len(study.trials) == 2 and {t.params["lam"] for t in study.trials} == {0.5, 0.9}
    for args in launched:  # the study sets λ, and nothing of Core-tuning
        assert args[1:3] == ["--objective", "scl_lam"] and not any("eta" in a or "alpha" in a for a in args)
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == ["lam0.5", "lam0.9"]
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert list(rows[0])[:3] == ["number", "state", "lam"] and "eta" not in rows[0]
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())["objective"]
    assert best == {"class_path": f"{TunableSCL.__module__}.TunableSCL", "init_args": {"lam": 0.9}}


def test_space_replaces_the_declared_values_and_is_checked(
    scl_lam: str, data_arg: str, launched: list[list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["tune", f"--output={tmp_path}", "--objective=scl_lam", "--space={lam: [0.6, 0.8, 0.6]}", "--", data_arg])
    assert sorted(p.name for p in (tmp_path / "trials").iterdir()) == ["lam0.6", "lam0.8"]
    assert "best: lam = 0.8 (final val top-1 40.00%" in capsys.readouterr().out
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"eta": [1.0]}, r"^--eta: --objective scl_lam tunes lam, not eta; give values of those with --space"),
        ({"space": {"temperature": [0.1]}}, r"^--space: --objective scl_lam tunes lam, not temperature"),
        ({"space": {"lam": []}}, r"^--space lam needs one or more finite values \(got \[\]\)"),
        ({"space": {"lam": [float("inf")]}}, r"^--space lam needs one or more finite values"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            tune([data_arg], output=tmp_path / "other", objective=scl_lam, **kwargs)
    with pytest.raises(ValueError, match=r"^remove --objective.lam from the fit arguments: lam is what the study"):
        tune([data_arg, "--objective.lam=0.5"], output=tmp_path / "other", objective=scl_lam)
    # Core-tuning's own values through --space are those of --eta/--alpha, under their checks
    with pytest.raises(ValueError, match=r"^α must be finite and > 0, η finite and >= 0 \(got eta \[0.1, 1.0, 10.0\]"):
        tune([data_arg], output=tmp_path / "other", space={"alpha": [0.0]})
    with pytest.raises(ValueError, match=r"^--eta and --space eta both give values of eta: pass one of them"):
        tune([data_arg], output=tmp_path / "other", eta=[1.0], space={"eta": [1.0]})
    # a registered objective with a space is offered where one without is refused
    offered = r"^--objective 'ce' declares no hyper-parameter to tune \(an empty search_space\); choose one of "
    offered += r"bi_tuning, .*, scl, scl_lam$"
    with pytest.raises(ValueError, match=offered):
        tune([data_arg], output=tmp_path / "other", objective="ce")


def test_tpe_ranges_of_another_space_tie_the_study(
    scl_lam: str, data_arg: str, launched: list[list[str]], tmp_path: Path
) -> None:
    study = tune([data_arg], output=tmp_path, objective=scl_lam, sampler="tpe", n_trials=2)
    assert study.user_attrs["space"] == {"lam": [0.5, 0.9]} and "eta_alpha" not in study.user_attrs
    assert all(0.5 <= t.params["lam"] <= 0.9 for t in study.trials)
    with pytest.raises(ValueError, match=r"was run with --space \{'lam': \[0.5, 0.9\]\} \(now \{'lam': \[0.5, 0.7\]\}"):
        tune([data_arg], output=tmp_path, objective=scl_lam, sampler="tpe", n_trials=3, space={"lam": [0.5, 0.7]})


HYPERPARAMETER_FREE = {
    "ce": "cross-entropy has none",
    "rifle": "its n re-initialisations are an integer",
    "erm_pp": "its linear_steps are an integer, fixed at 500 by DomainBed",
}
"""The registered objectives whose declared search space is empty, and why (every other one declares its own)."""


def test_every_registered_objective_declares_its_space_or_none() -> None:
    for name in objectives.available():
        cls, _ = objectives.get(name)
        owner = next(c for c in cls.__mro__ if "search_space" in vars(c))
        assert owner is not objectives.Objective, f"{name} inherits the base's empty space: declare one (or none)"
        if not cls.search_space:
            assert name in HYPERPARAMETER_FREE, f"{name} declares an empty search space"
            continue
        assert name not in HYPERPARAMETER_FREE
        params = inspect.signature(cls).parameters
        for hyper, grid in cls.search_space.items():
            assert params[hyper].annotation in ("float", float), (name, hyper)  # tune suggests floats
            assert list(grid) == sorted(set(grid)) and len(grid) >= 2 and grid[0] > 0, (name, hyper)
            assert grid[0] <= params[hyper].default <= grid[-1], (name, hyper)  # the method's default is searched


def test_tune_builds_a_study_over_each_declared_space(
    data_arg: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[list[str]] = []

    def fake_fit(args: list[str], run_dir: Path, stop: object = None, log_args: object = ()) -> int:
        launched.append(list(args))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.csv").write_text("epoch,val/top1\n0,0.5\n")
        (run_dir / "results.json").write_text(json.dumps({"test": {"top1": 0.5}}))
        RunDir(run_dir).fit_args.write_text(json.dumps(list(args)))
        return 0

    monkeypatch.setattr(tune_module, "launch_fit", fake_fit)
    tunable = [name for name in objectives.available() if name not in HYPERPARAMETER_FREE]
    built = {}
    for name in tunable:
        try:
            preset, space = resolve_space(name)
        except ValueError:  # a preset that fixes or voids its class's space (ce_mix, ce_con): refused by name
            continue
        assert space == {k: list(v) for k, v in objectives.get(name)[0].search_space.items()}
        study = tune([data_arg], output=tmp_path / name, objective=name, sampler="tpe", n_trials=1)
        (trial,) = study.trials
        assert set(trial.params) == set(space) and all(v[0] <= trial.params[k] <= v[-1] for k, v in space.items())
        chosen = [a for a in launched[-1] if a.startswith("--objective.")]
        assert sorted(a.partition("=")[0] for a in chosen) == sorted(f"--objective.{k}" for k in space)
        built[name] = preset
    assert set(built) == set(tunable) - {"ce_mix", "ce_con"}
    # the values a trial passes are ones coretune fit takes (its own parser, nothing run)
    args = [
        data_arg,
        "--data.val_fraction=0.2",
        "--objective",
        "l2sp",
        "--objective.alpha=0.001",
        "--objective.beta=0.1",
    ]
    config = resolved_fit_config(args)
    assert config["objective"]["init_args"] == {"alpha": 0.001, "beta": 0.1, "label_smoothing": 0.0}
