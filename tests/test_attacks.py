"""coretune's PGD: the ε-ball and [0, 1], the damage to an undefended model, a model left exactly as it was,
seeded determinism, agreement with torchattacks' PGD / PGDL2, one-line errors, bf16 autocast, NormalizedModel."""

from __future__ import annotations

import pytest
import torch
import torchattacks
from PIL import Image
from torch import Tensor, nn

from adversarial_models import digits, trained_digits_cnn
from coretune.data import IMAGENET_MEAN, IMAGENET_STD, eval_transform
from coretune.robust.attacks import PGD, NormalizedModel, eval_mode, pgd, pixel_radius


def _accuracy(model: nn.Module, images: Tensor, labels: Tensor) -> float:
    with torch.no_grad(), eval_mode(model):
        return (model(images).argmax(dim=1) == labels).float().mean().item()


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("random_start", [True, False])
@pytest.mark.parametrize(("norm", "eps"), [("linf", 8 / 255), ("linf", 0.1), ("l2", 0.5), ("l2", 1.5)])
def test_pgd_stays_in_the_eps_ball_and_in_pixel_range(norm: str, eps: float, random_start: bool) -> None:
    model = trained_digits_cnn()
    _, _, x, y = digits()
    adv = pgd(model, x, y, norm=norm, eps=eps, random_start=random_start, generator=_seeded(0))
    delta = (adv - x).flatten(1)
    size = delta.abs().amax(dim=1) if norm == "linf" else delta.norm(dim=1)
    assert adv.shape == x.shape and adv.dtype == torch.float32 and not adv.requires_grad
    assert float(adv.min()) >= 0 and float(adv.max()) <= 1
    assert float(size.max()) <= eps * (1 + 1e-5)
    # the ball is used, not avoided: most examples end near its boundary ([0, 1] clipping shrinks some ℓ2 ones)
    assert float((size > 0.9 * eps).float().mean()) > 0.5


def test_pgd_lowers_the_accuracy_of_an_undefended_model() -> None:
    model = trained_digits_cnn()
    _, _, x, y = digits()
    clean = _accuracy(model, x, y)
    assert clean > 0.9

    def robust(norm: str, eps: float) -> float:
        return _accuracy(model, pgd(model, x, y, norm=norm, eps=eps, generator=_seeded(0)), y)

    assert robust("linf", 8 / 255) < clean - 0.05  # 8 grey levels already cost points on 8×8 digits
    assert robust("linf", 0.1) < clean - 0.4
    assert robust("linf", 0.3) <= 0.01  # a large radius: an undefended model goes to (near) 0
    assert robust("l2", 0.5) < clean - 0.4
    assert robust("l2", 2.5) <= 0.01


def test_attacking_leaves_the_model_parameters_grads_modes_and_batchnorm_statistics_unchanged() -> None:
    model = trained_digits_cnn().train()
    model.model[5].eval()  # a mixed mode must come back exactly as well
    conv, bn, linear = model.model[0], model.model[1], model.model[5]
    conv.weight.grad = torch.full_like(conv.weight, 0.5)  # a gradient left by a training step: kept as it is
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    seen_modes: list[bool] = []
    bn.register_forward_pre_hook(lambda m, _: seen_modes.append(m.training))
    _, _, x, y = digits()

    pgd(model, x[:64], y[:64], norm="linf", eps=0.1)

    assert seen_modes == [False] * 10  # BatchNorm in eval mode at each of the 10 steps
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and running_mean/var/num_batches
    assert [m.training for m in model.modules()] == modes == [True] * 7 + [False]
    assert torch.equal(conv.weight.grad, torch.full_like(conv.weight, 0.5))
    assert linear.weight.grad is None and conv.bias.grad is None and bn.weight.grad is None
    # the check has teeth: a forward pass in the model's own (train) mode does move the running statistics
    model(x[:64])
    assert not torch.equal(before["model.1.running_mean"], bn.running_mean)


