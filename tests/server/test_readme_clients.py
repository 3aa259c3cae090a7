"""The README's snippets for the two official clients run as written against a live server (the fake engine
on a loopback port): their output has the answers, and systemone-client gets ``latency_ms``."""

from __future__ import annotations

from collections.abc import Callable

from devtools.fake_engine import FakeClef

from tests.readme_snippets import python_snippets, run_snippet
from tests.server.conftest import LiveServer


def test_the_official_client_snippets_run_as_written(live_fake: Callable[..., LiveServer]) -> None:
    typesafe, systemone = python_snippets("Official clients")
    assert "typesafe_sdk" in typesafe and "systemone" in systemone
    served = live_fake(FakeClef(), latency_ms=True)  # what `clef serve --model tiny --latency-ms` is

    noul, choice, score = run_snippet(typesafe, served.url).split()
    assert 0 <= float(noul) <= 1 and choice in ("billing", "tech") and 0 <= float(score) <= 2

    noul, choice, score, latency_ms = run_snippet(systemone, served.url).split()
    assert 0 <= float(noul) <= 1 and choice in ("billing", "tech") and 0 <= float(score) <= 2
    assert float(latency_ms) >= 0  # not None: the server reports a top-level latency_ms
    assert len(served.engine.batches) == 2


def test_latency_ms_is_top_level_only_when_asked_for(live_fake: Callable[..., LiveServer]) -> None:
    import httpx

    body = {"state": "s", "questions": {"q": {"type": "noul"}}}
    plain = live_fake(FakeClef())
    response = httpx.post(plain.url + "/v1/systemone", json=body).json()
    assert "latency_ms" not in response and response["x_latency_ms"] >= 0  # jevcompat: extras are x_
    asked = live_fake(FakeClef(), latency_ms=True)
    response = httpx.post(asked.url + "/v1/systemone", json=body).json()
    assert response["latency_ms"] == response["x_latency_ms"]


def test_the_mcp_snippet_runs_as_written(live_fake: Callable[..., LiveServer]) -> None:
    (snippet,) = python_snippets("MCP")
    assert "from mcp import Client" in snippet
    served = live_fake(FakeClef())  # what `clef serve --model tiny` is, on the fake engine

    listed, answered = run_snippet(snippet, served.url).splitlines()
    assert listed == "['decide']"
    is_error, choice = answered.split()
    assert is_error == "False" and choice in ("billing", "tech")
    assert len(served.engine.batches) == 1
