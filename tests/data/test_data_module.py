"""ImageClassificationData: loaders, splits, label fractions, image modes, bad files, every error message."""

from __future__ import annotations

import inspect
import pickle
import re
import shutil
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docstring_parser
import numpy as np
import pytest
import torch
import torchvision.datasets.cifar
from jsonargparse import ArgumentParser
from PIL import Image

from coretune.data import (
    DataError,
    DomainGeneralizationData,
    ImageClassificationData,
    ImageDecodeError,
    SegmentationData,
    SkippedImagesWarning,
    eval_transform,
    train_transform,
)
from coretune.data.transforms import eval_resize_size, normalisation_problems, train_draft_size

# One constant colour per class index, so a loaded tensor tells which class folder it came from.
CLASS_COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200)]

MakeTree = Callable[..., Path]


def write_split(folder: Path, counts: dict[str, int]) -> None:
    """``counts[class]`` 32 px PNGs per class folder, coloured CLASS_COLOURS[sorted class index]."""
    for k, name in enumerate(sorted(counts)):
        (folder / name).mkdir(parents=True, exist_ok=True)
        pixels = np.full((32, 32, 3), CLASS_COLOURS[k % len(CLASS_COLOURS)], dtype=np.uint8)
        for i in range(counts[name]):
            Image.fromarray(pixels).save(folder / name / f"{name}_{i:03d}.png")


@pytest.fixture
def make_tree(tmp_path: Path) -> MakeTree:
    """``make_tree(train={...}, val={...}, test={...})`` → a data root with those splits (None: no folder)."""

    def make(
        train: dict[str, int] | None = None,
        val: dict[str, int] | None = None,
        test: dict[str, int] | None = None,
        *,
        name: str = "data",
    ) -> Path:
        root = tmp_path / name
        root.mkdir()
        for split, counts in (("train", train), ("val", val), ("test", test)):
            if counts is not None:
                write_split(root / split, counts)
        return root

    return make


@pytest.fixture
def tree(make_tree: MakeTree) -> Path:
    """3 classes × 6 training and 2 validation images, 32 px."""
    classes = ("bird", "cat", "dog")
    return make_tree(train=dict.fromkeys(classes, 6), val=dict.fromkeys(classes, 2))


IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


def module(root: Path | None, **kw: object) -> ImageClassificationData:
    options: dict[str, object] = {"image_size": 32, "batch_size": 4, **IDENTITY, **kw}
    return ImageClassificationData(root=None if root is None else str(root), **options)  # type: ignore[arg-type]


def assert_colours_match_labels(x: torch.Tensor, y: torch.Tensor) -> None:
    """Each test image is one constant colour per class: the pixels tell which folder it came from."""
    for img, label in zip(x, y, strict=True):
        colour = torch.tensor(CLASS_COLOURS[int(label)], dtype=torch.float32) / 255
        torch.testing.assert_close(img.mean(dim=(1, 2)), colour, atol=1e-3, rtol=0)


# -- loaders -------------------------------------------------------------------------------------------------
def test_loaders_give_images_of_the_right_shape_dtype_and_label(tree: Path) -> None:
    dm = module(tree)
    dm.setup("fit")
    assert dm.class_names == ["bird", "cat", "dog"] and dm.num_classes == 3
    x, y = next(iter(dm.train_dataloader()))
    assert (x.shape, x.dtype, y.dtype) == ((4, 3, 32, 32), torch.float32, torch.int64)
    assert_colours_match_labels(x, y)
    val = list(dm.val_dataloader())
    assert [b[0].shape[0] for b in val] == [4, 2]  # evaluation keeps the trailing partial batch
    labels = torch.cat([b[1] for b in val])
    assert labels.tolist() == [0, 0, 1, 1, 2, 2]  # file order
    assert_colours_match_labels(torch.cat([b[0] for b in val]), labels)
    assert dm.class_counts() == {"bird": 6, "cat": 6, "dog": 6}
    assert dm.class_counts("val") == {"bird": 2, "cat": 2, "dog": 2}