def test_an_attack_that_fails_half_way_still_restores_every_mode() -> None:
    model = trained_digits_cnn().train()
    model.model[5].eval()
    _, _, x, _ = digits()
    with pytest.raises(IndexError, match="out of bounds"):
        pgd(model, x[:4], torch.full((4,), 10), norm="l2", eps=0.5)  # label 10 of a 10-class model
    assert [m.training for m in model.modules()] == [True] * 7 + [False]


def test_seeded_runs_are_deterministic() -> None:
    model = trained_digits_cnn()
    _, _, x, y = digits()
    for norm, eps in (("linf", 0.1), ("l2", 1.0)):
        first = pgd(model, x, y, norm=norm, eps=eps, generator=_seeded(3))
        assert torch.equal(first, pgd(model, x, y, norm=norm, eps=eps, generator=_seeded(3)))
        assert not torch.equal(first, pgd(model, x, y, norm=norm, eps=eps, generator=_seeded(4)))
    torch.manual_seed(5)  # without a generator, the global RNG draws the start
    first = pgd(model, x, y, norm="linf", eps=0.1)
    torch.manual_seed(5)
    assert torch.equal(first, pgd(model, x, y, norm="linf", eps=0.1))


def _torchattacks(model: nn.Module, attack: PGD, x: Tensor, y: Tensor, seed: int) -> Tensor:
    cls = torchattacks.PGD if attack.norm == "linf" else torchattacks.PGDL2
    torch.manual_seed(seed)  # torchattacks draws its random start from the global RNG, in the same order as ours
    return cls(model, eps=attack.eps, alpha=attack.step_size, steps=attack.steps, random_start=attack.random_start)(
        x, y
    )


@pytest.mark.parametrize("random_start", [True, False])
def test_linf_pgd_equals_torchattacks_pgd(random_start: bool) -> None:
    model = trained_digits_cnn().eval()
    _, _, x, y = digits()
    attack = PGD("linf", 0.1, steps=10, random_start=random_start)
    ours = attack(model, x, y, _seeded(7))
    torch.testing.assert_close(ours, _torchattacks(model, attack, x, y, seed=7), atol=1e-6, rtol=0)


def test_l2_pgd_equals_torchattacks_pgdl2() -> None:
    """The random start is drawn identically. Steps differ slightly: torchattacks divides by ‖g‖₂ + 1e-10, which
    is not negligible for confidently classified images (‖g‖₂ ~ 1e-6), so one step agrees to 1e-3; over 10 steps
    such differences also flip max-pool ties on the digits' many equal pixels and the examples part ways pixel by
    pixel, but the robust accuracy agrees within noise."""
    model = trained_digits_cnn().eval()
    _, _, x, y = digits()
    for random_start in (False, True):
        one_step = PGD("l2", 1.0, steps=1, step_size=0.25, random_start=random_start)
        torch.testing.assert_close(
            one_step(model, x, y, _seeded(7)), _torchattacks(model, one_step, x, y, seed=7), atol=1e-3, rtol=0
        )
    for eps in (0.5, 1.0):
        attack = PGD("l2", eps, steps=10)
        ours = _accuracy(model, attack(model, x, y, _seeded(7)), y)
        theirs = _accuracy(model, _torchattacks(model, attack, x, y, seed=7), y)
        assert abs(ours - theirs) <= 0.02, (eps, ours, theirs)


