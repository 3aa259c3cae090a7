"""API keys: accepted from either header, 401 otherwise, health and readiness open."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from clef_runtime.server.auth import NamedKey, parse_key
from tests.server.conftest import Served
from tests.server.helpers import REQUEST, assert_error_shape, post


def test_authorization_header_is_ignored_when_auth_is_off(client: TestClient) -> None:
    for headers in (
        {"authorization": "Bearer whatever"},
        {"authorization": "Basic Zm9vOmJhcg=="},
        {"x-api-key": "k"},
    ):
        assert post(client, REQUEST, headers=headers).status_code == 200


@pytest.fixture
def secured(serve_fake: Callable[..., Served]) -> TestClient:
    return serve_fake(api_keys=("key-one", "schlüssel-zwei")).client


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": "Bearer key-one"},
        {"authorization": "bearer   key-one "},
        {"x-api-key": "key-one"},
        {"authorization": "Bearer schlüssel-zwei".encode()},  # UTF-8 bytes on the wire
        {"authorization": "Bearer key-one", "x-api-key": "key-one"},  # systemone-client sends both
    ],
)
def test_a_configured_key_is_accepted_from_either_header(
    secured: TestClient, headers: dict[str, str]
) -> None:
    assert post(secured, REQUEST, headers=headers).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer nope"},
        {"authorization": "Bearer key-one-and-more"},
        {"authorization": "Bearer key-on"},
        {"authorization": "Basic a2V5LW9uZQ=="},
        {"x-api-key": "KEY-ONE"},
        {"authorization": "Bearer "},
    ],
)
def test_a_missing_or_wrong_key_gets_401_authentication_error(
    secured: TestClient, headers: dict[str, str]
) -> None:
    response = post(secured, REQUEST, headers=headers)
    assert_error_shape(response, 401, "authentication_error")
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "x-request-id" in response.headers


def test_auth_guards_models_but_not_health(secured: TestClient) -> None:
    assert secured.get("/v1/models").status_code == 401
    assert secured.get("/v1/models", headers={"x-api-key": "key-one"}).status_code == 200
    assert post(secured, {"input": "x", "questions": []}, "/v1/decisions").status_code == 401
    assert secured.get("/health").status_code == 200
    assert secured.get("/ready").status_code == 200


def test_a_value_with_a_colon_is_name_and_key_and_a_bad_name_is_refused_without_echoing_the_key() -> None:
    assert parse_key("alice:k1:more", 1) == NamedKey("alice", "k1:more")
    assert parse_key("plain-key", 3) == NamedKey("key-3", "plain-key")
    for value in ("bad name:s3cret", ":s3cret", "a/b:s3cret", "x" * 65 + ":s3cret"):
        with pytest.raises(ValueError, match="NAME:KEY") as info:
            parse_key(value, 2)
        assert "s3cret" not in str(info.value)
    with pytest.raises(ValueError, match="empty"):
        parse_key("alice:", 1)
