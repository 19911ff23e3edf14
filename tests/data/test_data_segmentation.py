"""SegmentationData and the joint transforms: the VOC layout, class inference, label fractions, alignment of image
and mask under random scale/crop/flip, padding, and a one-line error naming the file for every bad input."""

from __future__ import annotations

import inspect
import re
import shutil
import warnings
from pathlib import Path

import docstring_parser
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonargparse import ArgumentParser
from PIL import Image
from torchvision import tv_tensors

from coretune.data import (
    DataError,
    ImageDecodeError,
    SegmentationData,
    SegmentationDataset,
    SkippedImagesWarning,
    pad_collate,
    read_class_names,
    read_mask,
    segmentation_eval_transform,
    segmentation_train_transform,
)
from coretune.data.samplers import same_size_batches
from segmentation_sets import make_voc_set, save_mask

NO_NORM = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


def data(root: Path, **kwargs: object) -> SegmentationData:
    options = {"image_size": 32, "batch_size": 4} | kwargs
    return SegmentationData(str(root), **options)  # type: ignore[arg-type]


def loaded(root: Path, **kwargs: object) -> SegmentationData:
    """:func:`data`, set up."""
    dm = data(root, **kwargs)
    dm.setup()
    return dm


def one_line_error(match: str, root: Path, **kwargs: object) -> str:
    """Set up data on ``root`` and return the DataError's message, checked to be one line matching ``match``."""
    with pytest.raises(DataError, match=match) as err:
        data(root, **kwargs).setup()
    assert "\n" not in str(err.value)
    return str(err.value)


# -- the layout -----------------------------------------------------------------------------------------------
def test_reads_the_voc_layout_with_palette_masks_as_indices(voc_set: Path) -> None:
    dm = data(voc_set)
    assert (dm.num_classes, dm.class_names) == (4, ["0", "1", "2", "3"])
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (8, 4)
    assert dm.test_dataset is dm.val_dataset and dm.validates_on_test  # no test.txt: val serves both
    mask_file = voc_set / "SegmentationClass" / "train_000.png"
    with Image.open(mask_file) as img:
        assert img.mode == "P"
        indices = np.array(img)
    np.testing.assert_array_equal(read_mask(str(mask_file)), indices)
    assert set(np.unique(indices)) <= {0, 1, 2, 3, 255} and 255 in indices

    images, masks = next(iter(dm.train_dataloader()))
    assert (images.shape, images.dtype) == ((4, 3, 32, 32), torch.float32)
    assert (masks.shape, masks.dtype) == ((4, 32, 32), torch.int64)
    assert set(masks.unique().tolist()) <= {0, 1, 2, 3, 255}
    images, masks = next(iter(dm.val_dataloader()))
    assert (images.shape, masks.shape) == ((4, 3, 32, 32), (4, 32, 32))


def test_camvid_layout_png_images_grey_masks_class_names_and_a_test_split(tmp_path: Path) -> None:
    """What ``unpack.py camvid`` writes: PNG images in JPEGImages/, grey masks, classes.txt, train/val/test."""
    names = ["sky", "building", "road", "car"]
    root = make_voc_set(tmp_path / "CamVid", {"train": 6, "val": 2, "test": 3}, palette=False, class_names=names,
                        image_ext=".png")  # fmt: skip
    dm = data(root, eval_mode="whole", eval_batch_size=3)
    assert (dm.class_names, dm.num_classes) == (names, 4)
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (6, 2, 3)
    assert not dm.validates_on_test
    assert dm.test_dataset.images[0].endswith("test_000.png")
    images, masks = next(iter(dm.test_dataloader()))  # whole images: 40×56 as generated
    assert (images.shape, masks.shape) == ((3, 3, 40, 56), (3, 40, 56))


def test_class_names_from_a_cvat_labelmap(tmp_path: Path) -> None:
    root = make_voc_set(tmp_path / "voc")
    (root / "labelmap.txt").write_text(
        "# label:color_rgb:parts:actions\nbackground:0,0,0::\nsquare:128,0,0::\ndisc:0,128,0::\ntriangle:128,128,0::\n"
    )
    assert read_class_names(str(root)) == ["background", "square", "disc", "triangle"]
    assert data(root).class_names == ["background", "square", "disc", "triangle"]


