"""robust_accuracy: clean accuracy as a plain evaluation, robust accuracy under coretune's PGD, torchattacks' PGD
and AutoAttack, the JSON report, the pixel-space data recipe, and its one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adversarial_models import digits, trained_digits_cnn
from coretune.apps.robustness import (
    PAPER_THREAT_MODELS,
    RobustnessReport,
    ThreatResult,
    format_threat,
    robust_accuracy,
    sample_loader,
)
from coretune.data import IMAGENET_MEAN, IMAGENET_STD, ImageClassificationData
from coretune.models import create_backbone
from coretune.robust.attacks import NormalizedModel


def _digits_loader(n: int | None = None, batch_size: int = 100) -> DataLoader:
    _, _, x, y = digits()
    return DataLoader(TensorDataset(x[:n], y[:n]), batch_size=batch_size)


def _plain_accuracy(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    with torch.no_grad():
        pairs = [(model(x).argmax(dim=1) == y).sum().item() for x, y in loader]
    return sum(pairs) / len(loader.dataset)


def test_the_default_threat_models_are_the_papers_six() -> None:
    assert [format_threat(n, e) for n, e in PAPER_THREAT_MODELS] == [
        "ℓ2 0.5",
        "ℓ2 1.5",
        "ℓ2 2.5",
        "ℓ∞ 2/255",
        "ℓ∞ 4/255",
        "ℓ∞ 8/255",
    ]
    assert format_threat("linf", 0.1) == "ℓ∞ 0.1"


def test_clean_accuracy_equals_a_plain_evaluation_and_robust_accuracy_falls() -> None:
    model = trained_digits_cnn().train()
    modes = [m.training for m in model.modules()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = _digits_loader(200)
    report = robust_accuracy(model, loader)  # the paper's six threat models, coretune's PGD-10

    assert [m.training for m in model.modules()] == modes  # back in train mode, statistics untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert report.num_images == 200 and report.attack == "pgd" and report.steps == 10 and report.seed == 0
    assert report.clean_accuracy == _plain_accuracy(model, loader)
    robust = {format_threat(r.norm, r.eps): r.accuracy for r in report.results}
    assert list(robust) == [format_threat(n, e) for n, e in PAPER_THREAT_MODELS]
    assert all(r.step_size == pytest.approx(2.5 * r.eps / 10) for r in report.results)
    assert robust["ℓ∞ 2/255"] >= robust["ℓ∞ 4/255"] >= robust["ℓ∞ 8/255"]
    assert robust["ℓ2 0.5"] < report.clean_accuracy - 0.4
    assert robust["ℓ2 1.5"] == robust["ℓ2 2.5"] == 0.0  # undefended: nothing survives a large radius


def test_coretune_pgd_and_torchattacks_pgd_agree_within_noise() -> None:
    model = trained_digits_cnn()
    threats = [("linf", 8 / 255), ("linf", 0.1), ("l2", 0.5), ("l2", 1.0)]
    ours = robust_accuracy(model, _digits_loader(200), threats, seed=1)
    theirs = robust_accuracy(model, _digits_loader(200), threats, attack="torchattacks-pgd", seed=1)
    assert theirs.clean_accuracy == ours.clean_accuracy
    for a, b in zip(ours.results, theirs.results, strict=True):
        assert (a.norm, a.eps, a.step_size) == (b.norm, b.eps, b.step_size)
        # noise: coretune's PGD alone spans 0.39–0.415 over seeds 0–2 at ℓ2 0.5 on these 200 images
        assert abs(a.accuracy - b.accuracy) <= 0.03, (a, b)


def test_torchattacks_leaves_a_channels_last_model_in_train_mode_as_it_was() -> None:
    """torchattacks' PGDL2 views the images' gradient (channels-last for a channels-last model, as coretune's CNNs
    are) and hands the model back in the mode it found it in: the BatchNorm statistics must not move, and both
    PGDs draw the same random starts, so their ℓ∞ examples are the same."""
    model = trained_digits_cnn().train().to(memory_format=torch.channels_last)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    threats = [("l2", 0.5), ("linf", 0.1)]
    theirs = robust_accuracy(model, _digits_loader(100, batch_size=50), threats, attack="torchattacks-pgd")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(m.training for m in model.modules())
    ours = robust_accuracy(model, _digits_loader(100, batch_size=50), threats)
    assert theirs.results[1] == ours.results[1]
    assert abs(theirs.results[0].accuracy - ours.results[0].accuracy) <= 0.03


def test_autoattack_runs_locally_and_breaks_an_undefended_model() -> None:
    """At a large radius APGD-CE, AutoAttack's first attack, breaks every image, which ends the chain. At moderate
    radii the survivors go through APGD-T, FAB-T and Square (5,000 queries): about 100 s for 32 images on this
    machine, too slow for a test; docs/adversarial.md records those measurements."""
    model = trained_digits_cnn()
    report = robust_accuracy(model, _digits_loader(32), [("linf", 0.3), ("l2", 2.5)], attack="autoattack")
    assert report.clean_accuracy == 1.0
    assert [r.accuracy for r in report.results] == [0.0, 0.0]
    assert report.steps is None and all(r.step_size is None for r in report.results)  # parameter-free


@pytest.mark.parametrize(("classes", "targets"), [(10, 9), (100, 9), (4, 3)])
def test_autoattack_is_the_standard_version_of_the_reference_implementation(classes: int, targets: int) -> None:
    """torchattacks' AutoAttack ran APGD, APGD-T and FAB with 10 iterations (its defaults) and, on 100 classes, 99
    targets: a weaker, slower attack than standard AutoAttack's 100 iterations and 9 targets."""
    import torchattacks

    from coretune.apps.robustness import AUTOATTACK, standard_autoattack

    chain = standard_autoattack(torchattacks, trained_digits_cnn(), "linf", 8 / 255, classes, seed=0)
    apgd, apgdt, fab, square = chain.attacks
    assert [type(a).__name__ for a in chain.attacks] == ["APGD", "APGDT", "FAB", "Square"]
    assert (apgd.steps, apgdt.steps, fab.steps, apgd.loss, fab.multi_targeted) == (100, 100, 100, "ce", True)
    assert (apgdt.n_target_classes, fab.n_target_classes) == (targets, targets)
    assert all(a.n_restarts == 1 and a.eps == 8 / 255 and a.norm == "Linf" for a in chain.attacks)
    assert square.n_queries == 5000 and not square.rescale_schedule
    report = robust_accuracy(trained_digits_cnn(), _digits_loader(8), [("linf", 0.3)], attack="autoattack")
    assert report.implementation == AUTOATTACK and RobustnessReport.from_json(report.to_json()) == report
    with pytest.raises(ValueError, match=r"^AutoAttack needs a model of 4 or more classes .* has 3: use --attack pgd"):
        standard_autoattack(torchattacks, trained_digits_cnn(), "linf", 8 / 255, 3, seed=0)


