"""``coretune fit --adversarial.*``: every objective trains on each batch and its PGD examples (issue 38), the
attack leaves the model as it was, the settings are recorded and checked on resume, bad settings are one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from coretune import objectives
from coretune.cli import main
from coretune.engine import FineTuner
from coretune.robust.training import AdversarialTraining
from coretune.runs.layout import RunDir
from fit_flags import QUIET, TINY_FIT

AT = ["--adversarial.enable=true", "--adversarial.steps=2"]
STEPS = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("adversarial") / "data", per_class=8, val_per_class=2, size=16)


class _Spy:
    """Wraps ``AdversarialTraining.extend``: what went in and out of each call, and the model's state around it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        original = AdversarialTraining.extend

        def extend(settings: AdversarialTraining, model: Any, images: Any, labels: Any, **kwargs: Any) -> Any:
            tensors = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}  # no extra state
            before = {k: v.detach().clone() for k, v in tensors.items()}
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            modes = [m.training for m in model.modules()]
            out = original(settings, model, images, labels, **kwargs)
            self.calls.append(
                {
                    "settings": settings,
                    "images": images.detach().clone(),
                    "labels": labels.clone(),
                    "out": (out[0].detach().clone(), out[1].clone()),
                    "kwargs": kwargs,
                    "unchanged": all(torch.equal(before[k], v) for k, v in tensors.items()),
                    "grads_untouched": all(
                        (g is None and p.grad is None) or (g is not None and torch.equal(g, p.grad))
                        for g, p in zip(grads, model.parameters(), strict=True)
                    ),
                    "modes_kept": modes == [m.training for m in model.modules()] and all(modes),
                }
            )
            return out

        monkeypatch.setattr(AdversarialTraining, "extend", extend)


def test_the_trained_batch_holds_pgd_rows_and_the_attack_leaves_the_model_alone(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(monkeypatch)
    trained: list[tuple[int, torch.Tensor]] = []
    ce_forward = objectives.CETuning.forward

    def forward(self: Any, features: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        trained.append((features.shape[0], labels.clone()))
        return ce_forward(self, features, labels, **kwargs)

    monkeypatch.setattr(objectives.CETuning, "forward", forward)
    run = tmp_path / "run"
    eps = "--adversarial.eps=1/20"  # a fraction, as papers write 8/255
    main(["fit", *TINY_FIT, *QUIET, *STEPS, f"--data.root={tree}", f"--run_dir={run}", *AT, eps])
    assert len(spy.calls) == 2  # one attack per training step
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    for call, (rows, labels) in zip(spy.calls, trained, strict=True):
        x, y = call["images"], call["labels"]
        images, targets = call["out"]
        assert images.shape[0] == 2 * len(x) == rows and torch.equal(images[: len(x)], x)
        assert torch.equal(targets, torch.cat([y, y])) and torch.equal(labels, targets)  # the objective's batch
        clean, adv = x.float() * std + mean, images[len(x) :].float() * std + mean  # back to pixels
        assert (adv - clean).abs().max() <= 0.05 + 1e-3 and (adv - clean).abs().max() > 0.01  # bf16 rounding
        assert adv.min() >= -1e-3 and adv.max() <= 1 + 1e-3
        assert call["kwargs"]["mean"] == pytest.approx(mean.flatten().tolist())
        assert call["unchanged"] and call["grads_untouched"] and call["modes_kept"]  # parameters, BN, modes
    # recorded: config.yaml's adversarial section as written (it parses again), the checkpoint's as numbers
    config = yaml.safe_load(RunDir(run).config.read_text())
    assert config["adversarial"] == {"enable": True, "norm": "linf", "eps": "1/20", "steps": 2, "step_size": None,
                                     "random_start": True}  # fmt: skip
    checkpoint = torch.load(RunDir(run).last_checkpoint, weights_only=True)
    assert checkpoint["coretune"]["adversarial"] == {**config["adversarial"], "eps": 0.05}
    assert FineTuner.from_checkpoint(RunDir(run).last_checkpoint).batch_transform is None  # evaluation: clean
    main(["eval", "robust", f"--ckpt_path={RunDir(run).last_checkpoint}", f"--data.root={tree}", "--attack=pgd",
          "--threat_models=linf:8/255", "--steps=1"])  # fmt: skip
    robust = json.loads(RunDir(run).robust_results.read_text())
    assert robust["adversarial_training"] == checkpoint["coretune"]["adversarial"]


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_every_objective_trains_adversarially(
    name: str, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(monkeypatch)
    run = tmp_path / name
    main(["fit", *TINY_FIT, *QUIET, *STEPS, f"--data.root={tree}", f"--run_dir={run}", "--objective", name, *AT])
    assert len(spy.calls) == 2 and all(c["out"][0].shape[0] == 2 * len(c["images"]) for c in spy.calls)
    assert 0.0 <= yaml.safe_load(RunDir(run).results.read_text())["test"]["top1"] <= 1.0


def test_a_run_resumed_with_adversarial_training_repeats_the_uninterrupted_one(tree: Path, tmp_path: Path) -> None:
    common = ["fit", *TINY_FIT, *QUIET, f"--data.root={tree}", "--model.optim.schedule=constant", *AT]
    main([*common, f"--run_dir={tmp_path / 'whole'}", "--trainer.max_epochs=2"])
    main([*common, f"--run_dir={tmp_path / 'resumed'}", "--trainer.max_epochs=1"])
    main([*common, f"--run_dir={tmp_path / 'resumed'}", "--trainer.max_epochs=2"])  # resumes from last.ckpt
    whole, resumed = (
        torch.load(RunDir(tmp_path / run).last_checkpoint, weights_only=True)["state_dict"]
        for run in ("whole", "resumed")
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_resume_with_other_adversarial_settings_is_refused(tree: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    main(["fit", *TINY_FIT, *QUIET, *STEPS, f"--data.root={tree}", f"--run_dir={run}", *AT])
    config = RunDir(run).config.read_text()
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *TINY_FIT, *QUIET, *STEPS, f"--data.root={tree}", f"--run_dir={run}", *AT,
              "--adversarial.norm=l2", "--adversarial.eps=0.5"])  # fmt: skip
    assert re.match(
        rf"coretune fit: error: the run in {re.escape(str(run))} was trained with other settings than these: "
        r"adversarial\.norm linf → l2; adversarial\.eps 0\.0313\d* → 0\.5\. Resuming it",
        str(exit_.value.code),
    )
    assert RunDir(run).config.read_text() == config


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--adversarial.eps=-0.1", "PGD eps must be a finite radius >= 0 in [0, 1] pixel units (e.g. 8/255), got -0.1"),
        ("--adversarial.steps=0", "PGD steps must be >= 1, got 0"),
        ("--adversarial.step_size=0", "PGD step_size must be > 0 (or None for 2.5·eps/steps), got 0.0"),
        (
            "--adversarial.eps=8/O",
            "PGD eps must be a number or a fraction in [0, 1] pixel units (e.g. 8/255 or 0.5), got '8/O'",
        ),
    ],
)
def test_bad_adversarial_settings_are_one_line_and_nothing_is_written(
    option: str, message: str, tree: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *TINY_FIT, *QUIET, f"--data.root={tree}", f"--run_dir={run}", *AT, option])
    assert exit_.value.code == f"coretune fit: error: invalid adversarial-training settings: {message}"
    assert not run.exists() or not list(run.iterdir())  # at most the emptied folder of its released claim


