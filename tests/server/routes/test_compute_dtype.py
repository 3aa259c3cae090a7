"""The compute dtype is visible where operators look: ``/v1/models`` (``compute_dtype`` on every OpenAI-style
entry; the Jev card keeps its exact shape) and ``/status.json``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from clef_runtime.engine.clef import Clef
from tests.server.conftest import Served


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_models_and_status_say_which_dtype_computes(serve_fake: Callable[..., Served], dtype: str) -> None:
    served = serve_fake(engine=Clef.load("tiny", dtype=dtype, cache_mb=0))
    models = served.client.get("/v1/models").json()
    assert [entry["compute_dtype"] for entry in models["data"]] == [dtype]
    assert set(models["models"][0]) == {"name", "description", "release_date"}
    assert served.client.get("/status.json").json()["compute_dtype"] == dtype
    answer = served.client.post(
        "/v1/systemone", json={"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
    )
    assert answer.status_code == 200, answer.text
