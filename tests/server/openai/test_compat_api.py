"""/v1/chat/completions and the Workers AI route against the fake engine: answers, OpenAI's and
Cloudflare's error shapes (and the System One routes' shapes left as they were), auth, streaming, limits,
/v1/models and metrics."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from clef_runtime.protocol.openai_chat import parse_chat_request, to_systemone
from tests.server.conftest import Served

SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "enum": ["billing", "tech", "sales"], "description": "Which team?"},
        "urgent": {"type": "boolean", "description": "Is it urgent?"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 4},
    },
    "required": ["team", "urgent", "priority"],
    "additionalProperties": False,
}
CHAT = {
    "model": "clef",
    "messages": [
        {"role": "system", "content": "You triage support tickets."},
        {"role": "user", "content": "I was charged twice, fix it today!"},
    ],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True},
    },
    "temperature": 0.7,
}
CHAT_PATH = "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "ticket", "parameters": SCHEMA, "strict": True}}
WORKERS = "/client/v4/accounts/0123abcd/ai/run/@cf/cloudflare/clef-flash"
SYSTEMONE = {
    "state": "Charged twice.",
    "questions": {
        "team": {"type": "choice", "instructions": "Team?", "criteria": {"billing": None, "tech": None}}
    },
}


def assert_openai_error(response: Any, status: int, param: str | None, code: str | None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    return str(error["message"])


def assert_envelope_error(response: Any, status: int, code: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["result"] is None and body["success"] is False and body["messages"] == []
    assert [set(e) for e in body["errors"]] == [{"code", "message"}]
    assert body["errors"][0]["code"] == code
    return str(body["errors"][0]["message"])


def argmax(probabilities: dict[str, float]) -> str:
    return max(probabilities, key=probabilities.__getitem__)


def test_chat_answers_are_the_argmax_of_the_equivalent_systemone_request(client: TestClient) -> None:
    response = client.post(CHAT_PATH, json=CHAT)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["finish_reason"] == "stop"
    content = json.loads(out["choices"][0]["message"]["content"])

    equivalent, _ = to_systemone(parse_chat_request(CHAT))
    direct = client.post("/v1/systemone", json=equivalent).json()["answers"]
    assert out["x_decisions"] == direct
    assert content == {
        "team": argmax(direct["team"]["probabilities"]),
        "urgent": direct["urgent"]["noul"] >= 0.5,
        "priority": 1 + int(argmax(direct["priority"]["probabilities"])),
    }
    assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["completion_tokens"] == 0
    assert out["id"] == "chatcmpl-" + response.headers["x-request-id"]
    assert out["model"] == "clef"


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        ({"n": 3}, "n", "unsupported_value"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tools[0].function.parameters",
            "missing_schema",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_tools"),
        ({"response_format": {"type": "json_object"}}, "response_format", "missing_schema"),
        ({"response_format": None}, "response_format", "missing_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "t",
                        "schema": {"type": "object", "properties": {"why": {"type": "string"}}},
                    },
                }
            },
            "response_format.json_schema.schema.properties.why",
            "unsupported_schema",
        ),
        ({"messages": []}, "messages", "too_short"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
        (
            {"response_format": None, "tools": [TOOL], "tool_choice": "none"},
            "tool_choice",
            "unsupported_value",
        ),
    ],
)
def test_chat_errors_use_openai_shape_naming_the_field(
    client: TestClient, change: dict[str, Any], param: str, code: str
) -> None:
    body = {**CHAT, **change}
    message = assert_openai_error(client.post(CHAT_PATH, json=body), 400, param, code)
    assert message.startswith(param)


def test_chat_malformed_json_and_bodies_are_400_in_openai_shape(client: TestClient) -> None:
    bad = client.post(CHAT_PATH, content=b"{nope", headers={"content-type": "application/json"})
    assert_openai_error(bad, 400, None, "json_invalid")
    assert_openai_error(client.post(CHAT_PATH, json=[1, 2]), 400, None, "model_type")


def test_chat_over_the_token_limit_is_context_length_exceeded(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(max_input_tokens=24, on_overflow="reject")
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}
    assert_openai_error(served.client.post(CHAT_PATH, json=long), 400, "messages", "context_length_exceeded")


def test_auth_errors_are_shaped_per_route_and_systemone_keeps_its_own(
    serve_fake: Callable[..., Served],
) -> None:
    client = serve_fake(api_keys=("sekrit",)).client
    assert_openai_error(client.post(CHAT_PATH, json=CHAT), 401, None, "invalid_api_key")
    wrong = client.post(CHAT_PATH, json=CHAT, headers={"authorization": "Bearer nope"})
    assert_openai_error(wrong, 401, None, "invalid_api_key")
    assert wrong.headers["www-authenticate"].startswith("Bearer")
    ok = client.post(CHAT_PATH, json=CHAT, headers={"authorization": "Bearer sekrit"})
    assert ok.status_code == 200

    assert_envelope_error(client.post(WORKERS, json=SYSTEMONE), 401, 10000)
    assert client.post(WORKERS, json=SYSTEMONE, headers={"authorization": "Bearer sekrit"}).status_code == 200

    # The System One routes keep TypeSafe's shapes.
    detail = client.post("/v1/systemone", json=SYSTEMONE).json()["detail"]
    assert detail["error_type"] == "authentication_error"
    invalid = client.post("/v1/systemone", json={"state": "x"}, headers={"authorization": "Bearer sekrit"})
    assert invalid.status_code == 422 and invalid.json()["detail"][0]["loc"] == ["body", "questions"]


def test_chat_stream_is_one_chunk_then_done(client: TestClient) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    response = client.post(CHAT_PATH, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[len("data: ") :]) for event in events[:-1]]
    assert len(chunks) == 2
    plain = client.post(CHAT_PATH, json={**CHAT, "logprobs": True}).json()
    assert chunks[0]["choices"][0]["delta"]["content"] == plain["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]
    assert chunks[1]["usage"] == plain["usage"] and chunks[1]["choices"] == []


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "ticket"}}, "required", None]
)
def test_a_function_tool_is_answered_by_one_call_with_the_response_format_answers(
    client: TestClient, tool_choice: Any
) -> None:
    by_format = client.post(CHAT_PATH, json=CHAT).json()
    body = {key: value for key, value in CHAT.items() if key != "response_format"}
    body |= {"tools": [TOOL], "parallel_tool_calls": False}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    response = client.post(CHAT_PATH, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "ticket" and call["id"] == "call_" + response.headers["x-request-id"]
    assert call["function"]["arguments"] == by_format["choices"][0]["message"]["content"]
    assert response.json()["x_decisions"] == by_format["x_decisions"]


def test_a_client_retry_with_the_call_and_a_tool_message_in_its_history_is_answered(
    client: TestClient,
) -> None:
    first = client.post(CHAT_PATH, json={**CHAT, "tools": [TOOL], "tool_choice": "required"})
    first = first.json()["choices"][0]["message"]
    retry = {
        **CHAT,
        "tools": [TOOL],
        "tool_choice": "required",
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
            {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "priority must be 4"},
        ],
    }
    response = client.post(CHAT_PATH, json=retry)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_several_tools_without_a_named_choice_are_refused_naming_tool_choice(client: TestClient) -> None:
    other = {"type": "function", "function": {"name": "other", "parameters": SCHEMA}}
    body = {**CHAT, "tools": [TOOL, other], "tool_choice": "required"}
    assert "2 tools were given" in assert_openai_error(
        client.post(CHAT_PATH, json=body), 400, "tool_choice", "ambiguous_tool"
    )
    body["tool_choice"] = {"type": "function", "function": {"name": "other"}}
    assert (
        client.post(CHAT_PATH, json=body).json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"]
        == "other"
    )


def test_a_streamed_tool_call_is_the_call_then_its_finish_reason(client: TestClient) -> None:
    body = {**CHAT, "tools": [TOOL], "tool_choice": "required", "stream": True}
    events = [line for line in client.post(CHAT_PATH, json=body).text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    first, finish = (json.loads(event[len("data: ") :]) for event in events[:-1])
    (call,) = first["choices"][0]["delta"]["tool_calls"]
    assert (
        call["index"] == 0
        and call["function"]["name"] == "ticket"
        and json.loads(call["function"]["arguments"])
    )
    assert finish["choices"][0]["finish_reason"] == "tool_calls"


def test_unknown_v1_routes_and_wrong_methods_on_openai_routes_answer_in_openai_shape(
    client: TestClient,
) -> None:
    missing = client.post("/v1/embeddings", json={})
    assert "/v1/embeddings" in assert_openai_error(missing, 404, None, "unknown_url")
    assert_openai_error(client.get(CHAT_PATH), 405, None, "method_not_allowed")
    # Everything else keeps the server's own shape.
    assert client.get("/nope").json()["detail"]["error_type"] == "not_found_error"
    assert client.get("/v1/systemone").json()["detail"]["error_type"] == "method_not_allowed"


@pytest.mark.parametrize(
    "model", ["@cf/cloudflare/clef-flash", "@cf/cloudflare/clef", "%40cf/cloudflare/clef-flash"]
)
def test_workers_ai_route_answers_in_the_envelope(client: TestClient, model: str) -> None:
    response = client.post(f"/client/v4/accounts/acc-{len(model)}/ai/run/{model}", json=SYSTEMONE)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    direct = client.post("/v1/systemone", json=SYSTEMONE).json()
    assert body["result"]["answers"] == direct["answers"]
    assert body["result"]["usage"] == direct["usage"]
    assert "x-request-id" in response.headers


def test_workers_ai_route_errors(client: TestClient) -> None:
    message = assert_envelope_error(
        client.post("/client/v4/accounts/a/ai/run/@cf/meta/llama-3", json=SYSTEMONE), 400, 5007
    )
    assert "@cf/meta/llama-3" in message
    # a newline in the model path (found by schema fuzzing) is an unknown model too, not a bare 404
    assert_envelope_error(client.post("/client/v4/accounts/a/ai/run/@cf/x%0Ay", json=SYSTEMONE), 400, 5007)
    bad = {"state": "x", "questions": {"q": {"type": "choice", "criteria": {"only": None}}}}
    message = assert_envelope_error(client.post(WORKERS, json=bad), 422, 5006)
    assert message.startswith("questions.q.criteria")
    assert_envelope_error(
        client.post(WORKERS, content=b"{", headers={"content-type": "application/json"}), 422, 5006
    )
    assert_envelope_error(client.post(WORKERS, content=b"x", headers={"content-encoding": "br"}), 415, 3003)


def test_workers_ai_body_limit_is_3006(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(max_body_bytes=64).client
    assert_envelope_error(client.post(WORKERS, json={**SYSTEMONE, "pad": "x" * 100}), 413, 3006)


def test_models_shows_the_confidence_mode(client: TestClient) -> None:
    entry = client.get("/v1/models").json()["data"][0]
    assert entry["confidence"] == "seed"


def test_metrics_label_the_workers_ai_route_by_its_template(client: TestClient) -> None:
    client.post(WORKERS, json=SYSTEMONE)
    client.post(CHAT_PATH, json=CHAT)
    metrics = client.get("/metrics").text
    assert 'route="/client/v4/accounts/{account_id}/ai/run/{model_path}"' in metrics
    assert 'route="/v1/chat/completions"' in metrics
    assert "0123abcd" not in metrics


def test_openapi_documents_the_new_routes(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert CHAT_PATH in spec["paths"]
    assert "/client/v4/accounts/{account_id}/ai/run/{model_path}" in spec["paths"]
    assert "ChatCompletionRequest" in spec["components"]["schemas"]