def test_given_num_classes_may_exceed_the_classes_seen(voc_set: Path) -> None:
    dm = data(voc_set, num_classes=6)
    assert (dm.num_classes, dm.class_names) == (6, ["0", "1", "2", "3", "4", "5"])


def test_label_fraction_is_seeded_nested_and_rounded(tmp_path: Path) -> None:
    root = make_voc_set(tmp_path / "voc", {"train": 20, "val": 2})
    ids = {f: {s: loaded(root, label_fraction=f, seed=s).train_dataset.ids for s in (0, 1)} for f in (0.25, 0.5)}
    assert len(ids[0.25][0]) == 5 and len(ids[0.5][0]) == 10
    assert ids[0.25][0] == loaded(root, label_fraction=0.25, seed=0).train_dataset.ids  # seeded
    assert ids[0.25][0] != ids[0.25][1]
    assert set(ids[0.25][0]) < set(ids[0.5][0])  # a smaller fraction's images are among a larger one's
    assert len(loaded(root).train_dataset) == 20
    message = one_line_error("label_fraction 0.01 keeps none of the 20 training images", root, label_fraction=0.01)
    assert message.endswith("raise it to ≥ 0.025")


def test_val_fraction_holds_out_training_images_and_tests_on_val_txt(tmp_path: Path) -> None:
    """A seeded part of the (label-fraction) train.txt images validates; val.txt is then the test split only."""
    root = make_voc_set(tmp_path / "voc", {"train": 20, "val": 3})
    val_ids = [f"val_{i:03d}" for i in range(3)]
    held = {s: loaded(root, val_fraction=0.25, seed=s) for s in (0, 1)}
    for dm in held.values():
        assert len(dm.train_dataset) == 15 and len(dm.val_dataset) == 5
        assert set(dm.train_dataset.ids) | set(dm.val_dataset.ids) == {f"train_{i:03d}" for i in range(20)}
        assert dm.test_dataset.ids == val_ids and not dm.validates_on_test
    assert held[0].val_dataset.ids == loaded(root, val_fraction=0.25, seed=0).val_dataset.ids  # seeded
    assert held[0].val_dataset.ids != held[1].val_dataset.ids
    fraction = loaded(root, label_fraction=0.5, val_fraction=0.2, seed=0)  # carved from the images one has
    kept = loaded(root, label_fraction=0.5, seed=0).train_dataset.ids
    assert (len(fraction.train_dataset), len(fraction.val_dataset)) == (8, 2)
    assert set(fraction.train_dataset.ids) | set(fraction.val_dataset.ids) == set(kept)
    plain = loaded(root)  # without val_fraction, val.txt validates (and tests)
    assert plain.val_dataset.ids == val_ids and plain.validates_on_test
    one = make_voc_set(tmp_path / "one", {"train": 1, "val": 1})
    assert one_line_error("val_fraction 0.2 cannot hold out", one, val_fraction=0.2) == (
        "val_fraction 0.2 cannot hold out part of 1 training image: both training and validation need one; add "
        "images to train.txt, or set --data.val_fraction 0"
    )
    with pytest.raises(DataError, match=r"val_fraction must be in \[0, 1\) \(0 validates on val.txt or test.txt\)"):
        SegmentationData("x", val_fraction=1.0)