def test_images_are_normalised_with_mean_and_std(tree: Path) -> None:
    dm = module(tree, mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    x, y = next(iter(dm.val_dataloader()))
    colour = torch.tensor(CLASS_COLOURS[int(y[0])]) / 255
    torch.testing.assert_close(x[0, :, 5, 5], (colour - 0.5) / torch.tensor([0.25, 0.5, 1.0]), atol=1e-3, rtol=0)


def test_train_loader_drops_the_last_partial_batch_only_when_there_are_several(tree: Path) -> None:
    sizes = [b[0].shape[0] for b in module(tree, batch_size=4).train_dataloader()]
    assert sizes == [4, 4, 4, 4]  # 18 images: the trailing 2 are dropped
    sizes = [b[0].shape[0] for b in module(tree, batch_size=32).train_dataloader()]
    assert sizes == [18]  # one batch larger than the set: kept


def test_train_views_are_independent_augmentations_and_the_first_is_the_one_view_batch(tmp_path: Path) -> None:
    from image_trees import make_image_tree  # colour + noise: two crops of one image differ

    root = make_image_tree(tmp_path / "noise", per_class=4, val_per_class=1)

    def first_batch(views: int) -> tuple[object, torch.Tensor]:
        dm = module(root, image_size=16)
        dm.train_views = views
        return next(iter(dm.train_dataloader()))

    x, y = first_batch(1)
    (v1, v2), y2 = first_batch(2)
    assert torch.equal(y, y2) and torch.equal(v1, x)  # the query view is the one-view pipeline's image
    assert v2.shape == v1.shape and not torch.equal(v1, v2)  # the second view is another draw
    (w1, w2), _ = first_batch(2)
    assert torch.equal(w1, v1) and torch.equal(w2, v2)  # both fixed by (seed, epoch, index)


def test_eval_batch_size_defaults_to_batch_size(tree: Path) -> None:
    assert module(tree).val_dataloader().batch_size == 4
    assert module(tree, eval_batch_size=5).test_dataloader().batch_size == 5


def test_cache_images_gives_the_same_batches_and_reads_no_file_after_setup(tmp_path: Path) -> None:
    from image_trees import make_image_tree  # colour + noise PNGs of 32 px

    root = make_image_tree(tmp_path / "noise", per_class=6, val_per_class=2)
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)  # a JPEG large enough for draft-mode decoding
    Image.fromarray(big).save(root / "train" / "cat" / "big.jpg", quality=90)
    options = {"val_fraction": 0.25, "seed": 3, "hflip": True}

    def batches(dm: ImageClassificationData) -> list[torch.Tensor]:
        loaders = (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader())
        return [x for loader in loaders for x, _ in loader]

    plain = batches(module(root, **options))
    cached = module(root, cache_images=True, **options)
    cached.setup("fit")
    assert isinstance(cached.train_dataset.images, list)  # mixed sizes: one array per image
    assert isinstance(cached.test_dataset.images, np.ndarray) and cached.test_dataset.paths is None
    shutil.rmtree(root)  # every pixel is in memory
    again = batches(cached)
    assert len(plain) == len(again) and all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))


def test_the_training_items_as_evaluated_are_the_same_cached_or_not(tmp_path: Path) -> None:
    """``coretune eval``'s kNN bank and probe set read the training split through the evaluation transform; cached,
    they came from the training crops' JPEG draft decode (other pixels than the test split's reading)."""
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "noise", per_class=2, val_per_class=1)
    rng = np.random.default_rng(0)
    for path in (root / "train").rglob("*.png"):  # JPEGs large enough for draft-mode decoding
        Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(path.with_suffix(".jpg"))
        path.unlink()
    options = {"image_size": 16, "crop_scale": (0.08, 1.0)}  # drafts: 1/4 scale for training crops, 1/8 eval
    plain, cached = module(root, **options).train_as_evaluated(), module(root, cache_images=True, **options)
    bank = cached.train_as_evaluated()
    assert bank.paths is None and len(bank) == len(plain) == 6
    assert all(torch.equal(plain[i][0], bank[i][0]) and plain[i][1] == bank[i][1] for i in range(6))
    assert cached.train_dataset.paths is not None  # set up for testing: no training-draft decode beside it
    # what the bank read before: the cached training split (training draft) through the evaluation transform
    fitted = module(root, cache_images=True, **options)
    fitted.setup("fit")
    before = fitted.train_dataset.with_transform(fitted.eval_transform, fitted.eval_draft)
    assert before.paths is None and not all(torch.equal(plain[i][0], before[i][0]) for i in range(6))


