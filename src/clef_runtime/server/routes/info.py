"""Operational routes: ``/health``, ``/ready``, ``/metrics`` and ``GET /v1/models``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from clef_runtime.server.admission import authenticate
from clef_runtime.server.engine_queries import EngineQueryError
from clef_runtime.server.errors import ERROR_RESPONSES, ApiError
from clef_runtime.server.feature import Feature
from clef_runtime.server.metrics import CONTENT_TYPE
from clef_runtime.server.openapi import json_example
from clef_runtime.server.runtime import runtime_of
from clef_runtime.version import __version__

__all__ = ["FEATURE", "UNKNOWN_RELEASE_DATE", "router"]

router = APIRouter()

UNKNOWN_RELEASE_DATE = "1970-01-01"
"""Reported for a model without a release date (the built-in tiny model): the Jev model card requires a
YYYY-MM-DD string."""

_STARTED = time.time()


@router.get(
    "/health",
    summary="Liveness: 200 while the process runs, with the loading state",
    description="Answers 200 as long as the process runs, also while the model is still loading: use it as a "
    "liveness probe. `state` is `loading`, `ready`, `failed` or `stopping`. No API key needed.",
    responses={
        200: json_example(
            "The process is alive",
            {
                "status": "ok",
                "state": "ready",
                "ready": True,
                "model": "clef-flash",
                "queue_depth": 0,
                "version": __version__,
            },
        )
    },
)
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
        "model": runtime.settings.model if engine is None else engine.name,
        "queue_depth": runtime.queue_depth(),
        "version": __version__,
    }


_FUSED_EXAMPLE = {
    "in_use": True,
    "device": "cuda:0",
    "reason": "in_use",
    "calls": {"fused": 96, "reference": 0},
    "conv": "fla",
}
"""What a CUDA server with the fused DeltaNet kernels reports after warm-up (``fused_kernels``)."""


@router.get(
    "/ready",
    summary="Readiness: 200 once the model is loaded and warmed, else 503",
    description="200 once decisions can be served; 503 with `Retry-After` while the model loads (or after it "
    "failed to load), and with model replicas (`clef serve --ray`) while none runs or the cluster cannot say "
    "within a few seconds. Use it as a readiness probe. No API key needed. `fused_kernels` says whether the "
    "fused DeltaNet kernels run, from the calls counted so far (`reason`: `in_use`, `partial`, `fallback`, "
    "`not_installed`, `no_calls`, `disabled`, `cpu`, `replicas`, `unknown`; `calls`: fused and reference "
    "DeltaNet calls; `conv`: `causal_conv1d`, `fla` or `reference`).",
    responses={
        200: json_example(
            "Ready for decisions", {"status": "ready", "model": "clef-flash", "fused_kernels": _FUSED_EXAMPLE}
        ),
        503: ERROR_RESPONSES[503],
    },
)
@router.head("/ready", include_in_schema=False)
async def ready(request: Request) -> dict[str, Any]:
    """200 ``{"status": "ready", "model", "fused_kernels"}`` when decisions can be served; 503 ``not_ready``
    otherwise. ``fused_kernels`` is read from the calls counted when the request comes."""
    runtime = runtime_of(request)
    engine = runtime.require_ready()
    body: dict[str, Any] = {
        "status": "ready",
        "model": engine.name,
        "fused_kernels": runtime.metrics.decisions.fused_now().as_api(),
    }
    try:
        # It may ask a cluster: bounded in threads and time (server.engine_queries).
        replicas = await runtime.engine_queries.ask(engine.replica_status)
    except EngineQueryError as exc:
        # A cluster that cannot say how many replicas run (Serve's controller busy, the application being
        # deployed or replaced) cannot promise an answer either.
        raise ApiError(
            503, "not_ready", f"the model replicas cannot be counted: {exc}", headers={"Retry-After": "5"}
        ) from None
    if replicas is not None:
        body["replicas"] = {"up": replicas.up, "target": replicas.target}
        if replicas.up == 0:
            raise ApiError(503, "not_ready", "no model replica is running", headers={"Retry-After": "5"})
    return body


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    description="Requests, latency, tokens, batches, queue depth and state-cache counters in the Prometheus "
    "text format (all names start with `clef_`). No API key needed.",
    response_class=Response,
)
async def metrics(request: Request) -> Response:
    """The Prometheus text exposition (requests, latency, tokens, batches, queue, state cache)."""
    return Response(await runtime_of(request).render_metrics(), media_type=CONTENT_TYPE)


@router.get(
    "/v1/models",
    summary="The served model (Jev's `models` list plus an OpenAI-style `data` list)",
    description="The one model this server runs, as TypeSafe's SDK (`models`) and OpenAI's (`data`) expect "
    "it. Any model name is accepted in a decision request; this is the one that answers.",
    responses={
        200: json_example(
            "The served model",
            {
                "object": "list",
                "models": [
                    {
                        "name": "clef-flash",
                        "description": "clef-flash: Cloudflare's Clef decision model",
                        "release_date": "2026-10-01",
                    }
                ],
                "data": [
                    {
                        "id": "clef-flash",
                        "object": "model",
                        "created": 1764547200,
                        "owned_by": "cloudflare",
                        "max_input_tokens": 16384,
                        "compute_dtype": "bf16",
                        "fused_kernels": _FUSED_EXAMPLE,
                    }
                ],
            },
        ),
        401: ERROR_RESPONSES[401],
        503: ERROR_RESPONSES[503],
    },
)
async def models(request: Request) -> JSONResponse:
    """``{"object": "list", "models": [{name, description, release_date}], "data": [{id, object, ...,
    x_calibration, confidence}]}``; ``x_calibration``: the calibration applied to answers (label, file,
    sha256, temperatures) or null; ``confidence``: the engine's ``--confidence`` mode; ``fused_kernels``:
    whether the fused DeltaNet kernels run, read from the calls counted now (as ``/ready``). The Jev card
    keeps its exact shape. Each tuned head (``--head NAME=DIR``, ``POST /v1/heads``) follows the base model
    in both lists; every ``data`` entry has ``x_head`` (base model and the head's card: name, digest,
    source, directory)."""
    authenticate(request)
    runtime = runtime_of(request)
    engine = runtime.require_ready()
    model = engine.card.model
    release_date = model.release_date or UNKNOWN_RELEASE_DATE
    untrained = model.untrained
    calibration = engine.card.calibration
    # The confidence definition of choice/score answers (--confidence): clients can check it is theirs.
    confidence = engine.card.options.confidence
    card = {"name": engine.name, "description": model.description, "release_date": release_date}
    openai_entry = {
        "id": engine.name,
        "object": "model",
        "created": int(_STARTED),
        "owned_by": "clef-runtime" if untrained else "cloudflare",
        "max_input_tokens": runtime.settings.input_token_limit,
        "x_calibration": dict(calibration) if calibration is not None else None,
        "confidence": confidence,
        # The backbone's compute dtype (--dtype): bf16 answers drift slightly from the fp32 reference.
        "compute_dtype": engine.card.compute_dtype,
        "fused_kernels": runtime.metrics.decisions.fused_now().as_api(),
    }
    heads = engine.head_infos()
    default = next(info for info in heads if info.default)
    # The base model's entry names the default head (the release's, or a bare --head DIR replacing it).
    openai_entry["x_head"] = {"base_model": engine.name, **default.as_api()}
    models, data = [card], [openai_entry]
    for head in heads:
        if head.default:
            continue
        # A tuned head on the same backbone: a request whose model is its name is answered by it.
        models.append(
            {
                "name": head.name,
                "description": f"a tuned head on {engine.name}'s backbone (model={head.name!r} picks it)",
                "release_date": release_date,
            }
        )
        data.append(
            {
                **openai_entry,
                "id": head.name,
                "owned_by": "clef-runtime",
                "x_calibration": dict(head.calibration) if head.calibration is not None else None,
                "x_head": {"base_model": engine.name, **head.as_api()},
            }
        )
    return JSONResponse({"object": "list", "models": models, "data": data})


FEATURE = Feature("info", router)
"""Health, readiness, models, metrics and the server's info."""