def test_the_training_loader_is_reproducible(voc_set: Path) -> None:
    first = [b[1] for b in data(voc_set, seed=3).train_dataloader()]
    again = [b[1] for b in data(voc_set, seed=3).train_dataloader()]
    other = [b[1] for b in data(voc_set, seed=4).train_dataloader()]
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_loader_workers_get_the_transforms_and_the_collates(tmp_path: Path) -> None:
    """Everything a worker process receives pickles: the v2 transforms (RandomScale included), pad_collate and the
    same-size batches of whole images."""
    root = make_voc_set(tmp_path / "voc", {"train": 4, "val": 2})
    make_voc_set(root, {"extra": 1}, size=(30, 44), seed=1)
    (root / "ImageSets" / "Segmentation" / "test.txt").write_text("extra_000\nval_000\nval_001\n")
    dm = loaded(root, num_workers=1, eval_mode="whole")
    images, masks = next(iter(dm.train_dataloader()))
    assert (images.shape, masks.shape) == ((4, 3, 32, 32), (4, 32, 32))
    shapes = [(images.shape, masks.shape) for images, masks in dm.test_dataloader()]
    assert shapes == [((1, 3, 30, 44), (1, 30, 44)), ((2, 3, 40, 56), (2, 40, 56))]
    images, masks = next(iter(loaded(root, num_workers=1).test_dataloader()))  # centre crops, padded to 32
    assert (images.shape, masks.shape) == ((3, 3, 32, 32), (3, 32, 32)) and (masks[0, 31] == 255).all()


def test_images_of_one_size_share_batches_in_order_and_unreadable_files_stand_alone(tmp_path: Path) -> None:
    sizes = [(64, 48), (40, 32), (64, 48), (64, 48), (40, 32), (64, 48)]
    paths = []
    for i, size in enumerate(sizes):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.new("RGB", size).save(paths[-1])
    (tmp_path / "bad.png").write_bytes(b"not an image")
    paths.insert(2, str(tmp_path / "bad.png"))  # index 2
    assert same_size_batches(paths, 3) == [[0, 3, 4], [6], [1, 5], [2]]
    assert same_size_batches(paths, 64) == [[0, 3, 4, 6], [1, 5], [2]]
    assert same_size_batches([], 4) == []