def test_cache_images_decodes_a_folder_that_is_both_validation_and_test_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coretune.data.datasets import LabeledImageDataset
    from image_trees import make_image_tree

    root = make_image_tree(tmp_path / "noise", per_class=6, val_per_class=2)  # train/ and val/, no test/
    decoded: list[int] = []
    decode = LabeledImageDataset.decoded

    def counted(self: LabeledImageDataset, *args: Any) -> LabeledImageDataset:
        decoded.append(len(self))
        return decode(self, *args)

    monkeypatch.setattr(LabeledImageDataset, "decoded", counted)
    dm = module(root, cache_images=True)
    dm.setup("fit")
    assert dm.validates_on_test and dm.test_dataset is dm.val_dataset
    assert decoded == [len(dm.train_dataset), len(dm.val_dataset)]  # the validation folder once, not twice
    assert [y for _, y in dm.test_dataloader()] and isinstance(dm.test_dataset.images, np.ndarray)


def test_train_shuffle_is_reproducible_for_a_seed(tree: Path) -> None:
    def order(seed: int) -> list[list[int]]:
        return list(module(tree, seed=seed).train_dataloader().batch_sampler)

    assert order(0) == order(0)
    assert order(0) != order(1)
    flat = [i for batch in order(0) for i in batch]
    assert flat != sorted(flat) and len(set(flat)) == 16  # shuffled, not file order; no repeats


def test_class_names_are_the_sorted_folder_names(make_tree: MakeTree) -> None:
    names = {"b": 1, "A": 1, "c10": 1, "c2": 1}
    root = make_tree(train=names, val=names)
    (root / "train" / ".ipynb_checkpoints").mkdir()  # hidden folders are not classes
    assert module(root).class_names == ["A", "b", "c10", "c2"]  # read before setup: runs it


def test_images_of_any_mode_load_as_three_channels(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 1}, val={"a": 0})
    val = root / "val" / "a"
    Image.fromarray(np.full((32, 32), 65535, dtype=np.uint16)).save(val / "white16.png")
    Image.fromarray(np.full((40, 24), 257 * 51, dtype=np.uint16)).save(val / "grey16.png")
    Image.new("L", (16, 16), 255).save(val / "l.png")
    Image.new("RGBA", (32, 32), (255, 255, 255, 0)).save(val / "rgba.png")
    Image.new("P", (32, 32), 0).save(val / "p.png")
    x, _ = next(iter(module(root, eval_batch_size=8).val_dataloader()))
    assert x.shape == (5, 3, 32, 32)
    by_name = dict(zip(["grey16", "l", "p", "rgba", "white16"], x, strict=True))
    torch.testing.assert_close(by_name["white16"], torch.ones(3, 32, 32))  # 65535 → 1.0, not clipped
    torch.testing.assert_close(by_name["grey16"], torch.full((3, 32, 32), 51 / 255))
    torch.testing.assert_close(by_name["l"], torch.ones(3, 32, 32))  # 16 px upsampled to 32
    torch.testing.assert_close(by_name["rgba"], torch.ones(3, 32, 32))


def test_predict_loader_lists_files_with_indices(tree: Path) -> None:
    loader = module(tree).predict_loader(str(tree / "val"))
    x, idx = next(iter(loader))
    assert x.shape == (4, 3, 32, 32) and idx.tolist() == [0, 1, 2, 3]
    assert [Path(p).parent.name for p in loader.dataset.paths] == ["bird", "bird", "cat", "cat", "dog", "dog"]


# -- which folder feeds which loader -------------------------------------------------------------------------
def test_val_and_test_folders(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 3, "b": 3}, val={"a": 1, "b": 1}, test={"a": 2, "b": 2})
    dm = module(root)
    dm.setup()
    assert (len(dm.val_dataset), len(dm.test_dataset)) == (2, 4)
    assert not dm.validates_on_test


