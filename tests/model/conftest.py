"""Shared fixtures for the model tests: the tiny checkpoint is built once per session in a temp directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from clef_runtime.model.backbone import Backbone
from clef_runtime.model.tiny import make_tiny


@pytest.fixture(scope="session")
def tokenizer_json_path() -> Path:
    """The built-in Qwen3.5 tokenizer.json (built into the user cache on first use)."""
    from clef_runtime.encoding.tokenizer import default_tokenizer_path

    return Path(default_tokenizer_path())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_json_path: Path) -> Path:
    """A tiny checkpoint (seed 0) in the release layout, shared read-only by all model tests."""
    return make_tiny(tmp_path_factory.mktemp("tiny") / "checkpoint", seed=0)


@pytest.fixture(scope="session")
def tiny_backbone(tiny_dir: Path) -> Backbone:
    """The tiny checkpoint's text backbone, fp32 on CPU."""
    return Backbone.load(tiny_dir, device="cpu")


def _clone_checkpoint(source: Path, target: Path, copy: tuple[str, ...] = ()) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.name in copy:
            (target / entry.name).write_bytes(entry.read_bytes())
        else:
            (target / entry.name).symlink_to(entry)
    return target


@pytest.fixture
def clone_tiny(tiny_dir: Path, tmp_path: Path) -> Callable[..., Path]:
    """Returns ``clone(*names)``: a writable copy of the tiny checkpoint in which the named files are real
    copies (safe to corrupt) and every other file is a symlink to the shared checkpoint."""

    def clone(*names: str) -> Path:
        return _clone_checkpoint(tiny_dir, tmp_path / "clone", copy=names)

    return clone
