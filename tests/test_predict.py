"""``coretune predict``'s batching of segmentation images: one forward pass per group of images of one size."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from coretune.predict import same_size_batches


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