def test_a_single_held_out_folder_serves_validation_and_test(make_tree: MakeTree) -> None:
    dm = module(make_tree(train={"a": 3}, test={"a": 2}))
    dm.setup()
    assert dm.val_dataset.paths == dm.test_dataset.paths and len(dm.val_dataset) == 2
    assert dm.validates_on_test  # a checkpoint chosen on val/top1 is chosen on the test images


def test_explicit_split_folders_override_root(make_tree: MakeTree, tmp_path: Path) -> None:
    root = make_tree(train={"a": 3, "b": 3}, val={"a": 1, "b": 1})
    write_split(tmp_path / "other_val", {"a": 2, "b": 2})
    dm = module(root, val_dir=str(tmp_path / "other_val"))
    dm.setup()
    assert len(dm.val_dataset) == 4
    dm = module(None, train_dir=str(root / "train"), test_dir=str(root / "val"))
    dm.setup()
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (6, 2, 2)
    assert dm.validates_on_test
    same = module(root, val_dir=str(tmp_path / "other_val"), test_dir=str(tmp_path / "other_val" / ".." / "other_val"))
    same.setup()
    assert same.validates_on_test and same.val_dataset.paths == same.test_dataset.paths
    apart = module(root, test_dir=str(tmp_path / "other_val"))
    apart.setup()
    assert not apart.validates_on_test


# -- label fraction and validation carve-out -----------------------------------------------------------------
def test_label_fraction_keeps_exact_stratified_counts(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 10, "b": 20, "c": 3}, val={"a": 1, "b": 1, "c": 1})
    dm = module(root, label_fraction=0.5)
    dm.setup()
    assert dm.class_counts() == {"a": 5, "b": 10, "c": 2}  # 1.5 rounds half up to 2
    assert dm.class_counts("val") == {"a": 1, "b": 1, "c": 1}  # only training labels are subsampled

    def paths(seed: int) -> list[str]:
        other = module(root, label_fraction=0.5, seed=seed)
        other.setup()
        return other.train_dataset.paths

    assert paths(0) == dm.train_dataset.paths
    assert paths(1) != dm.train_dataset.paths


def test_label_fraction_that_empties_a_class_is_an_error(make_tree: MakeTree) -> None:
    root = make_tree(train={"x": 12, "y": 200}, val={"x": 1, "y": 1})
    msg = r"^label_fraction 0.01 keeps no image of class 'x' \(12 images\): raise it to ≥ 0.0417$"
    with pytest.raises(DataError, match=msg):
        module(root, label_fraction=0.01).setup()


def test_val_fraction_carves_a_disjoint_stratified_validation_split(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 10, "b": 20}, val={"a": 1, "b": 1}, test={"a": 3, "b": 3})
    dm = module(root, val_fraction=0.2)
    dm.setup()
    assert dm.class_counts("val") == {"a": 2, "b": 4}
    assert dm.class_counts("train") == {"a": 8, "b": 16}
    assert not set(dm.train_dataset.paths) & set(dm.val_dataset.paths)
    assert all("/train/" in p for p in dm.val_dataset.paths)
    assert len(dm.test_dataset) == 6  # the test/ folder; selection never sees it
    assert not dm.validates_on_test
    assert dm.val_dataset.transform is dm.eval_transform and dm.train_dataset.transform is dm.train_transform
    # with only val/, the val folder becomes the test split
    only_val = module(make_tree(train={"a": 10}, val={"a": 4}, name="v"), val_fraction=0.2)
    only_val.setup()
    assert len(only_val.test_dataset) == 4 and len(only_val.val_dataset) == 2


def test_val_fraction_is_drawn_from_the_label_fraction_subset(make_tree: MakeTree) -> None:
    dm = module(make_tree(train={"a": 20, "b": 20}, val={"a": 1, "b": 1}), label_fraction=0.5, val_fraction=0.2)
    dm.setup()
    assert dm.class_counts("train") == {"a": 8, "b": 8} and dm.class_counts("val") == {"a": 2, "b": 2}


