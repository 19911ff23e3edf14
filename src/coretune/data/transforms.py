"""The paper's pre-processing (Appendix C, after SimCLR and Kornblith et al. 2019), with torchvision v2.

Training: random resized crop to ``image_size`` and horizontal flip (plus an optional random rotation, which
the paper adds for some data sets such as CIFAR-10, and the colour jitter and random greyscale of domain
generalization). Evaluation: resize the shorter side to ``image_size·256/224`` and take the central ``image_size``
crop (256 → 224 at the paper's resolution), or (domain generalization, as DomainBed) resize the whole image to
``image_size × image_size``. Both upsample small images.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torchvision.transforms import v2

__all__ = [
    "AUTO_AUGMENT_EXAMPLES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Views",
    "auto_augment_problem",
    "auto_augment_transform",
    "eval_draft_size",
    "eval_resize_size",
    "eval_transform",
    "normalisation_problems",
    "option_values",
    "other_normalisation",
    "posterize_any_bits",
    "random_steps",
    "resize_transform",
    "train_draft_size",
    "train_transform",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

# torchvision's RandomResizedCrop defaults, spelled out because train_draft_size depends on them.
_CROP_SCALE = (0.08, 1.0)
_CROP_RATIO = (3 / 4, 4 / 3)


def normalisation_problems(mean: Sequence[float], std: Sequence[float]) -> list[str]:
    """What is wrong with a normalisation ``mean`` and ``std`` (3 values each, fractions of the [0, 1] pixel range
    the transforms scale images to), one message per problem; empty when they are usable."""
    checks = [
        (len(mean) == 3 and len(std) == 3, f"mean and std need 3 values (R, G, B), got {mean} and {std}"),
        (all(v > 0 for v in std), f"std values must be > 0, got {std}"),
        (all(0 <= v <= 1 for v in mean) and all(v <= 1 for v in std),
         "mean must be in [0, 1] and std in (0, 1] (fractions of the [0, 1] pixel range: divide values on the "
         f"0-255 scale by 255, e.g. 123.675 → 0.485), got {mean} and {std}"),
    ]  # fmt: skip
    return [message for ok, message in checks if not ok]


def option_values(values: Sequence[float]) -> str:
    """``values`` as a list option takes them on the command line: ``[0.485,0.456,0.406]`` (``--data.mean``)."""
    return "[" + ",".join(f"{float(v):g}" for v in values) + "]"


def other_normalisation(
    trained: tuple[Sequence[float], Sequence[float]] | None,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    weights: object,
    option: str = "--model.weights",
) -> str | None:
    """Why inputs normalised with ``mean`` and ``std`` are on another scale than the one the pre-trained ``weights``
    learned (``trained``: the mean and std their checkpoint or timm name records), with the options that fix it; None
    when they agree (to 1e-3) or either is unknown. Features of inputs on another scale are not the ones the backbone
    learned, and nothing downstream would notice. ``option`` names the weights in the message (``coretune eval``:
    ``--weights``)."""
    if trained is None or mean is None or std is None:
        return None
    pairs = [pair for want, got in zip(trained, (mean, std), strict=True) for pair in zip(want, got, strict=False)]
    if len(pairs) == 6 and all(math.isclose(a, b, abs_tol=1e-3) for a, b in pairs):
        return None
    trained_mean, trained_std = option_values(trained[0]), option_values(trained[1])
    return (
        f"{option} {weights} were trained on images normalised with mean {trained_mean} and std "
        f"{trained_std}, but the data is normalised with mean {option_values(mean)} and std {option_values(std)}: "
        f"pass --data.mean {trained_mean} --data.std {trained_std} to feed the backbone inputs on the scale it learned"
    )


AUTO_AUGMENT_EXAMPLES = ("rand-m9-mstd0.5", "rand-m9-mstd0.5-inc1", "trivial")
"""Values of ``--data.auto_augment``: timm's RandAugment strings (``rand-m9-mstd0.5``: 2 operations of magnitude 9,
noise std 0.5; ``-inc1``: the operations whose strength grows with the magnitude, as the ViT fine-tuning recipes of
DeiT, BEiT, iBOT and MAE use it) and ``trivial`` (TrivialAugmentWide)."""


class _SeededFromTorch:
    """A PIL transform that draws from Python's ``random`` and NumPy's global RNG (timm's RandAugment), run with both
    seeded from one draw of torch's RNG, which the training loaders seed per item (``(seed, epoch, index)``), and
    restored after: its draws are the item's, the same in every run and worker."""

    def __init__(self, transform: Callable[[Any], Any]) -> None:
        self.transform = transform

    def __call__(self, image: Any) -> Any:
        seed = int(torch.randint(2**62, (1,)).item())
        python_state, numpy_state = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            return self.transform(image)
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transform!r})"


