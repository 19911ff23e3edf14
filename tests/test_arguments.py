"""One-line parsing errors (:mod:`coretune.arguments`): jsonargparse's messages rewritten, and every command's
parser answering a bad option with one line instead of its usage."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import jsonargparse
import pytest

from coretune.arguments import ArgumentParser, one_line
from coretune.cli import main


class Schedule:
    def __init__(self, warmup: int = 0, decay: float = 0.1) -> None:
        self.warmup, self.decay = warmup, decay


def parse_error(args: list[str]) -> str:
    """jsonargparse's own message for ``args``."""
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--epochs", type=int | None)
    parser.add_argument("--norm", type=Literal["linf", "l2"])
    parser.add_argument("--precision", type=Literal[16, 32] | Literal["bf16-mixed"] | None)
    parser.add_argument("--schedule", type=Schedule | None)
    with pytest.raises(jsonargparse.ArgumentError) as info:
        parser.parse_args(args)
    return str(info.value)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--lr", "abc"], "--lr: expected float, got abc"),
        (["--epochs", "many"], "--epochs: expected int or null, got many"),
        (["--norm", "l1"], "--norm: expected one of 'linf', 'l2', got l1"),
        (["--precision", "17"], "--precision: expected one of 16, 32, 'bf16-mixed', null, got 17"),
        ([f"--schedule={__name__}.Schedule", "--schedule.decay=fast"], "--schedule.decay: expected float, got fast"),
        (["--lr", "1", "--nope", "2"], "unrecognized arguments: --nope 2"),
    ],
    ids=["float", "optional", "literal", "union-of-literals", "class-option", "unknown"],
)
def test_messages_are_one_line_naming_the_option(args: list[str], expected: str) -> None:
    message = parse_error(args)
    assert "\n" in message or expected.startswith("unrecognized")  # jsonargparse's own spans several lines
    assert one_line(message) == expected


def test_a_positional_argument_is_named_without_dashes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "foo"])
    assert capsys.readouterr().err.splitlines() == [
        "coretune eval: error: protocol: expected one of 'knn', 'linear', got foo (coretune eval --help lists the "
        "options)"
    ]


def test_a_message_of_another_shape_keeps_its_words() -> None:
    assert one_line('Parser key "x":\n  Something\n    went wrong') == "--x: Something went wrong"
    assert one_line("plain") == "plain"


def test_a_parser_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = ArgumentParser(prog="coretune demo-cmd")
    parser.add_argument("--k", type=int)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--k", "x"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr().err
        == "coretune demo-cmd: error: --k: expected int, got x (coretune demo-cmd --help lists the options)\n"
    )
    quiet = ArgumentParser(exit_on_error=False)
    quiet.add_argument("--k", type=int)
    with pytest.raises(jsonargparse.ArgumentError):  # a caller that handles errors still gets them raised
        quiet.parse_args(["--k", "x"])


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["fit", "--model.optim.schedule=foo"],
            "coretune fit: error: --model.optim.schedule: expected one of 'cosine', 'linear', 'poly', 'constant', "
            "'exponential', got foo (coretune fit --help lists the options)",
        ),
        (
            ["fit", "--objective=core", "--objective.eta=abc"],
            "coretune fit: error: --objective.eta: expected float, got abc (coretune fit --help lists the options)",
        ),
        (
            ["pretrain", "--model.lr=x"],
            "coretune pretrain: error: --model.lr: expected float, got x (coretune pretrain --help lists the options)",
        ),
        (
            ["predict", "--ckpt_path=x.ckpt", "--data.batch_size=abc"],
            "coretune predict: error: --data.batch_size: expected int, got abc (coretune predict --help lists the "
            "options)",
        ),
        (
            ["bench", "spec.yaml", "--workers=abc"],
            "coretune bench: error: --workers: expected int or null, got abc (coretune bench --help lists the options)",
        ),
    ],
    ids=["fit-literal", "fit-objective-option", "pretrain", "predict", "bench"],
)
def test_every_command_answers_a_bad_option_in_one_line(
    command: list[str], expected: str, image_tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*command, f"--data.root={image_tree}"] if command[0] in ("fit", "pretrain") else command
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [expected]  # no usage