def test_val_fraction_allows_a_root_with_train_only_but_then_there_is_no_test(make_tree: MakeTree) -> None:
    dm = module(make_tree(train={"a": 5, "b": 5}), val_fraction=0.2)
    assert len(dm.val_dataloader().dataset) == 2
    with pytest.raises(DataError, match=r"^no test split: .* add one or pass --data.test_dir$"):
        dm.test_dataloader()


# -- bad image files -----------------------------------------------------------------------------------------
def break_file(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:40])  # truncated PNG
    return path


@pytest.mark.parametrize("num_workers", [0, 1])
def test_corrupt_file_error_names_the_file(tree: Path, num_workers: int) -> None:
    bad = break_file(tree / "val" / "cat" / "cat_001.png")
    dm = module(tree, num_workers=num_workers)
    dm.setup()  # error mode does not scan: the first read raises
    with pytest.raises(ImageDecodeError, match=rf"cannot decode image {re.escape(str(bad))}: .*"
                       r"fix or remove it, or pass --data.on_bad_image skip"):  # fmt: skip
        list(dm.val_dataloader())


def test_skip_mode_drops_bad_files_with_one_warning(tree: Path) -> None:
    bad = [break_file(tree / "train" / "bird" / "bird_000.png"), tree / "val" / "dog" / "dog_000.png"]
    bad[1].write_bytes(b"not a png")
    dm = module(tree, on_bad_image="skip")
    with pytest.warns(SkippedImagesWarning) as record:
        dm.setup()
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith("skipped 2 unreadable image file(s) of 24 (on_bad_image='skip'): ")
    assert str(bad[0]) in message and str(bad[1]) in message
    assert dm.class_counts() == {"bird": 5, "cat": 6, "dog": 6}
    assert dm.class_counts("val") == {"bird": 2, "cat": 2, "dog": 1}
    assert sum(len(b[1]) for b in dm.val_dataloader()) == 5


def test_skip_mode_warns_on_the_first_process_only(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import coretune.data.images as images

    break_file(tree / "train" / "bird" / "bird_000.png")
    monkeypatch.setattr(images, "rank", lambda: 1)  # another DDP process reads the same files
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm = module(tree, on_bad_image="skip")
        dm.setup()
    assert dm.class_counts()["bird"] == 5  # the file is still left out


def test_skip_mode_warning_lists_only_the_first_files(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 9}, val={"a": 1})
    for i in range(7):
        break_file(root / "train" / "a" / f"a_{i:03d}.png")
    with pytest.warns(SkippedImagesWarning, match=r"^skipped 7 .* … and 2 more$"):
        module(root, on_bad_image="skip").setup()


def test_skip_mode_that_empties_a_class_is_an_error(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 2, "b": 1}, val={"a": 1, "b": 1})
    break_file(root / "train" / "b" / "b_000.png")
    msg = r"class folder\(s\) \['b'\] in .* contain no readable \(skipped 1 unreadable, e.g. .*b_000.png\)"
    with pytest.raises(DataError, match=msg):
        module(root, on_bad_image="skip").setup()


# -- errors a user can cause ---------------------------------------------------------------------------------
def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"^no training data given: pass --data.root .* or --data.train_dir$"):
        module(None).setup()
    with pytest.raises(DataError, match=r"^data root .*nowhere does not exist: pass an existing folder$"):
        module(tmp_path / "nowhere").setup()


def test_root_without_train_folder(make_tree: MakeTree) -> None:
    root = make_tree(val={"a": 1})
    with pytest.raises(DataError, match=rf"^data root {re.escape(str(root))} has no train/ folder: expected"):
        module(root).setup()


def test_root_with_neither_val_nor_test(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 2})
    with pytest.raises(DataError, match=r"has neither val/ nor test/: add one .* or pass --data.val_dir or --data"):
        module(root).setup()
    assert not module(root, val_fraction=0.5).has_test_split()  # validation only: a fit refuses it (CLI test)
    (root / "test" / "a").mkdir(parents=True)
    assert module(root, val_fraction=0.5).has_test_split()  # reads no image


def test_explicit_folder_that_does_not_exist(tree: Path) -> None:
    with pytest.raises(DataError, match=r"^val_dir .*typo does not exist: pass an existing folder$"):
        module(tree, val_dir=str(tree / "typo")).setup()


