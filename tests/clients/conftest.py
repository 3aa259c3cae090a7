"""One live server (the tiny model, auth on with the key ``test-key``) for all the client suites."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clef_runtime.engine.clef import Clef
from tests.clients.common import KEY
from tests.live_server import Live


@pytest.fixture(scope="package")
def engine() -> Clef:
    return Clef.load("tiny", dtype="fp32")


@pytest.fixture(scope="package")
def live(engine: Clef) -> Iterator[Live]:
    served = Live(engine, key=KEY, api_keys=(KEY,))
    yield served
    served.stop()
