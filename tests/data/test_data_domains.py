"""Domain generalization data: DomainBed's layout, leave-one-domain-out splits, balanced per-domain batches with
domain labels, and the one-line errors of bad layouts."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from coretune.data import samplers as samplers_module
from coretune.data.domains import DomainGeneralizationData, read_domains, split_domains
from coretune.data.errors import DataError
from coretune.data.samplers import BalancedDomainSampler, item_seed
from domain_trees import SHAPES, STYLES, make_domain_tree

IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """4 domains × 3 shapes × 5 images of 24 px."""
    return make_domain_tree(tmp_path / "dg")


def module(root: Path, test_domains: str | list[str] = "photo", **kw: object) -> DomainGeneralizationData:
    options: dict[str, object] = {"image_size": 16, "batch_size": 6, "steps_per_epoch": 4, **IDENTITY, **kw}
    return DomainGeneralizationData(root=str(root), test_domains=test_domains, **options)  # type: ignore[arg-type]


def files_under(root: Path, domain: str) -> set[str]:
    return {str(p) for p in (root / domain).rglob("*.png")}


def test_the_layout_is_read_as_domains_of_the_same_classes(tree: Path) -> None:
    domains = read_domains(str(tree))
    assert list(domains) == sorted(STYLES)
    for name, ds in domains.items():
        assert ds.classes == sorted(SHAPES)
        assert Counter(ds.targets) == {0: 5, 1: 5, 2: 5}
        assert set(ds.paths or []) == files_under(tree, name)
    data = module(tree)
    assert data.class_names == sorted(SHAPES) and data.num_classes == 3
    assert data.domain_names == sorted(STYLES)


def test_the_held_out_domain_never_reaches_training_or_training_domain_validation(tree: Path) -> None:
    data = module(tree, "photo")
    data.setup()
    assert data.train_dataset is not None and data.val_dataset is not None and data.test_dataset is not None
    photo = files_under(tree, "photo")
    train, val = set(data.train_dataset.paths), set(data.val_dataset.paths)
    assert not train & photo and not val & photo
    assert not train & val
    others = set().union(*(files_under(tree, d) for d in ("art", "cartoon", "sketch")))
    assert train | val == others  # every training-domain image trains or validates
    # the test split: photo's 80% (reported) and 20% (the oracle's), then the training domains' held-out parts
    assert [g.key for g in data.test_groups] == ["photo", "photo/out", "art/out", "cartoon/out", "sketch/out"]
    groups = data.test_dataset.groups
    test_files = data.test_dataset.paths
    photo_in = {p for p, g in zip(test_files, groups, strict=True) if g == 0}
    photo_out = {p for p, g in zip(test_files, groups, strict=True) if g == 1}
    assert photo_in | photo_out == photo and not photo_in & photo_out
    assert len(photo_out) == 3  # round(0.2 · 5) = 1 per class
    held = {p for p, g in zip(test_files, groups, strict=True) if g >= 2}
    assert held == val
    assert data.split is not None and set(data.split.files("photo", "in")) == photo_in


def test_every_domain_holds_out_a_seeded_stratified_fifth_whatever_the_test_domain(tmp_path: Path) -> None:
    tree = make_domain_tree(tmp_path / "dg", per_class=10)
    photo_out = module(tree, "photo")
    sketch_out = module(tree, "sketch")
    for data in (photo_out, sketch_out):
        data.setup()
    assert photo_out.split is not None and sketch_out.split is not None
    for domain in ("art", "cartoon"):  # a training domain in both splits: the same held-out images
        assert photo_out.split.files(domain, "out") == sketch_out.split.files(domain, "out")
        held = photo_out.split.parts[domain]["out"]
        assert Counter(photo_out.split.domains[domain].targets[i] for i in held) == {0: 2, 1: 2, 2: 2}
    # the held-out parts of photo (tested) and of photo (trained on) are the same images too
    assert photo_out.split.files("photo", "out") == sketch_out.split.files("photo", "out")
    again, other = module(tree, "photo"), module(tree, "photo", seed=1)
    again.setup()
    other.setup()
    assert again.split is not None and other.split is not None
    assert again.split.parts == photo_out.split.parts
    assert other.split.parts["art"]["out"] != photo_out.split.parts["art"]["out"]
    # two domains with the same class counts do not hold out the same positions
    assert photo_out.split.parts["art"]["out"] != photo_out.split.parts["cartoon"]["out"]


def test_training_batches_are_balanced_and_carry_domain_labels(tree: Path) -> None:
    data = module(tree, "photo", batch_size=6, steps_per_epoch=5)
    loader = data.train_dataloader()
    loader.sampler.set_epoch(0)
    batches = list(loader)
    assert len(batches) == len(loader) == 5
    names = data.domain_names
    assert data.train_dataset is not None
    domain_of = {p: d for d in ("art", "cartoon", "sketch") for p in files_under(tree, d)}
    keys = list(loader.sampler)
    for step, (x, y, d) in enumerate(batches):
        assert x.shape == (6, 3, 16, 16) and y.shape == d.shape == (6,)
        assert Counter(names[i] for i in d.tolist()) == {"art": 2, "cartoon": 2, "sketch": 2}
        files = [data.train_dataset.paths[i] for i, _ in keys[6 * step : 6 * (step + 1)]]
        assert [domain_of[f] for f in files] == [names[i] for i in d.tolist()]  # the label is the file's domain


def test_the_sampler_draws_equal_shares_and_every_item_before_repeating_one() -> None:
    domains = [list(range(0, 4)), list(range(4, 14)), list(range(14, 21))]  # 4, 10 and 7 items
    sampler = BalancedDomainSampler(domains, batch_size=6, steps_per_epoch=10, seed=3)
    sampler.set_epoch(0)
    keys = list(sampler)
    assert len(keys) == len(sampler) == 60
    which = [next(k for k, items in enumerate(domains) if i in items) for i, _ in keys]
    for step in range(10):
        assert which[6 * step : 6 * (step + 1)] == [0, 0, 1, 1, 2, 2]
    drawn = [[i for i, _ in keys if i in items] for items in domains]
    assert [len(d) for d in drawn] == [20, 20, 20]  # equal counts per domain, whatever its size
    assert Counter(drawn[0]) == dict.fromkeys(domains[0], 5)  # 4 items: 5 full passes
    assert set(drawn[1][:10]) == set(domains[1]) and set(drawn[1][10:]) == set(domains[1])
    assert sorted(Counter(drawn[2]).values()) == [2, 3, 3, 3, 3, 3, 3]  # 20 = 2 passes of 7 and 6 of a third
    sampler.set_epoch(1)
    later = list(sampler)
    assert later != keys and len(later) == 60
    # the stream goes on across epochs: epoch 1 starts where epoch 0 stopped
    whole = BalancedDomainSampler(domains, batch_size=6, steps_per_epoch=20, seed=3)
    whole.set_epoch(0)
    assert list(whole) == keys + later


def test_the_sampler_resumes_mid_epoch_and_splits_steps_over_ranks() -> None:
    domains = [list(range(0, 5)), list(range(5, 12))]
    sampler = BalancedDomainSampler(domains, batch_size=4, steps_per_epoch=6, seed=0)
    sampler.set_epoch(2)
    keys = list(sampler)
    sampler.skip_once(2, 8)
    assert list(sampler) == keys[8:]
    ranks = [BalancedDomainSampler(domains, 2, 6, seed=0, num_replicas=2, rank=r) for r in (0, 1)]
    for r in ranks:
        r.set_epoch(2)
    shards = [list(r) for r in ranks]
    assert all(len(s) == 12 for s in shards)
    for step in range(6):
        batches = [s[2 * step : 2 * (step + 1)] for s in shards]
        assert all([i in domains[0] for i, _ in batch] == [True, False] for batch in batches)
        rank_items = [k for batch in batches for k in batch]
        assert sorted(rank_items) == sorted(keys[4 * step : 4 * (step + 1)])  # same images, same augmentation seeds
    assert keys[0][1] == item_seed(0, 0, 2 * 6 * 2)  # domain 0, stream position 24 (epoch 2 starts at step 12)


def test_rank_loaders_split_the_single_process_batches(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def batches(world: int, rank: int, batch_size: int) -> list[list[torch.Tensor]]:
        monkeypatch.setattr(samplers_module, "world_size", lambda: world)
        monkeypatch.setattr(samplers_module, "rank", lambda: rank)
        loader = module(tree, "photo", batch_size=batch_size, steps_per_epoch=3, seed=4).train_dataloader()
        loader.sampler.set_epoch(1)
        return list(loader)

    single, rank0, rank1 = batches(1, 0, 12), batches(2, 0, 6), batches(2, 1, 6)
    for (x, y, d), (x0, y0, d0), (x1, y1, d1) in zip(single, rank0, rank1, strict=True):
        rows = {(tuple(img.flatten().tolist()), int(c), int(e)) for img, c, e in zip(x, y, d, strict=True)}
        parts = {
            (tuple(img.flatten().tolist()), int(c), int(e))
            for xs, ys, ds in ((x0, y0, d0), (x1, y1, d1))
            for img, c, e in zip(xs, ys, ds, strict=True)
        }
        assert rows == parts  # the same images with the same augmentation draws


def test_evaluation_resizes_the_whole_image_and_views_double_the_training_images(tree: Path) -> None:
    data = module(tree, "photo", image_size=12)
    x, _, g = next(iter(data.val_dataloader()))
    assert g.tolist() == [0, 0, 0, 1, 1, 1]  # art's held-out part (one image per class), then cartoon's
    assert data.val_dataset is not None
    resized = v2.functional.resize(v2.functional.to_image(Image.open(data.val_dataset.paths[0])), [12, 12])
    assert torch.equal(x[0], v2.functional.to_dtype(resized, scale=True))  # the whole 24-px image, no crop
    data.train_views = 2
    (first, second), _, _ = next(iter(data.train_dataloader()))
    assert first.shape == second.shape == (6, 3, 12, 12) and not torch.equal(first, second)


def test_label_fraction_keeps_a_stratified_part_of_each_training_domain(tmp_path: Path) -> None:
    tree = make_domain_tree(tmp_path / "dg", per_class=10)
    data = module(tree, "photo", label_fraction=0.5)
    data.setup()
    assert data.split is not None
    assert [len(data.split.parts[d]["in"]) for d in data.domain_names] == [12, 12, 24, 12]  # photo untouched


@pytest.mark.parametrize(
    ("change", "test_domains", "message"),
    [
        ("remove_class", "photo",
         "domain 'sketch' (ROOT/sketch) is missing class folder(s) ['triangle'] that 'art' has: every domain needs "
         "the same class folders"),
        (None, "foto",
         "unknown test domain(s) ['foto']: the domains under the data root are ['art', 'cartoon', 'photo', 'sketch']"),
        ("one_domain", "art",
         "data root ROOT holds one domain folder ('art'): domain generalization trains on some domains and tests on "
         "another; expected the DomainBed layout ROOT/<domain>/<class>/<images> with 2 or more domains"),
        ("flat", "art", "domain folder ROOT/art has no class folders: expected the DomainBed layout"),
        (None, ["art", "cartoon", "photo", "sketch"], "holds out every domain, leaving none to train on"),
        (None, [],
         "no test domain given: pass --data.test_domains with one or more of ['art', 'cartoon', 'photo', 'sketch']"),
        ("empty_class", "photo", "class folder(s) ['disc'] in ROOT/cartoon contain no image files"),
    ],
)  # fmt: skip
def test_bad_layouts_are_one_line_errors(
    tree: Path, change: str | None, test_domains: str | list[str], message: str
) -> None:
    if change == "remove_class":
        shutil.rmtree(tree / "sketch" / "triangle")
    elif change == "one_domain":
        for d in ("cartoon", "photo", "sketch"):
            shutil.rmtree(tree / d)
    elif change == "flat":
        for png in (tree / "art").rglob("*.png"):
            png.rename(tree / "art" / png.name)
        for shape in SHAPES:
            (tree / "art" / shape).rmdir()
    elif change == "empty_class":
        for png in (tree / "cartoon" / "disc").glob("*.png"):
            png.unlink()
    with pytest.raises(DataError) as err:
        module(tree, test_domains).setup()
    assert message.replace("ROOT", str(tree)) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_batch_size_that_does_not_split_over_the_domains_is_refused(tree: Path) -> None:
    with pytest.raises(DataError, match=r"batch_size 32 does not split equally over the 3 training domains: use a "
                       r"multiple of 3, e.g. 30 or 33 \(DomainBed draws 32 per domain: 96\)"):  # fmt: skip
        module(tree, "photo", batch_size=32).train_dataloader()


def test_option_and_split_errors_name_every_problem(tree: Path) -> None:
    with pytest.raises(DataError, match="steps_per_epoch must be >= 1, got 0; grayscale must be a probability"):
        module(tree, steps_per_epoch=0, grayscale=2.0)
    with pytest.raises(DataError, match=r"holdout_fraction must be in \(0, 1\)"):
        split_domains(read_domains(str(tree)), ["photo"], holdout_fraction=0)
    with pytest.raises(DataError, match=r"test_domains names a domain twice: \['photo', 'photo'\]"):
        split_domains(read_domains(str(tree)), ["photo", "photo"])


def test_test_domains_take_a_name_a_comma_list_or_a_list(tree: Path) -> None:
    assert module(tree, "photo").test_domains == ["photo"]
    assert module(tree, "photo, sketch").test_domains == ["photo", "sketch"]
    assert module(tree, ["sketch", "art"]).test_domains == ["sketch", "art"]
    data = module(tree, "photo,sketch")
    data.setup()
    assert [g.key for g in data.test_groups] == ["photo", "sketch", "photo/out", "sketch/out", "art/out", "cartoon/out"]
    module(tree, "photo").check_folders()
    with pytest.raises(DataError, match=r"unknown test domain\(s\) \['foto'\]"):
        module(tree, "foto").check_folders()


def test_cache_images_decodes_each_part_at_the_size_its_split_reads(tmp_path: Path) -> None:
    """Cached, every image was decoded at the training crops' JPEG draft size, so the evaluation splits of a JPEG
    data set read other pixels than without the cache (a scale-dependent test accuracy)."""
    import numpy as np

    tree = make_domain_tree(tmp_path / "dg", per_class=2)
    rng = np.random.default_rng(0)
    for domain in STYLES:
        for path in (tree / domain).rglob("*.png"):  # JPEGs large enough for draft-mode decoding
            Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(path.with_suffix(".jpg"))
            path.unlink()
    plain, cached = module(tree, image_size=64), module(tree, image_size=64, cache_images=True)  # drafts 1/2, 1/4
    for data in (plain, cached):
        data.setup()
    for split in ("train_dataset", "val_dataset", "test_dataset"):
        a, b = getattr(plain, split), getattr(cached, split)
        assert len(a) == len(b) and len(a.paths) == len(a) and b.paths == []  # cached: every pixel in memory
        for i in range(len(a)):
            torch.manual_seed(i)  # the training crops draw alike
            x = a[i]
            torch.manual_seed(i)
            y = b[i]
            assert torch.equal(x[0], y[0]) and x[1:] == y[1:], (split, i)