def test_empty_class_folder(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 2, "b": 0, "c": 0}, val={"a": 1, "b": 1, "c": 1})
    msg = r"^class folder\(s\) \['b', 'c'\] in .*train contain no image files \(\.jpg, .*\): "
    with pytest.raises(DataError, match=msg + r"add images or remove the folder\(s\)$"):
        module(root).setup()


def test_split_with_no_images_at_all(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 2, "b": 2}, val={"a": 0, "b": 0})
    with pytest.raises(DataError, match=r"val contains no image files .* in its class folders \['a', 'b'\]"):
        module(root).setup()


def test_images_without_class_folders(make_tree: MakeTree) -> None:
    root = make_tree(val={"a": 1})
    (root / "train").mkdir()
    Image.new("RGB", (8, 8)).save(root / "train" / "loose.png")
    with pytest.raises(DataError, match=r"train has no class sub-folders: expected the ImageFolder layout"):
        module(root).setup()


def test_class_names_differ_between_train_and_val(make_tree: MakeTree) -> None:
    root = make_tree(train={"a": 1, "b": 1, "c": 1}, val={"a": 1, "b": 1, "d": 1})
    msg = r"class folders of val \(.*\) differ from train \(.*\): missing from val: \['c'\]; only in val: "
    msg += r"\['d'\] — both need the same class sub-folders"
    with pytest.raises(DataError, match=msg):
        module(root).setup()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("image_size", 0, r"image_size must be >= 1 pixel, got 0"),
        ("batch_size", 0, r"batch_size must be >= 1, got 0"),
        ("eval_batch_size", 0, r"eval_batch_size must be >= 1 \(or unset to use batch_size\), got 0"),
        ("label_fraction", 0.0, r"label_fraction must be in \(0, 1\] \(1 uses every label\), got 0.0"),
        ("label_fraction", 1.5, r"label_fraction must be in \(0, 1\]"),
        ("val_fraction", 1.0, r"val_fraction must be in \[0, 1\) .*, got 1.0"),
        ("val_fraction", -0.1, r"val_fraction must be in \[0, 1\)"),
        ("num_workers", -1, r"num_workers must be >= 0 or auto, got -1"),
        ("rotation", -5.0, r"rotation must be in \[0, 180\] degrees"),
        ("crop_scale", (0.6, 0.5), r"crop_scale must be \(low, high\) with 0 < low <= high <= 1, got \(0.6, 0.5\)"),
        ("crop_scale", (0.0, 1.0), r"crop_scale must be"),
        ("std", (1.0, 0.0, 1.0), r"std values must be > 0"),
        ("dataset", "imagenet", r"dataset must be one of \['imagefolder', 'cifar10', 'cifar100'\]"),
        ("on_bad_image", "ignore", r"on_bad_image must be 'error' or 'skip', got 'ignore'"),
    ],
)
def test_bad_option_values(option: str, value: object, message: str) -> None:
    with pytest.raises(DataError, match=rf"^invalid data option\(s\): {message}.* — set valid values"):
        ImageClassificationData(**{option: value})  # type: ignore[arg-type]