def test_an_unknown_norm_is_the_parsers_error(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *TINY_FIT, f"--data.root={tree}", f"--run_dir={tmp_path / 'run'}", *AT, "--adversarial.norm=l1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1:] == [
        "coretune fit: error: --adversarial.norm: expected one of 'linf', 'l2', got l1 (coretune fit --help lists the "
        "options)"
    ]


def test_adversarial_training_is_refused_for_another_task(voc_set: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--task=segmentation", f"--data.root={voc_set}", "--model.backbone=resnet18",
              f"--run_dir={tmp_path / 'run'}", *AT])  # fmt: skip
    assert exit_.value.code == (
        "coretune fit: error: invalid model settings: adversarial training works with the classification task only "
        "(got task 'segmentation')"
    )


def test_bi_tuning_keys_an_adversarial_row_with_its_clean_sources_view(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The instance positive of an adversarial row (its momentum key, from the second view) is its source's."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    bi_forward = objectives.BiTuning.forward

    def forward(self: Any, features: torch.Tensor, labels: torch.Tensor, *, inputs: Any = None, **kw: Any) -> Any:
        seen.append((features.detach(), inputs.detach()))
        return bi_forward(self, features, labels, inputs=inputs, **kw)

    monkeypatch.setattr(objectives.BiTuning, "forward", forward)
    main(["fit", *TINY_FIT, *QUIET, *STEPS, f"--data.root={tree}", f"--run_dir={tmp_path / 'run'}",
          "--objective=bi_tuning", *AT])  # fmt: skip
    for features, inputs in seen:
        b = len(features) // 2
        assert len(inputs) == 2 * b and torch.equal(inputs[b:], inputs[:b])
        assert not torch.equal(features[b:], features[:b])  # the query rows differ: clean, then attacked


def test_adversarial_settings_without_enable_and_eps_0_are_refused(tree: Path, tmp_path: Path) -> None:
    """`--adversarial.eps 8/255 --adversarial.steps 3` without `--adversarial.enable true` trained clean without a
    word (row 11 of issue 60); in a --config file too; eps 0 with it enabled was CE-tuning at (steps + 1)× the cost.
    Each is one line before anything is written; the run's own config.yaml (every default spelled out) still runs."""
    from fit_flags import error

    run = tmp_path / "run"
    base = ["fit", *TINY_FIT, *QUIET, *STEPS, f"--data.root={tree}", f"--run_dir={run}"]
    assert error([*base, "--adversarial.eps=8/255", "--adversarial.steps=3"]) == (
        "--adversarial.eps, --adversarial.steps have no effect without --adversarial.enable true: add it, or drop them"
    )
    assert error([*base, "--adversarial.enable=false", "--adversarial.random_start=true"]) == (
        "--adversarial.random_start has no effect without --adversarial.enable true: add it, or drop it"
    )  # named on the command line: given, even at its default
    config = tmp_path / "at.yaml"
    config.write_text(yaml.safe_dump({"adversarial": {"norm": "l2", "eps": 0.5}}))
    assert error([*base, f"--config={config}"]) == (
        "--adversarial.norm, --adversarial.eps have no effect without --adversarial.enable true: add it, or drop them"
    )
    assert error([*base, "--adversarial.enable=true", "--adversarial.eps=0"]) == (
        "invalid adversarial-training settings: PGD eps 0 leaves every image as it is, so adversarial training would "
        "be CE-tuning on each batch twice at 11× the cost: give eps > 0 (e.g. 8/255), or drop --adversarial.enable"
    )
    assert not run.exists() or not list(run.iterdir())
    main(base)  # clean, and again from its own config.yaml, which lists the adversarial defaults
    assert yaml.safe_load(RunDir(run).config.read_text())["adversarial"]["enable"] is False
    main(["fit", *QUIET, f"--config={RunDir(run).config}", f"--run_dir={tmp_path / 'again'}"])
    assert RunDir(tmp_path / "again").is_finished()