def test_whole_images_are_batched_by_size_so_no_prediction_depends_on_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Padded to a batch-mate's size, a whole image was predicted with the padding in view of the network (ASPP's
    image pooling, the receptive field): its score depended on the evaluation batch size. Each batch now holds
    images of one size, in list order within a size, each image once; under torch.distributed each process reads
    every W-th image of the list (as the other evaluation loaders), grouped the same way."""
    root = make_voc_set(tmp_path / "voc", {"train": 4, "val": 3})
    make_voc_set(root, {"small": 3}, size=(30, 44), seed=1)
    order = ["small_000", "val_000", "small_001", "val_001", "val_002", "small_002"]
    (root / "ImageSets" / "Segmentation" / "test.txt").write_text("\n".join(order) + "\n")
    dm = loaded(root, eval_mode="whole", eval_batch_size=2, **NO_NORM)
    single = SegmentationDataset.from_voc(str(root), "test").with_transform(dm.eval_transform)
    batches = list(dm.test_dataloader())
    assert [tuple(images.shape) for images, _ in batches] == [
        (2, 3, 30, 44),
        (1, 3, 30, 44),
        (2, 3, 40, 56),
        (1, 3, 40, 56),
    ]
    expected = [single[i] for i in (0, 2, 5, 1, 3, 4)]  # the small images in list order, then the others
    got = [(image, mask) for images, masks in batches for image, mask in zip(images, masks, strict=True)]
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected, strict=True))
    assert (torch.cat([m.flatten() for _, m in got]) != 255).any()  # not all padding
    # --trainer.overfit_batches: Lightning re-reads the loader's dataset with a SequentialSampler, item by item
    images, masks = dm.test_dataloader().dataset[1]
    assert torch.equal(images[0], single[1][0]) and images.shape == (1, 3, 40, 56) and masks.shape == (1, 40, 56)
    from coretune.data import samplers

    monkeypatch.setattr(samplers, "world_size", lambda: 2)
    monkeypatch.setattr(samplers, "rank", lambda: 1)
    loader = dm.test_dataloader()
    assert list(loader.sampler) == [[1, 3], [5]]  # items 1 3 5 (val_000, val_001, small_002), by size
    assert len(loader) == 2 and [tuple(images.shape) for images, _ in loader] == [(2, 3, 40, 56), (1, 3, 30, 44)]


def test_options_parse_from_the_command_line(voc_set: Path) -> None:
    params = list(inspect.signature(SegmentationData.__init__).parameters.values())[1:]
    documented = {p.arg_name: p.description for p in docstring_parser.parse(SegmentationData.__doc__).params}
    assert {p.name for p in params} == set(documented) and all(documented.values())
    parser = ArgumentParser()
    parser.add_class_arguments(SegmentationData, "data")
    cfg = parser.parse_args(["--data.root", str(voc_set), "--data.image_size", "24", "--data.num_classes", "5",
                             "--data.eval_mode", "whole"])  # fmt: skip
    dm = parser.instantiate(cfg).data
    assert (dm.image_size, dm.num_classes, dm.hparams["eval_mode"]) == (24, 5, "whole")
    with pytest.raises(SystemExit):
        parser.parse_args(["--data.eval_mode", "resize"])


def test_invalid_options_are_named_together() -> None:
    with pytest.raises(DataError) as err:
        SegmentationData("x", image_size=0, label_fraction=1.5, num_classes=1, scale_range=(2.0, 1.0))
    message = str(err.value)
    for part in ("image_size must be >= 1", "label_fraction must be in (0, 1]", "num_classes must be >= 2",
                 "scale_range must be (low, high)"):  # fmt: skip
        assert part in message
    assert "\n" not in message


# -- joint transforms -----------------------------------------------------------------------------------------
def coordinate_image(height: int, width: int) -> tuple[Image.Image, tv_tensors.Mask]:
    """Red encodes x and green y (0 … 255 across the image); the mask is a function of the same coordinates
    (:func:`block_class`)."""
    yy, xx = np.mgrid[0:height, 0:width]
    rgb = np.stack([np.rint(xx * 255 / (width - 1)), np.rint(yy * 255 / (height - 1)), np.zeros_like(xx)], axis=2)
    return Image.fromarray(rgb.astype(np.uint8)), tv_tensors.Mask(torch.from_numpy(block_class(xx, yy)))


def block_class(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Class of source pixel (x, y): 4×4-pixel blocks numbered along x then y, modulo 7."""
    return ((x // 4 + 3 * (y // 4)) % 7).astype(np.uint8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    height=st.integers(12, 60),
    width=st.integers(12, 60),
    crop=st.integers(8, 48),
)
def test_random_scale_crop_and_flip_keep_image_and_mask_aligned(seed: int, height: int, width: int, crop: int) -> None:
    """Every non-ignored mask pixel after the training transform is the class of the source pixel whose
    coordinates the image pixel encodes (within 2 source pixels: bilinear/antialias filters at the borders)."""
    image, mask = coordinate_image(height, width)
    torch.manual_seed(seed)
    out_image, out_mask = segmentation_train_transform(crop, **NO_NORM)(image, mask)
    assert (out_image.shape, out_mask.shape, out_mask.dtype) == ((3, crop, crop), (crop, crop), torch.int64)
    x_src = out_image[0].numpy() * (width - 1)
    y_src = out_image[1].numpy() * (height - 1)
    labelled = out_mask.numpy() != 255
    tolerance = 2
    candidates = set()
    for dx in range(-tolerance, tolerance + 1):
        for dy in range(-tolerance, tolerance + 1):
            x = np.clip(np.rint(x_src) + dx, 0, width - 1).astype(int)
            y = np.clip(np.rint(y_src) + dy, 0, height - 1).astype(int)
            candidates.add(block_class(x, y).tobytes())
    nearby = np.stack([np.frombuffer(c, dtype=np.uint8).reshape(crop, crop) for c in candidates])
    agrees = (nearby == out_mask.numpy()[None].astype(np.uint8)).any(axis=0)
    assert agrees[labelled].all(), f"{(~agrees & labelled).sum()} of {labelled.sum()} mask pixels misaligned"


def test_flip_mirrors_image_and_mask_together() -> None:
    """At scale 1 with a crop the image's size, the output is the source or its mirror image — both together."""
    image, mask = coordinate_image(16, 16)
    flips = set()
    for seed in range(8):
        torch.manual_seed(seed)
        out_image, out_mask = segmentation_train_transform(16, **NO_NORM, scale_range=(1.0, 1.0))(image, mask)
        flipped = bool(out_image[0, 0, 0] > out_image[0, 0, -1])
        expected = mask.flip(-1) if flipped else mask
        assert torch.equal(out_mask, expected.long())
        flips.add(flipped)
    assert flips == {True, False}


def test_training_crop_pads_the_image_with_the_mean_colour_and_the_mask_with_ignore() -> None:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8))
    mask = tv_tensors.Mask(torch.from_numpy(rng.integers(0, 5, (10, 12), dtype=np.uint8)))
    transform = segmentation_train_transform(20, scale_range=(1.0, 1.0), hflip=False)  # ImageNet mean/std
    for seed in range(5):
        torch.manual_seed(seed)
        out_image, out_mask = transform(image, mask)
        padded = out_mask == 255
        assert int(padded.sum()) == 20 * 20 - 10 * 12
        assert out_image[:, padded].abs().max() < 0.01  # the mean colour is 0 after normalisation (± rounding)
        rows, cols = torch.nonzero(~padded, as_tuple=True)
        block = out_mask[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
        assert torch.equal(block, mask.long())  # the image itself, whole and unmoved inside its padding


def test_masks_are_resized_by_nearest_neighbour() -> None:
    image, mask = coordinate_image(20, 20)
    for seed in range(5):
        torch.manual_seed(seed)
        _, out_mask = segmentation_train_transform(16, **NO_NORM, scale_range=(0.5, 2.0))(image, mask)
        assert set(out_mask.unique().tolist()) <= set(range(7)) | {255}  # no interpolated in-between values


def test_evaluation_centre_crop_and_whole_image() -> None:
    image, mask = coordinate_image(10, 30)
    out_image, out_mask = segmentation_eval_transform(16, **NO_NORM)(image, mask)
    assert out_mask.shape == (16, 16)
    assert (out_mask[:3] == 255).all() and (out_mask[13:] == 255).all()  # 10 rows padded to 16, centred
    assert torch.equal(out_mask[3:13], mask[:, 7:23].long())  # 30 columns cropped to the central 16
    red = torch.from_numpy(np.array(image)[:, 7:23, 0]).float() / 255
    assert torch.allclose(out_image[0, 3:13], red) and (out_image[:, :3] == 0).all()
    whole_image, whole_mask = segmentation_eval_transform(16, **NO_NORM, mode="whole")(image, mask)
    assert (whole_image.shape, torch.equal(whole_mask, mask.long())) == ((3, 10, 30), True)


def test_pad_collate_pads_to_the_largest_image_with_ignore() -> None:
    small = (torch.ones(3, 4, 5), torch.zeros(4, 5, dtype=torch.int64))
    large = (torch.ones(3, 6, 3), torch.ones(6, 3, dtype=torch.int64))
    images, masks = pad_collate([small, large])
    assert (images.shape, masks.shape) == ((2, 3, 6, 5), (2, 6, 5))
    assert (masks[0, 4:] == 255).all() and (masks[1, :, 3:] == 255).all()
    assert images[0, :, 4:].eq(0).all() and images[0, :, :4].eq(1).all()


# -- bad inputs: one line naming the file ---------------------------------------------------------------------
def test_mask_of_another_size_is_named(voc_set: Path) -> None:
    mask = voc_set / "SegmentationClass" / "val_002.png"
    save_mask(np.zeros((30, 56), dtype=np.uint8), mask, palette=True)
    message = one_line_error("is 56×30 px but its image", voc_set)
    assert str(mask) in message and "val_002.jpg is 56×40" in message


def test_mask_value_out_of_range_is_named(voc_set: Path) -> None:
    mask = voc_set / "SegmentationClass" / "train_004.png"
    values = read_mask(str(mask)).copy()
    values[0, 0] = 9
    save_mask(values, mask, palette=False)
    message = one_line_error(re.escape(f"mask {mask} holds value 9, out of range for 4 classes (0–3, 255 = ignore)"),
                             voc_set, num_classes=4)  # fmt: skip
    assert "--data.num_classes" in message
    (voc_set / "classes.txt").write_text("a\nb\nc\nd\n")  # 4 names: the same check
    one_line_error(re.escape(f"mask {mask} holds value 9"), voc_set)
    (voc_set / "classes.txt").unlink()
    # inferred, classes 4–8 would never occur: refused (it was a silent 10-class model); a given count takes it
    one_line_error(re.escape(f"mask {mask} holds value 9, but no mask holds 4–8: inferred from the masks"), voc_set)
    assert data(voc_set, num_classes=10).num_classes == 10


def test_missing_mask_is_named(voc_set: Path) -> None:
    (voc_set / "SegmentationClass" / "train_001.png").unlink()
    message = one_line_error("has no mask", voc_set)
    assert f"image {voc_set / 'JPEGImages' / 'train_001.jpg'} has no mask: expected " in message
    assert str(voc_set / "SegmentationClass" / "train_001.png") in message


def test_list_file_naming_a_missing_image_is_named(voc_set: Path) -> None:
    (voc_set / "JPEGImages" / "val_003.jpg").unlink()
    list_file = voc_set / "ImageSets" / "Segmentation" / "val.txt"
    message = one_line_error(re.escape(f"list file {list_file} names image 'val_003'"), voc_set)
    assert "add the image or remove the line" in message


def test_an_image_listed_twice_is_named(voc_set: Path) -> None:
    # VOC's and SBD's lists joined naively: a repeat counts twice an epoch and can be both fitted and held out
    list_file = voc_set / "ImageSets" / "Segmentation" / "train.txt"
    list_file.write_text(list_file.read_text() + "train_002\ntrain_005\ntrain_002\n")
    assert one_line_error("more than once", voc_set, val_fraction=0.25) == (
        f"list file {list_file} names image 'train_002' more than once (3 repeated line(s)): list each image once "
        "(sort -u), or a repeat counts twice an epoch and may land in both the fitted and the held-out part"
    )


def test_test_images_that_are_training_images_are_found(voc_set: Path) -> None:
    """An id in both train.txt and the evaluation list (or an image symlinked to a training one): the same file read
    by both splits; the fit warns as a classification fit does."""
    assert data(voc_set).test_files_in_training() == []
    lists = voc_set / "ImageSets" / "Segmentation"
    (lists / "val.txt").write_text("val_000\ntrain_003\nval_001\n")
    (voc_set / "JPEGImages" / "val_001.jpg").unlink()
    (voc_set / "JPEGImages" / "val_001.jpg").symlink_to(voc_set / "JPEGImages" / "train_004.jpg")
    images = voc_set / "JPEGImages"
    assert data(voc_set).test_files_in_training() == [str(images / "train_003.jpg"), str(images / "val_001.jpg")]


@pytest.mark.parametrize("folder", ["JPEGImages", "SegmentationClass", "ImageSets"])
def test_missing_folders_are_named(voc_set: Path, folder: str) -> None:
    shutil.rmtree(voc_set / folder)
    one_line_error(re.escape(f"data root {voc_set} has no {folder}"), voc_set)
    with pytest.raises(DataError, match=f"has no {folder}"):
        data(voc_set).check_folders()


def test_missing_root_list_files_and_options_are_named(voc_set: Path, tmp_path: Path) -> None:
    one_line_error(re.escape(f"data root {tmp_path / 'nope'} does not exist"), tmp_path / "nope")
    with pytest.raises(DataError, match=r"no data given: pass --data\.root"):
        SegmentationData().setup()
    lists = voc_set / "ImageSets" / "Segmentation"
    (lists / "val.txt").unlink()
    one_line_error(re.escape(f"{lists} has neither val.txt nor test.txt"), voc_set)
    (lists / "train.txt").unlink()
    one_line_error(re.escape(f"list file {lists / 'train.txt'} does not exist"), voc_set)
    (lists / "train.txt").write_text("\n")
    (lists / "test.txt").write_text("train_000\n")
    one_line_error(re.escape(f"list file {lists / 'train.txt'} names no image"), voc_set)


def test_colour_and_undecodable_masks_are_named(voc_set: Path) -> None:
    mask = voc_set / "SegmentationClass" / "train_002.png"
    Image.new("RGB", (56, 40)).save(mask)
    one_line_error(re.escape(f"mask {mask} is a RGB image: masks hold one class index per pixel"), voc_set)
    mask.write_bytes(b"not a png")
    one_line_error(re.escape(f"cannot decode mask {mask}"), voc_set)


def test_undecodable_image_is_named_at_its_first_access(voc_set: Path) -> None:
    image = voc_set / "JPEGImages" / "train_003.jpg"
    image.write_bytes(image.read_bytes()[:200])  # truncated
    dataset = loaded(voc_set).train_dataset
    with pytest.raises(ImageDecodeError, match=re.escape(f"cannot decode image {image}")):
        dataset[dataset.ids.index("train_003")]


def test_skip_leaves_unreadable_images_and_masks_out_with_one_warning(voc_set: Path) -> None:
    image = voc_set / "JPEGImages" / "train_003.jpg"
    image.write_bytes(image.read_bytes()[:200])
    (voc_set / "SegmentationClass" / "val_001.png").write_bytes(b"not a png")
    with pytest.warns(SkippedImagesWarning, match="skipped 2 unreadable image file") as caught:
        dm = data(voc_set, on_bad_image="skip")
        dm.setup()
    assert len(caught) == 1
    assert "train_003" not in dm.train_dataset.ids and len(dm.train_dataset) == 7
    assert "val_001" not in dm.val_dataset.ids and len(dm.val_dataset) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(dm.train_dataloader()))


