"""The README's Python API example runs as written and prints its result."""

from __future__ import annotations

import ast

import pytest

from tests.readme_snippets import python_snippets, run_snippet


@pytest.mark.slow  # loads the tiny model
def test_the_python_api_example_prints_the_answer_and_the_token_count() -> None:
    (example,) = python_snippets("Python API")
    first, second = run_snippet(example).strip().splitlines()
    answer = ast.literal_eval(first)
    assert answer["type"] == "choice" and answer["choice"] in ("billing", "tech")
    assert set(answer["probabilities"]) == {"billing", "tech"}
    count, rest = second.split(" ", 1)
    assert int(count) > 0 and rest == "input tokens"
