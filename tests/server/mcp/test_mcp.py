"""``POST /mcp`` driven by the official ``mcp`` client, unchanged, against a live loopback server (the fake
engine): the tool list, a ``decide`` call answering what ``/v1/systemone`` answers for the same body, bad
bodies as tool errors naming the field, 401 without the key, and the per-key rate limit charged per tool
call. Both protocol eras the SDK speaks are driven: the initialize handshake (``ClientSession`` over
``streamable_http_client``) and the 2026 per-request era (``Client``'s default ``auto`` mode)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import mcp_types
import pytest
from devtools.fake_engine import FAIL_MARKER, FakeClef
from mcp import Client, ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from clef_runtime.server.mcp.tool import DECIDE_TOOL
from tests.server.conftest import LiveServer

BODY: dict[str, Any] = {
    "model": "jev-latest",
    "state": {"ticket": "Charged twice, please refund today."},
    "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {"type": "choice", "criteria": {"billing": "charges, refunds", "tech": None}},
        "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
    },
}
ERAS = ["handshake", "per-request"]


@asynccontextmanager
async def connected(url: str, era: str, api_key: str | None = None) -> AsyncIterator[ClientSession]:
    """A session of the real client on ``url``/mcp: the handshake era through `ClientSession` (as a
    2025 client), or the per-request era through `Client` (the SDK's default, which probes
    ``server/discover``). The key, if any, rides on every request as ``Authorization: Bearer``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
        transport = streamable_http_client(url + "/mcp", http_client=http)
        if era == "handshake":
            async with transport as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                yield session
        else:
            async with Client(transport) as client:
                yield client.session


async def decide_over_mcp(url: str, arguments: dict[str, Any], era: str, api_key: str | None = None) -> Any:
    async with connected(url, era, api_key) as session:
        return await session.call_tool("decide", arguments)


