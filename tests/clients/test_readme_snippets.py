"""The README's client snippets ("Clients", and the openai one in the Chat Completions section) run as
written against a live server with the tiny model and auth off (what `clef serve --model tiny` is), the
instructor one in instructor's pinned environment; each prints the answer the server sent."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from clef_runtime.engine.clef import Clef
from tests.clients.envs import run_in_env
from tests.live_server import Exchange, Live
from tests.readme_snippets import README_URL, python_snippets, run_snippet

pytestmark = pytest.mark.slow

CLIENTS = ["openai", "instructor", "litellm", "langchain", "pydantic-ai", "cloudflare"]
TICKET = re.compile(r"team='(billing|tech|sales)' refund=(True|False) urgency=([123])")


@pytest.fixture(scope="module")
def served(engine: Clef) -> Any:
    live = Live(engine)  # no api_keys: auth off, as `clef serve --model tiny`
    yield live
    live.stop()


def snippet(client: str) -> str:
    snippets = dict(zip(CLIENTS, python_snippets("Clients"), strict=True))
    return snippets[client]


def printed_ticket(out: str) -> dict[str, Any]:
    match = TICKET.fullmatch(out.strip().splitlines()[-1])
    assert match is not None, out
    team, refund, urgency = match.groups()
    return {"team": team, "refund": refund == "True", "urgency": int(urgency)}


def answered(exchange: Exchange) -> dict[str, Any]:
    """The JSON object of answers a chat completion carried (its content, or its one tool call)."""
    assert exchange.status == 200, exchange.describe()
    message = exchange.reply()["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    return json.loads(calls[0]["function"]["arguments"] if calls else message["content"])


def only_chat(live: Live, since: int) -> Exchange:
    (exchange,) = live.calls("/v1/chat/completions", since)
    return exchange


@pytest.mark.parametrize("client", ["openai", "litellm", "langchain", "pydantic-ai"])
def test_a_snippet_prints_the_servers_answer(served: Live, client: str) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # as the README says, for an offline CI
    since = len(served.exchanges)
    ticket = printed_ticket(run_snippet(snippet(client), served.url))
    assert ticket == answered(only_chat(served, since))


def test_the_instructor_snippet_runs_in_its_pinned_environment(served: Live, tmp_path: Path) -> None:
    code = snippet("instructor")
    assert README_URL in code
    script = tmp_path / "readme_instructor.py"
    script.write_text(code.replace(README_URL, served.url))
    since = len(served.exchanges)
    ticket = printed_ticket(run_in_env("instructor", script))
    exchange = only_chat(served, since)
    assert exchange.json()["tool_choice"] == {"type": "function", "function": {"name": "Ticket"}}
    assert ticket == answered(exchange)


def test_the_cloudflare_snippet(served: Live) -> None:
    since = len(served.exchanges)
    out = run_snippet(snippet("cloudflare"), served.url)
    (exchange,) = [e for e in served.exchanges[since:] if e.path.startswith("/client/v4/")]
    assert ast.literal_eval(out.strip()) == exchange.reply()["result"]["answers"]["refund"]


def test_the_openai_response_format_snippet(served: Live) -> None:
    (code,) = python_snippets("`POST /v1/chat/completions`: structured outputs as one decision")
    since = len(served.exchanges)
    parsed, decision = run_snippet(code, served.url).strip().splitlines()
    answer = answered(only_chat(served, since))
    assert parsed == (
        f"team={answer['team']!r} mood=<Mood.{answer['mood']}: {answer['mood']!r}> "
        f"refund={answer['refund']} urgency={answer['urgency']}"
    )
    assert ast.literal_eval(decision)["choice"] == answer["team"]
