"""``clef`` flags and `EngineOptions` generated from the options tables, never written by hand.

A benchmark names what it sets by field (``cache_mb=0``); the flag comes from the table that defines the
option (`clef_runtime.options.ENGINE_OPTIONS` for the engine, the ``clef serve`` parser for the server's own
options, which is built from the server's table), so a renamed or removed option fails loudly here instead
of silently dropping out of a benchmark's command line.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from clef_runtime.options import ENGINE_OPTIONS, MODEL_OPTION, EngineOptions, Option

__all__ = ["engine_flags", "engine_options", "has_engine_option", "option_flags", "serve_flags"]


def _value_text(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def _flags(flag: str, negative: str | None, kind: str, value: Any) -> list[str]:
    if kind == "bool":
        if negative is None:  # a store_true flag: only "on" can be said
            if not value:
                raise ValueError(f"{flag} can only be switched on")
            return [flag]
        return [flag if value else negative]
    if kind == "append":
        return [part for item in value for part in (flag, _value_text(item))]
    return [flag, _value_text(value)]


def option_flags(options: Iterable[Option], values: Mapping[str, Any]) -> list[str]:
    """The flags that give ``values`` (field -> value) through ``options``; None values are left out (the
    default applies). Raises KeyError naming a field that has no option in the table."""
    table = {option.field: option for option in options}
    argv: list[str] = []
    for field, value in values.items():
        if field not in table:
            raise KeyError(f"no option for {field!r} in the table")
        if value is None:
            continue
        option = table[field]
        negative = "--no-" + option.flag.removeprefix("--") if option.kind == "bool" else None
        argv += _flags(option.flag, negative, option.kind, value)
    return argv


def engine_flags(**values: Any) -> list[str]:
    """Flags of ``--model`` and the engine options (`ENGINE_OPTIONS`) for ``values`` by field name."""
    return option_flags((MODEL_OPTION, *ENGINE_OPTIONS), values)


def has_engine_option(field: str) -> bool:
    """Whether the engine has the option ``field`` (an entry of `ENGINE_OPTIONS`)."""
    return any(option.field == field for option in ENGINE_OPTIONS)


def engine_options(**values: Any) -> EngineOptions:
    """`EngineOptions` for ``Clef.load(model, options)``; None values keep the default. Raises TypeError for
    a field the engine does not have, `OptionsError` for a bad value."""
    return EngineOptions().replace(**{field: value for field, value in values.items() if value is not None})


@functools.cache
def _serve_actions() -> dict[str, argparse.Action]:
    from clef_runtime.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {action.dest: action for action in commands.choices["serve"]._actions if action.option_strings}


def serve_flags(**values: Any) -> list[str]:
    """``clef serve`` flags for ``values`` by field name: the model and engine options from their table
    (`engine_flags`), the server's own from the ``clef serve`` parser. None values are left out. Raises
    KeyError naming a field ``clef serve`` has no flag for."""
    engine_fields = {option.field for option in (MODEL_OPTION, *ENGINE_OPTIONS)}
    argv = engine_flags(**{field: value for field, value in values.items() if field in engine_fields})
    actions = _serve_actions()
    for field, value in values.items():
        if field in engine_fields or value is None:
            continue
        if field not in actions:
            raise KeyError(f"clef serve has no flag for {field!r}")
        action = actions[field]
        strings = action.option_strings
        if action.nargs == 0:  # --flag / --no-flag, or a plain switch
            argv += _flags(strings[0], strings[1] if len(strings) > 1 else None, "bool", value)
        elif isinstance(action, argparse._AppendAction):
            argv += _flags(strings[0], None, "append", value)
        else:
            argv += _flags(strings[0], None, "value", value)
    return argv


def add_device_check_arguments(parser: argparse.ArgumentParser, smoke_help: str) -> None:
    """``--device`` (default cuda) and ``--smoke`` / ``--quick`` (a plumbing run on CPU, ``smoke_help``
    says what it runs), shared by the device check and the release bench."""
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--smoke", "--quick", dest="smoke", action="store_true", help=smoke_help)