def systemone(url: str, body: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
    """The independent answer: the same body POSTed to /v1/systemone."""
    headers = {"x-api-key": api_key} if api_key else {}
    response = httpx.post(url + "/v1/systemone", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def without_latency(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer without the server time, the one field two requests do not share."""
    return {key: value for key, value in answer.items() if key != "x_latency_ms"}


# A raw initialize request, as a client's first POST (for the checks done before the SDK sees it).
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}
JSON_ACCEPT = {"accept": "application/json, text/event-stream"}


@pytest.mark.parametrize("era", ERAS)
def test_the_server_lists_one_tool_whose_input_is_the_system_one_request(
    live_fake: Callable[..., LiveServer], era: str
) -> None:
    served = live_fake(FakeClef())

    async def listing() -> mcp_types.ListToolsResult:
        async with connected(served.url, era) as session:
            return await session.list_tools()

    (tool,) = asyncio.run(listing()).tools
    assert tool == DECIDE_TOOL
    schema = tool.input_schema
    assert schema["type"] == "object" and set(schema["required"]) == {"state", "questions"}
    assert {"state", "questions", "images", "model"} <= set(schema["properties"])
    assert all(schema["properties"][name].get("description") for name in schema["properties"])
    assert "$ref" not in json.dumps(schema)  # self-contained: agents need not resolve references
    assert tool.annotations is not None and tool.annotations.read_only_hint
    assert served.engine.batches == []  # listing decides nothing


@pytest.mark.parametrize("era", ERAS)
def test_decide_answers_what_the_systemone_route_answers(
    live_fake: Callable[..., LiveServer], era: str
) -> None:
    served = live_fake(FakeClef())
    result = asyncio.run(decide_over_mcp(served.url, BODY, era))
    assert not result.is_error
    answer = result.structured_content
    assert set(answer["answers"]) == {"refund", "team", "urgency"}
    (text,) = result.content
    assert json.loads(text.text) == answer  # the same JSON for clients that read only text
    assert without_latency(answer) == without_latency(systemone(served.url, BODY))
    assert len(served.engine.batches) == 2  # one engine call each: the tool went through the engine


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({**BODY, "questions": {"q": {"type": "nope"}}}, "questions.q.type: "),
        ({"questions": BODY["questions"]}, "state: "),
        (
            {"state": "s", "questions": {"q": {"type": "choice", "criteria": {"only": None}}}},
            "questions.q.criteria: ",
        ),
        ({"state": "s", "questions": {}}, "questions: "),
        ({**BODY, "images": ["https://example.com/cat.png"]}, "images[0]: "),
    ],
)
def test_a_bad_body_is_a_tool_error_naming_the_field(
    live_fake: Callable[..., LiveServer], arguments: dict[str, Any], field: str
) -> None:
    served = live_fake(FakeClef())
    result = asyncio.run(decide_over_mcp(served.url, arguments, "handshake"))
    assert result.is_error
    (text,) = result.content
    assert text.text.startswith("invalid request: ") and field in text.text, text.text
    # The same field the HTTP route names in its 422.
    response = httpx.post(served.url + "/v1/systemone", json=arguments, timeout=30)
    assert response.status_code == 422
    loc = ".".join(str(part) for part in response.json()["detail"][0]["loc"][1:])
    assert loc.replace(".0", "[0]") in text.text
    assert served.engine.batches == []


def test_an_engine_failure_is_a_tool_error_not_an_http_error(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FakeClef())
    result = asyncio.run(decide_over_mcp(served.url, {**BODY, "state": FAIL_MARKER}, "handshake"))
    assert result.is_error
    text = result.content[0].text
    assert text.startswith("internal_error: ") and "quote request id " in text, text


def test_without_the_key_mcp_is_401_before_any_mcp_processing(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FakeClef(), api_keys=("mcp-key",))
    for key in (None, "wrong-key"):
        sent = {**JSON_ACCEPT, **({"authorization": f"Bearer {key}"} if key else {})}
        response = httpx.post(served.url + "/mcp", json=INITIALIZE, headers=sent, timeout=30)
        assert response.status_code == 401, response.text
        assert response.json()["detail"]["error_type"] == "authentication_error"
    # The real client without the key gets nowhere (its error comes out of its task groups); with it, it
    # decides.
    refused = False
    try:
        asyncio.run(decide_over_mcp(served.url, BODY, "handshake"))
    except* MCPError:
        refused = True
    assert refused
    result = asyncio.run(decide_over_mcp(served.url, BODY, "handshake", api_key="mcp-key"))
    assert not result.is_error
    assert without_latency(result.structured_content) == without_latency(
        systemone(served.url, BODY, api_key="mcp-key")
    )


@pytest.mark.parametrize("era", ERAS)
def test_the_rate_limit_is_charged_once_per_decide_call(
    live_fake: Callable[..., LiveServer], era: str
) -> None:
    # A bucket of 2 that refills in 1,000 s: the test never waits for it.
    served = live_fake(FakeClef(), api_keys=("mcp-key",), rate_limit=0.001, rate_burst=2)

    async def session_of_calls() -> list[mcp_types.CallToolResult]:
        results = []
        async with connected(served.url, era, "mcp-key") as session:
            for _ in range(3):  # listing is free, however often
                await session.list_tools()
            for _ in range(3):
                results.append(await session.call_tool("decide", BODY))
        return results

    first, second, third = asyncio.run(session_of_calls())
    assert not first.is_error and not second.is_error
    assert third.is_error
    text = third.content[0].text
    assert text.startswith("rate_limited: ") and "retry in " in text and text.endswith(" s"), text
    seconds = int(text.rsplit("retry in ", 1)[1].removesuffix(" s"))
    assert 1 <= seconds <= 1000
    assert len(served.engine.batches) == 2
    # The limit is the key's, shared with the other routes: /v1/systemone is refused too.
    response = httpx.post(
        served.url + "/v1/systemone", json=BODY, headers={"x-api-key": "mcp-key"}, timeout=30
    )
    assert response.status_code == 429


def test_mcp_answers_only_post(live_fake: Callable[..., LiveServer]) -> None:
    # Stateless: no GET stream to open and no session to DELETE (the transport allows a 405 for both).
    served = live_fake(FakeClef())
    for method in ("GET", "DELETE"):
        assert httpx.request(method, served.url + "/mcp", timeout=30).status_code == 405


def test_a_cross_origin_browser_call_is_refused_and_a_same_origin_one_is_not(
    live_fake: Callable[..., LiveServer],
) -> None:
    served = live_fake(FakeClef())
    host = served.url.removeprefix("http://")
    evil = httpx.post(
        served.url + "/mcp", json=INITIALIZE, headers={**JSON_ACCEPT, "origin": "http://evil.example"}
    )
    assert evil.status_code == 403 and evil.json()["detail"]["error_type"] == "forbidden_origin"
    own = httpx.post(
        served.url + "/mcp", json=INITIALIZE, headers={**JSON_ACCEPT, "origin": f"http://{host}"}
    )
    assert own.status_code == 200 and own.json()["result"]["serverInfo"]


def test_an_origin_the_operator_allows_may_call_mcp(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FakeClef(), cors_origins=("https://app.example",))
    allowed = httpx.post(
        served.url + "/mcp", json=INITIALIZE, headers={**JSON_ACCEPT, "origin": "https://app.example"}
    )
    assert (
        allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    )
    other = httpx.post(
        served.url + "/mcp", json=INITIALIZE, headers={**JSON_ACCEPT, "origin": "https://evil.example"}
    )
    assert other.status_code == 403


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"jsonrpc": "2.0", "id": 1}, -32600, "invalid request: method: Field required"),
        ({**INITIALIZE, "jsonrpc": "1.0"}, -32600, "invalid request: jsonrpc: Input should be '2.0'"),
        ({**INITIALIZE, "method": 5}, -32600, "invalid request: method: Input should be a valid string"),
        ({**INITIALIZE, "params": [1]}, -32602, "invalid params: params: Input should be an object"),
        (
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": "decide"},
            -32602,
            "invalid params: params: Input should be an object",
        ),
        ([INITIALIZE], -32600, "invalid request: a JSON-RPC message is a JSON object"),
    ],
)
def test_a_body_that_is_not_a_json_rpc_message_gets_a_short_error_naming_the_field(
    live_fake: Callable[..., LiveServer], body: Any, code: int, message: str
) -> None:
    served = live_fake(FakeClef())
    response = httpx.post(served.url + "/mcp", json=body, headers=JSON_ACCEPT, timeout=30)
    assert response.status_code == 400
    assert response.json() == {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}


def test_a_body_that_is_not_json_gets_a_parse_error(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FakeClef())
    sent = {**JSON_ACCEPT, "content-type": "application/json"}
    response = httpx.post(served.url + "/mcp", content=b"{nope", headers=sent, timeout=30)
    assert response.status_code == 400
    reply = response.json()
    assert reply["id"] is None and reply["error"]["code"] == -32700
    assert reply["error"]["message"].startswith("parse error: ") and "\n" not in reply["error"]["message"]


def test_a_body_over_the_limit_gets_a_json_rpc_error(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FakeClef(), max_body_bytes=1024)
    body = {
        **INITIALIZE,
        "params": {**INITIALIZE["params"], "clientInfo": {"name": "x" * 2000, "version": "1"}},
    }
    response = httpx.post(served.url + "/mcp", json=body, headers=JSON_ACCEPT, timeout=30)
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/json"
    reply = response.json()
    assert reply["id"] is None and reply["error"]["code"] == -32600
    assert "over the limit of 1024 bytes (--max-body-bytes)" in reply["error"]["message"]
    # Under the limit, the same server answers.
    assert (
        httpx.post(served.url + "/mcp", json=INITIALIZE, headers=JSON_ACCEPT, timeout=30).status_code == 200
    )
