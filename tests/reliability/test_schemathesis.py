"""Schemathesis against the server's own ``/openapi.json``: for every operation, schema-valid (positive)
and schema-invalid (negative) requests never get a 5xx, and every response matches the documented status
codes, content type and response schema.

Two servers: the fake engine over real HTTP (many examples, fast), and ``clef serve --model tiny`` (a few
examples per operation: each positive decision request runs the model).

One Schemathesis check is left out: ``positive_data_acceptance`` ("a schema-valid request must not get
4xx"). The published schema cannot express every validation rule (e.g. a decisions ``input`` array must
not be empty, a choice's options must be distinct, the token budget), so schema-valid bodies may correctly
get 422; that is documented rather than a failure.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from devtools.fake_engine import FakeClef
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server.conftest import LiveServer
from tests.server.routes.test_conformance import ServerProcess, start_server, stop_server


@schemathesis.serializer("application/jsonl")
def _jsonl(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    # The job-submission body is documented as a string of JSON lines.
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()


EXCLUDED_CHECKS = [schemathesis.checks.positive_data_acceptance]
ROUTES = {"/v1/systemone", "/v1/decisions", "/v1/models", "/health", "/ready", "/metrics"}


def fuzz_every_operation(base_url: str, max_examples: int) -> set[str]:
    """Run Schemathesis over every operation of the server's schema in both generation modes.

    Returns the operations' paths. Raises Schemathesis' failure group (a 5xx or a response that does not
    match the schema) on the first operation that fails.
    """
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    paths: set[str] = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        paths.add(operation.path)
        # A GET without parameters has no invalid form: negative generation only for the POST bodies.
        # A JSONL body (job submission) is bytes on the wire: a "non-string" cannot be sent, so it has no
        # negative form either (its bad lines are tested in tests/server/jobs/test_jobs_api.py).
        has_body = operation.method.upper() == "POST"
        jsonl = "application/jsonl" in str(operation.definition.raw.get("requestBody", {}))
        modes = (
            (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            if has_body and not jsonl
            else (GenerationMode.POSITIVE,)
        )
        for mode in modes:

            @settings(
                max_examples=max_examples if has_body else 3,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                response = case.call(base_url=base_url, timeout=120)
                assert response.status_code < 500, (case.body, response.text)
                case.validate_response(response, excluded_checks=EXCLUDED_CHECKS)

            run()
    return paths


@pytest.mark.slow
def test_schemathesis_against_the_fake_engine(live_fake: Callable[..., LiveServer]) -> None:
    live = live_fake(FakeClef())
    assert fuzz_every_operation(live.url, max_examples=60) >= ROUTES


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("schemathesis"), "--max-length", "512")
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.mark.slow
def test_schemathesis_against_the_tiny_model(tiny_server: ServerProcess, tmp_path: Path) -> None:
    assert fuzz_every_operation(tiny_server.url, max_examples=8) >= ROUTES
    assert "Traceback" not in tiny_server.log()
