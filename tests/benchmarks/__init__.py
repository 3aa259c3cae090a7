"""Tests of the developer tooling in benchmarks/ (the scripts and their shared library, `devtools`)."""

from __future__ import annotations

import importlib
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as the module ``benchmarks.<name>`` (the repository root is on
    the tests' path, and the scripts import each other and the library that way)."""
    return importlib.import_module(f"benchmarks.{name}")
