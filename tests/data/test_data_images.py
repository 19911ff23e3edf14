"""Image reading: every pixel mode to 8-bit RGB, corrupt files, listing, bad-file scan, unlabelled sets."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coretune.data import (
    DataError,
    ImageDecodeError,
    ImageFileDataset,
    SkippedImagesWarning,
    eval_transform,
    find_bad_images,
    list_image_files,
    load_rgb,
    to_rgb,
)

IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


def truncated_jpeg(path: Path) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path, quality=90)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    grey = np.array([[0, 257 * 100, 65535, 1000]], dtype=np.uint16)
    Image.fromarray(grey).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    img = load_rgb(str(tmp_path / "g16.png"))
    assert img.mode == "RGB"
    # 1000 / 257 = 3.89 → 4; PIL's own convert would give 255 for every value above 255
    np.testing.assert_array_equal(np.asarray(img)[0], [[0] * 3, [100] * 3, [255] * 3, [4] * 3])


def test_sixteen_bit_white_is_one_before_normalisation(tmp_path: Path) -> None:
    Image.fromarray(np.full((32, 32), 65535, dtype=np.uint16)).save(tmp_path / "white16.png")
    x = eval_transform(32, **IDENTITY)(load_rgb(str(tmp_path / "white16.png")))
    assert x.shape == (3, 32, 32)
    torch.testing.assert_close(x, torch.ones(3, 32, 32))


@pytest.mark.parametrize(
    ("mode", "pixel", "rgb"),
    [
        ("L", 77, (77, 77, 77)),
        ("1", 1, (255, 255, 255)),
        ("LA", (90, 10), (90, 90, 90)),
        ("RGBA", (10, 20, 30, 0), (10, 20, 30)),  # alpha dropped, as torchvision's loader does
        ("CMYK", (0, 0, 0, 0), (255, 255, 255)),
    ],
)
def test_modes_load_as_three_channel_rgb(tmp_path: Path, mode: str, pixel: object, rgb: tuple[int, ...]) -> None:
    ext = "jpg" if mode == "CMYK" else "png"
    Image.new(mode, (8, 8), pixel).save(tmp_path / f"x.{ext}")
    img = load_rgb(str(tmp_path / f"x.{ext}"))
    assert img.mode == "RGB" and img.size == (8, 8)
    np.testing.assert_allclose(np.asarray(img)[4, 4], rgb, atol=2)


def test_palette_images_with_and_without_transparency(tmp_path: Path) -> None:
    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 250, 120, 5] + [0] * 762)
    pal.save(tmp_path / "p.png")
    pal.save(tmp_path / "pt.png", transparency=0)
    for name in ("p.png", "pt.png"):
        np.testing.assert_array_equal(np.asarray(load_rgb(str(tmp_path / name)))[0, 0], [250, 120, 5])


def test_float_images_are_taken_in_unit_range() -> None:
    img = to_rgb(Image.fromarray(np.array([[0.0, 0.5, 1.0, 2.0]], dtype=np.float32)))
    np.testing.assert_array_equal(np.asarray(img)[0, :, 0], [0, 128, 255, 255])


def test_corrupt_files_raise_one_error_naming_the_file(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"definitely not an image")
    for path in (garbage, truncated_jpeg(tmp_path / "cut.jpg")):
        expected = (
            rf"^cannot decode image {re.escape(str(path))}: .+; "
            r"fix or remove it, or pass --data.on_bad_image skip$"
        )
        with pytest.raises(ImageDecodeError, match=expected) as info:
            load_rgb(str(path))
        assert info.value.path == str(path)


def test_missing_file_is_a_decode_error(tmp_path: Path) -> None:
    with pytest.raises(ImageDecodeError, match=r"cannot decode image .*nope\.png"):
        load_rgb(str(tmp_path / "nope.png"))


def test_draft_mode_decodes_large_jpegs_at_reduced_scale_but_not_below_the_request(tmp_path: Path) -> None:
    Image.new("RGB", (800, 600), (10, 200, 10)).save(tmp_path / "big.jpg")
    assert load_rgb(str(tmp_path / "big.jpg")).size == (800, 600)
    assert load_rgb(str(tmp_path / "big.jpg"), draft_size=140).size == (200, 150)  # 1/4: both sides >= 140
    assert load_rgb(str(tmp_path / "big.jpg"), draft_size=160).size == (400, 300)  # 1/8 would give 75 < 160


def test_find_bad_images_catches_truncated_jpegs_that_verify_misses(tmp_path: Path) -> None:
    good = tmp_path / "good.png"
    Image.new("RGB", (8, 8)).save(good)
    cut = truncated_jpeg(tmp_path / "cut.jpg")
    with Image.open(cut) as img:
        img.verify()  # PIL's cheap check passes …
    bad = find_bad_images([str(good), str(cut)], num_threads=2)  # … the decode scan does not
    assert [p for p, _ in bad] == [str(cut)]
    assert "truncated" in bad[0][1]


def test_list_image_files_is_recursive_sorted_and_skips_hidden_and_other_files(tmp_path: Path) -> None:
    for rel in ("b/2.PNG", "a/1.jpg", "a/deep/3.webp", ".hidden/4.jpg", "a/._5.jpg", "a/notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    found = [Path(p).relative_to(tmp_path).as_posix() for p in list_image_files(str(tmp_path))]
    assert found == ["a/1.jpg", "a/deep/3.webp", "b/2.PNG"]


def test_list_image_files_follows_each_linked_folder_once_and_refuses_loops(tmp_path: Path) -> None:
    for rel in ("data/a/1.png", "data/a/sub/2.png", "shared/3.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    data = tmp_path / "data"
    (data / "a" / "x").symlink_to(tmp_path / "shared")  # a linked folder outside the tree is read …
    (data / "a" / "y").symlink_to(tmp_path / "shared")  # … once, however many links lead to it
    (data / "a" / "gone.png").symlink_to(tmp_path / "nowhere.png")  # kept: reading it names the missing file
    os.mkfifo(data / "a" / "pipe.png")  # left out: opening a pipe blocks until something writes to it
    found = [Path(p).relative_to(data).as_posix() for p in list_image_files(str(data / "a"))]
    assert found == ["a/1.png", "a/gone.png", "a/sub/2.png", "a/x/3.png"]
    (data / "a" / "sub" / "up").symlink_to("../..")  # points to data/, which contains it
    with pytest.raises(DataError) as info:
        list_image_files(str(data / "a"))
    assert str(info.value) == (
        f"symbolic link loop: {data / 'a' / 'sub' / 'up'} points to {data.resolve()}, which contains it, so its "
        "images would be read again and again: remove the link, or point it at a folder that does not contain it"
    )


def test_image_file_dataset_returns_tensors_indices_and_paths(tmp_path: Path) -> None:
    for i, size in enumerate([(20, 30), (64, 48)]):
        (tmp_path / "sub").mkdir(exist_ok=True)
        Image.new("L", size, 10 * i).save(tmp_path / "sub" / f"{i}.png")
    ds = ImageFileDataset(str(tmp_path))
    assert [Path(p).name for p in ds.paths] == ["0.png", "1.png"]
    x, i = ds[1]
    assert (x.shape, x.dtype, i) == ((3, 224, 224), torch.float32, 1)
    custom = ImageFileDataset(str(tmp_path), eval_transform(16, **IDENTITY))
    assert custom[0][0].shape == (3, 16, 16)


def test_image_file_dataset_skip_mode_warns_once_with_count(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "bad1.jpg").write_bytes(b"x")
    (tmp_path / "bad2.png").write_bytes(b"y")
    with pytest.warns(SkippedImagesWarning, match=r"^skipped 2 unreadable image file\(s\) of 3") as record:
        ds = ImageFileDataset(str(tmp_path), on_bad_image="skip")
    assert len(record) == 1 and "bad1.jpg" in str(record[0].message)
    assert [Path(p).name for p in ds.paths] == ["ok.png"]


def test_image_file_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"image folder .*missing does not exist: pass an existing folder"):
        ImageFileDataset(str(tmp_path / "missing"))
    (tmp_path / "readme.txt").write_text("no images")
    with pytest.raises(DataError, match=r"contains no image files \(\.jpg, .*\): point it at a folder of images"):
        ImageFileDataset(str(tmp_path))


@pytest.mark.parametrize("draft_size", [None, 8])
def test_a_photo_stored_sideways_loads_as_its_exif_orientation_shows_it(tmp_path: Path, draft_size: int | None) -> None:
    # a phone camera stores a portrait photo as landscape pixels with EXIF orientation 6 (turn 90° clockwise to
    # show): it was fed to the model on its side, not as its owner saw and labelled it
    pixels = np.zeros((16, 32, 3), np.uint8)
    pixels[:, :16] = 255  # stored: white left half; shown: white top half
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(tmp_path / "sideways.jpg", exif=exif, quality=95)
    img = np.asarray(load_rgb(str(tmp_path / "sideways.jpg"), draft_size))  # draft mode: at half the size
    height, width, _ = img.shape
    assert height == 2 * width == (32 if draft_size is None else 16)
    assert img[: height // 3].mean() > 240 and img[-height // 3 :].mean() < 15  # white above, black below
    stored = np.asarray(load_rgb(str(tmp_path / "sideways.jpg"), draft_size, orient=False))  # segmentation's
    assert stored.shape[:2] == (height // 2, width * 2)
    Image.fromarray(pixels).save(tmp_path / "plain.jpg", quality=95)  # no orientation: as stored
    assert np.asarray(load_rgb(str(tmp_path / "plain.jpg"), draft_size)).shape[:2] == (height // 2, width * 2)