NOT_A_RADIUS = "PGD {name} must be a number or a fraction in [0, 1] pixel units (e.g. 8/255 or 0.5), got '{value}'"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps": -0.1}, "PGD eps must be a finite radius >= 0 in [0, 1] pixel units (e.g. 8/255), got -0.1"),
        ({"eps": float("nan")}, "PGD eps must be a finite radius >= 0 in [0, 1] pixel units (e.g. 8/255), got nan"),
        ({"norm": "l1"}, "PGD norm must be one of linf, l2; got 'l1'"),
        ({"steps": 0}, "PGD steps must be >= 1, got 0"),
        ({"steps": 2.5}, "PGD steps must be a whole number, got 2.5"),
        (
            {"eps": 8},
            "PGD linf eps must be < 1 in [0, 1] pixel units, got 8: a ball that holds every image. Write "
            "grey levels as a fraction (8/255)",
        ),
        (
            {"eps": 1},  # one grey level meant: the whole cube is the ball
            "PGD linf eps must be < 1 in [0, 1] pixel units, got 1: a ball that holds every image. Write "
            "grey levels as a fraction (1/255)",
        ),
        ({"step_size": 0.0}, "PGD step_size must be > 0 (or None for 2.5·eps/steps), got 0.0"),
        ({"step_size": -1.0}, "PGD step_size must be > 0 (or None for 2.5·eps/steps), got -1.0"),
        ({"eps": "eight"}, NOT_A_RADIUS.format(name="eps", value="eight")),
        ({"eps": "8/0"}, NOT_A_RADIUS.format(name="eps", value="8/0")),
        ({"eps": "-8/255"}, "PGD eps must be a finite radius >= 0 in [0, 1] pixel units (e.g. 8/255), got -0.0313725"),
        ({"step_size": "fast"}, NOT_A_RADIUS.format(name="step_size", value="fast")),
    ],
)
def test_bad_settings_give_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        PGD(**kwargs)
    assert str(info.value) == message
    settings = {"norm": "linf", "eps": 0.1, **kwargs}
    with pytest.raises(ValueError) as info:  # the function checks the same way
        pgd(nn.Identity(), torch.rand(1, 1, 2, 2), torch.zeros(1, dtype=torch.long), **settings)
    assert str(info.value) == message


def test_an_l2_radius_beyond_the_images_diameter_is_refused() -> None:
    # a 1×2×2 image's [0, 1] cube has diameter √4 = 2: ε = 2 still makes sense, ε = 2.5 holds every image
    x, y = torch.rand(3, 1, 2, 2), torch.zeros(3, dtype=torch.long)
    assert pgd(nn.Flatten(), x, y, norm="l2", eps=2.0).shape == x.shape
    with pytest.raises(ValueError) as info:
        pgd(nn.Flatten(), x, y, norm="l2", eps=2.5)
    assert str(info.value) == (
        "PGD l2 eps 2.5 is larger than the diameter of these images' [0, 1] pixel cube (2 = √4): a ball that holds "
        "every image. Give ε in [0, 1] pixel units (the paper's l2 radii: 0.5, 1.5, 2.5)"
    )


def test_normalised_images_are_refused_with_the_fix() -> None:
    model = trained_digits_cnn()
    _, _, x, y = digits()
    with pytest.raises(ValueError) as info:
        pgd(model, (x - 0.3) / 0.4, y, norm="linf", eps=0.1)
    assert str(info.value) == (
        "PGD needs pixel images in [0, 1], got values in [-0.75, 1.75]: feed unnormalised images and wrap the "
        "model in coretune.robust.attacks.NormalizedModel(model, mean, std)"
    )
    with pytest.raises(ValueError, match=r"PGD needs images \(N, ...\) and labels \(N,\), got \(397, 1, 8, 8\) and "):
        pgd(model, x, y[:5], norm="linf", eps=0.1)


@pytest.mark.parametrize(
    ("value", "radius"), [("8/255", 8 / 255), (" 2/255 ", 2 / 255), ("0.5", 0.5), ("1", 1.0), (0.25, 0.25), (1, 1.0)]
)
def test_radii_are_numbers_or_the_fractions_papers_write(value: float | str, radius: float) -> None:
    assert pixel_radius(value) == radius and type(pixel_radius(value)) is float
    attack = PGD("l2" if radius >= 1 else "linf", eps=value, step_size=value)  # an ℓ∞ ball of 1 is refused
    assert (attack.eps, attack.step_size) == (radius, radius)