def test_dataset_items_without_a_transform(voc_set: Path) -> None:
    dataset = SegmentationDataset.from_voc(str(voc_set), "val")
    image, mask = dataset[0]
    assert image.size == (56, 40) and isinstance(mask, tv_tensors.Mask) and mask.shape == (40, 56)
    assert dataset.max_class() <= 3 and dataset.ids == ["val_000", "val_001", "val_002", "val_003"]


@pytest.mark.parametrize("class_names", [None, ["background", "object"]])
def test_binary_masks_saved_as_0_and_255_are_refused_naming_the_remap(tmp_path: Path, class_names: list | None) -> None:
    # 255 (the object) is the ignored value: the object's pixels left out of loss and metrics, and the MIoU the
    # background's alone, near 100%. With a class file the masks were accepted; without, the message sent the user
    # to --data.num_classes 2, which did the same
    root = make_voc_set(tmp_path / "voc", num_classes=2, palette=False, class_names=class_names)
    for mask in (root / "SegmentationClass").glob("*.png"):
        values = np.asarray(Image.open(mask))
        save_mask(np.where(values == 1, 255, values).astype(np.uint8), mask, palette=False)
    message = one_line_error("^the training masks under ", root)
    assert message == (
        f"the training masks under {root} hold 1 class(es) besides 255 = ignore (0): segmentation needs at least 2; "
        "255 marks pixels to ignore, so if it is your foreground (a 0/255 binary mask), remap it to 1 in the masks"
    )
    one_line_error("^the training masks under .* hold 1 class", root, num_classes=2)


def test_a_label_fraction_that_keeps_background_only_masks_is_refused(tmp_path: Path) -> None:
    # the whole train.txt holds both classes, the 1 image of 8 that label_fraction 0.125 keeps only the background:
    # the check ran on train.txt before the subset, and the run trained with nothing to segment
    from coretune.data.splits import stratified_subset

    root = make_voc_set(tmp_path / "voc", {"train": 8, "val": 2}, num_classes=2, palette=False)
    (kept,) = stratified_subset([0] * 8, 0.125, 0)
    mask = root / "SegmentationClass" / f"train_{kept:03d}.png"
    save_mask(np.where(np.asarray(Image.open(mask)) == 1, 0, np.asarray(Image.open(mask))).astype(np.uint8), mask,
              palette=False)  # fmt: skip
    assert loaded(root).num_classes == 2  # all of it: fine
    message = one_line_error("^the training masks under ", root, label_fraction=0.125, seed=0)
    assert message.startswith(
        f"the training masks under {root} (the part --data.label_fraction and --data.val_fraction keep) hold 1 "
        "class(es) besides 255 = ignore (0): segmentation needs at least 2"
    )
