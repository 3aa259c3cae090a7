"""Every `clef` flag README.md names is one the command line accepts: a flag that is renamed, removed or
only ever existed in the docs fails here instead of in a reader's terminal."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from clef_runtime.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w<-])")
"""A long option; ``--no-<flag>`` (a pattern, not a flag) is left out by the look-ahead."""
BLOCK = r"^```[a-z]*\n(.*?)^```"
COMMAND = re.compile(r"clef [a-z]")
"""A `clef` command line (not Python's ``clef = Clef.load(...)``)."""


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of ``parser`` and of every subcommand below it."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


def _per_subcommand() -> dict[str, set[str]]:
    parser = build_parser()
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: _flags(sub) for name, sub in subparsers.choices.items()}


def _clef_commands(text: str) -> list[str]:
    """Every `clef ...` command of the README: lines of code blocks (a `$ ` prompt removed, indented
    continuation lines joined) and inline code spans that start with ``clef ``."""
    commands: list[str] = []
    for block in re.findall(BLOCK, text, flags=re.S | re.M):
        continuing = False
        for line in block.splitlines():
            line = line.removeprefix("$ ")
            if COMMAND.match(line):
                commands.append(line)
                continuing = True
            elif continuing and line.startswith(" "):
                commands[-1] += " " + line.strip()
            else:
                continuing = False
    return commands + [span for span in _inline_code(text) if COMMAND.match(span)]


def _inline_code(text: str) -> list[str]:
    """The inline code spans outside code blocks, a span broken over two lines joined with a space."""
    prose = re.sub(BLOCK, "", text, flags=re.S | re.M)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def _bare_flags(text: str) -> set[str]:
    """Flags written on their own in inline code (``--weights MODE``, in prose and in tables)."""
    return {flag for span in _inline_code(text) if FLAG.match(span) for flag in FLAG.findall(span)}


def test_every_flag_of_a_clef_command_in_the_readme_belongs_to_that_subcommand() -> None:
    subcommands = _per_subcommand()
    every = set().union(*subcommands.values())
    commands = _clef_commands(README.read_text(encoding="utf-8"))
    assert len(commands) > 10, commands
    wrong = []
    for command in commands:
        words = command.split()
        accepted = subcommands.get(words[1], every) if len(words) > 1 else every
        wrong += [(command, flag) for flag in FLAG.findall(command) if flag not in accepted]
    assert not wrong, wrong


def test_every_flag_the_readme_names_on_its_own_exists() -> None:
    every = set().union(*_per_subcommand().values())
    named = _bare_flags(README.read_text(encoding="utf-8"))
    assert "--weights" in named and "--confidence" in named, named
    assert sorted(named - every) == []


def test_a_flag_that_does_not_exist_is_caught() -> None:
    text = "Use `--pad-last-chunk` here, or `clef decide --model tiny --weigths fp32 x.json`."
    assert _bare_flags(text) == {"--pad-last-chunk"}
    assert _clef_commands(text) == ["clef decide --model tiny --weigths fp32 x.json"]
    assert "--pad-last-chunk" not in set().union(*_per_subcommand().values())
    assert "--weigths" not in _per_subcommand()["decide"]
