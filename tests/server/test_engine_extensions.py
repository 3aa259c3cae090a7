"""What the server hands the engine, and the engine's cache counters on /metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devtools.fake_engine import FakeClef

from tests.server.conftest import Served
from tests.server.helpers import REQUEST, post


class RecordingEngine(FakeClef):
    """Keeps every item the server hands to ``decide_encoded``, and reports cache counters."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[Any] = []

    def decide_encoded(self, items: Any) -> list[dict[str, Any]]:
        self.items.extend(items)
        return super().decide_encoded(items)

    def cache_stats(self) -> dict[str, int]:
        return {
            "hits": 3,
            "partials": 2,
            "misses": 1,
            "entries": 2,
            "points": 2,
            "bytes": 4096,
            "capacity_bytes": 8192,
            "tokens_saved": 90,
            "reused_tokens": 70,
        }


def test_the_engine_gets_what_its_prepare_returned(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(RecordingEngine())
    body = {**REQUEST, "images": ["data:image/png;base64,AAAA"]}
    response = post(served.client, body)
    assert response.status_code == 200
    (image,) = served.engine.items[0].images  # not dropped on the way
    assert (image.data, image.content_type, image.loc) == (b"\x00\x00\x00", "image/png", ("images", 0))
    assert response.json()["answers"] == FakeClef().decide(REQUEST)["answers"]


def test_engine_cache_statistics_are_exported(serve_fake: Callable[..., Served]) -> None:
    text = serve_fake(RecordingEngine()).client.get("/metrics").text
    assert "clef_cache_hits_total 3.0" in text
    assert "clef_cache_tokens_saved_total 90.0" in text
    assert "clef_cache_partials_total 2.0" in text and "clef_cache_reused_tokens_total 70.0" in text
    assert "clef_cache_points 2.0" in text
    assert "# TYPE clef_cache_entries gauge" in text and "clef_cache_bytes 4096.0" in text
