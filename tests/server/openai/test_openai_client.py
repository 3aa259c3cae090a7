"""The official ``openai`` client against a live loopback server running the tiny model: ``create`` with a
raw JSON schema, ``parse`` with a Pydantic model, streaming, logprobs, images, errors; the answers equal
the argmax of the equivalent (hand-written) /v1/systemone request; and each confidence mode over HTTP
against its formula on the engine's unrounded probabilities.

One tiny engine is loaded for the module (about 10 s); the confidence servers share its weights.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import math
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from clef_runtime.engine.clef import Clef
from tests.clients.common import MESSAGES, QUESTIONS, USER, Mood, Ticket
from tests.live_server import Live, first_max, systemone

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "team": {
            "type": "string",
            "enum": ["billing", "tech", "sales"],
            "description": "Which team handles it?",
        },
        "refund": {"type": "boolean", "description": "Is a refund requested?"},
        "urgency": {"type": "integer", "minimum": 1, "maximum": 3, "description": "How urgent, 1 to 3"},
    },
    "required": ["team", "refund", "urgency"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True}}
# The same decision written by hand in System One (independent of the mapping under test).
EQUIVALENT = {
    "state": MESSAGES,
    "questions": {k: v for k, v in QUESTIONS.items() if k in SCHEMA["properties"]},
}


@pytest.fixture(scope="module")
def engine() -> Clef:
    return Clef.load("tiny", dtype="fp32")


@pytest.fixture(scope="module")
def servers(engine: Clef) -> Iterator[dict[str, Live]]:
    """One server per confidence mode; the engines share the loaded weights."""
    started: dict[str, Live] = {}
    try:
        for mode in ("seed", "typesafe", "workers-ai"):
            own = Clef(engine.model, engine.options.replace(confidence=mode))
            started[mode] = Live(own, api_keys=("test-key",))
        yield started
    finally:
        for live in started.values():
            live.stop()


@pytest.fixture(scope="module")
def client(servers: dict[str, Live]) -> openai.OpenAI:
    return openai.OpenAI(api_key="test-key", base_url=servers["seed"].url + "/v1", max_retries=0, timeout=120)


def test_create_with_a_raw_schema_equals_the_argmax_of_system_one(
    client: openai.OpenAI, servers: dict[str, Live]
) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT, temperature=0.9, seed=3
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and completion.object == "chat.completion"
    content = json.loads(choice.message.content or "")
    direct = systemone(servers["seed"], EQUIVALENT)["answers"]
    assert content == {
        "team": first_max(direct["team"]["probabilities"]),
        "refund": direct["refund"]["noul"] >= 0.5,
        "urgency": 1 + int(first_max(direct["urgency"]["probabilities"])),
    }
    decisions = completion.model_extra["x_decisions"]  # type: ignore[index]
    assert decisions["team"]["probabilities"] == pytest.approx(direct["team"]["probabilities"], abs=2e-4)
    assert completion.usage is not None and completion.usage.completion_tokens == 0
    assert completion.usage.prompt_tokens == systemone(servers["seed"], EQUIVALENT)["usage"]["input_tokens"]


def test_parse_with_a_pydantic_model(client: openai.OpenAI, servers: dict[str, Live]) -> None:
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Ticket)
    ticket = completion.choices[0].message.parsed
    assert isinstance(ticket, Ticket)
    assert ticket.team in ("billing", "tech", "sales") and isinstance(ticket.mood, Mood)
    assert isinstance(ticket.refund, bool) and 1 <= ticket.urgency <= 3
    equivalent = copy.deepcopy(EQUIVALENT)
    equivalent["questions"] = {
        "team": equivalent["questions"]["team"],
        "mood": {
            "type": "choice",
            "instructions": "How does the customer feel?",
            "criteria": {"calm": None, "annoyed": None, "furious": None},
        },
        "refund": equivalent["questions"]["refund"],
        "urgency": equivalent["questions"]["urgency"],
    }
    direct = systemone(servers["seed"], equivalent)["answers"]
    assert ticket.model_dump(mode="json") == {
        "team": first_max(direct["team"]["probabilities"]),
        "mood": first_max(direct["mood"]["probabilities"]),
        "refund": direct["refund"]["noul"] >= 0.5,
        "urgency": 1 + int(first_max(direct["urgency"]["probabilities"])),
    }


def test_streaming_gives_the_same_content(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(content) == json.loads(plain.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]

    with client.chat.completions.stream(model="tiny", messages=MESSAGES, response_format=Ticket) as events:
        final = events.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Ticket)


def test_logprobs_carry_every_option(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT, logprobs=True, top_logprobs=5
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    decisions = completion.model_extra["x_decisions"]  # type: ignore[index]
    team, refund, urgency = logprobs.content
    assert [t.token for t in team.top_logprobs] == ['"billing"', '"tech"', '"sales"']
    assert [round(math.exp(t.logprob), 4) for t in team.top_logprobs] == pytest.approx(
        list(decisions["team"]["probabilities"].values()), abs=1e-4
    )
    assert [t.token for t in refund.top_logprobs] == ["true", "false"]
    assert [t.token for t in urgency.top_logprobs] == ["1", "2", "3"]
    content = json.loads(completion.choices[0].message.content or "")
    assert team.token == json.dumps(content["team"]) and urgency.token == str(content["urgency"])


def test_unsupported_schemas_are_bad_requests_naming_the_property(client: openai.OpenAI) -> None:
    for prop, words in [
        ({"type": "string"}, "free string"),
        ({"type": "number"}, "a number"),
        ({"type": "object", "properties": {}}, "nested object"),
        ({"type": "array", "items": {"type": "string"}}, "an array"),
        ({"type": "integer", "minimum": 0, "maximum": 100}, "spans 101"),
    ]:
        schema = {"type": "object", "properties": {"team": SCHEMA["properties"]["team"], "extra": prop}}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
            )
        assert info.value.status_code == 400
        assert info.value.param == "response_format.json_schema.schema.properties.extra"
        assert info.value.code == "unsupported_schema" and words in info.value.message

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT, n=2)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES)
    assert info.value.param == "response_format"


def test_a_wrong_key_is_an_authentication_error(servers: dict[str, Live]) -> None:
    wrong = openai.OpenAI(api_key="nope", base_url=servers["seed"].url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT)


def _png_data_url(seed: int) -> str:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_image_parts_are_read_and_bad_ones_named(client: openai.OpenAI) -> None:
    text_only = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT
    )
    with_image = client.chat.completions.create(
        model="tiny",
        messages=[
            MESSAGES[0],
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": USER},
                    {"type": "image_url", "image_url": {"url": _png_data_url(1)}},
                ],
            },
        ],
        response_format=RESPONSE_FORMAT,
    )
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "x"},
                        {"type": "image_url", "image_url": {"url": "https://a/b.png"}},
                    ],
                }
            ],
            response_format=RESPONSE_FORMAT,
        )
    assert info.value.param == "messages[0].content[1]" and info.value.code == "image_url_not_allowed"


def _seed(p: list[float]) -> float:
    return max(p)


def _typesafe_choice(p: list[float]) -> float:
    return (max(p) - 1 / len(p)) / (1 - 1 / len(p))


def _typesafe_score(p: list[float]) -> float:
    n, k = len(p), p.index(max(p))
    mad = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1 - sum(pi * abs(i - k) for i, pi in enumerate(p)) / mad)


def _workers_ai(p: list[float]) -> float:
    return (len(p) * sum(x * x for x in p) - 1) / (len(p) - 1)


FORMULAS = {
    "seed": (_seed, _seed),
    "typesafe": (_typesafe_choice, _typesafe_score),
    "workers-ai": (_workers_ai, _workers_ai),
}


@pytest.mark.parametrize("mode", ["seed", "typesafe", "workers-ai"])
def test_confidence_modes_over_http(engine: Clef, servers: dict[str, Live], mode: str) -> None:
    live = servers[mode]
    models = httpx.get(live.url + "/v1/models", headers={"authorization": "Bearer test-key"}).json()
    assert models["data"][0]["confidence"] == mode

    body = {
        "state": USER,
        "questions": {
            "team": EQUIVALENT["questions"]["team"],
            "urgency": {
                "type": "score",
                "instructions": "How urgent?",
                "criteria": ["low", "mid", "high", "now"],
            },
        },
    }
    # The engine's unrounded probabilities (model order: choice ids sorted, score levels 0..n-1).
    probs = engine.probabilities_encoded([engine.prepare(body)])[0]
    team_sorted = dict(zip(sorted(["billing", "tech", "sales"]), probs[0], strict=True))
    team = [team_sorted[k] for k in ("billing", "tech", "sales")]
    urgency = list(probs[1])
    choice_formula, score_formula = FORMULAS[mode]

    answers = systemone(live, body)["answers"]
    assert answers["team"]["confidence"] == pytest.approx(choice_formula(team), abs=2e-4)
    assert answers["urgency"]["confidence"] == pytest.approx(score_formula(urgency), abs=2e-4)

    workers = httpx.post(
        live.url + "/client/v4/accounts/abc/ai/run/@cf/cloudflare/clef-flash",
        json=body,
        headers={"authorization": "Bearer test-key"},
        timeout=120,
    ).json()
    assert workers["success"] is True
    assert workers["result"]["answers"]["team"]["confidence"] == pytest.approx(choice_formula(team), abs=2e-4)
