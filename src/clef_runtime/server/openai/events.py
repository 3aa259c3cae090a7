"""Server-sent events, as OpenAI's streaming replies send them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi.responses import Response

__all__ = ["event_stream"]


def event_stream(
    events: Iterable[Mapping[str, Any]], headers: Mapping[str, str], *, named: bool, done: bool
) -> Response:
    """One ``text/event-stream`` response of ``events``, each a ``data:`` line of its JSON (after an
    ``event: <type>`` line when ``named``: the Responses stream), ending with ``data: [DONE]`` when ``done``
    (chat completions). The decision is finished before the first event, so errors stay JSON."""
    parts = [
        (f"event: {event['type']}\n" if named else "") + f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        for event in events
    ]
    if done:
        parts.append("data: [DONE]\n\n")
    return Response("".join(parts), media_type="text/event-stream", headers=dict(headers))
