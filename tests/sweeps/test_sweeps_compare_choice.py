"""``coretune compare``'s recommendation on synthetic tables: a win beyond noise, a tie (the simplest method), CE
best; the order of simplicity; the rule that refuses a validation split too small to tell methods apart."""

from __future__ import annotations

import pytest

from coretune import objectives
from coretune.sweeps.choice import (
    SIMPLICITY,
    check_val_size,
    hyperparameters,
    method_rows,
    needed_val_images,
    p_value,
    recommend,
    reference_method,
    simplicity,
)
from coretune.sweeps.stats import Cell


def cells(**values: list[float]) -> dict[str, Cell]:
    """One cell per method, its seeds 0, 1, … in order."""
    return {m: Cell(m, "data", 1.0, tuple(v), tuple(range(len(v)))) for m, v in values.items()}


def test_a_win_beyond_noise_recommends_the_winner() -> None:
    table = cells(ce=[70.0, 71.0, 69.5, 70.2], ce_mix=[70.3, 71.1, 69.9, 70.4], core=[73.1, 74.3, 72.4, 73.0])
    choice = recommend(table)
    assert (choice.method, choice.best, choice.tied, choice.beyond_noise) == ("core", "core", ("core",), True)
    assert choice.text.startswith("use core: core has the highest mean validation top-1 (73.20%)")
    assert (
        "ahead of every other method beyond noise (the closest, ce_mix, by 2.77 points, p < 0.001 over 4 seeds"
        in choice.text
    )


def test_a_tie_within_noise_recommends_the_simplest_and_says_so() -> None:
    table = cells(core=[70.6, 70.1, 70.9], ce=[70.0, 70.5, 69.8], ce_mix=[71.0, 69.7, 70.3])
    choice = recommend(table)
    assert choice.best == "core" and choice.method == "ce" and not choice.beyond_noise
    assert choice.tied == ("ce", "ce_mix", "core")  # the simplest first
    assert choice.text.startswith("use ce, the simplest of them (no hyper-parameter of its own): core has the highest")
    assert "are within noise of it, so the simplest of the tie is recommended" in choice.text
    assert "more seeds (--seeds) or a larger validation split could separate them" in choice.text


def test_a_tie_of_two_names_the_other_and_its_p_value() -> None:
    choice = recommend(cells(ce=[70.0, 70.5, 69.8], core=[70.6, 70.1, 70.9]))
    p, _ = p_value(*cells(core=[70.6, 70.1, 70.9], ce=[70.0, 70.5, 69.8]).values())
    assert choice.method == "ce" and f"ce (−0.43 points, p = {p:.2g} over 3 seeds) is within noise" in choice.text


def test_ce_best_is_recommended_as_the_best_and_the_simplest() -> None:
    clear = recommend(cells(ce=[75.0, 76.2, 74.9], core=[70.1, 71.0, 70.2]))
    assert (clear.method, clear.beyond_noise) == ("ce", True)
    tie = recommend(cells(ce=[70.6, 70.1, 70.9], core=[70.0, 70.5, 69.8]))
    assert (tie.method, tie.best, tie.beyond_noise) == ("ce", "ce", False)
    assert "it is also the simplest of the methods within noise of it: core (−0.43 points" in tie.text


def test_a_method_behind_a_more_elaborate_winner_is_not_in_the_tie() -> None:
    table = cells(ce=[60.0, 61.0, 60.5], ce_mix=[70.0, 71.2, 70.1], core=[70.3, 70.9, 70.6])
    choice = recommend(table)
    assert choice.tied == ("ce_mix", "core") and choice.method == "ce_mix" and choice.best == "core"


def test_equal_differences_fall_back_on_the_sign_test() -> None:
    base = [70.0, 71.0, 69.0, 72.0, 70.5, 71.5]
    ahead = [v + 1.0 for v in base]
    assert p_value(*cells(a=ahead[:2], b=base[:2]).values()) == (0.5, 2)  # two seeds never beat the noise
    assert p_value(*cells(a=ahead[:5], b=base[:5]).values()) == (0.0625, 5)
    assert recommend(cells(ce=base[:5], core=ahead[:5])).method == "ce"  # p = 0.0625: a tie
    assert recommend(cells(ce=base, core=ahead)).method == "core"  # 6 seeds, all ahead: p = 0.031
    assert p_value(*cells(a=base, b=base).values()) == (1.0, 6)
    p, n = p_value(*cells(a=[70.0], b=[69.0]).values())
    assert n == 1 and p != p  # NaN: one pair is no test
    assert recommend(cells(ce=[70.0], core=[75.0])).method == "ce"  # one seed: nothing is beyond noise


def test_methods_without_a_finished_run_are_left_out() -> None:
    assert recommend(cells(ce=[], core=[70.0, 71.0])).text.startswith("core is the only method with finished runs")
    with pytest.raises(ValueError, match="no method has a finished run"):
        recommend(cells(ce=[], core=[]))


def test_rows_compare_every_method_with_ce_paired_by_seed() -> None:
    table = cells(core=[72.0, 73.0, 71.0], ce=[70.0, 72.0, 70.5])
    assert reference_method(list(table)) == "ce" and reference_method(["core", "ce_mix"]) == "ce_mix"
    core, ce = method_rows(table, "ce")
    assert (ce.diff, ce.p, ce.pairs) == (None, None, 0)
    assert core.diff == pytest.approx((2.0 + 1.0 + 0.5) / 3) and core.pairs == 3
    assert core.p == pytest.approx(p_value(table["core"], table["ce"])[0])
    assert core.hyperparameters == ("eta", "alpha") and ce.hyperparameters == ()
    assert core.as_dict()["val_top1_pct"] == [72.0, 73.0, 71.0]


def test_the_order_of_simplicity_follows_the_number_of_hyper_parameters() -> None:
    builtin = {n for n in objectives.available() if objectives.get(n)[0].__module__.startswith("coretune.")}
    assert set(SIMPLICITY) == builtin  # a new method takes its place in the order
    counts = [len(hyperparameters(m)) for m in SIMPLICITY]
    assert counts == sorted(counts) and counts[0] == 0
    assert hyperparameters("ce_mix") == ("alpha",)  # its preset fixes η = 0
    assert sorted(["core", "ce_mix", "ce", "rifle"], key=simplicity) == ["ce", "rifle", "ce_mix", "core"]
    assert simplicity("my.plugin.Method") > simplicity("core")


def test_a_validation_split_too_small_is_refused_naming_the_images_per_class_it_needs() -> None:
    assert needed_val_images(5) == 800 and needed_val_images(10) == 200 and needed_val_images(1) == 20000
    check_val_size({"a": 400, "b": 400}, 5, 0.2, 4000)  # enough: nothing raised
    with pytest.raises(ValueError) as info:
        check_val_size({"a": 50, "b": 50}, 5, 0.2, 500)
    message = str(info.value)
    assert message.startswith("the validation split holds 100 images (50 per class, --val_fraction 0.2 of 500")
    assert "which needs 800 images, 400 per class of 2" in message
    assert "use more training images, or accept a coarser comparison with --min_difference 14.2" in message
    with pytest.raises(ValueError, match=r"raise --val_fraction to 0.08, or accept"):
        check_val_size({"a": 250, "b": 250}, 5, 0.05, 10000)