def test_the_report_round_trips_through_json_and_prints_one_line_per_accuracy() -> None:
    model, loader = trained_digits_cnn(), _digits_loader(50)
    report = robust_accuracy(model, loader, [("linf", 8 / 255), ("l2", 0.5)], seed=3)
    assert robust_accuracy(model, loader, [("linf", 8 / 255), ("l2", 0.5)], seed=3) == report  # seeded
    text = report.to_json()
    assert RobustnessReport.from_json(text) == report
    values = json.loads(text)
    assert values["num_images"] == 50 and values["seed"] == 3 and values["results"][0]["norm"] == "linf"
    assert report.lines() == [
        f"clean     {report.clean_accuracy:6.2%}",
        f"ℓ∞ 8/255  {report.results[0].accuracy:6.2%}",
        f"ℓ2 0.5    {report.results[1].accuracy:6.2%}",
    ]
    made = RobustnessReport("pgd", 10, 0.9, [ThreatResult("l2", 0.5, 0.25, 0.125)], steps=10)
    assert RobustnessReport.from_json(made.to_json()) == made


def test_max_images_stops_early_and_batches_may_carry_more_than_images_and_labels() -> None:
    _, _, x, y = digits()
    loader = DataLoader(TensorDataset(x, y, torch.arange(len(y))), batch_size=32)  # (images, labels, index)
    report = robust_accuracy(trained_digits_cnn(), loader, [("linf", 0.1)], max_images=70)
    assert report.num_images == 70
    assert report.clean_accuracy == _plain_accuracy(trained_digits_cnn(), _digits_loader(70))


