"""API keys: accepted from either header, 401 otherwise, health and readiness open."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from clef_runtime.server.auth import NamedKey, parse_key
from clef_runtime.server.settings import SettingsError, server_settings
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


def test_keys_from_a_key_file_are_accepted_beside_the_flags_keys(
    serve_fake: Callable[..., Served], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# mounted from a secret\nalice:from-file\n\n  bare-from-file  \n", encoding="utf-8")
    served = serve_fake(api_keys=("flag-key",), api_key_file=str(keys))
    assert served.settings.accepted_api_keys == ("flag-key", "alice:from-file", "bare-from-file")
    for key in ("flag-key", "from-file", "bare-from-file"):
        assert post(served.client, REQUEST, headers={"authorization": f"Bearer {key}"}).status_code == 200
    for key in ("alice:from-file", "# mounted from a secret", ""):
        assert post(served.client, REQUEST, headers={"x-api-key": key}).status_code == 401
    assert "from-file" not in str(served.settings.redacted())


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "cannot be read (No such file or directory)"),
        ("", "holds no key"),
        ("# only a comment\n\n", "holds no key"),
        ("bad name:k\n", "the name 'bad name' is not one"),
    ],
)
def test_a_key_file_that_is_missing_empty_or_malformed_is_refused(
    content: str | None, needle: str, tmp_path: Path
) -> None:
    # An empty secret must not silently turn auth off.
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SettingsError, match=re.escape(needle)):
        server_settings("tiny", api_key_file=str(path))