def test_normalisation_values_must_be_fractions_of_the_pixel_range() -> None:
    """A mean outside [0, 1] or a std outside (0, 1] (mmpretrain's 0-255 values train at chance) is refused by every
    task's data module, with the fix."""
    assert normalisation_problems((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) == []
    assert normalisation_problems((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)) == []  # no normalisation
    for mean, std in [((0.5, 0.5, 1.5), (0.2, 0.2, 0.2)), ((-0.1, 0.5, 0.5), (0.2, 0.2, 0.2)),
                      ((0.5, 0.5, 0.5), (0.2, 0.2, 2.0)), ((0.5, float("nan"), 0.5), (0.2, 0.2, 0.2))]:  # fmt: skip
        problems = normalisation_problems(mean, std)
        assert [p.startswith("mean must be in [0, 1] and std in (0, 1] (fractions of") for p in problems] == [True]
    expected = (
        "invalid data option(s): mean must be in [0, 1] and std in (0, 1] (fractions of the [0, 1] pixel range: "
        "divide values on the 0-255 scale by 255, e.g. 123.675 → 0.485), got (123.675, 116.28, 103.53) and "
        "(58.395, 57.12, 57.375) — set valid values (--data.<option>)"
    )
    for data in (ImageClassificationData, SegmentationData, DomainGeneralizationData):
        with pytest.raises(DataError) as refused:
            data(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
        assert str(refused.value) == expected


def test_all_bad_options_are_reported_at_once() -> None:
    with pytest.raises(DataError, match=r"image_size must be >= 1 pixel, got -3; batch_size must be >= 1, got 0"):
        ImageClassificationData(image_size=-3, batch_size=0)


def test_check_folders_refuses_what_setup_refuses_without_reading_images(make_tree: MakeTree, tmp_path: Path) -> None:
    """``check_folders`` (bench's and tune's up-front check) raises setup's own message for every missing folder, and
    reads no image: a corrupt file or a CIFAR folder without its files is left to setup."""
    root = make_tree(train={"a": 2}, val={"a": 1})
    bad = [
        module(None),
        module(tmp_path / "nowhere"),
        module(make_tree(val={"a": 1}, name="no_train")),
        module(make_tree(train={"a": 2}, name="no_val_nor_test")),
        module(root, val_dir=str(root / "typo")),
        module(None, dataset="cifar10"),
        module(root, dataset="cifar10", train_dir=str(root)),
    ]
    for dm in bad:
        with pytest.raises(DataError) as from_setup:
            dm.setup()
        with pytest.raises(DataError, match=f"^{re.escape(str(from_setup.value))}$"):
            dm.check_folders()
    with pytest.raises(DataError, match=r"^cifar10 data not found under .*cifar-10-batches-py/ holding data_batch_1"):
        module(tmp_path, dataset="cifar10").check_folders()
    (tmp_path / "cifar-10-batches-py").mkdir()
    module(tmp_path, dataset="cifar10").check_folders()
    break_file(root / "train" / "a" / "a_000.png")
    module(root).check_folders()


# -- CIFAR ---------------------------------------------------------------------------------------------------
def test_cifar_root_missing_files_says_where_to_put_them(tmp_path: Path) -> None:
    msg = (
        rf"^cifar10 data not found or corrupted under {re.escape(str(tmp_path))}: expected "
        rf"{re.escape(str(tmp_path / 'cifar-10-batches-py'))}/ holding "
        r"data_batch_1 … data_batch_5, test_batch, "
        r"batches.meta — extract .*cifar-10-python.tar.gz into .* \(coretune never downloads\)"
    )
    with pytest.raises(DataError, match=msg):
        module(tmp_path, dataset="cifar10").setup()
    with pytest.raises(DataError, match=r"cifar100 data not found .*cifar-100-python/ holding train, test, meta"):
        module(tmp_path, dataset="cifar100").setup()


def test_cifar_needs_root_and_no_split_folders(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"^dataset=cifar10 needs --data.root"):
        module(None, dataset="cifar10").setup()
    with pytest.raises(DataError, match=r"train_dir/val_dir/test_dir apply to dataset=imagefolder only"):
        module(tmp_path, dataset="cifar10", train_dir=str(tmp_path)).setup()


def test_cifar_python_files_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A miniature CIFAR-10 in torchvision's file format (checksums bypassed: the real files are 170 MB)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = list(range(10))
        data = rng.integers(0, 256, (10, 3 * 32 * 32), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels}, f)
    names = ["plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names}, f)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kw: True)
    dm = module(tmp_path, dataset="cifar10", label_fraction=0.4, batch_size=8)
    assert dm.class_names == names
    assert dm.class_counts() == dict.fromkeys(names, 2)  # 5 per class · 0.4
    assert len(dm.val_dataset) == len(dm.test_dataset) == 10  # CIFAR's test set
    assert dm.validates_on_test
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and y.dtype == torch.int64


# -- transforms ----------------------------------------------------------------------------------------------
def test_eval_transform_resizes_by_256_over_224_then_centre_crops() -> None:
    assert (eval_resize_size(224), eval_resize_size(64), eval_resize_size(32)) == (256, 73, 37)
    ramp = np.tile(np.arange(100, dtype=np.uint8), (50, 1))  # 100x50, brightness = column
    x = eval_transform(32, **IDENTITY)(Image.fromarray(ramp).convert("RGB"))
    assert x.shape == (3, 32, 32)
    assert abs(float(x[0].mean()) * 255 - 49.5) < 1.5  # centred


def test_train_transform_upsamples_small_images_and_flips() -> None:
    half = np.zeros((16, 16, 3), dtype=np.uint8)
    half[:, 8:] = 255  # right half white
    tf = train_transform(48, **IDENTITY)
    torch.manual_seed(0)
    outs = [tf(Image.fromarray(half)) for _ in range(40)]
    assert all(o.shape == (3, 48, 48) for o in outs)
    left_bright = [bool(o[0, :, :8].mean() > o[0, :, -8:].mean()) for o in outs]
    assert 0 < sum(left_bright) < 40  # some flipped, some not


def test_crop_scale_and_hflip_options() -> None:
    half = np.zeros((16, 16, 3), dtype=np.uint8)
    half[:, 8:] = 255  # right half white
    torch.manual_seed(0)
    no_flip = train_transform(16, **IDENTITY, crop_scale=(1.0, 1.0), hflip=False)
    outs = [no_flip(Image.fromarray(half)) for _ in range(20)]
    # the full-area crop keeps the whole image (up to the aspect-ratio jitter), and nothing is ever mirrored
    assert all(bool(o[0, :, :4].mean() < o[0, :, -4:].mean()) for o in outs)
    assert train_draft_size(64, (0.5, 1.0)) < train_draft_size(64)  # less zoom, smaller decode


def test_rotation_fills_uncovered_corners_with_the_mean_colour() -> None:
    mean, std = (0.2, 0.4, 0.6), (0.5, 0.5, 0.5)
    torch.manual_seed(0)
    x = train_transform(32, mean, std, rotation=45)(Image.new("RGB", (32, 32), (255, 255, 255)))
    fill = (torch.tensor([round(255 * m) for m in mean]) / 255 - torch.tensor(mean)) / torch.tensor(std)
    torch.testing.assert_close(x[:, 0, 0], fill)  # ≈ 0: the mean colour normalises to zero
    torch.testing.assert_close(x[:, 16, 16], (1 - torch.tensor(mean)) / torch.tensor(std))


# -- command-line surface ------------------------------------------------------------------------------------
def test_every_option_has_a_type_default_and_help_line() -> None:
    params = list(inspect.signature(ImageClassificationData.__init__).parameters.values())[1:]
    documented = {p.arg_name: p.description for p in docstring_parser.parse(ImageClassificationData.__doc__).params}
    for p in params:
        assert p.annotation is not inspect.Parameter.empty, p.name
        assert p.default is not inspect.Parameter.empty, p.name
        assert documented.get(p.name), f"{p.name} has no line in the docstring's Args section"
    assert set(documented) == {p.name for p in params}


def test_options_parse_from_the_command_line(tree: Path) -> None:
    parser = ArgumentParser()
    parser.add_class_arguments(ImageClassificationData, "data")
    cfg = parser.parse_args(
        ["--data.root", str(tree), "--data.image_size", "32", "--data.mean", "[0.5, 0.5, 0.5]",
         "--data.on_bad_image", "skip"]
    )  # fmt: skip
    dm = parser.instantiate(cfg).data
    assert isinstance(dm, ImageClassificationData)
    assert (dm.image_size, dm.mean, dm.on_bad_image) == (32, (0.5, 0.5, 0.5), "skip")
    assert dm.hparams["image_size"] == 32  # saved in Lightning checkpoints
    with pytest.raises(SystemExit):
        parser.parse_args(["--data.dataset", "imagenet"])


def test_setup_runs_once(tree: Path) -> None:
    dm = module(tree)
    dm.setup("fit")
    first = dm.train_dataset
    dm.setup("test")
    assert dm.train_dataset is first
    assert Counter(dm.train_dataset.targets) == {0: 6, 1: 6, 2: 6}