def auto_augment_transform(name: str, image_size: int, mean: Sequence[float] = IMAGENET_MEAN) -> Callable[[Any], Any]:
    """The automatic augmentation ``name`` of PIL images: ``trivial`` is torchvision's ``TrivialAugmentWide``; a
    ``rand-…`` string timm's ``rand_augment_transform`` (its hyper-parameters as timm's ``create_transform`` sets
    them: translations up to 45% of ``image_size``, uncovered pixels filled with the ``mean`` colour), seeded from
    torch's RNG (:class:`_SeededFromTorch`).

    Raises:
        ValueError: ``name`` is neither (:func:`auto_augment_problem`).
    """
    if (problem := auto_augment_problem(name)) is not None:
        raise ValueError(problem)
    fill = tuple(min(255, round(255 * m)) for m in mean)
    if name == "trivial":
        return v2.TrivialAugmentWide(fill=fill)  # type: ignore[arg-type]  (a colour per channel)
    from timm.data.auto_augment import rand_augment_transform

    hparams = {"translate_const": int(image_size * 0.45), "img_mean": fill}
    transform = rand_augment_transform(name, hparams)
    for op in getattr(transform, "ops", ()):  # RandAugment's AugmentOps
        if op.name.startswith("Posterize"):
            op.aug_fn = posterize_any_bits
    return _SeededFromTorch(transform)


def posterize_any_bits(image: Any, bits_to_keep: int, **_: Any) -> Any:
    """timm's RandAugment ``posterize``, keeping ``bits_to_keep`` most significant bits of each channel, for every
    count it draws, 0 included. ``rand-…-inc1`` (MAE's ``--aa``) keeps ``4 - int(magnitude / 10 * 4)`` bits, so 0
    when a noisy magnitude (``mstd``) reaches 10: Pillow 13's ``ImageOps.posterize`` refuses 0 and the run stopped
    in its first epoch; earlier Pillows masked every bit (a black image), which is what is done here."""
    if bits_to_keep >= 8:
        return image
    mask = ~(2 ** (8 - max(0, bits_to_keep)) - 1) & 0xFF
    return image.point([value & mask for value in range(256)] * len(image.getbands()))


def auto_augment_problem(name: object) -> str | None:
    """Why ``name`` is no ``--data.auto_augment`` value (one sentence naming the valid ones), or None (also for
    None: no automatic augmentation)."""
    if name is None or name == "trivial":
        return None
    valid = f"use {', '.join(AUTO_AUGMENT_EXAMPLES)} (timm's RandAugment: rand-m<magnitude>[-n<ops>][-mstd<std>]…)"
    if not isinstance(name, str) or not name.startswith("rand"):
        return f"auto_augment {name!r} is unknown: {valid} or null"
    from timm.data.auto_augment import rand_augment_transform

    try:
        rand_augment_transform(name, {"translate_const": 100, "img_mean": (124, 116, 104)})
    except (AssertionError, ValueError, KeyError, IndexError) as err:
        return f"auto_augment {name!r} is no RandAugment string timm reads ({err or type(err).__name__}): {valid}"
    return None


def _to_normalized_tensor(mean: tuple[float, ...], std: tuple[float, ...]) -> list[v2.Transform]:
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]


