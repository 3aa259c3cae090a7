"""Operational routes: ``/health``, ``/ready``, ``/metrics`` and ``GET /v1/models``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from clef_runtime import __version__
from clef_runtime.server.handling import ERROR_RESPONSES, authenticate, runtime_of
from clef_runtime.server.metrics import CONTENT_TYPE

__all__ = ["UNKNOWN_RELEASE_DATE", "router"]

router = APIRouter()

UNKNOWN_RELEASE_DATE = "1970-01-01"
"""Reported for a model without a release date (the built-in tiny model): the Jev model card requires a
YYYY-MM-DD string."""

_STARTED = time.time()


@router.get("/health", summary="Liveness: 200 while the process runs, with the loading state")
@router.head("/health", include_in_schema=False)
async def health(request: Request) -> dict[str, Any]:
    """Always 200 while the process is alive; ``state`` is ``loading``, ``ready``, ``failed`` or
    ``stopping``."""
    runtime = runtime_of(request)
    engine = runtime.engine
    return {
        "status": "ok",
        "state": runtime.state,
        "ready": runtime.state == "ready",
        "model": getattr(engine, "name", None) or runtime.settings.model,
        "queue_depth": runtime.queue_depth(),
        "version": __version__,
    }


@router.get(
    "/ready",
    summary="Readiness: 200 once the model is loaded and warmed, else 503",
    responses={503: ERROR_RESPONSES[503]},
)
@router.head("/ready", include_in_schema=False)
async def ready(request: Request) -> dict[str, Any]:
    """200 ``{"status": "ready", "model"}`` when decisions can be served; 503 ``not_ready`` otherwise."""
    runtime = runtime_of(request)
    engine = runtime.require_ready()
    return {"status": "ready", "model": engine.name}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """The Prometheus text exposition (requests, latency, tokens, batches, queue)."""
    return Response(runtime_of(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get(
    "/v1/models",
    summary="The served model (Jev's `models` list plus an OpenAI-style `data` list)",
    responses={401: ERROR_RESPONSES[401], 503: ERROR_RESPONSES[503]},
)
async def models(request: Request) -> JSONResponse:
    """``{"object": "list", "models": [{name, description, release_date}], "data": [{id, object, ...,
    confidence}]}``; ``confidence`` is the engine's ``--confidence`` mode (the Jev card keeps its fields)."""
    authenticate(request)
    runtime = runtime_of(request)
    engine = runtime.require_ready()
    release_date = getattr(engine, "release_date", None) or UNKNOWN_RELEASE_DATE
    untrained = bool(getattr(engine, "untrained", False))
    # The confidence definition of choice/score answers (--confidence): clients can check it is theirs.
    confidence = getattr(getattr(engine, "options", None), "confidence", "seed")
    card = {"name": engine.name, "description": engine.description, "release_date": release_date}
    openai_entry = {
        "id": engine.name,
        "object": "model",
        "created": int(_STARTED),
        "owned_by": "clef-runtime" if untrained else "cloudflare",
        "max_input_tokens": runtime.settings.input_token_limit,
        "confidence": confidence,
    }
    return JSONResponse({"object": "list", "models": [card], "data": [openai_entry]})
