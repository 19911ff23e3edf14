"""docs/reliability.md's catalogue: its count is the number of its rows, and no two rows share a number."""

from __future__ import annotations

import re
from pathlib import Path

CATALOGUE = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def test_the_catalogue_counts_its_rows_and_numbers_each_once() -> None:
    text = CATALOGUE.read_text()
    numbers = [int(n) for n in re.findall(r"^\| (\d+) \|", text, flags=re.MULTILINE)]
    assert len(numbers) == len(set(numbers)), sorted(n for n in set(numbers) if numbers.count(n) > 1)
    missing = sorted(set(range(1, max(numbers) + 1)) - set(numbers))
    assert missing == [142]  # never used
    counted = re.search(r"\*\*Cases tried: (\d+) \(rows 1–(\d+); there is no row 142\)\. Handled: (\d+)\*\*", text)
    assert counted is not None
    assert [int(g) for g in counted.groups()] == [len(numbers), max(numbers), len(numbers)]