def test_a_sample_of_the_images_is_seeded_spread_over_the_classes_and_kept_in_order() -> None:
    """`--max_images`: a class-sorted set's first 12 images are all class 0; the seeded sample is not, is the same
    for the same seed, and keeps the loader's batch size; a sample as large as the set is the loader itself."""
    labels = torch.arange(4).repeat_interleave(25)  # 100 images sorted by class, as an ImageFolder reads them
    loader = DataLoader(TensorDataset(torch.arange(100), labels), batch_size=8)
    sample = sample_loader(loader, 12, seed=0)
    indices, sampled_labels = (torch.cat(parts) for parts in zip(*sample, strict=True))
    assert len(indices) == 12 and indices.unique().numel() == 12 and bool((indices.diff() > 0).all())
    assert sampled_labels.unique().numel() >= 3 and sample.batch_size == 8
    assert torch.equal(torch.cat([b[0] for b in sample_loader(loader, 12, seed=0)]), indices)
    assert not torch.equal(torch.cat([b[0] for b in sample_loader(loader, 12, seed=1)]), indices)
    assert sample_loader(loader, 100, seed=0) is loader
    batched = DataLoader(loader.dataset, batch_sampler=[[0, 1], [2, 3]])  # no batch_size to keep
    with pytest.raises(ValueError, match="needs a loader of a map-style data set with a batch_size"):
        sample_loader(batched, 12, seed=0)


def test_pixel_space_recipe_with_the_data_module(image_tree: Path) -> None:
    """What `coretune eval robust` will do: the data module's evaluation transform with mean 0 and std 1 gives
    [0, 1] pixels, and NormalizedModel applies the model's normalisation, so clean accuracy is the usual one."""
    torch.manual_seed(0)
    net = nn.Sequential(create_backbone("small_cnn", verbose=False), nn.LazyLinear(3))
    usual = ImageClassificationData(str(image_tree), image_size=32, batch_size=4)
    pixels = ImageClassificationData(str(image_tree), image_size=32, batch_size=4, mean=(0, 0, 0), std=(1, 1, 1))
    usual.setup("test")
    pixels.setup("test")
    net.eval()(next(iter(usual.test_dataloader()))[0])  # materialise the lazy head
    model = NormalizedModel(net, IMAGENET_MEAN, IMAGENET_STD)
    report = robust_accuracy(model, pixels.test_dataloader(), [("linf", 8 / 255)], steps=2)
    assert report.num_images == 12
    assert report.clean_accuracy == pytest.approx(_plain_accuracy(net, usual.test_dataloader()))
    assert report.results[0].accuracy <= report.clean_accuracy


class _Untouchable:
    """A loader that must not be read: every setting is checked before the first batch."""

    def __iter__(self):
        raise AssertionError("the loader was read before the settings were checked")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attack": "fgsm"}, "unknown attack 'fgsm': choose one of pgd, torchattacks-pgd, autoattack"),
        ({"threat_models": [("linf", -1.0)]}, "PGD eps must be a finite radius >= 0"),
        ({"threat_models": [("l1", 0.5)]}, "PGD norm must be one of linf, l2; got 'l1'"),
        ({"steps": 0}, "PGD steps must be >= 1, got 0"),
        ({"step_size": -0.1}, "PGD step_size must be > 0"),
        ({"max_images": 0}, "max_images must be >= 1 (or None for every image), got 0"),
    ],
)
def test_bad_settings_fail_before_any_work(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        robust_accuracy(trained_digits_cnn(), _Untouchable(), **kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("attack", ["pgd", "torchattacks-pgd"])
def test_normalised_images_are_refused_for_every_attack(attack: str) -> None:
    _, _, x, y = digits()
    loader = DataLoader(TensorDataset((x[:8] - 0.3) / 0.4, y[:8]), batch_size=8)
    with pytest.raises(ValueError) as info:
        robust_accuracy(trained_digits_cnn(), loader, [("linf", 0.1)], attack=attack)  # type: ignore[arg-type]
    assert str(info.value) == (
        "robust_accuracy needs pixel images in [0, 1], got values in [-0.75, 1.75]: feed unnormalised images and "
        "wrap the model in coretune.robust.attacks.NormalizedModel(model, mean, std)"
    )


def test_an_empty_loader_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        robust_accuracy(trained_digits_cnn(), [])
    assert str(info.value) == "robust_accuracy got an empty loader: the split holds no images"


@pytest.mark.parametrize("attack", ["torchattacks-pgd", "autoattack"])
def test_missing_torchattacks_names_the_extra(monkeypatch: pytest.MonkeyPatch, attack: str) -> None:
    monkeypatch.setitem(sys.modules, "torchattacks", None)  # as if it were not installed
    with pytest.raises(RuntimeError) as info:
        robust_accuracy(trained_digits_cnn(), _Untouchable(), attack=attack)  # type: ignore[arg-type]
    assert str(info.value) == "this attack needs torchattacks, which is not installed: pip install 'coretune[robust]'"
    robust_accuracy(trained_digits_cnn(), _digits_loader(8), [("linf", 0.1)])  # coretune's PGD needs nothing
