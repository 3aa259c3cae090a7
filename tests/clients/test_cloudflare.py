"""Cloudflare's Python SDK (``cloudflare``) against the live server's Workers AI route: ``ai.run`` with the
System One body in ``extra_body``, through ``base_url=<server>/client/v4`` and the API key as its API token.
The SDK unwraps Cloudflare's envelope; the answers are the server's /v1/systemone answers to the same
body."""

from __future__ import annotations

import cloudflare
import pytest
from cloudflare import Cloudflare

from tests.clients.common import KEY, MESSAGES, QUESTIONS, argmax_ticket, decided
from tests.live_server import Live

pytestmark = pytest.mark.slow


def client(live: Live, token: str = KEY) -> Cloudflare:
    return Cloudflare(api_token=token, base_url=f"{live.url}/client/v4", max_retries=0)


@pytest.mark.parametrize("model", ["@cf/cloudflare/clef-flash", "@cf/cloudflare/clef"])
def test_ai_run_answers_as_system_one(live: Live, model: str) -> None:
    since = len(live.exchanges)
    result = client(live).ai.run(
        model, account_id="local", extra_body={"state": MESSAGES, "questions": QUESTIONS}
    )
    (exchange,) = [e for e in live.exchanges[since:] if e.path.startswith("/client/v4/")]
    assert exchange.status == 200 and exchange.reply()["success"] is True, exchange.describe()
    assert isinstance(result, dict), result
    direct = decided(live, MESSAGES)
    assert argmax_ticket(result["answers"]) == argmax_ticket(direct["answers"])
    for name in ("team", "mood", "urgency"):
        assert result["answers"][name]["probabilities"] == pytest.approx(
            direct["answers"][name]["probabilities"], abs=2e-4
        )
    assert result["usage"]["input_tokens"] == direct["usage"]["input_tokens"]


def test_a_wrong_token_is_an_authentication_error(live: Live) -> None:
    with pytest.raises(cloudflare.AuthenticationError) as info:
        client(live, "wrong").ai.run(
            "@cf/cloudflare/clef-flash", account_id="local", extra_body={"state": "s", "questions": QUESTIONS}
        )
    assert info.value.status_code == 401
    assert info.value.body["errors"][0]["code"] == 10000  # type: ignore[index]