def train_transform(
    image_size: int,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
    rotation: float = 0.0,
    crop_scale: tuple[float, float] = _CROP_SCALE,
    hflip: bool = True,
    color_jitter: float = 0.0,
    grayscale: float = 0.0,
    auto_augment: str | None = None,
) -> v2.Compose:
    """PIL RGB image → normalised float tensor (3, image_size, image_size) with training augmentation.

    A random resized crop covering ``crop_scale`` of the image area (the paper's 8–100% by default), a horizontal
    flip if ``hflip``, and with ``rotation`` > 0 a rotation by a uniform angle in [-rotation, rotation] degrees
    after the crop; the corners it uncovers are filled with the mean colour, i.e. zero after normalisation. Then,
    with ``color_jitter`` > 0, a random brightness, contrast, saturation and hue change of that strength (hue at
    most 0.5), and with ``grayscale`` > 0 a conversion to grey with that probability: DomainBed's augmentation of
    domain generalization is ``crop_scale=(0.7, 1.0)``, ``color_jitter=0.3``, ``grayscale=0.1``. Last, with
    ``auto_augment``, an automatic augmentation policy (:func:`auto_augment_transform`: ``rand-m9-mstd0.5``,
    ``trivial``), where timm's ``create_transform`` puts it: after the crop and flip, before the tensor conversion.
    """
    steps = random_steps(image_size, mean, rotation, crop_scale, hflip, color_jitter, grayscale)
    if auto_augment is not None:
        steps.append(auto_augment_transform(auto_augment, image_size, mean))
    return v2.Compose(steps + _to_normalized_tensor(mean, std))


def random_steps(
    image_size: int,
    mean: Sequence[float],
    rotation: float,
    crop_scale: tuple[float, float],
    hflip: bool,
    color_jitter: float,
    grayscale: float,
) -> list[v2.Transform]:
    """The random steps of :func:`train_transform` (before conversion to float and normalisation), which
    :class:`~coretune.data.device_augment.DeviceAugment` runs on uint8 tensors on the device."""
    steps: list[v2.Transform] = [
        v2.RandomResizedCrop(image_size, scale=tuple(crop_scale), ratio=_CROP_RATIO, antialias=True),
    ]
    if hflip:
        steps.append(v2.RandomHorizontalFlip())
    if rotation > 0:
        steps.append(v2.RandomRotation(rotation, fill=tuple(round(255 * m) for m in mean)))
    if color_jitter > 0:
        steps.append(v2.ColorJitter(color_jitter, color_jitter, color_jitter, min(color_jitter, 0.5)))
    if grayscale > 0:
        steps.append(v2.RandomGrayscale(grayscale))
    return steps


class Views:
    """``n`` independently augmented views of one image, as a tuple: the image is decoded once and ``transform``
    runs ``n`` times with successive random draws (for objectives contrasting a second view, e.g. Bi-tuning's
    momentum keys)."""

    def __init__(self, transform: v2.Transform, n: int = 2) -> None:
        if n < 1:
            raise ValueError(f"Views needs n >= 1 views (got {n})")
        self.transform, self.n = transform, n

    def __call__(self, image: object) -> tuple[torch.Tensor, ...]:
        return tuple(self.transform(image) for _ in range(self.n))

    def __repr__(self) -> str:
        return f"Views(n={self.n}, transform={self.transform!r})"


def eval_resize_size(image_size: int) -> int:
    """Shorter side of the resize before the evaluation centre crop: ``round(image_size·256/224)``."""
    return round(image_size * 256 / 224)


def eval_transform(
    image_size: int,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
) -> v2.Compose:
    """PIL RGB image → normalised float tensor (3, image_size, image_size): resize, then centre crop."""
    return v2.Compose(
        [
            v2.Resize(eval_resize_size(image_size), antialias=True),
            v2.CenterCrop(image_size),
            *_to_normalized_tensor(mean, std),
        ]
    )


def resize_transform(
    image_size: int,
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
) -> v2.Compose:
    """PIL RGB image → normalised float tensor (3, image_size, image_size): the whole image resized to a square,
    no crop (DomainBed's evaluation transform; JPEG draft size: ``image_size``)."""
    return v2.Compose([v2.Resize((image_size, image_size), antialias=True), *_to_normalized_tensor(mean, std)])


def train_draft_size(image_size: int, crop_scale: tuple[float, float] = _CROP_SCALE) -> int:
    """JPEG draft size for :func:`train_transform`: the narrowest random crop keeps >= ``image_size`` pixels.

    The narrowest crop is ``sqrt(crop_scale[0] · ratio_min)`` of the shorter side (≈ 0.245 for the paper's 8%), so
    the image's shorter side must stay >= ``image_size / 0.245`` (915 px at 224): only larger photos are decoded
    at reduced scale.
    """
    return math.ceil(image_size / math.sqrt(crop_scale[0] * _CROP_RATIO[0]))


def eval_draft_size(image_size: int) -> int:
    """JPEG draft size for :func:`eval_transform`: the shorter side stays >= the resize target."""
    return eval_resize_size(image_size)