def test_defaults_and_zero_radius() -> None:
    attack = PGD()
    assert (attack.norm, attack.eps, attack.steps, attack.random_start) == ("linf", 8 / 255, 10, True)
    assert attack.step_size == pytest.approx(2 / 255)  # 2.5·ε/steps: torchattacks' default for ε = 8/255
    assert PGD("l2", 0.5, steps=5).step_size == pytest.approx(0.25)
    assert repr(PGD("l2", 0.5)) == "PGD(norm='l2', eps=0.5, steps=10, step_size=0.125, random_start=True)"
    _, _, x, y = digits()
    assert torch.equal(pgd(trained_digits_cnn(), x, y, norm="l2", eps=0), x)


def test_pgd_under_bf16_autocast_keeps_the_perturbation_in_float32() -> None:
    model = trained_digits_cnn()
    _, _, x, y = digits()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        adv = pgd(model, x, y, norm="linf", eps=0.1, generator=_seeded(0))
    assert adv.dtype == torch.float32
    assert float((adv - x).abs().max()) <= 0.1 + 1e-6 and float(adv.min()) >= 0 and float(adv.max()) <= 1
    assert _accuracy(model, adv, y) < _accuracy(model, x, y) - 0.4


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_under_float16_autocast_moves_confidently_classified_images(norm: str) -> None:
    """A GPU without bf16 trains under float16 autocast: the gradient of an image classified with 1 − p ≈ 1e-10
    underflows there (the attack stalls at sign(0) = 0) unless its loss is scaled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 2))
    with torch.no_grad():
        model[1].weight.copy_(torch.linspace(-1, 1, 16).expand(2, 16) * torch.tensor([[4.0], [-4.0]]))
        model[1].bias.zero_()
    x = torch.linspace(0, 1, 16).view(1, 1, 4, 4).repeat(4, 1, 1, 1)
    y = torch.zeros(4, dtype=torch.long)
    logits = model(x).detach()
    assert 20 < float(logits[0, 0] - logits[0, 1]) < 30  # 1 − p from 1e-13 to 2e-9: float16's smallest is 6e-8
    reference = pgd(model, x, y, norm=norm, eps=0.01, steps=1, random_start=False)
    with torch.autocast("cpu", dtype=torch.float16):
        adv = pgd(model, x, y, norm=norm, eps=0.01, steps=1, random_start=False)
    moved = (adv - x).flatten(1).norm(dim=1, p=float("inf") if norm == "linf" else 2)
    assert bool((moved > 0.005).all())  # every image moved (to the ball's edge, 0.01)
    torch.testing.assert_close(adv, reference, atol=1e-3, rtol=0)


def test_normalized_model_equals_the_model_on_the_pipelines_normalised_images() -> None:
    """The wiring recipe: an eval transform with mean 0 and std 1 gives pixels; NormalizedModel restores the
    normalisation the model was trained with."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).eval()
    image = Image.fromarray(torch.randint(0, 256, (40, 36, 3), dtype=torch.uint8).numpy())
    normalised = eval_transform(32)(image)[None]
    pixels = eval_transform(32, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))(image)[None]
    assert float(pixels.min()) >= 0 and float(pixels.max()) <= 1
    wrapped = NormalizedModel(net, IMAGENET_MEAN, IMAGENET_STD)
    torch.testing.assert_close(wrapped(pixels), net(normalised))
    assert list(wrapped.state_dict()) == [f"model.{k}" for k in net.state_dict()]  # mean/std not saved


@pytest.mark.parametrize(
    ("mean", "std", "message"),
    [
        ((0.5, 0.5), (0.2,), "NormalizedModel needs one mean and one std per channel, got (0.5, 0.5) and (0.2,)"),
        ((0.5,), (0.0,), "NormalizedModel std values must be > 0, got (0.0,)"),
    ],
)
def test_normalized_model_rejects_bad_statistics(mean: tuple, std: tuple, message: str) -> None:
    with pytest.raises(ValueError) as info:
        NormalizedModel(nn.Identity(), mean, std)
    assert str(info.value) == message
