"""Command-line parsing errors in one line.

jsonargparse answers a bad option with the command's whole usage (80 lines for ``coretune fit``) and a message over
several lines. coretune's parsers answer with the message alone, on one line, naming the option as it is typed::

    coretune fit: error: --model.optim.schedule: expected one of 'cosine', 'linear', 'poly', 'constant', 'exponential',
    got foo (coretune fit --help lists the options)
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Collection
from typing import Any, NoReturn

import jsonargparse

__all__ = ["ArgumentParser", "OneLineErrors", "help_hint", "one_line"]

_KEY = re.compile(r'^Parser key "([^"]+)":\s*')
_EXPECTED = re.compile(r"^Expected a (.+?)\. Got value: (.*)$", re.S)
_UNION = re.compile(r"^Does not validate against any of the Union subtypes\b")
_ERRORS = re.compile(r"^\s*Errors:\n(.*?)^\s*Given value type: .*?^\s*Given value: (.*?)\s*\Z", re.S | re.M)
_CLASS_PATH = re.compile(r"^Problem with given class_path '[^']*':\s*(.*)$", re.S)


def _readable(kind: str) -> tuple[str, bool]:
    """A type of jsonargparse's messages as a user reads it, and whether it is a list of values (a ``Literal``):
    ``<class 'int'>`` → ``int``, ``<class 'NoneType'>`` → ``null``, ``typing.Literal['a', 'b']`` → ``'a', 'b'``."""
    if literal := re.fullmatch(r"(?:typing\.)?Literal\[(.*)\]", kind, re.S):
        return literal[1], True
    if named := re.fullmatch(r"<class '(?:[\w.]*\.)?(\w+)'>", kind):
        return ("null" if named[1] == "NoneType" else named[1]), False
    return kind, False


def _expected(kinds: list[str]) -> str:
    """``expected float``, ``expected int or null``, ``expected one of 'a', 'b', null``."""
    readable = [_readable(k) for k in kinds]
    if any(values for _, values in readable):
        return "expected one of " + ", ".join(text for text, _ in readable)
    return "expected " + " or ".join(text for text, _ in readable)


def _entries(errors: str) -> list[str]:
    """The ``- …`` entries of a Union message's ``Errors:`` list, each dedented to its own first line."""
    lines = errors.splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    entries: list[list[str]] = []
    for line in lines:
        if line[indent:].startswith("- "):
            entries.append([line[indent + 2 :]])
        elif entries:
            entries[-1].append(line[indent + 2 :])
    return ["\n".join(entry) for entry in entries]


def _union(body: str) -> tuple[list[str], str] | None:
    """A Union message (:func:`_parts`): the error of the class a ``class_path`` chose, else every accepted type or
    value; None when it has another shape."""
    if not (found := _ERRORS.search(body)):
        return None
    entries, given = _entries(found[1]), found[2]
    for entry in entries:
        if _CLASS_PATH.match(entry):
            return _parts(entry)
    kinds = [m[1] for entry in entries if (m := re.fullmatch(r"Expected a (.+?)(?:\. Got value: .*)?", entry))]
    return ([], f"{_expected(kinds)}, got {given}") if kinds and len(kinds) == len(entries) else None


def _parts(message: str) -> tuple[list[str], str]:
    """The option keys a jsonargparse error names, outermost first (``--objective.eta`` is ``["objective", "eta"]``:
    a nested class's own option), and what it says of the last one, in one line."""
    key = _KEY.match(message)
    keys = [key[1]] if key else []
    body = textwrap.dedent(message[key.end() :] if key else message).strip()
    if (single := _EXPECTED.match(body)) and "\n" not in single[2]:
        return keys, f"{_expected([single[1]])}, got {single[2]}"
    inner: tuple[list[str], str] | None = None
    if chosen := _CLASS_PATH.match(body):
        inner = _parts(chosen[1])
    elif _UNION.match(body):
        inner = _union(body)
    if inner is not None and (inner[0] or not chosen):
        return keys + inner[0], inner[1]
    return keys, " ".join(body.split())


def one_line(message: str, positionals: Collection[str] = ()) -> str:
    """jsonargparse's error ``message`` in one line: ``Parser key "model.lr": Expected a <class 'float'>. Got value:
    abc`` → ``--model.lr: expected float, got abc``; a value no type of a ``Union`` accepts lists every accepted
    type or value; the error of an option of a class chosen by ``class_path`` names that option
    (``--objective.eta: expected float, got abc``); a ``positionals`` argument is named without dashes; other
    messages keep their words, on one line."""
    keys, text = _parts(message)
    if not keys:
        return text
    return f"{keys[0]}: {text}" if len(keys) == 1 and keys[0] in positionals else f"--{'.'.join(keys)}: {text}"


def help_hint(prog: str) -> str:
    """What a parsing error of ``prog`` ends with."""
    return f" ({prog} --help lists the options)"


class OneLineErrors:
    """A jsonargparse parser mix-in: an error prints ``<prog>: error: <message in one line> (<prog> --help lists
    the options)`` and exits with status 2, without the usage. With ``exit_on_error=False`` (or jsonargparse's debug
    mode) it raises, as jsonargparse does."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser: Any = self
        debug = getattr(getattr(jsonargparse, "_common", None), "debug_mode_active", lambda: False)
        if not parser.exit_on_error or debug():
            super().error(message, ex)  # type: ignore[misc]
        failed = getattr(ex, "subcommand_parser", None) or parser
        prog = failed.prog.replace(" [options]", "")
        positionals = {a.dest for a in failed._actions if not a.option_strings}
        sys.stderr.write(f"{prog}: error: {one_line(message, positionals)}{help_hint(prog)}\n")
        parser.exit(2)


class ArgumentParser(OneLineErrors, jsonargparse.ArgumentParser):
    """jsonargparse's parser with one-line errors (:class:`OneLineErrors`)."""
